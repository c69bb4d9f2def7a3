"""A durable run's writes: what changed since the last one, written to the file once a window.

**Window.** Every `window` seconds (50 ms by default) the records the run touched since the last
write are written as rows in one transaction, with the new tasks, the failed attempts and the
journal's events. Writing a task's *state* rather than each transition coalesces the several
transitions of a task inside one window into one row update.

**Cost.** Measured (`python -m benchmarks.sqlite`, 20,000 no-op tasks, the 2-core machine): 19 to
20 µs per task against 6.6 µs in memory (2.9x to 3.1x over runs; it was 54 µs). What made it so,
each measured: a task's row is written once it has ended when it ends inside its window (one
insert, no update); a row with the usual NULLs goes through statements that bind 18 parameters
instead of 33 (`_INSERT_LEAN`, `_UPDATE_LEAN` in `_writes.py`, the rows built in
`_rows.py`: binding dominates, 3.6 µs against 9.6 per insert); the claim index holds ready
tasks only (a row written ended enters no index but the key); and the journal holds only what a
task's row cannot say: its admission (`admitted`), its last start and its end are read from the row
by the journal's readers (`_JOURNAL` in `_admin.py`), so a task that succeeds at once is no
journal row at all (there were four). Tried and dropped: starting a write before the window ends
(when many tasks changed) made both threads slower (they share the GIL: 0.65 s against 0.55 s
then).

**Durable before acknowledged.** The run's `close()` (called whatever its end) commits what is
buffered and waits for it, so a `RunResult` is returned only once every result in it is on disk.
A result streamed (`Orchestrator.stream`) while the run goes on is handed over at once and is
durable within a few windows (at most two wait for the writer: `_BEHIND`, backpressure on
dispatch and admission): a process killed before their commit loses those results, and their
tasks run again on resume with the attempt counted (execution is at least once; a result is
recorded once). Holding each streamed result back until its commit would delay every result by up
to a window; a stream reader that needs it can wait for the run's end.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from ..._clock import current_clock
from ..._task import READY, SUCCEEDED, TERMINAL
from . import _writes as writes

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable
    from concurrent.futures import Future

    from ..._record import Record
    from ..._task import Attempt
    from .._memory import MemoryRun
    from .._protocol import Listener
    from ._keys import Keys
    from ._rows import Rows
    from ._share import Sharing
    from ._store import SQLiteStore

__all__ = ("Window",)

# Windows a run may have with the writer thread uncommitted (one being written, one waiting): at
# this many it starts no attempt and admits nothing until one is committed, so a kill loses at most
# these and the one being gathered, and memory stays flat however far the disk is behind.
_BEHIND = 2


class Window:
    """What one run changed since its last write, and its writes with the writer thread.

    The run adds to it as its steps go (`touch` a record whose row must be written again; `new`,
    `attempts`, `events`); `flush` hands it all to the writer thread in one transaction, from a
    timer a window after the first change, with the coordinator's heartbeat and what it learns of
    the worker processes (`_share`).
    """

    def __init__(
        self,
        run_id: str,
        name: str,
        store: SQLiteStore,
        loop: asyncio.AbstractEventLoop | None,
        listener: Listener,
        memory: MemoryRun,
        rows: Rows,
        keys: Keys,
        sharing: Sharing,
        clock: Callable[[], float],
    ) -> None:
        self._run_id = run_id
        self._name = name  # the coordinator's, as the file knows it
        self._store = store
        self._loop = loop
        self._listener = listener
        self._memory = memory
        self._rows = rows
        self._keys = keys
        self._sharing = sharing
        # Admitted, not written yet: (record, payload JSON, loop time of its admission).
        self.new: list[tuple[Record, str, float]] = []
        self.dirty: dict[str, Record] = {}  # changed since the last write
        self.attempts: list[tuple[str, Attempt]] = []  # (task id, a failed attempt)
        self.events: list[tuple[Any, ...]] = []  # (task id, loop time, event, agent, n, detail)
        self._writes: list[Future[Any]] = []
        # For the journal's readers in this process (`horizon`): the loop time the window being
        # gathered began at (every event it holds is dated from then on), and each window handed
        # to the writer and not committed yet, with the time it began at, oldest first.
        self._clock = clock
        self._began = clock()
        self._unwritten: deque[tuple[Future[Any], float]] = deque()
        # Backpressure: `_BEHIND` windows are with the writer; the next one, due meanwhile, waits
        # for it (`_deferred`); dispatch (`Listener.hold`) and admission (`backpressure`) go on
        # when one is committed (`_caught_up`).
        self._behind = False
        self._deferred = False
        self._writer_free: asyncio.Future[None] | None = None
        # While behind, the run waits on the writer's thread, which a `FakeClock` cannot see: it
        # is told (`real_work`), so virtual time passes at the real pace instead of jumping to
        # the next timer (a deadline, a test's guard) before the disk answers.
        self._real_work: contextlib.ExitStack | None = None
        # The first write that failed (or the file's refusal of a claim): nothing more is written,
        # and the run's close raises it.
        self.error: BaseException | None = None
        self._closing = False  # the last window: the claims of keys left are released
        self.closed = False
        self._timer: asyncio.TimerHandle | None = None
        self._armed = False
        self._beat_every = min(0.25, store.lease / 3)
        self._beat_at = 0.0  # wall time of the last heartbeat written
        self._beat_timer: asyncio.TimerHandle | None = None
        if loop is not None:
            self._beat_timer = loop.call_later(self._beat_every, self._beat)

    def touch(self, record: Record) -> None:
        """Write `record`'s row again in the next window."""
        self.dirty[record.id] = record
        if not self._armed:
            self.arm()

    def arm(self) -> None:
        """Write a window after this one (its timer, unless it has one)."""
        if self._armed or self.closed:
            return
        self._armed = True
        if self._loop is not None:
            self._timer = self._loop.call_later(self._store.window, self.flush)

    def flush(self) -> Future[Any] | None:
        """Hand what changed since the last write to the writer thread (one transaction)."""
        self._armed = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.error is not None:  # the run is stopping on it: nothing more is written
            return None
        if self._behind and not self._closing:  # gathered on, written once the writer has room
            self._deferred = self._armed = True  # (no timer, no heartbeat write meanwhile)
            return None
        now = time.time()
        keys = self._keys
        sharing = self._sharing
        beating = self._loop is not None and (
            sharing.active or now - self._beat_at >= self._beat_every
        )
        began, self._began = self._began, self._clock()  # (what comes from now on: the next one)
        journal = bool(self.new or self.dirty or self.events or self.attempts)
        if not (journal or keys.claims or beating):
            return None
        # Rows with the usual NULLs go through a statement that binds fewer parameters (`_LEAN`):
        # binding dominates an insert's cost (measured: 18 parameters 3.6 µs, 33 parameters 9.6).
        rows = self._rows
        shared = sharing.active
        offered = sharing.offered
        waiting = keys.waiting  # held back for a key's result: never a worker's to claim
        new: tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]] = ([], [])
        memory = self._memory
        for record, payload, admitted in self.new:
            key = record.task.key
            held = bool(waiting) and waiting.get(key) is record  # type: ignore[arg-type]
            took = key is not None and memory.took_key(record)
            lean, row = rows.new_row(record, payload, admitted, held, took)
            new[lean].append(row)
            if shared and record.state is READY and not held:
                offered.add(record.id)
        dirty: tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]] = ([], [])
        shared_rows: list[tuple[Any, ...]] = []
        if self.dirty:
            fresh = {record.id for record, _, _ in self.new}  # their rows hold their state
            for task_id, record in self.dirty.items():
                if task_id in fresh:
                    continue
                if shared:  # a worker may hold the row: `_UPDATE_SHARED` says when it is ours
                    held = bool(waiting) and waiting.get(record.task.key) is record  # type: ignore[arg-type]
                    shared_rows.append(rows.shared_row(record, held))
                    if record.state is READY and not held:
                        offered.add(task_id)
                    else:
                        offered.discard(task_id)
                else:
                    lean, row = rows.state_row(record)
                    dirty[lean].append(row)
        attempts = [rows.attempt_row(task_id, a) for task_id, a in self.attempts]
        offset = rows.offset
        run_id = self._run_id
        # The start of a task that succeeded at its first attempt is not a journal row: its row
        # says it (`started`, `agent`, `attempts`), and the journal's readers add the event from
        # it. Any other start is a row (the row's `started` is the first attempt's, and a failed
        # task's row names no agent).
        touched = self.dirty
        events = [
            (run_id, task_id, at + offset, event, agent, number, detail)
            for task_id, at, event, agent, number, detail in self.events
            if event != "started"
            or number != 1
            or (ended := touched.get(task_id)) is None
            or ended.state is not SUCCEEDED
            or ended.attempts != 1
        ]
        keyed: list[str] = [r.task.key for r in self.dirty.values() if r.task.key is not None]
        claimed = keys.rows(keyed, closing=self._closing, remote=sharing.remote)
        results = keys.results(keyed) if keyed else []
        self.new = []
        self.dirty = {}
        self.attempts = []
        self.events = []
        beat = None
        if beating:
            self._beat_at = now
            # Polled while workers may hold rows of the run (`active`), shared or not: a restart
            # with no live worker must still take back a dead worker's lease and settle what a
            # worker completed.
            remote = [i for i, r in sharing.remote.items() if r.state not in TERMINAL]
            beat = (self._name, now, self._store.lease, sharing.shared, sharing.active, remote)
        write = self._store.submit(
            writes.write,
            run_id,
            new,
            dirty,
            attempts,
            events,
            claimed,
            shared_rows,
            beat,
            self._name,
        )
        if keys.claims or sharing.active:
            self.arm()  # the next heartbeat, the next look at what workers did
        if journal:
            self._unwritten.append((write, began))
        write.add_done_callback(lambda done: self._written(done, results))
        self._writes = [w for w in self._writes if not w.done()]
        self._writes.append(write)
        if len(self._writes) >= _BEHIND and self._loop is not None and not self._closing:
            self._behind = True
            real_work = getattr(current_clock(), "real_work", None)
            if real_work is not None and self._real_work is None:
                self._real_work = contextlib.ExitStack()
                self._real_work.enter_context(real_work())
            self._listener.hold(True)
        return write

    def horizon(self) -> float:
        """The loop time before which the run's journal gains no more event from this process:
        the start of the oldest window not committed yet (its events are dated from then on), or
        now when none is pending. Every event of the run is dated by the loop (its clock read as
        it happens, on the loop, and put in the window being gathered at once), and the writer
        commits windows in the order they were handed over; so what is dated before this is in
        the file, and a reader that reads the file after asking sees it."""
        unwritten = self._unwritten
        while unwritten and unwritten[0][0].done():
            unwritten.popleft()
        if unwritten:
            return unwritten[0][1]
        if self.new or self.dirty or self.events or self.attempts:
            return self._began
        return self._clock()

    def backpressure(self) -> asyncio.Future[None] | None:
        """What admission waits for while the writer is `_BEHIND` windows behind (None: admit)."""
        if not self._behind:
            return None
        if self._writer_free is None or self._writer_free.done():  # (a cancelled waiter's)
            assert self._loop is not None  # (never behind without one)
            self._writer_free = self._loop.create_future()
        return self._writer_free

    def _caught_up(self) -> None:
        """On the loop, after each window the writer committed: once fewer than `_BEHIND` are
        left with it, attempts start and input is admitted again, and the window gathered
        meanwhile is given its timer. Every write asks, not only one made while behind: a flag
        read across the two threads could miss the one that ends the wait."""
        if not self._behind or self.error is not None:  # (a failed write stops the run)
            return
        self._writes = [w for w in self._writes if not w.done()]
        if len(self._writes) >= _BEHIND:
            return
        self._behind = False
        self._no_real_work()
        if self._deferred:
            self._deferred = self._armed = False
            self.arm()
        if self._beat_timer is None and self._loop is not None and not self.closed:
            self._beat_timer = self._loop.call_later(self._beat_every, self._beat)
        free, self._writer_free = self._writer_free, None
        if free is not None and not free.done():
            free.set_result(None)
        self._listener.hold(False)

    def _no_real_work(self) -> None:
        if self._real_work is not None:
            self._real_work.close()
            self._real_work = None

    def _written(self, write: Future[Any], results: list[tuple[str, Any]]) -> None:
        if write.cancelled():  # a window queued behind a failed one (below)
            return
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop: the run is over
                self._loop.call_soon_threadsafe(self._caught_up)
        error = write.exception()
        if error is not None:
            first = self.error is None
            self.error = self.error or error
            # The windows queued behind it would each wait out the busy timeout too (a file
            # locked by a stopped process), and `close` waits for them on the loop: dropped.
            for pending in list(self._writes):
                pending.cancel()
            if first and self._loop is not None and not self.closed:
                # Nothing more can be made durable: the run stops now (no new attempt spends
                # money on results that cannot be kept), and its `close` raises the error.
                with contextlib.suppress(RuntimeError):  # a closed loop: the run is over
                    self._loop.call_soon_threadsafe(
                        self._listener.stop, f"the store failed: {error}"
                    )
            return
        if results:
            self._keys.written(results)
        polled = write.result()
        if polled is not None and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop: the run is over
                self._loop.call_soon_threadsafe(self._sharing.polled, polled)

    def _beat(self) -> None:
        """Every `_beat_every` seconds: the coordinator's heartbeat (and a look for workers),
        written with the window's changes if there are any."""
        self._beat_timer = None
        if self.closed or self._loop is None or self._behind:  # (`_caught_up` beats again)
            return
        if not self._armed:
            self.flush()
        self._beat_timer = self._loop.call_later(self._beat_every, self._beat)

    def close(self) -> None:
        """The last window: everything left is written, and waited for until it is durable (a
        write that failed is kept in `error`)."""
        if self._beat_timer is not None:
            self._beat_timer.cancel()
        if self._timer is not None:
            self._timer.cancel()
        self._closing = True  # the claims of its keys left are released (`Keys.rows`)
        self.flush()
        self.closed = True
        if self._timer is not None:  # a shared run's flush arms the next window: none comes now
            self._timer.cancel()  # (it would write what the run's end does after this: the
            self._timer = None  # tasks a stop or a cancel ends are not written down)
        self._armed = False
        for write in self._writes:
            try:
                write.result()
            except BaseException as exc:  # recorded by `_written`; raised once, by the run
                self.error = self.error or exc
        self._writes = []
        self._no_real_work()
