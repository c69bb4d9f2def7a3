"""Concurrency: at most N attempts at once, as a limiter (the global limit, an agent's limit,
concurrent requests), and `Capacity`, the orchestrator-wide limit its concurrent runs share."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ._exceptions import ConfigError
from ._limits import CLOCK_SLIP, NO_HOLD, Lined, Watchers

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._limits import Cost

__all__ = ("Capacity", "Concurrency", "as_concurrency")


class Concurrency(Lined):
    """At most `limit` attempts at once: the global limit, an agent's limit, concurrent requests.

    Counts attempts, whatever their cost. A full limiter answers math.inf (room comes with a release;
    `watch` is told of it). Shared by everybody it is given to; not thread-safe (one event loop).
    """

    __slots__ = ("_hold", "_seen", "in_use", "limit", "watchers")

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigError(f"Concurrency limit must be an int >= 1, got {limit!r}")
        self.limit = limit
        self.in_use = 0
        self._hold = NO_HOLD
        self._seen = NO_HOLD  # the latest time it was asked at (see `CLOCK_SLIP`)
        # Who waits for room (None until somebody watched: a release is then only the count, which
        # a dispatcher does inline).
        self.watchers: Watchers | None = None
        self.line = None  # who waits for room, in turn order (see `Line`)

    def _asked(self, now: float) -> None:
        """Note the time it is asked at; a hold of another clock's (see `CLOCK_SLIP`) is gone."""
        if now < self._seen - CLOCK_SLIP:
            self._hold = NO_HOLD
            self.line = None
        self._seen = now

    def reserve(self, now: float, cost: Cost = 1) -> float:
        self._asked(now)
        if self.in_use < self.limit and now >= self._hold:
            self.in_use += 1
            return 0.0
        return self._hold if now < self._hold else math.inf

    def peek(self, now: float, cost: Cost = 1) -> float:
        self._asked(now)
        if now < self._hold:
            return self._hold
        return 0.0 if self.in_use < self.limit else math.inf

    def reconcile(self, reserved: Cost, actual: Cost, now: float) -> None:
        """Nothing to true up: a slot is held for the whole attempt and given back by `release`."""

    def release(self, reserved: Cost = 1, now: float = 0.0) -> None:
        if self.in_use <= 0:
            raise RuntimeError(f"{self!r}: released more slots than were reserved")
        self.in_use -= 1
        if self.line is not None and self.line.waiting:
            self.line.opened(now)
        if self.watchers is not None and self.watchers.waiting:
            self.watchers.wake_all()

    def hold_until(self, until: float) -> None:
        if until > self._hold:  # a nan never holds
            self._hold = until

    def watch(self, wake: Callable[[], None]) -> None:
        if self.watchers is None:
            self.watchers = Watchers()
        self.watchers.waiting[wake] = None

    def snapshot(self, now: float) -> dict[str, Any]:
        return {
            "type": "concurrency",
            "limit": self.limit,
            "in_use": self.in_use,
            "room_at": max(now, self.peek(now)),
            "held_until": self._hold if now < self._hold else None,
            "watchers": len(self.watchers.waiting) if self.watchers is not None else 0,
        }

    def __repr__(self) -> str:
        return f"Concurrency(limit={self.limit}, in_use={self.in_use})"


def as_concurrency(value: int | Concurrency, field: str) -> Concurrency:
    """`Orchestrator(concurrency=100)` or `concurrency=Concurrency(100)` (shared): always a limiter.

    An int makes a new limiter of one's own; a `Concurrency` is used as it is, shared with whoever else
    was given it. Anything else raises ConfigError naming `field`.
    """
    if isinstance(value, Concurrency):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{field} must be an int >= 1 or a Concurrency, got {value!r}")
    return Concurrency(value)


class Capacity:
    """The orchestrator-wide concurrency limit, shared by its concurrent runs (and, when it was
    given as a `Concurrency` object, by every orchestrator it was given to).

    The check on the hot path reads the limiter's counter directly (`in_use < limit`, as
    `Concurrency.reserve` does) and gives the slot back through `release`, which wakes the
    watchers of other orchestrators."""

    __slots__ = ("blocked", "limit", "limiter", "runs")

    def __init__(self, limiter: Concurrency) -> None:
        self.limiter = limiter
        self.limit = limiter.limit
        self.blocked = False  # a worker found the limit reached: wake the other runs on release
        self.runs: list[Any] = []  # the dispatchers of its runs


Concurrency.__module__ = "orchestra"
