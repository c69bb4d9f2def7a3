"""The live processes of a PostgreSQL database, and the sweep that takes back what the dead left.

Every process that runs tasks (a worker, a coordinator with agents) registers in
``orchestra.workers`` (its name, host, pid, kinds and run), beats while it lives (its ``expires``
pushed on, its counters added to), and says when it stops (``gone``). Nobody watches over them:
every live process runs `sweep` now and then (a third of its lease, say), which

- takes back the task leases that expired (`_claims.take_back_expired`: the attempt counted as
  ``LeaseExpired``, a task lost too often failed, to the dead letters), and wakes the runs whose
  tasks are ready again (`_listen.notify`);
- marks gone the processes whose beat expired.

One sweep at a time: a sweep runs in a transaction that first takes a transaction-level advisory
lock with ``pg_try_advisory_xact_lock``, and a process that does not get it returns at once (another
is sweeping; there is nothing to wait for). The taking back is safe without it (rows locked ``SKIP
LOCKED``, the expiry re-checked): the lock spares the database the same scan by every process.
Times are the database's ``now()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, NamedTuple

from ._claims import MAX_LOST, TakenBack, take_back_expired
from ._listen import notify

if TYPE_CHECKING:
    from collections.abc import Sequence

    import asyncpg

__all__ = ("Swept", "beat", "deregister", "live", "register", "sweep")

# `pg_try_advisory_xact_lock` key of the sweep: any constant, the same in every orchestra.
_SWEEP_LOCK: Final = 0x6F72632D73776570  # "orc-swep"


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
