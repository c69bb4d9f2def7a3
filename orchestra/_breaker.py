"""Circuit breaker: one per agent, so a failing agent stops getting tasks for a while.

closed ─(N consecutive failures, or a failure rate over a window)─▶ open ─(cool-down)─▶ half_open
half_open ─(the single probe succeeds)─▶ closed;  half_open ─(the probe fails)─▶ open.

While a breaker is open the dispatcher sends the agent's tasks straight to the next agent of their
fallback chain. Written by hand (aiobreaker and pybreaker wrap a call and raise; here the dispatcher
asks before it picks an agent and must not call it at all) and small: a state, two counters, a window.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Final, Literal

from ._config import check_int, check_number
from ._limits import CLOCK_SLIP

__all__ = ("Breaker", "BreakerPolicy", "BreakerState")

BreakerState = Literal["closed", "open", "half_open"]
CLOSED: Final = "closed"
OPEN: Final = "open"
HALF_OPEN: Final = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    """When an agent's breaker opens and for how long.

    Args:
        failures: consecutive failed attempts that open the breaker.
        cooldown: seconds the breaker stays open before one probe is let through.
        failure_rate: also open when at least this fraction of the last `window` attempts failed.
        window: how many recent attempts `failure_rate` looks at (it waits for a full window).
    """

    failures: int = 5
    cooldown: float = 30.0
    failure_rate: float | None = None
    window: int = 20

    def __post_init__(self) -> None:
        check_int("BreakerPolicy.failures", self.failures)
        check_number("BreakerPolicy.cooldown", self.cooldown)
        if self.failure_rate is not None:
            check_number(
                "BreakerPolicy.failure_rate", self.failure_rate, maximum=1.0, positive=True
            )
        check_int("BreakerPolicy.window", self.window)


class Breaker:
    """The state of one agent's breaker. Every method takes the current time; none sleeps.

    Without a policy (`Orchestrator(breaker=None)`) it never opens: failures are not counted."""

    __slots__ = ("consecutive", "opened_at", "policy", "probing", "recent", "reopens_at", "state")

    def __init__(self, policy: BreakerPolicy | None) -> None:
        self.policy = policy
        self.state: BreakerState = CLOSED
        self.consecutive = 0
        self.opened_at = 0.0
        # When an open breaker lets a probe through: one float, both for "may it take a task
        # now" and for "when may it": computed twice (`now - opened_at >= cooldown` and
        # `opened_at + cooldown`), rounding made them disagree, and a task woken at the second
        # found the first still false and was woken again at the same instant, forever.
        self.reopens_at = 0.0
        self.probing = False
        self.recent: deque[bool] | None = (
            deque(maxlen=policy.window)
            if policy is not None and policy.failure_rate is not None
            else None
        )

    def available(self, now: float) -> bool:
        """Whether the agent may take a task now (without reserving the half-open probe)."""
        if self.state is CLOSED:
            return True
        if self.state is OPEN:
            return now >= self.reopens_at or now < self.opened_at - CLOCK_SLIP
        return not self.probing

    def reopens_in(self, now: float) -> float:
        """Seconds until an open breaker lets a probe through (0 when it would now)."""
        return self.recovers_at(now) - now

    def recovers_at(self, now: float) -> float:
        """When an open breaker lets a probe through (`now` when it would now): `available` is
        true then. A breaker opened by another clock (more than `CLOCK_SLIP` ahead: a `FakeClock`
        of an earlier test, on an orchestrator kept across tests) has cooled down."""
        if self.state is not OPEN or now < self.opened_at - CLOCK_SLIP:
            return now
        reopens_at = self.reopens_at
        return reopens_at if reopens_at > now else now

    def on_dispatch(self, now: float) -> BreakerState | None:
        """Call when a task is sent to the agent; returns the new state if it changed."""
        if self.state is CLOSED:
            return None
        if self.state is OPEN:  # the cool-down is over (`available` said so): this is the probe
            self.state = HALF_OPEN
            self.probing = True
            return HALF_OPEN
        self.probing = True
        return None

    def on_success(self) -> BreakerState | None:
        if self.state is OPEN:
            return None  # a call sent before the breaker opened: only the probe may close it
        self.consecutive = 0
        if self.recent is not None:
            self.recent.append(True)
        if self.state is CLOSED:
            return None
        self.state = CLOSED
        self.probing = False
        if self.recent is not None:
            self.recent.clear()
        return CLOSED

    def on_failure(self, now: float) -> BreakerState | None:
        if self.policy is None:
            return None  # turned off
        self.consecutive += 1
        if self.state is HALF_OPEN:
            return self._open(now)
        if self.state is OPEN:
            return None
        if self.consecutive >= self.policy.failures:
            return self._open(now)
        recent = self.recent
        if recent is not None:
            recent.append(False)
            if len(recent) == recent.maxlen:
                rate = recent.count(False) / len(recent)
                if rate >= self.policy.failure_rate:  # type: ignore[operator]
                    return self._open(now)
        return None

    def on_abandon(self) -> None:
        """The probe ended without a verdict (cancelled): let another probe through."""
        self.probing = False

    def _open(self, now: float) -> BreakerState:
        self.state = OPEN
        self.opened_at = now
        self.reopens_at = now + self.policy.cooldown  # type: ignore[union-attr]
        self.probing = False
        return OPEN
