"""The PostgreSQL schema and its migrations (`orchestra.stores._postgres._schema`), on the session's real
server: a new database gets the newest schema, a second migrate changes nothing, a newer orchestra's
migration is applied on top and then refused by this one, processes migrating at once end with one
schema, a failed migration leaves nothing, and a schema named ``orchestra`` that is not ours is
refused."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import asyncpg
import pytest

from orchestra import StoreError
from orchestra.stores._postgres import _follow as follow
from orchestra.stores._postgres._schema import MIGRATIONS, migrate, version_of

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = [pytest.mark.subprocess, pytest.mark.postgres]

NEWEST = len(MIGRATIONS)

# What a newer orchestra might append: a column, and a row written through it.
_NEXT = (
    "ALTER TABLE orchestra.runs ADD COLUMN note text",
    "UPDATE orchestra.runs SET note = 'migrated'",
)


@pytest.fixture
async def conn(pg_empty_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection to a new, empty database."""
    conn = await asyncpg.connect(pg_empty_dsn)
    try:
        yield conn
    finally:
        await conn.close()


async def _tables(conn: asyncpg.Connection) -> set[str]:
    rows = await conn.fetch(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = 'orchestra'"
    )
    return {row[0] for row in rows}


class TestANewDatabase:
    async def test_gets_the_newest_schema_in_a_namespace_of_its_own(
        self, conn: asyncpg.Connection
    ) -> None:
        assert await version_of(conn) == 0
        assert await migrate(conn) == NEWEST
        assert await version_of(conn) == NEWEST
        assert {
            "runs", "tasks", "edges", "groups", "attempts", "events", "keys", "workers",
            "dead_letters", "schema_version",
        } <= await _tables(conn)  # fmt: skip
        public = await conn.fetchval(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'"
        )
        assert public == 0

    async def test_a_second_migrate_changes_nothing(self, conn: asyncpg.Connection) -> None:
        await migrate(conn)
        await conn.execute("INSERT INTO orchestra.runs (id) VALUES ('r1')")
        assert await migrate(conn) == NEWEST
        assert await conn.fetchval("SELECT version FROM orchestra.schema_version") == NEWEST
        assert await conn.fetchval("SELECT count(*) FROM orchestra.schema_version") == 1
        assert await conn.fetchval("SELECT id FROM orchestra.runs") == "r1"


class TestVersions:
    async def test_a_newer_orchestra_applies_only_its_new_migration(
        self, conn: asyncpg.Connection
    ) -> None:
        await migrate(conn)
        await conn.execute("INSERT INTO orchestra.runs (id) VALUES ('r1')")
        assert await migrate(conn, migrations=(*MIGRATIONS, _NEXT)) == NEWEST + 1
        assert await conn.fetchval("SELECT note FROM orchestra.runs WHERE id = 'r1'") == "migrated"

    async def test_an_older_orchestra_refuses_a_newer_schema_saying_what_to_do(
        self, conn: asyncpg.Connection
    ) -> None:
        await migrate(conn, migrations=(*MIGRATIONS, _NEXT))
        with pytest.raises(StoreError) as raised:
            await migrate(conn)
        message = str(raised.value)
        assert f"schema version {NEWEST + 1}, newer than this orchestra knows ({NEWEST})" in message
        assert "upgrade orchestra" in message
        database = await conn.fetchval("SELECT current_database()")
        assert f"database {database!r} on 127.0.0.1:" in message
        assert await version_of(conn) == NEWEST + 1  # untouched

    async def test_a_failed_migration_leaves_nothing_behind(self, conn: asyncpg.Connection) -> None:
        await migrate(conn)
        broken = ("ALTER TABLE orchestra.runs ADD COLUMN half text", "SELECT no_such_function()")
        with pytest.raises(asyncpg.UndefinedFunctionError):
            await migrate(conn, migrations=(*MIGRATIONS, broken))
        assert await version_of(conn) == NEWEST
        columns = await conn.fetchval(
            "SELECT count(*) FROM information_schema.columns "
            "WHERE table_schema = 'orchestra' AND table_name = 'runs' AND column_name = 'half'"
        )
        assert columns == 0


class TestOwnersIndex:
    async def test_a_v5_database_loses_the_owners_index_and_keeps_its_leases(
        self, conn: asyncpg.Connection
    ) -> None:
        assert await migrate(conn, migrations=MIGRATIONS[:5]) == 5
        assert await _indexes(conn) >= {"tasks_by_owner", "tasks_leased"}
        await conn.execute("INSERT INTO orchestra.runs (id) VALUES ('r1')")
        await conn.execute(
            "INSERT INTO orchestra.tasks (run_id, id, seq, idx, named, kind, payload, priority, "
            "state, lease_owner, lease_expires) VALUES ('r1', 't1', 1, 0, true, 'k', '{}', 0, "
            "'claimed', 'w1', now() + interval '30 seconds')"
        )
        assert await migrate(conn) == NEWEST
        indexes = await _indexes(conn)
        assert "tasks_by_owner" not in indexes
        assert "tasks_leased" in indexes  # what a worker's leases are found through now
        held = await conn.fetch("SELECT id FROM orchestra.tasks WHERE lease_owner = 'w1'")
        assert [row[0] for row in held] == ["t1"]

    async def test_a_new_database_never_has_it(self, conn: asyncpg.Connection) -> None:
        await migrate(conn)
        assert "tasks_by_owner" not in await _indexes(conn)


class TestTasksPages:
    async def test_a_v8_database_leaves_half_of_each_new_page_for_the_rows_written_anew(
        self, conn: asyncpg.Connection
    ) -> None:
        # A claim and an end each write a task's row anew: the new version stays on its page.
        assert await migrate(conn, migrations=MIGRATIONS[:8]) == 8
        assert await _options(conn) is None
        assert await migrate(conn) == NEWEST
        assert await _options(conn) == ["fillfactor=50"]


async def _options(conn: asyncpg.Connection) -> list[str] | None:
    options: list[str] | None = await conn.fetchval(
        "SELECT reloptions FROM pg_class WHERE oid = 'orchestra.tasks'::regclass"
    )
    return options


async def _indexes(conn: asyncpg.Connection) -> set[str]:
    rows = await conn.fetch("SELECT indexname FROM pg_indexes WHERE schemaname = 'orchestra'")
    return {row[0] for row in rows}


class TestConcurrentMigrations:
    async def test_processes_migrating_one_new_database_at_once_end_with_one_schema(
        self, pg_empty_dsn: str
    ) -> None:
        conns = [await asyncpg.connect(pg_empty_dsn) for _ in range(4)]
        try:
            versions = await asyncio.gather(*(migrate(c) for c in conns))
            assert versions == [NEWEST] * 4
            assert await conns[0].fetchval("SELECT count(*) FROM orchestra.schema_version") == 1
            schemas = await conns[0].fetchval(
                "SELECT count(*) FROM pg_namespace WHERE nspname = 'orchestra'"
            )
            assert schemas == 1
        finally:
            for c in conns:
                await c.close()


class TestAForeignSchema:
    async def test_a_schema_named_orchestra_that_is_not_ours_is_refused(
        self, conn: asyncpg.Connection
    ) -> None:
        await conn.execute("CREATE SCHEMA orchestra; CREATE TABLE orchestra.mine (v int)")
        with pytest.raises(
            StoreError, match="schema named 'orchestra' that orchestra did not make"
        ):
            await migrate(conn)
        assert await _tables(conn) == {"mine"}


class TestEndedFeed:
    async def test_a_v9_feeds_ends_are_heard_after_the_upgrade_in_order_with_their_spawns(
        self, conn: asyncpg.Connection
    ) -> None:
        # A run resumed across the upgrade: the ends an older worker wrote, a row per task, are
        # still its coordinator's to hear, once.
        assert await migrate(conn, migrations=MIGRATIONS[:9]) == 9
        await conn.execute("INSERT INTO orchestra.runs (id, owner) VALUES ('r', 'coordinator')")
        await conn.execute(
            "INSERT INTO orchestra.tasks (run_id, id, seq, parent, idx, named, kind, payload, "
            "priority, state, output, attempts) VALUES "
            "('r', 'b', 1, NULL, 0, true, 'k', '{}', 0, 'succeeded', '1', 1), "
            "('r', 'a', 2, NULL, 1, true, 'k', '{}', 0, 'succeeded', '2', 1), "
            "('r', 'a/c', 3, 'a', 0, true, 'k', '{\"x\": 1}', 0, 'ready', NULL, 0)"
        )
        await conn.execute("INSERT INTO orchestra.ended (run_id, id) VALUES ('r', 'b'), ('r', 'a')")
        assert await migrate(conn) == NEWEST
        heard = await follow.heard(conn, "r")
        assert [(row[0], row[2]) for row in heard.ends] == [("b", "1"), ("a", "2")]
        assert [spawn[0] for spawn in heard.spawned["a"]] == ["a/c"]
        assert "b" not in heard.spawned
        assert (await follow.heard(conn, "r")).ends == []
