"""A script for tests/test_sqlite_keys.py: N concurrent runs submitting one idempotency key.

Usage: ``python tests/key_job.py DB CALLS N [--die]``. Every agent call appends its task id to the
file CALLS (flushed before the agent sleeps 0.3 s); the outputs of the N runs are written to stdout
as one JSON list. With ``--die`` the agent kills its process with SIGKILL instead of returning
(its claim on the key is left behind).
"""

from __future__ import annotations

import asyncio
import json
import os
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


if __name__ == "__main__":
    outputs = asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), "--die" in sys.argv))
    sys.stdout.write(json.dumps(outputs) + "\n")
