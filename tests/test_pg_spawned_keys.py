"""Idempotency keys of tasks an agent *spawns*, across runs and processes on PostgreSQL: the
spawn's key is claimed in the transaction that admits it (a coordinator's completion, or a
worker's), and a key another run holds or finished is waited for or reused, as an admitted
task's is (`_postgres/_keys.py`). On the session's real server, with real processes killed by
real signals where a process matters."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import anyio
import asyncpg
import pytest

from orchestra import Context, Orchestrator, PermanentError, RetryPolicy, Task, agent
from orchestra.stores._postgres._store import PostgresStore
from tests.helpers import REPO, spawn
from tests.test_pg_worker import ran, start_worker, wait_all

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

pytestmark = [pytest.mark.subprocess, pytest.mark.postgres]


@pytest.fixture
async def store(pg_dsn: str) -> AsyncIterator[PostgresStore]:
    store = PostgresStore(pg_dsn, poll=0.1)
    yield store
    store.close()


def spawner(key: str = "order-1") -> Any:
    """A ``split`` agent whose attempt spawns ``charge`` task ``<its id>.c`` with `key`, and a
    ``sum`` task that depends on it (its output: the charge's)."""

    @agent(kinds=["split"])
    async def split(task: Task, ctx: Context) -> str:
        ctx.spawn(Task("charge", task.payload, id=f"{task.id}.c", key=key))
        ctx.spawn(Task("sum", None, id=f"{task.id}.sum", depends_on=[f"{task.id}.c"]))
        return "split"

    return split


@agent(kinds=["sum"])
async def add(task: Task, ctx: Context) -> Any:
    return list(ctx.deps.values())


def charger(calls: list[str], gate: anyio.Event | None = None, delay: float = 0.0) -> Any:
    @agent(kinds=["charge"], concurrency=50)
    async def charge(task: Task, ctx: Context) -> str:
        calls.append(task.id)
        if gate is not None:
            await gate.wait()
        if delay:
            await anyio.sleep(delay)
        return f"charged {task.payload}"

    return charge


async def key_row(dsn: str, key: str) -> asyncpg.Record | None:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchrow(
            "SELECT state, run_id, task_id, output::text FROM orchestra.keys WHERE key = $1", key
        )
    finally:
        await conn.close()


async def events_of(dsn: str, event: str) -> list[tuple[str, str]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT run_id, task_id FROM orchestra.events WHERE event = $1 ORDER BY seq", event
        )
    finally:
        await conn.close()
    return [(row[0], row[1]) for row in rows]


async def until_called(calls: list[str], n: int) -> None:
    with anyio.fail_after(20):
        while len(calls) < n:
            await anyio.sleep(0.01)


class TestASpawnedKeyAnotherRunFinished:
    async def test_is_reused_without_executing_and_what_waits_for_it_gets_the_result(
        self, store: PostgresStore, pg_dsn: str
    ) -> None:
        calls: list[str] = []
        async with Orchestrator(agents=[spawner(), charger(calls), add], store=store) as orch:
            first = await orch.run([Task("charge", 10, id="c", key="order-1")], run_id="k1")
            second = await orch.run([Task("split", 10, id="s")], run_id="k2")
        assert first.data == {"c": "charged 10"}
        assert second.status == "success", second.errors
        assert second.data["s.c"] == "charged 10"
        assert second.data["s.sum"] == ["charged 10"]
        assert calls == ["c"]  # the spawn was not executed
        assert await events_of(pg_dsn, "key_reused") == [("k2", "s.c")]
        row = await key_row(pg_dsn, "order-1")
        assert row is not None
        assert (row["state"], row["run_id"], row["task_id"]) == ("succeeded", "k1", "c")

    async def test_a_spawn_reuses_the_result_another_runs_spawn_stored(
        self, store: PostgresStore
    ) -> None:
        calls: list[str] = []
        async with Orchestrator(agents=[spawner(), charger(calls), add], store=store) as orch:
            first = await orch.run([Task("split", 1, id="a")], run_id="k1")
            second = await orch.run([Task("split", 2, id="b")], run_id="k2")
        assert first.data["a.c"] == "charged 1"
        assert second.data["b.c"] == "charged 1"  # the key's result, not its own payload's
        assert calls == ["a.c"]

    async def test_that_failed_is_taken_over_and_run(self, store: PostgresStore) -> None:
        calls: list[str] = []

        @agent(kinds=["charge"], retry=RetryPolicy(max_attempts=1))
        async def charge(task: Task, ctx: Context) -> str:
            calls.append(task.id)
            if task.payload == "bad":
                raise PermanentError("card declined")
            return "ok"

        async with Orchestrator(agents=[spawner(), charge, add], store=store) as orch:
            failed = await orch.run([Task("split", "bad", id="a")], run_id="f1")
            again = await orch.run([Task("split", "good", id="b")], run_id="f2")
        assert failed.status == "failed"
        assert again.data["b.c"] == "ok"
        assert calls == ["a.c", "b.c"]


class TestASpawnedKeyAnotherRunHolds:
    async def test_is_waited_for_then_its_result_taken(
        self, pg_dsn: str, store: PostgresStore
    ) -> None:
        calls: list[str] = []
        gate = anyio.Event()
        other = PostgresStore(pg_dsn, poll=0.1)
        agents = [spawner(), charger(calls, gate), add]
        try:
            async with (
                Orchestrator(agents=agents, store=store) as first,
                Orchestrator(agents=agents, store=other) as second,
            ):
                holder = first.start([Task("split", 1, id="a")], run_id="r-a")
                await until_called(calls, 1)
                waiter = second.start([Task("split", 1, id="b")], run_id="r-b")
                with anyio.fail_after(20):
                    while not await events_of(pg_dsn, "key_waits"):
                        await anyio.sleep(0.02)
                await anyio.sleep(0.3)
                assert calls == ["a.c"]  # b.c is held back: the key is r-a's
                assert not waiter.done
                gate.set()
                done_a, done_b = await holder, await waiter
        finally:
            other.close()
        assert done_a.data["a.c"] == "charged 1"
        assert done_b.status == "success", done_b.errors
        assert done_b.data["b.c"] == "charged 1"
        assert done_b.data["b.sum"] == ["charged 1"]
        assert calls == ["a.c"]
        assert await events_of(pg_dsn, "key_waits") == [("r-b", "b.c")]
        assert await events_of(pg_dsn, "key_reused") == [("r-b", "b.c")]

    async def test_whose_task_fails_is_taken_over_and_run_by_the_waiting_run(
        self, pg_dsn: str, store: PostgresStore
    ) -> None:
        calls: list[str] = []
        gate = anyio.Event()

        @agent(kinds=["charge"], retry=RetryPolicy(max_attempts=1))
        async def charge(task: Task, ctx: Context) -> str:
            calls.append(task.id)
            if task.id == "a.c":
                await gate.wait()
                raise PermanentError("card declined")
            return "ok"

        other = PostgresStore(pg_dsn, poll=0.1)
        agents = [spawner(), charge, add]
        try:
            async with (
                Orchestrator(agents=agents, store=store) as first,
                Orchestrator(agents=agents, store=other) as second,
            ):
                holder = first.start([Task("split", 1, id="a")], run_id="r-a")
                await until_called(calls, 1)
                waiter = second.start([Task("split", 1, id="b")], run_id="r-b")
                with anyio.fail_after(20):
                    while not await events_of(pg_dsn, "key_waits"):
                        await anyio.sleep(0.02)
                assert calls == ["a.c"]
                gate.set()
                done_a, done_b = await holder, await waiter
        finally:
            other.close()
        assert done_a.status == "failed"
        assert done_b.status == "success", done_b.errors
        assert done_b.data["b.sum"] == ["ok"]
        assert calls == ["a.c", "b.c"]
        assert await events_of(pg_dsn, "key_taken") == [("r-b", "b.c")]
        row = await key_row(pg_dsn, "order-1")
        assert row is not None
        assert (row["state"], row["run_id"], row["task_id"]) == ("succeeded", "r-b", "b.c")

    async def test_twenty_runs_spawning_one_key_at_once_execute_it_once(
        self, pg_dsn: str, store: PostgresStore
    ) -> None:
        calls: list[str] = []
        other = PostgresStore(pg_dsn, poll=0.1)
        agents = [spawner(), charger(calls, delay=0.3), add]
        results: dict[str, Any] = {}
        try:
            async with (
                Orchestrator(agents=agents, store=store) as one,
                Orchestrator(agents=agents, store=other) as two,
                anyio.create_task_group() as tg,
            ):

                async def run(orch: Orchestrator, i: int) -> None:
                    results[f"r{i}"] = await orch.run(
                        [Task("split", 7, id=f"s{i}")], run_id=f"r{i}"
                    )

                for i in range(20):
                    tg.start_soon(run, one if i % 2 else two, i)
        finally:
            other.close()
        assert len(calls) == 1
        assert {r.status for r in results.values()} == {"success"}
        assert {r.data[f"s{i}.c"] for i, r in enumerate(results[f"r{i}"] for i in range(20))} == {
            "charged 7"
        }


class TestASpawnedKeysHolderKilled:
    async def test_the_waiting_run_takes_the_key_over_once_its_hold_lapses_and_runs_it(
        self, pg_dsn: str, tmp_path: Path
    ) -> None:
        calls_file = tmp_path / "calls"
        holder = spawn(
            [sys.executable, str(REPO / "tests" / "pg_spawn_key_job.py"), pg_dsn, "held",
             str(calls_file), "1.0"],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        with anyio.fail_after(30):
            while not calls_file.exists() or not calls_file.read_text():
                assert holder.poll() is None, holder.communicate()
                await anyio.sleep(0.02)
        calls: list[str] = []
        store = PostgresStore(pg_dsn, poll=0.1, lease=1.0)
        try:
            async with Orchestrator(agents=[spawner(), charger(calls), add], store=store) as orch:
                waiter = orch.start([Task("split", 1, id="w")], run_id="waiter")
                with anyio.fail_after(20):
                    while not await events_of(pg_dsn, "key_waits"):
                        await anyio.sleep(0.02)
                await anyio.sleep(1.5)  # past the hold's lease: renewed by its live holder
                assert calls == []
                holder.send_signal(signal.SIGKILL)
                holder.wait()
                result = await waiter
        finally:
            store.close()
        assert [line.split()[0] for line in calls_file.read_text().splitlines()] == ["held.c"]
        assert calls == ["w.c"]  # taken over: run here, once
        assert result.status == "success", result.errors
        assert result.data["w.sum"] == ["charged 1"]
        row = await key_row(pg_dsn, "order-1")
        assert row is not None
        assert (row["state"], row["run_id"], row["task_id"]) == ("succeeded", "waiter", "w.c")
        assert json.loads(row["output"]) == "charged 1"


class TestAWaitingRunsCoordinatorKilled:
    async def test_the_resumed_run_waits_again_and_takes_the_holders_result(
        self, pg_dsn: str, store: PostgresStore, tmp_path: Path
    ) -> None:
        # The resumed run's input comes late (a stream): the key is asked for again once the
        # run has its tasks back, not before (the answer would be lost, and the run wait on).
        async def late() -> AsyncIterator[Task]:
            await anyio.sleep(1.0)
            yield Task("split", None, id="s")

        calls: list[str] = []
        gate = anyio.Event()
        waiter_calls = tmp_path / "calls"
        async with Orchestrator(agents=[spawner(), charger(calls, gate), add], store=store) as orch:
            holder = orch.start([Task("split", 1, id="a")], run_id="holder")
            await until_called(calls, 1)
            waiter = spawn(
                [sys.executable, str(REPO / "tests" / "pg_spawn_key_job.py"), pg_dsn, "w",
                 str(waiter_calls), "1.0"],
                cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            with anyio.fail_after(30):
                while not await events_of(pg_dsn, "key_waits"):
                    assert waiter.poll() is None, waiter.communicate()
                    await anyio.sleep(0.02)
            waiter.send_signal(signal.SIGKILL)
            waiter.wait()
            other = PostgresStore(pg_dsn, poll=0.1, lease=1.0)
            try:
                async with Orchestrator(
                    agents=[spawner(), charger(calls), add], store=other
                ) as again:
                    resumed = again.start(late(), run_id="w")
                    await anyio.sleep(2.0)  # past the killed coordinator's leases, and the input
                    assert not resumed.done  # waiting again for the holder
                    gate.set()
                    with anyio.fail_after(20):
                        result = await resumed
            finally:
                other.close()
            assert (await holder).data["a.c"] == "charged 1"
        assert not waiter_calls.exists()  # the killed run never ran the charge
        assert calls == ["a.c"]
        assert result.status == "success", result.errors
        assert result.data["w.c"] == "charged 1"
        assert await events_of(pg_dsn, "key_reused") == [("w", "w.c")]


class TestASpawnedKeyInAWorkerProcess:
    async def test_is_claimed_in_the_workers_completion_and_the_key_runs_once_over_two_runs(
        self, pg_dsn: str, tmp_path: Path
    ) -> None:
        calls = tmp_path / "calls"

        @agent(kinds=["keyed", "work"])
        async def never(task: Task, ctx: Context) -> None:  # the coordinators run nothing
            raise AssertionError(task.id)

        # The spawn runs past its key's lease: the key's hold is its run's coordinator's, which
        # renews it (else the other run would take the key over and run it again).
        worker = start_worker(pg_dsn, calls, run_id=None, lease=1.5, delay=2.5)
        one = PostgresStore(pg_dsn, poll=0.1, lease=1.5)
        two = PostgresStore(pg_dsn, poll=0.1, lease=1.5)
        try:
            async with (
                Orchestrator(agents=[never], store=one) as first,
                Orchestrator(agents=[never], store=two) as second,
            ):
                a = first.start([Task("keyed", 3, id="a")], run_id="ra")
                b = second.start([Task("keyed", 3, id="b")], run_id="rb")
                a.pause()
                b.pause()  # every task is the worker's: its completions admit the spawns
                done_a, done_b = await a, await b
        finally:
            one.close()
            two.close()
            worker.send_signal(signal.SIGTERM)
            errs = await wait_all([worker])
        assert worker.returncode == 0, errs
        assert done_a.status == done_b.status == "success", (done_a.errors, done_b.errors)
        assert done_a.data["a.w"] == done_b.data["b.w"] == 6
        executed = sorted(task for task, _ in ran(calls))
        assert executed in (["a", "a.w", "b"], ["a", "b", "b.w"])  # the key ran once
        waited = await events_of(pg_dsn, "key_waits")
        reused = await events_of(pg_dsn, "key_reused")
        assert len(reused) == 1
        assert waited in ([], reused)
