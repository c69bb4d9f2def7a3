"""A run on PostgreSQL, as its coordinator sees it: the run's state lives in the database; the
coordinator keeps a mirror of it, takes its tasks through the database like any worker, and hears
the ends the others write.

**Shape.** The engine calls a `RunStore` synchronously, with live records, so `PostgresRun` holds a
`MemoryRun` — the *mirror*: every task of the run, its state and its place in the graph — and
keeps it in step with the database:

- **Input** is checked and named by the mirror (the engine's `InputError` comes from there, before
  anything is written), then written behind, in order, by one writer (`_apply`) inside the fence
  of the coordinator's lease on the run (`_coordinator.fenced`); the database checks it again.
- **Claims** go through the database only (`_leases.claim`, sized by what the run's agents can
  start: `Listener.room`), whatever the mirror says is ready: a task the mirror holds as ready may
  be a worker's at this moment. A claimed task waits in `_runnable` until the engine's `claim`
  takes it. Its attempt's end goes back with its lease's token (`_leases.complete`, which settles
  its dependents in the same transaction); its failed attempts as they fail (`_leases.note`).
- **Ends written elsewhere** (a worker's completion, a lease lost too often) are heard from the
  database's feed (`_follow.heard`) and played into the mirror as if they had happened here:
  the engine's report, events, results and aggregate see every end once.
- **Ends only the coordinator decides** (a cancel, a deadline passed) are written as such
  (`_follow.decide`), fenced by the run's lease.

The mirror computes what the database computes (readiness, cascades, groups: the same checks and
the same rules, model-tested against each other), so that its ready tasks are the database's.

**Where the work happens.** With a running loop, the writes go through one writer task and the
claims through one claimer task on the run's loop, each awaiting the store's database thread
(`_database.py`); the run's lease, the leases of the tasks it holds and its LISTEN run there, in the
background (`_keep`). Without a loop (the store contract suite drives a run by hand), every call
writes and claims at once, blocking.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import time
from heapq import heappop, heappush
from typing import TYPE_CHECKING, Any

from pydantic_core import to_json

from ..._exceptions import InputError, StoreError
from ..._log import get_logger
from ..._output import json_text, jsonable, stored_json
from ..._task import CLAIMED, READY, RUNNING, SUCCEEDED, TERMINAL, Attempt, Task
from .._memory import MemoryRun
from .._protocol import KEEP
from . import _coordinator as coordinator
from . import _follow as follow
from . import _leases as leases
from ._graph import admit_in
from ._listen import Wakeup, channel_of, notify
from ._settle import close_input

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from concurrent.futures import Future

    import asyncpg

    from ..._admission import Admission
    from ..._record import Record
    from .._protocol import Listener, Selector
    from ._store import PostgresStore

__all__ = ("PostgresRun",)

log = get_logger("orchestra")

# Input written behind at most this far (tasks) before a streamed input waits for the writer.
_BACKLOG = 10_000


class PostgresRun:
    """One run of a `PostgresStore`, as its coordinator sees it (module docstring)."""

    quiet = None  # the mirror's listener: it hears every end (to write down what it decides)

    def __init__(
        self,
        store: PostgresStore,
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
        self._db = store.database
        self._listener = listener
        self._admission = admission
        self._now = clock
        self._memory = memory = MemoryRun(run_id, admission, self, clock, task_timeout, compact)
        self._wall0 = time.time()  # the wall time of the mirror's zero (`memory.t0`)
        self._kinds = sorted(admission.kinds)
        # This process, as the database knows it: the run's lease and its tasks' leases.
        self.name = f"{socket.gethostname()}:{os.getpid()}:{store.owner}"
        # The tasks this process holds under a lease of the database: id -> its claim.
        self._held: dict[str, leases.Claimed] = {}
        # Claimed here, not handed to the engine yet: (priority, order, record), best first.
        self._runnable: list[tuple[int, int, Record]] = []
        self._order = 0
        self._ops: list[tuple[str, Any]] = []  # what the database has not been told yet, in order
        self._backlog = 0  # input tasks among `_ops`
        self._drained: asyncio.Future[None] | None = None  # a streamed input waits on it
        self._error: BaseException | None = None
        self.closed = False
        self._ending: list[Record] | None = None  # the mirror's ends during a cancel
        self._failing: list[tuple[str, Any]] | None = None  # writes that follow a failure's note
        self.refused = 0  # completions of this process the database refused (a lost lease)
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # driven by hand (the contract suite): every call writes at once
            self._loop = None
        taken = self._db.call(_open, run_id, self.name, store.lease)
        if isinstance(taken, coordinator.Holder):
            raise StoreError(
                f"run {run_id!r} is being run by another coordinator ({taken.owner}, its lease "
                f"good for {max(taken.remaining, 0):.1f} s more): a run has one coordinator; "
                "more processes join it as workers (`orch.work(store)`, `orchestra worker "
                "--dsn ...`), or run this again once it is over"
            )
        self._lease: coordinator.Lease = taken
        del memory
        self._wakeup = Wakeup()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: Future[Any] | None = None
        self._inflight: Future[Any] | None = None
        self._dirty: asyncio.Event | None = None
        if self._loop is not None:
            self._dirty = asyncio.Event()
            self._tasks = [
                self._loop.create_task(self._write_behind(), name=f"orchestra-pg-write:{run_id}"),
                self._loop.create_task(self._claim_loop(), name=f"orchestra-pg-claim:{run_id}"),
            ]
            self._background = self._db.spawn(self._keep)

    # -- counters (the mirror's) -----------------------------------------------------------------

    @property
    def unfinished(self) -> int:
        return self._memory.unfinished

    @property
    def pending(self) -> int:
        return self._memory.pending

    # -- the mirror's listener -------------------------------------------------------------------

    def ready(self, record: Record) -> None:
        claimed = self._held.pop(record.id, None)
        if claimed is not None:
            # A task of ours ready again (a retry due, a fallback): back in the database's
            # queue, behind its equals as in memory, for whoever has room (its failed attempt
            # is written first: `fail` queues the requeue after its note).
            requeue = ("requeue", (claimed.run_id, claimed.id, claimed.token, record.priority))
            if self._failing is not None:
                self._failing.append(requeue)
            else:
                self._queue(*requeue)
        self._listener.ready(record)

    def ready_all(self, records: Sequence[Record]) -> None:
        self._listener.ready_all(records)

    def finished(self, record: Any) -> None:
        if self._ending is not None:
            self._ending.append(record)
        self._listener.finished(record)

    def wake(self) -> None:
        self._listener.wake()

    def stop(self, reason: str) -> None:
        self._listener.stop(reason)

    def hold(self, held: bool) -> None:
        self._listener.hold(held)

    def room(self, kind: str) -> int:
        return self._listener.room(kind)

    # -- admission -------------------------------------------------------------------------------

    def admit(
        self,
        tasks: Sequence[Any],
        *,
        where: str,
        forward: bool,
        first_index: int = 0,
    ) -> int:
        added = self._memory.admit(tasks, where=where, forward=forward, first_index=first_index)
        _storable(tasks, where)
        self._queue("admit", (list(tasks), where, forward, first_index))
        self._backlog += len(tasks)
        return added

    def admit_one(self, task: Any, index: int) -> None:
        self._memory.admit_one(task, index)
        _storable((task,), "input item")
        self._queue("admit", ([task], "input item", False, index))
        self._backlog += 1

    def close_input(self) -> None:
        self._memory.close_input()
        self._queue("close_input", None)

    def backpressure(self) -> asyncio.Future[None] | None:
        if self._backlog < _BACKLOG or self._loop is None:
            return None
        if self._drained is None:
            self._drained = self._loop.create_future()
        return self._drained

    def check_spawn(self, task: Task, parent: Any, pending: dict[str, Task]) -> None:
        self._memory.check_spawn(task, parent, pending)
        _storable((task,), f"task spawned by {parent.id!r}")

    # -- dispatch --------------------------------------------------------------------------------

    def claim(self) -> Record | None:
        record = self._pop()
        if record is None:
            if self._loop is None:
                self._step(limit=1)
                record = self._pop()
            else:  # nothing claimed here: look in the database
                self._wakeup.set()
        return record

    def _pop(self) -> Record | None:
        runnable = self._runnable
        held = self._held
        while runnable:
            priority, _, record = heappop(runnable)
            if record.state is not READY or record.id not in held:
                continue  # ended meanwhile (a cancel, a deadline), or its lease lost
            if record.priority != priority:  # moved since (`reprioritize`): to its new place
                self._push(record)
                continue
            self._memory.take(record)
            return record
        return None

    def _push(self, record: Record) -> None:
        self._order += 1
        heappush(self._runnable, (record.priority, self._order, record))

    def _taken(self, kind: str) -> int:
        return sum(1 for _, _, r in self._runnable if r.kind == kind and r.state is READY)

    def heartbeat(self, record: Any, token: int) -> bool:
        return self._memory.heartbeat(record, token)

    def start(self, record: Any, token: int, agent: str) -> bool:
        return self._memory.start(record, token, agent)

    def fail(
        self,
        record: Any,
        token: int,
        attempt: Attempt,
        *,
        retry_at: float | None = None,
        next_agent: str | None = KEEP,
    ) -> bool:
        claimed = self._held.get(record.id)
        after: list[tuple[str, Any]] = []
        self._failing = after
        try:
            if not self._memory.fail(
                record, token, attempt, retry_at=retry_at, next_agent=next_agent
            ):
                return False
        finally:
            self._failing = None
        if claimed is not None:
            self._queue("note", (record.id, claimed.token, self._failed(attempt)))
        for op in after:
            self._queue(*op)
        return True

    def note(self, record: Any, token: int, feedback: str, *, partial: Any = KEEP) -> bool:
        return self._memory.note(record, token, feedback, partial=partial)

    def settle(
        self,
        record: Any,
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
        if record.token != token or record.state in TERMINAL:
            return False
        text: str | None = None
        if status is SUCCEEDED:
            # Raised where the attempt ends, before any change: it fails that attempt.
            text = stored_json(output, record.id, agent)
        if spawned:
            _storable(spawned, f"tasks spawned by {record.id!r}")
        if not self._memory.settle(
            record, token, status, output, spawned=spawned, agent=agent, error=error,
            error_type=error_type, defaulted=defaulted, attempt=attempt,
        ):  # fmt: skip
            return False
        if text is None and record.output is not None:  # a rejected output, kept as JSON can
            text = to_json(jsonable(record.output)).decode()
        claimed = self._held.pop(record.id, None)
        if claimed is not None:
            started = None if record.t_start is None else self._wall(record.t_start)
            end = leases.End(
                record.id, claimed.token, status, text, agent, error, error_type,
                record.attempts, defaulted, started,
            )  # fmt: skip
            failed = [] if attempt is None else [self._failed(attempt)]
            self._queue("end", (end, list(spawned), failed))
        else:  # not a lease of ours: decided here (a deadline passed while it waited)
            self._queue("decide", (record.id, status, error, error_type, text, agent, defaulted))
        return True

    def succeed(self, record: Any, token: int, output: Any, agent: str) -> bool:
        return self.settle(record, token, SUCCEEDED, output, agent=agent)

    def cancel(self, selector: Selector, reason: str, error_type: str = "Cancelled") -> list[Any]:
        ended = self._ending = []
        try:
            flagged = self._memory.cancel(selector, reason, error_type)
        finally:
            self._ending = None
        for record in ended:
            if record.status == "cancelled":  # (the skipped ones follow from it: settled there)
                self._held.pop(record.id, None)
                self._queue(
                    "decide", (record.id, "cancelled", reason, error_type, None, None, False)
                )
        return flagged

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
        self._queue("priority", (task_id, priority))
        return True

    # -- the writer: what the database has not been told yet -------------------------------------

    def _queue(self, kind: str, op: Any) -> None:
        self._ops.append((kind, op))
        if self._loop is None:
            self._flush_now()
        else:
            assert self._dirty is not None
            self._dirty.set()

    def _flush_now(self) -> None:
        ops, self._ops = self._ops, []
        try:
            refused = self._db.call(_apply, self.run_id, self._lease, self._admission, ops)
        except BaseException as exc:
            self._keep_error(exc)
            return
        self._applied(ops, refused)

    async def _write_behind(self) -> None:
        dirty = self._dirty
        assert dirty is not None
        while True:
            await dirty.wait()
            dirty.clear()
            ops, self._ops = self._ops, []
            if not ops:
                continue
            self._inflight = self._db.submit(_apply, self.run_id, self._lease, self._admission, ops)
            try:
                refused = await asyncio.wrap_future(self._inflight)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                self._keep_error(exc)
                return
            self._applied(ops, refused)

    def _applied(self, ops: list[tuple[str, Any]], refused: list[str]) -> None:
        self._backlog -= sum(len(op[0]) for kind, op in ops if kind == "admit")
        if self._backlog < _BACKLOG and self._drained is not None:
            if not self._drained.done():
                self._drained.set_result(None)
            self._drained = None
        if refused:
            self.refused += len(refused)
            log.warning(
                "completion refused: the lease was lost", run_id=self.run_id, task_ids=refused
            )
        self._wakeup.set()  # what these writes made ready may be claimed now

    def _keep_error(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
            if not self.closed:
                self._listener.stop(f"the run's database failed: {error}")

    # -- the claimer: tasks taken through the database, ends heard from it -----------------------

    def _rooms(self) -> dict[str, int]:
        listener = self._listener
        return {kind: listener.room(kind) - self._taken(kind) for kind in self._kinds}

    def _step(self, *, limit: int | None = None) -> None:
        """Hear the ends written elsewhere and claim what the agents can start (blocking)."""
        try:
            heard, claimed = self._db.call(
                _claim_step, self.run_id, self._rooms(), self.name, self._store.lease, limit
            )
        except BaseException as exc:
            self._keep_error(exc)
            return
        self._take_in(heard)
        self._hand_out(claimed)

    async def _claim_loop(self) -> None:
        poll = self._store.poll
        while not self.closed:
            await self._wakeup.wait(poll)
            if self.closed or self._error is not None:
                return
            try:
                heard, claimed = await self._db.run(
                    _claim_step, self.run_id, self._rooms(), self.name, self._store.lease, None
                )
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                self._keep_error(exc)
                return
            if self._over():
                if claimed:  # not ours to run any more: back at once, no attempt counted
                    self._db.submit(
                        _release, self.name, [(c.run_id, c.id, c.token) for c in claimed]
                    )
                return
            self._take_in(heard)
            self._hand_out(claimed)

    def _over(self) -> bool:
        """Closed (read again after an await: `close` may have run meanwhile)."""
        return self.closed

    def _hand_out(self, claimed: list[leases.Claimed]) -> None:
        memory = self._memory
        early = []
        for task in claimed:
            record = memory.record_of(task.id)
            if record is None or record.state is not READY:
                # Made ready by an end this process has not heard yet (it came between the
                # feed's read and the claim): handed back, claimed again once heard.
                early.append(task)
                continue
            self._held[task.id] = task
            self._push(record)
        if early:
            back = [(c.run_id, c.id, c.token) for c in early]
            if self._loop is None:
                self._db.call(_release, self.name, back)
            else:
                self._db.submit(_release, self.name, back)
                self._wakeup.set()
        if self._loop is not None:
            for _ in range(len(claimed) - len(early)):
                self._listener.wake()

    def _take_in(self, heard: follow.Heard) -> None:
        """Play the ends written elsewhere into the mirror, as if they had happened here."""
        if not heard.ends:
            return
        memory = self._memory
        failures: dict[str, list[Attempt]] = {}
        for row in heard.failures:
            failures.setdefault(row[0], []).append(
                Attempt(
                    number=row[1], agent=row[2], error_type=row[3], message=row[4],
                    started=0.0 if row[5] is None else row[5] - self._wall0,
                    duration=row[6] or 0.0, retry_in=row[7], traceback=row[8],
                    status_code=row[9], api_error_type=row[10], request_id=row[11],
                )
            )  # fmt: skip
        spawned: dict[str, list[Task]] = {}
        for row in heard.spawned:
            spawned.setdefault(row[0], []).append(_task(row[1:]))
        for (
            task_id,
            state,
            output,
            agent,
            error,
            error_type,
            attempts,
            started,
            defaulted,
        ) in heard.ends:
            record = memory.record_of(task_id)
            if record is None or record.state in TERMINAL:
                continue  # ended here meanwhile (a cancel, a deadline): the mirror's is final
            if self._held.pop(task_id, None) is not None or record.state in (CLAIMED, RUNNING):
                token = record.token  # ours once; another process ended it since
            else:
                token = memory.take(record)
            record.attempts = attempts
            more = failures.get(task_id)
            if more:
                known = {a.number for a in record.failures or ()}
                new = [a for a in more if a.number not in known]
                record.failures = sorted([*(record.failures or ()), *new], key=lambda a: a.number)
            if started is not None and record.t_start is None:
                record.t_start = started - self._wall0 + memory.t0
            value = None if output is None else json.loads(output)
            try:
                # The memory store tells states apart by identity (its constants, interned); the
                # driver's strings are new objects: a success heard as one would end as a failure.
                memory.settle(
                    record, token, sys.intern(state), value, spawned=spawned.get(task_id, ()), agent=agent,
                    error=error, error_type=error_type, defaulted=defaulted,
                )  # fmt: skip
            except InputError as exc:  # the database took them: the mirror must too
                self._keep_error(
                    StoreError(f"run {self.run_id!r}: the tasks {task_id!r} spawned: {exc}")
                )

    # -- the background, in the database's thread ------------------------------------------------

    async def _keep(self) -> None:
        """The run's lease kept, the held tasks' leases renewed, the run's channel listened to
        (in the store's thread, where a busy run loop cannot stall them)."""
        from ._listen import Listener

        store = self._store
        loop = self._loop
        assert loop is not None
        pool = await self._db.pool()

        def lost(lease: coordinator.Lease) -> None:
            loop.call_soon_threadsafe(
                self._keep_error,
                coordinator.LeaseLost(
                    f"run {self.run_id!r}: this coordinator ({self.name}) lost its lease on the "
                    "run (it was taken over, or the database was out of reach for a whole "
                    "lease): it stops, writing nothing more",
                    run_id=lease.run_id, owner=lease.owner, token=lease.token,
                ),
            )  # fmt: skip

        def woken(_channel: str, _payload: str) -> None:
            loop.call_soon_threadsafe(self._wakeup.set)

        async with (
            coordinator.LeaseKeeper(pool, self._lease, on_lost=lost),
            Listener(
                self._db.dsn, [channel_of(self.run_id)], on_notify=woken,
                on_reconnect=lambda: woken("", ""),
            ),
        ):  # fmt: skip
            while True:
                await asyncio.sleep(store.lease / 3)
                # (a copy: the run's loop changes the dict meanwhile; `dict.copy` is one step)
                held = self._held.copy()
                if held:
                    async with pool.acquire() as conn:
                        await leases.heartbeat(
                            conn,  # type: ignore[arg-type]
                            self.name,
                            [(c.run_id, c.id, c.token) for c in held.values()],
                            lease=store.lease,
                        )

    def _wall(self, t: float) -> float:
        return self._wall0 + (t - self._memory.t0)

    def _failed(self, attempt: Attempt) -> leases.Failed:
        return leases.Failed(
            attempt.number, attempt.agent, attempt.error_type, attempt.message,
            self._wall0 + attempt.started, attempt.duration, attempt.retry_in, attempt.traceback,
            attempt.status_code, attempt.api_error_type, attempt.request_id,
        )  # fmt: skip

    # -- the end ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Write down everything, let go of what this process holds and of the run (closed when
        every task ended); raises `StoreError` if the database failed the run."""
        if self.closed:
            return
        self.closed = True
        for task in self._tasks:
            task.cancel()
        inflight = self._inflight
        if inflight is not None:
            with contextlib.suppress(BaseException):
                inflight.result()
        if self._ops and self._error is None:
            self._flush_now()
        if self._background is not None:
            self._background.cancel()
        done = self._error is None and not self._memory.unfinished
        held = [(c.run_id, c.id, c.token) for c in self._held.values()]
        self._held.clear()
        try:
            self._db.call(_close, self._lease, held, done)
        except StoreError as exc:
            self._error = self._error or exc
        error = self._error
        if error is not None:
            if isinstance(error, StoreError):
                raise error
            raise StoreError(f"{self._store!r} could not write run {self.run_id!r}: {error}")


# -- the jobs (run in the store's thread, on a pooled connection) --------------------------------


async def _open(
    conn: asyncpg.Connection, run_id: str, owner: str, lease: float
) -> coordinator.Lease | coordinator.Holder:
    taken = await coordinator.acquire(conn, run_id, owner=owner, lease=lease)
    if taken is not None:
        await conn.execute("UPDATE orchestra.runs SET state = 'open' WHERE id = $1", run_id)
        return taken
    held = await coordinator.holder(conn, run_id)
    assert held is not None  # acquire makes the run
    return held


async def _claim_step(
    conn: asyncpg.Connection,
    run_id: str,
    rooms: dict[str, int],
    owner: str,
    lease: float,
    limit: int | None,
) -> tuple[follow.Heard, list[leases.Claimed]]:
    heard = await follow.heard(conn, run_id)
    claimed: list[leases.Claimed] = []
    if any(room > 0 for room in rooms.values()):
        claimed = await leases.claim(conn, run_id, rooms, owner=owner, lease=lease, limit=limit)
    return heard, claimed


async def _release(conn: asyncpg.Connection, owner: str, held: list[tuple[str, str, int]]) -> None:
    await leases.release(conn, owner, held)


async def _apply(
    conn: asyncpg.Connection,
    run_id: str,
    lease: coordinator.Lease,
    admission: Admission,
    ops: list[tuple[str, Any]],
) -> list[str]:
    """Tell the database what the run did, in order: the coordinator's own writes (input,
    decided ends, priorities, the input's close) fenced by its lease on the run, its tasks' ends
    and failed attempts fenced by their leases. Returns the ids whose end was refused."""
    refused: list[str] = []
    i = 0
    while i < len(ops):
        kind = ops[i][0]
        j = i
        while (
            j < len(ops)
            and (ops[j][0] in _FENCED) == (kind in _FENCED)
            and (kind in _FENCED or ops[j][0] == kind)
        ):
            j += 1
        group = ops[i:j]
        if kind in _FENCED:
            async with coordinator.fenced(conn, lease):
                readied = False
                for what, op in _merged(group):
                    readied = await _fenced_op(conn, run_id, admission, what, op) or readied
                if readied:
                    await notify(conn, run_id)
        elif kind == "end":
            ends = [op[0] for _, op in group]
            spawned = {op[0].id: op[1] for _, op in group if op[1]}
            failures = {op[0].id: op[2] for _, op in group if op[2]}
            done = await leases.complete(
                conn, run_id, lease.owner, ends, spawned=spawned, admission=admission,
                failures=failures,
            )  # fmt: skip
            refused.extend(end.id for end, ok in zip(ends, done, strict=True) if not ok)
        elif kind == "note":
            await leases.note(conn, run_id, lease.owner, [op for _, op in group])
        else:  # "requeue"
            if await leases.requeue(conn, lease.owner, [op for _, op in group]):
                await notify(conn, run_id)
        i = j
    return refused


_FENCED = frozenset(("admit", "decide", "priority", "close_input"))


def _merged(group: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Consecutive items of a streamed input (each its own op) as one batch."""
    merged: list[tuple[str, Any]] = []
    for what, op in group:
        if what == "admit" and merged and merged[-1][0] == "admit":
            tasks, where, forward, first = merged[-1][1]
            more, where2, forward2, first2 = op
            if (where, forward, where2, forward2) == (
                "input item",
                False,
                "input item",
                False,
            ) and (first2 == first + len(tasks)):
                merged[-1] = ("admit", (tasks + more, where, forward, first))
                continue
        if what == "decide" and merged and merged[-1][0] == "decide":
            merged[-1] = ("decide", [*merged[-1][1], op])
            continue
        merged.append((what, [op] if what == "decide" else op))
    return merged


async def _fenced_op(
    conn: asyncpg.Connection, run_id: str, admission: Admission, what: str, op: Any
) -> bool:
    """One of the coordinator's own writes; True when it may have made tasks ready."""
    if what == "admit":
        tasks, where, forward, first = op
        _, ready, _ = await admit_in(conn, run_id, tasks, admission, where, forward, first, None)
        return bool(ready)
    if what == "decide":
        await follow.decide(conn, run_id, op)
        return False
    if what == "priority":
        task_id, priority = op
        await conn.execute(
            "UPDATE orchestra.tasks SET priority = $3 WHERE run_id = $1 AND id = $2 "
            "AND state IN ('pending', 'ready', 'retry_wait')",
            run_id, task_id, priority,
        )  # fmt: skip
        return False
    await close_input(conn, run_id)  # "close_input": notifies what it readies
    return False


async def _close(
    conn: asyncpg.Connection,
    lease: coordinator.Lease,
    held: list[tuple[str, str, int]],
    done: bool,
) -> None:
    """Hand back the tasks still held, unstarted (no attempt counted), mark the run closed when
    all its tasks ended, and give the run up (a standby or the next coordinator takes it now)."""
    await leases.release(conn, lease.owner, held)
    if done:
        with contextlib.suppress(coordinator.LeaseLost):
            async with coordinator.fenced(conn, lease):
                await conn.execute(
                    "UPDATE orchestra.runs SET state = 'closed', updated = now() WHERE id = $1",
                    lease.run_id,
                )
    await coordinator.hand_over(conn, lease)


def _storable(tasks: Sequence[Any], where: str) -> None:
    """Refuse a task whose payload or metadata JSON cannot hold, before anything is written."""
    for task in tasks:
        if not isinstance(task, Task):
            continue
        for field in ("payload", "metadata"):
            value = getattr(task, field)
            if value is None and field == "metadata":
                continue
            try:
                json_text(value)
            except ValueError as exc:
                raise InputError(
                    f"task {task.id!r} ({where}): {field} cannot be stored as JSON ({exc})",
                    task_id=task.id,
                    field=field,
                ) from None


def _task(row: Sequence[Any]) -> Task:
    """A task as its row holds it (a spawned one, heard with its spawner's end)."""
    (task_id, kind, payload, priority, depends_on, depends_on_tags, tags, key, timeout,
     critical, metadata) = row  # fmt: skip
    return Task(
        kind, json.loads(payload), id=task_id, priority=priority, depends_on=depends_on or (),
        depends_on_tags=depends_on_tags or (), tags=tags or (), key=key, timeout=timeout,
        critical=critical, metadata=None if metadata is None else json.loads(metadata),
    )  # fmt: skip
