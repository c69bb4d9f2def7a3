"""A PostgreSQL coordinator hearing a busy feed (reads of `BUSY` ends and more, paced by
`PACE`), on the session's real server: its streamed results, its progress, and a stop."""

from __future__ import annotations

import functools
import sys
from typing import Any

import anyio
import pytest

from orchestra import Context, Orchestrator, PermanentError, Task, TaskResult, agent
from orchestra.stores._postgres import _run
from orchestra.stores._postgres._run import BUSY, HOLD, WORTH, waits_for_more
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


class TestTheCoordinatorsSmallRoomWhileBusy:
    def test_a_small_room_waits_at_most_hold_and_only_while_busy(self) -> None:
        assert waits_for_more(1, True, None, 10.0)  # first held back now
        assert waits_for_more(WORTH - 1, True, 10.0, 10.0 + HOLD / 2)
        assert not waits_for_more(1, True, 10.0, 10.0 + HOLD)  # held long enough: claimed
        assert not waits_for_more(WORTH, True, None, 10.0)  # worth a claim at once
        assert not waits_for_more(1, False, None, 10.0)  # a run not busy claims any room
        assert not waits_for_more(0, True, None, 10.0)  # no room: nothing to hold

    async def test_a_kind_only_the_coordinator_serves_runs_while_workers_keep_the_feed_busy(
        self, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The worker's tasks spawn more for as long as the coordinator's one-slot agent has not
        # run both of its tasks: a coordinator that left its small room to wait for a quiet feed
        # would keep the run going until the cap. Busy from the first end heard (a worker in
        # this process, on a shared machine, may not end BUSY tasks a read), and v1 can only be
        # claimed once v0 has run, a while after that.
        monkeypatch.setattr(_run, "BUSY", 1)
        verified: list[str] = []
        cap = 400 * BUSY

        @agent(kinds=["verify"], concurrency=1)
        async def verify(task: Task, ctx: Context) -> Any:
            await anyio.sleep(0.3)
            verified.append(task.id)
            return task.payload

        async def spawning(task: Task, ctx: Context) -> Any:
            if len(verified) < 2 and task.payload < cap:
                next_one = task.payload + 4 * BUSY
                ctx.spawn(Task("work", next_one, id=f"w{next_one}"))
            return None

        work = agent(spawning, kinds=["work"], concurrency=4 * BUSY)
        # (the coordinator serves every kind of its input; one slot here, with verify's: a room
        # under WORTH)
        work_here = agent(spawning, kinds=["work"], concurrency=1, name="work_here")

        tasks = [Task("work", i, id=f"w{i}") for i in range(4 * BUSY)]
        tasks += [Task("verify", i, id=f"v{i}") for i in range(2)]
        here, there = PostgresStore(pg_dsn, poll=0.1), PostgresStore(pg_dsn, poll=0.1)
        try:
            coordinator = Orchestrator(agents=[verify, work_here], store=here)
            worker = Orchestrator(agents=[work])
            async with coordinator, worker, anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(worker.work, there, run_id="small"))
                with anyio.fail_after(60):
                    result = await coordinator.run(tasks, run_id="small")
                tg.cancel_scope.cancel()
        finally:
            here.close()
            there.close()
        assert sorted(verified) == ["v0", "v1"]
        assert result.status == "success"
        spawned = result.metadata.counts["succeeded"] - len(tasks)
        assert spawned < cap - 4 * BUSY  # the spawning stopped once both had run
