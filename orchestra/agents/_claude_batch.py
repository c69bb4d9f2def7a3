"""`ClaudeBatchAgent`: a kind served through the Message Batches API, at half the price.

Each attempt's request is gathered into the agent's next batch, which goes when it holds
`batch_size` requests or `max_wait` seconds after its first one; the batch is submitted, polled
with backoff (from `poll_interval` up to `max_poll_interval`) until it ends, and each result goes
back to the attempt that waits for it as a normal outcome: a message (validated, its usage and cost
recorded), or an error. An errored, expired or canceled request is a retryable failure (the retry
goes into a later batch); an errored one whose error is an invalid request is permanent.

Why by hand: the SDK gives the endpoints, not the gathering; nothing in asyncio or anyio batches
awaitables by count or time, and the polling must stop as soon as nobody waits any more (every
attempt of a batch cancelled: the batch is cancelled on the API too).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING, Any, Final

import anyio

from .._config import check_int, check_number
from .._exceptions import ConfigError, PermanentError, RetryableError
from .._log import get_logger
from .._retry import classify
from ._claude_agent import ClaudeAgent
from ._claude_calls import DEFAULT_RETRY
from ._claude_prices import cost_of

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping

    from anthropic.types import Message

    from .._core._context import Context
    from .._task import Task

__all__ = ("BATCH_DISCOUNT", "BatchRequestFailed", "ClaudeBatchAgent")

log = get_logger("orchestra")

_POLL_TRIES: Final = 8
"""How many times in a row a look at a submitted batch may fail (429, 529, 5xx, the network)
before its attempts fail with the error and the batch is cancelled."""

_CANCEL_TIMEOUT: Final = 30.0
"""Seconds a cancelled poller may take to cancel its batch on the API."""

BATCH_DISCOUNT: Final = 0.5
"""A batched request costs half the price of the same request through the Messages API."""


class BatchRequestFailed(RetryableError):
    """A request of a Message Batch errored, expired or was canceled: retried in a later batch."""


class _Pending:
    __slots__ = ("custom_id", "future", "params")

    def __init__(self, custom_id: str, params: dict[str, Any], future: asyncio.Future[Any]) -> None:
        self.custom_id = custom_id
        self.params = params
        self.future = future


class ClaudeBatchAgent(ClaudeAgent):
    """A `ClaudeAgent` whose calls go through the Message Batches API: half the price, answers
    within minutes to hours instead of seconds. For large jobs where latency does not matter.

    Takes every argument of `ClaudeAgent` (but `stream`), and:

    Args:
        batch_size: a batch goes when it holds this many requests (the API takes up to 100,000).
        max_wait: ... or this many seconds after its first request.
        poll_interval: seconds before the first look at a submitted batch; doubled at each look
            up to `max_poll_interval`.
        max_poll_interval: the longest wait between two looks.

    Its requests do not count against the Messages API's per-minute limits (batches have their
    own), so it reserves nothing on `ClaudeLimits`. Give it an attempt timeout long enough for a
    batch (up to 24 hours) or none.
    """

    __slots__ = (
        "_ids",
        "_open",
        "_running",
        "_timer",
        "batch_size",
        "batches",
        "max_poll_interval",
        "max_wait",
        "poll_interval",
    )

    def __init__(
        self,
        *,
        batch_size: int = 1_000,
        max_wait: float = 5.0,
        poll_interval: float = 5.0,
        max_poll_interval: float = 60.0,
        **options: Any,
    ) -> None:
        if options.get("stream"):
            raise ConfigError("ClaudeBatchAgent: a batch is not streamed (stream=True)")
        super().__init__(**options)
        check_int(f"agent {self.name!r}: batch_size", batch_size)
        check_number(f"agent {self.name!r}: max_wait", max_wait)
        check_number(f"agent {self.name!r}: poll_interval", poll_interval, positive=True)
        check_number(f"agent {self.name!r}: max_poll_interval", max_poll_interval, positive=True)
        self.limits = ()  # the per-minute budgets are the Messages API's, not the batches'
        self.batch_size = batch_size
        self.max_wait = max_wait
        self.poll_interval = poll_interval
        self.max_poll_interval = max_poll_interval
        self.batches: list[str] = []
        """The ids of the batches submitted, in order."""
        self._ids = itertools.count(1)
        self._open: list[_Pending] = []
        self._timer: asyncio.TimerHandle | None = None
        self._running: set[asyncio.Task[None]] = set()

    # `estimate` is the Messages agent's: it reserves nothing here (no limits), and a run's
    # budget prices it at the batch price (`cost_of`) before the attempt starts.

    def cost_of(self, units: Mapping[str, float]) -> float:
        """USD of these token counts at the batch price (half the agent's)."""
        return super().cost_of(units) * BATCH_DISCOUNT

    async def __call__(self, task: Task, ctx: Context) -> Any:
        params = self.request(self.conversation(task, ctx))
        message = await self.submit(params, ctx)
        return self.read(message)

    async def submit(self, params: dict[str, Any], ctx: Context) -> Message:
        """The answer to `params`, through the agent's next batch; its usage recorded at half
        price. An errored, expired or canceled request raises `BatchRequestFailed`."""
        loop = asyncio.get_running_loop()
        pending = _Pending(f"r{next(self._ids)}", params, loop.create_future())
        self._open.append(pending)
        if len(self._open) >= self.batch_size:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.max_wait, self._flush)
        result = await pending.future
        if result.type == "succeeded":
            message: Message = result.message
            self._record_batched(message.usage, ctx)
            return message
        if result.type == "errored":
            error = result.error.error
            text = f"agent {self.name!r}: a batched request errored: {error.type}: {error.message}"
            if error.type == "invalid_request_error":
                raise PermanentError(text)
            raise BatchRequestFailed(text)
        raise BatchRequestFailed(f"agent {self.name!r}: a batched request was {result.type}")

    async def aclose(self) -> None:
        """Stop polling the batches still open and cancel them on the API (else they would run
        on, and be paid for, with nobody to read them); their waiting attempts are cancelled."""
        for task in list(self._running):
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)

    # -- internals -------------------------------------------------------------------------------

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._open = self._open, []
        batch = [p for p in batch if not p.future.done()]  # attempts cancelled while gathering
        if not batch:
            return
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, batch: list[_Pending]) -> None:
        batches = self.account.client.messages.batches
        created = None
        try:
            created = await batches.create(
                requests=[{"custom_id": p.custom_id, "params": p.params} for p in batch]  # type: ignore[typeddict-item]
            )
            self.batches.append(created.id)
            # Nobody waits any more (every attempt of the batch cancelled): stop at once.
            abandoned = asyncio.Event()

            def check(_: object) -> None:
                if all(p.future.done() for p in batch):
                    abandoned.set()

            for pending in batch:
                pending.future.add_done_callback(check)
            wait = self.poll_interval
            while True:
                with anyio.move_on_after(wait):
                    await abandoned.wait()
                if abandoned.is_set():
                    await self._cancel(created.id)
                    return
                status = await self._look(lambda: batches.retrieve(created.id), created.id)
                if status.processing_status == "ended":
                    break
                wait = min(2 * wait, self.max_poll_interval)
            by_id = {p.custom_id: p for p in batch}

            async def collect() -> None:
                async for item in await batches.results(created.id):
                    found = by_id.pop(item.custom_id, None)
                    if found is not None and not found.future.done():
                        found.future.set_result(item.result)

            await self._look(collect, created.id)
            for left in by_id.values():  # the results left it out: treat it as expired
                if not left.future.done():
                    left.future.set_exception(
                        BatchRequestFailed(f"agent {self.name!r}: no result for a batched request")
                    )
        except BaseException as exc:
            # The submission or a poll failed (the API's own error, classified as any call's),
            # or the poller was cancelled: every attempt still waiting fails with it.
            for pending in batch:
                if not pending.future.done():
                    if isinstance(exc, Exception):
                        pending.future.set_exception(exc)
                    else:
                        pending.future.cancel()
            if not isinstance(exc, Exception):
                if created is not None:  # the poller was cancelled (`aclose`): so is the batch
                    await self._cancel(created.id)
                raise

    async def _cancel(self, batch_id: str) -> None:
        """Cancel the batch on the API, shielded and bounded (a dead API must not hold a close);
        a failure is logged, not raised: the caller is already ending."""
        with anyio.move_on_after(_CANCEL_TIMEOUT, shield=True):
            try:
                await self.account.client.messages.batches.cancel(batch_id)
            except Exception as exc:
                log.warning("could not cancel a batch", batch=batch_id, error=type(exc).__name__)

    async def _look(self, call: Callable[[], Awaitable[Any]], batch_id: str) -> Any:
        """`call()` (a poll, the results), again after a failure that deserves it: the batch
        runs on at the API, and is paid for, whatever one look meets. After `_POLL_TRIES`
        failures in a row, or a permanent one, the batch is cancelled and the error raised."""
        failures = 0
        while True:
            try:
                return await call()
            except Exception as exc:
                retryable, retry_after = classify(exc, DEFAULT_RETRY)
                failures += 1
                if not retryable or failures >= _POLL_TRIES:
                    await self._cancel(batch_id)
                    raise
                wait = min(self.poll_interval * 2 ** (failures - 1), self.max_poll_interval)
                await anyio.sleep(wait if retry_after is None else max(wait, retry_after))

    def _record_batched(self, usage: Any, ctx: Context) -> None:
        tokens = {
            "input_tokens": usage.input_tokens or 0,
            "output_tokens": usage.output_tokens or 0,
            "cache_creation_input_tokens": usage.cache_creation_input_tokens or 0,
            "cache_read_input_tokens": usage.cache_read_input_tokens or 0,
        }
        cost = 0.0 if self.price is None else BATCH_DISCOUNT * cost_of(self.price, usage)
        spent = self.spent
        for unit, n in tokens.items():
            spent[unit] = spent.get(unit, 0) + n
        spent["cost"] = spent.get("cost", 0.0) + cost
        ctx.record_usage(cost=cost, model=self.model, **tokens)

    def __repr__(self) -> str:
        return (
            f"ClaudeBatchAgent(name={self.name!r}, kinds={list(self.kinds)!r}, "
            f"model={self.model!r}, batch_size={self.batch_size})"
        )


for _public in (BatchRequestFailed, ClaudeBatchAgent):
    _public.__module__ = "orchestra.agents"
