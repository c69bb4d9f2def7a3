"""Worker processes: one durable run, its coordinator here, two `orchestra worker` processes helping.

    python examples/workers.py

The coordinator (this process) runs 60 "summarize" tasks on a SQLite file, each a 0.2 s call, two
at a time; two worker processes (``orchestra worker --db FILE --agents examples/workers.py:agents``)
join it on the same file and take ready tasks as well. Every task runs once, on whichever process
claimed it; the result says who ran what. Needs the `cli` extra (the `orchestra` command).
"""

from __future__ import annotations

import asyncio
import collections
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from orchestra import Context, Orchestrator, Task, agent
from orchestra.stores import SQLiteStore

ROOT = Path(__file__).resolve().parent.parent


@agent(kinds=["summarize"])
async def summarize(task: Task, ctx: Context) -> dict[str, object]:
    await asyncio.sleep(0.2)  # a model call
    return {"contract": task.payload, "summary": f"contract {task.payload}: ok", "pid": os.getpid()}


def agents() -> Orchestrator:
    """What a worker process runs (``--agents examples/workers.py:agents``)."""
    return Orchestrator(agents=[summarize], concurrency=4)


def start_worker(db: Path) -> subprocess.Popen[bytes]:
    """``orchestra worker`` on `db`, for run "contracts": it exits once that run is over."""
    return subprocess.Popen(
        [sys.executable, "-m", "orchestra", "worker", "--db", str(db), "--agents",
         "examples/workers.py:agents", "--run-id", "contracts"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


async def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        db = Path(directory) / "runs.db"
        store = SQLiteStore(db)
        store.runs()  # the file, before the workers open it
        workers = [start_worker(db) for _ in range(2)]
        # Both have joined before the run starts: a run this short could end before a worker
        # slow to start (a loaded machine) claimed anything.
        while len(store.workers()) < len(workers):
            if any(w.poll() is not None for w in workers):
                raise SystemExit("a worker exited before it joined")
            await asyncio.sleep(0.05)
        orch = Orchestrator(agents=[summarize], store=store, concurrency=2)
        result = await orch.run(tasks=[Task("summarize", i) for i in range(60)], run_id="contracts")
        for worker in workers:
            await asyncio.to_thread(worker.wait)  # each exits once the run is over
        by = collections.Counter(
            "this process" if out["pid"] == os.getpid() else f"worker {out['pid']}"
            for out in result.data.values()
        )
        print(f"status: {result.status}, {result.metadata.counts['succeeded']} tasks succeeded")
        print(f"elapsed: {result.metadata.elapsed:.2f}s (60 x 0.2 s, two at a time here: 6 s)")
        for who, n in sorted(by.items()):
            print(f"  {who}: {n} tasks")
        print("workers:", ", ".join(str(w.returncode) for w in workers), "(exit codes)")


if __name__ == "__main__":
    asyncio.run(main())
