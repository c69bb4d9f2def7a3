"""Retry policy: how many attempts, how long between them, and which errors deserve another try.

Backoff is `min(cap, base * 2**n)` for the n-th retry (n from 0), with jitter; a `Retry-After` hint from
the agent (HTTP 429/529 headers, or `RetryableError(retry_after=...)`) wins when it is longer. The
jitter draws from the run's seeded `random.Random`, so a schedule can be checked exactly in tests.

Written here rather than taken from tenacity or backoff: those wrap one call in a loop that sleeps,
and a task waiting for its retry here must not hold a worker or a concurrency slot; the schedule is
one formula, the classification is orchestra's own.
"""

from __future__ import annotations

import email.utils
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ._exceptions import ConfigError, InputError, PermanentError, RetryableError

if TYPE_CHECKING:
    from collections.abc import Mapping
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
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ConfigError(
                f"RetryPolicy.max_attempts must be an int >= 1, got {self.max_attempts!r}"
            )
        if self.base < 0 or self.cap < 0:
            raise ConfigError(
                f"RetryPolicy.base and .cap must be >= 0, got base={self.base}, cap={self.cap}"
            )
        if self.jitter not in ("full", "equal", "none"):
            raise ConfigError(
                f"RetryPolicy.jitter must be 'full', 'equal' or 'none', got {self.jitter!r}"
            )


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
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
            ):
                raise ConfigError(
                    f"Timeouts.{name} must be a positive number or None, got {value!r}"
                )

    @classmethod
    def of(cls, value: Timeouts | Mapping[str, float | None] | None) -> Timeouts:
        """Accept a `Timeouts`, a mapping such as ``{"attempt": 60, "task": 300}``, or None."""
        if value is None:
            return cls()
        if isinstance(value, Timeouts):
            return value
        unknown = set(value) - {"attempt", "task", "run"}
        if unknown:
            raise ConfigError(f"unknown timeout {sorted(unknown)}; use 'attempt', 'task' or 'run'")
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


def classify(exc: BaseException, policy: RetryPolicy) -> tuple[bool, float | None]:
    """Whether `exc` deserves another attempt, and the server's Retry-After hint in seconds.

    Retryable: `RetryableError`, timeouts, connection errors, HTTP 408/409/425/429 and every 5xx
    (529 "overloaded" included), and any exception not known to be permanent. Permanent:
    `PermanentError`, `InputError`, pydantic validation errors and the other 4xx.
    """
    if isinstance(exc, RetryableError):
        return True, exc.retry_after
    if isinstance(exc, PermanentError | InputError | ConfigError):
        return False, None
    if policy.permanent and isinstance(exc, policy.permanent):
        return False, None
    if policy.retryable and isinstance(exc, policy.retryable):
        return True, None
    status = _http_status(exc)
    if status is not None:
        if status in _RETRYABLE_STATUS or status >= 500:
            return True, retry_after_from(exc)
        return False, None
    if _is_validation_error(exc):
        return False, None
    return True, None


def _http_status(exc: BaseException) -> int | None:
    # anthropic.APIStatusError has .status_code; httpx.HTTPStatusError has .response.status_code.
    status = getattr(exc, "status_code", None)
    if status is None:
        response = getattr(exc, "response", None)
        status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def _is_validation_error(exc: BaseException) -> bool:
    # pydantic is imported by the package anyway; the lookup through sys.modules keeps this leaf light.
    pydantic = sys.modules.get("pydantic")
    return pydantic is not None and isinstance(exc, pydantic.ValidationError)


def retry_after_from(exc: BaseException) -> float | None:
    """The `retry-after-ms` / `retry-after` header of an HTTP error's response, in seconds."""
    headers: Any = getattr(getattr(exc, "response", None), "headers", None)
    if headers is None:
        return None
    try:
        millis = headers.get("retry-after-ms")
        if millis is not None:
            return max(0.0, float(millis) / 1000)
        value = headers.get("retry-after")
    except (AttributeError, TypeError, ValueError):
        return None
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        when = email.utils.parsedate_to_datetime(value) if value else None
        return None if when is None else max(0.0, when.timestamp() - time.time())
