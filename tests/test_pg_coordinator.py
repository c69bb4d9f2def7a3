"""The coordinator's lease on its run (`orchestra.stores._postgres._coordinator`), on the session's
real server: acquired when free or expired (the database's clock), renewed, handed over; every
coordinator write fenced by the run's token; a standby taking over from a killed holder within the
lease, and a paused-then-woken holder's write refused, with real processes and real signals.

A lease is made to run out in the in-process tests by moving its expiry into the past on the
server, not by waiting; the process tests wait for real leases of about a second."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import anyio
import asyncpg
import pytest

from orchestra import StoreError
from orchestra.stores._postgres._coordinator import (
    Lease,
    LeaseKeeper,
    LeaseLost,
    acquire,
    fenced,
    hand_over,
    holder,
    renew,
    take_over,
)
from tests.helpers import REPO, spawn

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = [pytest.mark.subprocess, pytest.mark.postgres]


@pytest.fixture
def conn(pg_conn: asyncpg.Connection) -> asyncpg.Connection:
    return pg_conn


@pytest.fixture
async def other(pg_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A second connection to the same database (another process's)."""
    conn = await asyncpg.connect(pg_dsn)
    try:
        yield conn
    finally:
        await conn.close()


async def expire(conn: asyncpg.Connection, run_id: str) -> None:
    """The run's lease runs out (its expiry a second ago, on the server's clock)."""
    await conn.execute(
        "UPDATE orchestra.runs SET expires = now() - interval '1 second' WHERE id = $1", run_id
    )


async def journal(conn: asyncpg.Connection, run_id: str) -> list[tuple[str, str, str]]:
    rows = await conn.fetch(
        "SELECT event, agent, detail FROM orchestra.events WHERE run_id = $1 ORDER BY seq", run_id
    )
    return [(row["event"], row["agent"], row["detail"]) for row in rows]


async def write_tick(
    conn: asyncpg.Connection,
    lease: Lease,
    *,
    pause: float = 0.0,
    stop: float = 0.0,
    then: BaseException | None = None,
) -> None:
    """A coordinator's write (a ``tick`` event) in a fenced transaction: after `pause` seconds
    in it (or `stop` seconds of the whole process, its loop blocked: as if stopped), and raising
    `then` after the write when given."""
    async with fenced(conn, lease):
        await anyio.sleep(pause)
        time.sleep(stop)
        await conn.execute(
            "INSERT INTO orchestra.events (run_id, event, agent) VALUES ($1, 'tick', $2)",
            lease.run_id, lease.owner,
        )  # fmt: skip
        if then is not None:
            raise then


async def ticks(conn: asyncpg.Connection, run_id: str, owner: str) -> int:
    count: int = await conn.fetchval(
        "SELECT count(*) FROM orchestra.events WHERE run_id = $1 AND event = 'tick' "
        "AND agent = $2",
        run_id, owner,
    )  # fmt: skip
    return count


class TestAcquire:
    async def test_a_new_run_is_made_and_held_with_a_fresh_token(
        self, conn: asyncpg.Connection
    ) -> None:
        lease = await acquire(conn, "r", owner="c1", lease=30)
        assert lease is not None
        assert lease.token > 0
        held = await holder(conn, "r")
        assert held is not None
        assert (held.owner, held.token) == ("c1", lease.token)
        assert 29 < held.remaining <= 30

    async def test_a_run_held_by_another_is_refused_until_its_lease_expires(
        self, conn: asyncpg.Connection
    ) -> None:
        first = await acquire(conn, "r", owner="c1", lease=30)
        assert first is not None
        assert await acquire(conn, "r", owner="c2", lease=30) is None
        await expire(conn, "r")
        second = await acquire(conn, "r", owner="c2", lease=30)
        assert second is not None
        assert second.token > first.token
        assert (await journal(conn, "r"))[-1] == (
            "coordinator", "c2",
            f"took the run (token {second.token}) over from c1 (token {first.token})",
        )  # fmt: skip

    async def test_its_own_holder_takes_it_again_with_a_new_token(
        self, conn: asyncpg.Connection
    ) -> None:
        first = await acquire(conn, "r", owner="c1", lease=30)
        again = await acquire(conn, "r", owner="c1", lease=30)
        assert first is not None
        assert again is not None
        assert again.token > first.token

    async def test_an_existing_run_nobody_holds_is_taken_and_counted_as_opened_again(
        self, conn: asyncpg.Connection
    ) -> None:
        await conn.execute("INSERT INTO orchestra.runs (id) VALUES ('r')")
        assert await acquire(conn, "r", owner="c1", lease=30) is not None
        assert await conn.fetchval("SELECT opened FROM orchestra.runs WHERE id = 'r'") == 2

    async def test_a_hand_over_frees_the_run_at_once(self, conn: asyncpg.Connection) -> None:
        first = await acquire(conn, "r", owner="c1", lease=30)
        assert first is not None
        assert await hand_over(conn, first)
        assert await acquire(conn, "r", owner="c2", lease=30) is not None
        assert not await hand_over(conn, first)  # no longer its to give

    async def test_a_standby_waits_for_the_expiry_on_the_database_clock(
        self, conn: asyncpg.Connection, other: asyncpg.Connection
    ) -> None:
        first = await acquire(conn, "r", owner="c1", lease=0.5)
        assert first is not None
        standby = await take_over(other, "r", owner="c2", lease=30, poll=5)
        held = await holder(conn, "r")
        assert held is not None
        assert held.owner == "c2"
        # Taken once the database's clock passed the first lease's expiry, not before.
        assert await conn.fetchval("SELECT now() >= $1::timestamptz", first.expires)
        assert standby.token > first.token


class TestRenew:
    async def test_extends_the_lease_it_still_holds(self, conn: asyncpg.Connection) -> None:
        lease = await acquire(conn, "r", owner="c1", lease=5)
        assert lease is not None
        await expire(conn, "r")  # expired, but nobody took it: still its own
        renewed = await renew(conn, lease)
        assert renewed is not None
        assert renewed.expires > await conn.fetchval("SELECT now()")
        held = await holder(conn, "r")
        assert held is not None
        assert held.remaining > 4

    async def test_refused_once_the_run_was_taken_over(self, conn: asyncpg.Connection) -> None:
        lease = await acquire(conn, "r", owner="c1", lease=5)
        assert lease is not None
        await expire(conn, "r")
        assert await acquire(conn, "r", owner="c2", lease=5) is not None
        assert await renew(conn, lease) is None


class TestFencedWrites:
    async def test_a_holders_write_is_applied(self, conn: asyncpg.Connection) -> None:
        lease = await acquire(conn, "r", owner="c1", lease=30)
        assert lease is not None
        await write_tick(conn, lease)
        assert await ticks(conn, "r", "c1") == 1

    async def test_an_old_holders_write_is_refused_journaled_and_not_applied(
        self, conn: asyncpg.Connection, other: asyncpg.Connection
    ) -> None:
        old = await acquire(conn, "r", owner="c1", lease=30)
        assert old is not None
        await expire(other, "r")
        new = await acquire(other, "r", owner="c2", lease=30)
        assert new is not None
        with pytest.raises(LeaseLost) as refused:
            await write_tick(conn, old)
        assert isinstance(refused.value, StoreError)
        assert (refused.value.run_id, refused.value.owner, refused.value.token) == (
            "r", "c1", old.token,
        )  # fmt: skip
        assert "'r'" in str(refused.value)
        assert "'c1'" in str(refused.value)
        assert await ticks(conn, "r", "c1") == 0
        assert (await journal(conn, "r"))[-1] == (
            "refused", "c1",
            f"coordinator write from c1 refused: its lease on the run (token {old.token}) is no "
            "longer held",
        )  # fmt: skip
        assert not conn.is_in_transaction()

    async def test_a_block_that_raises_applies_nothing(self, conn: asyncpg.Connection) -> None:
        lease = await acquire(conn, "r", owner="c1", lease=30)
        assert lease is not None
        with pytest.raises(KeyError):
            await write_tick(conn, lease, then=KeyError("boom"))
        assert await ticks(conn, "r", "c1") == 0

    async def test_a_take_over_waits_for_the_write_in_progress_to_commit(
        self, conn: asyncpg.Connection, other: asyncpg.Connection
    ) -> None:
        old = await acquire(conn, "r", owner="c1", lease=30)
        assert old is not None
        await expire(other, "r")
        async with fenced(conn, old):
            taking = asyncio.ensure_future(acquire(other, "r", owner="c2", lease=30))
            await asyncio.sleep(0.2)
            assert not taking.done()  # blocked on the run's row
            await conn.execute(
                "INSERT INTO orchestra.events (run_id, event, agent) VALUES ('r', 'tick', 'c1')"
            )
        new = await taking
        assert new is not None
        assert await ticks(conn, "r", "c1") == 1
        with pytest.raises(LeaseLost):
            await write_tick(conn, old)

    async def test_a_holder_idle_inside_its_write_past_a_third_of_the_lease_loses_the_session(
        self, conn: asyncpg.Connection, other: asyncpg.Connection
    ) -> None:
        lease = await acquire(conn, "r", owner="c1", lease=0.3)
        assert lease is not None
        with pytest.raises((asyncpg.PostgresError, asyncpg.InterfaceError)):
            # Paused inside the transaction, holding the row, before it writes.
            await write_tick(conn, lease, pause=0.5)
        # The row was let go when the server ended that session: a standby is not held up.
        with anyio.fail_after(5):
            assert await take_over(other, "r", owner="c2", lease=30, poll=0.05) is not None
        assert await ticks(other, "r", "c1") == 0


class TestFencedWritesOfAProcessStoppedPastTheIdleLimit:
    """The whole process stopped inside a fenced write (SIGSTOP, a frozen VM: its loop does not
    run, as under `time.sleep`) past the idle limit (a third of the lease): the server ends the
    session, and what the process does next fails as a lost connection."""

    async def test_its_next_statement_fails_with_the_lost_connection_not_the_rollbacks_error(
        self, conn: asyncpg.Connection
    ) -> None:
        lease = await acquire(conn, "r", owner="c1", lease=0.3)
        assert lease is not None
        with pytest.raises(asyncpg.ConnectionDoesNotExistError, match="idle-in-transaction"):
            await write_tick(conn, lease, stop=0.6)
        assert conn.is_closed()

    async def test_a_commit_after_the_servers_goodbye_is_retried_by_the_store_on_a_new_session(
        self, pg_dsn: str, other: asyncpg.Connection
    ) -> None:
        from orchestra.stores._postgres._database import Database

        failed: list[BaseException] = []

        async def write(c: asyncpg.Connection) -> None:
            lease = await take_over(c, "r", owner="c1", lease=0.3, poll=0.05)
            try:
                async with fenced(c, lease):
                    await c.execute(
                        "INSERT INTO orchestra.events (run_id, event, agent) "
                        "VALUES ('r', 'tick', 'c1')"
                    )
                    if not failed:
                        time.sleep(0.6)  # stopped, the write done, the commit not sent
                        # Woken: the loop reads the server's goodbye (asyncpg's protocol then
                        # waits for the rest of an error) before it sees the socket closed, and
                        # the commit meets that state: "cannot switch to state 15; another
                        # operation (2) is in progress", asyncpg's InternalClientError.
                        await asyncio.sleep(0)
                        await asyncio.sleep(0)
            except BaseException as exc:
                failed.append(exc)
                raise

        database = Database(pg_dsn)
        try:
            await database.run(write)
        finally:
            await anyio.to_thread.run_sync(database.close)
        assert len(failed) == 1
        assert isinstance(
            failed[0],
            asyncpg.InternalClientError | asyncpg.PostgresConnectionError | asyncpg.InterfaceError,
        ), repr(failed[0])
        assert await ticks(other, "r", "c1") == 1  # written once, on the second session


class TestLeaseKeeper:
    async def test_renews_while_open_so_no_standby_gets_the_run(
        self, conn: asyncpg.Connection, pg_dsn: str
    ) -> None:
        lease = await acquire(conn, "r", owner="c1", lease=0.6)
        assert lease is not None
        async with (
            asyncpg.create_pool(pg_dsn, min_size=1, max_size=1) as pool,
            LeaseKeeper(pool, lease) as keeper,
        ):
            await anyio.sleep(1.5)  # two and a half leases
            assert await acquire(conn, "r", owner="c2", lease=30) is None
            assert not keeper.lost.is_set()
            assert keeper.lease.expires > lease.expires

    async def test_reports_a_take_over_once(self, conn: asyncpg.Connection, pg_dsn: str) -> None:
        lease = await acquire(conn, "r", owner="c1", lease=0.6)
        assert lease is not None
        reported: list[Lease] = []
        async with (
            asyncpg.create_pool(pg_dsn, min_size=1, max_size=1) as pool,
            LeaseKeeper(pool, lease, on_lost=reported.append) as keeper,
        ):
            await expire(conn, "r")
            assert await acquire(conn, "r", owner="c2", lease=30) is not None
            with anyio.fail_after(5):
                await keeper.lost.wait()
            await anyio.sleep(0.5)
        assert [lost.token for lost in reported] == [lease.token]


def start_holder(dsn: str, run_id: str, owner: str, lease: float) -> subprocess.Popen[str]:
    return spawn(
        [sys.executable, str(REPO / "tests" / "pg_coord_job.py"), dsn, run_id, owner, str(lease)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


async def next_line(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    with anyio.fail_after(30):
        line: str = await anyio.to_thread.run_sync(process.stdout.readline, abandon_on_cancel=True)
    return line.strip()


async def until_line(process: subprocess.Popen[str], wanted: str) -> list[str]:
    """The lines `process` prints up to `wanted` (included)."""
    seen: list[str] = []
    while not seen or seen[-1] != wanted:
        line = await next_line(process)
        assert line, f"the process ended before printing {wanted!r}: {seen}"
        seen.append(line)
    return seen


class TestAHolderProcess:
    async def test_killed_its_run_is_taken_by_a_standby_within_the_lease(
        self, conn: asyncpg.Connection, pg_dsn: str
    ) -> None:
        lease = 1.0
        child = start_holder(pg_dsn, "r", "c1", lease)
        held = await next_line(child)
        assert held.startswith("held ")
        while await ticks(conn, "r", "c1") == 0:
            await anyio.sleep(0.02)
        child.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        standby = await take_over(conn, "r", owner="c2", lease=30, poll=0.05)
        took = time.monotonic() - killed
        assert standby.token > int(held.split()[1])
        assert took <= lease + 1.0, f"took {took:.2f} s over a {lease} s lease"
        child.wait()

    async def test_paused_past_its_lease_its_next_write_is_refused(
        self, conn: asyncpg.Connection, pg_dsn: str
    ) -> None:
        child = start_holder(pg_dsn, "r", "c1", 2.0)  # slack for a loaded machine
        held = await next_line(child)
        assert held.startswith("held ")
        while await ticks(conn, "r", "c1") < 3:
            await anyio.sleep(0.02)
        child.send_signal(signal.SIGSTOP)
        try:
            standby = await take_over(conn, "r", owner="c2", lease=30, poll=0.05)
            taken_at = await conn.fetchval(
                "SELECT max(seq) FROM orchestra.events WHERE run_id = 'r' AND event = "
                "'coordinator' AND agent = 'c2'"
            )
        finally:
            child.send_signal(signal.SIGCONT)
        lines = await until_line(child, "refused")
        assert child.wait(timeout=30) == 3
        assert set(lines) <= {"refused", "lost", "dropped"}
        late = await conn.fetchval(
            "SELECT count(*) FROM orchestra.events WHERE run_id = 'r' AND event = 'tick' "
            "AND agent = 'c1' AND seq > $1",
            taken_at,
        )
        assert late == 0
        refused = await conn.fetchval(
            "SELECT count(*) FROM orchestra.events WHERE run_id = 'r' AND event = 'refused' "
            "AND agent = 'c1' AND seq > $1",
            taken_at,
        )
        assert refused == 1
        held_now = await holder(conn, "r")
        assert held_now is not None
        assert (held_now.owner, held_now.token) == ("c2", standby.token)
