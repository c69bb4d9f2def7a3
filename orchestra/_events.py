"""Typed events for every state change, and the bus that delivers them to subscribers.

Events are built only when somebody subscribed to their type (the dispatcher checks `bus.active`
and `bus.wants(...)`), so they cost nothing otherwise; treat them as read-only (they are plain
slotted dataclasses: a frozen one costs twice as much to build). Each subscriber has its own bounded buffer, drained by its own task in the
orchestrator's task group: a slow subscriber drops events (counted in `dropped`) instead of slowing
dispatch, and one that raises is logged and kept, never allowed to break the run.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from ._failure import cancel_pending
from ._log import get_logger

if TYPE_CHECKING:
    from anyio.abc import TaskGroup
    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

    from ._task import TaskResult

__all__ = (
    "AttemptFailed",
    "AttemptStarted",
    "AttemptSucceeded",
    "BreakerChanged",
    "Event",
    "EventBus",
    "FallbackUsed",
    "RetryScheduled",
    "RunFinished",
    "RunStarted",
    "TaskFinished",
    "TaskReady",
)

log = get_logger("orchestra.events")


@dataclass(slots=True)
class Event:
    """Base of every event. `at` is the event loop's clock (seconds), `run_id` the run it belongs to."""

    at: float
    run_id: str | None


@dataclass(slots=True)
class RunStarted(Event):
    """A run began."""


@dataclass(slots=True)
class TaskReady(Event):
    """A task's dependencies succeeded (or it had none): it waits in the ready-queue."""

    task_id: str
    kind: str
    priority: int


@dataclass(slots=True)
class AttemptStarted(Event):
    """An agent was called on a task. `attempt` counts every attempt of the task, from 1."""

    task_id: str
    kind: str
    agent: str
    attempt: int


@dataclass(slots=True)
class AttemptSucceeded(Event):
    """An attempt returned an output that passed verification."""

    task_id: str
    kind: str
    agent: str
    attempt: int
    duration: float


@dataclass(slots=True)
class AttemptFailed(Event):
    """An attempt raised, timed out, returned garbage or failed verification."""

    task_id: str
    kind: str
    agent: str
    attempt: int
    error_type: str
    message: str
    retryable: bool
    duration: float


@dataclass(slots=True)
class RetryScheduled(Event):
    """The task will be tried again on the same agent after `delay` seconds (no slot held meanwhile)."""

    task_id: str
    kind: str
    agent: str
    attempt: int
    delay: float


@dataclass(slots=True)
class FallbackUsed(Event):
    """The task moved from one agent to the next of its chain (`to_agent` None: the chain ran out)."""

    task_id: str
    kind: str
    from_agent: str
    to_agent: str | None
    reason: str


@dataclass(slots=True)
class BreakerChanged(Event):
    """An agent's circuit breaker changed state: "closed", "open" or "half_open"."""

    agent: str
    state: str
    previous: str


@dataclass(slots=True)
class TaskFinished(Event):
    """A task reached its terminal state; `result.status` says which."""

    result: TaskResult


@dataclass(slots=True)
class RunFinished(Event):
    """A run ended with `status` after `elapsed` seconds."""

    status: str
    elapsed: float


Subscriber = Callable[[Any], Awaitable[None] | None]


def _with_subclasses(kind: type[Event]) -> list[type[Event]]:
    found = [kind]
    for sub in kind.__subclasses__():
        found.extend(_with_subclasses(sub))
    return found


class _Subscription:
    __slots__ = ("buffer", "fn", "handed", "is_async", "send", "sent", "types")

    def __init__(self, fn: Subscriber, types: tuple[type[Event], ...], buffer: int) -> None:
        self.fn = fn
        self.types = types
        self.buffer = buffer
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004
        )
        self.send: MemoryObjectSendStream[Event] | None = None  # open while the bus is started
        self.sent = 0  # events put in its buffer
        self.handed = 0  # events its delivery task has handed to `fn`


class EventBus:
    """Fan-out of events to subscribers, each through a bounded buffer."""

    __slots__ = (
        "_delivering",
        "_drained",
        "_group",
        "_scopes",
        "_subs",
        "_wanted",
        "active",
        "dropped",
        "errors",
        "on_change",
    )

    def __init__(self) -> None:
        self._subs: list[_Subscription] = []
        self._group: TaskGroup | None = None
        self._delivering = 0
        # Each delivery runs in a shielded scope of its own: a cancellation that unwinds the
        # orchestrator (a cancelled `run()` without `async with`) does not drop what is buffered;
        # `cancel` ends them, after the drain timeout.
        self._scopes: set[anyio.CancelScope] = set()
        self._drained: anyio.Event | None = None
        self._wanted: frozenset[type[Event]] | None = None  # None: every type
        self.active = False
        self.on_change: Callable[[], None] | None = None  # a subscriber came or went
        self.dropped = 0
        self.errors = 0

    def subscribe(
        self, fn: Subscriber, types: tuple[type[Event], ...] = (), buffer: int = 10_000
    ) -> Callable[[], None]:
        sub = _Subscription(fn, types, buffer)
        self._subs.append(sub)
        self._changed()
        if self._group is not None:
            self._open(sub, self._group)

        def unsubscribe() -> None:
            if sub in self._subs:
                self._subs.remove(sub)
                self._changed()
                if sub.send is not None:
                    sub.send.close()
                    sub.send = None

        return unsubscribe

    def wants(self, kind: type[Event]) -> bool:
        """Whether some subscriber takes events of `kind` (check `active` first: it is cheaper)."""
        return self._wanted is None or kind in self._wanted

    def _changed(self) -> None:
        self.active = bool(self._subs)
        if any(not s.types or Event in s.types for s in self._subs):
            self._wanted = None
        else:
            self._wanted = frozenset(
                k for s in self._subs for t in s.types for k in _with_subclasses(t)
            )
        if self.on_change is not None:
            self.on_change()

    def emit(self, event: Event) -> None:
        for sub in self._subs:
            if sub.send is None or (sub.types and not isinstance(event, sub.types)):
                continue
            try:
                sub.send.send_nowait(event)
                sub.sent += 1
            except anyio.WouldBlock:
                self.dropped += 1
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass

    def start(self, group: TaskGroup) -> None:
        """Start delivering, with one task per subscriber in `group`."""
        self._group = group
        for sub in self._subs:
            self._open(sub, group)

    def stop(self) -> None:
        """Close every buffer: the delivery tasks finish what is buffered, then end."""
        self._group = None
        for sub in self._subs:
            if sub.send is not None:
                sub.send.close()
                sub.send = None

    async def drained(self) -> None:
        """Wait until every delivery task has delivered what was buffered (after `stop`)."""
        while self._delivering:
            event = self._drained = anyio.Event()
            await event.wait()

    async def synced(self) -> None:
        """Wait until every sync subscriber has been handed what was emitted so far: a run
        returns once its events reached them, so a `Recorder` is read right after `run()`. A
        sync subscriber takes a few turns of the loop and no time; an async one keeps its own pace
        (the orchestrator's exit drains it, for `drain_timeout` at most). What other runs emit
        meanwhile is not waited for."""
        for sub in [s for s in self._subs if not s.is_async]:
            sent = sub.sent
            while sub.handed < sent and sub.send is not None:
                if not sub.send.statistics().open_receive_streams:
                    break  # its delivery task is gone
                await anyio.lowlevel.checkpoint()

    def _open(self, sub: _Subscription, group: TaskGroup) -> None:
        sub.send, receive = anyio.create_memory_object_stream[Event](sub.buffer)
        group.start_soon(self._deliver, sub, receive)

    async def _deliver(self, sub: _Subscription, receive: MemoryObjectReceiveStream[Event]) -> None:
        self._delivering += 1
        scope = anyio.CancelScope(shield=True)
        self._scopes.add(scope)
        try:
            with scope:
                await self._pump(sub, receive)
        finally:
            self._scopes.discard(scope)
            # Cancelled at the orchestrator's exit (past its drain timeout): what is left is dropped.
            self.dropped += receive.statistics().current_buffer_used
            self._delivering -= 1
            if not self._delivering and self._drained is not None:
                self._drained.set()

    def cancel(self) -> None:
        """End every delivery now (what is still buffered is dropped and counted)."""
        for scope in self._scopes:
            scope.cancel()

    async def _pump(self, sub: _Subscription, receive: MemoryObjectReceiveStream[Event]) -> None:
        fn = sub.fn
        async with receive:
            async for event in receive:
                if sub.is_async:
                    sub.handed += 1
                    try:
                        await fn(event)  # type: ignore[misc]
                    except (Exception, asyncio.CancelledError) as exc:
                        if isinstance(exc, asyncio.CancelledError) and cancel_pending():
                            raise  # the bus is cancelled (the orchestrator exits)
                        self._failed(fn, event)  # a stray CancelledError of its own included
                    continue
                # A sync subscriber takes everything buffered at once: one event per turn of the
                # loop (a receive is a checkpoint) fell behind a busy run for seconds, and a run
                # returns only once its events reached it (`synced`).
                while True:
                    sub.handed += 1  # handed over, whatever `fn` makes of it
                    try:
                        fn(event)
                    except (Exception, asyncio.CancelledError):
                        self._failed(fn, event)
                    try:
                        event = receive.receive_nowait()
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break

    def _failed(self, fn: Subscriber, event: Event) -> None:
        """A subscriber raised: logged and counted, never the run's failure."""
        self.errors += 1
        log.warning(
            "subscriber raised",
            subscriber=repr(fn),
            event_type=type(event).__name__,
            exc_info=True,
        )
