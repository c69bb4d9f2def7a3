"""Rate: at most N units per period, spread evenly, as a limiter (requests, input or output tokens,
any counted unit): a generic cell rate algorithm.

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

from typing import TYPE_CHECKING, Any

from ._config import finite
from ._exceptions import ConfigError
from ._limits import CLOCK_SLIP, NO_HOLD, REQUESTS, Lined, Watchers

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._limits import Cost

__all__ = ("Rate",)

_NUMBER = (int, float)


class Rate(Lined):
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
        self._tat = NO_HOLD  # theoretical arrival time: when the meter is empty
        self._hold = NO_HOLD
        self._seen = NO_HOLD  # the latest time it was asked at (see `CLOCK_SLIP`)
        self._watchers: Watchers | None = None
        self.line = None  # who waits for room, in turn order (see `Line`)

    def amount(self, cost: Cost) -> float:
        """How many of this limiter's units `cost` is."""
        if isinstance(cost, _NUMBER):
            return cost
        return cost.get(self.unit, self._default)

    def _asked(self, now: float) -> None:
        """Note the time it is asked at; another clock's times (see `CLOCK_SLIP`) are gone: an
        empty meter."""
        if now < self._seen - CLOCK_SLIP:
            self._tat = self._hold = NO_HOLD
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
            self._watchers = Watchers()
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


def _check_positive(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, _NUMBER) or not finite(value) or value <= 0:
        raise ConfigError(f"{field} must be a finite number > 0, got {value!r}")


Rate.__module__ = "orchestra"
