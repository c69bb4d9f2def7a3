"""A PostgreSQL worker's claims made with the write of its ends (`complete_and_claim`), on the
session's real server: what such a claim brings that the worker cannot run, and a stop that comes
while such a write is under way. The run is made as its coordinator would make it (see
tests/test_pg_worker.py)."""

from __future__ import annotations

import asyncio
import sys
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from pydantic import BaseModel

from orchestra import Context, Orchestrator, Task, agent
from orchestra._core._orchestrator import LocalRuns
from orchestra.stores._postgres._store import PostgresStore
from orchestra.stores._postgres._worker import PostgresWorkerBackend
from orchestra.stores._worker import Worker, WorkReport, backend_of
from tests.test_pg_worker import close_run, open_run, until_ended

if TYPE_CHECKING:
    import asyncpg

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.subprocess,
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals"),
]


def balanced(report: WorkReport) -> bool:
    """Every task a worker claimed is accounted for once, however it stopped."""
    return report.claimed == (
        report.completed + report.refused + report.lost + report.released + report.passed_on
    )


class Number(BaseModel):
    n: int


class TestAClaimMadeWithAWrite:
    async def test_a_payload_the_workers_agent_refuses_fails_that_task_and_the_rest_run(
        self, pg_dsn: str, pg_conn: asyncpg.Connection
    ) -> None:
        # Two at a time: all but the first two tasks are claimed with the writes of earlier
        # ends, and every third one's payload fails the agent's model.
        @agent(kinds=["work"], concurrency=2, input=Number)
        async def typed(task: Task, ctx: Context) -> int:
            n: int = task.payload.n
            return n * 2

        tasks = [
            Task("work", {"n": "not a number"} if i % 3 == 2 else {"n": i}, id=f"t{i:02}")
            for i in range(12)
        ]
        await open_run(pg_conn, "r", tasks)
        store = PostgresStore(pg_dsn, lease=30.0, poll=0.1)
        reports: list[WorkReport] = []
        try:
            async with anyio.create_task_group() as tg:

                async def work() -> None:
                    reports.append(await Orchestrator(agents=[typed]).work(store, run_id="r"))

                tg.start_soon(work)
                rows = await until_ended(pg_conn, "r", 12)
                await close_run(pg_conn, "r")
        finally:
            store.close()
        assert {i: (r["state"], r["error_type"]) for i, r in rows.items()} == {
            t.id: ("failed", "InputError") if i % 3 == 2 else ("succeeded", None)
            for i, t in enumerate(tasks)
        }
        (report,) = reports
        assert (report.claimed, report.completed) == (12, 12)
        assert balanced(report)


class TestAStopDuringAWriteThatClaims:
    async def test_what_the_write_claimed_is_handed_back_and_counted_claimed_and_released(
        self,
        pg_dsn: str,
        pg_conn: asyncpg.Connection,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        # A drain begins while the worker's first write of ends is on its way, before that
        # write's claim: what the claim brings is handed back unrun. The worker's report and its
        # row in the store count those tasks claimed, and released: every claim accounted for.
        @agent(kinds=["work"], concurrency=2)
        async def quick(task: Task, ctx: Context) -> int:
            return int(task.payload)

        await open_run(pg_conn, "r", [Task("work", i, id=f"t{i:02}") for i in range(10)])
        store = PostgresStore(pg_dsn, lease=30.0, poll=0.1)
        orch = Orchestrator(agents=[quick])
        worker = Worker(LocalRuns(orch), backend_of(store), "r", None, 0.1)
        chained = PostgresWorkerBackend.complete_and_claim
        drains: list[asyncio.Task[None]] = []

        async def stopped_meanwhile(self: PostgresWorkerBackend, *args: Any) -> list[bool]:
            if args[-2] is not None and not drains:  # the first write that claims
                drains.append(asyncio.ensure_future(worker.drain(5.0)))
                while not worker.stopping:
                    await asyncio.sleep(0)
            return await chained(self, *args)

        monkeypatch.setattr(PostgresWorkerBackend, "complete_and_claim", stopped_meanwhile)
        try:
            async with orch:
                with anyio.fail_after(30):
                    report = await worker.run()
                    await drains[0]
        finally:
            store.close()
        rows = await pg_conn.fetch("SELECT id, state, lease_owner FROM orchestra.tasks")
        states = sorted(r["state"] for r in rows)
        assert states == ["ready"] * 8 + ["succeeded"] * 2
        assert {r["lease_owner"] for r in rows} == {None}
        assert (report.completed, report.released) == (2, 2)
        assert report.claimed == 4
        assert balanced(report)
        row = await pg_conn.fetchrow(
            "SELECT claimed, completed FROM orchestra.workers WHERE owner = $1", report.worker
        )
        assert row is not None
        assert (row["claimed"], row["completed"]) == (report.claimed, report.completed)
