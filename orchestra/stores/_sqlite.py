"""The SQLite store: a run's tasks kept in a database file, so that a run survives its process.

**Shape.** The dispatcher works with live record objects, so `SQLiteRun` *holds* a `MemoryRun` (the
in-process state machine: readiness, dependencies, groups, priority order, tokens) and writes every
change behind it, as a write-ahead journal of that state: each protocol call is passed on to the
memory run, and the records it touched (the ones it was handed, and every one the memory run
reports ready or ended, which covers spawns, cascades and groups) are marked dirty. Every `window`
seconds (50 ms by default) the dirty records are written as rows in one transaction, with the new
tasks, the failed attempts and the journal's events. Writing a task's *state* rather than each
transition coalesces the several transitions of a task inside one window into one row update.

**Writer.** One connection, owned by one thread fed by a queue (`Writer` in
`_sqlite_writer.py`; the SQL it runs in `_sqlite_writes.py`), stdlib
`sqlite3` in WAL mode with ``synchronous=NORMAL`` (a commit survives the process being killed; a
power cut may lose the last commits). The loop thread builds the rows (plain tuples) and hands them
over; the thread runs ``executemany`` and commits, with the GIL released inside SQLite. aiosqlite
would be the same design (a thread per connection) with a future per call; the stdlib needs no
dependency and lets a window's batch be one call.

**Cost.** Measured (`python -m benchmarks.sqlite`, 20,000 no-op tasks, the 2-core machine): 19 to
20 µs per task against 6.6 µs in memory (2.9x to 3.1x over runs; it was 54 µs). What made it so,
each measured: a task's row is written once it has ended when it ends inside its window (one
insert, no update); a row with the usual NULLs goes through statements that bind 18 parameters
instead of 33 (`_INSERT_LEAN`, `_UPDATE_LEAN` in `_sqlite_writes.py`, the rows built in
`_sqlite_rows.py`: binding dominates, 3.6 µs against 9.6 per insert); the claim index holds ready
tasks only (a row written ended enters no index but the key); and the journal holds only what a
task's row cannot say: its admission (`admitted`), its last start and its end are read from the row
by the journal's readers (`_JOURNAL`), so a task that succeeds at once is no journal row at all
(there were four). Tried and dropped: starting a write before the window ends (when many tasks
changed) made both threads slower (they share the GIL: 0.65 s against 0.55 s then).

**Durable before acknowledged.** `close()` (called by the run whatever its end) commits what is
buffered and waits for it, so a `RunResult` is returned only once every result in it is on disk.
A result streamed (`Orchestrator.stream`) while the run goes on is handed over at once and is
durable within a few windows (at most two wait for the writer: `_BEHIND`, backpressure on
dispatch and admission): a process killed before their commit loses those results, and their
tasks run again on resume with the attempt counted (execution is at least once; a result is
recorded once). Holding each streamed result back until its commit would delay every result by up
to a window; a stream reader that needs it can wait for the run's end.

**Resume.** `open_run` of a run id the file knows loads its rows: ended tasks come back as they
ended (outputs as JSON values), the others wait again (claimed or running ones lost their worker
and run again, their attempts counted; a retry waiting for its due time is ready at once; a task's
timeout starts again). The run hears the ended ones (`finished`) when the input is admitted again,
so the aggregate and the report are those of an uninterrupted run. Re-admitted input is matched by
id (generated ids are generated again in the same order): the same task takes its place (the
agent gets the caller's payload object again), a different one is refused with `InputError`.

**Idempotency keys** are claimed, waited for and reused through the file by the run's `Keys`
(`_sqlite_keys.py`).

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
(`tasks_ready`) for it; the claims are in `_sqlite_leases.py`, the coordinator's side in
`_sqlite_share.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic_core import PydanticSerializationError, to_json

from .._admission import PRIORITY_MAX, PRIORITY_MIN
from .._clock import current_clock
from .._config import finite
from .._exceptions import ConfigError, InputError, StoreError
from .._output import stored_json
from .._task import (
    READY,
    SUCCEEDED,
    TERMINAL,
    Attempt,
    Task,
)
from . import _sqlite_admin as admin
from . import _sqlite_leases as leases
from . import _sqlite_writes as writes
from ._memory import MemoryRun
from ._protocol import KEEP
from ._sqlite_keys import Keys
from ._sqlite_rows import Rows
from ._sqlite_share import Sharing
from ._sqlite_writer import Writer

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from concurrent.futures import Future

    from .._admission import Admission
    from .._record import Record
    from ._protocol import Listener, Selector

__all__ = ("SQLiteRun", "SQLiteStore")

# Windows a run may have with the writer thread uncommitted (one being written, one waiting): at
# this many it starts no attempt and admits nothing until one is committed, so a kill loses at most
# these and the one being gathered, and memory stays flat however far the disk is behind.
_BEHIND = 2


class SQLiteStore:
    """Keeps runs in a SQLite database file: a run survives its process and resumes by run id.

    Args:
        path: the database file (created, with its schema, when missing).
        window: seconds between commits; a killed process loses at most the results of the
            window being gathered and of the two (at most) waiting for the writer thread, whose
            backlog holds the run back (their tasks run again on resume).
        key_lease: seconds after which an idempotency key claimed by a store that stopped
            committing (a killed process) is taken over by another submitter of the key.
        lease: seconds a worker process's claim of a task lasts without being renewed (its
            heartbeat renews it every `lease` / 3): a worker killed or paused longer loses its
            tasks, which run again elsewhere with the attempt counted; and seconds after which a
            coordinator that stopped beating (another host's; on this host a dead pid is seen at
            once) no longer holds its run against a second coordinator.
        busy_timeout: seconds a write waits for another process's lock on the file (SQLite's
            busy timeout) before it fails with `StoreError` ("another process holds it locked").
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        window: float = 0.05,
        key_lease: float = 30.0,
        lease: float = 30.0,
        busy_timeout: float = 10.0,
    ) -> None:
        if not isinstance(path, str | os.PathLike) or path == "":
            # pathlib would raise a TypeError, or take "" for the current directory.
            raise ConfigError(f"SQLiteStore path must be a file path (str or Path), got {path!r}")
        for name, value in (
            ("window", window),
            ("key_lease", key_lease),
            ("lease", lease),
            ("busy_timeout", busy_timeout),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{name} must be a number of seconds, got {value!r}")
            if not finite(value) or not value > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        if key_lease <= window:
            raise ConfigError(
                f"key_lease ({key_lease}) must be longer than window ({window}): a live claim "
                "is refreshed once a window"
            )
        if lease <= 3 * window:
            raise ConfigError(
                f"lease ({lease}) must be longer than three windows ({3 * window}): a lease is "
                "renewed a few times before it can expire"
            )
        self.path = Path(path)
        self.window = float(window)
        self.key_lease = float(key_lease)
        self.lease = float(lease)
        self.owner = uuid.uuid4().hex  # whose claims of idempotency keys are this store's
        self.busy_timeout = float(busy_timeout)
        self._writer = Writer(self.path, self.busy_timeout)
        self._closer = weakref.finalize(self, self._writer.stop)
        # Successes of keyed tasks not committed yet, across this store's runs: key -> (output
        # JSON, agent). A key's stored result is found here first, then in the file.
        self.unwritten_keys: dict[str, tuple[str, str | None]] = {}
        # This store's runs by id while they are open: the file cannot tell two of them apart
        # (one name, `leases.identity(owner)`), so a second one of a run id is refused here.
        self.open_runs: weakref.WeakValueDictionary[str, SQLiteRun] = weakref.WeakValueDictionary()

    def __repr__(self) -> str:
        return f"SQLiteStore({str(self.path)!r})"

    # -- the writer thread -----------------------------------------------------------------------

    def submit(self, job: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run `job(conn, *args)` in the writer thread; its `sqlite3` errors become `StoreError`."""
        return self._writer.submit(job, args)

    def call(self, job: Callable[..., Any], *args: Any) -> Any:
        """`submit` and wait for the answer."""
        return self.submit(job, *args).result()

    def close(self) -> None:
        """Close the database (the store closes itself when it is garbage collected, too)."""
        self._closer()

    # -- the Store protocol ----------------------------------------------------------------------

    def open_run(
        self,
        run_id: str,
        *,
        admission: Admission,
        listener: Listener,
        clock: Callable[[], float],
        task_timeout: float | None,
        compact: bool,
    ) -> SQLiteRun:
        return SQLiteRun(self, run_id, admission, listener, clock, task_timeout, compact)

    # -- reading ---------------------------------------------------------------------------------

    def runs(self) -> list[dict[str, Any]]:
        """Every run in the file, oldest first, with its task counts by state."""
        return self.call(admin.runs)  # type: ignore[no-any-return]

    def events(self, run_id: str, task_id: str | None = None) -> list[dict[str, Any]]:
        """The journal of a run (of one task, with `task_id`), in order: dicts with `seq` (None for
        an event read from the task's row), `run_id`, `task_id`, `at` (wall time), `event`
        (``admitted``, ``ready``, ``started``, ``attempt_failed``, ``retried``, or the end:
        ``succeeded``, ``failed``, ``skipped``, ``cancelled``), `agent`, `attempt`, `detail`.

        Raises:
            InputError: the file has no such run, or the run no such task.
        """
        return self.call(admin.events, run_id, task_id)  # type: ignore[no-any-return]

    def workers(self) -> list[dict[str, Any]]:
        """The worker processes of the file (`Orchestrator.work`, ``orchestra worker``), oldest
        first: `owner` (``host:pid:id``), `host`, `pid`, `run_id` (the one run it serves, or
        None), `kinds` (None: every kind it has agents for), `started` and `heartbeat` (wall
        time), `live` (its heartbeat is younger than `lease`), `claimed`, `completed`, and
        `holding` (tasks it holds now). A worker that stopped cleanly is not listed."""
        return self.call(admin.workers, time.time(), self.lease)  # type: ignore[no-any-return]

    def dead_letters(self, run_id: str) -> list[dict[str, Any]]:
        """The tasks of a run that failed for good, each with every attempt (`attempts_list`, with
        its traceback); `InputError` if the file has no such run."""
        return self.call(admin.dead, run_id)  # type: ignore[no-any-return]

    def retry(self, run_id: str, task_ids: Iterable[str] | None = None) -> list[str]:
        """Make the failed tasks of a run (or those of `task_ids`) runnable again: the next
        ``orch.run(..., run_id=run_id)`` on this file runs them, their attempts kept (the count,
        and every failed one among the dead letters' history), the chain of agents from its
        start. The run's skipped tasks are reopened too (skipped again if what they wait for still
        failed). Returns the ids of the failed tasks reopened.

        Raises:
            InputError: no such run, or a task of `task_ids` that is not a failed task of it.
        """
        if isinstance(task_ids, str):
            raise InputError(
                "task_ids must be a collection of ids, not one string", field="task_ids"
            )
        ids = None if task_ids is None else [str(i) for i in task_ids]
        return self.call(admin.retry, run_id, ids, time.time())  # type: ignore[no-any-return]


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
        self._admission = admission
        self._now = clock
        self._memory = MemoryRun(run_id, admission, self, clock, task_timeout, compact)
        # Loop time + offset = wall time; wall0 is the memory run's zero (its records' `started`
        # and `finished` count from it), so that a task's end read from its row and the journal's
        # events are on one clock, in order.
        self._wall0 = time.time()
        self._offset = self._wall0 - self._memory._t0
        # Admitted, not written yet: (record, payload JSON, loop time of its admission).
        self._new: list[tuple[Record, str, float]] = []
        self._admitting = False  # inside the memory run's admission: its `ready`s are not events
        # The tasks a settling attempt spawned (by `id`): ready at their admission, not an event.
        self._spawning: frozenset[int] = frozenset()
        self._dirty: dict[str, Record] = {}  # changed since the last write
        self._outputs: dict[str, str] = {}  # id -> its output's JSON (encoded when it settled)
        self._attempts: list[tuple[Any, ...]] = []
        self._events: list[tuple[Any, ...]] = []  # (task id, loop time, event, agent, n, detail)
        self._writes: list[Future[Any]] = []
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
        self._error: BaseException | None = None
        self._closed = False
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # driven directly (the contract suite): written at `close`
            self._loop = None
        self._timer: asyncio.TimerHandle | None = None
        self._armed = False
        self._keys = Keys(self)  # idempotency keys (`_sqlite_keys`)
        self._closing = False
        # Tasks held back and now to run here (a key's wait ended in a claim; the file granted a
        # claim), for `claim` to hand out first.
        self._runnable: list[Record] = []
        self._name = leases.identity(store.owner)  # this process, as the file knows it
        self._sharing = Sharing(self)  # with worker processes (`_sqlite_share`)
        self._beat_timer: asyncio.TimerHandle | None = None
        self._beat_every = min(0.25, store.lease / 3)
        self._beat_at = 0.0  # wall time of the last heartbeat written
        other = store.open_runs.get(run_id)
        if other is not None and not other._closed:
            raise StoreError(
                f"run {run_id!r} is already being run by this process, on this {store!r}: a run "
                "has one coordinator (more processes join it as workers: `orch.work(...)`)"
            )
        # Known to this process as its run until `close`, so that a hold the file keeps in its
        # name after it (one a failed run could not let go of) does not lock the process out.
        leases.coordinating(self._name, run_id, True)
        self._let_go = weakref.finalize(self, leases.coordinating, self._name, run_id, False)
        try:
            rows, attempts, seq = store.call(
                writes.open_run, run_id, self._wall0, self._name, store.lease
            )
        except BaseException:
            self._let_go()
            raise
        store.open_runs[run_id] = self
        self._rows = Rows(run_id, self._wall0, self._offset, self._outputs, seq)
        self._stored: dict[str, tuple[Record, str]] | None = None  # id -> (record, payload JSON)
        self._loaded: tuple[list[Any], list[Any]] | None = (rows, attempts) if rows else None
        if self._loop is not None:
            self._beat_timer = self._loop.call_later(self._beat_every, self._beat)

    # -- counters (the memory run's) -------------------------------------------------------------

    @property
    def unfinished(self) -> int:
        return self._memory.unfinished

    @property
    def pending(self) -> int:
        return self._memory.pending

    # -- the memory run's listener: what it readies and ends is written down ---------------------

    def ready(self, record: Record) -> None:
        if record.task.key is not None and not self._admitting and self._memory.holds_key(record):
            self._keys.took_over(record)  # (or it holds it already: a retry)
        self._touch(record)
        if not self._admitting and id(record.task) not in self._spawning:
            # (else ready at its admission: its row's `admitted` says it)
            self._events.append((record.id, self._now(), "ready", None, None, None))
        self._listener.ready(record)

    def ready_all(self, records: Sequence[Record]) -> None:
        dirty = self._dirty
        if self._admitting:
            for record in records:
                dirty[record.id] = record
        else:
            now = self._now()
            events = self._events
            spawning = self._spawning
            for record in records:
                dirty[record.id] = record
                if id(record.task) not in spawning:
                    events.append((record.id, now, "ready", None, None, None))
        self._arm()
        self._listener.ready_all(records)

    def wake(self) -> None:
        self._listener.wake()

    def stop(self, reason: str) -> None:
        self._listener.stop(reason)

    def hold(self, held: bool) -> None:
        self._listener.hold(held)

    def finished(self, record: Any) -> None:
        # Not a journal row: a task ends once, and its row says how (`state`, `finished`, `agent`,
        # `attempts`, `error`); the journal's readers add the event from it (`retry` writes it
        # into the journal before it reopens the task).
        self._touch(record)
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
        self._resume()
        payloads = self._encode(tasks, where, first_index)
        gone: list[int] = []
        generated: set[int] = set()
        if self._stored:
            generated = self._match(tasks, first_index)
            gone = [i for i, task in enumerate(tasks) if self._gone(task)]
        memory = self._memory
        self._admitting = True
        try:
            if not gone:
                added = memory.admit(
                    tasks,
                    where=where,
                    forward=forward,
                    first_index=first_index,
                    generated=generated,
                )
            else:
                # Admitted around the tasks that are gone, a stretch at a time. Only a streamed
                # input's chunk has such tasks (a whole list is never compacted), and it may only
                # depend backwards, so the stretches are independent.
                added = start = 0
                for stop in [*gone, len(tasks)]:
                    if start < stop:
                        added += memory.admit(
                            tasks[start:stop],
                            where=where,
                            forward=forward,
                            first_index=first_index + start,
                            generated=generated,
                        )
                    start = stop + 1
        finally:
            self._admitting = False
        self._added(tasks, payloads)
        return added

    def admit_one(self, task: Any, index: int) -> None:
        self._resume()
        payloads = self._encode((task,), "input item", index)
        generated = False
        if self._stored:
            generated = bool(self._match((task,), index))
            if self._gone(task):
                return
        self._admitting = True
        try:
            self._memory.admit_one(task, index, generated=generated)
        finally:
            self._admitting = False
        self._added((task,), payloads)

    def _gone(self, task: Any) -> bool:
        """A stored task (the same, `_match` checked) that succeeded in this process before the
        streamed input gave it again, and that the run has forgotten since (compacted): it is
        not admitted again (the memory run would take it for a second task with its id)."""
        stored = self._stored
        return (
            isinstance(task, Task)
            and stored is not None
            and task.id in stored
            and self._memory.record_of(task.id) is None
        )

    def close_input(self) -> None:
        self._resume()
        self._memory.close_input()

    def check_spawn(self, task: Task, parent: Any, pending: dict[str, Task]) -> None:
        self._memory.check_spawn(task, parent, pending)
        self._encode((task,), f"task spawned by {parent.id!r}", None)

    def _encode(self, tasks: Sequence[Any], where: str, first: int | None) -> list[Any]:
        """Each task's payload as JSON (None for what admission refuses anyway), before anything
        is admitted: a payload that cannot be stored refuses the batch, naming the task."""
        out: list[Any] = []
        for i, task in enumerate(tasks):
            if not isinstance(task, Task):
                out.append(None)
                continue
            try:
                out.append((task.payload, to_json(task.payload).decode()))
            except PydanticSerializationError as exc:
                raise InputError(
                    f"task {_named(task, where, first, i)}: payload cannot be stored as JSON "
                    f"by {self._store!r}: {exc}",
                    task_id=task.id,
                    field="payload",
                ) from exc
            # What the memory run takes but a row cannot hold would fail the store's first
            # write, after agents ran: refused here, with the task and the field.
            priority = task.priority
            if type(priority) is int and not PRIORITY_MIN <= priority <= PRIORITY_MAX:
                raise InputError(
                    f"task {_named(task, where, first, i)}: priority {priority} does not fit "
                    f"the 64-bit integer {self._store!r} keeps it in",
                    task_id=task.id,
                    field="priority",
                )
            if task.metadata is not None:
                try:  # as `_sqlite_rows` writes it: what JSON cannot hold is shown by its repr
                    to_json(task.metadata, fallback=repr)
                except PydanticSerializationError as exc:  # text that is not UTF-8
                    raise InputError(
                        f"task {_named(task, where, first, i)}: metadata cannot be stored as "
                        f"JSON by {self._store!r}: {exc}",
                        task_id=task.id,
                        field="metadata",
                    ) from exc
            for field in ("id", "key"):
                value = getattr(task, field)
                if type(value) is str and not value.isascii() and not _utf8(value):
                    raise InputError(
                        f"task {_named(task, where, first, i)}: {field} {value!r} is not valid "
                        f"UTF-8 text (a lone surrogate?), which {self._store!r} cannot store",
                        task_id=task.id,
                        field=field,
                    )
        return out

    def _added(self, tasks: Sequence[Any], payloads: list[Any]) -> None:
        """Queue the rows of the tasks the memory run just took in (not the ones it already had)."""
        memory = self._memory
        stored = self._stored
        keyed: list[Record] = []
        now = self._now()
        for task, encoded in zip(tasks, payloads, strict=True):
            record = memory.record_of(task.id)
            if record is None or record.task is not task:
                continue  # refused as the same task
            if stored and task.id in stored:
                continue
            payload, text = encoded
            if task.payload is not payload:  # admission validated it into its model
                text = to_json(task.payload).decode()
            self._new.append((record, text, now))
            if memory.holds_key(record):  # (the others with its key follow it in the run)
                keyed.append(record)
        self._arm()
        # One that took the key over from a task of the run (which waits for it: `_follow`) takes
        # over the run's claim on it, or its wait; the others claim theirs in one transaction.
        fresh = [record for record in keyed if not self._keys.inherit(record)]
        if fresh:
            self._keys.reuse(fresh)

    # -- resume ----------------------------------------------------------------------------------

    def _resume(self) -> None:
        """Take back what an earlier process left of this run (once, when the input starts coming,
        as the run is ready to hear it)."""
        if self._loaded is None:
            if self._stored is None:
                self._stored = {}
            return
        rows, attempt_rows = self._loaded
        self._loaded = None
        failures = self._rows.failures(attempt_rows)
        stored: dict[str, tuple[Record, str]] = {}
        records = [self._rows.record(row, stored, failures) for row in rows]
        self._stored = stored
        admission = self._admission
        for record in records:
            if record.state not in TERMINAL and record.kind in admission.kinds:
                admission.check(record.task, "stored task", None, lambda _: False)  # its model
        took_keys = [row[0] for row in rows if row[32]]
        self._memory.restore(records, took_keys)
        ended = [r for r in records if r.state in TERMINAL]
        self.resumed = len(ended)
        for record in ended:
            self._listener.finished(record)
        self.resumed += self._sharing.resume(records, rows)

    def _match(self, tasks: Sequence[Any], first: int) -> set[int]:
        """Input admitted again on resume: the stored task with its id (generated ids are
        generated again, in the same order) must be the same task; it takes the caller's object.
        Returns the tasks (by `id()`) whose ids it generated: the memory run takes them as
        generated, not given (the rows say so, for the next resume to generate them again)."""
        stored = self._stored
        assert stored is not None
        admission = self._admission
        generated: set[int] = set()
        for i, task in enumerate(tasks, first):
            if not isinstance(task, Task):
                continue
            given: str | None = task.id  # typed `str`: None until admission generates one
            if given is None:
                auto = admission.auto
                while True:
                    auto += 1
                    found = stored.get(f"{task.kind}#{auto}")
                    if found is None or not found[0].named:
                        break
                # The id admission would generate (a new task's too: given here, so that the
                # next one of the batch is generated after it, as in the first run).
                admission.auto = auto
                task.id = f"{task.kind}#{auto}"
                generated.add(id(task))
                if found is None:
                    continue
            else:
                found = stored.get(task.id)
                if found is None:
                    continue
                if not found[0].named:  # generated for a task given no id: its own is matched
                    raise InputError(
                        f"duplicate task id {task.id!r} (input item {i}): run {self.run_id!r} "
                        "generated it for an earlier task given no id",
                        task_id=task.id,
                        field="id",
                    )
            record, payload = found
            old = record.task
            if old is task:
                continue
            if (
                old.kind != task.kind
                or list(old.depends_on) != list(task.depends_on)
                or list(old.tags) != list(task.tags)
                or list(old.depends_on_tags) != list(task.depends_on_tags)
                or old.key != task.key
                or not _same_json(payload, task.payload)
            ):
                raise InputError(
                    f"task {task.id!r} (input item {i}) is not the task run {self.run_id!r} "
                    f"stored under that id: the input or the decomposer changed since the run "
                    "started. A resumed run must be given the same tasks (same ids, or the same "
                    "order when ids are generated); start a new run id for new work",
                    task_id=task.id,
                    field="payload",
                )
            record.task = task
        return generated

    # -- dispatch --------------------------------------------------------------------------------

    def claim(self) -> Record | None:
        # Not written down: in one process a claimed task is a ready one once the process is gone.
        if self._runnable:
            return self._runnable.pop()
        record = self._memory.claim()
        if self._keys.waiting:
            # A task waiting for its key's result stays claimed, held here, never started:
            # `_poll` ends it with the result, or hands it back through `_runnable`.
            while record is not None and self._keys.waiting.get(record.task.key) is record:  # type: ignore[arg-type]
                record = self._memory.claim()
        if record is not None and self._sharing.offered and self._sharing.held_back(record):
            return None  # a worker process may claim it too: the file decides (`_sqlite_share`)
        return record

    def heartbeat(self, record: Record, token: int) -> bool:
        return self._memory.heartbeat(record, token)

    def start(self, record: Record, token: int, agent: str) -> bool:
        if not self._memory.start(record, token, agent):
            return False
        self._touch(record)
        self._events.append((record.id, self._now(), "started", agent, record.attempts, None))
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
        self._failed(record, attempt)
        self._touch(record)
        return True

    def _failed(self, record: Record, attempt: Attempt) -> None:
        self._attempts.append((record.id, attempt))
        # At the attempt's end, not now: before the task's own end. Made from the attempt's
        # start and duration, counted from the run's zero, not the memory run's, a hair earlier:
        # never later than now, or the task's next event (its retry made ready) came first.
        end = self._memory._t0 + attempt.started + attempt.duration
        now = self._now()
        self._events.append(
            (record.id, end if end < now else now, "attempt_failed",
             attempt.agent, attempt.number, f"{attempt.error_type}: {attempt.message}")
        )  # fmt: skip

    def note(self, record: Record, token: int, feedback: str, *, partial: Any = KEEP) -> bool:
        if not self._memory.note(record, token, feedback, partial=partial):
            return False
        self._touch(record)
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
                payloads = self._encode(spawned, f"tasks spawned by {record.id!r}", None)
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
            self._failed(record, attempt)
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
            self._touch(record)
        return True

    # -- writing ---------------------------------------------------------------------------------

    def _touch(self, record: Record) -> None:
        self._dirty[record.id] = record
        if not self._armed:
            self._arm()

    def _arm(self) -> None:
        if self._armed or self._closed:
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
        if self._error is not None:  # the run is stopping on it: nothing more is written
            return None
        if self._behind and not self._closing:  # gathered on, written once the writer has room
            self._deferred = self._armed = True  # (no timer, no heartbeat write meanwhile)
            return None
        now = time.time()
        beating = self._loop is not None and (
            self._sharing.active or now - self._beat_at >= self._beat_every
        )
        if not (
            self._new
            or self._dirty
            or self._events
            or self._attempts
            or self._keys.claims
            or beating
        ):
            return None
        # Rows with the usual NULLs go through a statement that binds fewer parameters (`_LEAN`):
        # binding dominates an insert's cost (measured: 18 parameters 3.6 µs, 33 parameters 9.6).
        shared = self._sharing.active
        offered = self._sharing.offered
        waiting = self._keys.waiting  # held back for a key's result: never a worker's to claim
        new: tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]] = ([], [])
        memory = self._memory
        for record, payload, admitted in self._new:
            key = record.task.key
            held = bool(waiting) and waiting.get(key) is record  # type: ignore[arg-type]
            took = key is not None and memory.took_key(record)
            lean, row = self._rows.new_row(record, payload, admitted, held, took)
            new[lean].append(row)
            if shared and record.state is READY and not held:
                offered.add(record.id)
        dirty: tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]] = ([], [])
        shared_rows: list[tuple[Any, ...]] = []
        if self._dirty:
            fresh = {record.id for record, _, _ in self._new}  # their rows hold their state
            for task_id, record in self._dirty.items():
                if task_id in fresh:
                    continue
                if shared:  # a worker may hold the row: `_UPDATE_SHARED` says when it is ours
                    held = bool(waiting) and waiting.get(record.task.key) is record  # type: ignore[arg-type]
                    shared_rows.append(self._rows.shared_row(record, held))
                    if record.state is READY and not held:
                        offered.add(task_id)
                    else:
                        offered.discard(task_id)
                else:
                    lean, row = self._rows.state_row(record)
                    dirty[lean].append(row)
        attempts = [self._rows.attempt_row(task_id, a) for task_id, a in self._attempts]
        offset = self._offset
        run_id = self.run_id
        # The start of a task that succeeded at its first attempt is not a journal row: its row
        # says it (`started`, `agent`, `attempts`), and the journal's readers add the event from
        # it. Any other start is a row (the row's `started` is the first attempt's, and a failed
        # task's row names no agent).
        touched = self._dirty
        events = [
            (run_id, task_id, at + offset, event, agent, number, detail)
            for task_id, at, event, agent, number, detail in self._events
            if event != "started"
            or number != 1
            or (ended := touched.get(task_id)) is None
            or ended.state is not SUCCEEDED
            or ended.attempts != 1
        ]
        keys: list[str] = [r.task.key for r in self._dirty.values() if r.task.key is not None]
        claimed = self._keys.rows(keys, closing=self._closing)
        results = self._keys.results(keys) if keys else []
        self._new = []
        self._dirty = {}
        self._attempts = []
        self._events = []
        beat = None
        if beating:
            self._beat_at = now
            # Polled while workers may hold rows of the run (`active`), shared or not: a restart
            # with no live worker must still take back a dead worker's lease and settle what a
            # worker completed.
            sharing = self._sharing
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
        if self._keys.claims or self._sharing.active:
            self._arm()  # the next heartbeat, the next look at what workers did
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
        if not self._behind or self._error is not None:  # (a failed write stops the run)
            return
        self._writes = [w for w in self._writes if not w.done()]
        if len(self._writes) >= _BEHIND:
            return
        self._behind = False
        self._no_real_work()
        if self._deferred:
            self._deferred = self._armed = False
            self._arm()
        if self._beat_timer is None and self._loop is not None and not self._closed:
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
            first = self._error is None
            self._error = self._error or error
            # The windows queued behind it would each wait out the busy timeout too (a file
            # locked by a stopped process), and `close` waits for them on the loop: dropped.
            for pending in list(self._writes):
                pending.cancel()
            if first and self._loop is not None and not self._closed:
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

    # -- sharing the run with worker processes (`_sqlite_leases`) ----------------------------------

    def _beat(self) -> None:
        """Every `_beat_every` seconds: the coordinator's heartbeat (and a look for workers),
        written with the window's changes if there are any."""
        self._beat_timer = None
        if self._closed or self._loop is None or self._behind:  # (`_caught_up` beats again)
            return
        if not self._armed:
            self.flush()
        self._beat_timer = self._loop.call_later(self._beat_every, self._beat)

    def close(self) -> None:
        """Write down everything and wait until it is durable; raises `StoreError` if it is not."""
        if self._beat_timer is not None:
            self._beat_timer.cancel()
        if self._timer is not None:
            self._timer.cancel()
        self._keys.close()
        self._closing = True  # the claims of its keys left are released (`Keys.rows`)
        self.flush()
        self._closed = True
        if self._timer is not None:  # a shared run's flush arms the next window: none comes now
            self._timer.cancel()  # (it would write what the run's end does after this: the
            self._timer = None  # tasks a stop or a cancel ends are not written down)
        self._armed = False
        for write in self._writes:
            try:
                write.result()
            except BaseException as exc:  # recorded by `_written`; raised once, below
                self._error = self._error or exc
        self._writes = []
        self._no_real_work()
        # Let go of the run (a later process may resume it at once), even after a failed write:
        # best effort then (a file still locked or full refuses this too, and the hold lapses
        # `lease` seconds after the last heartbeat), and never closed as done.
        done = self._error is None and not self._memory.unfinished
        try:
            self._store.call(writes.close_run, self.run_id, time.time(), done, self._name)
        except StoreError as exc:
            self._error = self._error or exc
        self._let_go()  # over: a resume here need not wait for the hold to lapse
        if self._error is not None:
            error = self._error
            if isinstance(error, StoreError):
                raise error
            raise StoreError(f"{self._store!r} could not write run {self.run_id!r}: {error}")


# -- helpers ---------------------------------------------------------------------------------------


def _same_json(stored: str, payload: Any) -> bool:
    try:
        text = to_json(payload).decode()
    except PydanticSerializationError:
        return False
    return text == stored or json.loads(text) == json.loads(stored)


def _named(task: Task, where: str, first: int | None, i: int) -> str:
    """How an error names a task: its id, or where it came from when it has none yet."""
    given: str | None = task.id  # typed `str`: None until admission generates one
    if given is not None:
        return repr(given)
    return where if first is None else f"{where}[{first + i}]"


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
