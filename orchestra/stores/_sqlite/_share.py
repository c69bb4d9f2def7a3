"""A coordinator's side of a run shared with worker processes (the SQL: `_leases.py`).

Once a live worker may serve the run (`polled`: a window's look at the `workers` table), the run is
*shared*: the window that says so writes every unfinished task's row again, and from then on a
ready task whose row the file holds as ready (`offered`: a worker may claim it too) is claimed
through the file before it runs here (`held_back`; `claiming` while the file is asked). A task a
worker holds is `remote` until it completes it (its ``done`` row is settled here, as if the task
had ended here) or its lease expires (`expired`: the attempt counted, the task ready again, or
failed once lost too often). A run that was not shared never pays for any of it but its window's
look at the workers.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import TYPE_CHECKING, Any, Protocol

from ..._exceptions import InputError
from ..._task import FAILED, TERMINAL, Attempt, Task
from . import _leases as leases
from ._rows import STATES

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable, Sequence
    from concurrent.futures import Future

    from ..._record import Record
    from .._memory import MemoryRun
    from ._rows import Rows
    from ._store import SQLiteStore

__all__ = ("Owner", "Sharing")

# A task whose lease expires this many times fails: a task that kills every worker it reaches (a
# segfault, the OOM killer) must not take the whole pool down one worker after another.
MAX_LOST = 3


class Owner(Protocol):
    """What the sharing asks of its run (`SQLiteRun`)."""

    run_id: str
    name: str  # the coordinator's, as the file knows it

    @property
    def closed(self) -> bool: ...
    def touch(self, record: Record) -> None: ...
    def arm(self) -> None: ...
    def wake(self) -> None: ...
    def run_here(self, record: Record) -> None: ...
    def keep_error(self, error: BaseException) -> None: ...
    def attempt_failed(self, record: Record, attempt: Attempt) -> None: ...
    def check_spawn(self, task: Task, parent: Any, pending: dict[str, Task]) -> None: ...
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
    ) -> bool: ...


class Sharing:
    """The sharing of one run with worker processes (a part of the run, holding it)."""

    def __init__(
        self,
        run: Owner,
        store: SQLiteStore,
        loop: asyncio.AbstractEventLoop | None,
        memory: MemoryRun,
        rows: Rows,
        kinds: frozenset[str],
        clock: Callable[[], float],
    ) -> None:
        self._run = run
        self._store = store
        self._loop = loop
        self._memory = memory
        self._rows = rows
        self._kinds = kinds  # the kinds the run has agents for
        self._now = clock
        self.shared = False
        self.offered: set[str] = set()
        self.claiming: set[str] = set()
        self.claiming_kinds: Counter[str] = Counter()  # `claiming`, counted by kind
        # Asked for (`claiming`) when a window took its lease back from a worker: the file holds
        # the row for this process now, so the refusal that comes is not a worker's hold.
        self.taken_back: set[str] = set()
        self.remote: dict[str, Record] = {}

    @property
    def active(self) -> bool:
        """Workers may hold this run's rows: its writes are guarded, its windows beat."""
        return self.shared or bool(self.remote)

    # -- claims ----------------------------------------------------------------------------------

    def held_back(self, record: Record) -> bool:
        """`record` (just claimed in memory) is offered to workers too: ask the file whether it is
        this process's (`granted`), and hold it back meanwhile. False: run it now."""
        if record.id not in self.offered:
            return False
        self._claim_offered(record)
        return True

    def _claim_offered(self, record: Record) -> None:
        run = self._run
        self.offered.discard(record.id)
        self.claiming.add(record.id)
        self.claiming_kinds[record.kind] += 1
        loop = self._loop
        assert loop is not None  # a run is shared only with a loop to poll from
        answer = self._store.submit(leases.claim_offered, run.run_id, record.id, run.name)
        answer.add_done_callback(lambda done: loop.call_soon_threadsafe(self.granted, record, done))

    def granted(self, record: Record, answer: Future[bool]) -> None:
        """The file's answer to `_claim_offered`: run the task here, or it is a worker's."""
        run = self._run
        self.claiming.discard(record.id)
        self.claiming_kinds[record.kind] -= 1
        if record.state in TERMINAL or run.closed:
            return
        taken_back = record.id in self.taken_back
        self.taken_back.discard(record.id)
        error = answer.exception()
        if error is not None:
            run.keep_error(error)  # raised when the run closes
        if error is not None or taken_back or answer.result():
            run.run_here(record)  # granted: `claim` hands it out next
        else:
            self.remote[record.id] = record  # a worker process's now
            run.wake()  # the dispatch that waited for it takes the next ready task

    # -- what a window learned ---------------------------------------------------------------------

    def polled(self, polled: leases.Polled) -> None:
        """What a window learned of the workers, taken in on the loop."""
        if self._run.closed:
            return
        if not self.shared and polled.workers and self._serves(polled.workers):
            self._share()
        if polled.expired:
            failures = self._rows.failures(polled.expired_attempts)
            for task_id, worker, attempts in polled.expired:
                record = self._memory.record_of(task_id)
                if record is not None and record.state not in TERMINAL:
                    _heard(record, failures.get(task_id))
                self._expired(task_id, worker, attempts)
        for task_id in polled.released:
            self._released(task_id)
        if polled.done:
            self._settle_done(polled.done, polled.done_attempts)

    def _serves(self, workers: list[str | None]) -> bool:
        kinds = self._kinds
        return any(k is None or not kinds.isdisjoint(json.loads(k)) for k in workers)

    def _share(self) -> None:
        """A worker may serve this run: from the next window on, workers may claim its ready rows.
        Every unfinished task's row is written again in that window (one the file holds as ready
        may be claimed here since), and the run is marked shared in the same transaction."""
        run = self._run
        self.shared = True
        for record in self._memory.records():
            if record.state not in TERMINAL:
                run.touch(record)
        run.arm()

    def _expired(self, task_id: str, worker: str, attempts: int) -> None:
        """A worker's lease lapsed (the file took the task back): its attempt counts as failed,
        and the task is ready again (its row written so in the next window), or, lost once too
        often, failed."""
        run = self._run
        memory = self._memory
        record = memory.record_of(task_id)
        if record is None or record.state in TERMINAL:
            return
        attempt = Attempt(
            number=attempts,
            agent=worker.rpartition(":")[0],
            error_type="LeaseExpired",
            message=f"worker {worker} stopped renewing its lease on the task (killed, paused or "
            "cut off): the attempt is counted and the task runs again",
            started=self._now() - memory.t0,
            duration=0.0,
        )
        record.attempts = attempts
        remote = self.remote.pop(task_id, None) is not None
        # The file holds its row as claimed (by this process) until a window writes it again.
        self.offered.discard(task_id)
        lost = 1 + sum(a.error_type == "LeaseExpired" for a in record.failures or ())
        if lost >= MAX_LOST:
            token = record.token if remote else memory.take(record)
            run.settle(
                record, token, FAILED, attempt=attempt, error_type="LeaseExpired",
                error=f"{lost} workers in a row lost the task (each stopped renewing its lease: "
                "killed, paused or cut off): it may be what kills them, so it is not run again",
            )  # fmt: skip
            return
        if remote:
            memory.fail(record, record.token, attempt)
        else:  # still ready here, or asked for (`claiming`): never claimed by this process
            if task_id in self.claiming:  # the file refuses the claim: the row is this process's
                self.taken_back.add(task_id)
            if record.failures is None:
                record.failures = [attempt]
            else:
                record.failures.append(attempt)
            run.touch(record)
        run.attempt_failed(record, attempt)

    def _released(self, task_id: str) -> None:
        """A task held for a worker's (`remote`) is ready in the file again, unleased: the worker
        handed it back unfinished (it stopped), no attempt counted. Ready here too: this process
        asks for it again, as for any ready task a worker may claim."""
        record = self.remote.pop(task_id, None)
        if record is None or record.state in TERMINAL:
            return
        record.token += 1  # whatever was heard under the old claim is stale
        self.offered.add(task_id)  # its row is ready: a worker may claim it first
        self._memory.ready(record)

    def _settle_done(self, rows: list[tuple[Any, ...]], attempt_rows: list[Any]) -> None:
        """Settle the tasks workers completed, as if they had ended here: dependents readied,
        spawned tasks admitted, the result heard by the run."""
        run = self._run
        memory = self._memory
        failures = self._rows.failures(attempt_rows) if attempt_rows else {}
        for (task_id, outcome, output, agent, error, error_type, defaulted, attempts, started,
             _finished, spawned) in rows:  # fmt: skip
            record = memory.record_of(task_id)
            if record is None or record.state in TERMINAL:
                continue  # ended here meanwhile (a cancel, a deadline): ours is final
            if task_id in self.remote or task_id in self.claiming:
                self.remote.pop(task_id, None)
                token = record.token
            else:
                token = memory.take(record)
            self.offered.discard(task_id)
            record.attempts = attempts
            _heard(record, failures.get(task_id))
            if started is not None:
                record.t_start = started - self._rows.offset
            value = None if output is None else json.loads(output)
            tasks = [] if spawned is None else [_task(d) for d in json.loads(spawned)]
            try:
                if any(task.id is None for task in tasks):
                    _name(run, record, tasks)
                run.settle(record, token, STATES[outcome], value, spawned=tasks, agent=agent,
                           error=error, error_type=error_type, defaulted=bool(defaulted))  # fmt: skip
            except InputError as exc:
                run.settle(
                    record, token, FAILED, agent=agent, error_type="InputError",
                    error=f"the tasks it spawned (on a worker) were refused: {exc}",
                )  # fmt: skip

    # -- resume ----------------------------------------------------------------------------------

    def resume(self, records: Sequence[Record], rows: Sequence[Any]) -> int:
        """What worker processes hold or completed while no coordinator ran (the rows `records`
        were loaded from): a lease stays the worker's (its task is remote here until it completes
        or the lease expires); a completion is settled now. Returns how many were."""
        memory = self._memory
        done = []
        for record, row in zip(records, rows, strict=True):
            lease_owner, outcome = row[28], row[30]
            if outcome is not None and row[14] == "done":
                memory.take(record)
                self.remote[record.id] = record
                done.append((row[0], outcome, *row[23:28], row[15], row[21], row[22], row[31]))
            elif lease_owner is not None and row[14] in ("claimed", "running"):
                # A worker's lease, live or lapsed: its task is remote until the worker completes
                # it or a window takes the lease back (the attempt counted), whether or not a
                # live worker makes the run shared again (`Window.flush` polls while any is).
                memory.take(record)
                self.remote[record.id] = record
        if done:  # their failed attempts are among the records' failures already
            self._settle_done(done, [])
        return len(done)


def _heard(record: Record, more: list[Attempt] | None) -> None:
    """Add to a record's failures the attempts workers wrote that it does not hold yet (not the
    ones written here: lost leases), in the order of their numbers."""
    if not more:
        return
    known = {a.number for a in record.failures or ()}
    new = [a for a in more if a.number not in known]
    if new:
        record.failures = sorted([*(record.failures or ()), *new], key=lambda a: a.number)


def _task(data: dict[str, Any]) -> Task:
    """A task a worker's attempt spawned, as the worker wrote it (`spawn_data` in
    stores/_worker_run.py), without the id the worker gave one it spawned unnamed (`_name` names
    it)."""
    return Task(
        data["kind"],
        data["payload"],
        id=None if data.get("named_here") else data.get("id"),
        priority=data.get("priority", 0),
        depends_on=data.get("depends_on", ()),
        depends_on_tags=data.get("depends_on_tags", ()),
        tags=data.get("tags", ()),
        key=data.get("key"),
        timeout=data.get("timeout"),
        critical=data.get("critical", False),
        metadata=data.get("metadata"),
    )


def _name(run: Owner, parent: Record, tasks: list[Task]) -> None:
    """Name the tasks a worker's attempt of `parent` spawned unnamed as the attempt would have
    here (`<parent id>/<kind>#<n>`, skipping an id the run has: only this process knows them),
    checking them as it would; raises `InputError` as a spawn here does."""
    pending: dict[str, Task] = {}
    for task in tasks:
        run.check_spawn(task, parent, pending)
        pending[task.id] = task
