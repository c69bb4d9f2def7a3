"""The live processes of a PostgreSQL database, and the sweep that takes back what the dead left.

Every process that runs tasks (a worker, a coordinator with agents) registers in
``orchestra.workers`` (its name, host, pid, kinds and run), beats while it lives (its ``expires``
pushed on, its counters added to), and says when it stops (``gone``). Nobody watches over them:
every live process runs `sweep` now and then (a third of its lease, say), which

- takes back the task leases that expired (`_leases.take_back_expired`: the attempt counted as
  ``LeaseExpired``, a task lost too often failed, to the dead letters), and wakes the runs whose
  tasks are ready again (`_listen.notify`);
- marks gone the processes whose beat expired.

One sweep at a time: a sweep runs in a transaction that first takes a transaction-level advisory
lock with ``pg_try_advisory_xact_lock``, and a process that does not get it returns at once (another
is sweeping; there is nothing to wait for). The taking back is safe without it (rows locked ``SKIP
LOCKED``, the expiry re-checked): the lock spares the database the same scan by every process.
Times are the database's ``now()``.

`Presence` does all of it for one process: registers it, beats and sweeps every third of its lease
on a pool, and says it stopped when closed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, NamedTuple

import anyio
import asyncpg

from ._background import Background
from ._leases import MAX_LOST, SERVER_SETTINGS, TakenBack, take_back_expired
from ._listen import notify
from ._sessions import application_name

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from types import TracebackType


__all__ = ("Presence", "Swept", "beat", "deregister", "live", "register", "sweep")


async def _connect(dsn: str) -> asyncpg.Connection:
    """A connection of this process's own, named as its pool's are (`_sessions`): its sweep
    writes the journal (leases taken back), and the journal's readers wait only for the
    transactions of sessions so named."""
    settings = {**SERVER_SETTINGS, "application_name": application_name()}
    return await asyncpg.connect(dsn, server_settings=settings)


# `pg_try_advisory_xact_lock` key of the sweep: any constant, the same in every orchestra.
_SWEEP_LOCK: Final = 0x6F72632D73776570  # "orc-swep"
_GOODBYE: Final = 5.0
"""Seconds a process on its way out waits for its goodbye at least, however short its lease: told
gone, it is gone at once for every reader, not once a sweep finds its beat expired."""


class Swept(NamedTuple):
    """What one sweep did: the leases it took back, and the processes it marked gone."""

    taken_back: list[TakenBack]
    gone: list[str]


async def register(
    conn: asyncpg.Connection,
    owner: str,
    *,
    host: str,
    pid: int,
    lease: float,
    kinds: Sequence[str] | None = None,
    run_id: str | None = None,
) -> None:
    """Say that the process `owner` lives (on `host`, as `pid`), serving `kinds` (None: every
    kind) of `run_id` (None: any run), for `lease` seconds unless it beats. A name registered
    before (a process started again under it) starts over: live, its counters at zero."""
    await conn.execute(
        """INSERT INTO orchestra.workers (owner, host, pid, run_id, kinds, expires)
        VALUES ($1, $2, $3, $4, $5, now() + make_interval(secs => $6))
        ON CONFLICT (owner) DO UPDATE
        SET host = excluded.host, pid = excluded.pid, run_id = excluded.run_id,
            kinds = excluded.kinds, started = now(), heartbeat = now(),
            expires = excluded.expires, claimed = 0, completed = 0, refused = 0, gone = NULL""",
        owner, host, pid, run_id, None if kinds is None else list(kinds), float(lease),
    )  # fmt: skip


async def beat(
    conn: asyncpg.Connection,
    owner: str,
    *,
    lease: float,
    claimed: int = 0,
    completed: int = 0,
    refused: int = 0,
) -> bool:
    """`owner` lives for `lease` more seconds; its counters grow by these. False when it was
    marked gone meanwhile (its beat had expired): its leases may have been taken back, so it
    should `register` again and trust none it holds until their heartbeat says so."""
    alive = await conn.fetchval(
        """UPDATE orchestra.workers
        SET heartbeat = now(), expires = now() + make_interval(secs => $2),
            claimed = claimed + $3, completed = completed + $4, refused = refused + $5
        WHERE owner = $1 AND gone IS NULL
        RETURNING true""",
        owner, float(lease), claimed, completed, refused,
    )  # fmt: skip
    return bool(alive)


async def deregister(conn: asyncpg.Connection, owner: str) -> None:
    """`owner` stops: marked gone now (its row stays, for the record of what it did)."""
    await conn.execute(
        "UPDATE orchestra.workers SET gone = now() WHERE owner = $1 AND gone IS NULL", owner
    )


async def live(conn: asyncpg.Connection, run_id: str | None = None) -> list[str]:
    """The processes alive now (not gone, their beat not expired), serving `run_id` (or any run)
    when one is given; by name."""
    rows = await conn.fetch(
        """SELECT owner FROM orchestra.workers
        WHERE gone IS NULL AND expires >= now()
            AND ($1::text IS NULL OR run_id IS NULL OR run_id = $1)
        ORDER BY owner""",
        run_id,
    )
    return [row[0] for row in rows]


async def sweep(
    conn: asyncpg.Connection, *, max_lost: int = MAX_LOST, limit: int = 1000
) -> Swept | None:
    """Take back expired task leases (at most `limit`) and mark gone the processes that stopped
    beating, in one transaction; None when another process is sweeping now."""
    async with conn.transaction():
        if not await conn.fetchval("SELECT pg_try_advisory_xact_lock($1)", _SWEEP_LOCK):
            return None
        taken = await take_back_expired(conn, max_lost=max_lost, limit=limit)
        for run_id in sorted({task.run_id for task in taken if not task.failed}):
            await notify(conn, run_id, "ready")
        gone = await conn.fetch(
            """UPDATE orchestra.workers SET gone = now()
            WHERE gone IS NULL AND expires < now()
            RETURNING owner"""
        )
    return Swept(taken, sorted(row[0] for row in gone))


class Presence:
    """A process's life in ``orchestra.workers`` while open, on a connection of its own to `dsn`:
    registered on entry, a beat and a sweep every third of `lease` (the counters added since the
    last beat go with it), gone on exit. `on_swept` hears each sweep that did something;
    `given_up` is set when a beat was refused (the process had been marked gone: its leases may
    have been taken back), and the process is registered again at once. A database out of reach
    is tried again at the next beat, on a new connection.

    ``async with Presence(dsn, owner, host=..., pid=..., lease=...) as presence:``
    """

    def __init__(
        self,
        dsn: str,
        owner: str,
        *,
        host: str,
        pid: int,
        lease: float,
        kinds: Sequence[str] | None = None,
        run_id: str | None = None,
        on_swept: Callable[[Swept], object] | None = None,
    ) -> None:
        self.owner = owner
        self.given_up = anyio.Event()
        self.claimed = self.completed = self.refused = 0
        self._dsn = dsn
        self._host = host
        self._pid = pid
        self._lease = lease
        self._kinds = kinds
        self._run_id = run_id
        self._on_swept = on_swept
        self._conn: asyncpg.Connection | None = None
        self._background = Background()

    async def __aenter__(self) -> Presence:
        self._conn = await _connect(self._dsn)
        await self._register(self._conn)
        await self._background.start(self._beat_and_sweep)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        try:
            return await self._background.stop(exc_type, exc, tb)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(max(self._lease, _GOODBYE)):
                await self._stop()

    async def _stop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            await deregister(conn, self.owner)
        except _LOST:
            pass  # its beat will expire: the next sweep marks it gone
        finally:
            conn.terminate()

    async def _register(self, conn: asyncpg.Connection) -> None:
        await register(
            conn, self.owner, host=self._host, pid=self._pid, lease=self._lease,
            kinds=self._kinds, run_id=self._run_id,
        )  # fmt: skip

    async def _beat_and_sweep(self) -> None:
        while True:
            await anyio.sleep(self._lease / 3)
            try:
                swept = await self._beat_and_sweep_once()
            except _LOST:
                if self._conn is not None:
                    self._conn.terminate()
                    self._conn = None
                continue
            if swept and (swept.taken_back or swept.gone) and self._on_swept is not None:
                self._on_swept(swept)

    async def _beat_and_sweep_once(self) -> Swept | None:
        if self._conn is None or self._conn.is_closed():
            self._conn = await _connect(self._dsn)
        conn = self._conn
        claimed, completed, refused = self.claimed, self.completed, self.refused
        alive = await beat(
            conn, self.owner, lease=self._lease, claimed=claimed, completed=completed,
            refused=refused,
        )  # fmt: skip
        if alive:
            self.claimed -= claimed
            self.completed -= completed
            self.refused -= refused
        else:
            await self._register(conn)
            self.given_up.set()
        return await sweep(conn)


# What a lost or unreachable database raises.
_LOST = (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError)
