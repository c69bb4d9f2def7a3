"""Limits: the global limit, per-agent limits and rate limits, as one kind of object: the `Limiter`
protocol they answer, `reserve_all` over several of them, and the `Line` of askers they refused.

Every limiter answers the same five questions for the dispatcher, synchronously, with the time handed in
by the caller (the event loop's `loop.time()`, which `FakeClock` virtualises); none reads a clock, sleeps
or binds to an event loop, so one object can be given to several agents and several orchestrators and is
then one budget for all of them (as one anyio `CapacityLimiter` is):

```
reserve(now, cost)  -> 0.0              took `cost`: go
                    -> T > now          took nothing: ask again at loop time T
                    -> math.inf         took nothing: ask again when `watch`'s callback runs
reconcile(reserved, actual, now)        the call is over and its true cost known: give back or take more
release(reserved, now)                  on every exit of the attempt (a concurrency slot comes back)
hold_until(until)                       a 429 said Retry-After: no room for anybody until then
watch(wake)                             call `wake()` once, on the next release that may make room
```

`reserve_all` reserves over several limiters at once, all or nothing. The limiters are `Concurrency`
(`_concurrency.py`: attempts at once) and `Rate` (`_rate.py`: units per period); a run's budget is one
too (`_budget.py`), and so is any object that answers these questions.

**Turns.** Room that several askers wait for goes to the best of them, not to whichever asks
first. A dispatcher that reserves for a task passes its *turn* (priority, then input order) to
`reserve_all`; a refused asker joins the limiter's `Line` with its turn, the time it was told and
a `Waiter` callback, and the line, not a watcher list, calls it. A release (or units given back,
or a higher limit) calls the best waiter alone, so the first to ask is the one whose turn it is
and, in the common case, nobody asks in vain; its reservation calls the next waiter whose time
has come. The others are reminded to ask again `LAPSE` later, a timer of their own that matters
only if the best one does not come (its run paused or busy, its task cancelled): until then a
worse asker is refused and told when that chance ends. Several agents that share a rate each
wait in their own lane, woken by their own timers in no set order: the line, not the order of
the wake-ups, decides who goes. A better waiter whose time has not come (it waits for another
limiter, say) holds nobody back. A limit nobody waits on has no waiters, and an asker with no
better waiter due pays a look at the line's first entry; askers without a turn (a planner's
call, `ctx.reserve`) neither wait in line nor are held back by it, and watch as before.

Every limiter is per object: the orchestrator's `concurrency` and an agent's own limit are new objects
made from ints, private to their owner; a limiter object handed to several agents or orchestrators (one
API key, one budget) is shared by all of them, its holds and its 429s included.

**Costs.** A cost is a number or a mapping of unit to amount. A number is the amount in whatever unit the
limiter counts (so the default `1` is one request for a request rate). A mapping such as
`{"requests": 1, "input_tokens": 1200, "output_tokens": 4096}` lets each limiter read its own unit: a
unit the mapping leaves out counts 0, except `"requests"`, which counts 1 (every attempt is a request).
`Concurrency` counts attempts and ignores the cost.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from heapq import heappop, heappush
from typing import Any, Final, Protocol, TypeAlias, runtime_checkable

__all__ = (
    "CLOCK_SLIP",
    "LAPSE",
    "NO_HOLD",
    "REQUESTS",
    "Cost",
    "Limiter",
    "Line",
    "Lined",
    "Turn",
    "Waiter",
    "Watchers",
    "reserve_all",
)

REQUESTS: Final = "requests"
"""The unit every attempt counts 1 of unless its cost says otherwise."""

Cost: TypeAlias = float | Mapping[str, float]
"""An amount in the limiter's own unit, or a mapping of unit to amount (see the module docstring)."""

NO_HOLD: Final = -math.inf
"""A limiter's hold (or time last asked at) when there is none."""
# A time more than this before one a limiter has already seen is another clock's: a limiter kept
# across tests (a module-level key) saw a `FakeClock`'s virtual time, which runs ahead of the
# loop's real one, and would make the next test wait out that lead. It forgets its times instead.
# (One clock never goes back; the dispatcher's readings may, by a timer's early firing: far less.)
CLOCK_SLIP: Final = 1.0
# Seconds a waiter whose time has come keeps its turn (see `Line`): its own timer fires at that
# time, so a live one asks within a loop turn or two; one that does not ask by then has gone
# (cancelled, paused, its run busy) and the room goes to the next.
LAPSE: Final = 0.05
Turn: TypeAlias = tuple[Any, ...]
"""A waiter's place: smaller goes first (the dispatcher's is (priority, input order))."""


@runtime_checkable
class Limiter(Protocol):
    """What the dispatcher talks to. Every method is synchronous and takes the time from the caller."""

    def reserve(self, now: float, cost: Cost) -> float:
        """Take `cost` if there is room at `now` and return 0.0; else take nothing and return when to
        ask again: a loop time T > now, or math.inf (only a release makes room: see `watch`)."""
        ...

    def peek(self, now: float, cost: Cost) -> float:
        """What `reserve` would answer, taking nothing."""
        ...

    def reconcile(self, reserved: Cost, actual: Cost, now: float) -> None:
        """The call is over and cost `actual`: give back what `reserved` over-counted, or take the
        shortfall (which may push the next room into the future). `actual` 0 undoes the reservation."""
        ...

    def release(self, reserved: Cost, now: float) -> None:
        """The attempt has ended, however it ended: give back what is held only while it runs."""
        ...

    def hold_until(self, until: float) -> None:
        """No room for anybody before loop time `until` (a 429's Retry-After). Never shortens a hold."""
        ...

    def watch(self, wake: Callable[[], None]) -> None:
        """Call `wake()` once, on the next release (or give-back) that may make room."""
        ...

    def snapshot(self, now: float) -> dict[str, Any]:
        """Use, limit and the next room, for status reports."""
        ...


def reserve_all(
    limiters: Sequence[Limiter],
    now: float,
    cost: Cost,
    wake: Waiter | Callable[[], None] | None = None,
    turn: Turn | None = None,
) -> float:
    """Reserve `cost` on every limiter, or on none.

    Returns 0.0 when all took it. Otherwise gives back what the earlier ones took and returns the
    latest answer of all of them (the first time at which every one may have room; math.inf if one of
    them needs a release). Given `wake`, it then watches every limiter that answered math.inf, so a
    dispatcher that sleeps on math.inf is woken when any of them frees (it may be woken more than
    once: `wake` must be idempotent).

    Given a `turn` and `wake` (then a `Waiter`), the asker waits in line (see `Line`), known by its
    `wake`: it is refused while a better waiter whose time has come has not taken its room yet
    (the answer is then when that waiter's chance ends, or later), joins the lines of the limiters
    when refused (a limiter that keeps a line calls it from there rather than as a watcher), and
    leaves them when it reserves.
    """
    lines: list[Line] | None = None
    if turn is not None and wake is not None:
        held = 0.0
        for limiter in limiters:
            line = limiter.line if isinstance(limiter, Lined) else None
            if line is not None and line.waiting:
                lines = [line] if lines is None else [*lines, line]
                until = line.ahead(wake, turn, now)
                if until > held:
                    held = until
        if held:  # a better waiter's turn: take nothing
            room = 0.0
            blocked = []
            for limiter in limiters:
                later = limiter.peek(now, cost)
                if later == math.inf:
                    blocked.append(limiter)
                room = max(room, later)
            _wait(limiters, blocked, room or now, wake, turn)
            return max(room, held)
    taken = 0
    for limiter in limiters:
        room = limiter.reserve(now, cost)
        if room:
            break
        taken += 1
    else:
        if lines is not None and wake is not None:
            for line in lines:
                line.leave(wake, now)
        return 0.0
    for limiter in limiters[:taken]:  # the slow path: give back, then find the latest room
        limiter.reconcile(cost, 0, now)
        limiter.release(cost, now)
    blocked = [limiters[taken]] if room == math.inf else []
    for limiter in limiters[taken + 1 :]:
        later = limiter.peek(now, cost)
        if later == math.inf:
            blocked.append(limiter)
        room = max(room, later)
    if wake is not None:
        _wait(limiters, blocked, room, wake, turn)
    return room


def _wait(
    limiters: Sequence[Limiter],
    blocked: Sequence[Limiter],
    at: float,
    wake: Waiter | Callable[[], None],
    turn: Turn | None,
) -> None:
    """A refused asker waits for room: told `at`, or (math.inf) a release of one of `blocked`.
    With a turn, it waits in the lines of those that will say when room comes (every limiter, or
    the blocked ones), which call it; it watches the others, as an asker without a turn does."""
    if turn is None:
        if at == math.inf:
            for limiter in blocked:
                limiter.watch(wake)
        return
    for limiter in blocked if at == math.inf else limiters:
        if isinstance(limiter, Lined):
            line = limiter.line
            if line is None:
                line = limiter.line = Line()
            line.join(turn, at, wake)
        elif at == math.inf:
            limiter.watch(wake)


class Waiter(Protocol):
    """How a `Line` calls a waiter: with no argument, to ask again now; with a loop time, to ask
    again by then (a timer of its own; one it has that comes sooner does)."""

    def __call__(self, at: float | None = None) -> None: ...


class Line:
    """The askers one limiter refused, in turn order: who gets the room when it comes.

    A waiter is known by its `Waiter` callback (a dispatcher's, for one agent's lane of waiting
    tasks: only the lane's first task asks, so a lane waits as one, with the turn of the task that
    asked last), and has its turn and the loop time it was told to ask again (math.inf: when the
    line calls it). `ahead` answers whether a better waiter whose time has come stands before an
    asker; `leave` takes a waiter out once it has its room, and calls the next one whose time has
    come. Room that a release or a give-back makes goes to the best waiter first: `opened` and
    `sooner` call it alone, so it is the first to ask, and remind the others to ask again `LAPSE`
    later, which matters only if it does not come: a waiter that has not asked `LAPSE` after its
    time has gone, and is forgotten; nobody waits for it.

    Kept by `Concurrency` and `Rate` (made at the first refusal of an asker with a turn) and used
    by `reserve_all`; not thread-safe (one event loop).
    """

    __slots__ = ("_heap", "_n", "waiting")

    def __init__(self) -> None:
        # id(wake) -> [turn, told (loop time), entry number, weak reference to wake, reminded
        # (the loop time it was last reminded to ask again at)]. Held weakly: a limiter may
        # outlive the runs that waited on it (one API key's, kept by the process), and must not
        # keep them. An entry of `_heap` whose number is not its waiter's is stale (the waiter
        # left, or joined again with another turn). An entry found under the id of a live asker
        # is its own or a dead waiter's (ids are reused only once an object is gone).
        self.waiting: dict[int, list[Any]] = {}
        self._heap: list[tuple[Turn, int, int]] = []
        self._n = 0

    def join(self, turn: Turn, at: float, wake: Callable[..., None]) -> None:
        entry = self.waiting.get(id(wake))
        if entry is not None and entry[0] == turn and entry[3]() is wake:
            entry[1] = at
            return
        self._n += 1
        reminded = NO_HOLD if entry is None else entry[4]  # a reminder it has still comes
        self.waiting[id(wake)] = [turn, at, self._n, weakref.ref(wake), reminded]
        heappush(self._heap, (turn, self._n, id(wake)))

    def _due(self, now: float, key: int) -> list[Any] | None:
        """The best waiter if its time has come, it is not the asker known by `key` and it has
        not lapsed (stale, lapsed and forgotten ones are dropped on the way)."""
        heap = self._heap
        waiting = self.waiting
        while heap:
            _, n, first = heap[0]
            entry = waiting.get(first)
            if entry is not None and entry[2] == n:
                at = entry[1]
                if at > now or first == key:
                    return None
                if at + LAPSE > now and entry[3]() is not None:
                    return entry
                del waiting[first]
            heappop(heap)
        return None

    def ahead(self, wake: Callable[..., None], turn: Turn, now: float) -> float:
        """0.0 if `wake`'s asker, of `turn`, may take room now; else until when a better waiter
        whose time has come keeps it."""
        entry = self._due(now, id(wake))
        if entry is None or not entry[0] < turn:
            return 0.0
        until: float = entry[1] + LAPSE
        return until

    def leave(self, wake: Callable[..., None], now: float) -> None:
        """`wake`'s asker has its room: the next waiter whose time has come is told."""
        if self.waiting.pop(id(wake), None) is None:
            return
        entry = self._due(now, id(wake))
        if entry is not None:
            wake = entry[3]()
            if wake is not None:
                wake()

    def opened(self, now: float) -> None:
        """A release made room for one: the best of the waiters the line is to call is due now."""
        self._call(now, math.inf)

    def sooner(self, now: float) -> None:
        """Room may come sooner than the waiters were told (units given back, a higher limit):
        every one of them is due now; the best is called (and calls the next when it leaves)."""
        self._call(now, -math.inf)

    def _call(self, now: float, told: float) -> None:
        """The best waiter told `told` or later is due now, and called; the others so told are
        reminded to ask again `LAPSE` from now (when its turn lapses, if it does not come), at
        most once a `LAPSE`. Every one is called even if one raises: no lost wake-ups."""
        best: list[Any] | None = None
        key = 0
        for first, entry in self.waiting.items():
            if entry[1] >= told:
                if told < math.inf:
                    entry[1] = now
                if best is None or entry[0] < best[0]:
                    best, key = entry, first
        if best is None:
            return
        wake = best[3]()
        if wake is None:  # its dispatcher is gone: the next one
            del self.waiting[key]
            self._call(now, told)
            return
        best[1] = now
        later = now + LAPSE
        reminded = [
            entry
            for entry in self.waiting.values()
            if entry[1] >= told and entry[4] <= now and entry is not best
        ]
        errors: list[BaseException] = []
        try:
            wake()
        except Exception as exc:
            errors.append(exc)
        for entry in reminded:
            entry[4] = later
            other = entry[3]()
            if other is None:
                continue
            try:
                other(later)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def __len__(self) -> int:
        return len(self.waiting)


class Lined:
    """A limiter that keeps a `Line` of the askers with a turn it refused (`Concurrency`, `Rate`):
    `reserve_all` makes it at the first such refusal, and the limiter calls it when room comes."""

    __slots__ = ("line",)

    line: Line | None


class Watchers:
    """The callbacks waiting for room on one limiter; each is called once, in order, then forgotten."""

    __slots__ = ("waiting",)

    def __init__(self) -> None:
        self.waiting: dict[Callable[[], None], None] = {}

    def wake_all(self) -> None:
        waiting, self.waiting = self.waiting, {}
        errors: list[BaseException] = []
        for wake in waiting:  # every watcher is woken even if one raises: no lost wake-ups
            try:
                wake()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


Limiter.__module__ = "orchestra"
