"""Worker processes: `Orchestrator.work` runs the tasks other processes' runs keep in a shared
store (a SQLite file on one machine, a PostgreSQL database reached from many).

A run on a shared store has one coordinator (the process that runs it: it admits the input,
builds the result). More processes join it as *workers*: each claims ready tasks of its kinds
under a lease, runs them with its own agents, limits, retries and fallbacks, and writes back what
they came to, fenced by the lease's token: a worker whose lease lapsed (killed, paused past it)
has its late completion refused, and its tasks run again elsewhere, the attempt counted.

There is no second run loop: a worker is an ordinary run of its orchestrator (`Owner`) whose input
is the store's ready queue (an async iterator that claims as the run has room) and whose results
go back to the store. That run's store is a `WorkerRun` (`orchestra.stores._worker_run`): the
memory store, but for what the shared store changes. What differs between the shared stores (how
a claim, a heartbeat, a completion is written, who keeps the worker's row, what wakes an idle
worker) is its `Backend`: `_sqlite._worker` (calls in the file's writer thread) and
`_postgres._worker` (jobs on the database's connections).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from .._exceptions import ConfigError, StoreError
from .._log import get_logger
from .._task import CANCELLED, Attempt, Task, TaskResult
from ._sqlite._store import SQLiteStore
from ._sqlite._worker import SQLiteWorkerBackend
from ._worker_run import WorkerRun, WorkerStore, task_of

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Collection, Generator, Mapping, Sequence
    from contextlib import AbstractAsyncContextManager

    from .._admission import Admission
    from .._registry import Registry
    from ._protocol import Store
    from ._worker_run import Claim

__all__ = ("Backend", "LocalRun", "Owner", "WorkReport", "Worker", "backend_of")

log = get_logger("orchestra")


class Owner(Protocol):
    """What a worker asks of the orchestrator it works for (`Orchestrator.work`, `orchestra
    worker`; the engine's `LocalRuns`): its agents and its global limit, so that it claims no more
    than they can start, and a run of its own whose tasks are kept in the worker's store
    (`WorkerStore`), not the orchestrator's."""

    @property
    def registry(self) -> Registry: ...
    @property
    def concurrency(self) -> int: ...
    def start(self, tasks: AsyncIterator[Task], run_id: str, store: Store) -> LocalRun: ...


class LocalRun(Protocol):
    """The worker's local run, as its orchestrator started it (a `RunHandle`). Its ends are
    heard from its store (`Host.ended`), not read from a stream of its results."""

    @property
    def done(self) -> bool: ...
    def cancel(self, *, task_id: list[str]) -> object: ...
    async def stop(self, grace: float | None = None) -> object: ...
    def __await__(self) -> Generator[Any, None, object]: ...


class Backend(Protocol):
    """What a worker asks of the shared store it works for. Every call is a write or a read of
    that store; `Claim`s are the store's own.

    A backend may offer one call more, ``complete_and_claim(name, wall0, ends, notes, admission,
    then, taken)`` (the PostgreSQL one does): `complete`, and with `then` (run id, rooms, room)
    the claim `claim` would make, in the transaction that writes the ends; what it claimed is
    given to `taken` before that transaction commits. A worker's group commits use it when it is
    there (`Worker._write`)."""

    lease: float  # seconds a claim lasts unrenewed (the worker renews every third of it)
    poll: float  # seconds between looks when nothing woke the worker, unless it is given one

    def name(self, suffix: str) -> str:
        """The worker's name in the store (``host:pid:suffix``)."""
        ...

    def present(
        self, name: str, run_id: str | None, kinds: Sequence[str]
    ) -> AbstractAsyncContextManager[object]:
        """The worker's row in the store (and whatever keeps it alive) while the block runs."""
        ...

    async def claim(
        self, name: str, run_id: str | None, rooms: Mapping[str, int], room: int
    ) -> tuple[Sequence[Claim], bool]:
        """Claim up to `room` ready tasks, of each kind at most its room in `rooms`, of `run_id`
        (None: any run); and whether `run_id` may be over (then `closed` is asked)."""
        ...

    async def closed(self, run_id: str) -> bool:
        """Whether `run_id`'s row says it is over."""
        ...

    async def wait(self, poll: float) -> None:
        """Wait until new work may be ready: a wake-up, or `poll` seconds."""
        ...

    async def heartbeat(self, name: str, held: Sequence[Claim]) -> set[tuple[str, str]]:
        """Renew the leases of `held`; the (run id, task id) of the ones no longer held."""
        ...

    async def complete(
        self,
        name: str,
        wall0: float,
        ends: Sequence[tuple[Claim, TaskResult, Sequence[Attempt], Any]],
        notes: Sequence[tuple[Claim, Attempt]],
        admission: Admission | None,
    ) -> list[bool]:
        """Write the ends of held tasks (each with its failed attempts not yet written, and what
        its attempt spawned: the tasks and the ids given here) and the failed attempts of held
        tasks that go on (`notes`), fenced by their tokens; `wall0` is the wall time the local
        run's times count from; `admission`, the checks of the worker's run (its agents' kinds
        and payload models), for the spawns. Returns whether each end was accepted."""
        ...

    async def release(self, name: str, held: Sequence[Claim] | None) -> int:
        """Hand back claims (None: every one the store says `name` holds): ready again at once,
        the attempts not counted. Returns how many were still its own."""
        ...


@dataclass
class WorkReport:
    """What a worker did, returned by `Orchestrator.work`.

    Attributes:
        worker: its name in the store (``host:pid:id``).
        claimed: tasks it claimed.
        completed: tasks whose end it wrote (succeeded, failed, ...), accepted by the store.
        refused: completions the store refused: the lease had lapsed, or the coordinator had
            ended the task (a cancel, a deadline); the task's fate was decided elsewhere.
        lost: running tasks it cancelled because it no longer held their lease.
        released: claimed tasks it handed back unstarted when it stopped.
        passed_on: claimed tasks it handed back while it went on, because their agent would
            have kept them waiting (for its breaker's probe, for a rate to refill) while another
            process might run them.
    """

    worker: str
    claimed: int = 0
    completed: int = 0
    refused: int = 0
    lost: int = 0
    released: int = 0
    passed_on: int = 0


def backend_of(store: object) -> Backend:
    """The worker's side of `store`, a `SQLiteStore` or a `PostgresStore`.

    Raises:
        ConfigError: any other store.
    """
    if isinstance(store, SQLiteStore):
        return SQLiteWorkerBackend(store)
    try:
        # Imported only for a store that is not SQLite's: the core never imports asyncpg, and a
        # PostgresStore cannot exist unless this module (and asyncpg) could be imported.
        from ._postgres._store import PostgresStore
        from ._postgres._worker import PostgresWorkerBackend
    except ImportError:
        pass
    else:
        if isinstance(store, PostgresStore):
            return PostgresWorkerBackend(store)
    raise ConfigError(
        f"work() needs a SQLiteStore (the file the runs are kept in) or a PostgresStore (the "
        f"database they are kept in), got {store!r}"
    )


class Worker:
    """One `Orchestrator.work` call: claims, a local run, completions, heartbeats."""

    def __init__(
        self,
        orch: Owner,
        backend: Backend,
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
        self.backend = backend
        self.run_id = run_id
        self.kinds = wanted
        self.poll = float(poll)
        self.name = backend.name(uuid.uuid4().hex[:12])
        self.report = WorkReport(self.name)
        # What its agents can start at once, in all and per kind: a worker holds no more than
        # that, so tasks waiting for a slot stay in the store for other workers (a worker that
        # claimed up to its global limit held them under leases it renewed while they queued).
        agents = {slot.name: slot.concurrent for kind in wanted for slot in by_kind[kind]}
        self.capacity = min(orch.concurrency, sum(agents.values()))
        self.rooms = {
            kind: min(self.capacity, sum(agents[slot.name] for slot in by_kind[kind]))
            for kind in wanted
        }
        # The tasks this worker holds, by id: claimed, running, or ended and not yet written.
        self.held: dict[str, Claim] = {}
        self.local: WorkerRun | None = None  # its local run's store, once open
        # id -> what its attempt spawned, and the ids given here to the ones spawned unnamed
        self.spawned: dict[str, tuple[list[Task], set[str]]] = {}
        self.ends: list[tuple[Claim, TaskResult]] = []  # ended, to write
        # Attempts that failed here while their tasks go on (a retry), to write as they fail;
        # and the highest attempt number of each held task written (or being written) so.
        self.failed: list[tuple[Claim, Attempt]] = []
        self.noted: dict[str, int] = {}
        self.writing: list[tuple[Claim, TaskResult]] = []  # ended, being written
        # Handed back while it waited: its local end (a cancel) is still to come out of the run.
        self.passing: set[str] = set()
        # The tasks whose lease a renewal found lost, cancelled here: counted `lost` when their
        # cancelled end comes, or `refused` if they ended otherwise first (each task once).
        self.losing: set[str] = set()
        # Claimed with ends written (`_write`), held, for `_claims` to yield; and whether a claim
        # is under way (`_claims`' or `_write`'s: the other waits, or claims nothing).
        self.ahead: list[Claim] = []
        self._claiming = False
        self._room = anyio.Event()
        # Set per end: a bare asyncio event (a worker runs on asyncio: `_burst`), whose `set` is
        # one call, not anyio's wrapper around it.
        self._ended = asyncio.Event()
        self._stopping = False
        self._finished = False  # the run it serves is over: stop claiming
        self._handle: LocalRun | None = None
        # The wall time of the local run's zero (its records' times count from it): its store
        # sets it when the run opens.
        self.wall0 = time.time()

    @property
    def stopping(self) -> bool:
        """Whether it is stopping (drained or cancelled): it claims no more."""
        return self._stopping

    # -- what its local run tells it (`_worker_run.Host`) ----------------------------------------

    def claim_of(self, task_id: str) -> Claim | None:
        """The claim under which this worker holds `task_id`, if it does."""
        return self.held.get(task_id)

    def opened(self, run: WorkerRun) -> None:
        """Its local run has its store: claims ask it what its agents can start now."""
        self.local = run

    def ended(self, result: TaskResult) -> None:
        """A task ended in the local run: if this worker still holds it, its end is written with
        the next group commit."""
        if result.error_type == "Stopped":
            # The local run stopped (a KeyboardInterrupt in an agent, a drain): the task is
            # handed back (`_leave`), not ended in the coordinator's run.
            return
        task_id = result.task_id
        if result.status is CANCELLED and task_id in self.passing:
            # Its local end as it was handed back (`_hand_back`): not an end of the task, nor of
            # a claim of it made since.
            self.passing.discard(task_id)
            return
        claimed = self.held.get(task_id)
        if claimed is not None:
            self.ends.append((claimed, result))
            self._ended.set()

    def attempt_failed(self, claimed: Claim, attempt: Attempt) -> None:
        """A held task's attempt failed and the task goes on: written as it fails."""
        self.failed.append((claimed, attempt))
        self._ended.set()

    def spawns(self, task_id: str, spawned: list[Task], named_here: set[str]) -> None:
        """What the attempt that ends `task_id` spawned, written with its end."""
        self.spawned[task_id] = (spawned, named_here)

    # -- the worker's life -----------------------------------------------------------------------

    async def run(self) -> WorkReport:
        async with self.backend.present(self.name, self.run_id, self.kinds):
            await self._serve()
        log.info(
            "worker stopped",
            worker=self.name,
            claimed=self.report.claimed,
            completed=self.report.completed,
        )
        return self.report

    async def drain(self, grace: float) -> None:
        """Stop gracefully: claim no more, give the running attempts `grace` seconds to finish
        (their ends are written), and hand back the rest at once (`run` then returns)."""
        self._stopping = True
        self._room.set()
        handle = self._handle
        if handle is not None and not handle.done:
            with contextlib.suppress(Exception):  # its end is not ours to report
                await handle.stop(grace=grace)

    async def _serve(self) -> None:
        log.info("worker started", worker=self.name, kinds=self.kinds, run_id=self.run_id)
        handle = self.orch.start(self._claims(), f"worker:{self.name}", WorkerStore(self))
        self._handle = handle
        try:
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._beat, handle)
                    tg.start_soon(self._write_ends)
                    # Its ends come from its store as they happen (`ended`), in the step that
                    # ends them: no stream of results to carry them here one by one.
                    await handle
                    tg.cancel_scope.cancel()
            except BaseExceptionGroup as group:
                # The store failed under a heartbeat or a completion's write (full, locked,
                # corrupt, out of reach): the caller gets the `StoreError` that says so, as the
                # coordinator's run raises it, not the task group's ExceptionGroup around it.
                error = _store_error(group)
                if error is None:
                    raise
                raise error from None
            await self._write()
        finally:
            with anyio.CancelScope(shield=True):
                await self._leave(handle)

    async def _leave(self, handle: LocalRun) -> None:
        """However the worker ends: stop its run, write what ended, hand back the rest."""
        self._stopping = True
        self._room.set()
        if not handle.done:
            with contextlib.suppress(Exception):  # its end is not ours to report
                await handle.stop(grace=0)
        await self._write()
        # Every task the store says it still holds, after the claims already under way (one a
        # stop cancelled commits all the same, its answer dropped): a claim left leased by a
        # gone worker would wait out the lease and count an attempt.
        self.report.released += await self.backend.release(self.name, None)

    # -- claims: the local run's input -----------------------------------------------------------

    def _rooms(self, leaving: Collection[str] = ()) -> tuple[dict[str, int], int, bool]:
        """What a claim may take now, the tasks of `leaving` (ends written with the claim) no
        longer held: the room of each kind, the room in all (0: none), and, when there is none,
        whether the agents (not the leases) are what leave none."""
        # A task holds its room until its end is written (the store's leases are what other
        # workers see: a worker holds no more than its agents can start). Asked as often as the
        # room may have changed, most often while it holds its whole room: that is answered
        # before the held tasks are counted by kind.
        holding = self.held
        kept = holding.keys() - leaving if leaving else holding.keys()
        room = self.capacity - len(kept)
        if room <= 0:
            return {}, 0, False
        held = [holding[i] for i in kept]
        counts = Counter(claimed.kind for claimed in held)
        rooms = {k: n - counts[k] for k, n in self.rooms.items() if n > counts[k]}
        if not rooms:
            return {}, 0, False
        local = self.local
        if local is not None:
            # What the agents can start now (a shared limit another user fills, a rate or a
            # breaker's wait that holds a task already), within the room above; a task ended
            # here whose end is not written yet still holds its agent's place (its agent is
            # free, but its lease is not: the worker would hold one more).
            ended = {claimed.id for claimed, _ in self.ends + self.writing}.difference(leaving)
            for kind, n in list(rooms.items()):
                of_kind = [c.id for c in held if c.kind == kind]
                ids = [i for i in of_kind if i not in ended]
                live = local.room(kind, ids) - (len(of_kind) - len(ids))
                if live < n:
                    rooms[kind] = live
            rooms = {k: n for k, n in rooms.items() if n > 0}
            room = min(room, sum(rooms.values()))
            if not rooms:
                return {}, 0, True
        return rooms, room, False

    def _take(self, batch: Sequence[Claim]) -> tuple[list[Claim], list[Claim]]:
        """Hold what a claim brought (before anything is yielded or awaited: a stop hands back
        only what is held); and the claims of a task held already (another run's task of the
        same id), to hand back."""
        taking: dict[str, Claim] = {}
        clash = []
        for claimed in batch:
            if claimed.id in self.held or claimed.id in taking:
                clash.append(claimed)
            else:
                taking[claimed.id] = claimed
        self.held.update(taking)
        self.report.claimed += len(taking)
        return list(taking.values()), clash

    async def _claims(self) -> AsyncIterator[Task]:
        backend = self.backend
        while not (self._stopping or self._finished):
            clash: list[Claim] = []
            if self.ahead:
                # Claimed with the last ends written (`_write`), held already.
                taking, self.ahead = self.ahead, []
            else:
                # The room a burst of ends frees is claimed in one claim, not a claim per end.
                await self._burst()
                rooms, room, limited = self._rooms()
                if not room or self._claiming:
                    # Room comes with an end written here (`_write` says so, and may have
                    # claimed it already), a release, or a refill of the agents' limits
                    # elsewhere: looked at again then, or after a poll when the agents are what
                    # leave none.
                    self._room = anyio.Event()
                    with anyio.move_on_after(self.poll if limited else math.inf):
                        await self._room.wait()
                    continue
                # A stop may drop this answer (the claim commits all the same): `_leave` hands
                # back whatever the store says this worker holds, not only what it heard of.
                self._claiming = True
                try:
                    batch, maybe_over = await backend.claim(self.name, self.run_id, rooms, room)
                finally:
                    self._claiming = False
                if (
                    self.run_id is not None
                    and maybe_over
                    and not batch
                    and not self.held
                    and await backend.closed(self.run_id)
                ):
                    self._finished = True
                    return
                if self.stopping:  # a drain began while this claim was written: none of it runs
                    # Claimed all the same (the store counts it so): claimed, then released.
                    self.report.claimed += len(batch)
                    with anyio.CancelScope(shield=True):
                        self.report.released += await backend.release(self.name, list(batch))
                    return
                if not batch:
                    await backend.wait(self.poll)
                    continue
                taking, clash = self._take(batch)
                if clash:
                    with anyio.CancelScope(shield=True):
                        await backend.release(self.name, clash)
            for claimed in taking:
                yield task_of(claimed)
            if clash:  # not claimed again at once: it is still the best ready task of its run
                await anyio.sleep(self.poll)

    # -- completions -----------------------------------------------------------------------------

    async def _write_ends(self) -> None:
        # A group commit: one transaction for whatever ended while the last one was written.
        while True:
            await self._ended.wait()
            # The tasks of one claim end over a few turns of the loop: the turns that still bring
            # ends are waited for, so that a burst goes in one commit, not in one per turn. One
            # commit per turn would also hand the room back in slivers, and the claims follow the
            # room: small claims, small commits, each paying a durable commit's latency.
            await self._burst()
            self._ended = asyncio.Event()
            await self._write(claim=True)

    async def _burst(self) -> None:
        """Wait out the turns of the loop that still bring ends."""
        count = -1
        while count != len(self.ends):
            count = len(self.ends)
            # A bare turn of the loop: anyio's checkpoint would first look up which loop this
            # is (sniffio), a few turns per burst, twice per burst (claims and writes).
            await asyncio.sleep(0)

    async def _write(self, claim: bool = False) -> None:
        """Write what ended and the failed attempts; with `claim`, and a backend that can
        (``complete_and_claim``: the PostgreSQL one), claim the room these ends give back in the
        same transaction (one commit where a claim after the write took a second one)."""
        if not self.ends and not self.failed:
            return
        ends, self.ends = self.ends, []
        failed, self.failed = self.failed, []
        self.writing = ends
        chain = getattr(self.backend, "complete_and_claim", None) if claim else None
        then = None
        if (
            chain is not None
            and ends
            and self.run_id is not None
            and not (self._stopping or self._finished or self._claiming)
        ):
            # The room as it is once these ends are written (they are, before the claim).
            rooms, room, _ = self._rooms({claimed.id for claimed, _ in ends})
            if room:
                then = (self.run_id, rooms, room)
        noted = self.noted
        for claimed, attempt in failed:
            noted[claimed.id] = max(noted.get(claimed.id, 0), attempt.number)
        rows = []
        spawned = self.spawned
        for claimed, result in ends:
            failures: Sequence[Attempt] = result.failures or ()
            if failures:
                written = noted.get(claimed.id, 0)
                failures = [a for a in failures if a.number > written]
            rows.append((claimed, result, failures, spawned.get(claimed.id) if spawned else None))
        # Claimed with the write and not to run, handed back after it: all of it once the worker
        # stops; a task held already (`_take`).
        unrun: list[Claim] = []
        clashes: list[Claim] = []

        def taken(batch: Sequence[Claim]) -> None:
            # Before the commit (`_leases.NextClaim`): the local run starts them while it is
            # flushed, with the room these ends gave back.
            if self._stopping or self._finished:
                # Claimed all the same (the store counts it so): claimed, then released.
                self.report.claimed += len(batch)
                unrun.extend(batch)
                return
            taking, clash = self._take(batch)
            clashes.extend(clash)
            self.ahead.extend(taking)  # for `_claims` to yield
            self._room.set()

        try:
            # Shielded: a worker told to stop mid-write still learns which completions the store
            # took (the transaction commits either way).
            with anyio.CancelScope(shield=True):
                admission = None if self.local is None else self.local.admission
                if then is None:
                    accepted = await self.backend.complete(
                        self.name, self.wall0, rows, failed, admission
                    )
                else:
                    assert chain is not None  # (`then` says so)
                    self._claiming = True  # (no claim of `_claims` meanwhile: one room, one claim)
                    try:
                        accepted = await chain(
                            self.name, self.wall0, rows, failed, admission, then, taken
                        )
                    finally:
                        self._claiming = False
        finally:
            self.writing = []
        held = self.held
        lost = self.losing
        completed = 0
        for (claimed, result), ok in zip(ends, accepted, strict=True):
            task_id = claimed.id
            del held[task_id]
            if noted:
                noted.pop(task_id, None)
            if spawned:
                spawned.pop(task_id, None)
            losing = task_id in lost
            if losing:
                lost.discard(task_id)
            if ok:
                completed += 1
            elif result.status is CANCELLED:
                if losing:
                    self.report.lost += 1
            else:
                self.report.refused += 1
                log.warning(
                    "completion refused: the lease was lost",
                    worker=self.name,
                    task_id=task_id,
                    run_id=claimed.run_id,
                )
        self.report.completed += completed
        if unrun or clashes:
            with anyio.CancelScope(shield=True):
                if unrun:
                    self.report.released += await self.backend.release(self.name, unrun)
                if clashes:
                    await self.backend.release(self.name, clashes)
        self._room.set()

    # -- leases ----------------------------------------------------------------------------------

    async def _hand_back(self, handle: LocalRun, longer_than: float) -> None:
        """Hand back to the store the held tasks that wait here for their agent to recover or for
        its limits to refill (a rate, a Retry-After pause) for more than `longer_than` seconds:
        ready there again at once, for a process that can start them sooner, their attempts so
        far counted. Claims already take only what can start now (`WorkerRun.room`); these are
        what a wait caught after they were claimed (a pause another attempt's 429 set, a breaker
        that opened under the worker's retries). Not claimed again here while the wait lasts:
        the room has none for them until then."""
        local = self.local
        if local is None or not local.stalled(longer_than):
            return
        await self._write()  # their failed attempts first: the hand-back ends the lease
        local = self.local
        assert local is not None
        ended = {claimed.id for claimed, _ in self.ends + self.writing}
        ids = [i for i in local.stalled(longer_than) if i in self.held and i not in ended]
        if not ids:
            return
        claims = [self.held.pop(i) for i in ids]
        for i in ids:
            self.noted.pop(i, None)
            self.spawned.pop(i, None)
        # Ended in the local run at once, unreported (`_serve` skips their ends).
        self.passing.update(ids)
        handle.cancel(task_id=ids)
        with anyio.CancelScope(shield=True):
            self.report.passed_on += await self.backend.release(self.name, claims)
        log.info("tasks handed back: their agent waits", worker=self.name, task_ids=ids)
        self._room.set()

    async def _beat(self, handle: LocalRun) -> None:
        """Renew the leases every third of one; cancel the attempts of the tasks no longer held;
        hand back the ones that would still wait for their agent at the next renewal."""
        backend = self.backend
        while True:
            await anyio.sleep(backend.lease / 3)
            await self._hand_back(handle, backend.lease / 3)
            lost_here = await backend.heartbeat(self.name, list(self.held.values()))
            ended = {claimed.id for claimed, _ in self.ends + self.writing}
            lost = [
                i for i, c in self.held.items() if (c.run_id, c.id) in lost_here and i not in ended
            ]
            if lost:
                self.losing.update(lost)
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
