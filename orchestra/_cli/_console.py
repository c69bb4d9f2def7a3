"""A run watched from a terminal: the live view, control keys, signals, results as they finish.

What `orchestra run` and `orchestra demo` do with a run (and what a script can do with
`watch(orch, input)`, or `run_main(orch, input)`, the same without the view): the run goes on
through its `RunHandle`; the live view (`progress`) is drawn on stderr (redrawn in place on a
terminal, a plain line every few seconds elsewhere); each `TaskResult` can be handed to a writer as
it finishes; SIGINT / SIGTERM stop the run gracefully and a second one cancels it at once; and
when stdin is a terminal, single keys steer it:

    p  pause (no new attempt starts; running ones finish)     r  resume
    s  stop gracefully (running attempts get `grace` seconds)  c  cancel now (stop with no grace)

Keys are read in cbreak mode (one key at a time, no echo) through the event loop's reader, and the
terminal is restored however the run ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import sys
from functools import partial
from typing import IO, TYPE_CHECKING, Any

import anyio

from .._config import finite
from .._core._orchestrator import Orchestrator
from .._exceptions import ConfigError
from ._progress import progress
from ._signals import on_signals, signal_receiver, stop

if TYPE_CHECKING:
    from collections.abc import AsyncIterable, Callable, Iterable, Iterator

    from anyio.abc import TaskGroup
    from rich.console import Console

    from .._core._handle import RunHandle
    from .._result import RunResult
    from .._task import Task, TaskResult

__all__ = ("KEYS", "key_pressed", "run_main", "watch")

KEYS = "p pause · r resume · s stop · c cancel"


async def watch(
    orch: Orchestrator,
    input: Any = None,
    *,
    tasks: Iterable[Task] | AsyncIterable[Task] | None = None,
    write: Callable[[TaskResult], None] | None = None,
    console: Console | None = None,
    keys: IO[str] | None = None,
    grace: float | None = 10.0,
    run_id: str | None = None,
    view: bool = True,
) -> RunResult:
    """Run `orch` on `input` (or `tasks`) with the live view on `console` (stderr by default; none
    without `view`), `write(result)` for each task as it finishes, signals turned into a graceful
    stop, and single keys from `keys` (a terminal: cbreak mode) steering the run. Returns the
    `RunResult`; what the run raised (an `InputError`) is raised as it is."""
    # The receiver is open before the run starts: a signal at any moment is ours, never a
    # KeyboardInterrupt from the middle of the loop.
    with signal_receiver() as signals:
        async with orch:
            handle = orch.start(input, tasks=tasks, run_id=run_id)
            results = handle.results() if write is not None else None
            async with anyio.create_task_group() as tg:
                tg.start_soon(on_signals, signals, handle, grace, tg)
                if keys is not None:
                    tg.start_soon(_read_keys, keys, handle, grace, tg)
                if results is not None and write is not None:
                    tg.start_soon(_write_all, results, write)
                if view:
                    await progress(handle, console=console)
                try:
                    result = await handle
                except Exception as exc:  # raised below, as it is (not in an ExceptionGroup)
                    error: Exception | None = exc
                else:
                    error = None
                finally:
                    tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return result


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
    # The watched run of `orchestra run` without its view: one way to run under signals.
    return anyio.run(
        partial(watch, orch, input, tasks=tasks, run_id=run_id, grace=grace, view=False)
    )


def key_pressed(handle: RunHandle, key: str, grace: float | None, tg: TaskGroup) -> str | None:
    """Act on one key; what it did, for the view (None: not a key of ours)."""
    key = key.lower()
    if key == "p":
        handle.pause()
        return "paused"
    if key == "r":
        handle.resume()
        return "resumed"
    if key == "s":
        tg.start_soon(stop, handle, grace, "stopped from the keyboard")
        return "stopping"
    if key == "c":
        tg.start_soon(stop, handle, 0, "cancelled from the keyboard")
        return "cancelling"
    return None


async def _write_all(
    results: AsyncIterable[TaskResult], write: Callable[[TaskResult], None]
) -> None:
    async for result in results:
        write(result)


async def _read_keys(keys: IO[str], handle: RunHandle, grace: float | None, tg: TaskGroup) -> None:
    """Read single keys from `keys` until the run ends (the task group is cancelled then)."""
    fd = keys.fileno()
    with _cbreak(keys):
        while not handle.done:
            await anyio.wait_readable(fd)
            pressed = os.read(fd, 64)  # what was typed: readable, so this does not block
            if not pressed:
                return  # end of input
            for key in pressed.decode(errors="ignore"):
                key_pressed(handle, key, grace, tg)


@contextlib.contextmanager
def _cbreak(stream: IO[str]) -> Iterator[None]:
    """One key at a time, no echo, while the block runs; the terminal as it was afterwards. A
    stream that is not a terminal (a pipe in tests) is read as it is."""
    if not stream.isatty() or sys.platform == "win32":
        yield
        return
    import termios
    import tty

    fd = stream.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
