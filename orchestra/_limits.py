"""Limits: the global limit, per-agent limits and rate limits, as one kind of object.

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

`reserve_all` reserves over several limiters at once, all or nothing. `Rate.observe(remaining, reset)`
takes a server's rate-limit headers into account (it only ever slows the meter down).

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

**Why GCRA by hand.** The well-kept rate limiters were checked first: `limits` (alisaifee) and
`token-bucket` read `time.time()` / `time.monotonic()` inside their storage, `limits` runs expiry timers,
`pyrate-limiter` keeps a log of one timestamp object per hit in integer milliseconds with a background
leaker, `throttled-py`'s GCRA reads the monotonic clock in its store, and `aiolimiter` / `asyncio-throttle`
`await` inside `acquire`. None takes `now` from the caller, answers "room at T" without sleeping, or gives
units back after the call (tokens are known only afterwards). The generic cell rate algorithm (GCRA, the
ATM traffic meter, as in brandur.org/rate-limiting) needs one float of state, so it is written here: it is
smooth by construction (60 per minute is one request per second, never a minute's budget in one burst),
and giving back or taking more is a shift of that one float.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from heapq import heappop, heappush
from typing import Any, Final, Protocol, TypeAlias, runtime_checkable

from ._config import finite
from ._exceptions import ConfigError

__all__ = (
    "REQUESTS",
    "Capacity",
    "Concurrency",
    "Cost",
    "Limiter",
    "Line",
    "Rate",
    "Waiter",
    "as_concurrency",
    "reserve_all",
)

REQUESTS: Final = "requests"
"""The unit every attempt counts 1 of unless its cost says otherwise."""

Cost: TypeAlias = float | Mapping[str, float]
"""An amount in the limiter's own unit, or a mapping of unit to amount (see the module docstring)."""

_NUMBER = (int, float)
_NO_HOLD: Final = -math.inf
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
            line = limiter.line if isinstance(limiter, _LINED) else None
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
        if isinstance(limiter, _LINED):
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
        reminded = _NO_HOLD if entry is None else entry[4]  # a reminder it has still comes
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


class _Watchers:
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


class Concurrency:
    """At most `limit` attempts at once: the global limit, an agent's limit, concurrent requests.

    Counts attempts, whatever their cost. A full limiter answers math.inf (room comes with a release;
    `watch` is told of it). Shared by everybody it is given to; not thread-safe (one event loop).
    """

    __slots__ = ("_hold", "_seen", "in_use", "limit", "line", "watchers")

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigError(f"Concurrency limit must be an int >= 1, got {limit!r}")
        self.limit = limit
        self.in_use = 0
        self._hold = _NO_HOLD
        self._seen = _NO_HOLD  # the latest time it was asked at (see `CLOCK_SLIP`)
        # Who waits for room (None until somebody watched: a release is then only the count, which
        # a dispatcher does inline).
        self.watchers: _Watchers | None = None
        self.line: Line | None = None  # who waits for room, in turn order (see `Line`)

    def _asked(self, now: float) -> None:
        """Note the time it is asked at; a hold of another clock's (see `CLOCK_SLIP`) is gone."""
        if now < self._seen - CLOCK_SLIP:
            self._hold = _NO_HOLD
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
            self.watchers = _Watchers()
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


class Rate:
    """At most `limit` units per `per` seconds, spread evenly: one unit every `per / limit` seconds.

    A generic cell rate algorithm (GCRA): one float, the loop time at which everything admitted so far
    has drained. After an idle spell at most `burst` units go at once (default 1: 60 per minute is one
    request a second, never 60 in the first second), so any window of `per` seconds sees at most
    `limit + burst` units. A single cost larger than `burst` goes only when the meter is empty, and the
    excess delays whoever comes next. Never answers math.inf: room comes with time.

    Args:
        limit: units per period (> 0).
        per: the period in seconds (> 0): `Rate(60, per=60)` is 60 requests a minute.
        unit: what it counts; read from mapping costs (`"input_tokens"`, `"output_tokens"`, ...).
        burst: units that may go at once after an idle spell (> 0; default 1).
    """

    __slots__ = (
        "_default",
        "_hold",
        "_seen",
        "_tat",
        "_watchers",
        "burst",
        "interval",
        "limit",
        "line",
        "per",
        "unit",
    )

    def __init__(
        self, limit: float, per: float = 1.0, *, unit: str = REQUESTS, burst: float = 1
    ) -> None:
        _check_positive("Rate limit", limit)
        _check_positive("Rate per", per)
        _check_positive("Rate burst", burst)
        if not isinstance(unit, str) or not unit:
            raise ConfigError(f"Rate unit must be a non-empty str, got {unit!r}")
        self.limit = limit
        self.per = per
        self.unit = unit
        self.burst = burst
        self.interval = per / limit  # seconds per unit
        self._default = 1 if unit == REQUESTS else 0
        self._tat = _NO_HOLD  # theoretical arrival time: when the meter is empty
        self._hold = _NO_HOLD
        self._seen = _NO_HOLD  # the latest time it was asked at (see `CLOCK_SLIP`)
        self._watchers: _Watchers | None = None
        self.line: Line | None = None  # who waits for room, in turn order (see `Line`)

    def amount(self, cost: Cost) -> float:
        """How many of this limiter's units `cost` is."""
        if isinstance(cost, _NUMBER):
            return cost
        return cost.get(self.unit, self._default)

    def _asked(self, now: float) -> None:
        """Note the time it is asked at; another clock's times (see `CLOCK_SLIP`) are gone: an
        empty meter."""
        if now < self._seen - CLOCK_SLIP:
            self._tat = self._hold = _NO_HOLD
            self.line = None
        self._seen = now

    def reserve(self, now: float, cost: Cost = 1) -> float:
        n = cost if isinstance(cost, _NUMBER) else cost.get(self.unit, self._default)
        self._asked(now)
        if now < self._hold:
            return self._hold
        tat = self._tat
        slack = self.burst - n
        room = tat - slack * self.interval if slack > 0 else tat
        if room > now:
            return room
        self._tat = (tat if tat > now else now) + n * self.interval
        return 0.0

    def peek(self, now: float, cost: Cost = 1) -> float:
        self._asked(now)
        if now < self._hold:
            return self._hold
        n = self.amount(cost)
        slack = self.burst - n
        room = self._tat - slack * self.interval if slack > 0 else self._tat
        return room if room > now else 0.0

    def reconcile(self, reserved: Cost, actual: Cost, now: float) -> None:
        if actual is reserved:
            return
        more = self.amount(actual) - self.amount(reserved)
        if not more:
            return
        tat = self._tat
        if more > 0:  # took too little: the debt delays whoever comes next
            self._tat = (tat if tat > now else now) + more * self.interval
            return
        if tat <= now:  # drained already: giving back changes nothing and wakes nobody
            return
        self._tat = tat + more * self.interval
        if self.line is not None and self.line.waiting:
            self.line.sooner(now)
        if self._watchers is not None and self._watchers.waiting:
            self._watchers.wake_all()

    def release(self, reserved: Cost = 1, now: float = 0.0) -> None:
        """Nothing to give back: what was sent was sent."""

    def hold_until(self, until: float) -> None:
        if until > self._hold:  # a nan never holds
            self._hold = until

    def observe(self, remaining: float, reset: float) -> None:
        """The server says only `remaining` units are left until loop time `reset` (rate-limit
        response headers): admit no more than that before `reset`. Only ever slows the meter down.

        With `remaining` 0, the next unit goes at `reset` (a 429 without Retry-After).
        """
        drained = reset - (remaining - self.burst + 1) * self.interval
        if drained > self._tat:  # a nan never moves it
            self._tat = drained

    def retune(self, limit: float, now: float) -> None:
        """Change the limit in place (its users hold this object). Units admitted and not yet
        drained stay admitted and drain at the new pace from `now`."""
        _check_positive("Rate limit", limit)
        if limit == self.limit:
            return
        interval = self.per / limit
        tat = self._tat
        if tat > now:
            self._tat = now + (tat - now) * interval / self.interval
        faster = interval < self.interval
        self.limit = limit
        self.interval = interval
        if faster and self.line is not None and self.line.waiting:
            self.line.sooner(now)

    def watch(self, wake: Callable[[], None]) -> None:
        """Room comes with time (`reserve` never says math.inf); `wake` runs on the next give-back."""
        if self._watchers is None:
            self._watchers = _Watchers()
        self._watchers.waiting[wake] = None

    def in_use(self, now: float) -> float:
        """Units admitted that have not drained yet (0 when idle)."""
        return max(0.0, self._tat - now) / self.interval

    def snapshot(self, now: float) -> dict[str, Any]:
        return {
            "type": "rate",
            "unit": self.unit,
            "limit": self.limit,
            "per": self.per,
            "burst": self.burst,
            "in_use": self.in_use(now),
            "room_at": max(now, self.peek(now, 1)),
            "held_until": self._hold if now < self._hold else None,
        }

    def __repr__(self) -> str:
        return f"Rate({self.limit!r}, per={self.per!r}, unit={self.unit!r}, burst={self.burst!r})"


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


def _check_positive(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, _NUMBER) or not finite(value) or value <= 0:
        raise ConfigError(f"{field} must be a finite number > 0, got {value!r}")


_LINED: Final = (Concurrency, Rate)  # the limiters that keep a `Line`

for _public in (Concurrency, Rate, Limiter):
    _public.__module__ = "orchestra"


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
