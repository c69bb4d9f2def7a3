"""SQLiteStore: durable runs on a real file, resumed after a real SIGKILL of a real process.

The store contract suite runs on SQLiteStore too (tests/test_store_contract.py); this file tests
what only a durable store does: resume, the journal, dead letters, keys across runs, the schema.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from contextlib import closing
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from orchestra import (
    BreakerPolicy,
    Context,
    Discard,
    InputError,
    Orchestrator,
    PermanentError,
    Rate,
    RetryPolicy,
    RunResult,
    StoreError,
    Task,
    agent,
)
from orchestra._admission import Admission
from orchestra._task import SUCCEEDED
from orchestra.stores import MemoryStore, SQLiteStore
from orchestra.stores._sqlite._schema import MIGRATIONS
from tests.helpers import REPO
from tests.test_store_contract import Heard

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from pathlib import Path

    from orchestra.testing import FakeClock

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

JOB = REPO / "tests" / "durable_job.py"


def job(db: Path, calls: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """Run tests/durable_job.py (run id "r") to its end or to its kill."""
    return subprocess.run(
        [sys.executable, str(JOB), str(db), "r", str(calls), *options],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
        check=False,
    )


def committed(db: Path) -> dict[str, tuple[str, int]]:
    """Each stored task's state and attempts, read from the file as another process sees it."""
    with closing(sqlite3.connect(db)) as conn:
        rows = conn.execute("SELECT id, state, attempts FROM tasks WHERE run_id = 'r'").fetchall()
    return {task_id: (state, attempts) for task_id, state, attempts in rows}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    path = tmp_path_factory.mktemp("whole")
    done = job(path / "runs.db", path / "calls.txt")
    assert done.returncode == 0, done.stderr
    return RunResult.model_validate_json(done.stdout)


@pytest.mark.subprocess
class TestResumeAfterKill:
    @pytest.mark.parametrize(
        "options",
        [
            ("--kill", "calls:3", "--window", "0.01"),
            ("--kill", "calls:14", "--window", "0.01"),
            ("--kill", "calls:25", "--window", "0.01"),
            ("--kill", "input:4", "--stream", "--window", "0.01"),
            ("--kill", "input:20", "--stream", "--window", "0.01"),
            ("--kill", "calls:12", "--stream", "--window", "0.01"),
        ],
        ids=lambda o: " ".join(o),
    )
    def test_no_committed_success_runs_again_and_the_result_is_the_uninterrupted_one(
        self, tmp_path: Path, uninterrupted: RunResult, options: tuple[str, ...]
    ) -> None:
        db, calls = tmp_path / "runs.db", tmp_path / "calls.txt"
        killed = job(db, calls, *options)
        assert killed.returncode == -9, killed.stderr
        before = committed(db)
        done_before = {i for i, (state, _) in before.items() if state == "succeeded"}
        calls.write_text("")
        resumed = job(db, calls, *options[2:])  # the same run, not killed
        assert resumed.returncode == 0, resumed.stderr
        result = RunResult.model_validate_json(resumed.stdout)
        ran_again = set(calls.read_text().split())
        assert not done_before & ran_again
        assert result.status == uninterrupted.status == "success"
        assert result.data == uninterrupted.data
        assert result.metadata.counts == uninterrupted.metadata.counts
        assert result.metadata.total == uninterrupted.metadata.total == 29
        assert result.metadata.resumed == len(done_before)
        # Every task exactly once in the file: no spawn or input task twice.
        after = committed(db)
        assert sorted(after) == sorted(
            {*(f"w{i}" for i in range(24)), "split", "total"} | {f"s{i}" for i in range(3)}
        )
        # A task that was running when the process died ran again, its attempt counted.
        for task_id, (state, attempts) in before.items():
            if state == "running":
                assert after[task_id] == ("succeeded", attempts + 1)

    def test_a_success_inside_the_window_runs_again_with_its_attempt_counted(
        self, tmp_path: Path, uninterrupted: RunResult
    ) -> None:
        db, calls = tmp_path / "runs.db", tmp_path / "calls.txt"
        # w0 sleeps past one commit (its start is written), returns, and the process dies before
        # the next commit (window 0.3 s).
        killed = job(db, calls, "--kill", "after:w0", "--window", "0.3")
        assert killed.returncode == -9, killed.stderr
        assert committed(db)["w0"] == ("running", 1)
        resumed = job(db, calls, "--window", "0.3")
        assert resumed.returncode == 0, resumed.stderr
        assert calls.read_text().split().count("w0") == 2
        assert committed(db)["w0"] == ("succeeded", 2)
        result = RunResult.model_validate_json(resumed.stdout)
        assert result.data == uninterrupted.data

    def test_a_finished_run_run_again_executes_nothing(
        self, tmp_path: Path, uninterrupted: RunResult
    ) -> None:
        db, calls = tmp_path / "runs.db", tmp_path / "calls.txt"
        assert job(db, calls).returncode == 0
        calls.write_text("")
        again = job(db, calls)
        assert again.returncode == 0, again.stderr
        assert calls.read_text() == ""
        result = RunResult.model_validate_json(again.stdout)
        assert result.data == uninterrupted.data
        assert result.metadata.resumed == 29


class TestResumeStreamed:
    @pytest.mark.parametrize("how", ["admit_one", "admit"], ids=["async input", "sync input"])
    def test_a_stored_task_done_before_the_input_gives_it_again_is_not_a_duplicate(
        self, tmp_path: Path, how: str
    ) -> None:
        """A streamed run forgets a succeeded task: a resumed one that ran a stored task before
        the input re-yielded it must still take that task as the same one (it once raised
        "duplicate task id")."""

        def open_run(store: SQLiteStore) -> Any:
            return store.open_run(
                "s",
                admission=Admission(["a"], {}),
                listener=Heard(),
                clock=lambda: 0.0,
                task_timeout=None,
                compact=True,  # a streamed input
            )

        def admit(run: Any, task: Task, index: int) -> None:
            if how == "admit_one":
                run.admit_one(task, index)
            else:
                run.admit([task], where="input item", forward=False, first_index=index)

        store = SQLiteStore(tmp_path / "runs.db")
        run = open_run(store)
        for i in range(2):
            admit(run, Task("a", i, id=f"t{i}"), i)
        first = run.claim()
        assert run.start(first, first.token, "x")  # t0 running when the process "dies"
        run.close()
        store.close()
        store = SQLiteStore(tmp_path / "runs.db")
        run = open_run(store)
        admit(run, Task("a", 0, id="t0"), 0)
        done = []
        while (record := run.claim()) is not None:  # t0 and t1, before t1 is given again
            assert run.start(record, record.token, "x")
            assert run.settle(record, record.token, SUCCEEDED, record.id)
            done.append(record.id)
        assert done == ["t0", "t1"]
        admit(run, Task("a", 1, id="t1"), 1)
        with pytest.raises(InputError, match="changed since the run started"):
            admit(run, Task("a", 99, id="t1"), 1)  # still checked against what was stored
        run.close_input()
        assert (run.unfinished, run.state_of("t1")) == (0, "succeeded")
        run.close()
        store.close()

    @pytest.mark.parametrize("how", ["admit_one", "admit"], ids=["async input", "sync input"])
    def test_ids_generated_on_a_resume_are_generated_again_on_the_next_one(
        self, tmp_path: Path, how: str
    ) -> None:
        # The input's tail first admitted by a resumed run gets its generated ids there; a
        # second resume must give them the same ids, not take them for ids the user gave (and
        # generate others: every such task a second time, under a new id).
        def resume(n: int) -> list[str]:
            store = SQLiteStore(tmp_path / "runs.db")
            run = store.open_run(
                "r",
                admission=Admission(["a"], {}),
                listener=Heard(),
                clock=lambda: 0.0,
                task_timeout=None,
                compact=True,  # a streamed input
            )
            tasks = [Task("a", i) for i in range(n)]
            for i, task in enumerate(tasks):
                if how == "admit_one":
                    run.admit_one(task, i)
                else:
                    run.admit([task], where="input item", forward=False, first_index=i)
            assert run.unfinished == n
            run.close()  # the process "dies" before the input's end
            store.close()
            return [task.id for task in tasks]

        assert resume(1) == ["a#1"]
        assert resume(3) == ["a#1", "a#2", "a#3"]
        assert resume(3) == ["a#1", "a#2", "a#3"]
        assert resume(4) == ["a#1", "a#2", "a#3", "a#4"]
        assert committed(tmp_path / "runs.db") == {f"a#{n}": ("ready", 0) for n in range(1, 5)}

    async def test_a_given_id_equal_to_a_forgotten_generated_one_is_refused_and_the_run_resumes(
        self, tmp_path: Path
    ) -> None:
        # "w#1" is generated, succeeds and is forgotten; a task given that id later would be a
        # second task under it, overwriting the first one's row (and the run could not resume).
        given = "w#1"

        def decompose(_: Any) -> Any:
            yield Task("w", "generated")
            for i in range(5):
                yield Task("w", i, id=f"x{i}")
            yield Task("w", "given", id=given)

        @agent(kinds=["w"])
        async def echo(task: Task, ctx: Context) -> Any:
            return task.payload

        db = tmp_path / "runs.db"
        store = SQLiteStore(db, window=0.01)
        seen = []

        async def read(orch: Orchestrator) -> None:
            async for result in orch.stream([None], run_id="r"):
                seen.append((result.task_id, result.output))

        async with Orchestrator(agents=[echo], decomposer=decompose, window=1, store=store) as orch:
            with pytest.raises(InputError, match="'w#1'") as caught:
                await read(orch)
        assert (caught.value.task_id, caught.value.field) == ("w#1", "id")
        assert seen[0] == ("w#1", "generated")
        assert [task_id for task_id, _ in seen].count("w#1") == 1
        with closing(sqlite3.connect(db)) as con:
            rows = con.execute("SELECT payload, output FROM tasks WHERE id = 'w#1'").fetchall()
        assert rows == [('"generated"', '"generated"')]
        async with Orchestrator(agents=[echo], decomposer=decompose, window=1, store=store) as orch:
            with pytest.raises(InputError, match="duplicate task id 'w#1'") as caught:
                await orch.run([None], run_id="r")  # resumed: refused again
        assert (caught.value.task_id, caught.value.field) == ("w#1", "id")
        given = "mine"  # the input fixed: the run resumes, and "w#1" is the generated task's
        async with Orchestrator(agents=[echo], decomposer=decompose, window=1, store=store) as orch:
            resumed = await orch.run([None], run_id="r")
        assert (resumed.status, resumed.data["w#1"], resumed.data["mine"]) == (
            "success",
            "generated",
            "given",
        )


# -- in process --------------------------------------------------------------------------------


def orchestrator(store: SQLiteStore, seen: list[str]) -> Orchestrator:
    @agent(kinds=["work"])
    async def work(task: Task, ctx: Context) -> Any:
        seen.append(task.id)
        if task.payload == "bad":
            raise PermanentError("refused")
        if task.payload == "unstorable":
            return object()
        return {"double": task.payload * 2}

    return Orchestrator(agents=[work], store=store, seed=1)


@pytest.fixture
def store(tmp_path: Path) -> SQLiteStore:
    return SQLiteStore(tmp_path / "runs.db", window=0.01)


@pytest.fixture
def seen() -> list[str]:
    return []


@pytest.fixture
def orch(store: SQLiteStore, seen: list[str]) -> Orchestrator:
    return orchestrator(store, seen)


class TestBackpressure:
    """While the writer thread is behind, the run waits for it: at most two windows are handed
    to the writer uncommitted, and nothing more is claimed or admitted until one is committed."""

    async def test_waiting_for_the_writer_under_a_fake_clock_does_not_jump_virtual_time(
        self, tmp_path: Path, clock: FakeClock
    ) -> None:
        # The run waits on the writer's thread, which the FakeClock cannot see: with nothing
        # else to run, it jumped to the next timer (this guard, a task's deadline) while the disk
        # worked, and a run of a few rate-limited tasks timed out in virtual time.
        @agent(kinds=["work"], limits=[Rate(2, per=1.0)])
        async def spawner(task: Task, ctx: Context) -> Any:
            if "/" not in (task.id or ""):
                ctx.spawn(Task("work", 0, id=f"{task.id}/c"))
            return task.payload

        store = SQLiteStore(tmp_path / "runs.db")
        orch = Orchestrator(agents=[spawner], store=store, concurrency=1)
        async with orch:
            with anyio.fail_after(60):  # virtual: 8 tasks at 2 a second take 4 s
                result = await orch.run(tasks=[Task("work", i, id=f"t{i}") for i in range(4)])
        assert result.metadata.counts["succeeded"] == 8

    async def test_a_stalled_writer_holds_a_fast_streamed_run_within_three_windows(
        self, tmp_path: Path, clock: FakeClock
    ) -> None:
        path = tmp_path / "runs.db"
        concurrency, pause, window, total = 4, 0.001, 0.05, 4_000

        @agent(kinds=["work"], concurrency=concurrency)
        async def quick(task: Task, ctx: Context) -> Any:
            await anyio.sleep(pause)
            return task.payload

        # A window gathers what ends in `window` seconds: each worker ends a task every `pause`.
        per_window = concurrency * (round(window / pause) + 1)
        store = SQLiteStore(path, window=window, busy_timeout=3)
        orch = Orchestrator(agents=[quick], store=store, aggregate=Discard())

        async def source() -> AsyncIterator[Task]:
            for i in range(total):
                yield Task("work", i, id=f"t{i}")

        holder = sqlite3.connect(path, isolation_level=None, timeout=30)  # another writer
        seen = deepest = at_lock = read_in_lock = 0
        released = anyio.Event()

        async def release() -> None:
            # While the run waits for the writer, the FakeClock does not jump (the writer is
            # real work): this second passes at the real pace, well within the busy timeout.
            await anyio.sleep(1)
            holder.execute("ROLLBACK")
            released.set()

        try:
            async with orch, anyio.create_task_group() as tg:
                async for _ in orch.stream(tasks=source(), run_id="r"):
                    seen += 1
                    deepest = max(deepest, store._writer.jobs.qsize())
                    if seen == 1_000:  # the file is locked: the writer thread waits for it
                        holder.execute("BEGIN IMMEDIATE")
                        at_lock = _succeeded(holder)
                        tg.start_soon(release)
                    elif at_lock and not released.is_set():
                        read_in_lock = seen
        finally:
            holder.close()
        store.close()
        # At most the two windows handed to the writer wait in its queue (both at once only in
        # the instant after a commit, before its thread takes the next one).
        assert deepest <= 2
        # Every result read was committed, or in the two windows handed to the writer, or in the
        # one being gathered.
        assert 0 < read_in_lock - at_lock <= 3 * per_window
        with closing(sqlite3.connect(path)) as conn:
            assert _succeeded(conn) == seen == total

    async def test_a_streamed_input_is_not_pulled_while_the_writer_is_behind(
        self, tmp_path: Path, clock: FakeClock
    ) -> None:
        path = tmp_path / "runs.db"
        every, window, total = 0.0005, 0.05, 4_000  # the input is slower than the agents

        @agent(kinds=["work"], concurrency=4)
        async def quick(task: Task, ctx: Context) -> Any:
            await anyio.sleep(0.001)
            return task.payload

        store = SQLiteStore(path, window=window, busy_timeout=10)  # (a loaded machine: slack)
        orch = Orchestrator(agents=[quick], store=store, aggregate=Discard())
        holder = sqlite3.connect(path, isolation_level=None, timeout=30)  # another writer
        pulled = pulled_in_lock = 0
        locked = released = False

        async def source() -> AsyncIterator[Task]:
            nonlocal pulled, pulled_in_lock, locked
            for i in range(total):
                await anyio.sleep(every)  # a page of a slow API, say
                pulled += 1
                if pulled == 1_000:  # the file is locked: the writer thread waits for it
                    holder.execute("BEGIN IMMEDIATE")
                    locked = True
                elif locked and not released:
                    pulled_in_lock += 1
                yield Task("work", i, id=f"t{i}")

        async def release() -> None:
            nonlocal released
            while not locked:
                await anyio.sleep(window)
            await anyio.sleep(
                1
            )  # (real pace, as above) the input would be pulled to its end by now
            released = True
            holder.execute("ROLLBACK")

        try:
            async with orch, anyio.create_task_group() as tg:
                tg.start_soon(release)
                result = await orch.run(tasks=source(), run_id="r")
        finally:
            holder.close()
        store.close()
        assert result.status == "success"
        # Pulled while the windows before the writer stopped (two, and the one gathered): at
        # most an item every `every` seconds for each; none when the writer was behind already
        # as the file was locked (a loaded machine). Unbounded input would be ~2,000 here.
        assert pulled_in_lock <= 3 * (window / every + 1)


def _succeeded(conn: sqlite3.Connection) -> int:
    return int(
        conn.execute(
            "SELECT count(*) FROM tasks WHERE run_id = 'r' AND state = 'succeeded'"
        ).fetchone()[0]
    )


class TestChangedInput:
    async def test_a_task_that_changed_under_its_id_is_refused_naming_it(
        self, orch: Orchestrator, seen: list[str]
    ) -> None:
        await orch.run([Task("work", 1, id="a"), Task("work", 2, id="b")], run_id="x")
        with pytest.raises(InputError, match=r"task 'b'.*changed since the run started") as err:
            await orch.run([Task("work", 1, id="a"), Task("work", 3, id="b")], run_id="x")
        assert err.value.task_id == "b"
        assert seen == ["a", "b"]

    async def test_generated_ids_are_generated_again_in_the_same_order(
        self, orch: Orchestrator, seen: list[str]
    ) -> None:
        first = await orch.run([Task("work", n) for n in range(5)], run_id="g")
        again = await orch.run([Task("work", n) for n in range(5)], run_id="g")
        assert len(seen) == 5
        assert again.data == first.data
        with pytest.raises(InputError, match="changed since the run started"):
            await orch.run([Task("work", n) for n in (0, 1, 9)], run_id="g")

    async def test_more_input_on_resume_runs_only_the_new_tasks(
        self, orch: Orchestrator, seen: list[str]
    ) -> None:
        await orch.run([Task("work", 1, id="a")], run_id="m")
        result = await orch.run([Task("work", 1, id="a"), Task("work", 2, id="b")], run_id="m")
        assert seen == ["a", "b"]
        assert result.data == {"a": {"double": 2}, "b": {"double": 4}}


class TestBadValues:
    async def test_a_payload_that_cannot_be_stored_is_refused_before_any_work(
        self, orch: Orchestrator, seen: list[str]
    ) -> None:
        with pytest.raises(InputError, match=r"'p2'.*cannot be stored as JSON") as err:
            await orch.run([Task("work", 1, id="p1"), Task("work", object(), id="p2")])
        assert (err.value.task_id, err.value.field) == ("p2", "payload")
        assert seen == []

    async def test_a_refused_input_lets_go_of_its_run_which_then_runs_corrected(
        self, orch: Orchestrator, store: SQLiteStore, seen: list[str]
    ) -> None:
        # Refused before anything ran: the run's hold in the file is let go of at once, so the
        # same id runs now (a typo fixed), here or in another process, not a lease later.
        with pytest.raises(InputError, match="no agent serves kind 'analyse'"):
            await orch.run([Task("analyse", 1, id="p1")], run_id="typo")
        (run,) = store.runs()
        assert run["owner"] is None
        result = await orch.run([Task("work", 1, id="p1")], run_id="typo")
        assert (result.status, result.data, seen) == ("success", {"p1": {"double": 2}}, ["p1"])

    @pytest.mark.parametrize(
        ("task", "field"),
        [
            (Task("work", 1, id="p2", priority=2**63), "priority"),
            (Task("work", 1, id="p2", priority=-(2**63) - 1), "priority"),
            (Task("work", 1, id="p2", key="k\ud800"), "key"),
            (Task("work", 1, id="p2\ud800"), "id"),
            (Task("work", 1, id="p2", metadata={"note": "a\ud800"}), "metadata"),
        ],
        ids=[
            "priority-too-big",
            "priority-too-small",
            "key-surrogate",
            "id-surrogate",
            "metadata-surrogate",
        ],
    )
    async def test_a_field_a_row_cannot_hold_is_refused_before_any_work(
        self, orch: Orchestrator, seen: list[str], task: Task, field: str
    ) -> None:
        # The memory run takes them; the file's first write failed (StoreError) after work.
        with pytest.raises(InputError, match=r"'p2") as err:
            await orch.run([Task("work", 1, id="p1"), task])
        assert err.value.field == field
        assert seen == []

    @pytest.mark.parametrize("priority", [2**63, -(2**63) - 1], ids=["too-big", "too-small"])
    async def test_a_new_priority_a_row_cannot_hold_is_refused_at_the_call(
        self, orch: Orchestrator, priority: int
    ) -> None:
        # It was taken (True), and the next write of the file failed the whole run.
        async with orch:
            handle = orch.start([Task("work", i, id=f"t{i}") for i in range(3)])
            for reprioritize in (handle.reprioritize, orch.reprioritize):
                with pytest.raises(InputError, match="64-bit") as err:
                    reprioritize("t2", priority)
                assert (err.value.task_id, err.value.field) == ("t2", "priority")
            result = await handle
        assert result.status == "success"

    async def test_an_output_that_cannot_be_stored_fails_its_attempt_naming_the_type(
        self, orch: Orchestrator
    ) -> None:
        result = await orch.run([Task("work", "unstorable", id="u")])
        error = result.error_for("u")
        assert error is not None
        assert error.error_type == "InvalidOutput"
        assert "task 'u': agent 'work' returned an object that cannot be stored as JSON" in (
            error.message
        )
        assert [a.error_type for a in error.attempts] == ["InvalidOutput"]  # the attempt's

    async def test_an_iterator_output_is_refused_not_stored_empty(
        self, store: SQLiteStore, tmp_path: Path
    ) -> None:
        @agent(kinds=["work"])
        async def lazy(task: Task, ctx: Context) -> Any:
            return map(str.upper, task.payload)

        @agent(kinds=["work"])
        async def eager(task: Task, ctx: Context) -> Any:
            return [s.upper() for s in task.payload]

        alone = Orchestrator(agents=[lazy], store=store)
        result = await alone.run([Task("work", ["a"], id="t")], run_id="lazy")
        error = result.error_for("t")
        assert error is not None
        assert error.error_type == "InvalidOutput"
        assert "returned a map that cannot be stored as JSON" in error.message
        assert "iterator" in error.message
        chained = Orchestrator(
            agents=[lazy, eager], fallbacks={"work": ["lazy", "eager"]}, store=store
        )
        result = await chained.run([Task("work", ["a", "b"], id="t")], run_id="chained")
        assert result.data == {"t": ["A", "B"]}  # the next agent of the chain took it
        assert result.metadata.fallbacks == 1
        store.close()
        with closing(sqlite3.connect(tmp_path / "runs.db")) as db:
            rows = dict(db.execute("SELECT run_id, output FROM tasks").fetchall())
        assert rows == {"lazy": None, "chained": '["A","B"]'}


class TestClaimsByRoom:
    """A SQLite run claims only what its agents can start now (a worker may claim the rest), but
    what waits for an agent that is down is claimed as in memory: it fails as fast."""

    async def test_tasks_of_an_agent_down_for_good_fail_as_fast_as_in_memory(
        self, tmp_path: Path, clock: FakeClock
    ) -> None:
        """An agent of `concurrency=2` whose service is down: each failed probe charges an
        attempt to every task waiting for it, so 20 tasks fail after the probes their retries
        allow, not two at a time."""
        runs: dict[str, tuple[str, int, float]] = {}
        for name, store in (("memory", MemoryStore()), ("sqlite", SQLiteStore(tmp_path / "r.db"))):
            calls: list[str] = []

            @agent(kinds=["work"], concurrency=2)
            async def down(task: Task, ctx: Context, calls: list[str] = calls) -> Any:
                calls.append(task.id)
                raise ConnectionError("the service is down")

            orch = Orchestrator(
                agents=[down],
                store=store,
                breaker=BreakerPolicy(min_calls=1, failure_rate=1.0),
                retry=RetryPolicy(max_attempts=3),
            )
            start = clock.time()
            result = await orch.run([Task("work", i) for i in range(20)], run_id="r")
            runs[name] = (result.status, len(calls), clock.time() - start)
        assert runs["sqlite"] == runs["memory"]
        assert runs["memory"][:2] == ("failed", 6)  # the calls are the probes, not 3 per task


class TestRetryFailed:
    async def test_a_reopened_task_gets_its_agents_attempts_again(self, tmp_path: Path) -> None:
        db = tmp_path / "runs.db"
        down_for = {"calls": 5}  # three attempts of the first run, two of the second

        @agent(kinds=["work"], name="svc")
        async def svc(task: Task, ctx: Context) -> str:
            if down_for["calls"]:
                down_for["calls"] -= 1
                raise ConnectionError("down")
            return "up"

        def orchestrator() -> Orchestrator:
            return Orchestrator(
                agents=[svc],
                store=SQLiteStore(db, window=0.01),
                breaker=None,
                retry=RetryPolicy(max_attempts=3, base=0.001, jitter="none"),
            )

        first = await orchestrator().run([Task("work", 1, id="d")], run_id="r")
        assert first.status == "failed"
        store = SQLiteStore(db)
        assert store.retry("r") == ["d"]
        store.close()
        again = await orchestrator().run([Task("work", 1, id="d")], run_id="r")
        assert again.status == "success"


class TestKeys:
    async def test_a_key_that_succeeded_in_another_run_returns_its_result_without_executing(
        self, orch: Orchestrator, seen: list[str]
    ) -> None:
        await orch.run([Task("work", 21, id="first", key="k")], run_id="one")
        result = await orch.run([Task("work", 21, id="second", key="k")], run_id="two")
        assert seen == ["first"]
        assert result.status == "success"
        assert result.data == {"second": {"double": 42}}

    async def test_the_key_holds_in_a_new_store_on_the_same_file(
        self, store: SQLiteStore, tmp_path: Path
    ) -> None:
        seen: list[str] = []
        await orchestrator(store, seen).run([Task("work", 1, key="k")], run_id="one")
        other = SQLiteStore(tmp_path / "runs.db")
        result = await orchestrator(other, seen).run([Task("work", 1, key="k")], run_id="two")
        assert seen == ["work#1"]
        assert result.data == {"work#1": {"double": 2}}

    async def test_tasks_with_one_key_in_a_run_execute_once_and_their_rows_keep_the_result(
        self, orch: Orchestrator, seen: list[str], tmp_path: Path
    ) -> None:
        # The second task with the key was dropped, so the task depending on it was refused as
        # depending on an unknown task; now it follows the first, and its row has the output.
        def tasks() -> list[Task]:
            return [
                Task("work", 21, id="a", key="k"),
                Task("work", 21, id="b", key="k"),
                Task("work", 1, id="c", depends_on=["b"]),
            ]

        result = await orch.run(tasks(), run_id="r")
        expected = {"a": {"double": 42}, "b": {"double": 42}, "c": {"double": 2}}
        assert (result.status, result.data) == ("success", expected)
        assert seen == ["a", "c"]
        # Every result read back from the file, by a store that never saw the run.
        reader = orchestrator(SQLiteStore(tmp_path / "runs.db"), seen)
        again = await reader.run(tasks(), run_id="r")
        assert (again.data, again.metadata.resumed) == (expected, 3)
        assert seen == ["a", "c"]

    async def test_when_the_holder_fails_the_next_task_with_its_key_runs_and_holds_it(
        self, orch: Orchestrator, seen: list[str]
    ) -> None:
        tasks = [Task("work", "bad", id="a", key="k"), Task("work", 21, id="b", key="k")]
        result = await orch.run(tasks, run_id="one")
        assert seen == ["a", "b"]
        assert result.data == {"b": {"double": 42}}
        # b claimed the key in the file when it took over: its result serves another run.
        later = await orch.run([Task("work", 21, id="c", key="k")], run_id="two")
        assert (later.data, seen) == ({"c": {"double": 42}}, ["a", "b"])


class TestJournal:
    async def test_the_journal_traces_a_task_from_ready_to_done(
        self, orch: Orchestrator, store: SQLiteStore
    ) -> None:
        await orch.run([Task("work", 1, id="a")], run_id="j")
        events = store.events("j", "a")
        assert [e["event"] for e in events] == ["admitted", "started", "succeeded"]
        assert events[1]["agent"] == "work"
        assert events[0]["at"] <= events[1]["at"] <= events[2]["at"]

    async def test_a_task_that_waited_and_failed_is_traced_in_order(
        self, orch: Orchestrator, store: SQLiteStore
    ) -> None:
        await orch.run(
            [Task("work", 1, id="ok"), Task("work", "bad", id="d", depends_on=["ok"])], run_id="w"
        )
        events = store.events("w", "d")
        assert [e["event"] for e in events] == [
            "admitted",
            "ready",
            "started",
            "attempt_failed",
            "failed",
        ]
        assert "refused" in events[-1]["detail"]
        assert [e["at"] for e in events] == sorted(e["at"] for e in events)
        whole = store.events("w")
        assert [e["event"] for e in whole if e["task_id"] == "d"] == [e["event"] for e in events]
        assert {e["task_id"] for e in whole} == {"ok", "d"}

    async def test_an_attempts_failure_a_hair_after_its_tasks_end_still_comes_first(
        self, orch: Orchestrator, store: SQLiteStore, tmp_path: Path
    ) -> None:
        # The two times are sums of different floats (the attempt's start plus its duration; the
        # task's end): one unit in the last place after the end put `failed` first (a flaky
        # `runs show --task`).
        await orch.run([Task("work", "bad", id="d")], run_id="w")
        with closing(sqlite3.connect(tmp_path / "runs.db")) as conn, conn:
            conn.execute(
                "UPDATE events SET at = (SELECT finished FROM tasks WHERE id = 'd') + 1e-6 "
                "WHERE task_id = 'd' AND event = 'attempt_failed'"
            )
        events = [e["event"] for e in store.events("w", "d")]
        assert events == ["admitted", "started", "attempt_failed", "failed"]

    async def test_a_spawned_task_is_admitted_after_its_spawner_succeeded_and_never_ready_before(
        self, store: SQLiteStore
    ) -> None:
        """`orchestra runs show --events` on the README's quick start listed a spawned task
        `ready` before its spawner's success and before its own admission."""

        @agent(kinds=["split"], name="split")
        async def split(task: Task, ctx: Context) -> int:
            ctx.spawn(Task("leaf", 1, id="p/c0"))
            return 1

        @agent(kinds=["leaf"], name="leaf")
        async def leaf(task: Task, ctx: Context) -> int:
            return 2

        await Orchestrator(agents=[split, leaf], store=store).run(
            [Task("split", 0, id="p")], run_id="s"
        )
        assert [e["event"] for e in store.events("s", "p/c0")] == [
            "admitted",
            "started",
            "succeeded",
        ]
        whole = [(e["task_id"], e["event"]) for e in store.events("s")]
        assert whole.index(("p", "succeeded")) < whole.index(("p/c0", "admitted"))

    @pytest.mark.parametrize("succeeds", [True, False])
    async def test_every_attempt_of_a_retried_task_starts_in_order_on_its_agent(
        self, store: SQLiteStore, succeeds: bool
    ) -> None:
        @agent(kinds=["flaky"], name="flaky")
        async def flaky(task: Task, ctx: Context) -> int:
            if ctx.attempt < 3 or not succeeds:
                raise ValueError("boom")
            return 1

        retry = RetryPolicy(max_attempts=3, base=0.001)
        await Orchestrator(agents=[flaky], store=store, retry=retry).run(
            [Task("flaky", 1, id="t")], run_id="r"
        )
        events = store.events("r", "t")
        assert [(e["event"], e["attempt"]) for e in events] == [
            ("admitted", None),
            ("started", 1),
            ("attempt_failed", 1),
            ("ready", None),
            ("started", 2),
            ("attempt_failed", 2),
            ("ready", None),
            ("started", 3),
        ] + ([("succeeded", 3)] if succeeds else [("attempt_failed", 3), ("failed", 3)])
        assert [e["at"] for e in events] == sorted(e["at"] for e in events)
        assert {e["agent"] for e in events if e["event"] == "started"} == {"flaky"}

    async def test_a_failed_task_is_a_dead_letter_with_its_attempts(
        self, orch: Orchestrator, store: SQLiteStore
    ) -> None:
        await orch.run([Task("work", "bad", id="d"), Task("work", 1, id="ok")], run_id="dl")
        dead = store.dead_letters("dl")
        assert [d["task_id"] for d in dead] == ["d"]
        assert dead[0]["error_type"] == "PermanentError"
        attempts = dead[0]["attempts_list"]
        assert [a["message"] for a in attempts] == ["refused"]
        assert "PermanentError" in (attempts[0]["traceback"] or "")
        assert [r["id"] for r in store.runs()] == ["dl"]


class TestSchema:
    def test_a_new_file_gets_the_newest_schema_in_wal_mode(self, tmp_path: Path) -> None:
        store = SQLiteStore(tmp_path / "new.db")
        assert store.runs() == []
        with closing(sqlite3.connect(tmp_path / "new.db")) as conn:
            assert conn.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"

    def test_a_version_1_file_is_migrated_with_its_journal_and_keys(self, tmp_path: Path) -> None:
        path = tmp_path / "v1.db"
        with sqlite3.connect(path) as conn:
            for statement in MIGRATIONS[0]:
                conn.execute(statement)
            conn.execute("PRAGMA user_version = 1")
            conn.execute("INSERT INTO runs (id, created, updated) VALUES ('old', 1, 1)")
            conn.execute(
                "INSERT INTO tasks (run_id, id, seq, idx, named, kind, payload, key, priority, "
                "state, attempts, started, finished, output, agent) "
                "VALUES ('old', 'a', 1, 0, 1, 'work', '1', 'k', 0, 'succeeded', 1, 2, 3, "
                "'{\"double\": 2}', 'work')"
            )
            conn.executemany(
                "INSERT INTO events (run_id, task_id, at, event, agent, attempt) "
                "VALUES ('old', 'a', ?, ?, ?, ?)",
                [(1, "ready", None, None), (2, "started", "work", 1), (3, "succeeded", "work", 1)],
            )
        conn.close()
        store = SQLiteStore(path)
        assert [e["event"] for e in store.events("old", "a")] == ["ready", "started", "succeeded"]
        with sqlite3.connect(path) as conn:
            assert conn.execute("SELECT task_id, state FROM keys").fetchall() == [
                ("a", "succeeded")
            ]
        conn.close()
        store.close()

    @pytest.mark.parametrize(
        ("prepare", "says"),
        [
            (lambda p: p.write_bytes(b"not a database at all" * 100), "not a SQLite database"),
            (
                lambda p: sqlite3.connect(p).execute("PRAGMA user_version = 99").connection.close(),
                "newer than this orchestra",
            ),
        ],
        ids=["corrupt", "newer"],
    )
    def test_a_file_it_cannot_use_is_a_store_error_that_says_why(
        self, tmp_path: Path, prepare: Callable[[Path], Any], says: str
    ) -> None:
        path = tmp_path / "bad.db"
        prepare(path)
        with pytest.raises(StoreError, match=says) as err:
            SQLiteStore(path).runs()
        assert "bad.db" in str(err.value)


@pytest.mark.subprocess
def test_the_job_script_output_is_json(tmp_path: Path) -> None:
    """The subprocess tests read stdout as the RunResult: nothing else may reach it."""
    done = job(tmp_path / "runs.db", tmp_path / "calls.txt")
    assert json.loads(done.stdout)["status"] == "success"
