"""Agents for the worker processes of tests/test_sqlite_workers.py (``orchestra worker --agents
tests/worker_job.py:agents``).

Every call appends ``<task id> <pid>`` to the file named by ``$WORKER_CALLS`` (one ``write`` of one
line to a file opened for appending: lines of concurrent processes never interleave), before it
returns; ``$WORKER_DELAY`` (seconds, default 0) is how long each call takes. A task whose payload is
``"poison"`` kills its worker with SIGKILL. Run as a script (``python tests/worker_job.py DB N``), it
is a coordinator of run "r" (N tasks) that runs nothing itself, for a test to kill; with a third
argument (``DB N LEASE``), a coordinator of run "r" that runs its N tasks itself, one at a time.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

import anyio

from orchestra import Concurrency, Context, Orchestrator, RetryableError, Task, agent
from orchestra.stores import SQLiteStore


def _record(task_id: str) -> None:
    line = f"{task_id} {os.getpid()}\n".encode()
    fd = os.open(os.environ["WORKER_CALLS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


@agent(kinds=["work", "other"])
async def double(task: Task, ctx: Context) -> Any:
    _record(task.id)
    if task.payload == "poison":  # it kills the worker that runs it
        os.kill(os.getpid(), signal.SIGKILL)
    hold = os.environ.get("WORKER_HOLD")
    while hold and await anyio.Path(hold).exists():  # the test holds the calls for a while
        await anyio.sleep(0.01)
    delay = float(os.environ.get("WORKER_DELAY", "0"))
    if delay:
        await anyio.sleep(delay)
    return task.payload * 2


def agents() -> Orchestrator:
    return Orchestrator(agents=[double], concurrency=int(os.environ.get("WORKER_CONCURRENCY", "8")))


def big_outputs() -> Orchestrator:
    """An agent of kind "work" whose every output is 1 MB: a worker's completions pass a file-size
    limit of 1.5 MB."""

    @agent(kinds=["work"], concurrency=4)
    async def big(task: Task, ctx: Context) -> Any:
        _record(task.id)
        await anyio.sleep(0.05)
        return "y" * 1_000_000

    return Orchestrator(agents=[big])


def failing_then_hanging() -> Orchestrator:
    """An agent of kind "work" whose first attempt fails (retryable) and whose next ones hang: the
    worker is to be killed in its retry."""

    @agent(kinds=["work"])
    async def flaky(task: Task, ctx: Context) -> Any:
        _record(task.id)
        if ctx.attempt == 1:
            raise RetryableError("the first attempt fails")
        await anyio.sleep(3600)

    return Orchestrator(agents=[flaky])


def one_at_a_time() -> Orchestrator:
    """`double` limited to one call at a time (an agent's own limit), in an orchestrator of the
    default global concurrency (100)."""

    @agent(kinds=["work", "other"], name="double", concurrency=1)
    async def single(task: Task, ctx: Context) -> Any:
        return await double(task, ctx)

    return Orchestrator(agents=[single])


def sharing_one_place() -> Orchestrator:
    """Two agents of kind "work" (each `double`) sharing one `Concurrency(1)`: one call at a time
    in all, though each agent alone could make one."""
    place = Concurrency(1)

    @agent(kinds=["work"], name="left", concurrency=place)
    async def left(task: Task, ctx: Context) -> Any:
        return await double(task, ctx)

    @agent(kinds=["work"], name="right", concurrency=place)
    async def right(task: Task, ctx: Context) -> Any:
        return await double(task, ctx)

    return Orchestrator(agents=[left, right])


def agents_stopping_in_a_commit() -> Orchestrator:
    """`agents`, in a worker that stops itself (SIGSTOP, the whole process) inside the transaction
    of its first completion, just before its COMMIT: it holds the file's write lock, stopped."""
    from orchestra.stores._sqlite import _leases as leases

    complete = leases.complete

    class Stopping:
        def __init__(self, conn: Any) -> None:
            self.conn = conn

        def execute(self, sql: str, *args: Any) -> Any:
            if sql == "COMMIT":  # to this thread: a process-wide kill lets it run on a little
                signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
            return self.conn.execute(sql, *args)

        def executemany(self, sql: str, rows: Any) -> Any:
            return self.conn.executemany(sql, rows)

    def stopping(conn: Any, *args: Any) -> Any:
        leases.complete = complete  # once
        return complete(Stopping(conn), *args)  # type: ignore[arg-type]

    leases.complete = stopping  # type: ignore[assignment]
    return agents()


async def coordinate(db: str, n: int) -> None:
    """A coordinator that never runs a task itself (paused), for the test to kill."""

    @agent(kinds=["work", "other"])
    async def never(task: Task, ctx: Context) -> Any:
        raise AssertionError("the coordinator is paused")

    orch = Orchestrator(agents=[never], store=SQLiteStore(db))
    async with orch:
        handle = orch.start(tasks=[Task("work", i) for i in range(n)], run_id="r")
        handle.pause()
        await handle


async def run_alone(db: str, n: int, lease: float) -> None:
    """A coordinator that runs its n tasks (``t0`` ...) itself, one at a time, with ``double``
    (``$WORKER_DELAY`` a call), on a store of lease `lease`; prints the run's status."""
    orch = Orchestrator(agents=[double], store=SQLiteStore(db, lease=lease), concurrency=1)
    result = await orch.run(tasks=[Task("work", i, id=f"t{i}") for i in range(n)], run_id="r")
    print(result.status, flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 3:  # DB N LEASE: a coordinator that runs everything itself
        anyio.run(run_alone, sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
    else:
        anyio.run(coordinate, sys.argv[1], int(sys.argv[2]))
