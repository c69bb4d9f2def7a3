"""The coordinator's lease on its run, on PostgreSQL: acquire, renew, hand over, and the fence
every coordinator write goes through.

A run has one coordinator at a time (the process that admits its input and builds its
`RunResult`); the row of ``orchestra.runs`` says who (``owner``), under which fencing token
(``token``, from the sequence ``lease_tokens``, greater than any before) and until when
(``expires``, the database's clock). Any other process that wants the run (a standby: another
``orch.run(..., run_id=...)``, or a coordinator started for it) waits until the lease expires,
then takes it with a fresh token.

**Fencing.** Every write of a coordinator runs in `fenced`: a transaction that first reads the
run's row ``FOR SHARE`` and goes on only while the row still carries the coordinator's token. The
row lock holds until the transaction ends, so a take-over (an ``UPDATE`` of that row) waits for
the write to commit, and a write that starts after a take-over sees the new token and is refused:
nothing of it applied, a ``refused`` event in the journal, `LeaseLost` raised. A coordinator
paused (SIGSTOP, a long GC, a network partition) inside such a transaction would keep the take-over
waiting: the fence sets the transaction's ``idle_in_transaction_session_timeout`` to a third of
the lease, so the server ends that session (and its lock) well before the lease runs out.

An expired lease nobody took yet is still its holder's: no one else can have written under it, so
its renewal and its writes are let through (only a new token fences).

`LeaseKeeper` renews a lease every third of it on a connection pool of its own, and reports its
loss (``lost``, an `anyio.Event`, and an optional callback): the lease was taken over, or the
database could not be reached for a whole lease (then it may have been).
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Final, NamedTuple

import anyio
import asyncpg

from ..._exceptions import StoreError
from ._background import Background

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from datetime import datetime
    from types import TracebackType

    from asyncpg.transaction import Transaction


__all__ = (
    "Lease",
    "LeaseKeeper",
    "LeaseLost",
    "acquire",
    "fenced",
    "hand_over",
    "holder",
    "renew",
    "take_over",
)

RENEWALS_PER_LEASE: Final = 3
"""A lease is renewed this many times per lease (and a fenced transaction may idle a third of it)."""


class LeaseLost(StoreError):
    """A coordinator's write was refused: its run was taken over by another coordinator (a newer
    token). Nothing of the write was applied; the journal has a ``refused`` event."""

    def __init__(self, message: str, *, run_id: str, owner: str, token: int) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.owner = owner
        self.token = token


class Lease(NamedTuple):
    """A coordinator's lease on its run: `token` fences its writes; `expires` on the database's
    clock; `lease` its length in seconds."""

    run_id: str
    owner: str
    token: int
    expires: datetime
    lease: float


class Holder(NamedTuple):
    """Who holds a run now (`holder`): `remaining` seconds to its expiry, negative once past;
    `owner` None when nobody does."""

    owner: str | None
    token: int
    remaining: float


_ACQUIRE = """
WITH old AS (
    SELECT owner, token FROM orchestra.runs WHERE id = $1
), taken AS (
    INSERT INTO orchestra.runs AS r (id, owner, token, expires)
    VALUES ($1, $2, nextval('orchestra.lease_tokens'), now() + make_interval(secs => $3))
    ON CONFLICT (id) DO UPDATE
    SET owner = excluded.owner, token = excluded.token, expires = excluded.expires,
        updated = now(), opened = r.opened + 1
    WHERE r.owner IS NULL OR r.expires IS NULL OR r.expires < now() OR r.owner = excluded.owner
    RETURNING r.token, r.expires
), journal AS (
    INSERT INTO orchestra.events (run_id, event, agent, detail)
    SELECT $1, 'coordinator', $2, 'took the run (token ' || taken.token || ')'
        || coalesce(' over from ' || old.owner || ' (token ' || old.token || ')', '')
    FROM taken LEFT JOIN old ON old.owner IS NOT NULL AND old.owner <> $2
)
SELECT token, expires FROM taken
"""


async def acquire(
    conn: asyncpg.Connection, run_id: str, *, owner: str, lease: float
) -> Lease | None:
    """Take `run_id` for `owner` for `lease` seconds (the database's clock) with a fresh token:
    a run nobody holds (a new one is made), whose lease expired, or that `owner` itself holds.
    None while another coordinator's lease runs. The take-over is in the journal."""
    row = await conn.fetchrow(_ACQUIRE, run_id, owner, float(lease))
    if row is None:
        return None
    return Lease(run_id, owner, row["token"], row["expires"], float(lease))


async def holder(conn: asyncpg.Connection, run_id: str) -> Holder | None:
    """Who holds `run_id` now; None when there is no such run."""
    row = await conn.fetchrow(
        "SELECT owner, token, extract(epoch FROM expires - now())::float8 AS remaining "
        "FROM orchestra.runs WHERE id = $1",
        run_id,
    )
    if row is None:
        return None
    remaining = row["remaining"]
    return Holder(row["owner"], row["token"], -math.inf if remaining is None else remaining)


async def take_over(
    conn: asyncpg.Connection, run_id: str, *, owner: str, lease: float, poll: float = 1.0
) -> Lease:
    """Wait until `run_id` can be taken, and take it (a standby): looks again when the holder's
    lease is due to expire, and at least every `poll` seconds (a holder that hands over early)."""
    while True:
        taken = await acquire(conn, run_id, owner=owner, lease=lease)
        if taken is not None:
            return taken
        held = await holder(conn, run_id)
        wait = poll if held is None else min(poll, max(held.remaining, 0.0))
        # A little past the expiry: the database's `now()` must have passed it when we ask.
        await anyio.sleep(wait + 0.005)


_RENEW = """
UPDATE orchestra.runs SET expires = now() + make_interval(secs => $4), updated = now()
WHERE id = $1 AND owner = $2 AND token = $3
RETURNING expires
"""


async def renew(conn: asyncpg.Connection, lease: Lease) -> Lease | None:
    """Extend `lease` to its length from now (the database's clock). None when it was lost: the
    run was taken over (or handed over) since."""
    expires = await conn.fetchval(_RENEW, lease.run_id, lease.owner, lease.token, lease.lease)
    return None if expires is None else lease._replace(expires=expires)


async def hand_over(conn: asyncpg.Connection, lease: Lease) -> bool:
    """Give the run up at once (a coordinator stopping): a standby takes it without waiting for
    the expiry. False when the lease was already lost."""
    done = await conn.fetchval(
        "UPDATE orchestra.runs SET owner = NULL, expires = NULL, updated = now() "
        "WHERE id = $1 AND owner = $2 AND token = $3 RETURNING true",
        lease.run_id, lease.owner, lease.token,
    )  # fmt: skip
    return bool(done)


# The fence: the run's row locked FOR SHARE (a take-over waits for this transaction), and the
# session's idle limit inside this transaction, so that a paused holder cannot keep the lock.
_FENCE = """
SELECT set_config('idle_in_transaction_session_timeout', $4, true), token
FROM orchestra.runs WHERE id = $1 AND owner = $2 AND token = $3
FOR SHARE
"""

_REFUSED = """
INSERT INTO orchestra.events (run_id, event, agent, detail)
VALUES ($1, 'refused', $2, 'coordinator write from ' || $2 || ' refused: its lease on the run '
    || '(token ' || $3::bigint || ') is no longer held')
"""


@contextlib.asynccontextmanager
async def fenced(conn: asyncpg.Connection, lease: Lease) -> AsyncIterator[asyncpg.Connection]:
    """A transaction on `conn` that commits only while `lease` still holds the run: what the
    block writes through `conn` is applied at its end, or, when the run was taken over, nothing
    is, the refusal is journaled and `LeaseLost` raised (before the block runs). The outermost
    transaction of `conn`: inside another, the refusal's journal entry would share its fate."""
    idle = f"{max(1, int(lease.lease * 1000 / RENEWALS_PER_LEASE))}ms"
    transaction = conn.transaction()
    await transaction.start()
    try:
        held = await conn.fetchrow(_FENCE, lease.run_id, lease.owner, lease.token, idle)
    except BaseException:
        await _roll_back(conn, transaction)
        raise
    if held is None:
        await transaction.rollback()
        await conn.execute(_REFUSED, lease.run_id, lease.owner, lease.token)
        raise LeaseLost(
            f"run {lease.run_id!r}: the coordinator {lease.owner!r} no longer holds it (its "
            f"token {lease.token} was superseded): its write was refused",
            run_id=lease.run_id,
            owner=lease.owner,
            token=lease.token,
        )
    try:
        yield conn
    except BaseException:
        # Shielded: a cancelled block must still end its transaction, or the connection stays
        # inside it (and holds the run's row) until the server's idle limit ends the session.
        with anyio.CancelScope(shield=True):
            await _roll_back(conn, transaction)
        raise
    await transaction.commit()


async def _roll_back(conn: asyncpg.Connection, transaction: Transaction) -> None:
    """Roll back the transaction of a block that failed. On a connection that is gone (the server
    ended the session: its idle limit passed while this process was stopped), the rollback's own
    error is dropped and the connection closed: the server rolled back as it ended the session,
    and the caller must hear why the block failed (the connection lost, which it retries), not
    that a rollback could not be sent on it (asyncpg's "the underlying connection is closed")."""
    try:
        await transaction.rollback()
    except (
        OSError,
        asyncpg.PostgresConnectionError,
        asyncpg.InterfaceError,
        asyncpg.InternalClientError,
    ):
        conn.terminate()


class LeaseKeeper:
    """Renews a coordinator's lease every third of it, on `pool`, until closed; `lost` is set
    (and `on_lost` called, once) when the lease is taken over, or when no renewal got through for
    a whole lease (a database out of reach). The current lease (its newest expiry) is `lease`.

    ``async with LeaseKeeper(pool, lease) as keeper:`` renews in the block and, on leaving it,
    stops renewing (`hand_over` is the caller's choice).
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        lease: Lease,
        *,
        on_lost: Callable[[Lease], object] | None = None,
    ) -> None:
        self.lease = lease
        self.lost = anyio.Event()
        self._pool = pool
        self._on_lost = on_lost
        self._background = Background()

    async def __aenter__(self) -> LeaseKeeper:
        await self._background.start(self._renew_while_held)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return await self._background.stop(exc_type, exc, tb)

    async def _renew_while_held(self) -> None:
        every = self.lease.lease / RENEWALS_PER_LEASE
        # Measured from the start of the last renewal that got through: the lease runs from
        # (about) then on the database's clock.
        renewed = time.monotonic()
        while True:
            await anyio.sleep(every)
            started = time.monotonic()
            try:
                with anyio.fail_after(every):
                    lease = await self._renewed()
            except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
                if time.monotonic() - renewed >= self.lease.lease:
                    self._report_lost()
                    return
                continue
            if lease is None:
                self._report_lost()
                return
            self.lease = lease
            renewed = started

    async def _renewed(self) -> Lease | None:
        held = self.lease
        expires = await self._pool.fetchval(_RENEW, held.run_id, held.owner, held.token, held.lease)
        return None if expires is None else held._replace(expires=expires)

    def _report_lost(self) -> None:
        self.lost.set()
        if self._on_lost is not None:
            self._on_lost(self.lease)
