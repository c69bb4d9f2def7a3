"""Decomposition helpers for the common patterns: by type, by data chunk, by priority.

A decomposer is any function from the run's input to tasks: a list (checked whole before work
starts), a generator or an async generator (streamed, with backpressure), or an async function
returning either (an LLM planner). These helpers build the usual ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import islice
from typing import Any

from ._exceptions import ConfigError, InputError
from ._task import Task

__all__ = ("by_priority", "by_type", "chunked")


def chunked(
    items: Iterable[Any],
    size: int,
    *,
    kind: str,
    priority: int = 0,
    id_prefix: str | None = None,
    **task_fields: Any,
) -> Iterator[Task]:
    """One task per chunk of `size` items: the payload is the list of the chunk's items.

    Ids are ``f"{id_prefix or kind}-{n}"`` from 0; `task_fields` go to every `Task` (tags=, ...).
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"chunked: size must be an int >= 1, got {size!r}")
    prefix = id_prefix or kind
    iterator = iter(items)
    n = 0
    while chunk := list(islice(iterator, size)):
        yield Task(kind, chunk, id=f"{prefix}-{n}", priority=priority, **task_fields)
        n += 1


def by_type(
    items: Iterable[Any],
    route: Mapping[Any, str] | Callable[[Any], str],
    *,
    field: str = "type",
    priority: int | Callable[[Any], int] = 0,
) -> Iterator[Task]:
    """One task per item, its kind chosen by the item's type.

    `route` maps a Python type to a kind (the item's class, or a base class), or maps the value of
    the item's `field` (for dict items, e.g. ``{"type": "invoice"}``) to a kind, or is a function
    from the item to its kind.
    """
    if not (callable(route) or isinstance(route, Mapping)):
        # Else a TypeError from `in` on the first item.
        raise ConfigError(
            f"by_type: route must be a mapping (type or value -> kind) or a function, got {route!r}"
        )
    for i, item in enumerate(items):
        kind = route(item) if callable(route) else _route(item, route, field)
        if kind is None:
            raise InputError(f"by_type: item {i} ({item!r:.80}) matches no route")
        prio = priority(item) if callable(priority) else priority
        yield Task(kind, item, priority=prio)


def _route(item: Any, route: Mapping[Any, str], field: str) -> str | None:
    if isinstance(item, Mapping) and field in item:
        value = item[field]
        try:
            if value in route:
                return route[value]
        except TypeError:  # an unhashable value (a list, a dict) is no route's key
            pass
    for cls in type(item).__mro__:
        if cls in route:
            return route[cls]
    return None


def by_priority(
    items: Iterable[Any],
    *,
    kind: str,
    priority: Callable[[Any], int],
) -> Iterator[Task]:
    """One task of `kind` per item, with the priority `priority(item)` gives (smaller runs first)."""
    if not callable(priority):
        raise ConfigError(f"by_priority: priority must be a function of the item, got {priority!r}")
    for item in items:
        yield Task(kind, item, priority=priority(item))
