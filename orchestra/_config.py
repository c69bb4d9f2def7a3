"""Checks of configuration values: each raises `ConfigError` naming the parameter and the value.

Configuration is checked once, where it enters (`Orchestrator(...)`, `RetryPolicy`, `BreakerPolicy`,
`Timeouts`, `@agent(...)`), so a wrong type fails there with a clear message, never later as a
`TypeError` deep in a run. `bool` is refused where a number is wanted (it is an `int` to Python, and
`concurrency=True` is always a slip), `nan` and `inf` where a finite number is.
A leaf module: it imports only `_exceptions`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ._exceptions import ConfigError
from ._output import json_text

__all__ = (
    "check_callable",
    "check_exception_types",
    "check_instance",
    "check_int",
    "check_json",
    "check_mapping",
    "check_names",
    "check_number",
    "check_sequence",
    "finite",
    "shown",
)


def finite(value: float) -> bool:
    """`math.isfinite`, False (not an OverflowError) for an int too large for a float: every
    seconds, rate and cost value becomes a float somewhere."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def shown(value: Any) -> str:
    """`value`'s repr for an error message: at most 200 characters, and never an error of its own
    (a repr that raises would replace the clear error with its own)."""
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    if len(text) > 200:
        text = text[:197] + "..."
    return text


def _fail(name: str, wanted: str, value: Any) -> ConfigError:
    return ConfigError(f"{name} must be {wanted}, got {shown(value)}")


def check_int(name: str, value: Any, *, minimum: int | None = 1, optional: bool = False) -> None:
    """`value` is an int >= `minimum` (not a bool, not a float), or None when `optional`."""
    if value is None and optional:
        return
    if (
        type(value) is bool
        or not isinstance(value, int)
        or (minimum is not None and value < minimum)
    ):
        wanted = ("an int" if minimum is None else f"an int >= {minimum}") + (
            " or None" if optional else ""
        )
        raise _fail(name, wanted, value)


def check_number(
    name: str,
    value: Any,
    *,
    minimum: float = 0.0,
    maximum: float | None = None,
    positive: bool = False,
    optional: bool = False,
) -> None:
    """`value` is a finite int or float in [`minimum`, `maximum`] (> `minimum` when `positive`),
    or None when `optional`. Refused: bools, strings, nan and inf."""
    if value is None and optional:
        return
    ok = (
        type(value) is not bool
        and isinstance(value, int | float)
        and finite(value)
        and (value > minimum if positive else value >= minimum)
        and (maximum is None or value <= maximum)
    )
    if not ok:
        if maximum is not None:
            wanted = f"a number in {'(' if positive else '['}{minimum:g}, {maximum:g}]"
        else:
            wanted = f"a finite number {'>' if positive else '>='} {minimum:g}"
        raise _fail(name, wanted + (" or None" if optional else ""), value)


def check_callable(name: str, value: Any, *, optional: bool = True) -> None:
    """`value` is callable, or None when `optional`."""
    if value is None and optional:
        return
    if not callable(value):
        raise _fail(name, "callable" + (" or None" if optional else ""), value)


def check_instance(name: str, value: Any, cls: type, *, optional: bool = True) -> None:
    """`value` is an instance of `cls`, or None when `optional`."""
    if value is None and optional:
        return
    if not isinstance(value, cls):
        raise _fail(name, f"a {cls.__name__}" + (" or None" if optional else ""), value)


def check_mapping(name: str, value: Any, *, optional: bool = True) -> None:
    """`value` is a mapping with string keys (kinds or names), or None when `optional`."""
    if value is None and optional:
        return
    if not isinstance(value, Mapping):
        raise _fail(
            name, "a mapping (a dict of kind to value)" + (" or None" if optional else ""), value
        )
    for key in value:
        if not isinstance(key, str) or not key:
            raise _fail(f"a key of {name}", "a non-empty string", key)


def check_sequence(name: str, value: Any) -> None:
    """`value` is a list or tuple (not a string, not None)."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise _fail(name, "a list", value)


def check_names(name: str, value: Any) -> None:
    """`value` is a non-empty list of non-empty strings (a lone string is refused: it is a slip
    for a list of one)."""
    if (
        isinstance(value, str | bytes)
        or not isinstance(value, Sequence | set | frozenset)
        or not value
    ):
        raise _fail(name, "a non-empty list of names", value)
    for item in value:
        if not isinstance(item, str) or not item:
            raise _fail(name, "a list of non-empty strings", value)


def check_exception_types(name: str, value: Any) -> tuple[type[BaseException], ...]:
    """`value` as a tuple of exception classes: one class, or a list, tuple or set of them."""
    if isinstance(value, type):
        value = (value,)
    if isinstance(value, str | bytes) or not isinstance(value, Sequence | set | frozenset):
        raise _fail(name, "a tuple of exception classes", value)
    for item in value:
        if not (isinstance(item, type) and issubclass(item, BaseException)):
            raise _fail(name, "a tuple of exception classes", value)
    return tuple(value)


def check_json(name: str, value: Any) -> None:
    """`value` serialises to JSON, as a store that persists it writes it."""
    try:
        json_text(value)
    except ValueError as exc:
        raise _fail(name, f"JSON-serialisable ({exc})", value) from None
