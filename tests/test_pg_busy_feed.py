"""A PostgreSQL coordinator hearing a busy feed (reads of `BUSY` ends and more, paced by
`PACE`), on the session's real server: its streamed results, its progress, and a stop."""

from __future__ import annotations

import functools
import sys
from typing import Any

import anyio
import pytest

from orchestra import Context, Orchestrator, PermanentError, Task, TaskResult, agent
from orchestra.stores._postgres._run import BUSY
from orchestra.stores._postgres._store import PostgresStore

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.subprocess,
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals"),
]

N = 8 * BUSY  # enough that the worker's ends are heard a busy read at a time


@agent(kinds=["work", "bad", "split"], concurrency=N)
async def quick(task: Task, ctx: Context) -> Any:
    if task.kind == "bad":
        raise PermanentError("never")
    if task.kind == "split":
        ctx.spawn(Task("work", -1, id=f"{task.id}.child"))
    return task.payload


def tasks_mixed() -> list[Task]:
    kinds = ("bad", "split") + ("work",) * 8
    return [Task(kinds[i % len(kinds)], i, id=f"t{i:04}") for i in range(N)]


class TestABusyFeed:
    async def test_every_end_a_worker_writes_is_streamed_once_and_counted_once(
        self, pg_dsn: str
    ) -> None:
        # The coordinator is paused: every task is the worker's, heard from the feed.
        tasks = tasks_mixed()
        spawned = [f"{t.id}.child" for t in tasks if t.kind == "split"]
        streamed: list[TaskResult] = []
        seen: list[int] = []  # the status's `completed` as the results come
        here, there = PostgresStore(pg_dsn, poll=0.1), PostgresStore(pg_dsn, poll=0.1)
        try:
            coordinator = Orchestrator(agents=[quick], store=here)
            worker = Orchestrator(agents=[quick])
            async with coordinator, worker, anyio.create_task_group() as tg:
                handle = coordinator.start(tasks, run_id="busy")
                handle.pause()
                results = handle.results()
                tg.start_soon(functools.partial(worker.work, there, run_id="busy"))
                with anyio.fail_after(60):
                    async for end in results:
                        streamed.append(end)
                        seen.append(handle.status().completed)
                    result = await handle
                tg.cancel_scope.cancel()
        finally:
            here.close()
            there.close()
        ids = [r.task_id for r in streamed]
        assert sorted(ids) == sorted([t.id for t in tasks] + spawned)  # each once
        assert seen == sorted(seen)
        assert all(n <= len(ids) for n in seen)
        by_id = {r.task_id: r for r in streamed}
        for task in tasks:
            end = by_id[task.id]
            if task.kind == "bad":
                assert (end.status, end.error_type) == ("failed", "PermanentError")
            else:
                assert (end.status, end.output) == ("succeeded", task.payload)
        bad = sum(t.kind == "bad" for t in tasks)
        counts = {k: n for k, n in result.metadata.counts.items() if n}
        assert counts == {"succeeded": N - bad + len(spawned), "failed": bad}
        status = handle.status()
        assert (status.completed, status.total) == (len(ids), len(ids))

    async def test_a_stop_while_the_feed_is_busy_ends_the_run_and_every_task_once(
        self, pg_dsn: str
    ) -> None:
        streamed: list[str] = []
        here, there = PostgresStore(pg_dsn, poll=0.1), PostgresStore(pg_dsn, poll=0.1)
        tasks = [Task("work", i, id=f"t{i:05}") for i in range(20 * N)]
        try:
            coordinator = Orchestrator(agents=[quick], store=here)
            worker = Orchestrator(agents=[quick])
            async with coordinator, worker, anyio.create_task_group() as tg:
                handle = coordinator.start(tasks, run_id="busy")
                handle.pause()
                results = handle.results()
                tg.start_soon(functools.partial(worker.work, there, run_id="busy"))
                with anyio.fail_after(60):
                    async for end in results:
                        streamed.append(end.task_id)
                        if len(streamed) == 2 * BUSY:
                            tg.start_soon(functools.partial(handle.stop, grace=0))
                    result = await handle
                tg.cancel_scope.cancel()
        finally:
            here.close()
            there.close()
        assert result.status == "cancelled"
        assert len(streamed) == len(set(streamed)) == len(tasks)
        counts = result.metadata.counts
        assert counts["succeeded"] + counts["cancelled"] == len(tasks)
