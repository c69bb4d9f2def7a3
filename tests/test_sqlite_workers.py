"""Worker processes on a SQLite file: claims under leases with fencing tokens, completions the
coordinator settles, expired leases, refused late completions, one coordinator per run;
coordinators restarted or paused past their lease, claims handed back, a file locked by a stopped
worker.

In-process tests run a coordinator and a worker as two orchestrators on two `SQLiteStore` objects
of one file (what two processes do, without the processes); the process tests start real
``orchestra worker`` processes and kill, stop and continue them with real signals.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from orchestra import (
    BreakerPolicy,
    ConfigError,
    Context,
    Orchestrator,
    PermanentError,
    Rate,
    RetryableError,
    RetryPolicy,
    StoreError,
    Task,
    agent,
)
from orchestra._admission import Admission
from orchestra._cli._app import app
from orchestra._core._orchestrator import LocalRuns
from orchestra.stores import MemoryStore, SQLiteStore
from orchestra.stores._protocol import Selector
from orchestra.stores._sqlite._leases import Claimed
from orchestra.stores._sqlite._worker import SQLiteWorkerBackend
from orchestra.stores._worker import Worker, backend_of
from orchestra.stores._worker_run import WorkerStore
from tests.helpers import REPO, spawn

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from orchestra import RunHandle, RunResult, TaskResult

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def recorder(name: str, calls: list[tuple[str, str]], delay: float = 0.0) -> Any:
    @agent(kinds=["work", "split", "sum"], name=name)
    async def run(task: Task, ctx: Context) -> Any:
        calls.append((name, task.id))
        if delay:
            await anyio.sleep(delay)
        if task.kind == "split":
            for i in range(task.payload):
                ctx.spawn(Task("work", i, id=f"{task.id}.{i}"))
            ctx.spawn(Task("work", 100))  # no id: named after its parent on a worker
            return "split"
        if task.kind == "sum":
            return sorted(ctx.deps.items())
        return task.payload * 2

    return run


def rows(db: Path, sql: str, *args: Any) -> list[Any]:
    with closing(sqlite3.connect(db)) as conn:
        return conn.execute(sql, args).fetchall()


async def finish(handle: RunHandle) -> tuple[RunResult, dict[str, TaskResult]]:
    """The run's result, and every task's (`handle.results()` must have been asked at its start)."""
    ended = {r.task_id: r async for r in handle.results()}
    return await handle, ended


async def until(condition: Callable[[], bool], within: float = 10.0) -> None:
    with anyio.fail_after(within):
        while not condition():
            await anyio.sleep(0.01)


class TestInOneProcess:
    async def test_a_worker_and_the_coordinator_run_every_task_once(self, tmp_path: Path) -> None:
        db = tmp_path / "runs.db"
        calls: list[tuple[str, str]] = []
        coordinator = Orchestrator(
            agents=[recorder("here", calls, 0.01)], store=SQLiteStore(db), concurrency=2
        )
        helper = Orchestrator(
            agents=[recorder("there", calls, 0.01)], store=SQLiteStore(db), concurrency=8
        )
        async with helper, anyio.create_task_group() as tg:
            reports = []

            async def serve() -> None:
                reports.append(await helper.work(run_id="r"))

            tg.start_soon(serve)
            result = await coordinator.run(tasks=[Task("work", i) for i in range(200)], run_id="r")
        assert result.status == "success"
        assert sorted(result.data.values()) == [2 * i for i in range(200)]
        ran = collections.Counter(task_id for _, task_id in calls)
        assert len(ran) == 200
        assert set(ran.values()) == {1}
        by = collections.Counter(name for name, _ in calls)
        assert by["there"] > 0
        assert by["here"] > 0
        (report,) = reports
        assert report.completed == by["there"] == report.claimed
        assert report.refused == report.lost == 0
        claimed = rows(db, "SELECT count(*) FROM events WHERE run_id = 'r' AND event = 'claimed'")
        assert claimed[0][0] == by["there"]  # the journal says who claimed what
        assert rows(db, "SELECT owner, shared, state FROM runs") == [(None, 0, "closed")]
        assert rows(db, "SELECT count(*) FROM workers") == [(0,)]  # it left

    async def test_a_paused_coordinator_leaves_it_all_to_the_worker_dependencies_and_spawns_too(
        self, tmp_path: Path
    ) -> None:
        db = tmp_path / "runs.db"
        calls: list[tuple[str, str]] = []
        tasks = [
            Task("split", 3, id="a"),
            Task("work", 5, id="b"),
            Task("sum", None, id="c", depends_on=["a", "b"]),
        ]
        coordinator = Orchestrator(agents=[recorder("here", calls)], store=SQLiteStore(db))
        helper = Orchestrator(agents=[recorder("there", calls)], store=SQLiteStore(db))
        async with coordinator, helper, anyio.create_task_group() as tg:
            handle = coordinator.start(tasks=tasks, run_id="r")
            handle.results()
            handle.pause()  # nothing starts here: every task is the worker's
            tg.start_soon(helper.work, None)
            result, ended = await finish(handle)
            tg.cancel_scope.cancel()
        assert {name for name, _ in calls} == {"there"}
        assert result.status == "success", result.errors
        assert result.data["c"] == [["a", "split"], ["b", 10]]  # deps' outputs, from the file
        spawned = {i: r.output for i, r in ended.items() if i.startswith("a")}
        assert spawned == {"a": "split", "a.0": 0, "a.1": 2, "a.2": 4, "a/work#4": 200}
        assert sorted(t for _, t in calls) == [*sorted(spawned), "b", "c"]

    @pytest.mark.parametrize("where", ["here", "on a worker"])
    async def test_a_spawned_task_is_named_alike_on_a_worker_when_its_name_is_taken(
        self, tmp_path: Path, where: str
    ) -> None:
        # The run has a task named as "a"'s first unnamed spawn would be: the coordinator skips
        # to the next name; a worker, which does not know the run's ids, took it, and the
        # coordinator refused the spawn as a duplicate, failing "a" (only on a worker).
        db = tmp_path / "runs.db"
        calls: list[tuple[str, str]] = []
        tasks = [Task("split", 0, id="a"), Task("work", 1, id="a/work#1")]
        coordinator = Orchestrator(agents=[recorder("here", calls)], store=SQLiteStore(db))
        helper = Orchestrator(agents=[recorder("there", calls)], store=SQLiteStore(db))
        async with coordinator, helper, anyio.create_task_group() as tg:
            handle = coordinator.start(tasks=tasks, run_id="r")
            handle.results()
            if where != "here":
                handle.pause()  # every task is the worker's
                tg.start_soon(helper.work, None)
            result, ended = await finish(handle)
            tg.cancel_scope.cancel()
        assert {name for name, _ in calls} == {"here" if where == "here" else "there"}
        assert result.status == "success", result.errors
        assert {i: r.output for i, r in ended.items()} == {
            "a": "split",
            "a/work#1": 2,
            "a/work#2": 200,
        }

    async def test_a_worker_takes_only_its_kinds(self, tmp_path: Path) -> None:
        db = tmp_path / "runs.db"
        calls: list[tuple[str, str]] = []
        coordinator = Orchestrator(agents=[recorder("here", calls)], store=SQLiteStore(db))
        helper = Orchestrator(agents=[recorder("there", calls)], store=SQLiteStore(db))
        tasks = [Task("work", i) for i in range(20)] + [Task("sum", None, id="s")]
        async with coordinator, helper, anyio.create_task_group() as tg:
            handle = coordinator.start(tasks=tasks, run_id="r")
            handle.pause()
            tg.start_soon(lambda: helper.work(run_id="r", kinds=["work"]))
            await until(lambda: len(calls) == 20)
            await anyio.sleep(0.3)  # a few claims more: "sum" is not its kind
            assert {t for _, t in calls} == {f"work#{i}" for i in range(1, 21)}
            handle.resume()  # the coordinator runs "sum" itself
            result = await handle
        assert result.status == "success"
        assert ("here", "s") in calls

    async def test_a_task_cancelled_by_the_coordinator_is_cancelled_on_the_worker(
        self, tmp_path: Path
    ) -> None:
        db = tmp_path / "runs.db"
        started = anyio.Event()
        cancelled: list[str] = []

        @agent(kinds=["work"])
        async def slow(task: Task, ctx: Context) -> Any:
            started.set()
            try:
                await anyio.sleep(30)
            except BaseException:
                cancelled.append(task.id)
                raise

        store = SQLiteStore(db, lease=0.6, window=0.02)
        coordinator = Orchestrator(agents=[slow], store=store)
        helper = Orchestrator(agents=[slow], store=SQLiteStore(db, lease=0.6, window=0.02))
        async with coordinator, helper, anyio.create_task_group() as tg:
            handle = coordinator.start(tasks=[Task("work", 1, id="t")], run_id="r")
            handle.results()
            handle.pause()
            reports = []

            async def serve() -> None:
                reports.append(await helper.work(run_id="r"))

            tg.start_soon(serve)
            await started.wait()
            handle.cancel(task_id="t")
            _, ended = await finish(handle)
            await until(lambda: bool(reports))
        assert ended["t"].status == "cancelled"
        assert cancelled == ["t"]  # the worker saw its lease go at its next heartbeat
        assert reports[0].lost == 1
        assert reports[0].completed == 0

    async def test_a_run_stopped_while_a_worker_holds_tasks_restarts_with_every_task(
        self, tmp_path: Path
    ) -> None:
        db = tmp_path / "runs.db"
        calls: collections.Counter[str] = collections.Counter()

        @agent(kinds=["work"], concurrency=5)
        async def slow(task: Task, ctx: Context) -> Any:
            calls[task.id] += 1
            await anyio.sleep(0.05)
            return task.payload

        tasks = [Task("work", i, id=f"t{i}") for i in range(60)]
        helper = Orchestrator(agents=[slow], store=SQLiteStore(db, lease=0.6, window=0.02))
        async with helper, anyio.create_task_group() as tg:
            tg.start_soon(helper.work, None)
            first = Orchestrator(agents=[slow], store=SQLiteStore(db, lease=0.6, window=0.02))
            async with first:
                handle = first.start(tasks=tasks, run_id="r")
                handle.pause()  # the worker runs everything
                await until(lambda: sum(calls.values()) >= 20)
                await handle.stop()
                stopped = await handle
            before = set(stopped.data or {})
            again = Orchestrator(agents=[slow], store=SQLiteStore(db, lease=0.6, window=0.02))
            async with again:
                with anyio.fail_after(10):
                    result = await again.run(tasks=tasks, run_id="r")
            tg.cancel_scope.cancel()
        assert stopped.status == "cancelled"
        assert result.status == "success"
        assert len(result.data) == 60
        # What the worker held at the stop it finished, and the restart settled: not redone (but
        # a lease that lapsed under a starved CPU is taken back and its task run again).
        assert max(calls.values()) <= 2
        assert all(calls[t] == 1 for t in before)

    async def test_a_second_coordinator_of_a_live_run_is_refused(self, tmp_path: Path) -> None:
        db = tmp_path / "runs.db"
        gate = anyio.Event()

        @agent(kinds=["work"])
        async def wait(task: Task, ctx: Context) -> Any:
            await gate.wait()
            return 1

        first = Orchestrator(agents=[wait], store=SQLiteStore(db))
        second = Orchestrator(agents=[wait], store=SQLiteStore(db))
        async with first:
            handle = first.start(tasks=[Task("work", 1)], run_id="r")
            await until(lambda: handle.status().active == 1)
            with pytest.raises(StoreError, match="already being run by this process") as caught:
                await second.run(tasks=[Task("work", 1)], run_id="r")
            assert "another process" not in str(caught.value)
            gate.set()
            assert (await handle).status == "success"
        # Let go of at the end: the same run id may be run again (a resume: nothing left to do).
        assert (await second.run(tasks=[Task("work", 1)], run_id="r")).metadata.resumed == 1

    async def test_what_fails_on_a_worker_fails_in_the_run_with_every_attempt(
        self, tmp_path: Path
    ) -> None:
        db = tmp_path / "runs.db"

        @agent(kinds=["work"], name="picky")
        async def picky(task: Task, ctx: Context) -> Any:
            if task.payload == "bad":
                raise PermanentError("bad payload")
            if task.payload == "odd":
                return object()  # cannot be stored as JSON
            if task.payload == "lazy":
                return map(str, [1])  # an iterator: never stored as []
            if ctx.attempt == 1:
                raise RetryableError("flaky")
            return "fine"

        coordinator = Orchestrator(agents=[picky], store=SQLiteStore(db))
        helper = Orchestrator(
            agents=[picky], store=SQLiteStore(db), retry=RetryPolicy(max_attempts=3, base=0.0)
        )
        tasks = [Task("work", p, id=p) for p in ("bad", "odd", "lazy", "flaky")]
        async with coordinator, helper, anyio.create_task_group() as tg:
            handle = coordinator.start(tasks=tasks, run_id="r")
            handle.results()
            handle.pause()
            tg.start_soon(lambda: helper.work(run_id="r"))
            result, ended = await finish(handle)
        assert ended["flaky"].status == "succeeded"
        assert ended["flaky"].attempts == 2  # retried on the worker, under its own policy
        assert [a.error_type for a in ended["flaky"].failures or ()] == ["RetryableError"]
        bad = result.error_for("bad")
        assert bad is not None
        assert bad.error_type == "PermanentError"
        assert [(a.agent, a.message) for a in bad.attempts] == [("picky", "bad payload")]
        odd = result.error_for("odd")
        assert odd is not None
        assert odd.error_type == "InvalidOutput"
        assert "task 'odd': agent 'picky' returned an object that cannot be stored" in odd.message
        assert [a.error_type for a in odd.attempts] == ["InvalidOutput"]  # the attempt failed
        lazy = result.error_for("lazy")
        assert lazy is not None
        assert "returned a map that cannot be stored as JSON (a map is an iterator" in lazy.message

    async def test_a_keyboard_interrupt_in_an_agent_stops_the_worker_and_hands_its_task_back(
        self, tmp_path: Path
    ) -> None:
        db = tmp_path / "runs.db"
        others_ended = anyio.Event()
        ended: list[str] = []

        @agent(kinds=["work"], name="picky")
        async def on_worker(task: Task, ctx: Context) -> Any:
            if task.id == "ctrl-c":
                await others_ended.wait()
                raise KeyboardInterrupt
            ended.append(task.id)
            if len(ended) == 2:
                others_ended.set()
            if task.id == "exit":
                sys.exit(2)  # fails this attempt only
            return "worker"

        @agent(kinds=["work"], name="picky")
        async def on_coordinator(task: Task, ctx: Context) -> Any:
            return "coordinator"

        coordinator = Orchestrator(agents=[on_coordinator], store=SQLiteStore(db))
        helper = Orchestrator(
            agents=[on_worker], store=SQLiteStore(db), retry=RetryPolicy(max_attempts=1)
        )
        tasks = [Task("work", None, id=i) for i in ("ctrl-c", "exit", "fine")]
        async with coordinator, helper:
            handle = coordinator.start(tasks=tasks, run_id="r")
            handle.pause()
            report = await helper.work(run_id="r")  # returns, as on Ctrl-C
            handle.resume()
            result = await handle
        assert (report.claimed, report.completed, report.released) == (3, 2, 1)
        assert result.data == {"ctrl-c": "coordinator", "fine": "worker"}  # handed back, run here
        error = result.error_for("exit")
        assert error is not None
        assert error.error_type == "SystemExit"

    async def test_a_payload_the_workers_agents_refuse_fails_its_task_not_the_worker(
        self, tmp_path: Path
    ) -> None:
        class Numbered(BaseModel):
            n: int

        @agent(kinds=["work"], name="typed", input=Numbered)
        async def typed(task: Task, ctx: Context) -> Any:
            return task.payload.n * 2

        db = tmp_path / "runs.db"
        coordinator = Orchestrator(agents=[recorder("here", [])], store=SQLiteStore(db))
        helper = Orchestrator(agents=[typed], store=SQLiteStore(db))
        tasks = [Task("work", {"n": "x"}, id="bad"), Task("work", {"n": 2}, id="good")]
        async with coordinator, helper, anyio.create_task_group() as tg:
            handle = coordinator.start(tasks=tasks, run_id="r")
            handle.results()
            handle.pause()
            reports = []

            async def serve() -> None:
                reports.append(await helper.work(run_id="r"))

            tg.start_soon(serve)
            _, ended = await finish(handle)
        assert ended["good"].output == 4
        assert ended["bad"].status == "failed"
        assert ended["bad"].error_type == "InputError"
        assert "payload" in (ended["bad"].error or "")
        assert reports[0].completed == 2  # the worker went on

    async def test_a_task_waiting_for_its_keys_result_is_never_a_workers_to_run(
        self, tmp_path: Path
    ) -> None:
        db = tmp_path / "runs.db"
        calls: list[tuple[str, str]] = []
        slow = recorder("slow", calls, 0.5)
        first = Orchestrator(agents=[slow], store=SQLiteStore(db))
        second = Orchestrator(agents=[recorder("here", calls)], store=SQLiteStore(db))
        helper = Orchestrator(agents=[recorder("there", calls)], store=SQLiteStore(db))
        async with first, second, helper, anyio.create_task_group() as tg:
            tg.start_soon(helper.work)  # every run of the file
            await until(lambda: bool(SQLiteStore(db).workers()))
            one = first.start(tasks=[Task("work", 21, id="a", key="k")], run_id="A")
            await until(lambda: bool(calls))  # the key's holder runs (here or on the worker)
            two = second.start(tasks=[Task("work", 21, id="b", key="k")], run_id="B")
            two.pause()  # its task stays ready here: only the key's wait may hold it back
            await until(lambda: rows(db, "SELECT shared FROM runs WHERE id = 'B'") == [(1,)])
            results = [await one, await two]
            tg.cancel_scope.cancel()
        assert len(calls) == 1  # the key ran once: the waiting task took its result
        assert [r.data for r in results] == [{"a": 42}, {"b": 42}]

    def test_a_task_claimed_again_after_its_waiting_claim_was_cancelled_runs_again(
        self, tmp_path: Path
    ) -> None:
        """A lost lease cancels a claimed task still waiting on the worker (ended directly, not
        through `settle`); claimed again later, it must be a new task there, not one already
        admitted (it would never run, its lease renewed forever)."""
        orch = Orchestrator(agents=[recorder("there", [])])
        worker = Worker(
            LocalRuns(orch), backend_of(SQLiteStore(tmp_path / "runs.db")), "r", None, 0.1
        )
        claimed = Claimed(("r", "t", 1, 1, "work", "3", 0, None, 0, None, 0, None, None, None))
        worker.held["t"] = claimed
        heard: list[str] = []

        class Listener:
            quiet = None

            def ready(self, record: Any) -> None:
                heard.append(f"ready {record.id}")

            def ready_all(self, records: Any) -> None:
                for record in records:
                    self.ready(record)

            def finished(self, record: Any) -> None:
                heard.append(f"{record.status} {record.task_id}")

            def wake(self) -> None:
                pass

            def stop(self, reason: str) -> None:
                pass

            def hold(self, held: bool) -> None:
                pass

            def room(self, kind: str, *, hold: bool = True) -> int:
                return 1 << 30  # no agent of its own to fill: no limit

            def stalled(self, longer_than: float) -> list[str]:
                return []

        run = WorkerStore(worker).open_run(
            "local",
            admission=Admission(["work"], {}),
            listener=Listener(),
            clock=lambda: 0.0,
            task_timeout=None,
            compact=True,
        )
        run.admit_one(Task("work", 3, id="t"), 0)
        run.cancel(Selector(task_ids=["t"]), "lease lost")
        run.admit_one(Task("work", 3, id="t"), 1)
        assert heard == ["ready t", "cancelled t", "ready t"]
        assert run.state_of("t") == "ready"

    async def test_one_worker_serves_two_runs_whose_tasks_have_the_same_ids(
        self, tmp_path: Path
    ) -> None:
        db = tmp_path / "runs.db"
        calls: list[tuple[str, str]] = []
        runs = [Orchestrator(agents=[recorder(n, [])], store=SQLiteStore(db)) for n in "AB"]
        helper = Orchestrator(agents=[recorder("there", calls, 0.01)], store=SQLiteStore(db))
        async with runs[0], runs[1], helper, anyio.create_task_group() as tg:
            handles = []
            for name, orch in zip("AB", runs, strict=True):
                handle = orch.start(tasks=[Task("work", i) for i in range(20)], run_id=name)
                handle.pause()  # the worker runs them all
                handles.append(handle)
            tg.start_soon(helper.work)  # every run of the file, generated ids alike: work#1 ...
            results = [await h for h in handles]
            tg.cancel_scope.cancel()
        for result in results:
            assert result.status == "success"
            assert sorted(result.data.values()) == [2 * i for i in range(20)]
        assert len(calls) == 40  # each task of each run once
        assert collections.Counter(t for _, t in calls) == {f"work#{i}": 2 for i in range(1, 21)}

    async def test_the_file_lists_its_workers(self, tmp_path: Path) -> None:
        db = tmp_path / "runs.db"
        store = SQLiteStore(db)
        helper = Orchestrator(agents=[recorder("there", [])], store=SQLiteStore(db))
        async with helper, anyio.create_task_group() as tg:
            tg.start_soon(lambda: helper.work(run_id="r", kinds=["work"]))
            await until(lambda: bool(store.workers()))
            (worker,) = store.workers()
            listed = CliRunner().invoke(app, ["runs", "workers", "--db", str(db), "--jsonl"])
            tg.cancel_scope.cancel()
        assert worker["pid"] == os.getpid()
        assert worker["run_id"] == "r"
        assert worker["kinds"] == ["work"]
        assert worker["live"] is True
        assert worker["holding"] == 0
        assert listed.exit_code == 0, listed.output
        assert json.loads(listed.stdout)["owner"] == worker["owner"]
        assert store.workers() == []  # a cancelled worker leaves the file

    async def test_a_worker_cancelled_as_its_registration_commits_leaves_the_file(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The registration commits in the writer thread; a cancel that lands before the worker
        # hears back must not leave its row behind (listed, holding nothing, for a lease's time).
        db = tmp_path / "runs.db"
        store = SQLiteStore(db)
        registered = anyio.Event()
        real_call = SQLiteWorkerBackend._call

        async def call(self: SQLiteWorkerBackend, job: Any, *args: Any) -> Any:
            answer = await real_call(self, job, *args)
            if job.__name__ == "register":
                registered.set()
                await anyio.sleep(0.2)  # the cancel lands here, the answer not yet back
            return answer

        monkeypatch.setattr(SQLiteWorkerBackend, "_call", call)
        helper = Orchestrator(agents=[recorder("there", [])], store=SQLiteStore(db))
        async with helper, anyio.create_task_group() as tg:
            tg.start_soon(lambda: helper.work(run_id="r", kinds=["work"]))
            await registered.wait()
            tg.cancel_scope.cancel()
        assert store.workers() == []

    async def test_runs_list_says_which_process_runs_a_run_and_that_it_is_shared(
        self, tmp_path: Path
    ) -> None:
        db = tmp_path / "runs.db"
        SQLiteStore(db).runs()  # the schema, before the test reads the file
        coordinator = Orchestrator(agents=[recorder("here", [])], store=SQLiteStore(db))
        helper = Orchestrator(agents=[recorder("there", [])], store=SQLiteStore(db))
        async with coordinator, helper, anyio.create_task_group() as tg:
            handle = coordinator.start(tasks=[Task("sum", None)], run_id="r")
            handle.pause()
            tg.start_soon(lambda: helper.work(run_id="r", kinds=["work"]))  # not "sum"
            await until(lambda: rows(db, "SELECT shared FROM runs") == [(1,)])
            listed = CliRunner().invoke(app, ["runs", "list", "--db", str(db)])
            handle.resume()
            await handle
        assert listed.exit_code == 0, listed.output
        assert f":{os.getpid()}, shared" in listed.stdout
        after = CliRunner().invoke(app, ["runs", "list", "--db", str(db)])
        assert f":{os.getpid()}" not in after.stdout  # let go of when it ended

    async def test_bad_configurations_are_config_errors(self, tmp_path: Path) -> None:
        orch = Orchestrator(agents=[recorder("here", [])])
        with pytest.raises(ConfigError, match="needs a SQLiteStore"):
            await orch.work()
        with pytest.raises(ConfigError, match="needs a SQLiteStore"):
            await orch.work(MemoryStore())  # type: ignore[arg-type]
        store = SQLiteStore(tmp_path / "runs.db")
        with pytest.raises(ConfigError, match=r"kinds \['nope'\] have no agent here"):
            await orch.work(store, kinds=["nope"])
        with pytest.raises(ConfigError, match="not one string"):
            await orch.work(store, kinds="work")
        with pytest.raises(ConfigError, match="lease"):
            SQLiteStore(tmp_path / "runs.db", lease=0.1)


# -- real processes --------------------------------------------------------------------------------


def start_worker(
    db: Path,
    calls: Path,
    *,
    run_id: str = "r",
    delay: float = 0.0,
    lease: float = 30.0,
    concurrency: int = 8,
    agents: str = "tests/worker_job.py:agents",
    hold: Path | None = None,
) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "WORKER_HOLD": "" if hold is None else str(hold),
        "WORKER_CALLS": str(calls),
        "WORKER_DELAY": str(delay),
        "WORKER_CONCURRENCY": str(concurrency),
        "PYTHONPATH": str(REPO),
    }
    return spawn(
        [sys.executable, "-m", "orchestra", "worker", "--db", str(db), "--agents",
         agents, "--run-id", run_id, "--lease", str(lease)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def start_coordinator(db: Path, n: int) -> subprocess.Popen[bytes]:
    """tests/worker_job.py as a coordinator of run "r" (n tasks) that runs nothing itself."""
    return spawn(
        [sys.executable, str(REPO / "tests" / "worker_job.py"), str(db), str(n)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def ran(calls: Path) -> list[tuple[str, int]]:
    if not calls.exists():
        return []
    return [(t, int(p)) for t, p in (line.split() for line in calls.read_text().splitlines())]


async def coordinate(
    db: Path, tasks: list[Task], lease: float = 30.0
) -> tuple[RunResult, dict[str, TaskResult]]:
    """Run `tasks` as run "r" from this process, paused: the worker processes run everything."""

    @agent(kinds=["work", "other"])
    async def never(task: Task, ctx: Context) -> Any:
        raise AssertionError("the coordinator is paused")

    orch = Orchestrator(agents=[never], store=SQLiteStore(db, lease=lease))
    async with orch:
        handle = orch.start(tasks=tasks, run_id="r")
        handle.results()
        handle.pause()
        with anyio.fail_after(120):
            return await finish(handle)


def wait_all(workers: list[subprocess.Popen[str]]) -> list[str]:
    errs = []
    for worker in workers:
        _, err = worker.communicate(timeout=60)
        errs.append(err)
    return errs


@pytest.mark.subprocess
class TestWorkerProcesses:
    async def test_three_workers_run_5000_tasks_each_exactly_once(self, tmp_path: Path) -> None:
        db = tmp_path / "runs.db"
        calls = tmp_path / "calls"
        SQLiteStore(db).runs()  # the file and its schema, before the processes open it
        workers = [start_worker(db, calls) for _ in range(3)]
        try:
            result, _ = await coordinate(db, [Task("work", i) for i in range(5000)])
        finally:
            errs = wait_all(workers)
        assert [w.returncode for w in workers] == [0, 0, 0], errs
        assert result.status == "success"
        assert sorted(result.data.values()) == [2 * i for i in range(5000)]
        executed = ran(calls)
        assert len(executed) == 5000  # no task twice: no worker died, no claim was doubled
        assert {t for t, _ in executed} == {f"work#{i}" for i in range(1, 5001)}
        by_pid = collections.Counter(p for _, p in executed)
        assert set(by_pid) == {w.pid for w in workers}, by_pid  # all three took part
        claims = rows(
            db, "SELECT task_id, count(*) FROM events WHERE event = 'claimed' GROUP BY task_id"
        )
        assert len(claims) == 5000
        assert {n for _, n in claims} == {1}
        for err in errs:
            assert "0 refused, 0 lost" in err

    async def test_a_killed_worker_loses_nothing(self, tmp_path: Path) -> None:
        db = tmp_path / "runs.db"
        calls = tmp_path / "calls"
        SQLiteStore(db).runs()
        victim = start_worker(db, calls, delay=0.05, lease=1.0)
        survivor = start_worker(db, calls, delay=0.05, lease=1.0)
        # Both claim from the start: a victim slow to start (a loaded machine) could find the
        # survivor done with all 200 before it claimed its 20th.
        await until(lambda: len(rows(db, "SELECT * FROM workers")) == 2, 30)
        tasks = [Task("work", i) for i in range(200)]
        async with anyio.create_task_group() as tg:
            results: list[tuple[RunResult, dict[str, TaskResult]]] = []

            async def run() -> None:
                results.append(await coordinate(db, tasks, lease=1.0))

            tg.start_soon(run)
            await until(lambda: sum(p == victim.pid for _, p in ran(calls)) >= 20, 30)
            victim.send_signal(signal.SIGKILL)
        wait_all([victim, survivor])
        ((result, ended),) = results
        assert result.status == "success"
        assert sorted(result.data.values()) == [2 * i for i in range(200)]
        executed = ran(calls)
        by_task = collections.defaultdict(list)
        for task_id, pid in executed:
            by_task[task_id].append(pid)
        again = {t for t, pids in by_task.items() if len(pids) > 1}
        assert again, "the victim held tasks when it was killed"
        for task_id in again:  # run again elsewhere, with the lost attempt counted
            assert by_task[task_id] == [victim.pid, survivor.pid]
            record = ended[task_id]
            assert record.attempts == 2
            assert record.agent == "double"
        accepted = {r[0] for r in rows(db, "SELECT task_id FROM events WHERE event = 'claimed'")}
        assert accepted == set(by_task)
        errors = [e for r in ended.values() for e in (r.failures or ())]
        assert {e.error_type for e in errors} == {"LeaseExpired"}

    async def test_a_worker_paused_past_its_lease_has_its_late_completion_refused(
        self, tmp_path: Path
    ) -> None:
        db = tmp_path / "runs.db"
        calls = tmp_path / "calls"
        SQLiteStore(db).runs()
        sleeper = start_worker(db, calls, delay=0.5, lease=1.0)
        await until(lambda: bool(rows(db, "SELECT * FROM workers")), 20)
        tasks = [Task("work", i) for i in range(4)]
        async with anyio.create_task_group() as tg:
            results: list[tuple[RunResult, dict[str, TaskResult]]] = []

            async def run() -> None:
                results.append(await coordinate(db, tasks, lease=1.0))

            tg.start_soon(run)
            await until(lambda: len(ran(calls)) == 4, 20)  # it holds all four, mid-call
            sleeper.send_signal(signal.SIGSTOP)
            await anyio.sleep(2.0)  # past its lease: the coordinator takes the tasks back
            other = start_worker(db, calls, lease=1.0)
            await until(lambda: len(ran(calls)) == 8, 20)
            sleeper.send_signal(signal.SIGCONT)  # it wakes and completes: too late
        sleeper_err, other_err = wait_all([sleeper, other])
        ((result, ended),) = results
        assert result.status == "success"
        assert sorted(result.data.values()) == [0, 2, 4, 6]
        refused = rows(db, "SELECT task_id FROM events WHERE event = 'refused'")
        assert sorted(t for (t,) in refused) == [f"work#{i}" for i in range(1, 5)]
        assert "0 completed, 4 refused" in sleeper_err
        assert "4 completed, 0 refused" in other_err
        for record in ended.values():
            assert record.attempts == 2
            assert [f.error_type for f in record.failures or ()] == ["LeaseExpired"]

    async def test_a_worker_stopped_by_sigterm_hands_back_what_it_holds(
        self, tmp_path: Path
    ) -> None:
        db = tmp_path / "runs.db"
        calls = tmp_path / "calls"
        SQLiteStore(db).runs()
        worker = start_worker(db, calls, delay=30)
        await until(lambda: bool(rows(db, "SELECT * FROM workers")), 20)
        orch = Orchestrator(agents=[recorder("here", [])], store=SQLiteStore(db))
        async with orch:
            handle = orch.start(tasks=[Task("work", i) for i in range(3)], run_id="r")
            handle.results()
            handle.pause()
            await until(lambda: len(ran(calls)) == 3, 20)
            worker.send_signal(signal.SIGTERM)
            _, err = await asyncio.to_thread(worker.communicate, timeout=30)
            assert worker.returncode == 130, err
            assert "3 handed back" in err
            handle.resume()  # handed back: ready at once, not after a lease
            result, ended = await finish(handle)
        assert result.status == "success"
        assert all(r.attempts == 1 for r in ended.values())  # an attempt cut short is not counted
        assert not rows(db, "SELECT * FROM workers")


@pytest.mark.subprocess
class TestCrashes:
    async def test_a_task_that_kills_every_worker_fails_after_three(self, tmp_path: Path) -> None:
        db = tmp_path / "runs.db"
        calls = tmp_path / "calls"
        SQLiteStore(db).runs()
        tasks = [Task("work", "poison", id="poison"), Task("work", 1, id="fine")]
        # One task at a time: a task a killed worker held with the poison would be lost with it.
        workers = [start_worker(db, calls, lease=1.0, concurrency=1)]
        async with anyio.create_task_group() as tg:
            results: list[tuple[RunResult, dict[str, TaskResult]]] = []

            async def run() -> None:
                results.append(await coordinate(db, tasks, lease=1.0))

            tg.start_soon(run)
            with anyio.fail_after(60):
                while not results:  # a worker dies: another one starts, as a supervisor would
                    if workers[-1].poll() is not None:
                        workers.append(start_worker(db, calls, lease=1.0, concurrency=1))
                    await anyio.sleep(0.05)
        wait_all(workers)
        ((result, ended),) = results
        assert [t for t, _ in ran(calls)].count("poison") == 3
        assert ended["fine"].status == "succeeded"
        poison = ended["poison"]
        assert poison.status == "failed"
        assert poison.error_type == "LeaseExpired"
        assert "3 workers in a row lost the task" in (poison.error or "")
        assert result.metadata.counts["failed"] == 1

    async def test_attempts_a_killed_worker_retried_are_counted_and_kept(
        self, tmp_path: Path
    ) -> None:
        # Attempt 1 fails on worker A, which retries it (attempt 2) and is killed meanwhile. The
        # next worker's attempt is the third (not a second attempt 2), and the task's history
        # keeps A's failure before the lost lease.
        db = tmp_path / "runs.db"
        calls = tmp_path / "calls"
        SQLiteStore(db).runs()
        killed = start_worker(
            db, calls, lease=1.0, agents="tests/worker_job.py:failing_then_hanging"
        )
        results: list[tuple[RunResult, dict[str, TaskResult]]] = []
        workers: list[subprocess.Popen[str]] = []
        try:
            async with anyio.create_task_group() as tg:

                async def run() -> None:
                    results.append(await coordinate(db, [Task("work", 1, id="t")], lease=1.0))

                tg.start_soon(run)
                await until(
                    lambda: (
                        len(ran(calls)) == 2
                        and rows(db, "SELECT count(*) FROM attempts WHERE task_id = 't'") == [(1,)]
                    ),
                    30,
                )
                killed.send_signal(signal.SIGKILL)
                killed.communicate(timeout=30)
                workers.append(start_worker(db, calls, lease=1.0))
        finally:
            if killed.poll() is None:  # it never got that far: not left hanging
                killed.kill()
                killed.communicate(timeout=30)
            wait_all(workers)
        ((result, ended),) = results
        assert result.status == "success"
        t = ended["t"]
        assert t.status == "succeeded"
        assert t.output == 2
        assert len(ran(calls)) == 3
        assert t.attempts == 3
        assert [(a.number, a.error_type) for a in t.failures or ()] == [
            (1, "RetryableError"),
            (2, "LeaseExpired"),
        ]
        assert rows(
            db, "SELECT number, error_type FROM attempts WHERE task_id = 't' ORDER BY number"
        ) == [
            (1, "RetryableError"),
            (2, "LeaseExpired"),
        ]

    async def test_a_killed_coordinator_resumes_with_what_the_workers_did_meanwhile(
        self, tmp_path: Path
    ) -> None:
        db = tmp_path / "runs.db"
        calls = tmp_path / "calls"
        SQLiteStore(db).runs()
        coordinator = start_coordinator(db, 300)
        hold = tmp_path / "hold"
        worker = start_worker(db, calls, delay=0.01, hold=hold)
        try:
            await until(lambda: len(ran(calls)) >= 50, 30)
            # The worker's calls wait until the coordinator is killed: else, on a loaded machine,
            # it could finish the run (and the coordinator settle it all) before the kill.
            hold.touch()
            second = Orchestrator(agents=[recorder("here", [])], store=SQLiteStore(db))
            with pytest.raises(
                StoreError, match=rf"already being run by another process \(pid {coordinator.pid} "
            ):
                await second.run(tasks=[Task("work", i) for i in range(300)], run_id="r")
            coordinator.send_signal(signal.SIGKILL)  # the worker goes on: its tasks are leased
            coordinator.wait()
            hold.unlink()
            await until(lambda: len(ran(calls)) == 300, 30)  # it did them all, unsettled
            done = rows(db, "SELECT count(*) FROM tasks WHERE state = 'done'")[0][0]
            assert done > 0  # completed while no coordinator ran: to be settled on resume
            # Not ended yet, as the journal tells it: its end is the one the coordinator settles.
            told = {e["event"] for e in SQLiteStore(db).events("r")}
            assert "done" not in told
            result, _ = await coordinate(db, [Task("work", i) for i in range(300)])
        finally:
            wait_all([worker])
        assert result.status == "success"
        assert sorted(result.data.values()) == [2 * i for i in range(300)]
        assert len(ran(calls)) == 300  # nothing ran twice: every completion was kept
        assert result.metadata.resumed > 0
        assert rows(db, "SELECT count(*) FROM tasks WHERE state = 'done'") == [(0,)]
        ends = collections.Counter(
            e["task_id"] for e in SQLiteStore(db).events("r") if e["event"] == "succeeded"
        )
        assert len(ends) == 300
        assert set(ends.values()) == {1}  # each end told once


@pytest.mark.subprocess
def test_the_cli_names_a_bad_db_and_bad_agents(tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "orchestra", "worker", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )

    missing = cli("--db", str(tmp_path / "nope.db"), "--agents", "tests/worker_job.py:agents")
    assert missing.returncode == 2
    assert "no such file" in missing.stderr
    SQLiteStore(tmp_path / "runs.db").runs()
    bad = cli("--db", str(tmp_path / "runs.db"), "--agents", "tests/worker_job.py:nothing")
    assert bad.returncode == 2
    assert "has no attribute 'nothing'" in bad.stderr
    kinds = cli("--db", str(tmp_path / "runs.db"), "--agents", "tests/worker_job.py:agents",
                "--kinds", "work,zzz")  # fmt: skip
    assert kinds.returncode == 2
    assert "kinds ['zzz'] have no agent here" in kinds.stderr


# -- restarts, hand-backs, locks and refusals across coordinator and worker processes --------------


def kill(process: subprocess.Popen[Any]) -> None:
    process.send_signal(signal.SIGKILL)
    process.communicate()


class Lock:
    """The file's write lock, held by this process (``BEGIN IMMEDIATE`` on a connection of its
    own) until `release`: every other writer waits for it (SQLite's busy timeout)."""

    def __init__(self, db: Path) -> None:
        self.conn = sqlite3.connect(db, isolation_level=None, timeout=10)
        self.conn.execute("BEGIN IMMEDIATE")

    def release(self) -> None:
        self.conn.execute("ROLLBACK")
        self.conn.close()


def start_alone(db: Path, calls: Path, n: int, lease: float) -> subprocess.Popen[str]:
    """tests/worker_job.py as a coordinator of run "r" that runs its n tasks itself (agent
    ``double``, 0.3 s a call, one at a time)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "WORKER_CALLS": str(calls), "WORKER_DELAY": "0.3"}
    return spawn(
        [sys.executable, str(REPO / "tests" / "worker_job.py"), str(db), str(n), str(lease)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def start_stopping_worker(db: Path, calls: Path) -> subprocess.Popen[str]:
    """A worker (tests/worker_job.py:agents_stopping_in_a_commit) that stops itself (SIGSTOP)
    inside the transaction of its first completion: it holds the file's write lock, stopped."""
    env = {**os.environ, "WORKER_CALLS": str(calls), "PYTHONPATH": str(REPO)}
    return spawn(
        [sys.executable, "-m", "orchestra", "worker", "--db", str(db), "--agents",
         "tests/worker_job.py:agents_stopping_in_a_commit", "--run-id", "r", "--lease", "1"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


class TestCoordinatorRestarts:
    """A run's coordinator killed, restarted with other agents, paused past its lease, or started
    twice: the run ends once, every task run, and a stale coordinator writes nothing."""

    @pytest.mark.subprocess
    async def test_a_restart_takes_back_a_dead_workers_lease_with_no_worker_left(
        self, tmp_path: Path
    ) -> None:
        """A worker killed holding a task whose lease is still running when the coordinator
        restarts, and no live worker since: the restarted run must take the task back when the
        lease expires and run it, not wait for it forever (the run is never shared again, so its
        windows never looked at expired leases)."""
        db = tmp_path / "runs.db"
        calls = tmp_path / "calls"
        SQLiteStore(db).runs()
        worker = start_worker(db, calls, delay=60, lease=6.0)
        coordinator = start_coordinator(db, 1)
        try:
            await until(lambda: len(ran(calls)) == 1, 30)  # the worker holds the task, mid-call
        finally:
            kill(worker)
            kill(coordinator)
        await anyio.sleep(1.5)  # the dead worker's heartbeat is older than the new lease (1 s)
        here: list[tuple[str, str]] = []
        again = Orchestrator(agents=[recorder("here", here)], store=SQLiteStore(db, lease=1.0))
        with anyio.fail_after(20):  # the worker's lease (6 s) expires well before
            result = await again.run(tasks=[Task("work", 0)], run_id="r")
        assert result.status == "success"
        assert here == [("here", "work#1")]
        assert rows(db, "SELECT attempts, lease_owner FROM tasks") == [(2, None)]
        assert rows(db, "SELECT error_type FROM attempts") == [("LeaseExpired",)]

    @pytest.mark.subprocess
    async def test_a_restart_with_other_agents_routes_a_task_the_dead_coordinator_was_running(
        self, tmp_path: Path
    ) -> None:
        """A coordinator killed mid-call leaves its task's row running under its agent's name (the
        row's `target`). The restart, in a process whose agents have other names, must run the task
        with its own agent for the kind, not crash its dispatcher with a bare KeyError."""
        db = tmp_path / "runs.db"
        calls = tmp_path / "calls"
        SQLiteStore(db).runs()
        first = start_alone(db, calls, 3, 30.0)
        try:
            await until(lambda: len(ran(calls)) >= 2, 30)  # mid-call of its second task
            await anyio.sleep(0.1)  # its window wrote the start
        finally:
            kill(first)
        here: list[tuple[str, str]] = []
        again = Orchestrator(agents=[recorder("here", here)], store=SQLiteStore(db))
        with anyio.fail_after(20):
            result = await again.run(
                tasks=[Task("work", i, id=f"t{i}") for i in range(3)], run_id="r"
            )
        assert result.status == "success"
        assert result.data == {"t0": 0, "t1": 2, "t2": 4}
        assert ("here", "t1") in here

    @pytest.mark.subprocess
    async def test_a_coordinator_paused_past_its_lease_does_not_write_over_its_successor(
        self, tmp_path: Path
    ) -> None:
        """A coordinator stopped (SIGSTOP) past its lease loses its run: a second coordinator takes
        it over (as the README says it may), runs it to its end and closes it. The first one, woken
        (SIGCONT), must not write the run's rows any more (a stale coordinator is fenced, as a stale
        worker is): it stops with a `StoreError`; it does not overwrite its successor's rows, set
        its finished tasks running again, or go on running the run's tasks."""
        db = tmp_path / "runs.db"
        calls = tmp_path / "calls"
        SQLiteStore(db).runs()
        first = start_alone(db, calls, 10, 1.0)
        try:
            await until(lambda: len(ran(calls)) >= 2, 30)
            first.send_signal(signal.SIGSTOP)
            await anyio.sleep(1.6)  # its heartbeat is older than its lease (1 s): the run is free
            second = Orchestrator(agents=[recorder("double", [])], store=SQLiteStore(db, lease=1.0))
            with anyio.fail_after(20):
                result = await second.run(
                    tasks=[Task("work", i, id=f"t{i}") for i in range(10)], run_id="r"
                )
            assert result.status == "success"
            closed = rows(db, "SELECT * FROM tasks ORDER BY id")
            assert rows(db, "SELECT state, owner FROM runs") == [("closed", None)]
            before = len(ran(calls))
        finally:
            first.send_signal(signal.SIGCONT)
        out, err = await asyncio.to_thread(first.communicate, timeout=30)
        assert rows(db, "SELECT * FROM tasks ORDER BY id") == closed, (out, err)
        assert rows(db, "SELECT state, owner FROM runs") == [("closed", None)]
        assert first.returncode != 0
        assert "StoreError" in err
        assert len(ran(calls)) <= before + 2  # what it had started when it woke, at most

    async def test_a_second_run_of_a_run_id_on_the_same_store_object_is_refused(
        self, tmp_path: Path
    ) -> None:
        """Two coordinators of one run id on one `SQLiteStore` object (one process): the file knows
        them by one name, so the second was let in and every task ran twice."""
        calls: list[tuple[str, str]] = []
        orch = Orchestrator(
            agents=[recorder("here", calls, 0.2)], store=SQLiteStore(tmp_path / "r.db")
        )
        tasks = [Task("work", i, id=f"t{i}") for i in range(3)]
        async with orch:
            first = orch.start(tasks=tasks, run_id="r")
            await until(lambda: len(calls) == 3)
            with pytest.raises(StoreError, match="already being run by this process"):
                await orch.run(tasks=tasks, run_id="r")
            assert (await first).status == "success"
            again = await orch.run(tasks=tasks, run_id="r")  # once it is over: a resume
        assert again.metadata.resumed == 3
        assert len(calls) == 3


class TestClaimsHandedBack:
    """Tasks a worker claimed and cannot finish (its lease expired mid-claim, a SIGTERM inside a
    claim, a stop while it holds tasks) go back to ready and are run; a worker claims no more than
    its agents can start, and what it writes back never kills it."""

    @pytest.mark.subprocess
    async def test_a_lease_that_expires_while_the_coordinator_asks_for_the_task_is_not_lost(
        self, tmp_path: Path
    ) -> None:
        """The coordinator asks the file for a ready task of its own (a worker may claim it too)
        while the window's write is taking that task back from a dead worker: the file refuses the
        coordinator's claim (the row is held by the take-back), the window then says the lease
        expired, and the task must run again, not stay "a worker's" forever."""
        db = tmp_path / "runs.db"
        calls = tmp_path / "calls"
        SQLiteStore(db).runs()
        worker = start_worker(db, calls, delay=60, lease=1.0)
        await until(lambda: bool(rows(db, "SELECT * FROM workers")), 20)
        here: list[tuple[str, str]] = []
        orch = Orchestrator(agents=[recorder("here", here)], store=SQLiteStore(db, lease=1.0))
        async with orch:
            handle = orch.start(tasks=[Task("work", 0, id="t")], run_id="r")
            handle.pause()  # the worker takes it; here it stays ready (and offered)
            try:
                await until(lambda: len(ran(calls)) == 1, 20)
            finally:
                kill(worker)
            lock = Lock(db)  # the windows' writes queue up behind it
            try:
                await anyio.sleep(1.6)  # past the lease: the queued windows will take the task back
                handle.resume()  # ... and this process asks for the task, behind them
                await anyio.sleep(0.2)
            finally:
                lock.release()
            with anyio.fail_after(15):
                result = await handle
        assert result.status == "success"
        assert here == [("here", "t")]

    @pytest.mark.subprocess
    async def test_a_worker_stopped_by_sigterm_inside_a_claim_hands_back_what_it_claimed(
        self, tmp_path: Path
    ) -> None:
        """SIGTERM while the worker's claim waits for the file's lock: the claim commits in the
        writer thread, but its answer is dropped with the cancelled call. What it claimed must be
        handed back like the rest (ready at once, no attempt counted), not left leased by a process
        that is gone until the lease (30 s) runs out and then counted as a lost attempt."""
        db = tmp_path / "runs.db"
        calls = tmp_path / "calls"
        SQLiteStore(db).runs()
        worker = start_worker(db, calls)  # lease 30 s
        await until(lambda: bool(rows(db, "SELECT * FROM workers")), 20)
        worker.send_signal(
            signal.SIGSTOP
        )  # live in the file (its heartbeat is fresh), not claiming
        here: list[tuple[str, str]] = []
        orch = Orchestrator(agents=[recorder("here", here)], store=SQLiteStore(db))
        async with orch:
            handle = orch.start(tasks=[Task("work", i, id=f"t{i}") for i in range(3)], run_id="r")
            handle.pause()
            await until(lambda: rows(db, "SELECT shared FROM runs") == [(1,)])
            await until(
                lambda: rows(db, "SELECT count(*) FROM tasks WHERE state = 'ready'") == [(3,)]
            )
            lock = Lock(db)
            try:
                worker.send_signal(signal.SIGCONT)
                await anyio.sleep(0.6)  # it sees ready rows and waits for the lock to claim them
                worker.send_signal(signal.SIGTERM)
                await anyio.sleep(0.3)
            finally:
                lock.release()  # the claim commits now
            _, err = await asyncio.to_thread(worker.communicate, timeout=30)
            assert worker.returncode == 130, err
            assert rows(db, "SELECT count(*) FROM tasks WHERE lease_owner IS NOT NULL") == [(0,)]
            handle.resume()
            with anyio.fail_after(10):
                result = await handle
        assert result.status == "success"
        assert sorted(t for _, t in here) == ["t0", "t1", "t2"]
        assert rows(db, "SELECT count(*) FROM attempts") == [(0,)]  # nothing counted as lost
        assert ran(calls) == []

    @pytest.mark.subprocess
    async def test_tasks_a_stopping_worker_hands_back_are_run_by_a_coordinator_that_asked_for_them(
        self, tmp_path: Path
    ) -> None:
        """The coordinator asked the file for tasks a worker held (refused: they are "remote" here,
        waiting for the worker's completion or its lease's expiry). The worker is stopped (SIGTERM)
        and hands them back, ready, with no lease: nothing will ever complete them or expire, and
        with no other worker the coordinator must still run them itself."""
        db = tmp_path / "runs.db"
        calls = tmp_path / "calls"
        SQLiteStore(db).runs()
        worker = start_worker(db, calls, delay=30)
        await until(lambda: bool(rows(db, "SELECT * FROM workers")), 20)
        here: list[tuple[str, str]] = []
        orch = Orchestrator(agents=[recorder("here", here)], store=SQLiteStore(db))
        async with orch:
            handle = orch.start(tasks=[Task("work", i, id=f"t{i}") for i in range(3)], run_id="r")
            handle.pause()
            await until(lambda: len(ran(calls)) == 3, 20)  # the worker holds all three
            handle.resume()  # ... and this process asks for them: refused, they are the worker's
            await anyio.sleep(0.5)
            worker.send_signal(signal.SIGTERM)
            _, err = await asyncio.to_thread(worker.communicate, timeout=30)
            assert "3 handed back" in err
            with anyio.fail_after(15):
                result = await handle
        assert result.status == "success"
        assert sorted(t for _, t in here) == ["t0", "t1", "t2"]

    @pytest.mark.subprocess
    async def test_a_worker_does_not_hold_more_tasks_than_its_agents_can_start(
        self, tmp_path: Path
    ) -> None:
        db = tmp_path / "runs.db"
        calls = tmp_path / "calls"
        SQLiteStore(db).runs()
        env = {**os.environ, "WORKER_CALLS": str(calls), "WORKER_DELAY": "0.5",
               "PYTHONPATH": str(REPO)}  # fmt: skip

        def start() -> subprocess.Popen[str]:
            return spawn(
                [sys.executable, "-m", "orchestra", "worker", "--db", str(db), "--agents",
                 "tests/worker_job.py:one_at_a_time", "--run-id", "r"],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip

        first = start()
        await until(lambda: bool(rows(db, "SELECT * FROM workers")), 20)
        orch = Orchestrator(agents=[recorder("here", [])], store=SQLiteStore(db))
        async with orch:
            handle = orch.start(tasks=[Task("work", i, id=f"t{i}") for i in range(8)], run_id="r")
            handle.pause()
            await until(lambda: len(ran(calls)) >= 1, 20)
            second = start()
            try:
                with anyio.fail_after(60):
                    result = await handle
            finally:
                for worker in (first, second):
                    await asyncio.to_thread(worker.communicate, timeout=30)
        assert result.status == "success"
        by_pid = collections.Counter(p for _, p in ran(calls))
        assert by_pid[second.pid] > 0, by_pid  # the second worker took a share of the work

    async def test_a_task_spawned_on_a_worker_with_metadata_json_cannot_say_does_not_kill_it(
        self, tmp_path: Path
    ) -> None:
        """Task metadata is free data ("never read by the runtime"): a coordinator stores what JSON
        cannot say as its repr. A worker whose attempt spawns such a task must write its completion
        the same way, not die writing it (the task handed back, uncounted, to kill the next worker)."""
        db = tmp_path / "runs.db"

        @agent(kinds=["work"])
        async def spawner(task: Task, ctx: Context) -> Any:
            if task.payload == 0:
                ctx.spawn(Task("work", 1, id="child", metadata={"seen": object()}))
            return task.payload

        coordinator = Orchestrator(agents=[recorder("here", [])], store=SQLiteStore(db))
        helper = Orchestrator(agents=[spawner], store=SQLiteStore(db))
        async with coordinator, helper, anyio.create_task_group() as tg:
            handle = coordinator.start(tasks=[Task("work", 0, id="parent")], run_id="r")
            handle.pause()  # the worker runs everything
            reports: list[Any] = []

            async def serve() -> None:
                reports.append(await helper.work(run_id="r"))

            tg.start_soon(serve)
            with anyio.fail_after(10):
                result = await handle
        assert result.status == "success"
        assert result.data == {"parent": 0, "child": 1}
        assert reports[0].completed == 2


class TestClaimsFitTheRoom:
    """A process holds no more of a shared run's tasks than its agents can start at once, the
    coordinator's own included: what its agents have no room for stays ready in the file, for a
    worker with room to claim."""

    @pytest.mark.subprocess
    async def test_a_coordinator_whose_agent_has_a_limit_leaves_the_rest_to_the_workers(
        self, tmp_path: Path
    ) -> None:
        """An agent of `concurrency=2` under the orchestrator's default limit (100): the
        coordinator holds at most the two tasks its agent can run at once (running, or claimed
        to start), never the run's backlog."""
        db = tmp_path / "runs.db"
        calls = tmp_path / "calls"
        SQLiteStore(db).runs()
        workers = [start_worker(db, calls, delay=0.2, concurrency=4) for _ in range(2)]
        await until(lambda: len(rows(db, "SELECT * FROM workers")) == 2, 30)
        here: list[str] = []
        done: set[str] = set()

        @agent(kinds=["work"], concurrency=2)
        async def limited(task: Task, ctx: Context) -> Any:
            here.append(task.id)
            await anyio.sleep(0.2)
            done.add(task.id)
            return task.payload * 2

        # The coordinator's claimed or running rows, sampled, less the ones it has finished (the
        # file says so a window later).
        held: list[int] = []
        orch = Orchestrator(agents=[limited], store=SQLiteStore(db))
        try:
            async with orch:
                handle = orch.start(tasks=[Task("work", i) for i in range(40)], run_id="r")
                with anyio.fail_after(60):
                    while not handle.done:
                        held.append(len(set(holding(db, None)) - done))
                        await anyio.sleep(0.01)
                    result = await handle
        finally:
            errs = wait_all(workers)
        assert [w.returncode for w in workers] == [0, 0], errs
        assert result.status == "success"
        assert sorted(result.data.values()) == [2 * i for i in range(40)]
        by_pid = collections.Counter(p for _, p in ran(calls))
        assert sorted([t for t, _ in ran(calls)] + here) == sorted(result.data)  # each once
        for worker in workers:
            assert by_pid[worker.pid] >= 10, (by_pid, len(here))  # a fair share each
        assert max(held) <= 2, held

    @pytest.mark.subprocess
    @pytest.mark.parametrize(
        "agents",
        [
            # its only agent runs one task at a time (`concurrency=1`, under the default limit)
            "tests/worker_job.py:one_at_a_time",
            # two agents of its kind share one `Concurrency(1)`: each alone could start a task,
            # both together only one
            "tests/worker_job.py:sharing_one_place",
        ],
        ids=["limited-agent", "agents-sharing-one-place"],
    )
    async def test_a_worker_claims_no_more_than_its_agents_can_start(
        self, tmp_path: Path, agents: str
    ) -> None:
        """Beside a worker of room 4, the worker whose agents can start one task holds one task at
        a time; the other takes the most."""
        db = tmp_path / "runs.db"
        calls = tmp_path / "calls"
        SQLiteStore(db).runs()
        single = start_worker(db, calls, delay=0.2, agents=agents)
        wide = start_worker(db, calls, delay=0.2, concurrency=4)
        await until(lambda: len(rows(db, "SELECT * FROM workers")) == 2, 30)
        names = dict(rows(db, "SELECT pid, owner FROM workers"))
        held: list[int] = []

        async def sample() -> None:
            while True:
                held.append(len(holding(db, names[single.pid])))
                await anyio.sleep(0.01)

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(sample)
                result, _ = await coordinate(db, [Task("work", i) for i in range(40)])
                tg.cancel_scope.cancel()
        finally:
            errs = wait_all([single, wide])
        assert [w.returncode for w in (single, wide)] == [0, 0], errs
        assert result.status == "success"
        by_pid = collections.Counter(p for _, p in ran(calls))
        assert sum(by_pid.values()) == 40
        assert by_pid[single.pid] > 0, by_pid
        assert by_pid[wide.pid] >= 20, by_pid
        assert max(held) <= 1, held

    async def test_a_coordinator_whose_agent_is_out_of_rate_takes_one_task_to_wait_for_it(
        self, tmp_path: Path
    ) -> None:
        """An agent limited to a call every 2 s (no `concurrency` of its own): once its call took
        the rate, the coordinator holds one task to wait for the next, not the backlog; the
        worker runs the rest."""
        db = tmp_path / "runs.db"
        SQLiteStore(db).runs()
        calls: list[tuple[str, str]] = []

        @agent(kinds=["work"], name="here", limits=[Rate(1, per=2.0)])
        async def rated(task: Task, ctx: Context) -> Any:
            calls.append(("here", task.id))
            return task.payload * 2

        coordinator = Orchestrator(agents=[rated], store=SQLiteStore(db))
        helper = Orchestrator(
            agents=[recorder("there", calls, 0.05)], store=SQLiteStore(db), concurrency=4
        )
        async with helper, anyio.create_task_group() as tg:

            async def serve() -> None:
                await helper.work(run_id="r")

            tg.start_soon(serve)
            await until(lambda: bool(rows(db, "SELECT * FROM workers")))
            with anyio.fail_after(30):
                result = await coordinator.run([Task("work", i) for i in range(20)], run_id="r")
        assert result.status == "success"
        by = collections.Counter(name for name, _ in calls)
        assert sum(by.values()) == 20
        assert by["here"] <= 2, by  # the one it ran at once, and the one that waited for it


class TestAWorkerHoldsNoTaskToWait:
    """A worker holds only what its agents can start now: a task it would hold while its agent
    waits (for a rate to refill, for its breaker's probe) stays in the file, or goes back there
    within a heartbeat, for a worker that can run it (the coordinator is paused: nothing runs
    there)."""

    async def test_out_of_rate_it_claims_nothing_and_the_worker_with_room_runs_the_rest(
        self, tmp_path: Path
    ) -> None:
        """Its agent may call once a minute: after that call it would have held one more task
        for the minute; the run ends long before."""
        db = tmp_path / "runs.db"
        calls: list[tuple[str, str]] = []

        @agent(kinds=["work"], name="rated", limits=[Rate(1, per=60.0)])
        async def rated(task: Task, ctx: Context) -> Any:
            calls.append(("rated", task.id))
            return task.payload * 2

        coordinator = Orchestrator(agents=[recorder("here", calls)], store=SQLiteStore(db))
        slow = Orchestrator(agents=[rated], store=SQLiteStore(db))
        helper = Orchestrator(
            agents=[recorder("there", calls, 0.01)], store=SQLiteStore(db), concurrency=4
        )
        async with coordinator, slow, helper, anyio.create_task_group() as tg:
            handle = coordinator.start(tasks=[Task("work", i) for i in range(20)], run_id="r")
            handle.pause()
            tg.start_soon(slow.work, None)
            await until(lambda: bool(calls))  # its one call of the minute
            await anyio.sleep(0.3)  # (claims it would make meanwhile: a poll is 0.1 s)
            tg.start_soon(helper.work, None)
            with anyio.fail_after(30):
                result = await handle
            tg.cancel_scope.cancel()
        assert result.status == "success", result.errors
        assert sorted(result.data.values()) == [2 * i for i in range(20)]
        assert collections.Counter(name for name, _ in calls) == {"rated": 1, "there": 19}

    async def test_its_agent_down_it_hands_back_what_waits_for_the_probe(
        self, tmp_path: Path
    ) -> None:
        """Its agent refuses every connection: its breaker opens on the first tasks it runs, whose
        retries then wait for a probe seconds away. It hands them back at its next heartbeat (every
        0.5 s), their failed attempts counted, and the healthy worker runs them: none spends its
        last attempt on the probes of an agent that is down."""
        db = tmp_path / "runs.db"
        calls: list[tuple[str, str]] = []

        @agent(kinds=["work"], name="down", concurrency=4)
        async def down(task: Task, ctx: Context) -> Any:
            calls.append(("down", task.id))
            raise ConnectionError("connection refused")

        coordinator = Orchestrator(agents=[recorder("here", calls)], store=SQLiteStore(db))
        failing = Orchestrator(
            agents=[down],
            store=SQLiteStore(db, lease=1.5),
            retry=RetryPolicy(max_attempts=3, base=0.01, cap=0.01),
            breaker=BreakerPolicy(min_calls=2, cooldown=5.0),
        )
        helper = Orchestrator(
            agents=[recorder("there", calls, 0.01)], store=SQLiteStore(db), concurrency=4
        )
        reports = []

        async def work(orch: Orchestrator) -> None:
            reports.append(await orch.work(run_id="r"))  # until the run is over

        with anyio.fail_after(30):
            async with coordinator, failing, helper, anyio.create_task_group() as tg:
                handle = coordinator.start(tasks=[Task("work", i) for i in range(20)], run_id="r")
                handle.results()
                handle.pause()
                tg.start_soon(work, failing)
                await until(lambda: len(calls) >= 2)  # two tasks failed: the breaker opened
                tg.start_soon(work, helper)
                result, ended = await finish(handle)
        assert result.status == "success", result.errors
        assert sorted(result.data.values()) == [2 * i for i in range(20)]
        failed_on = collections.Counter(task_id for name, task_id in calls if name == "down")
        assert len(failed_on) >= 2, calls
        for task_id, failures in failed_on.items():  # their attempts there are counted
            assert ended[task_id].attempts == failures + 1
            assert [a.agent for a in ended[task_id].failures or ()] == ["down"] * failures
        report = next(r for r in reports if r.passed_on)  # the failing worker's
        assert report.completed == 0  # every task it held went back, the ones that failed too
        assert report.passed_on >= len(failed_on)


def holding(db: Path, owner: str | None) -> list[str]:
    """The ids of run "r"'s rows `owner` (a worker's name; None: the coordinator) holds claimed
    or running, as the file says now."""
    lease = "lease_owner IS NULL" if owner is None else "lease_owner = ?"
    return [
        task_id
        for (task_id,) in rows(
            db,
            f"SELECT id FROM tasks WHERE run_id = 'r' AND {lease} "
            "AND state IN ('claimed', 'running')",
            *(() if owner is None else (owner,)),
        )
    ]


class TestAFileLockedByAStoppedWorker:
    """A worker stopped while it holds the file's write lock: the run stops with a `StoreError`
    after one busy timeout, the loop never blocked, and nothing is lost."""

    @pytest.mark.subprocess
    async def test_a_worker_stopped_while_it_holds_the_write_lock_stops_the_run_and_loses_nothing(
        self, tmp_path: Path
    ) -> None:
        """A worker stopped (SIGSTOP) inside one of its transactions holds the file's write lock: the
        coordinator waits for it up to busy_timeout, like for any process that locks the file, then
        its run stops with a StoreError that says so (the README's "When the disk is bad"). Nothing is
        lost: once the stopped worker is gone, the same run id runs every task to success."""
        db = tmp_path / "runs.db"
        calls = tmp_path / "calls"
        SQLiteStore(db).runs()
        stopped = start_stopping_worker(db, calls)
        await until(lambda: bool(rows(db, "SELECT * FROM workers")), 20)
        here: list[tuple[str, str]] = []
        tasks = [Task("work", i, id=f"t{i}") for i in range(3)]
        orch = Orchestrator(
            agents=[recorder("here", here)], store=SQLiteStore(db, lease=1.0, busy_timeout=1.0)
        )
        try:
            async with orch:
                handle = orch.start(tasks=tasks, run_id="r")
                handle.pause()  # the worker takes them all, and stops in its first commit
                await until(lambda: len(ran(calls)) >= 1, 20)
                with anyio.fail_after(20), pytest.raises(StoreError, match="locked"):
                    await handle
        finally:
            kill(stopped)  # its lock goes with it
        again = Orchestrator(agents=[recorder("here", here)], store=SQLiteStore(db, lease=1.0))
        async with again:
            with anyio.fail_after(30):
                result = await again.run(
                    tasks=[Task("work", i, id=f"t{i}") for i in range(3)], run_id="r"
                )
        assert result.status == "success"
        assert sorted(result.data) == ["t0", "t1", "t2"]

    @pytest.mark.subprocess
    async def test_a_file_locked_by_a_stopped_worker_does_not_block_the_coordinators_loop(
        self, tmp_path: Path
    ) -> None:
        """The run stops at the first window that cannot be committed (the README's "locked for
        longer than busy_timeout"); but the windows queued behind it meanwhile (one a window, each
        waiting out the busy timeout in turn) were all waited for by `close`, on the loop: with the
        lock held by a stopped process, the loop was blocked for (windows queued) x busy_timeout."""
        db = tmp_path / "runs.db"
        calls = tmp_path / "calls"
        SQLiteStore(db).runs()
        stopped = start_stopping_worker(db, calls)
        try:
            await until(lambda: bool(rows(db, "SELECT * FROM workers")), 20)
            orch = Orchestrator(
                agents=[recorder("here", [])], store=SQLiteStore(db, lease=1.0, busy_timeout=1.0)
            )
            gaps = [0.0]
            last = [time.monotonic()]

            def note() -> None:
                now = time.monotonic()
                gaps[0] = max(gaps[0], now - last[0])
                last[0] = now

            async def tick() -> None:
                while True:
                    await anyio.sleep(0.05)
                    note()

            async with orch, anyio.create_task_group() as tg:
                tg.start_soon(tick)
                handle = orch.start(
                    tasks=[Task("work", i, id=f"t{i}") for i in range(3)], run_id="r"
                )
                handle.pause()  # the worker takes them all, and stops in its first commit
                with anyio.fail_after(60), pytest.raises(StoreError, match="holds it locked"):
                    await handle
                note()  # the loop's last gap: it may end here
                tg.cancel_scope.cancel()
        finally:
            kill(stopped)
        assert gaps[0] < 2.5  # one busy timeout (the write in flight), not one per queued window


class TestRefusals:
    """A closed store, bad kinds, an empty kinds: refused with an error that says so."""

    async def test_a_closed_store_is_refused_not_waited_on_forever(self, tmp_path: Path) -> None:
        """`store.close()` stops the store's writer thread: a worker (or a run) given the store
        afterwards must get a `StoreError`, not wait forever for a thread that is gone (`orch.run`
        waited on the loop itself: not even a timeout could end it)."""
        store = SQLiteStore(tmp_path / "runs.db")
        store.runs()
        store.close()
        orch = Orchestrator(agents=[recorder("here", [])], store=store)
        with anyio.fail_after(5), pytest.raises(StoreError, match="was closed"):
            await orch.work(store, run_id="r")
        with anyio.fail_after(5), pytest.raises(StoreError, match="was closed"):
            await orch.run(tasks=[Task("work", 1)], run_id="r")

    async def test_bad_kinds_for_a_worker_are_config_errors_that_say_so(
        self, tmp_path: Path
    ) -> None:
        store = SQLiteStore(tmp_path / "runs.db")
        orch = Orchestrator(agents=[recorder("here", [])])
        with pytest.raises(ConfigError, match="kinds must be a list of kinds"):
            await orch.work(store, kinds=3)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="kinds must be a list of kinds"):
            await orch.work(store, kinds=[["work"]])  # type: ignore[list-item]
        with pytest.raises(ConfigError, match="kinds is empty"):
            await orch.work(store, kinds=[])

    @pytest.mark.subprocess
    def test_the_cli_says_an_empty_kinds_is_empty(self, tmp_path: Path) -> None:
        SQLiteStore(tmp_path / "runs.db").runs()
        empty = subprocess.run(
            [sys.executable, "-m", "orchestra", "worker", "--db", str(tmp_path / "runs.db"),
             "--agents", "tests/worker_job.py:agents", "--kinds", " , "],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert empty.returncode == 2
        assert "kinds is empty" in empty.stderr
