"""A worker process's side of a PostgreSQL database: what `orchestra.stores._worker.Worker` asks
of the store it works for (its `Backend`), as jobs of `_leases` on connections of the store's
database opened on the worker's own event loop (`Database.local`: no hop to the store's thread).

- **Claims** (`_leases.claim`): of the worker's run, or, serving every run, of each open run with
  ready tasks of its kinds, oldest first, until its room is used.
- **Completions** (`_leases.complete`), one transaction per run for what ended meanwhile (a group
  commit): each end carries its attempts, its failed attempts not yet noted, and its attempt's
  spawns, admitted with it under the checks of the worker's run (its agents' kinds and payload
  models, as the coordinator's would be: the same agents). A spawn the run refuses (a duplicate
  id, an unknown dependency) fails its spawner with an ``InputError``, as a coordinator fails it,
  and the others' ends are written all the same. Failed attempts of a task retried here are
  written as they fail (`_leases.note`).
- **Presence** (`_processes.Presence`): the worker's row, its beat, and the sweep that takes back
  the expired leases of dead processes; **wake-ups** (`_listen.Listener`) on its run's channel,
  or the global one when it serves every run, with the store's `poll` behind them.

Every time is the database's: leases and expiries are ``now()`` there, and the times of the
worker's own attempts (measured on its monotonic clock, from the wall time its local run started)
are moved onto the database's clock by the difference the worker measured when it joined, so a
worker whose clock is off writes the same times as one whose clock is right.
"""

from __future__ import annotations

import contextlib
import copy
import os
import socket
import time
from typing import TYPE_CHECKING, Any

import anyio
import asyncpg

from ..._exceptions import InputError, StoreError
from ..._task import CANCELLED, FAILED
from .._worker_run import ending
from ._database import explain
from ._leases import (
    Claimed,
    End,
    Failed,
    NextClaim,
    claim,
    complete,
    complete_and_claim,
    heartbeat,
    note,
    release,
)
from ._listen import ENDED, GLOBAL_CHANNEL, Listener, Wakeup, channel_of, notify
from ._processes import Presence

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence

    from ..._admission import Admission
    from ..._task import Attempt, Task, TaskResult
    from .._worker_run import Claim
    from ._database import Local
    from ._store import PostgresStore

__all__ = ("PostgresWorkerBackend",)

# What a database out of reach raises under the presence and the listener (their own
# connections, not the pool's, whose errors `Database` explains already).
_LOST = (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError)


class PostgresWorkerBackend:
    """The claims, heartbeats and completions of a worker on `store`'s database."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
        self.database = store.database
        self.lease = store.lease
        self.poll = store.poll
        self._wakeup = Wakeup()
        self._presence: Presence | None = None
        self._offset = 0.0  # the database's clock less this process's wall clock, seconds
        self._local: Local | None = None  # its connections, on its loop, while it is present

    async def _run(self, job: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Any:
        """``await job(conn, *args)`` on the worker's connections (the store's, outside
        `present`)."""
        local = self._local
        return await (self.database.run if local is None else local.run)(job, *args)

    def name(self, suffix: str) -> str:
        return f"{socket.gethostname()}:{os.getpid()}:{suffix}"

    @contextlib.asynccontextmanager
    async def present(
        self, name: str, run_id: str | None, kinds: Sequence[str]
    ) -> AsyncIterator[None]:
        database = self.database
        await database.run(_now)  # the pool opened, the schema migrated (a StoreError if not)
        # The worker's jobs run on connections of its own loop, not in the store's thread.
        local = await database.local()
        try:
            before = time.time()
            now: float = await local.run(_now)
            self._offset = now - (before + time.time()) / 2
            self._local = local
            async with self._present(name, run_id, kinds):
                yield
        finally:
            self._local = None
            with anyio.CancelScope(shield=True):
                await local.close()

    @contextlib.asynccontextmanager
    async def _present(
        self, name: str, run_id: str | None, kinds: Sequence[str]
    ) -> AsyncIterator[None]:
        database = self.database
        channel = GLOBAL_CHANNEL if run_id is None else channel_of(run_id)
        wake = self._wakeup.set

        def woken(channel: str, payload: str) -> None:
            if payload != ENDED:  # another process's ends: the coordinator's news, not ours
                wake()

        presence: Presence | None = None
        try:
            async with (
                Presence(
                    database.dsn, name, host=socket.gethostname(), pid=os.getpid(),
                    lease=self.lease, kinds=kinds, run_id=run_id, on_swept=wake,
                ) as presence,
                Listener(database.dsn, [channel], on_notify=woken, on_reconnect=wake),
            ):  # fmt: skip
                self._presence = presence
                try:
                    yield
                finally:
                    self._presence = None
        except _LOST as exc:
            raise StoreError(explain(exc, database.dsn)) from exc
        finally:
            if presence is not None:
                # What it did since its last beat, which the presence (gone now, its beats over)
                # did not take to its row: the row says what the worker did, to its end.
                with anyio.CancelScope(shield=True), contextlib.suppress(StoreError):
                    await self._run(
                        _counted, name, presence.claimed, presence.completed, presence.refused
                    )

    async def claim(
        self, name: str, run_id: str | None, rooms: Mapping[str, int], room: int
    ) -> tuple[list[Claimed], bool]:
        claimed, closed = await self._run(_claim, name, run_id, dict(rooms), room, self.lease)
        if self._presence is not None:
            self._presence.claimed += len(claimed)
        # A claim counts the attempt its lease is for; the worker's run counts it again when it
        # starts it: it is given the attempts made before.
        return [_before(c) for c in claimed], closed

    async def closed(self, run_id: str) -> bool:
        return bool(await self._run(_closed, run_id))

    async def wait(self, poll: float) -> None:
        await self._wakeup.wait(poll)

    async def heartbeat(self, name: str, held: Sequence[Claim]) -> set[tuple[str, str]]:
        leases = [(c.run_id, c.id, c.token) for c in held]
        lost: set[tuple[str, str]] = await self._run(_heartbeat, name, leases, self.lease)
        return lost

    async def complete(
        self,
        name: str,
        wall0: float,
        ends: Sequence[tuple[Claim, TaskResult, Sequence[Attempt], Any]],
        notes: Sequence[tuple[Claim, Attempt]],
        admission: Admission | None,
    ) -> list[bool]:
        return await self.complete_and_claim(name, wall0, ends, notes, admission, None, None)

    async def complete_and_claim(
        self,
        name: str,
        wall0: float,
        ends: Sequence[tuple[Claim, TaskResult, Sequence[Attempt], Any]],
        notes: Sequence[tuple[Claim, Attempt]],
        admission: Admission | None,
        then: tuple[str, Mapping[str, int], int] | None,
        taken: Callable[[list[Claimed]], None] | None,
    ) -> list[bool]:
        """`complete`, and with `then` (run id, rooms, room) the claim `claim` would make, in
        the transaction of that run's ends (one commit: `_leases.complete_and_claim`), what it
        claimed given to `taken` before the commit (`_leases.NextClaim`). Nothing is claimed
        when the run has no end here."""
        wall = wall0 + self._offset
        runs: dict[str, _Ends] = {}
        of_run = None
        new = tuple.__new__
        for claimed, result, failures, spawned in ends:
            # (Looked up per end only when the run changes: a group commit is of one run.)
            if of_run is None or of_run.run_id != claimed.run_id:
                of_run = runs.get(claimed.run_id)
                if of_run is None:
                    of_run = runs[claimed.run_id] = _Ends(claimed.run_id)
            state, output, error, error_type, kept = ending(
                result, None if spawned is None else spawned[0]
            )
            started = result.started
            # Built as the tuple it is (as `_before` builds a claim): `End(...)` is a Python call
            # with ten arguments, once per end.
            end = new(End, (claimed.id, claimed.token, state, output, result.agent, error,
                            error_type, result.attempts, bool(result.defaulted),
                            None if started is None else wall + started))  # fmt: skip
            of_run.ends.append(end)
            if failures:
                of_run.failures[claimed.id] = [_failed(wall, a) for a in failures]
            if kept:
                # A task spawned unnamed goes without the id given it here: the database names it
                # after its spawner, skipping the ids its run has (`_graph.admit_in`).
                named_here = spawned[1]  # (spawns kept: `spawned` gave them)
                of_run.spawned[claimed.id] = [
                    _unnamed(t) if t.id in named_here else t for t in kept
                ]
        noted: dict[str, list[tuple[str, int, Failed]]] = {}
        for claimed, attempt in notes:
            noted.setdefault(claimed.run_id, []).append(
                (claimed.id, claimed.token, _failed(wall, attempt))
            )
        nxt = None
        if then is not None:
            presence = self._presence

            def hand(batch: list[Claimed]) -> None:
                if presence is not None:
                    presence.claimed += len(batch)
                if taken is not None:
                    # A claim counts the attempt its lease is for (as `claim` says).
                    taken([_before(c) for c in batch])

            nxt = (then[0], NextClaim(dict(then[1]), then[2], self.lease, hand))
        written: dict[str, list[bool]]
        written, _ = await self._run(_complete, name, runs, noted, admission, self.lease, nxt)
        if len(written) == 1:  # (a group commit is of one run: its ends in their order)
            [accepted] = written.values()
        else:
            by_run = {run_id: iter(done) for run_id, done in written.items()}
            accepted = [next(by_run[end[0].run_id]) for end in ends]
        presence = self._presence
        if presence is not None:  # counted as the worker's report counts them
            completed = sum(accepted)
            presence.completed += completed
            if completed != len(accepted):
                presence.refused += sum(
                    not ok and end[1].status != CANCELLED
                    for ok, end in zip(accepted, ends, strict=True)
                )
        return accepted

    async def release(self, name: str, held: Sequence[Claim] | None) -> int:
        leases = None if held is None else [(c.run_id, c.id, c.token) for c in held]
        released: int = await self._run(_release, name, leases)
        return released


_ATTEMPTS = Claimed._fields.index("attempts")


def _before(claimed: Claimed) -> Claimed:
    """`claimed` with the attempts made before its claim (the claim counted its own). Built as
    the tuple it is: `_replace` takes twice as long (a dict of changes, a map over the fields),
    once per claimed task."""
    return tuple.__new__(
        Claimed, (*claimed[:_ATTEMPTS], claimed.attempts - 1, *claimed[_ATTEMPTS + 1 :])
    )


class _Ends:
    """A run's part of a group commit."""

    __slots__ = ("ends", "failures", "run_id", "spawned")

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.ends: list[End] = []
        self.failures: dict[str, list[Failed]] = {}
        self.spawned: dict[str, list[Task]] = {}


def _failed(wall: float, a: Attempt) -> Failed:
    return Failed(a.number, a.agent, a.error_type, a.message, wall + a.started, a.duration,
                  a.retry_in, a.traceback, a.status_code, a.api_error_type, a.request_id)  # fmt: skip


def _unnamed(task: Task) -> Task:
    task = copy.copy(task)
    task.id = None  # type: ignore[assignment]  # named by the admission
    return task


# -- jobs (each on a pooled connection, on the worker's loop) ----------------------------------


async def _counted(
    conn: asyncpg.Connection, owner: str, claimed: int, completed: int, refused: int
) -> None:
    await conn.execute(
        "UPDATE orchestra.workers SET claimed = claimed + $2, completed = completed + $3, "
        "refused = refused + $4 WHERE owner = $1",
        owner, claimed, completed, refused,
    )  # fmt: skip


async def _now(conn: asyncpg.Connection) -> float:
    now: float = await conn.fetchval("SELECT extract(epoch FROM now())::float8")
    return now


# The open runs with ready tasks of some kinds, oldest first (a worker that serves every run).
_RUNS_READY = """
SELECT r.id FROM orchestra.runs AS r
WHERE r.state = 'open' AND EXISTS (
    SELECT 1 FROM orchestra.tasks AS t
    WHERE t.run_id = r.id AND t.state = 'ready' AND t.kind = ANY ($1::text[])
)
ORDER BY r.created, r.id
"""


async def _claim(
    conn: asyncpg.Connection,
    owner: str,
    run_id: str | None,
    rooms: dict[str, int],
    room: int,
    lease: float,
) -> tuple[list[Claimed], bool]:
    """What `Backend.claim` answers: the tasks claimed; with a run, whether its row says it is
    over (when nothing was claimed)."""
    if run_id is not None:
        batch = await claim(conn, run_id, rooms, owner=owner, lease=lease, limit=room)
        return batch, not batch and await _closed(conn, run_id)
    claimed: list[Claimed] = []
    for run in [row[0] for row in await conn.fetch(_RUNS_READY, list(rooms))]:
        batch = await claim(conn, run, rooms, owner=owner, lease=lease, limit=room)
        claimed.extend(batch)
        room -= len(batch)
        for task in batch:
            rooms[task.kind] -= 1
        rooms = {kind: n for kind, n in rooms.items() if n > 0}
        if room <= 0 or not rooms:
            break
    return claimed, False


async def _closed(conn: asyncpg.Connection, run_id: str) -> bool:
    state = await conn.fetchval("SELECT state FROM orchestra.runs WHERE id = $1", run_id)
    return bool(state == "closed")


async def _heartbeat(
    conn: asyncpg.Connection, owner: str, held: list[tuple[str, str, int]], lease: float
) -> set[tuple[str, str]]:
    return await heartbeat(conn, owner, held, lease=lease)


async def _complete(
    conn: asyncpg.Connection,
    owner: str,
    runs: dict[str, _Ends],
    noted: dict[str, list[tuple[str, int, Failed]]],
    admission: Admission | None,
    lease: float,
    then: tuple[str, NextClaim] | None,
) -> tuple[dict[str, list[bool]], list[Claimed]]:
    """The failed attempts of tasks that go on, then each run's ends in a transaction of its own;
    whether each end was written, by run id in the order of its `_Ends`, and what `then` claimed
    (with its run's ends). `lease`: the keys' holds of the spawns (`_leases.complete`'s
    ``key_lease``)."""
    for run_id, failed in noted.items():
        await note(conn, run_id, owner, failed)
    written: dict[str, list[bool]] = {}
    claimed: list[Claimed] = []
    for run_id, of_run in runs.items():
        try:
            if then is not None and then[0] == run_id:
                done, claimed = await complete_and_claim(
                    conn, run_id, owner, of_run.ends, then[1], spawned=of_run.spawned,
                    admission=admission, failures=of_run.failures, key_lease=lease,
                )  # fmt: skip
            else:
                done = await complete(
                    conn, run_id, owner, of_run.ends, spawned=of_run.spawned,
                    admission=admission, failures=of_run.failures, key_lease=lease,
                )  # fmt: skip
        except InputError:
            # A spawn was refused, and nothing written: each end alone, then, so that only the
            # spawner whose spawns were refused fails for it.
            done = [
                await _complete_one(conn, run_id, owner, of_run, e, admission, lease)
                for e in of_run.ends
            ]
        written[run_id] = done
    return written, claimed


async def _complete_one(
    conn: asyncpg.Connection,
    run_id: str,
    owner: str,
    of_run: _Ends,
    end: End,
    admission: Admission | None,
    lease: float,
) -> bool:
    failures = {end.id: of_run.failures[end.id]} if end.id in of_run.failures else None
    spawned = of_run.spawned.get(end.id)
    if spawned:
        try:
            [ok] = await complete(
                conn, run_id, owner, [end], spawned={end.id: spawned}, admission=admission,
                failures=failures, key_lease=lease,
            )  # fmt: skip
        except InputError as exc:
            end = end._replace(
                state=FAILED, output=None, error_type="InputError",
                error=f"the tasks it spawned (on a worker) were refused: {exc}",
            )  # fmt: skip
        else:
            return ok
    [ok] = await complete(conn, run_id, owner, [end], failures=failures)
    return ok


# Every claim `owner` still holds unstarted, handed back as `_leases.release` hands back some (a
# stopping worker: the answer of a claim its stop cancelled may have been dropped, the claim
# committed all the same).
_RELEASE_ALL = """
UPDATE orchestra.tasks AS t
SET state = 'ready', attempts = t.attempts - 1, lease_owner = NULL, lease_expires = NULL
WHERE t.lease_owner = $1 AND t.state = 'claimed'
RETURNING t.run_id, t.id
"""


async def _release(
    conn: asyncpg.Connection, owner: str, held: list[tuple[str, str, int]] | None
) -> int:
    """Hand back claims (`held`, or every one `owner` holds), and wake the processes that serve
    their runs: they are ready at once."""
    async with conn.transaction():
        if held is None:
            released = {(row[0], row[1]) for row in await conn.fetch(_RELEASE_ALL, owner)}
        else:
            released = await release(conn, owner, held)
        for run_id in sorted({run for run, _ in released}):
            await notify(conn, run_id, "ready")
    return len(released)
