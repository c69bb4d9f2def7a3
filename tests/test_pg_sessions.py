"""The sessions of a stalled process cut off (`_postgres/_sessions.py`): a process found with its
lease lapsed has its sessions that wait for it inside a transaction ended, as
`idle_in_transaction_session_timeout` would; no other session is touched."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from orchestra.stores._postgres._sessions import cut_off

pytestmark = [pytest.mark.subprocess, pytest.mark.postgres]


@pytest.fixture
async def table(pg_conn: asyncpg.Connection) -> asyncpg.Connection:
    await pg_conn.execute("CREATE TABLE public.rows (id int PRIMARY KEY)")
    await pg_conn.execute("INSERT INTO public.rows VALUES (1), (2)")
    return pg_conn


async def session(dsn: str, process: str) -> asyncpg.Connection:
    return await asyncpg.connect(dsn, server_settings={"application_name": f"orchestra {process}"})


class TestCutOff:
    async def test_a_lapsed_processs_session_stalled_in_a_transaction_is_ended(
        self, pg_dsn: str, table: asyncpg.Connection
    ) -> None:
        stalled = await session(pg_dsn, "host:1")
        other = await session(pg_dsn, "host:2")
        try:
            await stalled.execute("BEGIN; UPDATE public.rows SET id = id WHERE id = 1")
            await other.execute("BEGIN; UPDATE public.rows SET id = id WHERE id = 2")
            await asyncio.sleep(0.3)
            assert await cut_off(table, ["host:1:worker-a"], 0.1) == 1
            # Its lock is let go: the row is taken at once.
            await table.execute("SET lock_timeout = '5s'")
            await table.execute("UPDATE public.rows SET id = id WHERE id = 1")
            # (asyncpg says so in one of these ways, by when it read the server's goodbye)
            cut = (
                asyncpg.InterfaceError,
                asyncpg.PostgresConnectionError,
                asyncpg.InternalClientError,
                OSError,
            )
            with pytest.raises(cut):
                await stalled.execute("COMMIT")
            # The other process's session, whose lease was not said to lapse, is left alone.
            await other.execute("COMMIT")
        finally:
            for conn in (stalled, other):
                conn.terminate()

    async def test_a_session_stalled_for_less_than_the_bound_is_left_alone(
        self, pg_dsn: str, table: asyncpg.Connection
    ) -> None:
        busy = await session(pg_dsn, "host:1")
        try:
            await busy.execute("BEGIN; UPDATE public.rows SET id = id WHERE id = 1")
            assert await cut_off(table, ["host:1:x"], 60) == 0
            await busy.execute("COMMIT")
        finally:
            busy.terminate()

    async def test_a_session_waiting_for_a_lock_or_outside_a_transaction_is_left_alone(
        self, pg_dsn: str, table: asyncpg.Connection
    ) -> None:
        holder = await asyncpg.connect(pg_dsn)
        waiter = await session(pg_dsn, "host:1")
        idle = await session(pg_dsn, "host:1")
        try:
            await holder.execute("BEGIN; UPDATE public.rows SET id = id WHERE id = 1")
            waiting = asyncio.ensure_future(
                waiter.execute("UPDATE public.rows SET id = id WHERE id = 1")
            )
            await asyncio.sleep(0.3)
            assert await cut_off(table, ["host:1:x"], 0.1) == 0
            await holder.execute("COMMIT")
            await waiting
            assert await idle.fetchval("SELECT 1") == 1
        finally:
            for conn in (holder, waiter, idle):
                conn.terminate()
