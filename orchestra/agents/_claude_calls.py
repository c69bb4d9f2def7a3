"""Claude calls made outside a task's attempt: the planner's, before the run, and the verifier's,
after an attempt's output. They are not dispatched, so they do here what the dispatcher does for an
agent: reserve on the key's shared `ClaudeLimits` (waiting for room), true the reservation up from
the answer's usage, and retry what deserves it (the core's `classify`: 429 / 529 / 5xx /
connection errors), waiting out a Retry-After that then holds every sharer of the limits.
"""

from __future__ import annotations

import math
from random import Random
from typing import TYPE_CHECKING, Any, Final

import anyio
import structlog

from .._limits import reserve_all
from .._retry import RetryPolicy, backoff, classify

if TYPE_CHECKING:
    from collections.abc import Sequence

    from anthropic.types import Message, MessageParam

    from .._core._context import Context
    from ._claude_agent import ClaudeAgent

__all__ = ("DEFAULT_RETRY", "Tab", "ask")

DEFAULT_RETRY: Final = RetryPolicy(max_attempts=4, base=1.0, cap=30.0)
_CHARS_PER_TOKEN: Final = 3.5


class Tab:
    """What `ClaudeAgent.send` needs of a `Context` (`record_usage`, `log`) for a call that is no
    task's attempt: it adds the usage up, and passes it to the run of `ctx` when there is one,
    under the caller's own name (not the attempt's agent, whose limits it must not true up)."""

    __slots__ = ("_ctx", "name", "recorded", "usage")

    def __init__(self, name: str, ctx: Context | None = None) -> None:
        self.name = name
        self._ctx = ctx
        self.usage: dict[str, float] = {}
        self.recorded = 0  # how many answers reported usage

    def record_usage(self, *, cost: float = 0.0, model: str | None = None, **tokens: int) -> None:
        self.recorded += 1
        usage = self.usage
        for unit, n in tokens.items():
            usage[unit] = usage.get(unit, 0) + n
        usage["cost"] = usage.get("cost", 0.0) + cost
        if self._ctx is not None:
            self._ctx.record_usage_for(self.name, cost=cost, model=model, **tokens)

    @property
    def log(self) -> Any:
        return structlog.get_logger("orchestra.agent").bind(agent=self.name)


def estimate(agent: ClaudeAgent, messages: Sequence[MessageParam]) -> dict[str, float]:
    """One request, the messages' tokens estimated locally, `max_tokens` output tokens."""
    chars = len(agent.system or "") + sum(len(str(m["content"])) for m in messages)
    return {
        "requests": 1,
        "input_tokens": math.ceil(chars / _CHARS_PER_TOKEN) + 8,
        "output_tokens": agent.max_tokens,
    }


async def ask(
    agent: ClaudeAgent,
    messages: Sequence[MessageParam],
    tab: Tab,
    *,
    retry: RetryPolicy = DEFAULT_RETRY,
    rng: Random | None = None,
) -> Message:
    """`agent`'s answer to `messages`, within its limits, retried as `retry` says; the last error
    is raised as it is."""
    rng = rng or Random()
    params = agent.request(messages)
    cost = estimate(agent, messages)
    limiters = agent.limits
    attempt = 0
    while True:
        await _reserve(limiters, cost)
        before, recorded = dict(tab.usage), tab.recorded
        try:
            return await agent.send(params, tab)  # type: ignore[arg-type]
        except Exception as exc:
            retryable, retry_after = classify(exc, retry)
            attempt += 1
            if not retryable or attempt >= retry.max_attempts:
                raise
            wait = backoff(retry, attempt - 1, rng, retry_after)
            if retry_after is not None:
                until = anyio.current_time() + retry_after
                for limiter in limiters:
                    limiter.hold_until(until)  # everybody on the key waits, as after an attempt
            tab.log.info("Claude call failed; retrying", error=type(exc).__name__, wait=wait)
            await anyio.sleep(wait)
        finally:
            _settle(limiters, cost, before if tab.recorded > recorded else None, tab.usage)


async def _reserve(limiters: Sequence[Any], cost: dict[str, float]) -> None:
    while True:
        now = anyio.current_time()
        room = anyio.Event()
        at = reserve_all(limiters, now, cost, room.set)
        if not at:
            return
        if at == math.inf:
            await room.wait()  # a concurrency slot frees
        else:
            await anyio.sleep(at - now)


def _settle(
    limiters: Sequence[Any],
    cost: dict[str, float],
    before: dict[str, float] | None,
    after: dict[str, float],
) -> None:
    """True the reservation up from the usage the call recorded (none: it is kept as reserved,
    as the dispatcher does for an attempt that never heard back), then free its slot."""
    now = anyio.current_time()
    actual: dict[str, float] = dict(cost)
    if before is not None:
        actual = {
            "requests": 1,
            "input_tokens": after.get("input_tokens", 0) - before.get("input_tokens", 0),
            "output_tokens": after.get("output_tokens", 0) - before.get("output_tokens", 0),
        }
    for limiter in limiters:
        limiter.reconcile(cost, actual, now)
        limiter.release(cost, now)
