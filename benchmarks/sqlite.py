"""No-op throughput of a durable run: SQLiteStore against MemoryStore (issue 16's benchmark row).

``python -m benchmarks.sqlite [N] [REPS]`` (default 20,000 tasks, 3 repetitions): each measurement in
a fresh process (``python -m benchmarks.sqlite --child STORE N``), the stores alternating, the
median reported. Timed: `Orchestrator.run` over N no-op tasks, admission to the returned
`RunResult` (for SQLite: every row committed, the journal included). A target is reported, never
asserted: SQLite within a small factor of memory.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from orchestra import Context, Orchestrator, Task, agent
from orchestra.stores import MemoryStore, SQLiteStore


@agent(kinds=["noop"])
async def noop(task: Task, ctx: Context) -> None:
    return None


async def measure(store_name: str, n: int, directory: str) -> float:
    store: Any = (
        MemoryStore() if store_name == "memory" else SQLiteStore(Path(directory) / "runs.db")
    )
    orch = Orchestrator(agents=[noop], store=store, concurrency=100)
    await orch.run([Task("noop", i) for i in range(200)], run_id="warm-up")
    tasks = [Task("noop", i) for i in range(n)]
    start = time.perf_counter()
    result = await orch.run(tasks, run_id="timed")
    elapsed = time.perf_counter() - start
    assert result.metadata.counts["succeeded"] == n
    if isinstance(store, SQLiteStore):
        store.close()
    return elapsed


def child(store_name: str, n: int) -> None:
    # structlog left unconfigured (its run lines go to stdout, before ours): configured, it would
    # turn on the per-task DEBUG lines and time those instead.
    with tempfile.TemporaryDirectory() as directory:
        elapsed = asyncio.run(measure(store_name, n, directory))
    print(json.dumps({"store": store_name, "n": n, "seconds": elapsed}))


def main(n: int, reps: int) -> None:
    times: dict[str, list[float]] = {"memory": [], "sqlite": []}
    for rep in range(reps):
        order = ["memory", "sqlite"] if rep % 2 == 0 else ["sqlite", "memory"]
        for name in order:
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.sqlite", "--child", name, str(n)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            times[name].append(json.loads(out.splitlines()[-1])["seconds"])
    memory, sqlite = (statistics.median(times[k]) for k in ("memory", "sqlite"))
    print(f"| store | {n:,} no-op tasks, median of {reps} | µs per task | tasks/s |")
    print("| --- | --- | --- | --- |")
    for name, value in (("MemoryStore", memory), ("SQLiteStore", sqlite)):
        print(f"| {name} | {value:.3f} s | {value / n * 1e6:.1f} | {n / value:,.0f} |")
    print(f"\nSQLiteStore / MemoryStore: {sqlite / memory:.1f}x")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]))
    else:
        main(
            int(sys.argv[1]) if len(sys.argv) > 1 else 20_000,
            int(sys.argv[2]) if len(sys.argv) > 2 else 3,
        )
