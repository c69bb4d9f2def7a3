"""The workers' routes, under ``/api/workers`` (role ``worker``): what a worker that cannot reach
the database asks of the service (``orchestra worker --url``).

The service does for the remote worker what a worker on the database does for itself: each route
calls the store's own worker backend (`orchestra.stores._worker.backend_of`: SQLite's or
PostgreSQL's), so every claim, heartbeat, completion and release is the same SQL, fenced by the
lease's token in the database exactly as on the database path; the service adds no fencing of its
own. A late completion (the lease lapsed while the worker was paused or cut off) is refused by the
store and answered ``false``.

**Names.** A remote worker's name in the store is ``host:pid:TOKEN.suffix`` (`_wire.worker_name`),
the id of its token inside: a request that names a worker of another token is refused (403), so a
worker token touches only its own workers' leases.

**Presence.** ``POST /api/workers/{name}`` opens the worker's presence here: the backend's
`present` (its row in the store, and on PostgreSQL its beat, its sweep of expired leases and its
LISTEN connection for wake-ups), held open in a task of this router's lifespan until the worker
leaves (``DELETE``) or sends nothing for a lease (it died: its leases expire in the store, as any
dead worker's). A route for a worker with no presence here answers 409 ``unknown_worker``: the
service restarted (or dropped it), and the worker presents itself again and repeats the call.

**Wake-ups.** ``POST /{name}/wait`` is a long poll: it returns when the store's wake-up fires
(PostgreSQL's NOTIFY of new ready work) or after the poll asked for.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Final, cast

import anyio
from fastapi import APIRouter, Depends, FastAPI, Path, Query, Request, Response

from .._admission import Admission
from .._log import get_logger
from .._task import CANCELLED, FAILED, SKIPPED, SUCCEEDED, Attempt, Task, TaskResult
from ..stores._http._wire import (
    MAX_WAIT,
    NAME_PATTERN,
    Claimed,
    ClaimedTask,
    ClaimRequest,
    Closed,
    Completed,
    CompleteRequest,
    FailedAttempt,
    Heartbeat,
    HeartbeatRequest,
    Hello,
    Lease,
    Present,
    Presented,
    Released,
    ReleaseRequest,
    Spawn,
    TaskRef,
    Waited,
    WaitRequest,
    token_of,
)
from ..stores._worker import backend_of
from ._auth import require
from ._errors import Refused, responses
from ._models import ErrorBody
from ._tokens import TokenInfo

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator, Sequence

    from anyio.abc import TaskGroup

    from ..stores._worker import Backend
    from ..stores._worker_run import Claim

__all__ = ("Workers", "router")

log = get_logger("orchestra")

# The task states a worker writes, as the module's own strings: the backends compare with `is`.
_STATES: Final = {s: s for s in (SUCCEEDED, FAILED, CANCELLED, SKIPPED)}


class Session:
    """One remote worker's presence here: its backend (the store's worker side, for it alone:
    PostgreSQL's wake-ups are per worker), held open by `hold` until `stop` is set."""

    def __init__(self, name: str, run_id: str | None, kinds: list[str], backend: Backend) -> None:
        self.name = name
        self.run_id = run_id
        self.kinds = kinds
        self.backend = backend
        self.alive = False
        self.stop = anyio.Event()
        self.done = anyio.Event()
        self.seen = time.monotonic()
        self.busy = 0  # requests under way (a long poll may outlast a lease)

    async def hold(self, opened: anyio.Event, failed: list[Exception]) -> None:
        try:
            async with self.backend.present(self.name, self.run_id, self.kinds):
                self.alive = True
                opened.set()
                await self.stop.wait()
        except Exception as exc:  # the store failed: said to the request, or logged
            if opened.is_set():
                log.warning("remote worker's presence lost", worker=self.name, error=str(exc))
            else:
                failed.append(exc)
        finally:
            self.alive = False
            opened.set()
            self.done.set()

    @contextlib.contextmanager
    def using(self) -> Iterator[Backend]:
        """A request for this worker: it is seen, and not dropped while the request runs."""
        self.busy += 1
        self.seen = time.monotonic()
        try:
            yield self.backend
        finally:
            self.busy -= 1
            self.seen = time.monotonic()


class Workers:
    """The remote workers present here, their presences held in `tg`."""

    def __init__(self, store: Any, tg: TaskGroup) -> None:
        self.store = store
        self.tg = tg
        self.lease = float(store.lease)
        self.poll = backend_of(store).poll
        self.sessions: dict[str, Session] = {}
        self._presenting = anyio.Lock()

    async def present(self, name: str, run_id: str | None, kinds: list[str]) -> Session:
        """Open `name`'s presence (again: a worker that presents itself anew replaces its old
        presence, with its run and kinds)."""
        async with self._presenting:
            old = self.sessions.get(name)
            if old is not None:
                if old.alive and old.run_id == run_id and old.kinds == kinds:
                    old.seen = time.monotonic()
                    return old
                await self._close(old)
            session = Session(name, run_id, kinds, backend_of(self.store))
            opened = anyio.Event()
            failed: list[Exception] = []  # what failed the presence's opening
            self.tg.start_soon(session.hold, opened, failed)
            await opened.wait()
            if failed:
                raise failed[0]
            self.sessions[name] = session
            return session

    async def leave(self, name: str) -> None:
        session = self.sessions.get(name)
        if session is not None:
            await self._close(session)

    async def _close(self, session: Session) -> None:
        if self.sessions.get(session.name) is session:
            del self.sessions[session.name]
        session.stop.set()
        await session.done.wait()

    async def reap(self) -> None:
        """Drop the presences of workers silent for a lease (a live one beats every third of
        it): they died, and their leases expire in the store."""
        while True:
            await anyio.sleep(min(1.0, self.lease / 3))
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if not session.alive or (session.busy == 0 and now - session.seen > self.lease):
                    log.info("remote worker gone", worker=session.name)
                    await self._close(session)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The presences of remote workers, held in a task group of the app's lifespan (entered
    after the service's: its store is open)."""
    async with anyio.create_task_group() as tg:
        workers = Workers(app.state.service.store, tg)
        app.state.workers = workers
        tg.start_soon(workers.reap)
        try:
            yield
        finally:
            tg.cancel_scope.cancel()  # each presence leaves the store (shielded) as it ends


router = APIRouter(prefix="/api/workers", tags=["workers"], lifespan=_lifespan)

WorkerToken = Annotated[TokenInfo, Depends(require("worker"))]
NamePath = Annotated[
    str,
    Path(
        max_length=400,
        pattern=NAME_PATTERN,
        description="The worker's name in the store, host:pid:TOKEN_ID.suffix (from /hello).",
    ),
]


def _workers(request: Request) -> Workers:
    workers: Workers = request.app.state.workers
    return workers


WorkersDep = Annotated[Workers, Depends(_workers)]


def _own(name: str, token: TokenInfo) -> None:
    if token_of(name) != token.id:
        raise Refused(
            403,
            "forbidden",
            f"worker {name!r} works with another token: a worker token acts only for the "
            f"workers named with its id ({token.id!r})",
            field="name",
        )


async def _session(name: NamePath, token: WorkerToken, workers: WorkersDep) -> Session:
    """The present worker of the path, the token's own: 403 for another token's, 409 when it
    has no presence here."""
    _own(name, token)
    session = workers.sessions.get(name)
    if session is None or not session.alive:
        raise Refused(
            409,
            "unknown_worker",
            f"worker {name!r} is not present at this service (it restarted, or the worker was "
            f"silent for a lease): present it again (POST /api/workers/{name})",
            field="name",
        )
    return session


SessionDep = Annotated[Session, Depends(_session)]

_ERRORS: Final[dict[int | str, dict[str, Any]]] = {
    **responses(400, 401, 403, 503),
    409: {"model": ErrorBody, "description": "The worker is not present here: present it again."},
}


def _json(model: Any) -> Response:
    # Serialized once, here: the answer is built from the store's values, not the client's.
    return Response(model.model_dump_json(), media_type="application/json")


@router.get("/hello", response_model=Hello, responses=responses(401, 403))
async def hello(token: WorkerToken, workers: WorkersDep) -> Hello:
    """What a worker learns before it starts: its token's id (its name carries it), the store's
    lease and poll, and the service's clock."""
    return Hello(token_id=token.id, lease=workers.lease, poll=workers.poll, now=time.time())


@router.post(
    "/{name}",
    response_model=Presented,
    responses={**responses(400, 401, 403, 503)},
)
async def present(
    name: NamePath, body: Present, token: WorkerToken, workers: WorkersDep
) -> Presented:
    """The worker is here, serving `kinds` of `run_id` (None: every run): its row in the store,
    kept until it leaves or is silent for a lease."""
    _own(name, token)
    await workers.present(name, body.run_id, list(dict.fromkeys(body.kinds)))
    return Presented(name=name, lease=workers.lease, poll=workers.poll)


@router.delete(
    "/{name}", status_code=204, response_class=Response, responses=responses(401, 403, 503)
)
async def leave(name: NamePath, token: WorkerToken, workers: WorkersDep) -> Response:
    """The worker leaves: its row in the store says it stopped (hand back its claims first)."""
    _own(name, token)
    await workers.leave(name)
    return Response(status_code=204)


@router.post("/{name}/claim", response_model=Claimed, responses=_ERRORS)
async def claim(session: SessionDep, body: ClaimRequest) -> Response:
    """Claim up to `room` ready tasks, of each kind at most its room, under fenced leases."""
    with session.using() as backend:
        batch, maybe_over = await backend.claim(session.name, body.run_id, body.rooms, body.room)
    tasks = [_claimed(c) for c in batch]
    return _json(Claimed.model_construct(tasks=tasks, maybe_over=maybe_over))


def _claimed(c: Claim) -> ClaimedTask:
    return ClaimedTask.model_construct(
        run_id=c.run_id, id=c.id, token=c.token, kind=c.kind, payload=c.payload,
        priority=c.priority, timeout=c.timeout, critical=bool(c.critical),
        metadata=c.metadata, attempts=c.attempts, deps=c.deps,
    )  # fmt: skip


@router.get("/{name}/closed", response_model=Closed, responses=_ERRORS)
async def closed(
    session: SessionDep,
    run_id: Annotated[str, Query(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$")],
) -> Closed:
    """Whether the run's row says it is over."""
    with session.using() as backend:
        return Closed(closed=await backend.closed(run_id))


@router.post("/{name}/wait", response_model=Waited, responses=_ERRORS)
async def wait(session: SessionDep, body: WaitRequest) -> Waited:
    """Wait until new work may be ready (the store's wake-up), or `poll` seconds."""
    began = time.monotonic()
    with session.using() as backend:
        await backend.wait(min(body.poll, MAX_WAIT))
    return Waited(waited=time.monotonic() - began)


@dataclass(slots=True)
class _Held:
    """A lease as a request names it: what the backends read of a `Claim` to fence a write."""

    run_id: str
    id: str
    token: int


def _held(leases: Sequence[Lease]) -> list[Claim]:
    return [cast("Claim", _Held(lease.run_id, lease.id, lease.token)) for lease in leases]


@router.post("/{name}/heartbeat", response_model=Heartbeat, responses=_ERRORS)
async def heartbeat(session: SessionDep, body: HeartbeatRequest) -> Heartbeat:
    """Renew the worker's leases; the tasks of `held` it no longer holds."""
    with session.using() as backend:
        lost = await backend.heartbeat(session.name, _held(body.held))
    return Heartbeat(lost=[TaskRef(run_id=r, id=i) for r, i in sorted(lost)])


def _attempt(a: FailedAttempt) -> Attempt:
    return Attempt(**a.model_dump())  # the wire model's fields are Attempt's


@router.post("/{name}/complete", response_model=Completed, responses=_ERRORS)
async def complete(session: SessionDep, body: CompleteRequest) -> Response:
    """Write the ends of held tasks (with their failed attempts and spawns) and the failed
    attempts of held tasks that go on, each fenced by its lease's token; whether each end was
    taken (false: the lease was lost, the task's fate decided elsewhere)."""
    ends: list[tuple[Claim, TaskResult, Sequence[Attempt], Any]] = []
    spawning = False
    for end in body.ends:
        lease = end.lease
        output = None if end.output is None else json.loads(end.output)
        result = TaskResult(
            Task(end.kind, None, id=lease.id), 0, _STATES[end.status], output,
            end.agent, end.attempts, None, end.started, 0.0, error=end.error,
            defaulted=end.defaulted, error_type=end.error_type,
        )  # fmt: skip
        spawned = None
        if end.spawned is not None:
            spawning = True
            tasks = [_spawn(s) for s in end.spawned]
            spawned = (tasks, {s.id for s in end.spawned if s.named_here})
        held = cast("Claim", _Held(lease.run_id, lease.id, lease.token))
        ends.append((held, result, [_attempt(a) for a in end.failures], spawned))
    notes = [
        (cast("Claim", _Held(n.lease.run_id, n.lease.id, n.lease.token)), _attempt(n.attempt))
        for n in body.notes
    ]
    # The worker checked its spawns against its agents' payload models; the store checks them
    # against its run (ids, dependencies) and against the kinds the worker serves.
    admission = Admission(body.kinds, {}) if spawning else None
    with session.using() as backend:
        accepted = await backend.complete(session.name, body.wall0, ends, notes, admission)
    return _json(Completed.model_construct(accepted=accepted))


def _spawn(s: Spawn) -> Task:
    return Task(
        s.kind, s.payload, id=s.id, priority=s.priority, depends_on=s.depends_on,
        depends_on_tags=s.depends_on_tags, tags=s.tags, key=s.key, timeout=s.timeout,
        critical=s.critical, metadata=s.metadata,
    )  # fmt: skip


@router.post("/{name}/release", response_model=Released, responses=_ERRORS)
async def release(session: SessionDep, body: ReleaseRequest) -> Released:
    """Hand back claims not started (`held`; none named: every claim the worker holds): ready
    again at once, their attempts not counted."""
    with session.using() as backend:
        released = await backend.release(
            session.name, None if body.held is None else _held(body.held)
        )
    return Released(released=released)
