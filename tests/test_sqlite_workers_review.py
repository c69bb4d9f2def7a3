"""Adversarial review of worker processes on a SQLite file: restarts, races between the
coordinator's window and workers' claims, signals in the middle of a claim, a coordinator paused
past its lease. Real processes, real signals, real SQLite files (helpers from
tests/test_sqlite_workers.py)."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import sqlite3
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from orchestra import ConfigError, Context, Orchestrator, StoreError, Task, agent
from orchestra.stores import SQLiteStore
from tests.helpers import spawn

from .test_sqlite_workers import REPO, ran, recorder, rows, start_coordinator, start_worker, until

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


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


async def test_a_restart_takes_back_a_dead_workers_lease_with_no_worker_left(
    tmp_path: Path,
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


async def test_a_lease_that_expires_while_the_coordinator_asks_for_the_task_is_not_lost(
    tmp_path: Path,
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


async def test_a_worker_stopped_by_sigterm_inside_a_claim_hands_back_what_it_claimed(
    tmp_path: Path,
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
    worker.send_signal(signal.SIGSTOP)  # live in the file (its heartbeat is fresh), not claiming
    here: list[tuple[str, str]] = []
    orch = Orchestrator(agents=[recorder("here", here)], store=SQLiteStore(db))
    async with orch:
        handle = orch.start(tasks=[Task("work", i, id=f"t{i}") for i in range(3)], run_id="r")
        handle.pause()
        await until(lambda: rows(db, "SELECT shared FROM runs") == [(1,)])
        await until(lambda: rows(db, "SELECT count(*) FROM tasks WHERE state = 'ready'") == [(3,)])
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


async def test_a_restart_with_other_agents_routes_a_task_the_dead_coordinator_was_running(
    tmp_path: Path,
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
        result = await again.run(tasks=[Task("work", i, id=f"t{i}") for i in range(3)], run_id="r")
    assert result.status == "success"
    assert result.data == {"t0": 0, "t1": 2, "t2": 4}
    assert ("here", "t1") in here


async def test_a_coordinator_paused_past_its_lease_does_not_write_over_its_successor(
    tmp_path: Path,
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


async def test_a_task_spawned_on_a_worker_with_metadata_json_cannot_say_does_not_kill_it(
    tmp_path: Path,
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


async def test_a_closed_store_is_refused_not_waited_on_forever(tmp_path: Path) -> None:
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


async def test_bad_kinds_for_a_worker_are_config_errors_that_say_so(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "runs.db")
    orch = Orchestrator(agents=[recorder("here", [])])
    with pytest.raises(ConfigError, match="kinds must be a list of kinds"):
        await orch.work(store, kinds=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="kinds must be a list of kinds"):
        await orch.work(store, kinds=[["work"]])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="kinds is empty"):
        await orch.work(store, kinds=[])


def test_the_cli_says_an_empty_kinds_is_empty(tmp_path: Path) -> None:
    SQLiteStore(tmp_path / "runs.db").runs()
    empty = subprocess.run(
        [sys.executable, "-m", "orchestra", "worker", "--db", str(tmp_path / "runs.db"),
         "--agents", "tests/worker_job.py:agents", "--kinds", " , "],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert empty.returncode == 2
    assert "kinds is empty" in empty.stderr


def start_stopping_worker(db: Path, calls: Path) -> subprocess.Popen[str]:
    """A worker (tests/worker_job.py:agents_stopping_in_a_commit) that stops itself (SIGSTOP)
    inside the transaction of its first completion: it holds the file's write lock, stopped."""
    env = {**os.environ, "WORKER_CALLS": str(calls), "PYTHONPATH": str(REPO)}
    return spawn(
        [sys.executable, "-m", "orchestra", "worker", "--db", str(db), "--agents",
         "tests/worker_job.py:agents_stopping_in_a_commit", "--run-id", "r", "--lease", "1"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


async def test_a_worker_stopped_while_it_holds_the_write_lock_stops_the_run_and_loses_nothing(
    tmp_path: Path,
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


async def test_a_file_locked_by_a_stopped_worker_does_not_block_the_coordinators_loop(
    tmp_path: Path,
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
            handle = orch.start(tasks=[Task("work", i, id=f"t{i}") for i in range(3)], run_id="r")
            handle.pause()  # the worker takes them all, and stops in its first commit
            with anyio.fail_after(60), pytest.raises(StoreError, match="holds it locked"):
                await handle
            note()  # the loop's last gap: it may end here
            tg.cancel_scope.cancel()
    finally:
        kill(stopped)
    assert gaps[0] < 2.5  # one busy timeout (the write in flight), not one per queued window


async def test_a_second_run_of_a_run_id_on_the_same_store_object_is_refused(
    tmp_path: Path,
) -> None:
    """Two coordinators of one run id on one `SQLiteStore` object (one process): the file knows
    them by one name, so the second was let in and every task ran twice."""
    calls: list[tuple[str, str]] = []
    orch = Orchestrator(agents=[recorder("here", calls, 0.2)], store=SQLiteStore(tmp_path / "r.db"))
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


async def test_tasks_a_stopping_worker_hands_back_are_run_by_a_coordinator_that_asked_for_them(
    tmp_path: Path,
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


async def test_a_worker_does_not_hold_more_tasks_than_its_agents_can_start(
    tmp_path: Path,
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
