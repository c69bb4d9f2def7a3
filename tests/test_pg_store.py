"""`PostgresStore`: its settings, its connections in a thread of their own, and the errors of a
database it cannot use, on the session's real server."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading

import asyncpg
import pytest

from orchestra import ConfigError, StoreError
from orchestra.stores._postgres._store import PostgresStore

pytestmark = [pytest.mark.subprocess, pytest.mark.postgres]


async def _version(conn: object) -> int:
    return await conn.fetchval("SELECT version FROM orchestra.schema_version")  # type: ignore[attr-defined,no-any-return]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"dsn": "sqlite:///x.db"}, "needs a DSN"),
        ({"dsn": 5}, "needs a DSN"),
        ({"dsn": "postgresql://h/db", "lease": 0}, "lease must be a positive"),
        ({"dsn": "postgresql://h/db", "poll": "1"}, "poll must be a number"),
        ({"dsn": "postgresql://h/db", "max_connections": 1}, "at least 2"),
    ],
)
def test_bad_settings_are_refused_before_any_connection(
    kwargs: dict[str, object], says: str
) -> None:
    with pytest.raises(ConfigError, match=says):
        PostgresStore(**kwargs)  # type: ignore[arg-type]


def test_the_password_is_never_shown() -> None:
    store = PostgresStore("postgresql://app:s3cret@db.example:6543/runs")
    try:
        assert "s3cret" not in repr(store)
        assert "db.example:6543/runs" in repr(store)
    finally:
        store.close()
    with pytest.raises(ConfigError) as caught:
        PostgresStore("postgres:/app:s3cret@db")  # not a URL a driver reads
    assert "s3cret" not in str(caught.value)


async def test_jobs_run_in_the_stores_thread_on_a_migrated_database(pg_empty_dsn: str) -> None:
    store = PostgresStore(pg_empty_dsn)
    try:
        assert store.database.call(_version) >= 2  # from a thread that is not the store's
        assert await store.database.run(_version) >= 2  # awaited from this loop
        answers = await asyncio.gather(*(store.database.run(_version) for _ in range(20)))
        assert len(set(answers)) == 1
    finally:
        store.close()
    with pytest.raises(StoreError, match="was closed"):
        await store.database.run(_version)


class TestALocalPool:
    async def test_its_jobs_run_on_the_callers_loop_not_in_the_stores_thread(
        self, pg_dsn: str
    ) -> None:
        store = PostgresStore(pg_dsn)
        seen: list[tuple[int, asyncio.AbstractEventLoop]] = []

        async def where(conn: object) -> int:
            seen.append((threading.get_ident(), asyncio.get_running_loop()))
            return await _version(conn)

        try:
            await store.database.run(where)  # the store's thread (it migrates)
            local = await store.database.local()
            try:
                assert await local.run(where) >= 5
            finally:
                await local.close()
        finally:
            store.close()
        (store_thread, store_loop), on_local = seen
        assert store_thread != threading.get_ident()
        assert store_loop is not asyncio.get_running_loop()
        assert on_local == (threading.get_ident(), asyncio.get_running_loop())

    async def test_a_job_whose_connection_was_cut_runs_again_on_a_new_one(
        self, pg_dsn: str
    ) -> None:
        store = PostgresStore(pg_dsn)
        backends: list[int] = []

        async def cut_once(conn: object) -> int:
            pid: int = await conn.fetchval("SELECT pg_backend_pid()")  # type: ignore[attr-defined]
            backends.append(pid)
            if len(backends) == 1:  # the server ends this session, as a restart would
                await conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")  # type: ignore[attr-defined]
            return pid

        try:
            await store.database.run(_version)
            local = await store.database.local()
            try:
                answered = await local.run(cut_once)
            finally:
                await local.close()
        finally:
            store.close()
        assert len(backends) == 2
        assert answered == backends[1] != backends[0]

    async def test_its_jobs_one_after_another_share_a_connection_and_one_meanwhile_takes_another(
        self, pg_dsn: str
    ) -> None:
        store = PostgresStore(pg_dsn)
        inside = asyncio.Event()
        leave = asyncio.Event()

        async def pid(conn: object) -> int:
            return await conn.fetchval("SELECT pg_backend_pid()")  # type: ignore[attr-defined,no-any-return]

        async def held(conn: object) -> int:
            inside.set()
            await leave.wait()
            return await pid(conn)

        try:
            await store.database.run(_version)
            local = await store.database.local()
            try:
                first, second = await local.run(pid), await local.run(pid)
                holding = asyncio.ensure_future(local.run(held))
                await inside.wait()
                meanwhile = await local.run(pid)  # while `held` runs on the kept one
                leave.set()
                after = await holding
            finally:
                await local.close()
        finally:
            store.close()
        assert first == second == after != meanwhile

    async def test_a_kept_connection_the_server_ended_between_jobs_is_replaced_at_the_next(
        self, pg_dsn: str
    ) -> None:
        store = PostgresStore(pg_dsn)

        async def pid(conn: object) -> int:
            return await conn.fetchval("SELECT pg_backend_pid()")  # type: ignore[attr-defined,no-any-return]

        try:
            await store.database.run(_version)
            local = await store.database.local()
            try:
                first = await local.run(pid)
                other = await asyncpg.connect(pg_dsn)
                try:  # the server ends that session while no job runs on it (a restart would)
                    assert await other.fetchval("SELECT pg_terminate_backend($1)", first)
                finally:
                    await other.close()
                second = await local.run(pid)
                third = await local.run(pid)
            finally:
                await local.close()
        finally:
            store.close()
        assert first != second == third


async def test_an_unreachable_server_is_a_store_error_that_says_what_to_do() -> None:
    store = PostgresStore(f"postgresql://app:pw@127.0.0.1:{_closed_port()}/runs")
    try:
        with pytest.raises(StoreError) as caught:
            await store.database.run(_version)
    finally:
        store.close()
    message = str(caught.value)
    assert "cannot reach it" in message
    assert "is the server running" in message
    assert "pw@" not in message


async def test_a_missing_database_is_named(pg_dsn: str) -> None:
    store = PostgresStore(pg_dsn.rpartition("/")[0] + "/no_such_db")
    try:
        with pytest.raises(StoreError, match="does not exist: create it"):
            await store.database.run(_version)
    finally:
        store.close()


class TestTheExtra:
    def test_asyncpg_is_loaded_only_by_who_uses_postgresql(self) -> None:
        code = (
            "import sys, orchestra, orchestra.stores\n"
            "assert 'asyncpg' not in sys.modules, 'imported asyncpg'\n"
            "from orchestra.stores import PostgresStore\n"
            "assert 'asyncpg' in sys.modules\n"
            "assert PostgresStore.__module__ == 'orchestra.stores'\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr

    def test_without_asyncpg_the_error_says_which_extra_to_install(self) -> None:
        code = (
            "import sys\n"
            "sys.modules['asyncpg'] = None\n"
            "from orchestra.stores import PostgresStore\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False
        )
        assert done.returncode != 0
        assert "pip install 'orchestra-runtime[postgres]'" in done.stderr


async def test_an_unreadable_dsn_is_a_store_error_that_says_so() -> None:
    store = PostgresStore("postgresql://app:s3cret@host:notaport/db")
    try:
        with pytest.raises(StoreError, match="the DSN cannot be read") as caught:
            await store.database.run(_version)
    finally:
        store.close()
    assert "s3cret" not in str(caught.value)
