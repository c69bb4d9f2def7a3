"""The plans of the PostgreSQL statements that run under generic plans (`_settle.FORCED_PLANS`):
the generic plan PostgreSQL would keep for each (a prepared statement explained under
``force_generic_plan``, on the session's real server) reads the tasks by primary key, whatever
the batch, on a table whose statistics tempt it otherwise (many tasks, none of them leased when
it was analyzed, so that the partial index of leases looks empty)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from orchestra.stores._postgres._follow import _HEARD
from orchestra.stores._postgres._leases import _CLAIM, _COMPLETE
from orchestra.stores._postgres._settle import _CONCERNS, _WAITED_FOR

if TYPE_CHECKING:
    import asyncpg

pytestmark = [pytest.mark.subprocess, pytest.mark.postgres]

TASKS = 20_000


async def generic_plan(conn: asyncpg.Connection, statement: str) -> str:
    """The generic plan of `statement`, as EXPLAIN prints it."""
    await conn.execute(f"PREPARE probe AS {statement}")
    params = await conn.fetchval(
        "SELECT cardinality(parameter_types) FROM pg_prepared_statements WHERE name = 'probe'"
    )
    await conn.execute("SET plan_cache_mode = force_generic_plan")
    try:
        rows = await conn.fetch(f"EXPLAIN EXECUTE probe({', '.join(['NULL'] * params)})")
    finally:
        await conn.execute("RESET plan_cache_mode")
        await conn.execute("DEALLOCATE probe")
    return "\n".join(row[0] for row in rows)


@pytest.fixture
async def tasks(pg_conn: asyncpg.Connection) -> asyncpg.Connection:
    """A run of `TASKS` ready tasks, analyzed before any was leased."""
    await pg_conn.execute("INSERT INTO orchestra.runs (id) VALUES ('r')")
    await pg_conn.execute(
        "INSERT INTO orchestra.tasks (run_id, id, seq, idx, named, kind, payload, priority, "
        "state) SELECT 'r', 't' || g, g, g, false, 'k', to_json(g), 0, 'ready' "
        "FROM generate_series(1, $1::integer) AS g",
        TASKS,
    )
    await pg_conn.execute("ANALYZE orchestra.tasks")
    return pg_conn


class TestGenericPlans:
    @pytest.mark.parametrize(
        "statement",
        [_COMPLETE, _CONCERNS, _HEARD],
        ids=["a completion", "whether ends concern the graph", "the ended feed's read"],
    )
    async def test_each_reads_the_tasks_by_primary_key(
        self, tasks: asyncpg.Connection, statement: str
    ) -> None:
        plan = await generic_plan(tasks, statement)
        assert "using tasks_pkey on tasks" in plan, plan
        assert "tasks_leased" not in plan, plan
        assert "Seq Scan on tasks" not in plan, plan

    async def test_whether_something_waits_for_ends_reads_edges_and_groups_by_their_keys(
        self, tasks: asyncpg.Connection
    ) -> None:
        plan = await generic_plan(tasks, _WAITED_FOR)
        assert "using edges_pkey on edges" in plan, plan
        assert "using groups_pkey on groups" in plan, plan
        assert "Seq Scan" not in plan, plan

    @pytest.mark.parametrize(
        "index", ["attempts_by_task", "tasks_by_parent"], ids=["failed attempts", "spawns"]
    )
    async def test_the_ended_feeds_read_takes_what_came_with_each_end_by_its_index(
        self, tasks: asyncpg.Connection, index: str
    ) -> None:
        plan = await generic_plan(tasks, _HEARD)
        assert f"using {index} on" in plan, plan
        assert "Seq Scan" not in plan, plan

    async def test_a_claim_picks_from_the_ready_index_and_updates_by_primary_key(
        self, tasks: asyncpg.Connection
    ) -> None:
        plan = await generic_plan(tasks, _CLAIM)
        assert "using tasks_ready on tasks r" in plan, plan
        assert "using tasks_pkey on tasks t" in plan, plan
        assert "Seq Scan" not in plan, plan
