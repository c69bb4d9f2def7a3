"""Retry policy: how many attempts, how long between them, and which errors deserve another try.

Backoff is `min(cap, base * 2**n)` for the n-th retry (n from 0), with jitter; a `Retry-After` hint from
the agent (HTTP 429/529 headers, or `RetryableError(retry_after=...)`) wins when it is longer. The
jitter draws from the run's seeded `random.Random`, so a schedule can be checked exactly in tests.

Written here rather than taken from tenacity or backoff: those wrap one call in a loop that sleeps,
and a task waiting for its retry here must not hold a dispatcher's runner or a concurrency slot;
the schedule is one formula, the classification is orchestra's own.
"""

from __future__ import annotations

import email.utils
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from ._config import check_exception_types, check_int, check_number, finite, shown
from ._exceptions import ConfigError, InputError, PermanentError, RetryableError
from ._failure import http_status, response_header

if TYPE_CHECKING:
    from random import Random

__all__ = ("RetryPolicy", "Timeouts", "backoff", "classify")

Jitter = Literal["full", "equal", "none"]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a task is retried on one agent before it moves down the fallback chain.

    Args:
        max_attempts: attempts per agent, counting the first try (1 means no retry).
        base: seconds before the first retry, doubled for each further one.
        cap: the longest backoff, in seconds.
        jitter: "full" (uniform in [0, backoff]), "equal" (half fixed, half random) or "none".
        retryable: extra exception types to retry, beyond the built-in classification.
        permanent: extra exception types never to retry.
    """

    max_attempts: int = 3
    base: float = 0.5
    cap: float = 30.0
    jitter: Jitter = "full"
    retryable: tuple[type[BaseException], ...] = ()
    permanent: tuple[type[BaseException], ...] = ()

    def __post_init__(self) -> None:
        check_int("RetryPolicy.max_attempts", self.max_attempts)
        check_number("RetryPolicy.base", self.base)
        check_number("RetryPolicy.cap", self.cap)
        if self.jitter not in ("full", "equal", "none"):
            raise ConfigError(
                f"RetryPolicy.jitter must be 'full', 'equal' or 'none', got {self.jitter!r}"
            )
        # A frozen dataclass: the normalised tuples are set the way dataclasses itself sets fields.
        for name in ("retryable", "permanent"):
            types = check_exception_types(f"RetryPolicy.{name}", getattr(self, name))
            object.__setattr__(self, name, types)


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Default timeouts in seconds; None means no limit.

    Args:
        attempt: one agent call, alone (waiting for a slot or a rate limit is not part of it).
        task: everything from ready to done: every attempt and wait together. `Task(timeout=...)` wins.
        run: the whole run; when it passes, the run ends with what finished.
    """

    attempt: float | None = None
    task: float | None = None
    run: float | None = None

    def __post_init__(self) -> None:
        for name in ("attempt", "task", "run"):
            check_number(f"Timeouts.{name}", getattr(self, name), positive=True, optional=True)

    @classmethod
    def of(cls, value: Timeouts | Mapping[str, float | None] | None) -> Timeouts:
        """Accept a `Timeouts`, a mapping such as ``{"attempt": 60, "task": 300}``, or None."""
        if value is None:
            return cls()
        if isinstance(value, Timeouts):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"timeouts must be a Timeouts, a mapping such as {{'attempt': 60}} or None, "
                f"got {shown(value)}"
            )
        unknown = [k for k in value if k not in ("attempt", "task", "run")]
        if unknown:
            raise ConfigError(
                f"timeouts has unknown keys {sorted(map(str, unknown))}; use 'attempt', 'task' or 'run'"
            )
        return cls(**value)


def backoff(
    policy: RetryPolicy, retry: int, rng: Random, retry_after: float | None = None
) -> float:
    """Seconds to wait before retry number `retry` (0 for the first retry)."""
    delay = min(policy.cap, policy.base * 2.0 ** min(retry, 64))  # 2**1024 overflows a float
    if policy.jitter == "full":
        delay = rng.uniform(0.0, delay)
    elif policy.jitter == "equal":
        delay = delay / 2 + rng.uniform(0.0, delay / 2)
    if retry_after is not None and retry_after > delay:
        return retry_after
    return delay


_RETRYABLE_STATUS = frozenset((408, 409, 425, 429))

MAX_RETRY_AFTER: Final = 3600.0
"""The longest wait a server's `Retry-After` (or `RetryableError(retry_after=)`) may ask for, in
seconds; a longer one is cut to it (a task whose deadline comes first moves on instead)."""


def classify(exc: BaseException, policy: RetryPolicy) -> tuple[bool, float | None]:
    """Whether `exc` deserves another attempt, and the server's Retry-After hint in seconds.

    In this order: `RetryableError` is retried and `PermanentError`, `InputError`, `ConfigError`
    are not; then the policy's own `retryable` / `permanent` types; then an HTTP response's
    `x-should-retry: true|false` header, which the API sets to say it itself; then the status:
    408/409/425/429 and every 5xx (529 "overloaded" included) are retried, other statuses are not,
    except anthropic's `APIResponseValidationError` (a 200 whose body failed the client's
    validation: a glitch, retried). Pydantic validation errors are permanent; any other exception
    is retried. Never raises, whatever `exc` does when asked about itself.
    """
    if isinstance(exc, RetryableError):
        return True, sane_retry_after(exc.retry_after)
    if isinstance(exc, PermanentError | InputError | ConfigError):
        return False, None
    if policy.permanent and isinstance(exc, policy.permanent):
        return False, None
    if policy.retryable and isinstance(exc, policy.retryable):
        return True, None
    status = http_status(exc)
    if status is not None:
        should_retry = (response_header(exc, "x-should-retry") or "").strip().lower()
        if should_retry == "false":
            return False, None
        if (
            should_retry == "true"
            or status in _RETRYABLE_STATUS
            or status >= 500
            or _is_response_validation_error(exc)
        ):
            return True, retry_after_from(exc)
        return False, None
    if _is_validation_error(exc):
        return False, None
    return True, None


def _is_validation_error(exc: BaseException) -> bool:
    # pydantic is imported by the package anyway; the lookup through sys.modules keeps this leaf light.
    pydantic = sys.modules.get("pydantic")
    return pydantic is not None and isinstance(exc, pydantic.ValidationError)


def _is_response_validation_error(exc: BaseException) -> bool:
    # Looked up the same way: an anthropic error can only exist once anthropic was imported.
    anthropic = sys.modules.get("anthropic")
    error = getattr(anthropic, "APIResponseValidationError", None)
    return error is not None and isinstance(exc, error)


def retry_after_from(exc: BaseException) -> float | None:
    """The `retry-after-ms` / `retry-after` header of an HTTP error's response, in seconds.

    Seconds (a float is accepted) or an HTTP date; garbage (``"soon"``, blank, negative, nan, inf)
    gives None, a date in the past 0, and a wait longer than `MAX_RETRY_AFTER` is cut to it.
    Never raises.
    """
    millis = _number(response_header(exc, "retry-after-ms"))
    if millis is not None:
        return sane_retry_after(millis / 1000)
    value = response_header(exc, "retry-after")
    if value is None:
        return None
    seconds = _number(value)
    if seconds is not None:
        return sane_retry_after(seconds)
    when = email.utils.parsedate_tz(value)  # None for anything that is not a date
    if when is None:
        return None
    try:
        return sane_retry_after(max(0.0, email.utils.mktime_tz(when) - time.time()))
    except (OverflowError, ValueError):  # a year 10000, say
        return None


def _number(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None


def sane_retry_after(value: Any) -> float | None:
    """`value` as a wait in seconds: None unless a finite number >= 0, at most `MAX_RETRY_AFTER`."""
    if type(value) is bool or not isinstance(value, int | float):
        return None
    if not finite(value) or value < 0:  # an int too large for a float too
        return None
    return min(float(value), MAX_RETRY_AFTER)
