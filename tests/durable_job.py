"""A script for tests/test_sqlite.py: a durable run that can kill itself with SIGKILL at a point.

Usage: ``python tests/durable_job.py DB RUN_ID CALLS [--kill SPEC] [--window S] [--stream]
[--unnamed] [--alone] [--chunk N] [--iter]``;
DB a SQLite file, or a PostgreSQL DSN (``postgresql://...``: a `PostgresStore`).
Every agent call appends ``<task id>`` to the file CALLS (flushed before the agent goes on), so the
test knows what ran in which process. The `RunResult` is written as JSON to stdout, alone.

The run: 24 tasks ``w0`` … ``w23`` (a few ms each, two at a time), a task ``split`` that spawns
``s0`` … ``s2``, and ``total``, which depends on ``w0`` … ``w3``; with ``--unnamed``, ``w4`` …
``w23`` are given no id (the run generates ``work#1`` … ``work#20``). With ``--alone``, the 24
tasks alone (every one stands alone: a PostgreSQL run resumed streamed reads its ended tasks ahead
of the input, ``--chunk N`` at a time), and the one with payload 5 fails for good. With ``--iter``
the input is a plain generator (admitted in chunks, not an item at a time). Kill points
(SPEC):

- ``calls:N``: SIGKILL inside the N-th agent call of this process (mid-run);
- ``input:K``: SIGKILL after the streamed input yielded K tasks (mid-admission; with --stream);
- ``after:ID``: task ID returns normally (after the window has committed its start), and the next
  agent call SIGKILLs at once: ID's success is in no commit yet.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from orchestra import Context, Orchestrator, PermanentError, Task, agent
from orchestra.stores import SQLiteStore

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

ARGS = argparse.Namespace()
CALLS = [0]
DONE: list[str] = []


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def record_call(task_id: str) -> None:
    with open(ARGS.calls, "a") as calls:
        calls.write(f"{task_id}\n")
    CALLS[0] += 1
    kill = ARGS.kill or ""
    if kill.startswith("calls:") and CALLS[0] == int(kill[6:]):
        die()
    if kill.startswith("after:") and DONE:
        die()


@agent(kinds=["work"])
async def work(task: Task, ctx: Context) -> dict[str, Any]:
    record_call(task.id)
    if task.id == "split":
        for i in range(3):
            ctx.spawn(Task("work", 100 + i, id=f"s{i}"))
    if ARGS.alone and task.payload == 5:
        raise PermanentError("five is refused")
    if task.id == "total":
        return {"id": task.id, "value": sum(d["value"] for d in ctx.deps.values())}
    await anyio.sleep(0.4 if ARGS.kill == f"after:{task.id}" else ARGS.sleep)
    if ARGS.kill == f"after:{task.id}":
        DONE.append(task.id)
    return {"id": task.id, "value": task.payload * 2}


def tasks() -> list[Task]:
    work = [Task("work", i, id=None if ARGS.unnamed and i >= 4 else f"w{i}") for i in range(24)]
    if ARGS.alone:
        return work
    return [
        *work,
        Task("work", 0, id="split"),
        Task("work", 0, id="total", depends_on=[f"w{i}" for i in range(4)]),
    ]


async def streamed() -> AsyncIterator[Task]:
    for n, task in enumerate(tasks(), 1):
        yield task
        await anyio.sleep(0.01)
        if ARGS.kill == f"input:{n}":
            die()


async def main() -> None:
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    parser = argparse.ArgumentParser()
    parser.add_argument("db")
    parser.add_argument("run_id")
    parser.add_argument("calls")
    parser.add_argument("--kill")
    parser.add_argument("--window", type=float, default=0.05)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--unnamed", action="store_true")
    parser.add_argument("--sleep", type=float, default=0.004)  # each agent call's
    parser.add_argument("--lease", type=float, default=30.0)  # (PostgreSQL)
    parser.add_argument("--alone", action="store_true")
    parser.add_argument("--chunk", type=int, default=None)  # (PostgreSQL)
    parser.add_argument("--iter", action="store_true")
    parser.parse_args(namespace=ARGS)
    if ARGS.chunk is not None:  # the ended rows a resumed run reads ahead at a time
        from orchestra.stores._postgres._run import PostgresRun

        PostgresRun.read_ahead = ARGS.chunk
    store: Any
    if ARGS.db.startswith("postgresql://"):
        from orchestra.stores._postgres._store import PostgresStore

        store = PostgresStore(ARGS.db, poll=0.05, lease=ARGS.lease)
    else:
        store = SQLiteStore(ARGS.db, window=ARGS.window)
    orch = Orchestrator(agents=[work], store=store, concurrency=2, seed=1)
    source: Any = streamed() if ARGS.stream else tasks()
    if ARGS.iter:
        source = (task for task in tasks())
    result = await orch.run(source, run_id=ARGS.run_id)
    store.close()
    sys.stdout.write(result.model_dump_json())


if __name__ == "__main__":
    anyio.run(main)
