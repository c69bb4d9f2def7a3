"""Idempotency keys under concurrency: many submissions of one key, from two store objects on one
file and from two processes, execute once; the others return the stored result."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import closing
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
        store.close()
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
        store = SQLiteStore(tmp_path / "runs.db", window=0.01)
        async with work.orchestrator(store) as orch:
            with anyio.fail_after(30):
                result = await orch.run(tasks=source(), run_id="one")
        store.close()
        assert (result.status, result.data) == ("success", {"a": {"answer": 4}, "b": {"answer": 4}})
        assert work.calls == ["b"]


def _holder(db: Path, key: str) -> str | None:
    """The task that holds `key` in the file, or last held it."""
    with closing(sqlite3.connect(db)) as conn:
        row = conn.execute("SELECT task_id FROM keys WHERE key = ?", (key,)).fetchone()
    return None if row is None else str(row[0])


class Gated:
    """An agent of "work" that doubles its payload, recording each call; a task whose id it gates
    says it was called (`called[id]`) and waits for `go[id]` before it answers."""

    def __init__(self, *gated: str) -> None:
        self.calls: list[str] = []
        self.called = {task_id: asyncio.Event() for task_id in gated}
        self.go = {task_id: asyncio.Event() for task_id in gated}

        @agent(kinds=["work"])
        async def work(task: Task, ctx: Context) -> Any:
            self.calls.append(task.id)
            if task.id in self.go:
                self.called[task.id].set()
                await self.go[task.id].wait()
            return task.payload * 2

        self.agent = work


class TestASuccessDuringItsWindowsCommit:
    """A keyed task that succeeds while the window that wrote it running is being committed: its
    key is written succeeded by the next window, never released as a failure."""

    async def test_the_key_is_stored_succeeded_and_neither_a_waiter_nor_a_later_run_executes_it(
        self, tmp_path: Path
    ) -> None:
        db = tmp_path / "runs.db"
        holder, other = SQLiteStore(db, window=0.2), SQLiteStore(db, window=0.01)
        gated = Gated("a", "b")
        calls, called, go, work = gated.calls, gated.called, gated.go, gated.agent

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
        holder.close()
        with closing(sqlite3.connect(db)) as con:
            assert con.execute("SELECT state, output FROM keys").fetchall() == [("succeeded", "42")]
        assert (waited.status, waited.data) == ("success", {"w": 42})
        assert (later.status, later.data) == ("success", {"c": 42})
        assert calls == ["a", "b"]


class TestAWaitersLookAtTheFile:
    async def test_a_waiting_task_is_never_handed_out_while_its_key_is_being_asked_for(
        self, tmp_path: Path
    ) -> None:
        # "w" waits for the key "one" holds, ready behind "x" (one slot). Its run asks the file
        # for the key every window; "x" ends while one of those questions waits for the file:
        # "w" must stay held, not be handed to the freed slot and run the key a second time.
        db = tmp_path / "runs.db"
        holder, other = SQLiteStore(db, window=0.01), SQLiteStore(db, window=0.01)
        gated = Gated("a", "x")
        calls, called, go, work = gated.calls, gated.called, gated.go, gated.agent

        first = asyncio.ensure_future(
            Orchestrator(agents=[work], store=holder).run(
                [Task("work", 21, id="a", key="k")], run_id="one"
            )
        )
        await called["a"].wait()
        second = asyncio.ensure_future(
            Orchestrator(agents=[work], store=other, concurrency=1).run(
                [Task("work", 1, id="x"), Task("work", 21, id="w", key="k")], run_id="two"
            )
        )
        await called["x"].wait()
        await asyncio.sleep(0.1)  # "w" waits for the key
        locked = threading.Event()

        def lock() -> None:  # the next question waits for the file, for 0.4 s
            with closing(sqlite3.connect(db, isolation_level=None)) as conn:
                conn.execute("BEGIN IMMEDIATE")
                locked.set()
                time.sleep(0.4)
                conn.rollback()

        locking = threading.Thread(target=lock)
        locking.start()
        await anyio.to_thread.run_sync(locked.wait)
        await asyncio.sleep(0.1)
        go["x"].set()  # the slot is free while it waits
        await anyio.to_thread.run_sync(locking.join)
        await asyncio.sleep(0.1)
        go["a"].set()
        with anyio.fail_after(30):
            assert (await first).status == "success"
            result = await second
        assert (result.status, result.data) == ("success", {"x": 2, "w": 42})
        assert calls == ["a", "x"]
        holder.close()
        other.close()

    @pytest.mark.parametrize("end", ["the run stops", "the task is cancelled"])
    async def test_a_task_that_ends_while_the_file_answers_lets_go_of_the_key_it_was_given(
        self, tmp_path: Path, end: str
    ) -> None:
        # "s" waits for the key "b" holds; "b" fails, and the file gives the key to "s" in
        # answer to a question asked just before "s" ended: its run releases the key, so that
        # "t", submitted later, runs at once instead of waiting out the lease.
        db = tmp_path / "runs.db"
        steered = SQLiteStore(db, window=1.0, key_lease=3600)  # asks the file once a second
        other = SQLiteStore(db, window=0.01, key_lease=3600)
        calls: list[str] = []
        holding = asyncio.Event()
        fail = asyncio.Event()
        done = asyncio.Event()

        @agent(kinds=["work"])
        async def work(task: Task, ctx: Context) -> Any:
            calls.append(task.id)
            if task.id == "b":
                holding.set()
                await fail.wait()
                raise PermanentError("no")
            if task.id == "keep":  # the run goes on after "s" is cancelled
                await done.wait()
            return task.id

        async def asking(keys: Any, now: bool) -> None:
            """Until the steered run's question to the file is (not) under way."""
            with anyio.fail_after(30):
                while (keys._asking is not None) != now:
                    await asyncio.sleep(0.001)

        async with (
            Orchestrator(agents=[work], store=steered) as orch,
            Orchestrator(agents=[work], store=other) as elsewhere,
        ):
            holder = elsewhere.start(tasks=[Task("work", 1, id="b", key="k")], run_id="b")
            await holding.wait()
            steered_run = orch.start(
                tasks=[Task("work", 1, id="s", key="k"), Task("work", 1, id="keep")], run_id="s"
            )
            with anyio.fail_after(30):
                while "s" not in steered.open_runs:
                    await asyncio.sleep(0.001)
            keys = steered.open_runs["s"]._keys
            await asking(keys, True)  # "s" waits for the key: a question, answered "b has it"
            await asking(keys, False)  # the next one comes a second later
            fail.set()
            assert (await holder).status == "failed"  # the key is released in the file
            locked, unlock = threading.Event(), threading.Event()

            def lock() -> None:  # the next question waits for the file until "s" ended, and
                # the window that writes its end is built
                with closing(sqlite3.connect(db, isolation_level=None)) as conn:
                    conn.execute("BEGIN IMMEDIATE")
                    locked.set()
                    unlock.wait(30)
                    time.sleep(0.2)
                    conn.rollback()

            locking = threading.Thread(target=lock)
            locking.start()
            await anyio.to_thread.run_sync(locked.wait)
            await asking(keys, True)  # asked: the answer waits for the lock
            if end == "the run stops":  # (its end is written, blocking, once the file is free)
                threading.Timer(0.3, unlock.set).start()
                assert (await steered_run.stop(grace=0)).status == "cancelled"
            else:
                assert steered_run.cancel(task_id="s").cancelled == ("s",)
            unlock.set()
            await anyio.to_thread.run_sync(locking.join)
            with anyio.fail_after(30):  # the file has answered: the key is "s"'s
                while _holder(db, "k") != "s":
                    await asyncio.sleep(0.01)
            with anyio.fail_after(30):  # far shorter than the key's lease
                later = await elsewhere.run(tasks=[Task("work", 1, id="t", key="k")], run_id="t")
            done.set()
            await steered_run
        steered.close()
        other.close()
        assert (later.status, later.data) == ("success", {"t": "t"})
        assert sorted(calls) == ["b", "keep", "t"]


@pytest.mark.subprocess
class TestProcesses:
    def test_two_processes_submitting_one_key_execute_it_once(self, tmp_path: Path) -> None:
        db, calls = tmp_path / "runs.db", tmp_path / "calls.txt"
        SQLiteStore(db).close()  # the schema, before the race
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
        SQLiteStore(db).close()  # the schema, before the race
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
