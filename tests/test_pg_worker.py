"""Worker processes over PostgreSQL (`orchestra.stores._postgres._worker`, `Orchestrator.work`,
``orchestra worker --dsn``), on the session's real server.

A run is made as its coordinator would make it (`_coordinator.acquire` writes its row, `_graph.admit`
its tasks); the workers claim, run and complete them, and a task's dependents are made ready by the
completion that ends it, in the worker's own transaction. The test stands for the coordinator that
is not there: it waits for the tasks' rows to end and closes the run (a worker bound to a run
returns once its row says it is closed). In-process tests run `orch.work`; the process tests start
real ``orchestra worker`` processes (tests/pg_work_job.py) and kill, stop, continue and drain them
with real signals.
"""

from __future__ import annotations

import collections
import functools
import gc
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import asyncpg
import pytest
from typer.testing import CliRunner

from orchestra import (
    ConfigError,
    Context,
    Orchestrator,
    PermanentError,
    RetryableError,
    RetryPolicy,
    Task,
    agent,
)
from orchestra._admission import Admission
from orchestra._cli._app import app
from orchestra.stores import MemoryStore
from orchestra.stores._postgres import _worker as worker_module
from orchestra.stores._postgres._coordinator import acquire
from orchestra.stores._postgres._graph import admit
from orchestra.stores._postgres._schema import migrate
from orchestra.stores._postgres._server import embedded_server
from orchestra.stores._postgres._store import PostgresStore
from orchestra.stores._postgres._worker import PostgresWorkerBackend
from tests.helpers import REPO, spawn

if TYPE_CHECKING:
    from collections.abc import Sequence

    from orchestra.stores._worker import WorkReport

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.subprocess,
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals"),
]

KINDS = ["work", "split", "sum", "flaky", "bad", "slow", "poison"]
ENDED = ("succeeded", "failed", "cancelled", "skipped")


async def open_run(conn: asyncpg.Connection, run_id: str, tasks: Sequence[Task]) -> None:
    """`run_id` as its coordinator makes it: its row (held by "coordinator"), then its tasks."""
    assert await acquire(conn, run_id, owner="coordinator", lease=3600) is not None
    await admit(conn, run_id, tasks, admission=Admission(KINDS, {}))


async def close_run(conn: asyncpg.Connection, run_id: str) -> None:
    await conn.execute("UPDATE orchestra.runs SET state = 'closed' WHERE id = $1", run_id)


async def until_ended(
    conn: asyncpg.Connection, run_id: str, n: int, within: float = 30.0
) -> dict[str, asyncpg.Record]:
    """Wait until `n` tasks of `run_id` ended; its tasks' rows, by id."""
    with anyio.fail_after(within):
        while True:
            ended = await conn.fetchval(
                "SELECT count(*) FROM orchestra.tasks WHERE run_id = $1 AND state = ANY ($2)",
                run_id, list(ENDED),
            )  # fmt: skip
            if ended >= n:
                break
            await anyio.sleep(0.05)
    rows = await conn.fetch("SELECT * FROM orchestra.tasks WHERE run_id = $1", run_id)
    return {row["id"]: row for row in rows}


async def attempts_of(conn: asyncpg.Connection, run_id: str) -> dict[str, list[tuple[int, str]]]:
    """The failed attempts of `run_id`'s tasks, (number, error type) in order, by task id."""
    found: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)
    for row in await conn.fetch(
        "SELECT task_id, number, error_type FROM orchestra.attempts WHERE run_id = $1 "
        "ORDER BY task_id, number",
        run_id,
    ):
        found[row["task_id"]].append((row["number"], row["error_type"]))
    return found


async def until(condition: Any, within: float = 20.0) -> None:
    """Wait until `condition()` (awaited when it is a coroutine) is true."""
    with anyio.fail_after(within):
        while True:
            held = condition()
            if not isinstance(held, bool):
                held = await held
            if held:
                return
            await anyio.sleep(0.02)


@agent(kinds=["work", "split", "sum"])
async def runner(task: Task, ctx: Context) -> Any:
    if task.kind == "split":
        ctx.spawn(Task("work", 5, id=f"{task.id}.five"))
        ctx.spawn(Task("work", 6))  # no id: the database names it after its spawner
        return "split"
    if task.kind == "sum":
        return sorted(ctx.deps.items())
    return task.payload * 2


class Work:
    """`orch.work(...)` in the background of a test, on a store of its own."""

    def __init__(self, orch: Orchestrator, dsn: str, **work: Any) -> None:
        self.orch = orch
        self.store = PostgresStore(dsn, lease=work.pop("lease", 30.0), poll=work.pop("poll", 0.1))
        self.work = work
        self.report: WorkReport | None = None

    async def __call__(self) -> None:
        try:
            self.report = await self.orch.work(self.store, **self.work)
        finally:
            self.store.close()


def value(row: asyncpg.Record) -> Any:
    return None if row["output"] is None else json.loads(row["output"])


class TestInOneProcess:
    async def test_a_worker_runs_a_runs_tasks_readies_their_dependents_and_admits_their_spawns(
        self, pg_dsn: str, pg_conn: asyncpg.Connection
    ) -> None:
        await open_run(pg_conn, "r", [
            Task("work", 1, id="a"), Task("work", 2, id="b"),
            Task("sum", None, id="c", depends_on=["a", "b"]), Task("split", None, id="p"),
        ])  # fmt: skip
        work = Work(Orchestrator(agents=[runner]), pg_dsn, run_id="r")
        async with anyio.create_task_group() as tg:
            tg.start_soon(work)
            rows = await until_ended(pg_conn, "r", 6)
            await close_run(pg_conn, "r")
        assert {i: (r["state"], value(r)) for i, r in rows.items()} == {
            "a": ("succeeded", 2),
            "b": ("succeeded", 4),
            "c": ("succeeded", [["a", 2], ["b", 4]]),  # readied by the worker's completions
            "p": ("succeeded", "split"),
            "p.five": ("succeeded", 10),
            "p/work#2": ("succeeded", 12),  # named as the engine names it, after its spawner
        }
        assert rows["p/work#2"]["parent"] == rows["p.five"]["parent"] == "p"
        assert {r["agent"] for r in rows.values()} == {"runner"}
        assert {i: (r["attempts"], r["lease_owner"]) for i, r in rows.items()} == dict.fromkeys(
            rows, (1, None)
        )
        # The coordinator follows what others ended: every end is in its feed, once.
        ended = await pg_conn.fetch(
            "SELECT unnest(ids) AS id FROM orchestra.ended WHERE run_id = 'r'"
        )
        assert sorted(r["id"] for r in ended) == sorted(rows)
        assert work.report is not None
        assert (work.report.claimed, work.report.completed, work.report.refused) == (6, 6, 0)
        row = await pg_conn.fetchrow("SELECT * FROM orchestra.workers")
        assert row is not None
        assert row["owner"] == work.report.worker
        assert (row["claimed"], row["completed"], row["refused"]) == (6, 6, 0)
        assert row["gone"] is not None  # it said it stopped

    async def test_failed_attempts_are_recorded_and_a_task_retried_here_counts_them(
        self, pg_dsn: str, pg_conn: asyncpg.Connection
    ) -> None:
        @agent(kinds=["flaky", "bad"])
        async def fragile(task: Task, ctx: Context) -> Any:
            if task.kind == "bad":
                raise PermanentError("never")
            if ctx.attempt < 3:
                raise RetryableError(f"attempt {ctx.attempt} fails")
            return "third time"

        await open_run(pg_conn, "r", [Task("flaky", 0, id="f"), Task("bad", 0, id="x")])
        orch = Orchestrator(agents=[fragile], retry=RetryPolicy(max_attempts=3, base=0.01))
        async with anyio.create_task_group() as tg:
            tg.start_soon(Work(orch, pg_dsn, run_id="r"))
            rows = await until_ended(pg_conn, "r", 2)
            await close_run(pg_conn, "r")
        assert (rows["f"]["state"], value(rows["f"]), rows["f"]["attempts"]) == (
            "succeeded", "third time", 3,
        )  # fmt: skip
        assert (rows["x"]["state"], rows["x"]["error_type"], rows["x"]["attempts"]) == (
            "failed", "PermanentError", 1,
        )  # fmt: skip
        attempts = await attempts_of(pg_conn, "r")
        assert attempts["f"] == [(1, "RetryableError"), (2, "RetryableError")]
        assert attempts["x"] == [(1, "PermanentError")]

    async def test_a_spawn_the_run_refuses_fails_its_spawner_and_nothing_else(
        self, pg_dsn: str, pg_conn: asyncpg.Connection
    ) -> None:
        @agent(kinds=["split", "work"])
        async def clashing(task: Task, ctx: Context) -> Any:
            if task.kind == "split":
                ctx.spawn(Task("work", 1, id="a"))  # the run has an "a" already
            return task.payload

        await open_run(pg_conn, "r", [Task("work", 1, id="a"), Task("split", 2, id="p")])
        async with anyio.create_task_group() as tg:
            tg.start_soon(Work(Orchestrator(agents=[clashing]), pg_dsn, run_id="r"))
            rows = await until_ended(pg_conn, "r", 2)
            await close_run(pg_conn, "r")
        assert set(rows) == {"a", "p"}
        assert (rows["a"]["state"], value(rows["a"])) == ("succeeded", 1)
        assert (rows["p"]["state"], rows["p"]["error_type"]) == ("failed", "InputError")
        assert "spawned (on a worker) were refused" in rows["p"]["error"]
        assert "'a'" in rows["p"]["error"]

    async def test_a_worker_serving_every_run_is_woken_by_work_in_a_new_run(
        self, pg_dsn: str, pg_conn: asyncpg.Connection
    ) -> None:
        # Its poll is longer than the test's patience: only a notification can wake it.
        work = Work(Orchestrator(agents=[runner]), pg_dsn, poll=60.0)
        await open_run(pg_conn, "first", [Task("work", 1, id="a")])
        async with anyio.create_task_group() as tg:
            tg.start_soon(work)
            await until_ended(pg_conn, "first", 1)  # it claimed once, found nothing more: idle
            await anyio.sleep(0.2)
            await open_run(pg_conn, "second", [Task("work", 2, id="a"), Task("work", 3, id="b")])
            rows = await until_ended(pg_conn, "second", 2, within=20)
            tg.cancel_scope.cancel()
        assert {i: value(r) for i, r in rows.items()} == {"a": 4, "b": 6}

    async def test_a_lease_lost_to_another_process_cancels_its_attempt_counted_lost(
        self, pg_dsn: str, pg_conn: asyncpg.Connection
    ) -> None:
        started = anyio.Event()
        cancelled: list[str] = []

        @agent(kinds=["slow"])
        async def waits(task: Task, ctx: Context) -> Any:
            started.set()
            try:
                await anyio.sleep(3600)
            except BaseException:
                cancelled.append(task.id)
                raise

        await open_run(pg_conn, "r", [Task("slow", 0, id="s")])
        work = Work(Orchestrator(agents=[waits]), pg_dsn, run_id="r", lease=0.6)
        async with anyio.create_task_group() as tg:
            tg.start_soon(work)
            await started.wait()
            # Another process holds it now (as after a take-back and a claim): a newer token.
            await pg_conn.execute(
                "UPDATE orchestra.tasks SET lease_owner = 'other', "
                "token = nextval('orchestra.lease_tokens') WHERE id = 's'"
            )
            await until(lambda: cancelled == ["s"], 10)  # its next heartbeat heard it
            await pg_conn.execute(
                "UPDATE orchestra.tasks SET state = 'succeeded', lease_owner = NULL WHERE id = 's'"
            )
            await close_run(pg_conn, "r")
        assert work.report is not None
        assert (work.report.lost, work.report.completed, work.report.refused) == (1, 0, 0)
        counted = await pg_conn.fetchrow(
            "SELECT claimed, completed, refused FROM orchestra.workers"
        )
        assert counted is not None
        assert tuple(counted) == (1, 0, 0)  # as its report says
        # Its cancelled end was not written over the other process's task.
        row = await pg_conn.fetchrow("SELECT state, error_type FROM orchestra.tasks")
        assert row is not None
        assert tuple(row) == ("succeeded", None)

    async def test_a_cancelled_worker_hands_back_what_it_holds_uncounted(
        self, pg_dsn: str, pg_conn: asyncpg.Connection
    ) -> None:
        started: list[str] = []

        @agent(kinds=["slow"], concurrency=2)
        async def waits(task: Task, ctx: Context) -> Any:
            started.append(task.id)
            await anyio.sleep(3600)

        await open_run(pg_conn, "r", [Task("slow", i, id=f"s{i}") for i in range(3)])
        work = Work(Orchestrator(agents=[waits]), pg_dsn, run_id="r")
        async with anyio.create_task_group() as tg:
            tg.start_soon(work)
            await until(lambda: len(started) == 2)  # as many as its agent can start
            tg.cancel_scope.cancel()
        rows = await pg_conn.fetch("SELECT id, state, attempts, lease_owner FROM orchestra.tasks")
        assert sorted(tuple(r) for r in rows) == [(f"s{i}", "ready", 0, None) for i in range(3)]
        assert await attempts_of(pg_conn, "r") == {}
        gone = await pg_conn.fetchval("SELECT gone IS NOT NULL FROM orchestra.workers")
        assert gone

    async def test_a_store_that_is_not_shared_is_a_config_error_naming_both(self) -> None:
        orch = Orchestrator(agents=[runner])
        with pytest.raises(ConfigError, match=r"needs a SQLiteStore .* or a PostgresStore"):
            await orch.work(MemoryStore())  # type: ignore[arg-type]

    def test_the_command_takes_exactly_one_of_a_file_and_a_database(self, tmp_path: Path) -> None:
        runner_ = CliRunner()
        agents = ["--agents", "tests/pg_work_job.py:agents"]
        for given in ([], ["--db", str(tmp_path / "x.db"), "--dsn", "postgresql://h/db"]):
            done = runner_.invoke(app, ["worker", *agents, *given])
            assert done.exit_code == 2, done.output
            assert "exactly one of --db" in done.output


# -- real processes --------------------------------------------------------------------------------


def start_worker(
    dsn: str,
    calls: Path,
    *,
    run_id: str | None = "r",
    lease: float = 30.0,
    delay: float = 0.0,
    shift: float = 0.0,
    kinds: str | None = None,
) -> subprocess.Popen[str]:
    """``orchestra worker --dsn DSN`` with tests/pg_work_job.py's agents."""
    env = {
        **os.environ,
        "WORKER_CALLS": str(calls),
        "WORKER_DELAY": str(delay),
        "WORKER_CLOCK_SHIFT": str(shift),
        "PYTHONPATH": str(REPO),
    }
    args = ["--dsn", dsn, "--agents", "tests/pg_work_job.py:agents", "--lease", str(lease)]
    if kinds is not None:
        args += ["--kinds", kinds]
    if run_id is not None:
        args += ["--run-id", run_id]
    return spawn(
        [sys.executable, str(REPO / "tests" / "pg_work_job.py"), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def ran(calls: Path) -> list[tuple[str, int]]:
    """The calls the workers' agents made, in order: (task id, pid)."""
    if not calls.exists():
        return []
    return [(t, int(p)) for t, p in (line.split() for line in calls.read_text().splitlines())]


async def wait_all(workers: list[subprocess.Popen[str]]) -> list[str]:
    """Each worker's stderr, once it exited."""
    errs = []
    for worker in workers:
        _, err = await anyio.to_thread.run_sync(functools.partial(worker.communicate, timeout=60))
        errs.append(err)
    return errs


async def live_workers(conn: asyncpg.Connection) -> int:
    n: int = await conn.fetchval("SELECT count(*) FROM orchestra.workers WHERE gone IS NULL")
    return n


class _Output(dict[str, int]):
    """An agent's output the test can count while it is alive (a dict cannot be weakly held)."""

    __hash__ = object.__hash__  # type: ignore[assignment]  # by identity: a WeakSet holds it


class TestAWorkerThatRunsForDays:
    async def test_keeps_no_output_of_the_tasks_it_ended(
        self, pg_dsn: str, pg_conn: asyncpg.Connection
    ) -> None:
        # Its results go to the database as they end; a worker that also folded them into its
        # local run's aggregate (by default every output, by task id) grew with every task.
        alive: weakref.WeakSet[_Output] = weakref.WeakSet()

        @agent(kinds=["work"])
        async def counted(task: Task, ctx: Context) -> _Output:
            out = _Output(n=task.payload)
            alive.add(out)
            return out

        n = 600
        await open_run(pg_conn, "r", [Task("work", i, id=f"t{i}") for i in range(n)])
        work = Work(Orchestrator(agents=[counted]), pg_dsn, run_id="r")
        async with anyio.create_task_group() as tg:
            tg.start_soon(work)
            rows = await until_ended(pg_conn, "r", n)
            # Every task ended, the worker still serving the run: what it holds of them now.
            # (A few may wait in its writer's last batch.)
            gc.collect()
            kept = len(alive)
            await close_run(pg_conn, "r")
        assert {row["state"] for row in rows.values()} == {"succeeded"}
        assert kept < 100, f"the worker keeps {kept} outputs of the {n} tasks it ended"

    async def test_keeps_no_record_of_the_tasks_that_failed_on_it(
        self, pg_dsn: str, pg_conn: asyncpg.Connection
    ) -> None:
        # Their ends go to the database as they end; a worker that also kept each one for a
        # `RunResult.errors` it never builds grew with every failure.
        from orchestra._record import Record

        @agent(kinds=["work"])
        async def broken(task: Task, ctx: Context) -> None:
            raise PermanentError(f"task {task.id}: no such clause")

        n = 600
        await open_run(pg_conn, "r", [Task("work", i, id=f"t{i}") for i in range(n)])
        work = Work(Orchestrator(agents=[broken]), pg_dsn, run_id="r")
        async with anyio.create_task_group() as tg:
            tg.start_soon(work)
            rows = await until_ended(pg_conn, "r", n)
            gc.collect()
            kept = sum(isinstance(o, Record) for o in gc.get_objects())
            await close_run(pg_conn, "r")
        assert {row["state"] for row in rows.values()} == {"failed"}
        assert kept < 100, f"the worker keeps {kept} records of the {n} tasks that failed on it"


class TestGroupCommits:
    async def test_tasks_of_one_claim_that_end_together_are_written_in_one_commit(
        self, pg_dsn: str, pg_conn: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        batches: list[int] = []
        complete = PostgresWorkerBackend.complete_and_claim  # (`complete` calls it too)

        async def counted(self: PostgresWorkerBackend, name: str, *args: Any) -> list[bool]:
            batches.append(len(args[1]))  # (wall0, rows, failed, ...): the ends written
            return await complete(self, name, *args)

        monkeypatch.setattr(PostgresWorkerBackend, "complete_and_claim", counted)
        await open_run(pg_conn, "r", [Task("work", i, id=f"t{i}") for i in range(50)])
        work = Work(Orchestrator(agents=[runner], concurrency=50), pg_dsn, run_id="r")
        async with anyio.create_task_group() as tg:
            tg.start_soon(work)
            await until_ended(pg_conn, "r", 50)
            await close_run(pg_conn, "r")
        assert work.report is not None
        assert work.report.claimed == 50
        assert batches == [50]

    async def test_the_room_their_ends_give_back_is_claimed_in_their_commit_and_no_more(
        self, pg_dsn: str, pg_conn: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        by_claim: list[int] = []
        by_write: list[int] = []
        leased: list[int] = []  # the worker's leases after each commit of its ends
        claim = PostgresWorkerBackend.claim
        complete: Any = PostgresWorkerBackend.complete_and_claim
        watch = await asyncpg.connect(pg_dsn)

        async def claimed(self: PostgresWorkerBackend, *args: Any) -> tuple[list[Any], bool]:
            batch, over = await claim(self, *args)
            by_claim.append(len(batch))
            return batch, over

        async def completed(self: PostgresWorkerBackend, name: str, *args: Any) -> list[bool]:
            *rest, taken = args

            def counted(batch: list[Any]) -> None:
                by_write.append(len(batch))
                taken(batch)

            accepted: list[bool] = await complete(self, name, *rest, counted)
            leased.append(await watch.fetchval(
                "SELECT count(*) FROM orchestra.tasks WHERE lease_owner = $1", name
            ))  # fmt: skip
            return accepted

        monkeypatch.setattr(PostgresWorkerBackend, "claim", claimed)
        monkeypatch.setattr(PostgresWorkerBackend, "complete_and_claim", completed)
        await open_run(pg_conn, "r", [Task("work", i, id=f"t{i}") for i in range(30)])
        work = Work(Orchestrator(agents=[runner], concurrency=10), pg_dsn, run_id="r")
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(work)
                rows = await until_ended(pg_conn, "r", 30)
                await close_run(pg_conn, "r")
        finally:
            await watch.close()
        assert work.report is not None
        assert (work.report.claimed, work.report.completed) == (30, 30)
        assert sum(by_claim) + sum(by_write) == 30
        assert sum(by_write) >= 10, (by_claim, by_write)
        assert max(leased) <= 10, leased
        assert {(row["state"], row["attempts"]) for row in rows.values()} == {("succeeded", 1)}


class TestTheWorkersConnections:
    async def test_its_claims_and_completions_run_on_its_own_loop_not_the_stores_thread(
        self, pg_dsn: str, pg_conn: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        threads: dict[str, set[int]] = collections.defaultdict(set)
        for job in ("_claim", "_complete"):
            original = getattr(worker_module, job)

            async def seen(*args: Any, _job: str = job, _original: Any = original) -> Any:
                threads[_job].add(threading.get_ident())
                return await _original(*args)

            monkeypatch.setattr(worker_module, job, seen)
        await open_run(pg_conn, "r", [Task("work", i, id=f"t{i}") for i in range(20)])
        work = Work(Orchestrator(agents=[runner], concurrency=5), pg_dsn, run_id="r")
        async with anyio.create_task_group() as tg:
            tg.start_soon(work)
            rows = await until_ended(pg_conn, "r", 20)
            await close_run(pg_conn, "r")
        assert {value(row) for row in rows.values()} == {2 * i for i in range(20)}
        assert threads == {"_claim": {threading.get_ident()}, "_complete": {threading.get_ident()}}


class TestWorkerProcesses:
    async def test_three_workers_run_3000_tasks_each_exactly_once(
        self, pg_dsn: str, pg_conn: asyncpg.Connection, tmp_path: Path
    ) -> None:
        calls = tmp_path / "calls"
        workers = [start_worker(pg_dsn, calls) for _ in range(3)]
        try:
            # All three listen before there is work: each takes part.
            await until(lambda: _equals(live_workers(pg_conn), 3), 30)
            await open_run(pg_conn, "r", [Task("work", i, id=f"t{i}") for i in range(3000)])
            rows = await until_ended(pg_conn, "r", 3000, within=90)
            await close_run(pg_conn, "r")
        finally:
            errs = await wait_all(workers)
        assert [w.returncode for w in workers] == [0, 0, 0], errs
        assert {r["state"] for r in rows.values()} == {"succeeded"}
        assert sorted(value(r) for r in rows.values()) == [2 * i for i in range(3000)]
        assert {r["attempts"] for r in rows.values()} == {1}
        executed = ran(calls)
        assert len(executed) == 3000  # no task twice: no claim was doubled
        assert {t for t, _ in executed} == set(rows)
        by_pid = collections.Counter(p for _, p in executed)
        assert set(by_pid) == {w.pid for w in workers}, by_pid
        assert not await pg_conn.fetchval(
            "SELECT count(*) FROM orchestra.events WHERE event = 'refused'"
        )
        ended = await pg_conn.fetchval("SELECT sum(cardinality(ids)) FROM orchestra.ended")
        assert (
            ended
            == 3000
            == await pg_conn.fetchval(
                "SELECT count(DISTINCT id) FROM orchestra.ended, unnest(ids) AS id"
            )
        )
        for err in errs:
            assert "0 refused, 0 lost" in err
        counted = await pg_conn.fetch("SELECT claimed, completed, refused FROM orchestra.workers")
        assert sum(r["completed"] for r in counted) == 3000
        assert sum(r["claimed"] for r in counted) == 3000
        assert {r["refused"] for r in counted} == {0}

    async def test_a_killed_workers_leases_are_taken_back_and_its_tasks_finished_elsewhere(
        self, pg_dsn: str, pg_conn: asyncpg.Connection, tmp_path: Path
    ) -> None:
        calls = tmp_path / "calls"
        victim = start_worker(pg_dsn, calls, lease=1.0, delay=0.05)
        survivor = start_worker(pg_dsn, calls, lease=1.0, delay=0.05)
        try:
            await until(lambda: _equals(live_workers(pg_conn), 2), 30)
            await open_run(pg_conn, "r", [Task("work", i, id=f"t{i}") for i in range(200)])
            await until(lambda: sum(p == victim.pid for _, p in ran(calls)) >= 20, 30)
            victim.send_signal(signal.SIGKILL)
            rows = await until_ended(pg_conn, "r", 200, within=60)
            await close_run(pg_conn, "r")
        finally:
            await wait_all([victim, survivor])
        assert survivor.returncode == 0
        assert {r["state"] for r in rows.values()} == {"succeeded"}
        by_task = collections.defaultdict(list)
        for task_id, pid in ran(calls):
            by_task[task_id].append(pid)
        again = {t for t, pids in by_task.items() if len(pids) > 1}
        assert again, "the victim held tasks when it was killed"
        for task_id in again:
            assert by_task[task_id] == [victim.pid, survivor.pid]
        # What it held (running, or claimed and not started yet) was taken back and run again by
        # the survivor, the lost attempt counted.
        attempts = await attempts_of(pg_conn, "r")
        assert again <= set(attempts)
        for task_id, failed in attempts.items():
            assert failed == [(1, "LeaseExpired")]
            assert rows[task_id]["attempts"] == 2
        taken = await pg_conn.fetch(
            "SELECT task_id FROM orchestra.events WHERE event = 'lease_expired'"
        )
        assert {r["task_id"] for r in taken} == set(attempts)

    async def test_a_worker_paused_past_its_lease_has_its_late_completions_refused(
        self, pg_dsn: str, pg_conn: asyncpg.Connection, tmp_path: Path
    ) -> None:
        calls = tmp_path / "calls"
        sleeper = start_worker(pg_dsn, calls, lease=1.0, delay=0.5)
        other: subprocess.Popen[str] | None = None
        try:
            await until(lambda: _equals(live_workers(pg_conn), 1), 30)
            await open_run(pg_conn, "r", [Task("work", i, id=f"t{i}") for i in range(4)])
            await until(lambda: len(ran(calls)) == 4)  # it holds all four, mid-call
            sleeper.send_signal(signal.SIGSTOP)
            await anyio.sleep(2.0)  # past its lease
            other = start_worker(pg_dsn, calls, lease=1.0)
            rows = await until_ended(pg_conn, "r", 4, within=30)  # taken back, run there
            sleeper.send_signal(signal.SIGCONT)  # it wakes and completes: too late
            await until(
                lambda: _equals(
                    pg_conn.fetchval(
                        "SELECT count(*) FROM orchestra.events WHERE event = 'refused'"
                    ),
                    4,
                )
            )
            await close_run(pg_conn, "r")
        finally:
            sleeper.send_signal(signal.SIGCONT)
            sleeper_err, other_err = await wait_all(
                [sleeper] if other is None else [sleeper, other]
            )
        assert {r["state"] for r in rows.values()} == {"succeeded"}
        assert {r["attempts"] for r in rows.values()} == {2}
        attempts = await attempts_of(pg_conn, "r")
        assert attempts == {task_id: [(1, "LeaseExpired")] for task_id in rows}
        refused = await pg_conn.fetch(
            "SELECT task_id FROM orchestra.events WHERE event = 'refused' ORDER BY task_id"
        )
        assert [r["task_id"] for r in refused] == ["t0", "t1", "t2", "t3"]
        assert "0 completed, 4 refused" in sleeper_err
        assert "4 completed, 0 refused" in other_err
        found = re.search(r"worker (\S+): \d+ claimed", sleeper_err)
        assert found is not None, sleeper_err
        counted = await pg_conn.fetchval(
            "SELECT refused FROM orchestra.workers WHERE owner = $1", found[1]
        )
        assert counted == 4  # the workers table says so too

    async def test_sigterm_drains_running_attempts_finish_and_the_rest_is_handed_back(
        self, pg_dsn: str, pg_conn: asyncpg.Connection, tmp_path: Path
    ) -> None:
        calls = tmp_path / "calls"
        worker = start_worker(pg_dsn, calls)
        try:
            await until(lambda: _equals(live_workers(pg_conn), 1), 30)
            await open_run(pg_conn, "r", [Task("slow", "done", id="s"), Task("flaky", 0, id="f")])
            # "s" runs (1.5 s), "f" failed once and waits a minute for its retry, held.
            await until(lambda: {t for t, _ in ran(calls)} == {"s", "f"})
            await until(lambda: attempts_of(pg_conn, "r"))
            worker.send_signal(signal.SIGTERM)
            await anyio.sleep(0.3)  # it claims no more: a task that comes now stays ready
            await admit(
                pg_conn, "r", [Task("slow", "late", id="late")], admission=Admission(KINDS, {})
            )
        finally:
            (err,) = await wait_all([worker])
        assert worker.returncode == 0, err
        rows = await until_ended(pg_conn, "r", 0)
        assert (rows["s"]["state"], value(rows["s"])) == ("succeeded", "done")  # finished in grace
        f = rows["f"]
        assert (f["state"], f["lease_owner"]) == ("ready", None)  # handed back: ready at once
        assert f["attempts"] == 1  # its failed attempt counted, its retry not
        assert (await attempts_of(pg_conn, "r"))["f"] == [(1, "RetryableError")]
        assert (rows["late"]["state"], rows["late"]["attempts"]) == ("ready", 0)
        assert "1 completed, 0 refused, 0 lost, 1 handed back" in err
        assert sorted(t for t, _ in ran(calls)) == ["f", "s"]  # nothing ran after the signal

    async def test_a_worker_whose_clock_is_ten_minutes_off_works_normally(
        self, pg_dsn: str, pg_conn: asyncpg.Connection, tmp_path: Path
    ) -> None:
        calls = tmp_path / "calls"
        worker = start_worker(pg_dsn, calls, lease=2.0, delay=0.02, shift=600.0)
        try:
            await until(lambda: _equals(live_workers(pg_conn), 1), 30)
            await open_run(pg_conn, "r", [
                *(Task("work", i, id=f"t{i}") for i in range(50)),
                Task("work", 1, id="after", depends_on=[f"t{i}" for i in range(50)]),
            ])  # fmt: skip
            rows = await until_ended(pg_conn, "r", 51, within=60)
            await anyio.sleep(2.5)  # more than a lease: leases it holds stay its own
            await close_run(pg_conn, "r")
        finally:
            (err,) = await wait_all([worker])
        assert worker.returncode == 0, err
        assert {r["state"] for r in rows.values()} == {"succeeded"}
        assert {r["attempts"] for r in rows.values()} == {1}
        assert await attempts_of(pg_conn, "r") == {}  # no lease ran out early
        assert "0 refused, 0 lost" in err
        # Its times are the database's: it measured the difference when it joined.
        skew = await pg_conn.fetchval(
            "SELECT max(abs(extract(epoch FROM started - admitted))) FROM orchestra.tasks"
        )
        assert skew < 60


async def _equals(value: Any, expected: Any) -> bool:
    return bool(await value == expected)


class TestADatabaseRestart:
    async def test_a_restart_that_cuts_off_a_write_loses_nothing_and_records_each_end_once(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # A write claims the next tasks and hands them over before it commits: the server stops
        # there, the commit fails, and the tasks started run unleased (their ends refused) while
        # the write runs again on a new connection once the server is back.
        with tempfile.TemporaryDirectory() as parent:
            os.chmod(parent, 0o755)  # reachable by the server's user when root
            directory = Path(parent) / "data"
            server = embedded_server(directory, durable=True)
            port = server.port
            calls: collections.Counter[str] = collections.Counter()
            stopped = anyio.Event()
            writes: list[int] = []  # the tasks each write handed over
            cut_off: list[int] = []  # how many the write cut off handed over
            complete: Any = PostgresWorkerBackend.complete_and_claim

            async def cut(self: PostgresWorkerBackend, name: str, *args: Any) -> list[bool]:
                *rest, taken = args

                def handed(batch: list[Any]) -> None:
                    taken(batch)
                    writes.append(len(batch))
                    if len(writes) >= 5 and batch and not stopped.is_set():
                        server.stop()  # (blocking: the transaction is open, its commit next)
                        cut_off.append(len(batch))
                        stopped.set()

                accepted: list[bool] = await complete(self, name, *rest, handed)
                return accepted

            monkeypatch.setattr(PostgresWorkerBackend, "complete_and_claim", cut)

            @agent(kinds=["work"], concurrency=20)
            async def slow(task: Task, ctx: Context) -> int:
                calls[task.id] += 1
                await anyio.sleep(0.005)
                return int(task.payload)

            try:
                conn = await asyncpg.connect(server.dsn)
                try:
                    await migrate(conn)
                    await open_run(conn, "r", [Task("work", i, id=f"t{i}") for i in range(300)])
                finally:
                    await conn.close()
                work = Work(Orchestrator(agents=[slow]), server.dsn, run_id="r", lease=10)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(work)
                    await stopped.wait()
                    await anyio.sleep(0.5)
                    server = await anyio.to_thread.run_sync(
                        lambda: embedded_server(directory, durable=True, port=port)
                    )
                    conn = await asyncpg.connect(server.dsn)
                    try:
                        rows = await until_ended(conn, "r", 300, within=60)
                        await close_run(conn, "r")
                    finally:
                        await conn.close()
                assert {(row["state"], value(row)) for row in rows.values()} == {
                    ("succeeded", int(task_id[1:])) for task_id in rows
                }
                assert set(calls) == set(rows)
                report = work.report
                assert report is not None
                assert report.completed == 300
                # The tasks handed over by the write cut off ran twice, the first end refused.
                assert report.refused == cut_off[0] == sum(calls.values()) - 300
            finally:
                server.stop()


class TestAPoisonTask:
    async def test_a_task_that_kills_every_worker_it_reaches_fails_to_the_dead_letters(
        self, pg_dsn: str, pg_conn: asyncpg.Connection, tmp_path: Path
    ) -> None:
        calls = tmp_path / "calls"
        # A worker that never takes the poison, and sweeps: the victims die one after another.
        sweeper = start_worker(pg_dsn, calls, lease=1.0, kinds="work")
        victims = [start_worker(pg_dsn, calls, lease=1.0, kinds="poison") for _ in range(4)]
        try:
            await until(lambda: _equals(live_workers(pg_conn), 5), 30)
            await open_run(pg_conn, "r", [Task("poison", 0, id="p"), Task("work", 1, id="w")])
            rows = await until_ended(pg_conn, "r", 2, within=60)
            await close_run(pg_conn, "r")
        finally:
            await wait_all([sweeper, *victims])
        assert rows["w"]["state"] == "succeeded"
        assert (rows["p"]["state"], rows["p"]["error_type"]) == ("failed", "LeaseExpired")
        killed = [v for v in victims if v.returncode == -signal.SIGKILL]
        assert len(killed) == 3  # three lost leases, then no fourth process was given it
        assert sorted(p for t, p in ran(calls) if t == "p") == sorted(v.pid for v in killed)
        assert (await attempts_of(pg_conn, "r"))["p"] == [
            (1, "LeaseExpired"), (2, "LeaseExpired"), (3, "LeaseExpired"),
        ]  # fmt: skip
        dead = await pg_conn.fetch("SELECT task_id FROM orchestra.dead_letters WHERE run_id = 'r'")
        assert [r["task_id"] for r in dead] == ["p"]
