"""Fake time for tests: a clock that jumps ahead whenever the event loop has nothing else to do.

trio has `MockClock(autojump_threshold=0)`; asyncio has no clock to inject, so `FakeClock` patches
the running loop instead: `loop.time()` returns virtual time, and when the loop would block waiting
for its next timer, the clock jumps straight to that timer. Every `asyncio.sleep`, `anyio.sleep`,
cancel-scope deadline, backoff and breaker cool-down then runs in fake time — a 30 s cool-down takes
microseconds — while real I/O (sockets, threads finishing) is still polled at each jump.
It needs asyncio's default selector event loop (not uvloop).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ._exceptions import ConfigError

if TYPE_CHECKING:
    from types import TracebackType

__all__ = ("FakeClock",)


class FakeClock:
    """Virtual time for the running asyncio loop. Use `async with FakeClock():` or pass it as
    `Orchestrator(clock=FakeClock())`.

    Args:
        autojump_threshold: real seconds the loop must be idle before time jumps (0: at once, as
            trio's autojump). A positive value lets threads and sockets finish before a timer fires.
    """

    def __init__(self, *, autojump_threshold: float = 0.0) -> None:
        self.autojump_threshold = autojump_threshold
        self._now = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._installs = 0
        self._saved: tuple[Any, Any] | None = None

    def time(self) -> float:
        """The virtual time, in seconds (the loop's clock while installed)."""
        return self._now

    def install(self) -> None:
        """Patch the running loop (idempotent: installs nest, the last `uninstall` restores)."""
        loop = asyncio.get_running_loop()
        if self._installs:
            if loop is not self._loop:
                raise ConfigError("this FakeClock is installed on another event loop")
            self._installs += 1
            return
        selector = getattr(loop, "_selector", None)
        if selector is None or "time" in vars(loop):
            raise ConfigError(
                "FakeClock needs asyncio's default selector event loop, with no other fake clock on it"
            )
        self._now = loop.time()
        real_select = selector.select

        def select(timeout: float | None = None) -> Any:
            if timeout is None:  # no timer at all: wait for real I/O
                return real_select(None)
            events = real_select(min(timeout, self.autojump_threshold))
            if not events and timeout > 0:
                self._now += timeout  # nothing happened: jump to the next timer
            return events

        self._saved = (selector, real_select)
        selector.select = select
        loop.time = self.time  # type: ignore[method-assign]
        self._loop = loop
        self._installs = 1

    def uninstall(self) -> None:
        if not self._installs:
            return
        self._installs -= 1
        if self._installs:
            return
        assert self._saved is not None
        assert self._loop is not None
        selector, real_select = self._saved
        selector.select = real_select
        del self._loop.time  # back to the class's method
        self._loop = None
        self._saved = None

    async def __aenter__(self) -> FakeClock:
        self.install()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.uninstall()
