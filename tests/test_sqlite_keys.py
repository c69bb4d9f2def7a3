"""Idempotency keys under concurrency: many submissions of one key, from two store objects on one
file and from two processes, execute once; the others return the stored result."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from orchestra import Context, Orchestrator, PermanentError, Task, agent
from orchestra.stores import SQLiteStore
from tests.helpers import spawn

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "tests" / "key_job.py"


def start(db: Path, calls: Path, n: int, *options: str) -> subprocess.Popen[str]:
    return spawn(
        [sys.executable, str(JOB), str(db), str(calls), str(n), *options],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


class Agent:
    """A slow agent that counts its calls; fails while `failing`."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.failing = False

    def orchestrator(self, store: SQLiteStore) -> Orchestrator:
        @agent(kinds=["work"])
        async def work(task: Task, ctx: Context) -> Any:
            self.calls.append(task.id)
            await asyncio.sleep(0.05)
            if self.failing:
                raise PermanentError("no")
            return {"answer": task.payload * 2}

        return Orchestrator(agents=[work], store=store)


class TestOneProcess:
    async def test_100_concurrent_runs_on_two_store_objects_execute_the_key_once(
        self, tmp_path: Path
    ) -> None:
        db = tmp_path / "runs.db"
        stores = [SQLiteStore(db, window=0.01) for _ in range(2)]
        work = Agent()
        orchestrators = [work.orchestrator(store) for store in stores]
        results = await asyncio.gather(
            *(
                orchestrators[i % 2].run([Task("work", 21, id=f"t{i}", key="k")], run_id=f"r{i}")
                for i in range(100)
            )
        )
        assert len(work.calls) == 1
        assert all(r.status == "success" for r in results)
        assert [r.data[f"t{i}"] for i, r in enumerate(results)] == [{"answer": 42}] * 100
        for store in stores:
            store.close()

    async def test_when_the_holder_fails_a_waiter_takes_the_key_and_runs_it(
        self, tmp_path: Path
    ) -> None:
        db = tmp_path / "runs.db"
        first, second = SQLiteStore(db, window=0.01), SQLiteStore(db, window=0.01)
        work = Agent()
        work.failing = True
        failing = asyncio.ensure_future(
            work.orchestrator(first).run([Task("work", 1, id="a", key="k")], run_id="one")
        )
        await asyncio.sleep(0.02)  # "one" holds the key
        waiter = asyncio.ensure_future(
            work.orchestrator(second).run([Task("work", 1, id="b", key="k")], run_id="two")
        )
        assert (await failing).status == "failed"
        work.failing = False
        result = await waiter
        assert work.calls == ["a", "b"]
        assert result.data == {"b": {"answer": 2}}
        first.close()
        second.close()

    async def test_a_stopped_run_releases_its_keys_to_the_runs_waiting_for_them(
        self, tmp_path: Path
    ) -> None:
        # A stopped run writes its tasks down as they were, to resume them; its key claims stayed
        # too, live in the file with nobody to end them, so a run waiting for such a key waited
        # out the whole `key_lease` (in virtual time, as the fuzzer runs it: for ever). Now the
        # stop releases them: the waiter takes the key at once, and the resumed run follows it.
        db = tmp_path / "runs.db"
        store = SQLiteStore(db, window=0.01, key_lease=3600)
        hold = asyncio.Event()
        calls: list[str] = []

        @agent(kinds=["work"])
        async def work(task: Task, ctx: Context) -> Any:
            calls.append(task.id)
            if task.id == "a":
                await hold.wait()  # until the stop cancels it
            return task.id

        async with Orchestrator(agents=[work], store=store) as orch:
            stopped = orch.start(tasks=[Task("work", 1, id="a", key="k")], run_id="one")
            while calls != ["a"]:
                await asyncio.sleep(0.01)
            waiter = orch.start(tasks=[Task("work", 1, id="b", key="k")], run_id="two")
            await asyncio.sleep(0.05)  # "two" waits for the key "one" holds
            assert (await stopped.stop(grace=0)).status == "cancelled"
            with anyio.fail_after(30):  # far shorter than the key's lease
                result = await waiter
            assert (result.status, result.data) == ("success", {"b": "b"})
            resumed = await orch.run(tasks=[Task("work", 1, id="a", key="k")], run_id="one")
        assert (resumed.status, resumed.data) == ("success", {"a": "b"})
        assert calls == ["a", "b"]

    async def test_a_streamed_task_the_keys_holder_waits_for_takes_the_runs_claim(
        self, tmp_path: Path
    ) -> None:
        # "a" holds the key in the file from its admission, and waits for group g; "b", streamed
        # later, has the key and joins g: it takes the key over in the run (else neither runs),
        # and with it the run's claim in the file (it waited for "a"'s claim: a deadlock).
        async def source() -> Any:
            yield Task("work", 1, id="a", key="k", depends_on_tags=["g"])
            await asyncio.sleep(0.05)  # "a"'s claim is in the file
            yield Task("work", 2, id="b", key="k", tags=["g"])

        work = Agent()
        async with work.orchestrator(SQLiteStore(tmp_path / "runs.db", window=0.01)) as orch:
            with anyio.fail_after(30):
                result = await orch.run(tasks=source(), run_id="one")
        assert (result.status, result.data) == ("success", {"a": {"answer": 4}, "b": {"answer": 4}})
        assert work.calls == ["b"]


class TestASuccessDuringItsWindowsCommit:
    """A keyed task that succeeds while the window that wrote it running is being committed: its
    key is written succeeded by the next window, never released as a failure."""

    async def test_the_key_is_stored_succeeded_and_neither_a_waiter_nor_a_later_run_executes_it(
        self, tmp_path: Path
    ) -> None:
        db = tmp_path / "runs.db"
        holder, other = SQLiteStore(db, window=0.2), SQLiteStore(db, window=0.01)
        calls: list[str] = []
        called = {"a": asyncio.Event(), "b": asyncio.Event()}
        go = {"a": asyncio.Event(), "b": asyncio.Event()}

        @agent(kinds=["work"])
        async def work(task: Task, ctx: Context) -> Any:
            calls.append(task.id)
            if task.id in go:
                called[task.id].set()
                await go[task.id].wait()
            return task.payload * 2

        async with Orchestrator(agents=[work], store=holder) as orch:
            first = orch.start(
                tasks=[Task("work", 21, id="a", key="k"), Task("work", 1, id="b")], run_id="one"
            )
            await called["a"].wait()
            await called["b"].wait()
            waiter = asyncio.ensure_future(
                Orchestrator(agents=[work], store=other).run(
                    [Task("work", 21, id="w", key="k")], run_id="two"
                )
            )
            await asyncio.sleep(0.05)  # "two" waits for the key "one" holds
            # Another connection takes the file's write lock: the window that writes "a" running
            # (and the waiter's next look at the key) waits for it, as a busy file makes them wait.
            lock = sqlite3.connect(db, isolation_level=None)
            lock.execute("BEGIN IMMEDIATE")
            await asyncio.sleep(0.4)  # that window is being committed
            go["a"].set()  # "a" succeeds before that window is committed
            await asyncio.sleep(0.05)
            lock.rollback()
            lock.close()
            await asyncio.sleep(0.6)  # the next windows: "a"'s key is written
            go["b"].set()
            assert (await first).status == "success"
            with anyio.fail_after(30):
                waited = await waiter
            later = await orch.run(tasks=[Task("work", 21, id="c", key="k")], run_id="three")
        other.close()
        with sqlite3.connect(db) as con:
            assert con.execute("SELECT state, output FROM keys").fetchall() == [("succeeded", "42")]
        assert (waited.status, waited.data) == ("success", {"w": 42})
        assert (later.status, later.data) == ("success", {"c": 42})
        assert calls == ["a", "b"]


class TestProcesses:
    def test_two_processes_submitting_one_key_execute_it_once(self, tmp_path: Path) -> None:
        db, calls = tmp_path / "runs.db", tmp_path / "calls.txt"
        SQLiteStore(db).runs()  # the schema, before the race
        jobs = [start(db, calls, 10) for _ in range(2)]
        outputs = []
        for process in jobs:
            out, err = process.communicate(timeout=60)
            assert process.returncode == 0, err
            outputs.extend(json.loads(out))
        [call] = calls.read_text().splitlines()
        winner = int(call.split()[0])
        assert outputs == [{"answer": 42, "pid": winner}] * 20

    def test_two_processes_submitting_the_same_150_keys_execute_each_once(
        self, tmp_path: Path
    ) -> None:
        # Keys end at every point of a window, some while the window that wrote them running
        # is being committed.
        db, calls = tmp_path / "runs.db", tmp_path / "calls.txt"
        SQLiteStore(db).runs()  # the schema, before the race
        jobs = [start(db, calls, 150, "--many") for _ in range(2)]
        outputs = []
        for process in jobs:
            out, err = process.communicate(timeout=60)
            assert process.returncode == 0, err
            outputs.append(json.loads(out))
        executed = [line.split() for line in calls.read_text().splitlines()]
        assert sorted(task_id for _, task_id in executed) == sorted(f"t{i}" for i in range(150))
        by = {task_id: int(pid) for pid, task_id in executed}
        assert outputs == [by, by]

    async def test_a_key_left_by_a_killed_process_is_taken_over_after_the_lease(
        self, tmp_path: Path
    ) -> None:
        db, calls = tmp_path / "runs.db", tmp_path / "calls.txt"
        killed = start(db, calls, 1, "--die")
        killed.communicate(timeout=60)
        assert killed.returncode == -9
        work = Agent()
        store = SQLiteStore(db, window=0.01, key_lease=0.3)
        result = await work.orchestrator(store).run([Task("work", 21, id="x", key="k")])
        assert work.calls == ["x"]
        assert result.data == {"x": {"answer": 42}}
        store.close()
