"""Idempotency keys under concurrency: many submissions of one key, from two store objects on one
file and from two processes, execute once; the others return the stored result."""

from __future__ import annotations

import asyncio
import json
import os
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
