"""`run_main`: a script's entry point that turns Ctrl-C and SIGTERM into a graceful stop.

The first SIGINT or SIGTERM stops the run gracefully (`RunHandle.stop(grace)`): no new attempt
starts, the running ones get `grace` seconds, the rest is cancelled, and the partial `RunResult`
is returned as usual. A second signal cancels what still runs at once; the result of the cancelled
run is still returned, never a `KeyboardInterrupt` traceback.
"""

from __future__ import annotations

import asyncio
import math
import signal
import sys
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio

from .._config import finite
from .._exceptions import ConfigError
from .._log import get_logger

if TYPE_CHECKING:
    from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator

    from anyio.abc import TaskGroup

    from .._core._handle import RunHandle
    from .._core._orchestrator import Orchestrator
    from .._result import RunResult
    from .._task import Task

__all__ = ("run_main",)

log = get_logger("orchestra")

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run_main(
    orch: Orchestrator,
    input: Any = None,
    *,
    tasks: Iterable[Task] | AsyncIterable[Task] | None = None,
    run_id: str | None = None,
    grace: float | None = 10.0,
) -> RunResult:
    """Run `orch` on `input` (or `tasks`) from synchronous code and return the `RunResult`;
    SIGINT / SIGTERM stop the run gracefully (see the module's docstring).

    ``result = orchestra.run_main(orch, contracts)`` at the bottom of a script is the whole of
    it: an event loop is started for the run (so call it where none runs) and the orchestrator is
    entered and left. `grace` is how long running attempts may take to finish after the first
    signal (None: as long as they take; 0: cancel them at once).
    """
    from .._core._orchestrator import Orchestrator  # here: a module below the orchestrator's

    if not isinstance(orch, Orchestrator):  # else a TypeError from inside the run
        raise ConfigError(f"run_main() runs an Orchestrator, got {orch!r}")
    if grace is not None and (
        isinstance(grace, bool)
        or not isinstance(grace, int | float)
        or not grace >= 0
        or (grace != math.inf and not finite(grace))
    ):
        raise ConfigError(f"grace must be a number >= 0 or None, got {grace!r}")
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass  # no event loop runs here: the one place run_main can start its own
    else:  # anyio.run would raise "Already running asyncio in this thread"
        raise ConfigError(
            "run_main() starts an event loop, and one runs here already: in async code, "
            "`await orch.run(...)` instead"
        )
    # The watched run of `orchestra run` without its view: one way to run under signals. Imported
    # here because `_console` builds on this module's receiver.
    from ._console import watch

    return anyio.run(
        partial(watch, orch, input, tasks=tasks, run_id=run_id, grace=grace, view=False)
    )


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
