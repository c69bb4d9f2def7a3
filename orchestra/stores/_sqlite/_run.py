"""A durable run: a memory run written behind to the SQLite file (`SQLiteStore`'s runs).

**Shape.** The dispatcher works with live record objects, so `SQLiteRun` *holds* a `MemoryRun` (the
in-process state machine: readiness, dependencies, groups, priority order, tokens) and writes every
change behind it, as a write-ahead journal of that state: each protocol call is passed on to the
memory run, and the records it touched (the ones it was handed, and every one the memory run
reports ready or ended, which covers spawns, cascades and groups) are marked for its `Window`,
which writes them as rows once a window (`_window.py`, with what that costs and when a
result is durable). Opening a run id the file knows takes back what an earlier process left of it
(`Resume`, `stores/_resume.py`); idempotency keys are claimed, waited for and reused through the
file by the run's `Keys` (`_keys.py`).

**Several processes.** A worker process claims with one statement in a
``BEGIN IMMEDIATE`` transaction (SQLite's single writer lock makes it atomic)::

    UPDATE tasks SET state = 'claimed', token = token + 1, lease_owner = :owner,
                     lease_expires = :now + :lease
    WHERE rowid = (SELECT rowid FROM tasks WHERE run_id = :run AND state = 'ready'
                   AND kind IN (...) ORDER BY priority, seq LIMIT 1)
    RETURNING id, token, ...

and every later write (heartbeat, start, fail, settle) carries the token:
``UPDATE ... WHERE run_id = ? AND id = ? AND token = ?``, refused (no row changed) once the task
was re-leased; `due` returns the tasks whose ``lease_expires`` passed to ready, attempt counted.
The schema has the columns (`token`, `lease_owner`, `lease_expires`) and the index
(`tasks_ready`) for it; the claims are in `_leases.py`, the coordinator's side in
`_share.py`.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from typing import TYPE_CHECKING, Any

from pydantic_core import to_json

from ..._exceptions import StoreError
from ..._output import stored_json
from ..._task import FAILED, SUCCEEDED, TERMINAL, Attempt, Task
from .._memory import MemoryRun
from .._protocol import KEEP
from .._resume import Resume
from .._room import Room
from . import _leases as leases
from . import _writes as writes
from ._keys import Keys
from ._rows import Rows, encode
from ._share import Sharing
from ._window import Window

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from ..._admission import Admission
    from ..._record import Record
    from .._protocol import Listener, Selector
    from ._store import SQLiteStore

__all__ = ("SQLiteRun",)


class SQLiteRun:
    """One run of a `SQLiteStore`: a `MemoryRun` for the state, every change written behind it."""

    quiet = None  # the `MemoryRun`'s listener: it hears every end, to write it down

    def __init__(
        self,
        store: SQLiteStore,
        run_id: str,
        admission: Admission,
        listener: Listener,
        clock: Callable[[], float],
        task_timeout: float | None,
        compact: bool,
    ) -> None:
        self.run_id = run_id
        self.resumed = 0
        self._store = store
        self._listener = listener
        self._now = clock
        self._memory = memory = MemoryRun(run_id, admission, self, clock, task_timeout, compact)
        # Loop time + offset = wall time; wall0 is the memory run's zero (its records' `started`
        # and `finished` count from it), so that a task's end read from its row and the journal's
        # events are on one clock, in order.
        wall0 = time.time()
        offset = wall0 - memory.t0
        self._admitting = False  # inside the memory run's admission: its `ready`s are not events
        # The tasks a settling attempt spawned (by `id`): ready at their admission, not an event.
        self._spawning: frozenset[int] = frozenset()
        self._outputs: dict[str, str] = {}  # id -> its output's JSON (encoded when it settled)
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # driven directly (the contract suite): written at `close`
            loop = None
        # Tasks held back and now to run here (a key's wait ended in a claim; the file granted a
        # claim), for `claim` to hand out first.
        self._runnable: list[Record] = []
        self.name = leases.identity(store.owner)  # this process, as the file knows it
        other = store.open_runs.get(run_id)
        if other is not None and not other.closed:
            raise StoreError(
                f"run {run_id!r} is already being run by this process, on this {store!r}: a run "
                "has one coordinator (more processes join it as workers: `orch.work(...)`)"
            )
        # Known to this process as its run until `close`, so that a hold the file keeps in its
        # name after it (one a failed run could not let go of) does not lock the process out.
        leases.coordinating(self.name, run_id, True)
        self._let_go = weakref.finalize(self, leases.coordinating, self.name, run_id, False)
        try:
            rows, attempts, seq = store.call(writes.open_run, run_id, wall0, self.name, store.lease)
        except BaseException:
            self._let_go()
            raise
        self._rows = Rows(run_id, wall0, offset, self._outputs, seq)
        self._keys = Keys(self, store, loop)  # idempotency keys (`_keys`)
        # With worker processes (`_share`).
        self._sharing = Sharing(self, store, loop, memory, self._rows, admission.kinds, clock)
        self._window = Window(
            run_id,
            self.name,
            store,
            loop,
            listener,
            memory,
            self._rows,
            self._keys,
            self._sharing,
            clock,
        )
        self._resume = Resume(run_id, admission, self._rows, (rows, attempts) if rows else None)
        self._room = Room(self, listener)  # claims sized by what the agents can start
        store.open_runs[run_id] = self

    # -- counters (the memory run's) -------------------------------------------------------------

    @property
    def unfinished(self) -> int:
        return self._memory.unfinished

    @property
    def pending(self) -> int:
        return self._memory.pending

    def queue_depths(self) -> dict[int, int]:
        """Ready tasks by priority (for the run's status): the memory run's queue holds them until
        this process claims them. O(priority levels)."""
        return self._memory.queue_depths()

    @property
    def closed(self) -> bool:
        """Its last window is written: nothing more of it is (`close`)."""
        return self._window.closed

    def horizon(self) -> float | None:
        """The wall time (as the journal dates it) before which the run's journal gains no more
        event, for a reader in this process (the service's event stream): what this process
        stamps and has not committed (`Window.horizon`). None while worker processes may serve
        the run: they date what they write by their own clocks and commit it when they can.
        Asked on the loop the run runs on."""
        if self._sharing.active:
            return None
        return self._window.horizon() + self._rows.offset

    # -- the memory run's listener: what it readies and ends is written down ---------------------

    def ready(self, record: Record) -> None:
        if record.task.key is not None and not self._admitting and self._memory.holds_key(record):
            self._keys.took_over(record)  # (or it holds it already: a retry)
        window = self._window
        window.touch(record)
        if not self._admitting and id(record.task) not in self._spawning:
            # (else ready at its admission: its row's `admitted` says it)
            window.events.append((record.id, self._now(), "ready", None, None, None))
        self._listener.ready(record)

    def ready_all(self, records: Sequence[Record]) -> None:
        window = self._window
        dirty = window.dirty
        if self._admitting:
            for record in records:
                dirty[record.id] = record
        else:
            now = self._now()
            events = window.events
            spawning = self._spawning
            for record in records:
                dirty[record.id] = record
                if id(record.task) not in spawning:
                    events.append((record.id, now, "ready", None, None, None))
        window.arm()
        self._listener.ready_all(records)

    def wake(self) -> None:
        self._listener.wake()

    def stop(self, reason: str) -> None:
        self._listener.stop(reason)

    def hold(self, held: bool) -> None:
        self._listener.hold(held)

    def room(self, kind: str, *, hold: bool = True) -> int:
        return self._listener.room(kind, hold=hold)

    def stalled(self, longer_than: float) -> list[str]:
        return self._listener.stalled(longer_than)

    def finished(self, record: Any) -> None:
        # Not a journal row: a task ends once, and its row says how (`state`, `finished`, `agent`,
        # `attempts`, `error`); the journal's readers add the event from it (`retry` writes it
        # into the journal before it reopens the task).
        self._window.touch(record)
        self._listener.finished(record)

    # -- admission -------------------------------------------------------------------------------

    def admit(
        self,
        tasks: Sequence[Any],
        *,
        where: str,
        forward: bool,
        first_index: int = 0,
    ) -> int:
        self._take_back()
        payloads = encode(tasks, where, first_index, self._store)
        self._admitting = True
        try:
            added, _ = self._resume.admit(
                self._memory, tasks, where=where, forward=forward, first_index=first_index
            )
        finally:
            self._admitting = False
        self._added(tasks, payloads)
        return added

    def admit_one(self, task: Any, index: int) -> None:
        self._take_back()
        payloads = encode((task,), "input item", index, self._store)
        self._admitting = True
        try:
            admitted = self._resume.admit_one(self._memory, task, index)
        finally:
            self._admitting = False
        if admitted:
            self._added((task,), payloads)

    def close_input(self) -> None:
        self._take_back()
        self._memory.close_input()

    def backpressure(self) -> asyncio.Future[None] | None:
        return self._window.backpressure()

    def check_spawn(self, task: Task, parent: Any, pending: dict[str, Task]) -> None:
        self._memory.check_spawn(task, parent, pending)
        encode((task,), f"task spawned by {parent.id!r}", None, self._store)

    def _take_back(self) -> None:
        """What an earlier process left of this run, taken back as the input starts coming."""
        self.resumed += self._resume.take_back(self._memory, self._listener, self._sharing)

    def _added(self, tasks: Sequence[Any], payloads: list[Any]) -> None:
        """Queue the rows of the tasks the memory run just took in (not the ones it already had)."""
        memory = self._memory
        resume = self._resume
        new = self._window.new
        keyed: list[Record] = []
        now = self._now()
        for task, encoded in zip(tasks, payloads, strict=True):
            record = memory.record_of(task.id)
            if record is None or record.task is not task:
                continue  # refused as the same task
            if resume.stored and resume.knows(task.id):
                continue
            payload, text = encoded
            if task.payload is not payload:  # admission validated it into its model
                text = to_json(task.payload).decode()
            new.append((record, text, now))
            if memory.holds_key(record):  # (the others with its key follow it in the run)
                keyed.append(record)
        self._window.arm()
        # One that took the key over from a task of the run (which waits for it: `_follow`) takes
        # over the run's claim on it, or its wait; the others claim theirs in one transaction.
        fresh = [record for record in keyed if not self._keys.inherit(record)]
        if fresh:
            self._keys.reuse(fresh)

    # -- dispatch --------------------------------------------------------------------------------

    def claim(self) -> Record | None:
        # Not written down: in one process a claimed task is a ready one once the process is gone.
        if self._runnable:
            return self._runnable.pop()
        # Only what this process's agents can start now (`_room`): a worker may come and claim
        # the rest from the file at any time.
        room = self._room
        aside = room.aside
        record = room.take() if aside else None
        if record is None:
            memory = self._memory
            waiting = self._keys.waiting
            credit = room.credit
            while True:
                record = memory.claim()
                if record is None:
                    return None
                # A task waiting for its key's result stays claimed, held here, never started:
                # `Keys._poll` ends it with the result, or hands it back (`run_here`).
                if waiting and waiting.get(record.task.key) is record:  # type: ignore[arg-type]
                    continue
                kind = record.kind
                left = credit.get(kind, 0)
                if left > 0 and kind not in aside:  # `Room.fits`'s common case, inline
                    credit[kind] = left - 1
                    break
                if room.fits(record):
                    break
        if self._sharing.offered and self._sharing.held_back(record):
            return None  # a worker process may claim it too: the file decides (`_share`)
        return record

    def taken(self, kind: str) -> int:
        """The tasks of `kind` claimed here and not handed to the dispatcher yet: asked of the
        file, or granted (`_runnable`, with the ones a key's wait let go)."""
        taken = self._sharing.claiming_kinds.get(kind, 0)
        if self._runnable:
            taken += sum(r.kind == kind for r in self._runnable)
        return taken

    def take(self, record: Record) -> int:
        return self._memory.take(record)

    def heartbeat(self, record: Record, token: int) -> bool:
        return self._memory.heartbeat(record, token)

    def start(self, record: Record, token: int, agent: str) -> bool:
        if not self._memory.start(record, token, agent):
            return False
        window = self._window
        window.touch(record)
        window.events.append((record.id, self._now(), "started", agent, record.attempts, None))
        return True

    def fail(
        self,
        record: Record,
        token: int,
        attempt: Attempt,
        *,
        retry_at: float | None = None,
        next_agent: str | None = KEEP,
    ) -> bool:
        if not self._memory.fail(record, token, attempt, retry_at=retry_at, next_agent=next_agent):
            return False
        self.attempt_failed(record, attempt)
        self._window.touch(record)
        return True

    def note(self, record: Record, token: int, feedback: str, *, partial: Any = KEEP) -> bool:
        if not self._memory.note(record, token, feedback, partial=partial):
            return False
        self._window.touch(record)
        return True

    def settle(
        self,
        record: Record,
        token: int,
        status: str,
        output: Any = None,
        *,
        spawned: Sequence[Task] = (),
        agent: str | None = None,
        error: str | None = None,
        error_type: str | None = None,
        defaulted: bool = False,
        attempt: Attempt | None = None,
    ) -> bool:
        memory = self._memory
        if status is SUCCEEDED:
            if record.token != token or record.state in TERMINAL:
                return False
            # Raised where the attempt ends, before any change: it fails that attempt.
            text = stored_json(output, record.id, agent)
            if spawned:
                payloads = encode(spawned, f"tasks spawned by {record.id!r}", None, self._store)
                self._spawning = frozenset(map(id, spawned))
            try:
                settled = memory.settle(
                    record,
                    token,
                    status,
                    output,
                    spawned=spawned,
                    agent=agent,
                    error=error,
                    error_type=error_type,
                    defaulted=defaulted,
                    attempt=attempt,
                )
            finally:
                self._spawning = frozenset()
            if not settled:
                return False
            self._outputs[record.id] = text
            key = record.task.key
            if key is not None:
                self._store.unwritten_keys[key] = (text, agent)
            if spawned:
                self._added(spawned, payloads)
        elif not memory.settle(
            record,
            token,
            status,
            output,
            agent=agent,
            error=error,
            error_type=error_type,
            defaulted=defaulted,
            attempt=attempt,
        ):
            return False
        if attempt is not None:
            self.attempt_failed(record, attempt)
        return True

    def succeed(self, record: Record, token: int, output: Any, agent: str) -> bool:
        return self.settle(record, token, SUCCEEDED, output, agent=agent)

    def cancel(self, selector: Selector, reason: str, error_type: str = "Cancelled") -> list[Any]:
        return self._memory.cancel(selector, reason, error_type)

    def due(self, now: float) -> list[Any]:
        return self._memory.due(now)

    def next_due(self) -> float | None:
        return self._memory.next_due()

    # -- reading ---------------------------------------------------------------------------------

    def deps_of(self, record: Any) -> dict[str, Any]:
        return self._memory.deps_of(record)

    def results(self) -> Iterable[Any]:
        return self._memory.results()

    def state_of(self, task_id: str) -> str | None:
        return self._memory.state_of(task_id)

    def reprioritize(self, task_id: str, priority: int, *, claimed: bool = False) -> bool:
        if not self._memory.reprioritize(task_id, priority, claimed=claimed):
            return False
        record = self._memory.record_of(task_id)
        if record is not None:
            self._window.touch(record)
        return True

    # -- for its parts (`Keys`, `Sharing`): what they change goes through the run ----------------

    def touch(self, record: Record) -> None:
        """Write `record`'s row again in the next window."""
        self._window.touch(record)

    def arm(self) -> None:
        """Write a window after this one (a claim of a key, a shared run: kept live by commits)."""
        self._window.arm()

    def run_here(self, record: Record) -> None:
        """A task held back (claimed, never started: waiting for its key's result, or for the
        file's answer to a claim) runs in this process: `claim` hands it out first."""
        self._runnable.append(record)
        self._listener.wake()

    def attempt_failed(self, record: Record, attempt: Attempt) -> None:
        """Write down a failed attempt of a task: its row of `attempts`, and its journal event."""
        window = self._window
        window.attempts.append((record.id, attempt))
        # At the attempt's end, not now: before the task's own end. Made from the attempt's
        # start and duration, counted from the run's zero, not the memory run's, a hair earlier:
        # never later than now, or the task's next event (its retry made ready) came first.
        end = self._memory.t0 + attempt.started + attempt.duration
        now = self._now()
        window.events.append(
            (record.id, end if end < now else now, "attempt_failed",
             attempt.agent, attempt.number, f"{attempt.error_type}: {attempt.message}")
        )  # fmt: skip

    def end_reused(self, record: Record, output: str, agent: str | None) -> None:
        """End a task with the result its key already has (`output`: its JSON), unexecuted."""
        self._outputs[record.id] = output
        self._memory.settle(record, record.token, SUCCEEDED, json.loads(output), agent=agent)

    def end_held(self, record: Record, error: str, error_type: str) -> None:
        """Fail a task held back here (waiting for its key's result, never started)."""
        self._memory.settle(record, record.token, FAILED, error=error, error_type=error_type)

    def keep_error(self, error: BaseException) -> None:
        """The file failed a step of the run: `close` raises it (the first one)."""
        window = self._window
        window.error = window.error or error

    # -- the end ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Write down everything and wait until it is durable; raises `StoreError` if it is not."""
        self._keys.close()
        window = self._window
        window.close()
        # Let go of the run (a later process may resume it at once), even after a failed write:
        # best effort then (a file still locked or full refuses this too, and the hold lapses
        # `lease` seconds after the last heartbeat), and never closed as done.
        done = window.error is None and not self._memory.unfinished
        try:
            self._store.call(writes.close_run, self.run_id, time.time(), done, self.name)
        except StoreError as exc:
            window.error = window.error or exc
        self._let_go()  # over: a resume here need not wait for the hold to lapse
        error = window.error
        if error is not None:
            if isinstance(error, StoreError):
                raise error
            raise StoreError(f"{self._store!r} could not write run {self.run_id!r}: {error}")
