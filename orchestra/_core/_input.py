"""`Input`: a run's input admitted into its store, whole or streamed, with backpressure.

A whole input (a list or a tuple) is checked and admitted before anything runs. A streamed one (an
iterable, a generator, an async iterable) is admitted as it arrives, by a task of the run's own
(`feed`), and never gets ahead of the run: at most `window` tasks unfinished, the results the
run's reader has not taken counted among them, unless none can progress without more input; and
none while the store's writes are behind (`RunStore.backpressure`). What the input raises ends the
run and reaches the caller as it is (`error`).
"""

from __future__ import annotations

from collections.abc import AsyncIterable
from itertools import islice
from operator import length_hint
from typing import TYPE_CHECKING, Protocol

import anyio
import anyio.lowlevel

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Sequence

    from anyio.streams.memory import MemoryObjectSendStream

    from .._task import Task, TaskResult
    from ..stores._protocol import RunStore
    from ._control import Control
    from ._report import Report

__all__ = ("Input", "Owner")

_CHUNK = 1_024  # a plain iterable input is admitted this many tasks at a time


class Owner(Protocol):
    """What the input asks of its run: its store and report, its reader's stream of results (the
    unread ones count against the window), and to end when the input fails or all is done."""

    store: RunStore
    report: Report
    result_stream: MemoryObjectSendStream[TaskResult] | None

    def end(self) -> None: ...


class Input:
    """The input of one run (see the module's docstring)."""

    __slots__ = ("_control", "_run", "_window", "done", "error", "left", "room")

    def __init__(self, run: Owner, window: int, control: Control) -> None:
        self._run = run
        self._window = window
        self._control = control  # its standing cancels and priorities meet each admitted task
        self.done = False  # every task of the input is admitted
        self.error: BaseException | None = None  # what the input raised: the run's caller gets it
        # Items of a streamed input never read when the run ended before its end: known for an
        # iterator with a length hint, else None (a generator's rest is unknown).
        self.left: int | None = None
        # Set when the window may have room (a task ended, the reader took a result) while the
        # input waits for it.
        self.room: anyio.Event | None = None

    def admit_whole(self, tasks: Sequence[Task]) -> None:
        """Check and admit a whole input, before anything runs."""
        run = self._run
        run.store.admit(tasks, where="tasks", forward=True)
        run.report.admitted(tasks)
        self.close()

    async def feed(self, source: Iterable[Task] | AsyncIterable[Task]) -> None:
        """Admit a streamed input, with backpressure (see the module's docstring), then close it.

        What the input raises (an `InputError` for a bad task, or the source's own error) is kept
        in `error` and ends the run; the source is closed however the run ends."""
        run = self._run
        store = run.store
        report = run.report
        control = self._control
        window = self._window
        pulled = 0
        iterator: Iterator[Task] | None = None
        try:
            if isinstance(source, AsyncIterable):
                async for task in source:  # each item admitted as soon as it arrives
                    if store.unfinished >= window or run.result_stream is not None:
                        await self._wait_for_room()
                    while (behind := store.backpressure()) is not None:
                        await behind
                    store.admit_one(task, pulled)
                    report.admitted_one(task.kind)
                    pulled += 1
                    if control.standing:
                        control.admitted((task,))
            else:  # a plain iterable never waits: admit it in chunks, as the window allows
                iterator = iter(source)
                while True:
                    await self._wait_for_room()
                    while (behind := store.backpressure()) is not None:
                        await behind
                    room = max(1, min(_CHUNK, window - store.unfinished - self._unread()))
                    chunk = list(islice(iterator, room))
                    if not chunk:
                        break
                    store.admit(chunk, where="input item", forward=False, first_index=pulled)
                    report.admitted(chunk)
                    pulled += len(chunk)
                    if control.standing:
                        control.admitted(chunk)
                    await anyio.lowlevel.checkpoint()  # let the dispatcher start on it
        except (Exception, SystemExit, KeyboardInterrupt) as exc:
            # `sys.exit()` and Ctrl-C from the source too: raised in this task, they would leave the
            # event loop and abandon the caller's `await`; the caller gets them once the run ends.
            self.error = exc
            run.end()
            return
        finally:
            if iterator is not None:  # read before `_close`, which may end a generator
                hint = length_hint(iterator, -1)
                self.left = hint if hint >= 0 else None
            with anyio.CancelScope(shield=True):
                await _close(source)
        self.close()
        if not store.unfinished:
            run.end()

    async def _wait_for_room(self) -> None:
        # Every unfinished task counts, and every result the stream's reader has not taken yet;
        # but when no task is ready or running (all wait for dependencies or groups that only the
        # rest of the input can complete) and no result waits for the reader, more input is the
        # only way forward, and it is let in.
        store = self._run.store
        while True:
            unread = self._unread()
            if store.unfinished + unread < self._window or not (
                unread or store.unfinished > store.pending
            ):
                return
            event = self.room = anyio.Event()
            await event.wait()

    def _unread(self) -> int:
        results = self._run.result_stream
        return 0 if results is None else results.statistics().current_buffer_used

    def room_freed(self) -> None:
        """A task ended, or the reader took a result: the window may have room."""
        if self.room is not None:
            self.room.set()
            self.room = None

    def close(self) -> None:
        """Every task of the input is admitted."""
        self.done = True
        self._control.input_closed()
        self._run.store.close_input()


async def _close(source: object) -> None:
    aclose = getattr(source, "aclose", None)
    if aclose is not None:
        await aclose()
        return
    close = getattr(source, "close", None)
    if close is not None:
        close()
