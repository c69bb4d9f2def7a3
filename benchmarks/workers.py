"""Claim + complete throughput of worker processes on one SQLite file (issue 16's benchmark row).

``python -m benchmarks.workers [N] [REPS]`` (default 3,000 tasks, 3 repetitions): for 1, 2 and 3
worker processes (``orchestra worker --db FILE --agents benchmarks.workers:agents --run-id r``,
started and registered before the clock starts), a coordinator in this process runs N no-op tasks
paused (it runs none itself: every task is claimed, run and completed by a worker) and is timed from
`start` to its `RunResult` (every completion settled and committed). The worker counts alternate
between repetitions; the median is reported. A target is reported, never asserted.
"""

from __future__ import annotations

import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

from orchestra import Context, Orchestrator, Task, agent
from orchestra.stores import SQLiteStore

ROOT = Path(__file__).resolve().parent.parent
COUNTS = (1, 2, 3)


@agent(kinds=["noop"])
async def noop(task: Task, ctx: Context) -> None:
    return None


def agents() -> Orchestrator:
    """The workers' agents (``--agents benchmarks.workers:agents``)."""
    return Orchestrator(agents=[noop], concurrency=64)


def measure(db: Path, workers: int, n: int) -> float:
    """Seconds for `n` tasks run by `workers` worker processes."""
    SQLiteStore(db).runs()  # the schema, before the processes open the file
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "orchestra", "worker", "--db", str(db), "--agents",
             "benchmarks.workers:agents", "--run-id", "r"],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for _ in range(workers)
    ]  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while _registered(db) < workers:  # started and registered before the clock starts
            if time.monotonic() > deadline:
                raise RuntimeError("the workers did not start")
            time.sleep(0.02)
        return anyio.run(_timed, db, n)
    finally:
        for proc in procs:
            _, err = proc.communicate(timeout=60)
            if proc.returncode != 0:
                raise RuntimeError(f"a worker failed: {err.decode()}")


async def _timed(db: Path, n: int) -> float:
    orch = Orchestrator(agents=[noop], store=SQLiteStore(db))
    async with orch:
        start = time.perf_counter()
        handle = orch.start(tasks=[Task("noop", i) for i in range(n)], run_id="r")
        handle.pause()  # the coordinator runs none: the workers run them all
        result = await handle
        elapsed = time.perf_counter() - start
    assert result.metadata.counts["succeeded"] == n, result.metadata.counts
    return elapsed


def _registered(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT count(*) FROM workers").fetchone()[0])


def run(n: int, reps: int) -> dict[int, list[float]]:
    """Seconds per repetition, by worker count."""
    times: dict[int, list[float]] = {k: [] for k in COUNTS}
    for rep in range(reps):
        order = COUNTS if rep % 2 == 0 else COUNTS[::-1]
        for workers in order:
            with tempfile.TemporaryDirectory() as directory:
                times[workers].append(measure(Path(directory) / "runs.db", workers, n))
    return times


def table(n: int, times: dict[int, list[float]]) -> list[str]:
    lines = [
        f"| worker processes | {n:,} no-op tasks, median | tasks/s (claim + run + complete) |",
        "| --- | --- | --- |",
    ]
    for workers, seconds in times.items():
        median = statistics.median(seconds)
        lines.append(f"| {workers} | {median:.2f} s | {n / median:,.0f} |")
    return lines


def main(n: int, reps: int) -> None:
    times = run(n, reps)
    print("\n".join(table(n, times)))
    one, three = (statistics.median(times[k]) for k in (1, 3))
    print(f"\n3 workers / 1 worker throughput: {one / three:.2f}x")


if __name__ == "__main__":
    main(
        int(sys.argv[1]) if len(sys.argv) > 1 else 3_000,
        int(sys.argv[2]) if len(sys.argv) > 2 else 3,
    )
