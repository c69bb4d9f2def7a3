"""`orchestra runs list|show|dead|retry` and the store's Python API behind them, on a real file."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from typing import TYPE_CHECKING, Any

import pytest
from typer.testing import CliRunner

from orchestra import Context, InputError, Orchestrator, PermanentError, Task, agent
from orchestra._cli._app import app
from orchestra._cli._runs import _coordinator
from orchestra.stores import SQLiteStore

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from typer.testing import Result


def invoke(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), prog_name="orchestra")


class Flaky:
    """An agent whose tasks with payload "bad" fail permanently until `healed`."""

    def __init__(self) -> None:
        self.healed = False
        self.calls: list[str] = []

    def orchestrator(self, db: Path) -> Orchestrator:
        @agent(kinds=["work"])
        async def work(task: Task, ctx: Context) -> Any:
            self.calls.append(task.id)
            if task.payload == "bad" and not self.healed:
                raise PermanentError("refused")
            return {"id": task.id}

        return Orchestrator(agents=[work], store=SQLiteStore(db, window=0.01))


TASKS: tuple[Callable[[], Task], ...] = (
    lambda: Task("work", 1, id="ok"),
    lambda: Task("work", "bad", id="d"),
    lambda: Task("work", 2, id="after", depends_on=["d"]),
)


@pytest.fixture
async def failed_run(tmp_path: Path) -> tuple[Path, Flaky]:
    """A file with run "r": `ok` succeeded, `d` failed, `after` skipped."""
    db = tmp_path / "runs.db"
    flaky = Flaky()
    result = await flaky.orchestrator(db).run([make() for make in TASKS], run_id="r")
    assert result.metadata.counts["failed"] == 1
    return db, flaky


class TestList:
    async def test_lists_every_run_with_its_counts(self, failed_run: tuple[Path, Flaky]) -> None:
        db, _ = failed_run
        result = invoke("runs", "list", "--db", str(db))
        assert result.exit_code == 0, result.output
        assert "r" in result.stdout
        assert "1 failed" in result.stdout
        assert "1 skipped" in result.stdout
        lines = invoke("runs", "list", "--db", str(db), "--jsonl").stdout.splitlines()
        [run] = [json.loads(line) for line in lines]
        assert run["id"] == "r"
        assert run["counts"] == {"succeeded": 1, "failed": 1, "skipped": 1}


class TestShow:
    async def test_a_task_is_traced_from_admitted_to_its_end(
        self, failed_run: tuple[Path, Flaky]
    ) -> None:
        db, _ = failed_run
        result = invoke("runs", "show", "r", "--db", str(db), "--task", "d", "--jsonl")
        assert result.exit_code == 0, result.output
        events = [json.loads(line) for line in result.stdout.splitlines()]
        assert [e["event"] for e in events] == ["admitted", "started", "attempt_failed", "failed"]
        assert {e["task_id"] for e in events} == {"d"}
        table = invoke("runs", "show", "r", "--db", str(db), "--events")
        assert table.exit_code == 0, table.output
        assert "attempt_failed" in table.stdout
        assert "skipped" in table.stdout

    async def test_without_options_the_run_is_summed_up(
        self, failed_run: tuple[Path, Flaky]
    ) -> None:
        db, _ = failed_run
        result = invoke("runs", "show", "r", "--db", str(db))
        assert result.exit_code == 0, result.output
        assert "run r: closed" in result.stdout
        assert "succeeded" in result.stdout


class TestDead:
    async def test_lists_each_dead_letter_with_every_attempt_and_its_traceback(
        self, failed_run: tuple[Path, Flaky]
    ) -> None:
        db, _ = failed_run
        result = invoke("runs", "dead", "r", "--db", str(db))
        assert result.exit_code == 0, result.output
        assert "d (work): PermanentError" in result.stdout
        assert "PermanentError: PermanentError" not in result.stdout  # the type said once
        assert "attempt 1 on work" in result.stdout
        assert "Traceback" in result.stdout
        [letter] = map(
            json.loads, invoke("runs", "dead", "r", "--db", str(db), "--jsonl").stdout.splitlines()
        )
        assert letter["task_id"] == "d"
        assert [a["message"] for a in letter["attempts_list"]] == ["refused"]


class TestRetry:
    async def test_a_retried_tasks_end_is_kept_after_its_last_failed_attempt(
        self, failed_run: tuple[Path, Flaky]
    ) -> None:
        # The failed attempt's time is made from the attempt's own clock readings, the task's end
        # from the store's: a hair apart, either way. The journal puts the end last; the end a
        # retry keeps did too only when its time said so (it failed under load, now and then).
        db, _ = failed_run
        with closing(sqlite3.connect(db)) as conn, conn:
            conn.execute("UPDATE events SET at = at + 0.001 WHERE event = 'attempt_failed'")
        assert invoke("runs", "retry", "r", "--db", str(db)).exit_code == 0
        store = SQLiteStore(db)
        trace = [e["event"] for e in store.events("r", "d")]
        store.close()
        assert trace == ["admitted", "started", "attempt_failed", "failed", "retried"]

    async def test_a_retried_task_runs_on_the_next_run_with_its_attempts_kept(
        self, failed_run: tuple[Path, Flaky]
    ) -> None:
        db, flaky = failed_run
        result = invoke("runs", "retry", "r", "--db", str(db))
        assert result.exit_code == 0, result.output
        assert "1 failed task(s) runnable again (d)" in result.stdout
        flaky.healed = True
        flaky.calls.clear()
        again = await flaky.orchestrator(db).run([make() for make in TASKS], run_id="r")
        assert again.status == "success"
        assert sorted(flaky.calls) == ["after", "d"]  # `ok` is not executed again
        assert again.data == {"ok": {"id": "ok"}, "d": {"id": "d"}, "after": {"id": "after"}}
        store = SQLiteStore(db)
        trace = [e["event"] for e in store.events("r", "d")]
        assert trace == [
            "admitted",
            "started",
            "attempt_failed",
            "failed",
            "retried",
            "ready",
            "started",
            "succeeded",
        ]
        assert store.events("r", "d")[-1]["attempt"] == 2  # the first attempt is counted
        assert store.dead_letters("r") == []
        assert store.retry("r") == []  # nothing failed any more
        store.close()

    async def test_one_task_by_id_from_python(self, failed_run: tuple[Path, Flaky]) -> None:
        db, _ = failed_run
        store = SQLiteStore(db)
        assert store.retry("r", ["d"]) == ["d"]
        counts = next(r for r in store.runs() if r["id"] == "r")["counts"]
        assert counts == {"succeeded": 1, "pending": 2}
        store.close()

    @pytest.mark.parametrize(
        ("task", "says"),
        [("ok", "is succeeded, not failed"), ("nope", "has no task 'nope'")],
    )
    async def test_a_task_that_is_not_a_failed_one_is_a_usage_error(
        self, failed_run: tuple[Path, Flaky], task: str, says: str
    ) -> None:
        db, _ = failed_run
        result = invoke("runs", "retry", "r", "--db", str(db), "--task", task)
        assert result.exit_code == 2
        assert says in result.stderr
        with pytest.raises(InputError, match=says):
            SQLiteStore(db).retry("r", [task])


class TestUsageErrors:
    @pytest.mark.parametrize(
        "command",
        [("list",), ("show", "r"), ("show", "r", "--events"), ("dead", "r"), ("retry", "r")],
        ids=" ".join,
    )
    def test_a_missing_file_is_exit_code_2_and_no_file_is_created(
        self, tmp_path: Path, command: tuple[str, ...]
    ) -> None:
        db = tmp_path / "missing.db"
        result = invoke("runs", *command, "--db", str(db))
        assert result.exit_code == 2
        assert "no such file" in result.stderr
        assert not db.exists()

    @pytest.mark.parametrize(
        "command",
        [("show", "nope"), ("show", "nope", "--events"), ("dead", "nope"), ("retry", "nope")],
        ids=" ".join,
    )
    async def test_an_unknown_run_id_is_exit_code_2_naming_the_runs(
        self, failed_run: tuple[Path, Flaky], command: tuple[str, ...]
    ) -> None:
        db, _ = failed_run
        result = invoke("runs", *command, "--db", str(db))
        assert result.exit_code == 2
        assert "no run 'nope' in this file (its runs: 'r')" in result.stderr

    async def test_an_unknown_task_id_is_exit_code_2(self, failed_run: tuple[Path, Flaky]) -> None:
        db, _ = failed_run
        result = invoke("runs", "show", "r", "--db", str(db), "--task", "nope")
        assert result.exit_code == 2
        assert "run 'r' has no task 'nope'" in result.stderr

    def test_a_file_that_is_not_a_database_is_exit_code_2(self, tmp_path: Path) -> None:
        db = tmp_path / "junk.db"
        db.write_bytes(b"junk" * 1000)
        result = invoke("runs", "list", "--db", str(db))
        assert result.exit_code == 2
        assert "not a SQLite database" in result.stderr


class TestBracketsInUserText:
    """Ids, messages and tracebacks are printed as they are: rich markup in them (a "[/x]") used
    to crash every command with a MarkupError, and "[redacted]" was eaten as a style tag."""

    @pytest.fixture
    async def bracketed(self, tmp_path: Path) -> Path:
        @agent(kinds=["work"], name="ag[/b]")
        async def work(task: Task, ctx: Context) -> Any:
            raise PermanentError("closing [/bold] tag, api_key=sk-ant-api03-abcdefghijkl")

        db = tmp_path / "runs.db"
        orch = Orchestrator(agents=[work], store=SQLiteStore(db))
        result = await orch.run([Task("work", 1, id="t[/x]")], run_id="r[/2]")
        assert result.status == "failed"
        return db

    @pytest.mark.parametrize(
        ("command", "shown"),
        [
            (("list",), ["r[/2]"]),
            (("show", "r[/2]"), ["run r[/2]"]),
            (("show", "r[/2]", "--events"), ["t[/x]", "ag[/b]", "[/bold] tag, api_key=[redacted]"]),
            (("dead", "r[/2]"), ["t[/x] (work)", "[/bold] tag, api_key=[redacted]", "on ag[/b]"]),
            (("retry", "r[/2]"), ["(t[/x])"]),
        ],
        ids=["list", "show", "show --events", "dead", "retry"],
    )
    async def test_they_are_shown_as_they_are(
        self, bracketed: Path, command: tuple[str, ...], shown: list[str]
    ) -> None:
        result = invoke("runs", *command, "--db", str(bracketed))
        assert result.exit_code == 0, result.output
        for text in shown:
            assert text in result.stdout, result.stdout
        assert "sk-ant-api03" not in result.stdout

    async def test_in_a_usage_error_too(self, bracketed: Path) -> None:
        result = invoke("runs", "show", "nope", "--db", str(bracketed))
        assert result.exit_code == 2, result.output
        assert "(its runs: 'r[/2]')" in result.stderr


@pytest.mark.subprocess
class TestCoordinatorColumn:
    def test_a_coordinator_whose_process_ended_is_not_shown_running_it(self) -> None:
        # `kill -9` leaves the run's lease standing for its length: on this host, the pid says.
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        host, now = socket.gethostname(), time.time()
        run = {"heartbeat": now - 1, "lease": 30.0}
        assert _coordinator({**run, "owner": f"{host}:{gone.pid}:x"}, now) == ""
        assert _coordinator({**run, "owner": f"{host}:{os.getpid()}:x"}, now) == (
            f"{host}:{os.getpid()}"
        )
        # Another host's process cannot be looked at: its heartbeat is all there is.
        assert _coordinator({**run, "owner": "elsewhere:1:x"}, now) == "elsewhere:1"


@pytest.mark.subprocess
@pytest.mark.postgres
class TestOverPostgres:
    """Every command with --dsn reads (and retries) a PostgreSQL database as --db does a file.
    The history is made as a coordinator and a worker make it (`tests/test_pg_admin.py`); the
    session's server trusts local connections, so a password in the DSN is taken and unused:
    it must show nowhere."""

    PASSWORD = "s3cret-pw"

    @pytest.fixture
    async def dsn(self, pg_dsn: str) -> str:
        """A database with run "r" (`ok` succeeded, `d` failed, `after` skipped) and a worker."""
        import asyncpg

        from orchestra.stores._postgres._coordinator import acquire
        from orchestra.stores._postgres._processes import register
        from tests.test_pg_admin import WORKER, simple_pg

        conn = await asyncpg.connect(pg_dsn)
        try:
            await acquire(conn, "r", owner="coordinator", lease=30)
            await simple_pg(conn)
            await register(conn, WORKER, host="host-a", pid=101, lease=30, kinds=["work"])
        finally:
            await conn.close()
        return pg_dsn.replace("postgres@", f"postgres:{self.PASSWORD}@")

    def run(self, *args: str) -> Result:
        result = invoke("runs", *args)
        assert self.PASSWORD not in result.stdout + result.stderr
        return result

    async def test_list_counts_the_tasks_of_each_run(self, dsn: str) -> None:
        result = self.run("list", "--dsn", dsn)
        assert result.exit_code == 0, result.output
        assert "1 failed" in result.stdout
        assert "coordinator" in result.stdout  # it holds the run
        [run] = [
            json.loads(line)
            for line in self.run("list", "--dsn", dsn, "--jsonl").stdout.splitlines()
        ]
        assert run["id"] == "r"
        assert run["counts"] == {"succeeded": 1, "failed": 1, "skipped": 1}

    async def test_show_traces_a_task_and_sums_up_the_run(self, dsn: str) -> None:
        result = self.run("show", "r", "--dsn", dsn, "--task", "d", "--jsonl")
        assert result.exit_code == 0, result.output
        events = [json.loads(line) for line in result.stdout.splitlines()]
        assert [e["event"] for e in events] == ["admitted", "started", "attempt_failed", "failed"]
        table = self.run("show", "r", "--dsn", dsn, "--events")
        assert table.exit_code == 0, table.output
        assert "attempt_failed" in table.stdout
        assert "skipped" in table.stdout
        summed = self.run("show", "r", "--dsn", dsn)
        assert summed.exit_code == 0, summed.output
        assert "run r: open" in summed.stdout

    async def test_dead_lists_each_attempt_with_its_traceback(self, dsn: str) -> None:
        result = self.run("dead", "r", "--dsn", dsn)
        assert result.exit_code == 0, result.output
        assert "d (work): PermanentError" in result.stdout
        assert "attempt 1 on work" in result.stdout
        assert "Traceback" in result.stdout

    async def test_workers_lists_the_live_ones_with_what_they_hold(self, dsn: str) -> None:
        result = self.run("workers", "--dsn", dsn)
        assert result.exit_code == 0, result.output
        assert "host-a:101:w1" in result.stdout
        [worker] = map(json.loads, self.run("workers", "--dsn", dsn, "--jsonl").stdout.splitlines())
        assert (worker["live"], worker["kinds"], worker["holding"]) == (True, ["work"], 0)

    async def test_retry_makes_the_failed_task_ready_in_the_database(self, dsn: str) -> None:
        result = self.run("retry", "r", "--dsn", dsn)
        assert result.exit_code == 0, result.output
        assert "1 failed task(s) runnable again (d)" in result.stdout
        assert "workers serving the run" in result.stdout
        lines = self.run("list", "--dsn", dsn, "--jsonl").stdout.splitlines()
        assert json.loads(lines[0])["counts"] == {"succeeded": 1, "ready": 1, "pending": 1}
        again = self.run("retry", "r", "--dsn", dsn)
        assert "no failed task to retry" in again.stdout

    @pytest.mark.parametrize(
        ("command", "says"),
        [
            (("show", "nope"), "no run 'nope' in this database (its runs: 'r')"),
            (("dead", "nope"), "no run 'nope' in this database (its runs: 'r')"),
            (("retry", "nope"), "no run 'nope' in this database (its runs: 'r')"),
            (("show", "r", "--task", "nope"), "run 'r' has no task 'nope'"),
            (("retry", "r", "--task", "ok"), "is succeeded, not failed"),
        ],
        ids=" ".join,
    )
    async def test_unknown_ids_are_usage_errors(
        self, dsn: str, command: tuple[str, ...], says: str
    ) -> None:
        result = self.run(*command, "--dsn", dsn)
        assert result.exit_code == 2
        assert says in result.stderr

    async def test_a_user_the_database_does_not_let_read_is_a_usage_error(
        self, dsn: str, pg_dsn: str
    ) -> None:
        import uuid

        import asyncpg

        role = f"reader_{uuid.uuid4().hex[:12]}"
        conn = await asyncpg.connect(pg_dsn)
        try:
            await conn.execute(f'CREATE ROLE "{role}" LOGIN')
            result = self.run("list", "--dsn", dsn.replace("//postgres:", f"//{role}:"))
            assert result.exit_code == 2, result.output
            assert "permission denied for schema orchestra" in result.stderr
        finally:
            await conn.execute(f'DROP ROLE "{role}"')
            await conn.close()


class TestWhereTheRunsAre:
    def test_both_a_file_and_a_database_is_a_usage_error(self, tmp_path: Path) -> None:
        result = invoke(
            "runs", "list", "--db", str(tmp_path / "x.db"), "--dsn", "postgresql://h/db"
        )
        assert result.exit_code == 2
        assert "--db FILE" in result.stderr
        assert "not both" in result.stderr

    @pytest.mark.parametrize(
        "command",
        [("list",), ("workers",), ("show", "r"), ("dead", "r"), ("retry", "r")],
        ids=" ".join,
    )
    def test_neither_is_a_usage_error(self, command: tuple[str, ...]) -> None:
        result = invoke("runs", *command)
        assert result.exit_code == 2
        assert "--db FILE" in result.stderr
        assert "--dsn URL" in result.stderr

    @pytest.mark.parametrize(
        ("dsn", "says"),
        [
            ("mysql://u:s3cret-pw@h/db", "PostgresStore needs a DSN"),
            ("postgresql://u:s3cret-pw@[bad/db", "Invalid IPv6 URL"),
            ("postgresql://u:s3cret-pw@127.0.0.1:1/db?sslmode=bogus", "sslmode"),
        ],
        ids=["not postgresql", "unreadable", "bad option"],
    )
    def test_a_dsn_that_cannot_be_used_is_a_usage_error_without_its_password(
        self, dsn: str, says: str
    ) -> None:
        result = invoke("runs", "list", "--dsn", dsn)
        assert result.exit_code == 2, result.output
        assert says in result.stderr
        assert "s3cret-pw" not in result.output + result.stderr

    def test_a_database_out_of_reach_is_a_usage_error_without_its_password(self) -> None:
        with socket.socket() as free:  # a port nothing listens on
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        result = invoke("runs", "list", "--dsn", f"postgresql://u:s3cret-pw@127.0.0.1:{port}/db")
        assert result.exit_code == 2, result.output
        assert f"PostgreSQL at 127.0.0.1:{port}/db: cannot reach it" in result.stderr
        assert "s3cret-pw" not in result.output + result.stderr

    def test_the_password_is_masked_as_written_and_decoded(self) -> None:
        from orchestra._cli._runs import _hidden

        dsn = "postgresql://u:p%40ss@h/db"
        assert _hidden("p%40ss and p@ss", dsn) == "*** and ***"
        assert _hidden("x s3 y", "postgresql://u:s3@[bad/db") == "x *** y"


@pytest.mark.subprocess
@pytest.mark.postgres
class TestADatabaseWithoutRuns:
    @pytest.mark.parametrize(
        "command",
        [("list",), ("workers",), ("show", "r"), ("dead", "r"), ("retry", "r")],
        ids=" ".join,
    )
    async def test_is_a_usage_error_and_is_left_without_orchestras_schema(
        self, pg_empty_dsn: str, command: tuple[str, ...]
    ) -> None:
        import asyncpg

        result = invoke("runs", *command, "--dsn", pg_empty_dsn)
        assert result.exit_code == 2, result.output
        assert "has no orchestra runs (no orchestra schema)" in result.stderr
        conn = await asyncpg.connect(pg_empty_dsn)
        try:
            assert not await conn.fetchval(
                "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = 'orchestra')"
            )
        finally:
            await conn.close()


class TestCoordinatorColumnOnPostgres:
    def test_a_runs_coordinator_is_shown_while_its_lease_holds_on_the_databases_clock(
        self,
    ) -> None:
        # `held` is the database's judgement (its clock): the local clock is not asked.
        run = {"owner": "vm:7:abc", "expires": 0.0}
        assert _coordinator({**run, "held": True}, time.time()) == "vm:7:abc"
        assert _coordinator({**run, "held": False}, 0.0) == ""
        assert _coordinator({"owner": None, "held": False}, 0.0) == ""
