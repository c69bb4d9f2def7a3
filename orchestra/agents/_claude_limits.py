"""The rate limits of one API key on one model family, shared by every Claude agent on them.

The Messages API limits requests per minute, input tokens per minute and output tokens per minute
per key and *model family* (every Sonnet 4.x model shares one budget, every Opus 4.x another), and
enforces a minute's limit over shorter intervals ("60 RPM may be enforced as 1 request per
second"). `ClaudeLimits` is those three budgets, and optionally a cap on concurrent requests, as
the core's own limiters: three `Rate`s (GCRA, smooth by construction: never a minute's budget in
one burst) and a `Concurrency`. They are the core's and not aiolimiter's because the dispatcher
reserves *before* the call with the time handed in and no await (the estimate: one request,
estimated input tokens, `max_tokens` output tokens) and trues up *after* it from the response's
`usage` (`ctx.record_usage`): aiolimiter's leaky bucket awaits inside `acquire` and cannot give
units back (see the `orchestra._rate` docstring for the libraries checked).

Every response's `anthropic-ratelimit-*` headers, successful ones included, adapt the budgets
(`observe_headers`): the server's `-limit` is adopted (capped by what the user configured), and a
falling `-remaining` slows the meter down so that what is left lasts until `-reset`; a 429 that
carries only the reset headers holds every sharer until the reset of the budget it exhausted.
"""

from __future__ import annotations

import math
import re
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final

from .._concurrency import Concurrency
from .._config import finite
from .._exceptions import ConfigError
from .._rate import Rate

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .._clock import Clock
    from .._limits import Limiter

__all__ = ("DEFAULT_LIMITS", "ClaudeLimits", "model_family")

DEFAULT_LIMITS: Final = {"requests": 50, "input_tokens": 30_000, "output_tokens": 8_000}
"""The budgets assumed until the first response says otherwise: the API's tier 1 for Sonnet, the
smallest any key has. The first response's `-limit` headers replace them."""

# The budget each header family describes; `anthropic-ratelimit-tokens-*` (the most restrictive of
# the input and output budgets) adds nothing the other two do not say.
_HEADERS: Final = (
    ("requests", "anthropic-ratelimit-requests"),
    ("input_tokens", "anthropic-ratelimit-input-tokens"),
    ("output_tokens", "anthropic-ratelimit-output-tokens"),
)
_MINUTE: Final = 60.0
_NEW = re.compile(r"claude-([a-z]+)-(\d+)")  # claude-sonnet-4-5-20250929 -> sonnet 4
_OLD = re.compile(r"claude-(\d+)(?:-\d+)?-([a-z]+)")  # claude-3-5-haiku-20241022 -> haiku 3


def model_family(model: str) -> str:
    """The family whose rate limits `model` shares: ``"sonnet-4"`` for every Sonnet 4.x id, with
    or without a date; the id itself when it follows neither naming scheme."""
    match = _NEW.match(model)
    if match is not None:
        return f"{match[1]}-{match[2]}"
    match = _OLD.match(model)
    if match is not None:
        return f"{match[2]}-{match[1]}"
    return model


class ClaudeLimits:
    """Requests, input tokens and output tokens per minute, and concurrent requests, of one API
    key on one model family: the limiters every Claude agent on them reserves before each call.

    Give one object to every agent (and orchestrator) that uses the key and family, or let
    `ClaudeAccount` make one per family. A budget left as None starts at `DEFAULT_LIMITS` and
    follows the server's `-limit` headers; one that is given is a ceiling the server's headers
    may lower but never raise (the key may be shared with other processes).

    Args:
        requests_per_minute, input_tokens_per_minute, output_tokens_per_minute: the budgets.
        concurrent_requests: the most requests in flight at once (None: no such cap).
    """

    __slots__ = (
        "_ceilings",
        "_observed",
        "concurrency",
        "input_tokens",
        "output_tokens",
        "requests",
    )

    def __init__(
        self,
        *,
        requests_per_minute: float | None = None,
        input_tokens_per_minute: float | None = None,
        output_tokens_per_minute: float | None = None,
        concurrent_requests: int | None = None,
    ) -> None:
        given = {
            "requests": requests_per_minute,
            "input_tokens": input_tokens_per_minute,
            "output_tokens": output_tokens_per_minute,
        }
        for unit, value in given.items():
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not finite(value)
                or value <= 0
            ):
                raise ConfigError(f"ClaudeLimits: {unit} per minute must be > 0, got {value!r}")
        self._ceilings: dict[str, float | None] = given
        self._observed: set[str] = set()  # the budgets a server's `-limit` header has told
        self.requests = Rate(given["requests"] or DEFAULT_LIMITS["requests"], per=_MINUTE)
        self.input_tokens = _token_rate("input_tokens", given["input_tokens"])
        self.output_tokens = _token_rate("output_tokens", given["output_tokens"])
        self.concurrency = None if concurrent_requests is None else Concurrency(concurrent_requests)

    @property
    def limiters(self) -> tuple[Limiter, ...]:
        """What an agent on this key and family reserves before each call."""
        rates: tuple[Limiter, ...] = (self.requests, self.input_tokens, self.output_tokens)
        return rates if self.concurrency is None else (self.concurrency, *rates)

    def rate(self, unit: str) -> Rate:
        """The meter of `unit`: ``"requests"``, ``"input_tokens"`` or ``"output_tokens"``."""
        rate: Rate = getattr(self, unit)
        return rate

    def known(self, unit: str) -> float | None:
        """The per-minute budget of `unit` if the user set it or a response told it; None while
        it is only the assumed default (a request over that may well fit the key's real one)."""
        if self._ceilings[unit] is None and unit not in self._observed:
            return None
        return self.rate(unit).limit

    def observe_headers(self, headers: Mapping[str, str], clock: Clock) -> None:
        """Adapt to a response's `anthropic-ratelimit-*` headers (any response: 200, 429, 529).

        `-limit` retunes the meter (up to the configured ceiling); `-remaining` and `-reset` slow
        it down so that no more than what remains goes before the reset. Garbage is ignored.
        """
        for unit, prefix in _HEADERS:
            rate = self.rate(unit)
            limit = _number(headers.get(f"{prefix}-limit"))
            if limit is not None and limit > 0:
                self._observed.add(unit)
                ceiling = self._ceilings[unit]
                _retune(rate, limit if ceiling is None else min(limit, ceiling), clock.now())
            remaining = _number(headers.get(f"{prefix}-remaining"))
            reset = _timestamp(headers.get(f"{prefix}-reset"))
            if remaining is not None and reset is not None:
                rate.observe(remaining, clock.to_loop(reset))

    def snapshot(self, now: float) -> dict[str, Any]:
        """Each budget's use and limit, for status reports."""
        shot = {unit: self.rate(unit).snapshot(now) for unit, _ in _HEADERS}
        if self.concurrency is not None:
            shot["concurrent_requests"] = self.concurrency.snapshot(now)
        return shot

    def __repr__(self) -> str:
        return (
            f"ClaudeLimits(requests_per_minute={self.requests.limit:g}, "
            f"input_tokens_per_minute={self.input_tokens.limit:g}, "
            f"output_tokens_per_minute={self.output_tokens.limit:g}, "
            f"concurrent_requests={None if self.concurrency is None else self.concurrency.limit})"
        )


def _token_rate(unit: str, per_minute: float | None) -> Rate:
    limit = per_minute or DEFAULT_LIMITS[unit]
    # A second's worth may go at once after an idle spell: a request's tokens come in one lump,
    # and a burst of one token would make every request wait for the meter to drain completely.
    return Rate(limit, per=_MINUTE, unit=unit, burst=limit / _MINUTE)


def _retune(rate: Rate, limit: float, now: float) -> None:
    """Set `rate`'s limit in place: a default budget that turns out ten times too small does not
    keep the first requests' reservations ten times too long (see `Rate.retune`). A token budget's
    burst stays one second's worth."""
    if limit == rate.limit:
        return
    rate.retune(limit, now)
    if rate.unit != "requests":
        rate.burst = limit / _MINUTE


def _number(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) and number >= 0 else None


def _timestamp(value: str | None) -> float | None:
    """An RFC 3339 time (``2025-01-01T00:00:30Z``) as epoch seconds, or None."""
    if not value:
        return None
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        return None
    if moment.tzinfo is None:
        return None
    return moment.timestamp()
