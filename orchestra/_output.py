"""Outputs are the agent's: what JSON can say of them, for a result's dump and for a store.

In memory an output is kept as the agent returned it (an object, a numpy array, an iterator): the
runtime never reads, copies or refuses it. JSON comes in at two places only:

- `jsonable(value)`: what `RunResult.model_dump_json()` (and `orchestra run`'s JSON lines) write of
  an output: JSON as pydantic writes it, and what JSON cannot hold (an object, an array, an
  iterator, bytes that are not UTF-8, a container that holds itself) as its repr. An iterator is
  never iterated: pydantic would write it as a list and leave it consumed, the agent's values gone.
- `stored_json(output, task_id, agent)`: the JSON text a store that persists outputs keeps, or
  `InvalidOutput` naming the type it cannot keep (an iterator is refused, never stored as the `[]`
  pydantic would make of it). The store raises it where the attempt ends, so it fails that attempt.
- `json_value(text)`: what JSON text a store kept reads back as (a worker's claimed payload).

A leaf module: it imports only `_exceptions`, pydantic_core and the standard library.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import NoneType
from typing import Any, Final

from pydantic_core import from_json, to_json, to_jsonable_python

from ._exceptions import InvalidOutput

__all__ = ("json_text", "json_value", "jsonable", "safe_repr", "stored_json", "type_name")

_SCALARS: Final = frozenset((str, int, float, bool, NoneType))


class _Unstorable(Exception):
    """What `_walk` found that JSON cannot hold without reading or changing it."""

    def __init__(self, value: Any, why: str) -> None:
        super().__init__(why)
        self.value = value
        self.why = why


def type_name(value: Any) -> str:
    """`value`'s type as a user reads it: ``map``, ``numpy.ndarray``, ``tests.Draft``."""
    cls = type(value)
    module = getattr(cls, "__module__", "")
    name = getattr(cls, "__qualname__", "object")
    return name if module in ("builtins", "", None) else f"{module}.{name}"


def safe_repr(value: Any) -> str:
    """`repr(value)`, or a stand-in naming its type when its `__repr__` raises."""
    try:
        return repr(value)
    except Exception:
        return f"<{type_name(value)} object (its repr failed)>"


def jsonable(value: Any) -> Any:
    """`value` as plain JSON values, with what JSON cannot hold as its repr (module docstring).
    Never raises, never reads an iterator, never changes `value`."""
    try:
        return to_jsonable_python(_walk(value, set(), False), fallback=safe_repr)
    except Exception:  # something pydantic refuses deep inside an object of its own kind
        return safe_repr(value)


def json_text(value: Any) -> str:
    """`value`'s JSON text, or `ValueError` saying what in it JSON cannot hold (an iterator, which
    it never reads, included)."""
    if value is None:  # (the output of an agent that returns nothing: no walk, no call)
        return "null"
    try:
        _walk(value, set(), True)
        return to_json(value).decode()
    except _Unstorable as exc:
        found = exc.value
        detail = exc.why if found is value else f"it holds {_a(type_name(found))}: {exc.why}"
    except Exception as exc:
        detail = str(exc).removeprefix("Error serializing to JSON: ")
    raise ValueError(detail)


def stored_json(output: Any, task_id: str, agent: str | None) -> str:
    """The JSON text of `output` for a store that persists it, or `InvalidOutput` naming the type
    it cannot keep."""
    try:
        return json_text(output)
    except ValueError as exc:
        detail = str(exc)
    who = f"agent {agent!r}" if agent is not None else "it"
    raise InvalidOutput(
        f"task {task_id!r}: {who} returned {_a(type_name(output))} that cannot be stored as JSON "
        f"({detail}); a store keeps outputs as JSON: return lists, dicts, strings, numbers or a "
        "pydantic model"
    )


def json_value(text: str) -> Any:
    """The value of JSON `text`, as `json.loads` reads it. pydantic_core's parser reads a small
    document in a tenth of the time (one call into Rust, where `json.loads` runs a Python
    decoder around its scanner: most of a no-op task's payload cost on a worker); it refuses
    what `json.loads` takes, a lone surrogate escape, which that then reads."""
    try:
        return from_json(text)
    except ValueError:
        return json.loads(text)


def _a(name: str) -> str:
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


def _walk(value: Any, path: set[int], strict: bool) -> Any:
    """`value` with its iterators, self-holding containers and non-UTF-8 bytes replaced by their
    reprs (or, `strict`, `_Unstorable` raised for the first one). The containers pydantic writes
    element by element are walked; what is unchanged is returned as is, not copied."""
    cls = type(value)
    if cls in _SCALARS:
        return value
    if isinstance(value, dict | list | tuple | set | frozenset):
        if id(value) in path:
            if strict:
                raise _Unstorable(value, "it holds itself")
            return safe_repr(value)
        path.add(id(value))
        try:
            if isinstance(value, dict):
                return _walk_dict(value, path, strict)
            items = list(value)
            walked = [v if type(v) in _SCALARS else _walk(v, path, strict) for v in items]
            if all(a is b for a, b in zip(walked, items, strict=True)):
                return value
            return walked
        finally:
            path.discard(id(value))
    if isinstance(value, bytes | bytearray):
        try:
            value.decode()
        except UnicodeDecodeError:
            if strict:
                raise _Unstorable(value, "bytes that are not UTF-8") from None
            return safe_repr(value)
        return value
    if isinstance(value, Iterator):
        if strict:
            raise _Unstorable(value, f"{_a(type_name(value))} is an iterator: return a list of it")
        return safe_repr(value)
    return value


def _walk_dict(value: dict[Any, Any], path: set[int], strict: bool) -> Any:
    if strict and not all(type(key) is str for key in value):
        _check_keys(value)
    out: dict[Any, Any] | None = None
    for n, (key, item) in enumerate(value.items()):
        new_key = key
        if isinstance(key, frozenset):  # pydantic refuses it as a key, even with a fallback
            if strict:
                raise _Unstorable(key, f"a {type_name(key)} cannot be an object's key")
            new_key = safe_repr(key)
        new = item if type(item) in _SCALARS else _walk(item, path, strict)
        if out is None:
            if new is item and new_key is key:
                continue
            out = dict(list(value.items())[:n])  # the unchanged items before the first change
        out[new_key] = new
    return value if out is None else out


def _check_keys(value: dict[Any, Any]) -> None:
    """Raise `_Unstorable` if two keys of `value` are one key in JSON (``1`` and ``"1"``), which
    would keep one of their values and drop the other without a word."""
    names: dict[Any, Any] = {}
    for key in value:
        name = key if type(key) is str else _key_name(key)
        if name in names:
            raise _Unstorable(
                value,
                f"its keys {safe_repr(names[name])} and {safe_repr(key)} are both {name!r} in JSON",
            )
        names[name] = key


def _key_name(key: Any) -> Any:
    """The object key JSON writes for `key` (pydantic's: ``1`` -> ``"1"``, ``True`` -> ``"true"``)."""
    try:
        return next(iter(to_jsonable_python({key: None})))
    except Exception:  # a key JSON cannot write at all: `to_json` says so
        return key
