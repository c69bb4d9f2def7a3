"""Runs on PostgreSQL end to end: `Orchestrator(store=PostgresStore(dsn))` on the session's real
server, with real agents — what the coordinator's run (`_postgres/_run.py`) writes, claims and
hears, checked against the database's rows."""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import asyncpg
import pytest

from orchestra import (
    Context,
    Discard,
    Orchestrator,
    PermanentError,
    RetryableError,
    RetryPolicy,
    RunResult,
    Task,
    agent,
)
from orchestra.stores._postgres._server import embedded_server
from orchestra.stores._postgres._store import PostgresStore
from tests.helpers import REPO, spawn
from tests.test_cli import JOB as CLI_JOB
from tests.test_cli import invoke, lines_of

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

pytestmark = [pytest.mark.subprocess, pytest.mark.postgres]


@pytest.fixture
async def store(pg_dsn: str) -> AsyncIterator[PostgresStore]:
    store = PostgresStore(pg_dsn, poll=0.2)
    yield store
    store.close()


async def states(dsn: str, run_id: str) -> dict[str, str]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT id, state FROM orchestra.tasks WHERE run_id = $1", run_id)
    finally:
        await conn.close()
    return {row["id"]: row["state"] for row in rows}


async def attempts_of(dsn: str, run_id: str) -> dict[str, int]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT id, attempts FROM orchestra.tasks WHERE run_id=$1", run_id)
    finally:
        await conn.close()
    return {row["id"]: row["attempts"] for row in rows}


@agent(kinds=["work"])
async def double(task: Task, ctx: Context) -> int:
    return int(task.payload["n"]) * 2


@agent(kinds=["sum"])
async def add(task: Task, ctx: Context) -> int:
    return sum(int(v) for v in ctx.deps.values())


@agent(kinds=["split"])
async def split(task: Task, ctx: Context) -> str:
    for i in range(int(task.payload["n"])):
        ctx.spawn(Task("work", {"n": i}))
    return "split"


class TestARun:
    async def test_every_task_runs_once_and_the_database_says_so(
        self, store: PostgresStore, pg_dsn: str
    ) -> None:
        tasks = [Task("work", {"n": i}, id=f"w{i}") for i in range(300)]
        tasks.append(Task("sum", {}, id="total", depends_on=[f"w{i}" for i in range(10)]))
        async with Orchestrator(agents=[double, add], store=store) as orch:
            result = await orch.run(tasks, run_id="r1")
        assert result.status == "success", result.errors
        assert result.data["total"] == sum(2 * i for i in range(10))
        assert result.metadata.counts["succeeded"] == 301
        assert set((await states(pg_dsn, "r1")).values()) == {"succeeded"}

    async def test_spawned_tasks_are_admitted_and_run(
        self, store: PostgresStore, pg_dsn: str
    ) -> None:
        async with Orchestrator(agents=[double, split], store=store) as orch:
            result = await orch.run([Task("split", {"n": 5}, id="s")], run_id="r2")
        assert result.status == "success", result.errors
        found = await states(pg_dsn, "r2")
        assert len(found) == 6
        assert set(found.values()) == {"succeeded"}

    async def test_failed_attempts_are_written_and_a_task_that_fails_for_good_fails(
        self, store: PostgresStore, pg_dsn: str
    ) -> None:
        calls: dict[str, int] = {}

        @agent(kinds=["flaky"], retry=RetryPolicy(max_attempts=3, base=0.01, jitter="none"))
        async def flaky(task: Task, ctx: Context) -> str:
            calls[task.id] = calls.get(task.id, 0) + 1
            if task.payload["bad"]:
                raise PermanentError("never")
            if calls[task.id] < 3:
                raise ConnectionError("dropped")
            return "ok"

        async with Orchestrator(agents=[flaky], store=store) as orch:
            result = await orch.run(
                [Task("flaky", {"bad": False}, id="f"), Task("flaky", {"bad": True}, id="b")],
                run_id="r3",
            )
        assert result.data == {"f": "ok"}
        assert calls == {"f": 3, "b": 1}
        conn = await asyncpg.connect(pg_dsn)
        try:
            rows = await conn.fetch(
                "SELECT task_id, number, error_type FROM orchestra.attempts ORDER BY 1, 2"
            )
            task = await conn.fetchrow("SELECT attempts, state FROM orchestra.tasks WHERE id = 'f'")
        finally:
            await conn.close()
        assert [tuple(r) for r in rows] == [
            ("b", 1, "PermanentError"), ("f", 1, "ConnectionError"), ("f", 2, "ConnectionError"),
        ]  # fmt: skip
        assert task is not None
        assert (task["attempts"], task["state"]) == (3, "succeeded")
        assert (await states(pg_dsn, "r3"))["b"] == "failed"

    async def test_a_cancel_is_written_and_its_dependents_skipped(
        self, store: PostgresStore, pg_dsn: str
    ) -> None:
        gate = anyio.Event()

        @agent(kinds=["slow"])
        async def slow(task: Task, ctx: Context) -> str:
            await gate.wait()
            return "done"

        async with Orchestrator(agents=[slow, add], store=store, concurrency=1) as orch:
            handle = orch.start(
                [
                    Task("slow", {}, id="a"),
                    Task("slow", {}, id="b", priority=5),
                    Task("sum", {}, id="after", depends_on=["b"]),
                ],
                run_id="r4",
            )
            await anyio.sleep(0.3)
            handle.cancel(task_id=["b"])
            gate.set()
            result = await handle
        assert result.data == {"a": "done"}
        found = await states(pg_dsn, "r4")
        assert found == {"a": "succeeded", "b": "cancelled", "after": "skipped"}

    async def test_the_run_is_closed_and_given_up_at_its_end(
        self, store: PostgresStore, pg_dsn: str
    ) -> None:
        async with Orchestrator(agents=[double], store=store) as orch:
            await orch.run([Task("work", {"n": 1}, id="x")], run_id="r5")
        conn = await asyncpg.connect(pg_dsn)
        try:
            run: Any = await conn.fetchrow("SELECT state, owner FROM orchestra.runs WHERE id='r5'")
        finally:
            await conn.close()
        assert (run["state"], run["owner"]) == ("closed", None)

    async def test_a_refused_input_lets_go_of_its_run_which_then_runs_corrected(
        self, store: PostgresStore, pg_dsn: str
    ) -> None:
        # Refused before anything ran: the run's lease is let go of at once (not renewed on),
        # so the same id, its input corrected, runs now rather than a lease later.
        from orchestra import InputError

        async with Orchestrator(agents=[double], store=store) as orch:
            with pytest.raises(InputError, match="no agent serves kind 'analyse'"):
                await orch.run([Task("analyse", {"n": 1}, id="x")], run_id="typo")
            conn = await asyncpg.connect(pg_dsn)
            try:
                owner = await conn.fetchval("SELECT owner FROM orchestra.runs WHERE id='typo'")
            finally:
                await conn.close()
            assert owner is None
            with anyio.fail_after(10):
                result = await orch.run([Task("work", {"n": 1}, id="x")], run_id="typo")
        assert (result.status, result.data) == ("success", {"x": 2})


JOB = REPO / "tests" / "durable_job.py"


def job(dsn: str, calls: Path, *options: str, run: str = "r") -> subprocess.CompletedProcess[str]:
    """Run tests/durable_job.py (run id `run`) on `dsn` to its end or to its kill."""
    return subprocess.run(
        [sys.executable, str(JOB), dsn, run, str(calls), *options],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
        check=False,
    )


async def committed(dsn: str) -> dict[str, tuple[str, int]]:
    """Each task's state and attempts, as another process reads them."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT id, state, attempts FROM orchestra.tasks WHERE run_id='r'")
    finally:
        await conn.close()
    return {row[0]: (row[1], row[2]) for row in rows}


EVERY_TASK = sorted({*(f"w{i}" for i in range(24)), "split", "total"} | {f"s{i}" for i in range(3)})


class TestPlannerStatistics:
    """A run's admission grows the tasks table long before autovacuum looks at it (a minute):
    the coordinator has it measured at once, or the planner plans the completions and the ended
    feed for an empty table (a scan of it all per batch)."""

    async def _measured(self, conn: asyncpg.Connection) -> float:
        rows: float = await conn.fetchval(
            "SELECT reltuples FROM pg_class WHERE oid = 'orchestra.tasks'::regclass"
        )
        return rows

    async def test_a_large_admission_has_the_table_measured(
        self, store: PostgresStore, pg_conn: asyncpg.Connection
    ) -> None:
        # Autovacuum off for the table: only the coordinator can have measured it.
        await pg_conn.execute("ALTER TABLE orchestra.tasks SET (autovacuum_enabled = false)")
        assert await self._measured(pg_conn) <= 0
        async with Orchestrator(agents=[double], store=store) as orch:
            result = await orch.run([Task("work", {"n": i}) for i in range(3_000)], run_id="big")
        assert result.status == "success", result.errors
        assert await self._measured(pg_conn) >= 3_000

    async def test_a_small_one_does_not(
        self, store: PostgresStore, pg_conn: asyncpg.Connection
    ) -> None:
        await pg_conn.execute("ALTER TABLE orchestra.tasks SET (autovacuum_enabled = false)")
        async with Orchestrator(agents=[double], store=store) as orch:
            result = await orch.run([Task("work", {"n": i}) for i in range(300)], run_id="small")
        assert result.status == "success", result.errors
        assert await self._measured(pg_conn) <= 0


class TestAStreamedRunInBoundedMemory:
    async def test_the_coordinator_lets_go_of_the_tasks_it_took_through_the_database(
        self, store: PostgresStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The coordinator's mirror of the run queues each task that becomes ready and takes it
        # out when the database hands it to a process (`discard`): its queue is never popped,
        # and it kept every task of a streamed run (1,000,000 of them: 700 MB).
        from orchestra._record import Record
        from orchestra.stores._queue import ReadyQueue

        monkeypatch.setattr(ReadyQueue, "SWEEP", 64)  # the sweep's floor, at a test's size
        n, window = 1_500, 50
        kept: list[int] = []

        @agent(kinds=["work"])
        async def quick(task: Task, ctx: Context) -> None:
            return None

        async def tasks() -> AsyncIterator[Task]:
            for i in range(n):
                if i == n - 1:  # what the process holds of the tasks, near the end
                    gc.collect()
                    kept.append(sum(isinstance(o, Record) for o in gc.get_objects()))
                yield Task("work", i)

        async with Orchestrator(
            agents=[quick], store=store, window=window, aggregate=Discard()
        ) as orch:
            result = await orch.run(tasks=tasks(), run_id="streamed")
        assert result.metadata.counts["succeeded"] == n
        # The window's unfinished tasks, the dead slots a sweep has not reached yet, the
        # successes the report counts a batch at a time, and the runners' last attempts: each
        # bounded, none growing with the run.
        from orchestra._core._report import BATCH

        bound = window + 2 * 64 + BATCH + 100
        assert kept[0] <= bound, f"{kept[0]} records of {n} tasks kept"


class TestAWriterThatStopped:
    async def test_holds_the_input_back_no_more(self, store: PostgresStore) -> None:
        # Its batch failed with a full backlog (the coordinator's session cut off, say): the
        # input waiting for it was woken, then found the same resolved wait at each look and
        # spun on it for ever, the run never hearing of the failure.
        from datetime import UTC, datetime

        from orchestra._admission import Admission
        from orchestra.stores._postgres._behind import BACKLOG, Behind
        from orchestra.stores._postgres._coordinator import Lease

        failed: list[BaseException] = []
        behind = Behind(
            store.database, "nobody", Lease("nobody", "me", 1, datetime.now(UTC), 30.0),
            Admission(("work",), {}), asyncio.get_running_loop(), lambda done: None,
            failed.append,
        )  # fmt: skip
        tasks = [Task("work", i, id=f"t{i}") for i in range(BACKLOG)]
        behind.queue("admit", (tasks, "input item", False, 0, [], set()))
        waiting = behind.backpressure()
        assert waiting is not None
        with anyio.fail_after(30):
            await waiting  # the run "nobody" is not ours: the write is refused
        assert failed
        assert behind.backpressure() is None
        behind.close()


class TestResumeAfterKill:
    """The SQLite store's kill points (tests/test_sqlite.py), on PostgreSQL: a coordinator
    SIGKILLed mid-run, the run resumed by its id in a new process."""

    @pytest.mark.parametrize(
        "options",
        [("--kill", "calls:3"), ("--kill", "calls:14"), ("--kill", "calls:25"),
         ("--kill", "input:4", "--stream"), ("--kill", "input:20", "--stream"),
         ("--kill", "calls:12", "--stream")],
        ids=lambda o: " ".join(o),
    )  # fmt: skip
    async def test_no_success_runs_again_and_every_task_ends_once(
        self, pg_dsn: str, tmp_path: Path, options: tuple[str, ...]
    ) -> None:
        calls = tmp_path / "calls.txt"
        killed = await anyio.to_thread.run_sync(job, pg_dsn, calls, *options)
        assert killed.returncode == -9, killed.stderr
        before = await committed(pg_dsn)
        done_before = {i for i, (state, _) in before.items() if state == "succeeded"}
        calls.write_text("")
        resumed = await anyio.to_thread.run_sync(job, pg_dsn, calls, *options[2:])
        assert resumed.returncode == 0, resumed.stderr
        result = RunResult.model_validate_json(resumed.stdout)
        ran_again = set(calls.read_text().split())
        assert not done_before & ran_again
        assert result.status == "success", result.errors
        assert result.metadata.total == 29
        assert result.metadata.resumed == len(done_before)
        assert result.data["total"]["value"] == sum(2 * i for i in range(4))
        after = await committed(pg_dsn)
        assert sorted(after) == EVERY_TASK
        assert {state for state, _ in after.values()} == {"succeeded"}
        # A task the killed process held ran again, its lost attempt counted.
        for task_id, (state, attempts) in before.items():
            if state in ("claimed", "running"):
                assert after[task_id] == ("succeeded", attempts + 1)

    @pytest.mark.parametrize("options", [(), ("--stream",)], ids=["list", "stream"])
    async def test_tasks_given_no_id_are_the_same_tasks_again_not_new_ones(
        self, pg_dsn: str, tmp_path: Path, options: tuple[str, ...]
    ) -> None:
        # Their ids are generated again in the same order and match the rows: a row that said
        # its id was the caller's made the resumed run generate others, and run every one again.
        calls = tmp_path / "calls.txt"
        killed = await anyio.to_thread.run_sync(
            job, pg_dsn, calls, "--kill", "calls:14", "--unnamed", *options
        )
        assert killed.returncode == -9, killed.stderr
        done_before = {
            i for i, (state, _) in (await committed(pg_dsn)).items() if state == "succeeded"
        }
        assert {i for i in done_before if i.startswith("work#")}  # some of them ended
        calls.write_text("")
        resumed = await anyio.to_thread.run_sync(job, pg_dsn, calls, "--unnamed", *options)
        assert resumed.returncode == 0, resumed.stderr
        result = RunResult.model_validate_json(resumed.stdout)
        assert not done_before & set(calls.read_text().split())
        assert (result.status, result.metadata.total) == ("success", 29), result.errors
        assert result.metadata.resumed == len(done_before)
        after = await committed(pg_dsn)
        assert len(after) == 29
        assert {state for state, _ in after.values()} == {"succeeded"}

    async def test_a_finished_run_run_again_executes_nothing(
        self, pg_dsn: str, tmp_path: Path
    ) -> None:
        calls = tmp_path / "calls.txt"
        first = await anyio.to_thread.run_sync(job, pg_dsn, calls)
        assert first.returncode == 0, first.stderr
        calls.write_text("")
        again = await anyio.to_thread.run_sync(job, pg_dsn, calls)
        assert again.returncode == 0, again.stderr
        assert calls.read_text() == ""
        result = RunResult.model_validate_json(again.stdout)
        assert result.data == RunResult.model_validate_json(first.stdout).data
        assert result.metadata.resumed == 29

    @pytest.mark.parametrize(
        "options",
        [
            ("--kill", "calls:14"),
            ("--kill", "input:12"),
            ("--kill", "calls:14", "--unnamed"),
            ("--kill", "calls:14", "--iter"),
        ],
        ids=lambda o: " ".join(o),
    )
    async def test_a_stream_of_tasks_that_stand_alone_ends_as_an_uninterrupted_run(
        self, pg_dsn: str, tmp_path: Path, options: tuple[str, ...]
    ) -> None:
        # Its ended tasks are read ahead of the input as it comes again, 4 rows at a time here:
        # the ones that ended before are heard once and never run again, the rest run.
        alone = ("--stream", "--alone", "--chunk", "4")
        calls = tmp_path / "calls.txt"
        killed = await anyio.to_thread.run_sync(
            functools.partial(job, pg_dsn, calls, *options, *alone)
        )
        assert killed.returncode == -9, killed.stderr
        before = await committed(pg_dsn)
        ended_before = {i for i, (state, _) in before.items() if state in ("succeeded", "failed")}
        calls.write_text("")
        resumed = await anyio.to_thread.run_sync(
            functools.partial(job, pg_dsn, calls, *options[2:], *alone)
        )
        assert resumed.returncode == 0, resumed.stderr
        result = RunResult.model_validate_json(resumed.stdout)
        assert not ended_before & set(calls.read_text().split())
        assert result.metadata.resumed == len(ended_before)
        assert result.metadata.total == 24
        assert (result.metadata.counts["succeeded"], result.metadata.counts["failed"]) == (23, 1)
        (error,) = result.errors
        # Once refused, never again: before it, at most the attempt the killed process held.
        assert [a.error_type for a in error.attempts] in (
            ["PermanentError"],
            ["LeaseExpired", "PermanentError"],
        )
        after = await committed(pg_dsn)
        assert len(after) == 24
        assert sorted(state for state, _ in after.values()) == ["failed"] + ["succeeded"] * 23
        uninterrupted = await anyio.to_thread.run_sync(
            functools.partial(job, pg_dsn, tmp_path / "other.txt", *options[2:], *alone, run="u")
        )
        assert result.data == RunResult.model_validate_json(uninterrupted.stdout).data
        # Each row stands at its task's place in the input, as in the uninterrupted run (a
        # resumed chunk whose first items had ended wrote the rest from the chunk's first index).
        conn = await asyncpg.connect(pg_dsn)
        try:
            places: dict[str, dict[str, int]] = {}
            for run in ("r", "u"):
                rows = await conn.fetch(
                    "SELECT id, idx FROM orchestra.tasks WHERE run_id = $1", run
                )
                places[run] = {row["id"]: row["idx"] for row in rows}
        finally:
            await conn.close()
        assert places["r"] == places["u"]


class TestAResumedStreamInBoundedMemory:
    async def test_holds_a_chunk_of_the_tasks_that_ended_not_the_whole_run(
        self, store: PostgresStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # A resumed run read every row of the run at once and kept a record of each: 900 MB for
        # a million-task stream killed half way. It reads the ended ones as the input comes.
        from orchestra._record import Record
        from orchestra.stores._postgres._run import PostgresRun

        monkeypatch.setattr(PostgresRun, "read_ahead", 1_000)
        n = 20_000
        held: list[int] = []
        calls: list[int] = []

        @agent(kinds=["work"])
        async def quick(task: Task, ctx: Context) -> None:
            calls.append(task.payload)

        async def tasks(sample: bool) -> AsyncIterator[Task]:
            for i in range(n):
                if sample and i % 2_500 == 1:  # the first after the run was taken back
                    gc.collect()
                    held.append(sum(isinstance(o, Record) for o in gc.get_objects()))
                yield Task("work", i)

        async with Orchestrator(agents=[quick], store=store, aggregate=Discard()) as orch:
            await orch.run(tasks(False), run_id="s")
            calls.clear()
            again = await orch.run(tasks(True), run_id="s")
        assert (again.metadata.counts["succeeded"], again.metadata.resumed) == (n, n)
        assert calls == []
        assert len(held) == 8
        assert max(held) <= 2 * 1_000 + 100, f"{held} records held of {n} tasks"


def start_job(dsn: str, calls: Path, *options: str) -> subprocess.Popen[str]:
    return spawn(
        [sys.executable, str(JOB), dsn, "r", str(calls), *options],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def _words(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


async def lines(path: Path, at_least: int) -> list[str]:
    """The lines of `path`, once it has `at_least` of them (30 s at most)."""
    with anyio.fail_after(30):
        while True:
            found = await anyio.to_thread.run_sync(_words, path)
            if len(found) >= at_least:
                return found
            await anyio.sleep(0.02)


async def finish(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    """Wait for `process` (60 s at most): its exit code, stdout and stderr."""
    out, err = await anyio.to_thread.run_sync(lambda: process.communicate(timeout=60))
    return process.returncode, out, err


class TestStandby:
    async def test_a_standby_takes_a_killed_coordinators_run_over_with_nothing_redone(
        self, pg_dsn: str, tmp_path: Path
    ) -> None:
        first, second = tmp_path / "first.txt", tmp_path / "second.txt"
        a = start_job(pg_dsn, first, "--sleep", "0.15")
        await lines(first, 4)
        b = start_job(pg_dsn, second, "--sleep", "0.01")
        await anyio.sleep(1.0)
        assert b.poll() is None  # waiting, as a standby ...
        assert not second.exists() or second.read_text() == ""  # ... running nothing
        a.kill()
        await anyio.to_thread.run_sync(a.wait)
        before = await committed(pg_dsn)
        done_before = {i for i, (state, _) in before.items() if state == "succeeded"}
        assert done_before
        code, out, err = await finish(b)
        assert code == 0, err
        result = RunResult.model_validate_json(out)
        assert result.status == "success", result.errors
        assert result.metadata.resumed == len(done_before)
        assert not done_before & set(second.read_text().split())
        after = await committed(pg_dsn)
        assert sorted(after) == EVERY_TASK
        assert {state for state, _ in after.values()} == {"succeeded"}

    async def test_a_coordinator_paused_past_its_lease_is_fenced_off_when_it_wakes(
        self, pg_dsn: str, tmp_path: Path
    ) -> None:
        first, second = tmp_path / "first.txt", tmp_path / "second.txt"
        a = start_job(pg_dsn, first, "--sleep", "0.15", "--lease", "1.5")
        await lines(first, 4)
        a.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        b = start_job(pg_dsn, second, "--sleep", "0.01", "--lease", "1.5")
        code, out, err = await finish(b)
        took = time.monotonic() - started
        assert code == 0, err
        assert took >= 1.0  # it waited for the lease of a live (stopped) holder to lapse
        result = RunResult.model_validate_json(out)
        assert result.status == "success", result.errors
        settled = await committed(pg_dsn)
        a.send_signal(signal.SIGCONT)
        code, _, err = await finish(a)
        assert code != 0
        assert "lost its lease on the run" in err
        # Nothing the woken coordinator did changed the run: every task ended once, as it was.
        assert await committed(pg_dsn) == settled
        assert sorted(settled) == EVERY_TASK


class TestTheCommand:
    """`orchestra run ... --dsn URL`: the run kept in PostgreSQL, resumed by running the command
    again with its --run-id."""

    @pytest.fixture
    def job(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
        name = f"job_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(CLI_JOB)
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sys, "path", list(sys.path))
        yield name
        sys.modules.pop(name, None)

    def test_a_run_kept_in_postgresql_resumes_with_nothing_run_again(
        self, job: str, tmp_path: Path, pg_dsn: str
    ) -> None:
        source = tmp_path / "input.jsonl"
        source.write_text(
            "".join(
                json.dumps({"kind": "double", "payload": i, "id": f"t{i}"}) + "\n" for i in range(5)
            )
        )
        command = ("run", f"{job}:build", str(source), "--dsn", pg_dsn, "--run-id", "r1")
        first = invoke(*command)
        assert first.exit_code == 0, first.output
        assert {r["task_id"]: r["output"] for r in lines_of(first.stdout)} == {
            f"t{i}": 2 * i for i in range(5)
        }
        again = invoke(*command)
        assert again.exit_code == 0, again.output
        # Nothing ran again: each task has the one attempt of the first run.
        assert anyio.run(attempts_of, pg_dsn, "r1") == {f"t{i}": 1 for i in range(5)}
        assert anyio.run(states, pg_dsn, "r1") == {f"t{i}": "succeeded" for i in range(5)}

    def test_a_file_and_a_database_at_once_is_a_usage_error(self, job: str, tmp_path: Path) -> None:
        source = tmp_path / "input.jsonl"
        source.write_text(json.dumps({"kind": "double", "payload": 1}) + "\n")
        result = invoke(
            "run", f"{job}:build", str(source), "--db", str(tmp_path / "r.db"),
            "--dsn", "postgresql://app:s3cret@db/x",
        )  # fmt: skip
        assert result.exit_code == 2, result.output
        assert "not both" in result.stderr
        assert "s3cret" not in result.output


class TestADatabaseRestart:
    async def test_a_run_under_load_loses_nothing_when_its_database_restarts(self) -> None:
        with tempfile.TemporaryDirectory() as parent:
            os.chmod(parent, 0o755)  # reachable by the server's user when root
            directory = Path(parent) / "data"
            server = embedded_server(directory, durable=True)
            port = server.port
            calls: dict[str, int] = {}

            @agent(kinds=["work"], concurrency=20)
            async def work(task: Task, ctx: Context) -> int:
                calls[task.id] = calls.get(task.id, 0) + 1
                await anyio.sleep(0.01)
                return int(task.payload)

            async def restart() -> None:
                nonlocal server
                while len(calls) < 150:
                    await anyio.sleep(0.01)
                await anyio.to_thread.run_sync(server.stop)
                down.append(len(calls))
                await anyio.sleep(0.5)
                server = await anyio.to_thread.run_sync(
                    lambda: embedded_server(directory, durable=True, port=port)
                )

            down: list[int] = []  # how many tasks had run when the server was down
            store = PostgresStore(server.dsn, poll=0.1, lease=10)
            try:
                async with (
                    Orchestrator(agents=[work], store=store) as orch,
                    anyio.create_task_group() as tg,
                ):
                    tg.start_soon(restart)
                    tasks = [Task("work", i, id=f"t{i}") for i in range(600)]
                    result = await orch.run(tasks, run_id="restarted")
                assert result.status == "success", result.errors
                assert down[0] < 600  # the run was under way
                assert result.data == {f"t{i}": i for i in range(600)}
                found = await states(server.dsn, "restarted")
                assert found == {f"t{i}": "succeeded" for i in range(600)}
                # Executions at least once, each counted: a task run again was one whose end
                # the restart cut off.
                assert set(calls) == set(found)
            finally:
                store.close()
                server.stop()


class TestACoordinatorWithWorkers:
    async def test_three_worker_processes_and_the_coordinator_run_10000_tasks_each_once(
        self, pg_dsn: str, pg_conn: asyncpg.Connection, tmp_path: Path
    ) -> None:
        from tests.test_pg_worker import live_workers, ran, start_worker, until, wait_all

        calls = tmp_path / "calls"
        workers = [start_worker(pg_dsn, calls, run_id="big") for _ in range(3)]
        here: list[str] = []

        @agent(kinds=["work"], concurrency=2)
        async def mine(task: Task, ctx: Context) -> int:
            here.append(task.id)
            return int(task.payload) * 2

        try:
            await until(lambda: _same(live_workers(pg_conn), 3), 30)
            spawner = Task("split", 5, id="split")
            tasks = [Task("work", i, id=f"t{i}") for i in range(10_000)]
            tasks.append(Task("total", 0, id="total", depends_on=["t0", "t1", "t2"]))

            @agent(kinds=["split", "total"])
            async def other(task: Task, ctx: Context) -> int:
                if task.kind == "split":
                    for i in range(5):
                        ctx.spawn(Task("work", 100_000 + i, id=f"s{i}"))
                    return 0
                return sum(int(v) for v in ctx.deps.values())

            store = PostgresStore(pg_dsn, poll=0.2)
            try:
                async with Orchestrator(agents=[mine, other], store=store) as orch:
                    result = await orch.run([spawner, *tasks], run_id="big")
            finally:
                store.close()
        finally:
            errs = await wait_all(workers)
        assert result.status == "success", result.errors
        assert result.metadata.total == 10_007
        assert result.data["total"] == 2 * (0 + 1 + 2)
        assert result.data["s4"] == 2 * 100_004
        rows = await pg_conn.fetch("SELECT id, state, attempts FROM orchestra.tasks")
        assert len(rows) == 10_007
        assert {(r["state"], r["attempts"]) for r in rows} == {("succeeded", 1)}
        # Every "work" task executed exactly once, by a worker or the coordinator; the workers
        # did most of it (the coordinator's agent takes two at a time).
        executed = [t for t, _ in ran(calls)] + here
        work = {r["id"] for r in rows} - {"split", "total"}
        assert sorted(executed) == sorted(work)
        assert len({p for _, p in ran(calls)}) == 3
        assert len(here) < len(executed) / 2
        assert not await pg_conn.fetchval(
            "SELECT count(*) FROM orchestra.events WHERE event = 'refused'"
        )
        assert [w.returncode for w in workers] == [0, 0, 0], errs  # their run closed: they left


async def _same(value: Any, expected: int) -> bool:
    return bool(await value == expected)


class TestKeysAcrossRuns:
    """Idempotency keys across runs and processes, through the coordinator's run."""

    async def test_a_later_run_reuses_a_keys_result_without_executing(
        self, store: PostgresStore
    ) -> None:
        calls: list[str] = []

        @agent(kinds=["charge"])
        async def charge(task: Task, ctx: Context) -> str:
            calls.append(task.id)
            return f"charged {task.payload}"

        async with Orchestrator(agents=[charge, add], store=store) as orch:
            first = await orch.run([Task("charge", 10, id="c", key="order-1")], run_id="k1")
            second = await orch.run(
                [
                    Task("charge", 10, id="again", key="order-1"),
                    Task("charge", 20, id="other", key="order-2"),
                ],
                run_id="k2",
            )
        assert first.data == {"c": "charged 10"}
        assert second.data == {"again": "charged 10", "other": "charged 20"}
        assert calls == ["c", "other"]

    async def test_a_run_waits_for_a_key_another_run_holds_then_reuses_its_result(
        self, pg_dsn: str
    ) -> None:
        calls: list[str] = []
        gate = anyio.Event()

        @agent(kinds=["charge"])
        async def charge(task: Task, ctx: Context) -> str:
            calls.append(task.id)
            await gate.wait()
            return f"charged {task.payload}"

        one, two = PostgresStore(pg_dsn, poll=0.1), PostgresStore(pg_dsn, poll=0.1)
        try:
            async with (
                Orchestrator(agents=[charge], store=one) as first,
                Orchestrator(agents=[charge], store=two) as second,
            ):
                holder = first.start([Task("charge", 1, id="a", key="k")], run_id="r-a")
                await until_called(calls, 1)
                waiter = second.start([Task("charge", 1, id="b", key="k")], run_id="r-b")
                await anyio.sleep(0.5)
                assert calls == ["a"]  # b waits: the key is a's run's
                assert not waiter.done
                gate.set()
                done_a, done_b = await holder, await waiter
        finally:
            one.close()
            two.close()
        assert done_a.data == {"a": "charged 1"}
        assert done_b.data == {"b": "charged 1"}
        assert calls == ["a"]

    async def test_a_failed_key_is_taken_over_by_the_next_run(self, store: PostgresStore) -> None:
        calls: list[str] = []

        @agent(kinds=["charge"], retry=RetryPolicy(max_attempts=1))
        async def charge(task: Task, ctx: Context) -> str:
            calls.append(task.id)
            if task.payload == "bad":
                raise PermanentError("card declined")
            return "ok"

        async with Orchestrator(agents=[charge], store=store) as orch:
            failed = await orch.run([Task("charge", "bad", id="x", key="k")], run_id="f1")
            again = await orch.run([Task("charge", "good", id="y", key="k")], run_id="f2")
        assert failed.status == "failed"
        assert again.data == {"y": "ok"}
        assert calls == ["x", "y"]


async def until_called(calls: list[str], n: int) -> None:
    with anyio.fail_after(10):
        while len(calls) < n:
            await anyio.sleep(0.01)


class TestAPausedCoordinator:
    async def test_leaves_every_task_to_the_workers_dependencies_and_spawns_too(
        self, pg_dsn: str
    ) -> None:
        calls: list[tuple[str, str]] = []

        def recorder(name: str) -> Any:
            @agent(kinds=["split", "work", "sum"])
            async def record(task: Task, ctx: Context) -> Any:
                calls.append((name, task.id))
                if task.kind == "split":
                    for i in range(3):
                        ctx.spawn(Task("work", i, id=f"{task.id}.{i}"))
                    return "split"
                if task.kind == "sum":
                    return sorted(ctx.deps)
                return int(task.payload) * 2

            return record

        tasks = [
            Task("split", 3, id="a"),
            Task("work", 5, id="b"),
            Task("sum", None, id="c", depends_on=["a", "b"]),
        ]
        here, there = PostgresStore(pg_dsn, poll=0.1), PostgresStore(pg_dsn, poll=0.1)
        try:
            coordinator = Orchestrator(agents=[recorder("here")], store=here)
            helper = Orchestrator(agents=[recorder("there")])
            async with coordinator, helper, anyio.create_task_group() as tg:
                handle = coordinator.start(tasks, run_id="r")
                handle.pause()  # nothing starts here: every task is the worker's
                tg.start_soon(functools.partial(helper.work, there, run_id="r"))
                result = await handle
                tg.cancel_scope.cancel()
        finally:
            here.close()
            there.close()
        assert {name for name, _ in calls} == {"there"}
        assert result.status == "success", result.errors
        assert result.data["c"] == ["a", "b"]
        assert result.data["a.2"] == 4
        assert sorted(t for _, t in calls) == ["a", "a.0", "a.1", "a.2", "b", "c"]


class TestWhatACoordinatorHearsFromAWorker:
    async def test_failed_attempts_a_default_and_a_failure_come_with_each_end(
        self, pg_dsn: str
    ) -> None:
        @agent(kinds=["flaky", "bad", "fallen", "plain"])
        async def fragile(task: Task, ctx: Context) -> Any:
            if task.kind == "plain":
                return {"n": task.payload}
            if task.kind == "flaky" and ctx.attempt >= 3:
                return "third time"
            raise PermanentError("never") if task.kind != "flaky" else RetryableError("again")

        tasks = [
            Task("flaky", 0, id="f"), Task("bad", 0, id="x"), Task("fallen", 0, id="d"),
            *(Task("plain", i, id=f"p{i}") for i in range(100)),
        ]  # fmt: skip
        here, there = PostgresStore(pg_dsn, poll=0.1), PostgresStore(pg_dsn, poll=0.1)
        try:
            coordinator = Orchestrator(agents=[fragile], store=here)
            worker = Orchestrator(
                agents=[fragile], retry=RetryPolicy(max_attempts=3, base=0.01),
                defaults={"fallen": "fallback"},
            )  # fmt: skip
            async with coordinator, worker, anyio.create_task_group() as tg:
                handle = coordinator.start(tasks, run_id="r")
                stream = handle.results()  # (opened before any end: it hears every one)
                handle.pause()  # every task is the worker's
                tg.start_soon(functools.partial(worker.work, there, run_id="r"))
                result = await handle
                heard = {r.task.id: r async for r in stream}
                tg.cancel_scope.cancel()
        finally:
            here.close()
            there.close()
        assert result.metadata.counts["succeeded"] == 102
        assert result.metadata.counts["failed"] == 1
        assert result.data["f"] == "third time"
        assert result.data["d"] == "fallback"
        assert result.data["p7"] == {"n": 7}
        assert sorted(heard) == sorted(t.id for t in tasks)
        failures = {
            i: [(a.number, a.error_type) for a in r.failures or ()] for i, r in heard.items()
        }
        assert failures["f"] == [(1, "RetryableError"), (2, "RetryableError")]
        assert failures["x"] == [(1, "PermanentError")]
        assert failures["d"] == [(1, "PermanentError")]
        assert not any(failures[f"p{i}"] for i in range(100))
        assert (heard["f"].attempts, heard["x"].attempts, heard["d"].attempts) == (3, 1, 1)
        assert heard["x"].error_type == "PermanentError"
        assert [i for i, r in heard.items() if r.defaulted] == ["d"]
        assert result.metadata.defaulted == ["d"]  # defaulted in the worker


class TestALeaseTheCoordinatorLost:
    async def test_its_late_end_is_refused_then_written_under_a_fresh_lease(
        self, pg_dsn: str, pg_conn: asyncpg.Connection
    ) -> None:
        from orchestra.stores._postgres._leases import take_back_expired

        gate, started = anyio.Event(), anyio.Event()
        calls: list[str] = []

        @agent(kinds=["slow"])
        async def slow(task: Task, ctx: Context) -> str:
            calls.append(task.id)
            started.set()
            await gate.wait()
            return "late"

        store = PostgresStore(pg_dsn, poll=0.1, lease=1.5)
        try:
            async with Orchestrator(agents=[slow], store=store) as orch:
                handle = orch.start([Task("slow", 0, id="s")], run_id="r")
                with anyio.fail_after(10):
                    await started.wait()
                run = handle_run(handle)
                # As if this process had been cut off for a whole lease: the database takes
                # the task back (the attempt counted), and the next heartbeat hears it.
                await pg_conn.execute(
                    "UPDATE orchestra.tasks SET lease_expires = now() - interval '1 s' "
                    "WHERE id = 's'"
                )
                assert [t.id for t in await take_back_expired(pg_conn, "r")] == ["s"]
                with anyio.fail_after(10):
                    while "s" not in run._lost:
                        await anyio.sleep(0.05)
                gate.set()
                result = await handle
        finally:
            store.close()
        assert result.data == {"s": "late"}
        assert calls == ["s"]  # run once: the end was the one written, not a second run
        assert run.refused == 1
        row = await pg_conn.fetchrow("SELECT state, output::text FROM orchestra.tasks")
        assert row is not None
        assert (row["state"], row["output"]) == ("succeeded", '"late"')


def handle_run(handle: Any) -> Any:
    """The `PostgresRun` under a run handle (for what only the store knows)."""
    return handle._run.store
