"""Bad disks: a SQLite file that is corrupt, locked, full or read-only gives a `StoreError` that says
what is wrong (never a raw `sqlite3` traceback), before any work when it is bad from the start, and
mid-run it stops the run and keeps every result committed before.

Real conditions, no mocks: another process holding the lock, a process whose file-size limit
(`RLIMIT_FSIZE`) makes the disk "full", a file made immutable with ``chattr +i`` (root ignores file
modes), pages overwritten with garbage.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from typer.testing import CliRunner

from orchestra import ConfigError, Context, Orchestrator, StoreError, Task, agent
from orchestra._cli._app import app
from orchestra.stores import SQLiteStore

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX only")

REPO = Path(__file__).resolve().parent.parent


def counting(calls: list[str], delay: float = 0.0) -> Any:
    @agent(kinds=["work"])
    async def work(task: Task, ctx: Context) -> Any:
        calls.append(task.id)
        if delay:
            await anyio.sleep(delay)
        return task.payload

    return work


def made(path: Path, n: int = 50) -> None:
    """A real store file with a finished run "r" of `n` tasks."""

    async def run() -> None:
        store = SQLiteStore(path)
        await Orchestrator(agents=[counting([])], store=store).run(
            [Task("work", "x" * 200, id=f"t{i}") for i in range(n)], run_id="r"
        )
        store.close()

    anyio.run(run)
    with sqlite3.connect(path) as conn:  # everything in the main file: the WAL emptied
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


@pytest.fixture
def locked(tmp_path: Path) -> Iterator[Path]:
    """A store file another process holds an exclusive lock on, until the test ends."""
    path = tmp_path / "runs.db"
    made(path)
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sqlite3, sys, time
            conn = sqlite3.connect({str(path)!r}, isolation_level=None)
            conn.execute("BEGIN EXCLUSIVE")
            print("locked", flush=True)
            sys.stdin.read()
        """)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "locked"
    yield path
    holder.communicate("", timeout=30)


def immutable(path: Path) -> Iterator[Path]:
    made(path)
    for name in (Path(f"{path}-wal"), Path(f"{path}-shm")):
        name.unlink(missing_ok=True)  # checkpointed: the main file holds everything
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"chattr +i is not available here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=False)


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A store file nobody may write, not even root (``chattr +i``)."""
    yield from immutable(tmp_path / "runs.db")


def cli(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), prog_name="orchestra")


class TestFromTheStart:
    @pytest.mark.subprocess
    async def test_a_locked_file_refuses_the_run_before_any_work(self, locked: Path) -> None:
        calls: list[str] = []
        orch = Orchestrator(agents=[counting(calls)], store=SQLiteStore(locked, busy_timeout=0.2))
        with pytest.raises(StoreError, match="another process holds it locked") as err:
            await orch.run([Task("work", 1)], run_id="new")
        assert str(locked) in str(err.value)
        assert calls == []

    @pytest.mark.subprocess
    def test_a_read_only_file_refuses_a_run_and_says_so(self, read_only: Path) -> None:
        calls: list[str] = []
        orch = Orchestrator(agents=[counting(calls)], store=SQLiteStore(read_only))
        with pytest.raises(StoreError, match="it is read-only") as err:
            anyio.run(lambda: orch.run([Task("work", 1)], run_id="new"))
        assert "sqlite3" not in type(err.value).__module__
        assert calls == []

    def test_a_file_with_pages_overwritten_is_corrupt(self, tmp_path: Path) -> None:
        path = tmp_path / "runs.db"
        made(path, 400)
        data = bytearray(path.read_bytes())
        assert len(data) > 40_000
        data[8192:32768] = os.urandom(32768 - 8192)  # the middle, not the header
        path.write_bytes(bytes(data))
        calls: list[str] = []
        orch = Orchestrator(agents=[counting(calls)], store=SQLiteStore(path))
        with pytest.raises(StoreError, match="corrupt"):
            anyio.run(
                lambda: orch.run(
                    [Task("work", "x" * 200, id=f"t{i}") for i in range(400)], run_id="r"
                )
            )
        assert calls == []

    @pytest.mark.parametrize("where", ["missing directory", "a directory"])
    def test_a_path_it_cannot_open(self, tmp_path: Path, where: str) -> None:
        path = tmp_path / "nope" / "runs.db" if where == "missing directory" else tmp_path
        with pytest.raises(StoreError, match="cannot be opened"):
            SQLiteStore(path).runs()

    @pytest.mark.parametrize("bad", [3, None, b"runs.db", ""], ids=repr)
    def test_a_path_that_is_not_one_is_a_config_error(self, bad: Any) -> None:
        # A TypeError from pathlib, or "" taken as the current directory (StoreError later).
        with pytest.raises(ConfigError, match="path") as info:
            SQLiteStore(bad)
        assert repr(bad) in str(info.value)

    def test_a_new_file_opened_by_many_at_once_is_ours_for_all_of_them(
        self, tmp_path: Path
    ) -> None:
        # A coordinator and its workers start together on a new path: one creates the schema while
        # the others check that the file is not another application's. Read as two statements
        # (version, then tables), the check saw version 0 and then the tables just committed,
        # and refused our own file (two in three rounds of six openers).
        for round_ in range(20):
            path = tmp_path / f"new-{round_}.db"
            start = threading.Barrier(6)
            errors: list[BaseException] = []

            def open_it(
                path: Path = path,
                start: threading.Barrier = start,
                errors: list[BaseException] = errors,
            ) -> None:
                start.wait()
                try:
                    store = SQLiteStore(path)
                    store.runs()
                    store.close()
                except BaseException as exc:  # every error is what is checked
                    errors.append(exc)

            threads = [threading.Thread(target=open_it) for _ in range(6)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert errors == []

    @pytest.mark.parametrize("table", ["tasks", "notes"])
    def test_another_applications_database_is_refused_and_left_as_it_was(
        self, tmp_path: Path, table: str
    ) -> None:
        path = tmp_path / "app.db"
        with sqlite3.connect(path) as conn:
            conn.execute(f"CREATE TABLE {table} (x)")
            conn.execute(f"INSERT INTO {table} VALUES (1)")
        conn.close()
        calls: list[str] = []
        orch = Orchestrator(agents=[counting(calls)], store=SQLiteStore(path))
        with pytest.raises(StoreError, match="not a SQLiteStore file") as err:
            anyio.run(lambda: orch.run([Task("work", 1)], run_id="r"))
        assert str(path) in str(err.value)
        assert table in str(err.value)  # the tables it found
        assert calls == []
        with sqlite3.connect(path) as conn:  # untouched: no schema added, not put in WAL mode
            names = [n for (n,) in conn.execute("SELECT name FROM sqlite_master")]
            (mode,) = conn.execute("PRAGMA journal_mode").fetchone()
        conn.close()
        assert names == [table]
        assert mode == "delete"
        result = cli("runs", "list", "--db", str(path))
        assert result.exit_code == 2
        assert "not a SQLiteStore file" in result.output

    @pytest.mark.parametrize("content", [b"x", b"notes", b"x" * 5000], ids=len)
    def test_a_file_without_sqlites_header_is_refused_and_left_as_it_was(
        self, tmp_path: Path, content: bytes
    ) -> None:
        path = tmp_path / "runs.db"
        path.write_bytes(content)
        calls: list[str] = []
        orch = Orchestrator(agents=[counting(calls)], store=SQLiteStore(path))
        with pytest.raises(StoreError, match="not a SQLite database") as err:
            anyio.run(lambda: orch.run([Task("work", 1)], run_id="r"))
        assert str(path) in str(err.value)
        assert calls == []
        assert path.read_bytes() == content  # not overwritten with a new database
        assert not Path(f"{path}-wal").exists()

    def test_busy_timeout_is_a_number_of_seconds(self, tmp_path: Path) -> None:
        for bad in (-1, 0, "1", True, float("nan")):
            with pytest.raises(ConfigError, match="busy_timeout"):
                SQLiteStore(tmp_path / "runs.db", busy_timeout=bad)  # type: ignore[arg-type]


class TestMidRun:
    @pytest.mark.subprocess
    async def test_a_lock_held_mid_run_stops_it_and_keeps_what_was_committed(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "runs.db"
        calls: list[str] = []
        store = SQLiteStore(path, busy_timeout=0.3, window=0.02)
        orch = Orchestrator(agents=[counting(calls, 0.01)], store=store, concurrency=2)
        tasks = [Task("work", i, id=f"t{i}") for i in range(400)]
        holder = None
        async with orch:
            handle = orch.start(tasks=tasks, run_id="r")
            with anyio.fail_after(20):
                while _succeeded(path) < 10:
                    await anyio.sleep(0.02)
            holder = await anyio.open_process(
                [sys.executable, "-c", "import sqlite3, sys; c = sqlite3.connect(sys.argv[1], "
                 "isolation_level=None); c.execute('BEGIN EXCLUSIVE'); print('locked', "
                 "flush=True); sys.stdin.read()", str(path)],
            )  # fmt: skip
            assert holder.stdout is not None
            assert (await holder.stdout.receive()).strip() == b"locked"
            with pytest.raises(StoreError, match="another process holds it locked"):
                with anyio.fail_after(20):
                    await handle
            ran = len(calls)
        assert holder.stdin is not None
        await holder.stdin.aclose()
        await holder.wait()
        assert ran < 400  # it stopped: no attempt after the failure spent anything
        kept = _succeeded(path)
        assert 10 <= kept <= ran  # what was committed before stays, readable
        # Its hold on the run could not be let go while the file was locked, but its process
        # knows the run is over: the run resumes at once, here, on another store object.
        again = SQLiteStore(path)
        resumed = await Orchestrator(agents=[counting(calls)], store=again).run(
            tasks=tasks, run_id="r"
        )
        again.close()
        assert resumed.status == "success"
        assert resumed.metadata.resumed >= kept

    @pytest.mark.parametrize("how", ["deleted", "replaced"])
    async def test_the_file_deleted_or_replaced_mid_run_stops_it_with_a_store_error(
        self, tmp_path: Path, how: str
    ) -> None:
        path = tmp_path / "runs.db"
        calls: list[str] = []
        store = SQLiteStore(path, window=0.02)
        orch = Orchestrator(agents=[counting(calls, 0.01)], store=store, concurrency=2)
        tasks = [Task("work", i, id=f"t{i}") for i in range(400)]
        async with orch:
            handle = orch.start(tasks=tasks, run_id="r")
            with anyio.fail_after(20):
                while _succeeded(path) < 10:
                    await anyio.sleep(0.02)
            if how == "replaced":  # another database at the path (an old backup put back)
                with closing(sqlite3.connect(tmp_path / "other.db")) as conn:
                    conn.execute("CREATE TABLE notes (x)")
                    conn.commit()
                # In one step: a window the writer commits meanwhile must not find no file at all
                # (and say "deleted"), as it may on a loaded machine between an unlink and a move.
                (tmp_path / "other.db").replace(path)
            else:
                path.unlink()
            for name in (Path(f"{path}-wal"), Path(f"{path}-shm")):
                name.unlink(missing_ok=True)
            with pytest.raises(StoreError) as err:
                with anyio.fail_after(20):
                    await handle
            ran = len(calls)
        store.close()
        assert ran < 400  # it stopped at the next window: no attempt spent on what cannot be kept
        message = str(err.value)
        assert str(path) in message
        assert f"was {how}" in message  # what happened
        assert "resume" in message  # and what to do
        if how == "replaced":  # the file now at the path is left as it is
            with closing(sqlite3.connect(path)) as conn:
                names = [n for (n,) in conn.execute("SELECT name FROM sqlite_master")]
            assert names == ["notes"]

    async def test_a_relative_path_names_its_file_after_the_working_directory_changes(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        (tmp_path / "elsewhere").mkdir()
        monkeypatch.chdir(tmp_path)
        store = SQLiteStore("runs.db")
        orch = Orchestrator(agents=[counting([])], store=store)
        first = await orch.run([Task("work", 1)], run_id="a")
        monkeypatch.chdir(tmp_path / "elsewhere")  # not a file replaced: the same one, found
        second = await orch.run([Task("work", 1)], run_id="b")
        store.close()
        assert first.status == second.status == "success"
        assert not (tmp_path / "elsewhere" / "runs.db").exists()

    @pytest.mark.subprocess
    def test_a_full_disk_mid_run_is_a_store_error_and_keeps_what_was_committed(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "runs.db"
        script = textwrap.dedent(f"""
            import resource, signal, sys
            import anyio
            from orchestra import Orchestrator, StoreError, Task, agent
            from orchestra.stores import SQLiteStore

            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails: EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (1_500_000, 1_500_000))

            @agent(kinds=["work"])
            async def work(task, ctx):
                await anyio.sleep(0.002)
                return "y" * 2000

            async def main():
                store = SQLiteStore({str(path)!r}, window=0.02)
                orch = Orchestrator(agents=[work], store=store, concurrency=4)
                try:
                    await orch.run([Task("work", i, id=f"t{{i}}") for i in range(2000)],
                                   run_id="r")
                except StoreError as exc:
                    print("StoreError:", exc)
                    sys.exit(3)

            anyio.run(main)
        """)
        done = subprocess.run(
            [sys.executable, "-c", script],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 3, done.stderr[-3000:]
        assert "StoreError:" in done.stdout
        assert "the disk may be full" in done.stdout  # EFBIG: SQLITE_IOERR_WRITE
        assert "Traceback" not in done.stderr
        kept = _succeeded(path)
        assert 0 < kept < 2000  # what was committed before the disk filled stays readable

    @pytest.mark.subprocess
    async def test_a_worker_whose_disk_fills_stops_with_a_store_error_and_loses_nothing(
        self, tmp_path: Path
    ) -> None:
        # The worker's completions (1 MB each) pass its file-size limit (1.5 MB): the write fails
        # under the worker's task group, and the worker must say so as `StoreError` (one line,
        # exit 2), not die of an ExceptionGroup traceback; its tasks run again elsewhere.
        path = tmp_path / "runs.db"
        calls = tmp_path / "calls"
        SQLiteStore(path).runs()
        limited = textwrap.dedent("""
            import resource, runpy, signal, sys
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails: EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (1_500_000, 1_500_000))
            sys.argv = ["orchestra", *sys.argv[1:]]
            runpy.run_module("orchestra", run_name="__main__")
        """)

        @agent(kinds=["work"])
        async def never(task: Task, ctx: Context) -> Any:
            raise AssertionError("the coordinator is paused")

        orch = Orchestrator(agents=[never], store=SQLiteStore(path, lease=1.0))
        async with orch:
            handle = orch.start(tasks=[Task("work", i, id=f"t{i}") for i in range(4)], run_id="r")
            handle.pause()
            done = await anyio.run_process(
                [sys.executable, "-c", limited, "worker", "--db", str(path), "--agents",
                 "tests/worker_job.py:big_outputs", "--run-id", "r", "--lease", "1"],
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO), "WORKER_CALLS": str(calls)},
                check=False,
            )  # fmt: skip
            err = done.stderr.decode()
            assert done.returncode == 2, err[-3000:]
            assert "the disk may be full" in err
            assert str(path.name) in err
            assert "Traceback" not in err
            assert "ExceptionGroup" not in err

            # What it held comes back (handed back, or its leases lapse) and another worker runs it.
            async def work() -> None:
                await Orchestrator(agents=[counting([])]).work(SQLiteStore(path), run_id="r")

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(work)
                    result = await handle
        assert result.status == "success"
        assert result.metadata.counts["succeeded"] == 4


class TestTheCommandLine:
    def test_runs_list_on_a_corrupt_file_is_one_line_and_exit_2(self, tmp_path: Path) -> None:
        path = tmp_path / "bad.db"
        path.write_bytes(b"garbage" * 1000)
        result = cli("runs", "list", "--db", str(path))
        assert result.exit_code == 2
        assert "not a SQLite database" in result.output
        assert "Traceback" not in result.output

    @pytest.mark.subprocess
    def test_runs_list_reads_a_read_only_file(self, read_only: Path) -> None:
        result = cli("runs", "list", "--db", str(read_only), "--jsonl")
        assert result.exit_code == 0, result.output
        assert '"id": "r"' in result.output

    def test_the_worker_on_a_corrupt_file_is_one_line_and_exit_2(self, tmp_path: Path) -> None:
        path = tmp_path / "bad.db"
        path.write_bytes(b"garbage" * 1000)
        result = cli("worker", "--db", str(path), "--agents", "tests/worker_job.py:agents")
        assert result.exit_code == 2
        assert "not a SQLite database" in result.output


def _succeeded(path: Path) -> int:
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as conn:
            (n,) = conn.execute("SELECT count(*) FROM tasks WHERE state = 'succeeded'").fetchone()
    except sqlite3.OperationalError:
        return 0
    return int(n)
