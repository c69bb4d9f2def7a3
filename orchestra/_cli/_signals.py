"""Ctrl-C and SIGTERM turned into a graceful stop of a run (`run_main`, `orchestra run`).

The first SIGINT or SIGTERM stops the run gracefully (`RunHandle.stop(grace)`): no new attempt
starts, the running ones get `grace` seconds, the rest is cancelled, and the partial `RunResult`
is returned as usual. A second signal cancels what still runs at once; the result of the cancelled
run is still returned, never a `KeyboardInterrupt` traceback.
"""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING

import anyio

from .._log import get_logger

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

    from anyio.abc import TaskGroup

    from .._core._handle import RunHandle

__all__ = ("on_signals", "signal_receiver", "stop")

log = get_logger("orchestra")

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


async def on_signals(
    signals: AsyncIterator[int], handle: RunHandle, grace: float | None, tg: TaskGroup
) -> None:
    """The first signal stops `handle`'s run gracefully (`grace`), the next cancels it at once."""
    received = 0
    async for signum in signals:
        received += 1
        name = signal.Signals(signum).name
        if received == 1:
            log.warning(
                "stopping the run gracefully; signal again to cancel at once",
                run_id=handle.run_id,
                signal=name,
                grace=grace,
            )
            tg.start_soon(stop, handle, grace, f"stopped by {name}")
        else:
            log.warning("cancelling the run now", run_id=handle.run_id, signal=name)
            tg.start_soon(stop, handle, 0, f"stopped by {name}")


async def stop(handle: RunHandle, grace: float | None, reason: str) -> None:
    """`handle.stop(grace, reason=reason)`, for a task group to start (its result unread)."""
    await handle.stop(grace, reason=reason)


@contextmanager
def signal_receiver() -> Iterator[AsyncIterator[int]]:
    """`anyio.open_signal_receiver` for SIGINT and SIGTERM; where the event loop cannot catch
    signals (asyncio on Windows), none is caught and Ctrl-C stays a `KeyboardInterrupt`."""
    if sys.platform == "win32":
        yield _never()
        return
    with anyio.open_signal_receiver(*_SIGNALS) as signals:
        yield signals


async def _never() -> AsyncIterator[int]:
    await anyio.Event().wait()  # no timer at math.inf: a FakeClock would race to it
    yield 0  # pragma: no cover
