"""Scenario 10, durable runs on SQLite (issue 16's benchmark rows), and the store scenario 3 adds.

Every row runs in the suite's fresh child processes, like any other variant:

- **Transitions per second** (``memory_noop`` / ``sqlite_noop``, ``memory_retry`` /
  ``sqlite_retry``): N tasks on one agent, no-op, and the same with every fifth task failing its
  first attempt (a `RetryableError`, retried at once: ``RetryPolicy(base=0)``), each beside the
  same run on `MemoryStore`. The transitions counted are the states a task enters: its admission,
  then for every attempt ready, claimed and running, and the attempt's end (a failed attempt that
  waits for its retry, or the task's success): ``1 + 4 x attempts`` per task, 5 for a task that
  succeeds at once, 9 for one retried once. They are counted from the `RunResult`
  (``metadata.total``, ``metadata.attempts``) and, on SQLite, checked against the file once the
  run returned: the ``tasks`` rows, their ``attempts`` summed, and one ``attempts`` row per failed
  attempt. The rate is over the time from building the tasks to the `RunResult` (every row
  committed); the check is not timed.
- **Resume** (``sqlite_resume``): a run of N tasks killed with SIGKILL once 90 % of them
  succeeded (`build_killed_run`: a real run in its own process whose last tenth blocks, killed
  when the file shows the 90 % committed; built untimed, before the clock), then the same input
  run again with the same run id. Timed from the `orch.run` call to the first attempt starting
  again (``first_attempt_s``) and to the `RunResult` (``run_s``); the agent counts its calls, so
  a resume that ran a finished task again fails the row.
- **Durability on the latency-bound scenario**: ``orchestra_sqlite`` in scenario 3 (built in
  `variants.py`) is the ``orchestra`` variant with `temporary_store()`.
- **Claim + complete throughput with 1, 2 and 3 worker processes** (``sqlite_workers_1`` ...
  ``_3``): `claim_complete`, N no-op tasks all claimed, run and completed by worker processes.

    python -m benchmarks.durable build PATH N DONE LIMIT    # what build_killed_run starts
"""

from __future__ import annotations

import asyncio
import atexit
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    from orchestra.stores import SQLiteStore

    from .spec import Spec

    Workload = Callable[[], Coroutine[Any, Any, dict[str, Any]]]

#: Every FAIL_EVERY-th task of a ``*_retry`` run fails its first attempt: 20 % of the tasks.
FAIL_EVERY = 5
#: The share of a resumed run that had succeeded when its first process was killed.
DONE_SHARE = 0.9
RUN_ID = "bench"
ROOT = Path(__file__).resolve().parent.parent


def temporary_store() -> SQLiteStore:
    """A `SQLiteStore` on a new file in a temporary directory, removed when the process exits."""
    from orchestra.stores import SQLiteStore

    directory = tempfile.mkdtemp(prefix="orchestra-bench-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return SQLiteStore(Path(directory) / "runs.db")


def transitions_of(total: int, attempts: int) -> int:
    """Admission, then ready, claimed, running and an end per attempt (see the module's docstring)."""
    return total + 4 * attempts


# --------------------------------------------------------------------------- transitions


def transitions(spec: Spec, store_name: str, fail_every: int) -> Workload:
    """Scenario 10's throughput rows: ``spec.n`` tasks on `store_name`, every ``fail_every``-th one
    failing its first attempt (0: none)."""
    from orchestra import Orchestrator, RetryableError, RetryPolicy, Task, agent
    from orchestra.stores import MemoryStore

    store = temporary_store() if store_name == "sqlite" else MemoryStore()
    n, limit = spec.n, spec.limit

    @agent(kinds=["work"], name="work")
    async def work(task: Any, ctx: Any) -> None:
        if fail_every and task.payload % fail_every == 0 and ctx.attempt == 1:
            raise RetryableError("the first attempt of every fifth task fails")

    async def run() -> dict[str, Any]:
        start = time.perf_counter()
        async with Orchestrator(
            agents=[work], concurrency=limit, store=store, retry=RetryPolicy(base=0.0)
        ) as orch:
            result = await orch.run(tasks=[Task("work", i) for i in range(n)], run_id=RUN_ID)
        run_s = time.perf_counter() - start
        meta = result.metadata
        failed_first = len(range(0, n, fail_every)) if fail_every else 0
        out: dict[str, Any] = {
            "completed": meta.counts.get("succeeded", 0),
            "attempts": meta.attempts,
            "transitions": transitions_of(meta.total, meta.attempts),
            "run_s": run_s,
        }
        if meta.attempts != n + failed_first:
            out["error"] = f"{meta.attempts} attempts, expected {n + failed_first}"
        elif store_name == "sqlite":
            out.update(_check_file(store.path, n, meta.attempts))  # type: ignore[union-attr]
        return out

    return run


def _check_file(path: Path, n: int, attempts: int) -> dict[str, Any]:
    """What the file says the run did: a task row each, and the attempts counted in the result."""
    with closing(sqlite3.connect(path)) as conn:
        rows, summed, succeeded = conn.execute(
            "SELECT count(*), sum(attempts), sum(state = 'succeeded') FROM tasks WHERE run_id = ?",
            (RUN_ID,),
        ).fetchone()
        (failed,) = conn.execute(
            "SELECT count(*) FROM attempts WHERE run_id = ?", (RUN_ID,)
        ).fetchone()
    conn.close()
    if (rows, summed, succeeded, failed) != (n, attempts, n, attempts - n):
        return {
            "error": f"the file holds {rows} tasks ({succeeded} succeeded), {summed} attempts, "
            f"{failed} failed attempts; the result says {n} tasks, {attempts} attempts"
        }
    return {}


# --------------------------------------------------------------------------- resume


def resume(spec: Spec) -> Workload:
    """Scenario 10's resume row: the file of a killed run built first, then the same run again."""
    from orchestra import Orchestrator, Task, agent

    n, limit = spec.n, spec.limit
    done = int(n * DONE_SHARE)
    store = temporary_store()
    build_killed_run(store.path, n, done, limit)
    calls: list[float] = []

    @agent(kinds=["work"], name="work")
    async def work(task: Any, ctx: Any) -> None:
        calls.append(time.perf_counter())

    async def run() -> dict[str, Any]:
        tasks = [Task("work", i) for i in range(n)]
        async with Orchestrator(agents=[work], concurrency=limit, store=store) as orch:
            start = time.perf_counter()
            result = await orch.run(tasks=tasks, run_id=RUN_ID)
            end = time.perf_counter()
        meta = result.metadata
        out: dict[str, Any] = {
            "completed": meta.counts.get("succeeded", 0),
            "resumed": meta.resumed,
            "executed": len(calls),
            "first_attempt_s": calls[0] - start if calls else None,
            "run_s": end - start,
        }
        if meta.resumed != done or len(calls) != n - done:
            out["error"] = (
                f"resumed {meta.resumed} tasks and executed {len(calls)}; "
                f"expected {done} and {n - done}"
            )
        return out

    return run


def build_killed_run(path: Path, n: int, done: int, limit: int, timeout: float = 300.0) -> None:
    """Leave at `path` the file of a run of `n` tasks killed with SIGKILL after `done` succeeded.

    The run is real and in its own process (``python -m benchmarks.durable build``): its tasks from
    `done` on block forever, so `limit` of them are running and the rest wait when this process,
    polling the file, sees `done` successes committed and kills it.
    """
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.durable",
            "build",
            str(path),
            str(n),
            str(done),
            str(limit),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + timeout
    try:
        while _succeeded(path) < done:
            if proc.poll() is not None:
                stderr = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"the run to kill exited {proc.returncode}: {stderr[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the run to kill did not reach {done} successes in {timeout} s")
            time.sleep(0.02)  # a poll: another process's commits signal nothing here
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stderr:
            proc.stderr.close()


def _succeeded(path: Path) -> int:
    if not path.exists():
        return 0
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as conn:
            (count,) = conn.execute(
                "SELECT count(*) FROM tasks WHERE run_id = ? AND state = 'succeeded'", (RUN_ID,)
            ).fetchone()
    except sqlite3.OperationalError:  # the schema is not there yet
        return 0
    return int(count)


async def _doomed_run(path: Path, n: int, done: int, limit: int) -> None:
    from orchestra import Orchestrator, Task, agent
    from orchestra.stores import SQLiteStore

    never = asyncio.Event()

    @agent(kinds=["work"], name="work")
    async def work(task: Any, ctx: Any) -> None:
        if task.payload >= done:
            await never.wait()  # held until the process is killed

    orch = Orchestrator(agents=[work], concurrency=limit, store=SQLiteStore(path))
    await orch.run(tasks=[Task("work", i) for i in range(n)], run_id=RUN_ID)


# --------------------------------------------------------------------------- worker processes


def claim_complete(spec: Spec, workers: int) -> Workload:
    """Scenario 10's worker rows: ``spec.n`` no-op tasks run by `workers` worker processes
    (``orchestra worker``, started and registered before the clock starts) for a coordinator in
    this process that runs none itself (paused); timed from `start` to the `RunResult`, every
    completion settled and committed. The journal must show one claim per task."""
    from orchestra import Orchestrator, Task

    n = spec.n
    store = temporary_store()
    store.runs()  # the schema, before the worker processes open the file
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "orchestra", "worker", "--db", str(store.path), "--agents",
             "benchmarks.durable:worker_agents", "--run-id", RUN_ID],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for _ in range(workers)
    ]  # fmt: skip
    deadline = time.monotonic() + 60
    while len(store.workers()) < workers:  # a poll: the workers' commits signal nothing here
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError(f"the {workers} worker processes did not start")
        time.sleep(0.02)

    async def run() -> dict[str, Any]:
        orch = Orchestrator(agents=[_noop()], store=store)
        async with orch:
            start = time.perf_counter()
            handle = orch.start(tasks=[Task("work", i) for i in range(n)], run_id=RUN_ID)
            handle.pause()  # the coordinator runs none: the workers run them all
            result = await handle
            run_s = time.perf_counter() - start
        failed = []
        for proc in procs:
            _, err = await asyncio.to_thread(proc.communicate, timeout=60)
            if proc.returncode != 0:
                failed.append(err.decode()[-500:])
        with sqlite3.connect(store.path) as conn:
            claims, distinct = conn.execute(
                "SELECT count(*), count(DISTINCT task_id) FROM events WHERE event = 'claimed'"
            ).fetchone()
        conn.close()
        out: dict[str, Any] = {
            "completed": result.metadata.counts.get("succeeded", 0),
            "workers": workers,
            "run_s": run_s,
            "tasks_per_s": n / run_s,
        }
        if failed:
            out["error"] = f"a worker failed: {failed[0]}"
        elif (claims, distinct) != (n, n) or out["completed"] != n:
            out["error"] = f"{claims} claims of {distinct} tasks, {out['completed']} succeeded"
        return out

    return run


def worker_agents() -> Any:
    """The worker processes' agents (``--agents benchmarks.durable:worker_agents``)."""
    from orchestra import Orchestrator

    return Orchestrator(agents=[_noop()], concurrency=64)


def _noop() -> Any:
    from orchestra import agent

    @agent(kinds=["work"], name="work")
    async def work(task: Any, ctx: Any) -> None:
        return None

    return work


def main(argv: list[str]) -> int:
    if len(argv) == 5 and argv[0] == "build":
        path, n, done, limit = Path(argv[1]), int(argv[2]), int(argv[3]), int(argv[4])
        asyncio.run(_doomed_run(path, n, done, limit))
        return 0
    print("usage: python -m benchmarks.durable build PATH N DONE LIMIT", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
