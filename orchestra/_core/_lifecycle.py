"""`Lifecycle`: what an orchestrator holds open while it is used, and who may close it.

An orchestrator's runs need a task group (for its run handles and streams) and its event bus's
delivery; a `FakeClock` it was given is installed meanwhile. ``async with orch`` opens that
lifecycle, and the outermost block of the task that opened it closes it, once every run started
in it is over and the other tasks' blocks have ended; subscribers then get what is buffered for
them, for `drain_timeout` at most. A caller of `run()` or `work()` outside `async with` gets the
lifecycle from a task of its own (`around`), shared by all such callers and closed after the last.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, TypeVar

import anyio

from .._exceptions import ConfigError
from .._failure import cancel_pending

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from types import TracebackType

    from anyio.abc import TaskGroup

    from .._clock import FakeClock
    from .._events import EventBus

__all__ = ("Lifecycle",)

T = TypeVar("T")


class Lifecycle:
    """One orchestrator's lifecycle (see the module's docstring)."""

    def __init__(
        self,
        bus: EventBus,
        clock: FakeClock | None,
        drain_timeout: float,
        busy: Callable[[], bool],
    ) -> None:
        self._bus = bus
        self._clock = clock
        self._drain_timeout = drain_timeout
        self._busy = busy  # whether some run of the orchestrator is starting or going on
        self.tg: TaskGroup | None = None  # open while the lifecycle is
        self._idle: anyio.Event | None = None
        self._entered = 0
        # The tasks inside an `async with` of it, by anyio task id, with their depth; the first
        # one entered the task group, and only it can exit it (a cancel scope is left in the
        # task that entered it).
        self._holders: dict[int, int] = {}
        self._owner: int | None = None
        # The task that keeps the lifecycle open for callers outside `async with` (see
        # `around`), how many such calls use it, and the event that lets it close once none does.
        self._keeper: asyncio.Task[None] | None = None
        self._kept_open: asyncio.Future[None] | None = None  # set once `_keeper` has entered
        self._users = 0
        self._unused = anyio.Event()

    @property
    def in_async_with(self) -> bool:
        """Open by a caller's `async with` (not by the task `around` starts)."""
        return bool(self._entered) and self._keeper is None

    def maybe_idle(self) -> None:
        """A run ended: a block waiting to close the lifecycle looks again."""
        if self._idle is not None and not self._busy():
            self._idle.set()

    async def __aenter__(self) -> Lifecycle:
        me = anyio.get_current_task().id
        if self._entered:
            self._entered += 1
            self._holders[me] = self._holders.get(me, 0) + 1
            return self
        if self._clock is not None:
            self._clock.install()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self.tg = tg
        self._entered = 1
        self._holders = {me: 1}
        self._owner = me
        self._bus.start(tg)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        me = anyio.get_current_task().id
        depth = self._holders.get(me)
        if depth is None:
            if self.tg is None:
                return None  # the lifecycle it entered was ended by its first task's error
            raise ConfigError(
                "Orchestrator exited from a task (or event loop) that did not enter it: use "
                "`async with` in the task that runs the block"
            )
        self._entered -= 1
        if depth > 1:
            self._holders[me] = depth - 1
            return None
        del self._holders[me]
        if me != self._owner:
            # Another task entered first: that one exits the task group, once this one is out.
            if self._idle is not None:
                self._idle.set()
            return None
        tg = self.tg
        assert tg is not None
        waited: BaseException | None = None  # a cancellation while waiting for other callers' runs
        try:
            if exc is None:
                # Runs that other callers started in this lifecycle (run() without `async with`,
                # concurrently) finish first, and other tasks' `async with` blocks end.
                try:
                    while self._busy() or self._holders:
                        idle = self._idle = anyio.Event()
                        await idle.wait()
                except anyio.get_cancelled_exc_class() as cancelled:
                    # Cancelled while it waits for them (its caller's deadline): it still closes the
                    # task group it opened, in its own task, as a caller cancelled during its own
                    # run does (below), then re-raises. Leaving without would keep that group's
                    # cancel scope open (a RuntimeError at the caller's next scope exit) and its
                    # delivery tasks running.
                    waited = cancelled
                    exc_type, exc, tb = type(cancelled), cancelled, cancelled.__traceback__
            self._holders.clear()
            self._entered = 0
            self.tg = None
            self._bus.stop()
            if exc is None:
                # Subscribers get what is buffered for them, for `drain_timeout` at most.
                with anyio.move_on_after(self._drain_timeout):
                    await self._bus.drained()
                self._bus.cancel()
                tg.cancel_scope.cancel()
                return await tg.__aexit__(None, None, None)
            if isinstance(exc, Exception):
                # An error from the body (say, an InputError from run()) reaches the caller as it
                # is, not wrapped in an ExceptionGroup by our background task group.
                self._bus.cancel()
                tg.cancel_scope.cancel()
                await tg.__aexit__(None, None, None)
                return None
            # Cancelled (the caller's `run()` without `async with`, say): the subscribers still
            # get what is buffered for them — `RunFinished` of the cancelled run included — for
            # `drain_timeout` at most, shielded from the cancellation that is unwinding us.
            with anyio.CancelScope(shield=True), anyio.move_on_after(self._drain_timeout):
                await self._bus.drained()
            self._bus.cancel()
            suppressed = await tg.__aexit__(exc_type, exc, tb)
            if waited is not None and not suppressed:
                raise waited
            return suppressed
        finally:
            if self._clock is not None:
                self._clock.uninstall()

    async def around(self, call: Callable[[], Awaitable[T]]) -> T:
        """`call` for a caller outside `async with`. The lifecycle it needs (the task group, the
        event bus) is kept open by a task of its own (`_keep_open`), started by the first such
        caller and closed once the last one's call is over. Not an `async with` in the first
        caller's task: that caller's cancel would close it under the others' runs, whose
        subscribers would hear nothing more of them."""
        while self._keeper is not None and self._unused.is_set():
            await asyncio.wait((self._keeper,))  # the last lifecycle is closing: let it close
        if self._keeper is None:
            if self._entered:  # an `async with` of another task's opened it meanwhile
                return await call()
            self._unused = anyio.Event()
            self._kept_open = asyncio.get_running_loop().create_future()
            self._keeper = asyncio.create_task(self._keep_open(self._kept_open, self._unused))
        keeper, kept_open = self._keeper, self._kept_open
        assert kept_open is not None
        self._users += 1
        try:
            if not kept_open.done():
                await asyncio.wait((kept_open, keeper), return_when=asyncio.FIRST_COMPLETED)
                if not kept_open.done():
                    keeper.result()  # it could not open the lifecycle: its error is the caller's
            return await call()
        finally:
            self._users -= 1
            if not self._users:
                self._unused.set()
                # The lifecycle closes (its subscribers drained, a FakeClock uninstalled) before
                # the last caller returns, as at the end of its own `async with`; a cancelled
                # caller waits for that `drain_timeout` at most.
                cancelled = cancel_pending()
                with (
                    anyio.CancelScope(shield=cancelled),
                    anyio.move_on_after(self._drain_timeout if cancelled else None),
                ):
                    await asyncio.wait((keeper,))
                if keeper.done() and not keeper.cancelled() and (error := keeper.exception()):
                    raise error

    async def _keep_open(self, kept_open: asyncio.Future[None], unused: anyio.Event) -> None:
        """The keeper's task: the lifecycle, open until `unused` is set."""
        try:
            async with self:
                kept_open.set_result(None)
                await unused.wait()
        finally:
            if self._keeper is asyncio.current_task():
                self._keeper = None
