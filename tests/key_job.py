"""A script for tests/test_sqlite_keys.py: concurrent submissions of idempotency keys.

Usage: ``python tests/key_job.py DB CALLS N [--die | --many]``. N concurrent runs submit one key;
every agent call appends its task id to the file CALLS (flushed before the agent sleeps 0.3 s); the
outputs of the N runs are written to stdout as one JSON list. With ``--die`` the agent kills its
process with SIGKILL instead of returning (its claim on the key is left behind). With ``--many``
one run submits N tasks with N keys, in a shuffled order, each taking 1 to 30 ms (so that they end
at every point of a window), and its output by task id is written to stdout as one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
from typing import Any

from orchestra import Context, Orchestrator, Task, agent
from orchestra.stores import SQLiteStore


def record_call(calls: str, task_id: str) -> None:
    with open(calls, "a") as out:  # a line, flushed before the agent goes on
        out.write(f"{os.getpid()} {task_id}\n")


async def main(db: str, calls: str, n: int, die: bool) -> list[Any]:
    @agent(kinds=["work"])
    async def work(task: Task, ctx: Context) -> dict[str, Any]:
        record_call(calls, task.id)
        if die:
            os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(0.3)
        return {"answer": task.payload * 2, "pid": os.getpid()}

    orch = Orchestrator(agents=[work], store=SQLiteStore(db, window=0.01))
    results = await asyncio.gather(
        *(orch.run([Task("work", 21, key="k")], run_id=f"{os.getpid()}-{i}") for i in range(n))
    )
    return [next(iter(r.data.values())) for r in results]


async def many(db: str, calls: str, n: int) -> dict[str, Any]:
    @agent(kinds=["work"], concurrency=20)
    async def work(task: Task, ctx: Context) -> int:
        record_call(calls, task.id)
        await asyncio.sleep(random.uniform(0.001, 0.03))
        return os.getpid()

    numbers = list(range(n))
    random.shuffle(numbers)
    tasks = [Task("work", i, id=f"t{i}", key=f"k{i}") for i in numbers]
    store = SQLiteStore(db)
    try:
        result = await Orchestrator(agents=[work], store=store).run(tasks, run_id=str(os.getpid()))
    finally:
        store.close()
    return dict(result.data)


if __name__ == "__main__":
    db, calls, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if "--many" in sys.argv:
        output: Any = asyncio.run(many(db, calls, n))
    else:
        output = asyncio.run(main(db, calls, n, "--die" in sys.argv))
    sys.stdout.write(json.dumps(output) + "\n")
