"""Agents and a worker process for tests/test_pg_worker.py.

``python tests/pg_work_job.py ARGS...`` is ``orchestra worker ARGS...``, after moving this
process's wall clock (`time.time`) by ``$WORKER_CLOCK_SHIFT`` seconds (default 0): a machine whose
clock is off. The agents are ``tests/pg_work_job.py:agents``:

- kind ``work`` doubles its payload, after ``$WORKER_DELAY`` seconds (default 0);
- kind ``slow`` returns its payload after 1.5 s;
- kind ``flaky`` fails its first attempt with a retry a minute later, then succeeds;
- kind ``poison`` kills its process (SIGKILL) as it starts: a task that takes down every worker;
- kind ``keyed`` spawns a ``work`` task ``<its id>.w`` of its payload with the key
  ``key-<payload>``.

Every call appends ``<task id> <pid>`` to the file named by ``$WORKER_CALLS`` (one ``write`` of one
line to a file opened for appending: lines of concurrent processes never interleave) as it starts.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import anyio

from orchestra import Context, Orchestrator, RetryableError, Task, agent


def _record(task_id: str) -> None:
    line = f"{task_id} {os.getpid()}\n".encode()
    fd = os.open(os.environ["WORKER_CALLS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


@agent(kinds=["work"])
async def double(task: Task, ctx: Context) -> Any:
    _record(task.id)
    delay = float(os.environ.get("WORKER_DELAY", "0"))
    if delay:
        await anyio.sleep(delay)
    return task.payload * 2


@agent(kinds=["slow"])
async def slow(task: Task, ctx: Context) -> Any:
    _record(task.id)
    await anyio.sleep(1.5)
    return task.payload


@agent(kinds=["flaky"])
async def flaky(task: Task, ctx: Context) -> Any:
    _record(task.id)
    if ctx.attempt == 1:
        raise RetryableError("the first attempt fails", retry_after=60)
    return task.payload


@agent(kinds=["poison"])
async def poison(task: Task, ctx: Context) -> Any:
    _record(task.id)
    os.kill(os.getpid(), signal.SIGKILL)


@agent(kinds=["keyed"])
async def keyed(task: Task, ctx: Context) -> Any:
    _record(task.id)
    ctx.spawn(Task("work", task.payload, id=f"{task.id}.w", key=f"key-{task.payload}"))
    return "spawned"


def agents() -> Orchestrator:
    return Orchestrator(
        agents=[double, slow, flaky, poison, keyed],
        concurrency=int(os.environ.get("WORKER_CONCURRENCY", "8")),
    )


if __name__ == "__main__":
    shift = float(os.environ.get("WORKER_CLOCK_SHIFT", "0"))
    if shift:
        real = time.time
        time.time = lambda: real() + shift  # every caller of time.time() in this process

    from orchestra._cli._app import main

    sys.argv = ["orchestra", "worker", *sys.argv[1:]]
    main()
