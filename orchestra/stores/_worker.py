"""Worker processes: `Orchestrator.work` runs the tasks other processes' runs keep in a SQLite file.

A run on a `SQLiteStore` has one coordinator (the process that runs it: it admits the input,
readies tasks, settles them, builds the result). More processes join it as *workers*: each
claims ready tasks of its kinds from the file under a lease (`_sqlite._leases.claim`), runs them with
its own agents, limits, retries and fallbacks, and writes back what they came to
(`_sqlite._leases.complete`), fenced by the lease's token: a worker whose lease lapsed (killed,
paused past it) has its late completion refused, and its tasks run again elsewhere, the attempt
counted.

There is no second run loop: a worker is an ordinary run of its orchestrator (`Owner`) whose input
is the file's ready queue (an async iterator that claims as the run has room) and whose results go
back to the file. That run's store is a `WorkerRun` (`orchestra.stores._worker_run`): the memory
store, but for what the file changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from pydantic_core import to_json

from .._exceptions import ConfigError, InvalidOutput, StoreError
from .._log import get_logger
from .._output import jsonable, stored_json
from .._task import CANCELLED, SUCCEEDED, Attempt, Task, TaskResult
from ._sqlite import _leases as leases
from ._worker_run import WorkerRun, WorkerStore

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Generator, Sequence

    from .._registry import Registry
    from ._protocol import Store
    from ._sqlite._leases import Claimed
    from ._sqlite._store import SQLiteStore

__all__ = ("LocalRun", "Owner", "WorkReport", "Worker", "work")

log = get_logger("orchestra")


class Owner(Protocol):
    """What a worker asks of the orchestrator it works for (`Orchestrator.work`, `orchestra
    worker`): its agents and its global limit, so that it claims no more than they can start, and
    a run of its own whose tasks are kept in the worker's store (`WorkerStore`), not the
    orchestrator's."""

    @property
    def registry(self) -> Registry: ...
    @property
    def concurrency(self) -> int: ...
    def _start_local(self, tasks: AsyncIterator[Task], run_id: str, store: Store) -> LocalRun: ...


class LocalRun(Protocol):
    """The worker's local run, as its orchestrator started it (a `RunHandle`)."""

    @property
    def done(self) -> bool: ...
    def results(self) -> Results: ...
    def cancel(self, *, task_id: list[str]) -> object: ...
    async def stop(self, grace: float | None = None) -> object: ...
    def __await__(self) -> Generator[Any, None, object]: ...


class Results(Protocol):
    """The results of a `LocalRun`, as its tasks end."""

    def __aiter__(self) -> AsyncIterator[TaskResult]: ...
    async def aclose(self) -> None: ...


@dataclass
class WorkReport:
    """What a worker did, returned by `Orchestrator.work`.

    Attributes:
        worker: its name in the file (``host:pid:id``).
        claimed: tasks it claimed.
        completed: tasks whose end it wrote (succeeded, failed, ...), accepted by the file.
        refused: completions the file refused: the lease had lapsed, or the coordinator had
            ended the task (a cancel, a deadline); the task's fate was decided elsewhere.
        lost: running tasks it cancelled because it no longer held their lease.
        released: claimed tasks it handed back unstarted when it stopped.
    """

    worker: str
    claimed: int = 0
    completed: int = 0
    refused: int = 0
    lost: int = 0
    released: int = 0


async def work(
    orch: Owner,
    store: SQLiteStore,
    *,
    run_id: str | None,
    kinds: Sequence[str] | None,
    poll: float,
) -> WorkReport:
    return await Worker(orch, store, run_id, kinds, poll).run()


class Worker:
    """One `Orchestrator.work` call: claims, a local run, completions, heartbeats."""

    def __init__(
        self,
        orch: Owner,
        store: SQLiteStore,
        run_id: str | None,
        kinds: Sequence[str] | None,
        poll: float,
    ) -> None:
        by_kind = orch.registry.by_kind
        served = [k for k, slots in by_kind.items() if slots]
        if kinds is None:
            wanted = sorted(served)
        else:
            if isinstance(kinds, str):
                raise ConfigError("kinds must be a list of kinds, not one string")
            try:
                wanted = list(dict.fromkeys(kinds))
            except TypeError:  # not iterable, or an unhashable kind
                raise ConfigError(f"kinds must be a list of kinds (str), got {kinds!r}") from None
            if not wanted:
                raise ConfigError(
                    "kinds is empty: name at least one kind to take (or none at all: every kind "
                    f"this orchestrator's agents serve, {sorted(served)})"
                )
            unknown = [k for k in wanted if k not in served]
            if unknown:
                raise ConfigError(
                    f"kinds {unknown} have no agent here (this orchestrator serves "
                    f"{sorted(served)})"
                )
        if not wanted:
            raise ConfigError("a worker needs at least one kind to serve: register an agent")
        if run_id is not None and not isinstance(run_id, str):
            raise ConfigError(f"run_id must be a str or None, got {run_id!r}")
        if isinstance(poll, bool) or not isinstance(poll, int | float) or not 0 < poll < math.inf:
            raise ConfigError(f"poll must be a positive number of seconds, got {poll!r}")
        self.orch = orch
        self.store = store
        self.run_id = run_id
        self.kinds = wanted
        self.poll = float(poll)
        self.name = leases.identity(uuid.uuid4().hex[:12])
        self.report = WorkReport(self.name)
        # What its agents can start at once, in all and per kind: a worker holds no more than
        # that, so tasks waiting for a slot stay in the file for other workers (a worker that
        # claimed up to its global limit held them under leases it renewed while they queued).
        agents = {slot.name: slot.concurrent for kind in wanted for slot in by_kind[kind]}
        self.capacity = min(orch.concurrency, sum(agents.values()))
        self.rooms = {
            kind: min(self.capacity, sum(agents[slot.name] for slot in by_kind[kind]))
            for kind in wanted
        }
        # The tasks this worker holds, by id: claimed, running, or ended and not yet written.
        self.held: dict[str, Claimed] = {}
        self.local: WorkerRun | None = None  # its local run's store, once open
        self.spawned: dict[str, list[dict[str, Any]]] = {}  # id -> what its attempt spawned
        self.ends: list[tuple[Claimed, TaskResult]] = []  # ended, to write
        # Attempts that failed here while their tasks go on (a retry), to write as they fail;
        # and the highest attempt number of each held task written (or being written) so.
        self.failed: list[tuple[Claimed, Attempt]] = []
        self.noted: dict[str, int] = {}
        self.writing: list[tuple[Claimed, TaskResult]] = []  # ended, being written
        self._room = anyio.Event()
        self._ended = anyio.Event()
        self._stopping = False
        self._finished = False  # the run it serves is over: stop claiming
        # The wall time of the local run's zero (its records' times count from it): its store
        # sets it when the run opens.
        self.wall0 = time.time()

    async def call(self, job: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self.store.submit(job, *args))

    # -- what its local run tells it (`_worker_run.Host`) ----------------------------------------

    def claim_of(self, task_id: str) -> Claimed | None:
        """The claim under which this worker holds `task_id`, if it does."""
        return self.held.get(task_id)

    def opened(self, run: WorkerRun) -> None:
        """Its local run has its store: claims ask it what its agents can start now."""
        self.local = run

    def ended(self, claimed: Claimed, result: TaskResult) -> None:
        """A held task ended here: its end is written with the next group commit."""
        self.ends.append((claimed, result))
        self._ended.set()

    def attempt_failed(self, claimed: Claimed, attempt: Attempt) -> None:
        """A held task's attempt failed and the task goes on: written as it fails."""
        self.failed.append((claimed, attempt))
        self._ended.set()

    def spawns(self, task_id: str, spawned: list[dict[str, Any]]) -> None:
        """What the attempt that ends `task_id` spawned, written with its end."""
        self.spawned[task_id] = spawned

    # -- the worker's life -----------------------------------------------------------------------

    async def run(self) -> WorkReport:
        store = self.store
        # Shielded: the row commits in the writer thread even when a cancel lands before the
        # answer is back, and only the `finally` below (`_leave`) takes it out again.
        with anyio.CancelScope(shield=True):
            await self.call(leases.register, self.name, self.run_id, self.kinds, time.time())
        log.info("worker started", worker=self.name, kinds=self.kinds, run_id=self.run_id)
        handle = self.orch._start_local(self._claims(), f"worker:{self.name}", WorkerStore(self))
        results = handle.results()
        try:
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._beat, handle)
                    tg.start_soon(self._write_ends)
                    async for result in results:
                        claimed = self.held.get(result.task_id)
                        if result.error_type == "Stopped":
                            # The local run stopped (a KeyboardInterrupt in an agent): the
                            # worker stops as on Ctrl-C, handing the task back (`_leave`),
                            # not ending it in the coordinator's run.
                            continue
                        if claimed is not None:
                            self.ended(claimed, result)
                    await handle
                    tg.cancel_scope.cancel()
            except BaseExceptionGroup as group:
                # The file failed under a heartbeat or a completion's write (full, locked,
                # corrupt): the caller gets the `StoreError` that says so, as the coordinator's
                # run raises it, not the task group's ExceptionGroup around it.
                error = _store_error(group)
                if error is None:
                    raise
                raise error from None
            await self._write()
        finally:
            with anyio.CancelScope(shield=True):
                await results.aclose()
                await self._leave(handle)
        log.info(
            "worker stopped",
            worker=self.name,
            claimed=self.report.claimed,
            completed=self.report.completed,
        )
        del store
        return self.report

    async def _leave(self, handle: LocalRun) -> None:
        """However the worker ends: stop its run, write what ended, hand back the rest."""
        self._stopping = True
        self._room.set()
        if not handle.done:
            with contextlib.suppress(Exception):  # its end is not ours to report
                await handle.stop(grace=0)
        try:
            await self._write()
            # Every task the file says it still holds, after the claims already in the writer
            # thread's queue (one a stop cancelled commits all the same, its answer dropped): a
            # claim left leased by a gone worker would wait out the lease and count an attempt.
            self.report.released += await self.call(leases.release, self.name, None)
        finally:
            await self.call(leases.unregister, self.name)

    # -- claims: the local run's input -----------------------------------------------------------

    async def _claims(self) -> AsyncIterator[Task]:
        store = self.store
        while not (self._stopping or self._finished):
            room = self.capacity - len(self.held)
            held = Counter(claimed.kind for claimed in self.held.values())
            rooms = {k: n - held[k] for k, n in self.rooms.items() if n > held[k]}
            if room <= 0 or not rooms:
                self._room = anyio.Event()
                await self._room.wait()
                continue
            local = self.local
            if local is not None:
                # What the agents can start now (a shared limit another user fills, a rate or
                # a breaker's wait that holds a task already), within the room above.
                ended = {claimed.id for claimed, _ in self.ends + self.writing}
                for kind, n in list(rooms.items()):
                    ids = [i for i, c in self.held.items() if c.kind == kind and i not in ended]
                    live = local.room(kind, ids)
                    if live < n:
                        rooms[kind] = live
                rooms = {k: n for k, n in rooms.items() if n > 0}
                room = min(room, sum(rooms.values()))
                if not rooms:  # room comes with a release here, or a refill: looked at again
                    await anyio.sleep(self.poll)
                    continue
            # A stop may drop this answer (the claim commits all the same): `_leave` hands back
            # whatever the file says this worker holds, not only what it heard of.
            batch, runs = await self.call(
                leases.claim, self.name, self.run_id, rooms, room, time.time(), store.lease
            )
            if (
                self.run_id is not None
                and self.run_id not in runs
                and not self.held
                and await self.call(_closed, self.run_id)
            ):
                self._finished = True
                return
            if not batch:
                await anyio.sleep(self.poll)
                continue
            taking: dict[str, Claimed] = {}
            clash = []  # another run's task of the same id is here: handed back, for a while
            for claimed in batch:
                if claimed.id in self.held or claimed.id in taking:
                    clash.append(claimed)
                else:
                    taking[claimed.id] = claimed
            # Held before anything is yielded or awaited: a stop handed back only what was held.
            self.held.update(taking)
            self.report.claimed += len(taking)
            if clash:
                with anyio.CancelScope(shield=True):
                    await self.call(
                        leases.release, self.name, [(c.run_id, c.id, c.token) for c in clash]
                    )
            for claimed in taking.values():
                yield Task(
                    claimed.kind,
                    json.loads(claimed.payload),
                    id=claimed.id,
                    priority=claimed.priority,
                    timeout=claimed.timeout,
                    critical=bool(claimed.critical),
                    metadata=None if claimed.metadata is None else json.loads(claimed.metadata),
                )
            if clash:  # not claimed again at once: it is still the best ready task of its run
                await anyio.sleep(self.poll)

    # -- completions -----------------------------------------------------------------------------

    async def _write_ends(self) -> None:
        # A group commit: one transaction for whatever ended while the last one was written.
        while True:
            await self._ended.wait()
            self._ended = anyio.Event()
            await self._write()

    async def _write(self) -> None:
        if not self.ends and not self.failed:
            return
        ends, self.ends = self.ends, []
        failed, self.failed = self.failed, []
        self.writing = ends
        noted = self.noted
        notes = []
        for claimed, attempt in failed:
            notes.append(
                (claimed.run_id, claimed.id, claimed.token, self._attempt_row(claimed, attempt))
            )
            noted[claimed.id] = max(noted.get(claimed.id, 0), attempt.number)
        rows = []
        attempts = []
        for claimed, result in ends:
            rows.append(self._end_row(claimed, result))
            written = noted.get(claimed.id, 0)
            attempts.append(
                [self._attempt_row(claimed, a) for a in result.failures or () if a.number > written]
            )
        try:
            # Shielded: a worker told to stop mid-write still learns which completions the file
            # took (the transaction commits either way).
            with anyio.CancelScope(shield=True):
                accepted = await self.call(
                    leases.complete, self.name, time.time(), rows, attempts, notes
                )
        finally:
            self.writing = []
        for (claimed, result), ok in zip(ends, accepted, strict=True):
            del self.held[claimed.id]
            noted.pop(claimed.id, None)
            self.spawned.pop(claimed.id, None)
            if ok:
                self.report.completed += 1
            elif result.status is not CANCELLED:
                self.report.refused += 1
                log.warning(
                    "completion refused: the lease was lost",
                    worker=self.name,
                    task_id=claimed.id,
                    run_id=claimed.run_id,
                )
        self._room.set()

    def _attempt_row(self, claimed: Claimed, a: Attempt) -> tuple[Any, ...]:
        return (claimed.run_id, claimed.id, a.number, a.agent, a.error_type, a.message,
                self.wall0 + a.started, a.duration, a.retry_in, a.traceback, a.status_code,
                a.api_error_type, a.request_id)  # fmt: skip

    def _end_row(self, claimed: Claimed, result: TaskResult) -> tuple[Any, ...]:
        status = result.status
        output = None
        error, error_type = result.error, result.error_type
        spawned = self.spawned.get(claimed.id)
        if status == SUCCEEDED:
            try:
                output = stored_json(result.output, claimed.id, result.agent)
            except InvalidOutput as exc:  # checked when it settled: this is a last resort
                status = "failed"
                error_type = "InvalidOutput"
                error = str(exc)
                spawned = None
        elif result.output is not None:  # a rejected output, kept for the record as JSON can
            output = to_json(jsonable(result.output)).decode()
        started = None if result.started is None else self.wall0 + result.started
        return (
            status,
            output,
            result.agent,
            error,
            error_type,
            int(result.defaulted),
            result.attempts,
            started,
            time.time(),
            # Metadata is free data: what JSON cannot say is kept as its repr, as a coordinator
            # stores it (the payloads were checked at the spawn).
            None if not spawned else to_json(spawned, fallback=repr).decode(),
            claimed.run_id,
            claimed.id,
            claimed.token,
        )

    # -- leases ----------------------------------------------------------------------------------

    async def _beat(self, handle: LocalRun) -> None:
        """Renew the leases every third of one; cancel the attempts of the tasks no longer held."""
        store = self.store
        while True:
            await anyio.sleep(store.lease / 3)
            held, _ = await self.call(leases.beat, self.name, time.time(), store.lease)
            ended = {claimed.id for claimed, _ in self.ends + self.writing}
            lost = [
                i
                for i, c in self.held.items()
                if (c.run_id, c.id, c.token) not in held and i not in ended
            ]
            if lost:
                self.report.lost += len(lost)
                log.warning("leases lost: cancelling", worker=self.name, task_ids=lost)
                handle.cancel(task_id=lost)


def _store_error(group: BaseExceptionGroup[BaseException]) -> StoreError | None:
    """The first `StoreError` in `group` (nested groups included), if there is one."""
    for error in group.exceptions:
        if isinstance(error, StoreError):
            return error
        if isinstance(error, BaseExceptionGroup):
            found = _store_error(error)
            if found is not None:
                return found
    return None


def _closed(conn: Any, run_id: str) -> bool:
    row = conn.execute("SELECT state FROM runs WHERE id = ?", (run_id,)).fetchone()
    return row is not None and row[0] == "closed"
