"""Circuit breaker: one per agent, for outages, not for bugs.

closed ─(a failure rate over a time window)─▶ open ─(cool-down)─▶ half_open
half_open ─(the probe ends without an outage)─▶ closed;  half_open ─(the probe fails)─▶ open,
for a cool-down twice as long (up to the policy's maximum).

Only *health* failures count (`is_outage`): what says the service behind the agent is unwell — an
attempt timeout, a connection error, a 5xx / 529 answer, an exception the agent raises to say so.
A bug in the agent's own code (`ValueError`, `KeyError`, a validation error) fails its attempt and
is retried, but says nothing of the service: a few bad payloads cost those payloads, not the run.

The rate is over the tasks that called the agent in the last `window` seconds, each task once (its
own retries do not make an outage of one bad payload): the failing tasks are kept by id, the calls
that succeeded are read off the agent's success counter, sampled at each failure, so a success
costs the breaker nothing while it is closed.

While a breaker is open the dispatcher sends the agent's tasks to the next agent of their fallback
chain; a task with nowhere else to go waits for the probe, and each failed probe counts as one of
its attempts there (`CircuitOpen`). Written by hand (aiobreaker and pybreaker wrap a call and
raise; here the dispatcher asks before it picks an agent and must not call it at all).
"""

from __future__ import annotations

import socket
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Final, Literal

from ._config import check_exception_types, check_int, check_number
from ._exceptions import RateLimited, RetryableError, VerificationError
from ._failure import http_status
from ._limits import CLOCK_SLIP

__all__ = ("Breaker", "BreakerPolicy", "BreakerState", "is_outage")

BreakerState = Literal["closed", "open", "half_open"]
CLOSED: Final = "closed"
OPEN: Final = "open"
HALF_OPEN: Final = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    """When an agent's breaker opens and for how long.

    Args:
        failure_rate: open when at least this fraction of the tasks that called the agent in the
            last `window` seconds failed with a health failure (a task's retries count once).
        min_calls: the fewest tasks in the window before the rate is judged.
        window: seconds of calls the rate looks at.
        cooldown: seconds the breaker stays open before one probe is let through, at first.
        max_cooldown: each failed probe doubles the cool-down, up to this (None: 30 s, or
            `cooldown` when longer); closing resets it.
        outages: exception types that also say the service is unwell, beyond the built-in ones
            (attempt timeouts, connection errors, 5xx / 529 answers, `RetryableError`).
    """

    failure_rate: float = 0.5
    min_calls: int = 5
    window: float = 10.0
    cooldown: float = 1.0
    max_cooldown: float | None = None
    outages: tuple[type[BaseException], ...] = ()

    def __post_init__(self) -> None:
        check_number("BreakerPolicy.failure_rate", self.failure_rate, maximum=1.0, positive=True)
        check_int("BreakerPolicy.min_calls", self.min_calls)
        check_number("BreakerPolicy.window", self.window, positive=True)
        check_number("BreakerPolicy.cooldown", self.cooldown)
        check_number(
            "BreakerPolicy.max_cooldown", self.max_cooldown, minimum=self.cooldown, optional=True
        )
        types = check_exception_types("BreakerPolicy.outages", self.outages)
        object.__setattr__(self, "outages", types)

    @property
    def longest(self) -> float:
        """The longest cool-down: `max_cooldown`, or its default."""
        if self.max_cooldown is not None:
            return self.max_cooldown
        return max(self.cooldown, 30.0)


class Breaker:
    """The state of one agent's breaker. Every method takes the current time; none sleeps.

    Without a policy (`Orchestrator(breaker=None)`) it never opens: failures are not counted."""

    __slots__ = (
        "cooldown",
        "failing",
        "opened_at",
        "opens",
        "policy",
        "probing",
        "reopens_at",
        "samples",
        "state",
    )

    def __init__(self, policy: BreakerPolicy | None) -> None:
        self.policy = policy
        self.state: BreakerState = CLOSED
        self.opened_at = 0.0
        self.opens = 0  # how many times it opened (a failed probe included)
        self.cooldown = 0.0 if policy is None else policy.cooldown  # the current one
        # When an open breaker lets a probe through: one float, both for "may it take a task
        # now" and for "when may it": computed twice (`now - opened_at >= cooldown` and
        # `opened_at + cooldown`), rounding made them disagree, and a task woken at the second
        # found the first still false and was woken again at the same instant, forever.
        self.reopens_at = 0.0
        self.probing = False
        # The tasks whose last call failed with a health failure in the window, by id, oldest
        # first (a task failing again moves to the end), with the time of that failure.
        self.failing: OrderedDict[str, float] = OrderedDict()
        # (time, the agent's successes so far) at each health failure in the window, and the
        # newest one before it: the successes in the window are the count now less the first.
        self.samples: deque[tuple[float, int]] = deque()

    @property
    def health_failures(self) -> int:
        """How many tasks failed with a health failure in the window (while closed)."""
        return len(self.failing)

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

    def on_success(self, probe: bool) -> BreakerState | None:
        """An attempt ended without a health failure; `probe`: it was sent while the breaker was
        not closed (it is the probe). Only the probe's closes the breaker: a call sent before it
        opened says nothing of now, even when it ends while the probe is out. (While closed,
        successes are not told: `on_failure` reads them off the agent's counter.)"""
        if self.state is not HALF_OPEN or not probe:
            return None
        self.state = CLOSED
        self.probing = False
        if self.policy is not None:
            self.cooldown = self.policy.cooldown
        return CLOSED

    def on_failure(
        self, now: float, task_id: str, successes: int, probe: bool = False
    ) -> BreakerState | None:
        """A health failure of task `task_id`'s attempt; `successes` is the agent's count of
        calls that succeeded so far; `probe`: the attempt is the probe (see `on_success`).
        Returns the new state if it changed."""
        policy = self.policy
        if policy is None:
            return None  # turned off
        if self.state is not CLOSED:
            if self.state is HALF_OPEN and probe:
                return self._open(now, min(self.cooldown * 2, policy.longest))
            # A call sent before it opened: it says nothing of now, and the probe, still out
            # when the breaker half-opened, is the verdict.
            return None
        failing = self.failing
        failing[task_id] = now
        failing.move_to_end(task_id)
        horizon = now - policy.window
        while failing[next(iter(failing))] < horizon:  # drop what left the window: O(1) each
            failing.popitem(last=False)
        samples = self.samples
        samples.append((now, successes))
        while len(samples) > 1 and samples[1][0] <= horizon:
            samples.popleft()
        failed = len(failing)
        calls = failed + successes - samples[0][1]
        if calls >= policy.min_calls and failed >= policy.failure_rate * calls:
            return self._open(now, policy.cooldown)
        return None

    def on_abandon(self) -> None:
        """The probe ended without a verdict (cancelled): let another probe through."""
        self.probing = False

    def _open(self, now: float, cooldown: float) -> BreakerState:
        self.state = OPEN
        self.opens += 1
        self.opened_at = now
        self.cooldown = cooldown
        self.reopens_at = now + cooldown
        self.probing = False
        self.failing.clear()
        self.samples.clear()
        return OPEN


def is_outage(exc: BaseException, policy: BreakerPolicy | None) -> bool:
    """Whether `exc`, raised by an agent's call, says the service behind the agent is unwell: an
    attempt timeout, a connection error, a 5xx or 529 answer (or 408), a `RetryableError` the
    agent raises (not a rate limit's, not a verifier's), or a type the policy lists. Anything
    else — a `ValueError`, a `KeyError`, a validation error, a 4xx — is the agent's own failure.
    Never raises."""
    if isinstance(exc, RetryableError):
        return not isinstance(exc, RateLimited | VerificationError)
    if policy is not None and policy.outages and isinstance(exc, policy.outages):
        return True
    if isinstance(exc, ConnectionError | TimeoutError | socket.gaierror):
        return True
    status = http_status(exc)
    if status is not None:
        return status >= 500 or status == 408
    return _is_transport_error(exc)


def _is_transport_error(exc: BaseException) -> bool:
    # The HTTP clients' own "could not reach the service" errors: anthropic's (a timeout is one)
    # and httpx's, looked up through sys.modules (either exists only once it was imported).
    for module, name in (("anthropic", "APIConnectionError"), ("httpx", "TransportError")):
        found = sys.modules.get(module)
        error = getattr(found, name, None)
        if isinstance(error, type) and isinstance(exc, error):
            return True
    return False
