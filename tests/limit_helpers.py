"""What the limiter tests share: a client that asks again exactly when told, a count of times in a
window, and a wake callback that counts its calls and keeps its reminders."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from orchestra._limits import Cost, Limiter


def admit_greedily(
    limiter: Limiter, count: int, *, start: float = 0.0, cost: Cost = 1
) -> list[float]:
    """One client that wants `count` admissions from `start` on and asks again exactly when told."""
    times: list[float] = []
    now = start
    while len(times) < count:
        room = limiter.reserve(now, cost)
        if room == 0.0:
            times.append(now)
            continue
        assert room > now, "a 'no' must name a later time"
        now = room
    return times


def in_window(times: Sequence[float], start: float, length: float) -> int:
    return sum(1 for t in times if start <= t < start + length)


class Counter:
    """A wake callback that counts its calls (to ask now) and keeps its reminders (to ask at)."""

    def __init__(self) -> None:
        self.calls = 0
        self.reminders: list[float] = []

    def __call__(self, at: float | None = None) -> None:
        if at is None:
            self.calls += 1
        else:
            self.reminders.append(at)
