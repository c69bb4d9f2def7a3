"""A coordinator process for tests/test_pg_spawned_keys.py: it holds a key that a task of its run
spawned, and runs that task until it is killed.

``python tests/pg_spawn_key_job.py DSN RUN_ID CALLS LEASE`` runs, on ``PostgresStore(DSN,
lease=LEASE)``, run RUN_ID of one task ``split`` whose agent spawns ``charge`` task
``<RUN_ID>.c`` with the key ``order-1``; the ``charge`` agent appends ``<task id> <pid>`` to the
file CALLS (one write of one line, as it starts) and then waits for ever, its run holding the key.
"""

from __future__ import annotations

import os
import sys

import anyio

from orchestra import Context, Orchestrator, Task, agent
from orchestra.stores import PostgresStore


async def main(dsn: str, run_id: str, calls: str, lease: float) -> None:
    @agent(kinds=["split"])
    async def split(task: Task, ctx: Context) -> str:
        ctx.spawn(Task("charge", 1, id=f"{run_id}.c", key="order-1"))
        return "split"

    @agent(kinds=["charge"])
    async def charge(task: Task, ctx: Context) -> str:
        fd = os.open(calls, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{task.id} {os.getpid()}\n".encode())
        finally:
            os.close(fd)
        await anyio.sleep_forever()
        return "never"

    store = PostgresStore(dsn, lease=lease, poll=0.1)
    try:
        async with Orchestrator(agents=[split, charge], store=store) as orch:
            await orch.run([Task("split", None, id="s")], run_id=run_id)
    finally:
        store.close()


if __name__ == "__main__":
    dsn, run_id, calls, lease = sys.argv[1:5]
    anyio.run(main, dsn, run_id, calls, float(lease))
