"""What the app holds while it serves: the orchestrator its runs execute on (entered for the
app's lifespan), the store they are kept in, its tokens, and the runs this service started.

A run this service started is *live* here while it goes on: its `RunHandle` answers control
(pause, resume, cancel, stop, reprioritize) and status. Everything else about a run (the list,
its journal, its dead letters, a task) is read from the store, so it answers as well for runs
that ended before this process started or that another process runs. On PostgreSQL, control of
a run another replica runs is passed to it through the database, and the runs of a replica that
died are taken over (`_replicas.py`); control of a run another kind of process holds (``orchestra
run --dsn``, a program's own run) is refused (409) naming that process.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
import uuid
from collections import OrderedDict
from functools import partial
from typing import TYPE_CHECKING, Any, Final, cast

import anyio
import anyio.to_thread

from .._exceptions import ConfigError
from ..stores import SQLiteStore
from ..stores._sqlite import _leases as leases
from ._control import act
from ._errors import Refused
from ._keys import Keys
from ._tokens import TOKEN_TTL, Tokens, Verified

if TYPE_CHECKING:
    import sqlite3
    from collections.abc import Callable

    import asyncpg

    from .._core._handle import RunHandle
    from .._core._orchestrator import Orchestrator
    from .._spec import TaskSpec
    from ..stores._postgres._store import PostgresStore
    from ._replicas import Replicas

__all__ = ("Service",)

# Ended runs whose `RunResult` this process keeps for `/result` (the store keeps every task's
# end, not the aggregate): the most recent ones, so that memory stays bounded.
_KEPT_RESULTS: Final = 1000


class Service:
    """The orchestrator, its durable store, the tokens and the runs started here.

    Args:
        orchestrator: runs the submitted runs; its store must be durable (`SQLiteStore`,
            `PostgresStore`), so that runs are listed, read and resumed across processes.
        grace: on shutdown, seconds the running attempts of live runs may take to finish.
        metrics: what `/metrics` serves (an object with ``exposition() -> bytes``, as
            `orchestra.metrics.PrometheusMetrics`), or None.
        token_ttl: seconds a token the database found live is trusted without asking it again.
    """

    def __init__(
        self,
        orchestrator: Orchestrator,
        *,
        grace: float,
        metrics: Any,
        token_ttl: float = TOKEN_TTL,
    ) -> None:
        store = orchestrator.store
        if not isinstance(store, SQLiteStore) and not hasattr(store, "database"):
            raise ConfigError(
                f"the service keeps its runs in a durable store, and this orchestrator's is a "
                f"{type(store).__name__}: give it store=SQLiteStore(path) or "
                "store=PostgresStore(dsn) (`orchestra serve --db FILE` or `--dsn URL`)"
            )
        self.orchestrator = orchestrator
        self.store: Any = store
        # Several replicas on one PostgreSQL database; a SQLite file has one service process.
        self.replicas: Replicas | None = None
        if not isinstance(store, SQLiteStore):
            from ._replicas import Replicas

            self.replicas = Replicas(self, cast("PostgresStore", store))
        self.tokens = Tokens(store)
        self.idempotency = Keys(store)
        self.verified = Verified(self.tokens, ttl=token_ttl)
        self.grace = grace
        self.metrics = metrics
        self.live: dict[str, RunHandle] = {}
        self.ended: OrderedDict[str, RunHandle] = OrderedDict()
        self.keys: dict[str, str] = {}  # idempotency key -> the run id it started, this process
        # One submission of a run id at a time in this process: a second request with the same
        # id or key waits for the first's admission and finds its run, instead of opening the
        # run a second time.
        self._starting: dict[str, anyio.Lock] = {}

    # -- runs started here -----------------------------------------------------------------------

    def handle(self, run_id: str) -> RunHandle | None:
        """The handle of a run started here (live, or ended and kept), else None."""
        handle = self.live.get(run_id)
        if handle is not None and handle.done:
            self._ended(handle)
        return handle or self.ended.get(run_id)

    def _ended(self, handle: RunHandle) -> None:
        self.live.pop(handle.run_id, None)
        self.ended[handle.run_id] = handle
        while len(self.ended) > _KEPT_RESULTS:
            self.ended.popitem(last=False)

    async def submit(
        self,
        *,
        tasks: list[TaskSpec] | None,
        input: Any,
        run_id: str | None,
        key: str | None,
        digest: str | None = None,
        paused: bool = False,
    ) -> tuple[str, bool]:
        """Start a run (or find the one the same request started, or resume it); its id, and
        whether it is new. With an idempotency `key`, the run's id is the key's own
        (`key_run_id`) unless `run_id` names it: every replica on the store maps one key to one
        run; `digest` (`request_digest`) is the request's, and the key sent with another request
        than the one it started its run with is a 409. `paused`: the run starts paused (a run
        taken over as it was left)."""
        if key is not None:
            run_id = self.keys.get(key) or run_id or key_run_id(key)
        self.prune()
        if run_id is None and self.replicas is not None:
            run_id = new_run_id()  # known before it starts: written down for the other replicas
        if run_id is None:
            return await self._start(tasks, input, None, None), True
        lock = self._starting.setdefault(run_id, anyio.Lock())
        try:
            async with lock:
                unkept: tuple[str, str] | None = None  # the key's first request, and its digest
                if key is not None and digest is not None:
                    kept = await self.read(self.idempotency.digest_of, key)
                    if kept is not None and kept != digest:
                        raise Refused(
                            409,
                            "idempotency_key_reused",
                            f"Idempotency-Key {key!r} started run {run_id!r} with another "
                            "request: send that request again to read its run, or this one "
                            "with a new key",
                            field="Idempotency-Key",
                        )
                    if kept is None:  # written down once the request is answered
                        unkept = (key, digest)
                created = await self._submit(tasks, input, run_id, key, paused)
                if unkept is not None:
                    await self.read(self.idempotency.keep, unkept[0], run_id, unkept[1])
                return run_id, created
        finally:
            if not lock.locked() and lock.statistics().tasks_waiting == 0:
                self._starting.pop(run_id, None)

    async def _submit(
        self,
        tasks: list[TaskSpec] | None,
        input: Any,
        run_id: str,
        key: str | None,
        paused: bool,
    ) -> bool:
        """`submit`'s run id, under its lock: start the run, find it, or resume it; whether the
        request created it."""
        here = self.handle(run_id)
        if here is not None and not here.done:
            return False
        stored = await self.read(partial(self.store.run_info, counts=False), run_id)
        if (
            stored is not None
            and stored.get("state") != "open"
            and holder(stored) is None
            and not await self.read(self.has_tasks, run_id)
        ):
            # No task of it was ever admitted (its input was refused, and the run let go of
            # closed): the request that starts it is this one.
            stored = None
        if (stored is None and here is not None) or (
            stored is not None and (stored.get("state") != "open" or holder(stored) is not None)
        ):
            # A run the store holds: the same run, never a second one. One left open that no
            # process runs (its process died, or a retry reopened tasks) is resumed below with
            # this input: what succeeded is not run again. So is one this process stopped (its
            # handle is done, the run left open).
            return False
        await self._start(tasks, input, run_id, key, paused)
        return stored is None

    async def _start(
        self,
        tasks: list[TaskSpec] | None,
        input: Any,
        run_id: str | None,
        key: str | None,
        paused: bool = False,
    ) -> str:
        """Start the run and wait for its input's admission; its id."""
        orch = self.orchestrator
        registered = False
        if self.replicas is not None and run_id is not None and (tasks or input is not None):
            registered = await self.replicas.register(run_id, submission(tasks, input), paused)
        if tasks is not None:
            handle = orch.start(tasks=[spec.task() for spec in tasks], run_id=run_id)
        else:
            if orch.decomposer is None:
                raise Refused(
                    400,
                    "invalid",
                    "this service's orchestrator has no decomposer: give the run's tasks "
                    '({"tasks": [{"kind": ..., "payload": ...}]}), not an input',
                    field="input",
                )
            handle = orch.start(input, run_id=run_id)
        if paused:
            handle.pause()  # before its first attempt
        self.live[handle.run_id] = handle
        if key is not None:
            self.keys[key] = handle.run_id
        try:
            await handle.admitted()  # a bad input is a 400 now, not a failed run later
        except BaseException:
            self.live.pop(handle.run_id, None)
            if key is not None:
                self.keys.pop(key, None)
            if registered and self.replicas is not None:
                with anyio.CancelScope(shield=True):
                    await self.replicas.forget(handle.run_id)
            raise
        if self.replicas is not None:
            self.replicas.follow(handle)
        return handle.run_id

    def prune(self) -> None:
        """Move the runs that ended from `live` to `ended` (bounded)."""
        for handle in [h for h in self.live.values() if h.done]:
            self._ended(handle)

    async def shutdown(self) -> None:
        """Stop the live runs, each with `grace` for its running attempts (on PostgreSQL, given
        up for another replica to take over)."""
        if self.replicas is not None:
            self.replicas.closing = True
        async with anyio.create_task_group() as tg:
            for handle in list(self.live.values()):
                if not handle.done:
                    tg.start_soon(partial(_stop, handle, self.grace))

    # -- the store -------------------------------------------------------------------------------

    async def read(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)`` (a store's blocking read) in a worker thread: the event loop goes on
        serving while the store's own thread does the reading."""
        return await anyio.to_thread.run_sync(partial(call, *args))

    def has_tasks(self, run_id: str) -> bool:
        """Whether the store holds a task of `run_id` (one row read, not the run's counts)."""
        if isinstance(self.store, SQLiteStore):
            return bool(self.store.call(_sqlite_has_tasks, run_id))
        return bool(self.store.database.call(_pg_has_tasks, run_id))

    async def ping(self) -> None:
        """Ask the store's database the cheapest question (a `StoreError` when it cannot)."""
        await self.read(partial(self.store.run_info, counts=False), "")

    async def run_record(self, run_id: str, *, counts: bool = True) -> dict[str, Any]:
        """The store's record of `run_id` (as `store.runs()` gives it; without `counts`, none:
        they scan the run's tasks, and a stream asks ten times a second); 404 when it has none."""
        run = await self.read(partial(self.store.run_info, counts=counts), run_id)
        if run is not None:
            return run  # type: ignore[no-any-return]
        if self.handle(run_id) is not None:  # started here, its first rows not written yet
            return {"id": run_id, "state": "open", "counts": {}}
        raise Refused(
            404, "not_found", f"no run {run_id!r} in this service's store", field="run_id"
        )

    async def control(
        self, run_id: str, op: str, args: dict[str, Any], *, within: float | None = 0.0
    ) -> dict[str, Any]:
        """`op` (`_control.OPS`) done to `run_id` with `args`, its answer as JSON: here when it
        runs here; on PostgreSQL, by the replica that runs it, asked through the database
        (`within`: seconds more it may take, a stop's grace); else a 404 or 409 as
        `live_handle` says."""
        handle = self.handle(run_id)
        if handle is not None and not handle.done:
            answer = await act(handle, op, args)
            if op in ("pause", "resume") and self.replicas is not None:
                await self.replicas.paused(run_id, handle.paused)
            return answer
        run = await self.run_record(run_id, counts=False)
        if (
            (handle is None or handle.done)  # (one that ended here, resumed elsewhere since)
            and self.replicas is not None
            and run.get("state") == "open"
            and await self.replicas.passes_on(run_id)
        ):
            return await self.replicas.ask(run_id, op, args, within=within)
        await self.live_handle(run_id)  # the refusal that says why
        raise AssertionError("unreachable")  # pragma: no cover

    async def live_handle(self, run_id: str) -> RunHandle:
        """The handle of `run_id` to control it: 404 when the store has no such run, 409 when
        it is over or another process runs it."""
        handle = self.handle(run_id)
        if handle is not None and not handle.done:
            return handle
        run = await self.run_record(run_id, counts=False)
        held = holder(run)
        if held is not None and handle is None:
            raise Refused(
                409,
                "held_elsewhere",
                f"run {run_id!r} is run by another process ({held}): control it there",
                field="run_id",
            )
        raise Refused(
            409,
            "not_running",
            f"run {run_id!r} is not running here (state {run.get('state')!r}): it can be read, "
            "not controlled",
            field="run_id",
        )


def submission(tasks: list[TaskSpec] | None, input: Any) -> dict[str, Any]:
    """The request a run came with, as `SubmitRun` reads it back (a replica that takes the run
    over admits it again when the database lacks some of its input)."""
    if tasks is not None:
        return {"tasks": [t.model_dump(mode="json", exclude_unset=True) for t in tasks]}
    return {"input": input}


def key_run_id(key: str) -> str:
    """The id of the run an idempotency key starts: the same on every replica, and no key can
    choose another run's id (it is a hash, prefixed)."""
    return "key-" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def _sqlite_has_tasks(conn: sqlite3.Connection, run_id: str) -> bool:
    return (
        conn.execute("SELECT 1 FROM tasks WHERE run_id = ? LIMIT 1", (run_id,)).fetchone()
        is not None
    )


async def _pg_has_tasks(conn: asyncpg.Connection, run_id: str) -> bool:
    found = await conn.fetchval("SELECT 1 FROM orchestra.tasks WHERE run_id = $1 LIMIT 1", run_id)
    return found is not None


def holder(run: dict[str, Any]) -> str | None:
    """The process that runs `run` now (a store's `runs()` record), or None."""
    if "held" in run:  # PostgreSQL: its coordinator's lease, on the database's clock
        return str(run["owner"]) if run["held"] and run.get("owner") else None
    owner, seen, lease = run.get("owner"), run.get("heartbeat"), run.get("lease") or 30.0
    if owner is None or seen is None or time.time() - seen >= lease:
        return None
    if not leases.is_alive(owner):  # on this host, and its process is gone
        return None
    return str(owner)


async def _stop(handle: RunHandle, grace: float) -> None:
    with contextlib.suppress(Exception):  # a run that raised has nothing left to stop
        await handle.stop(grace, reason="the service is shutting down")
