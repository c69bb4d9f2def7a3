"""A fork server for tests/test_sqlite_kills.py: durable runs killed with SIGKILL at chosen points.

``python tests/killed_run.py`` imports orchestra once, then reads requests from stdin, one JSON
object a line: ``{"dir": ..., "plan": [kill, ...], "stream": bool, "delay": float}``. For each it
forks a *seed process* that runs the request's run once per kill of `plan`, each time in a
fresh forked child killed at that point, and once more to its end; between them it reads the
database file with `sqlite3` (what was committed when the child died). It writes
``DIR/report.json`` and the server answers ``done`` on stdout. Forking after the imports is why
this is a server: importing orchestra costs ~0.7 s, a fork a millisecond (the server has no
thread and no event loop when it forks; each child makes its own).

The run (run id ``"kill"``, 26 tasks, concurrency 2, window 10 ms) has tasks with dependencies
(``total`` needs ``w0`` … ``w3``), a fan-out (``split`` spawns ``s0`` … ``s2``, tagged ``split``),
a group awaited by tag (``gather``), retries (``w3``, ``w7``, ``w12`` fail their first attempt), a
fallback (kind ``review``: ``strict`` refuses everything, ``lenient`` answers), a task that fails
for good (``bad``) and its skipped dependent (``after``); with ``stream`` its decomposer is an
async generator (a streamed input), else a list.

Every agent call first appends ``<task id> <attempt> <pid>`` to ``DIR/calls.txt`` with one
``write`` on an ``O_APPEND`` descriptor: a SIGKILL cannot lose it (the kernel has the bytes; an
fsync would only matter for a power cut, which these tests do not make).

Kill points (an item of `plan`):

- ``calls:N``: inside the N-th agent call of the child, once it is recorded;
- ``input:K``: once the streamed input yielded K tasks (mid-admission);
- ``commit:N``: in the writer thread, inside the N-th write transaction, just before its COMMIT;
- ``committed:N``: in the writer thread, just after the N-th COMMIT (before the loop hears of it);
- ``in:ID``: inside task ID's first call;
- ``fallback:ID``: inside task ID's call on its fallback agent (``lenient``);
- ``after:ID``: task ID returns normally and the next agent call dies at once;
- ``spawned:ID``: inside task ID's call, right after it spawned (``split`` spawns);
- ``retry:ID``: ID's first attempt fails with ``retry_after=0.3`` and the child dies 0.1 s later,
  inside the retry wait;
- ``end``: at the run's end, instead of the store's `close` (what the last window held is lost);
- ``external``: the seed process sends SIGKILL after the request's ``delay`` seconds (wherever the
  child is: inside a commit, an admission, a call); the child waits to be killed if it finishes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from orchestra import (
    Context,
    Orchestrator,
    PermanentError,
    RetryableError,
    RetryPolicy,
    Task,
    agent,
)
from orchestra.stores import SQLiteStore
from orchestra.stores._sqlite import _run as sqlite_run
from orchestra.stores._sqlite import _writes as sqlite_writes

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

RUN = "kill"
FLAKY = frozenset({"w3", "w7", "w12"})


class Child:
    """What one forked child knows: where to record calls, and where it is to die."""

    kill = ""
    calls_fd = -1
    calls = 0
    writes = 0
    returned = False  # `after:ID`: ID has returned; the next call dies


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def called(task: Task, ctx: Context) -> None:
    os.write(Child.calls_fd, f"{task.id} {ctx.attempt} {os.getpid()}\n".encode())
    Child.calls += 1
    kill = Child.kill
    if (
        Child.returned
        or kill == f"calls:{Child.calls}"
        or kill == f"in:{task.id}"
        or (kill == f"fallback:{task.id}" and ctx.agent == "lenient")
    ):
        die()


async def step(task: Task, value: int) -> dict[str, Any]:
    await anyio.sleep(0.004)
    if Child.kill == f"after:{task.id}":
        Child.returned = True
    return {"id": task.id, "value": value}


@agent(kinds=["work"])
async def work(task: Task, ctx: Context) -> dict[str, Any]:
    called(task, ctx)
    if task.payload == "bad":
        raise PermanentError("bad payload")
    if task.id in FLAKY and ctx.attempt == 1:
        if Child.kill == f"retry:{task.id}":
            asyncio.get_running_loop().call_later(0.1, die)
            raise RetryableError("busy", retry_after=0.3)
        raise RetryableError("busy")
    if task.id == "split":
        for i in range(3):
            ctx.spawn(Task("work", 10 + i, id=f"s{i}", tags=["split"]))
        if Child.kill == "spawned:split":
            die()
    if task.id in ("total", "gather"):
        return await step(task, sum(dep["value"] for dep in ctx.deps.values()))
    return await step(task, task.payload * 2)


@agent(kinds=["review"], name="strict")
async def strict(task: Task, ctx: Context) -> dict[str, Any]:
    called(task, ctx)
    raise PermanentError("too strict")


@agent(kinds=["review"], name="lenient")
async def lenient(task: Task, ctx: Context) -> dict[str, Any]:
    called(task, ctx)
    return await step(task, len(task.payload))


def plan(_: Any) -> list[Task]:
    ws = [Task("work", i, id=f"w{i}", priority=i % 3) for i in range(16)]
    return [
        *ws,
        Task("work", 0, id="total", depends_on=[f"w{i}" for i in range(4)]),
        Task("work", 0, id="split"),
        Task("work", 0, id="gather", depends_on_tags=["split"]),
        Task("review", "first draft", id="r0"),
        Task("review", "second", id="r1"),
        Task("work", "bad", id="bad"),
        Task("work", 1, id="after", depends_on=["bad"]),
    ]


async def streamed(_: Any) -> AsyncIterator[Task]:
    for n, task in enumerate(plan(None), 1):
        yield task
        await anyio.sleep(0.002)
        if Child.kill == f"input:{n}":
            die()


class DyingConnection:
    """The writer's connection for one write: its COMMIT kills the process first."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def execute(self, sql: str, *args: Any) -> Any:
        if sql == "COMMIT":
            die()
        return self.conn.execute(sql, *args)

    def executemany(self, sql: str, rows: Any) -> Any:
        return self.conn.executemany(sql, rows)


def hook_writes() -> None:
    write = sqlite_writes.write

    def hooked(conn: sqlite3.Connection, *args: Any) -> None:
        Child.writes += 1
        dying = Child.kill == f"commit:{Child.writes}"
        write(DyingConnection(conn) if dying else conn, *args)  # type: ignore[arg-type]
        if Child.kill == f"committed:{Child.writes}":
            die()

    sqlite_writes.write = hooked  # type: ignore[assignment]
    if Child.kill == "end":
        sqlite_run.SQLiteRun.close = lambda self: die()  # type: ignore[method-assign]


async def run(db: Path, stream: bool) -> str:
    store = SQLiteStore(db, window=0.01)
    orch = Orchestrator(
        agents=[work, strict, lenient],
        decomposer=streamed if stream else plan,
        fallbacks={"review": ["strict", "lenient"]},
        retry=RetryPolicy(max_attempts=3, base=0.02, jitter="none"),
        concurrency=2,
        seed=1,
        store=store,
    )
    result = await orch.run(None, run_id=RUN)
    store.close()
    return result.model_dump_json()


def child(folder: Path, kill: str, stream: bool) -> None:
    """The body of one forked child: the run, killed at `kill` (or to its end, written down)."""
    Child.kill = kill
    Child.calls_fd = os.open(folder / "calls.txt", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    hook_writes()
    result = anyio.run(run, folder / "runs.db", stream)
    if kill == "external":
        time.sleep(60)  # finished before the seed process's SIGKILL: wait for it
    if kill:
        raise SystemExit(f"not killed at {kill}")
    (folder / "result.json").write_text(result)


def fork(folder: Path, kill: str, stream: bool, delay: float) -> dict[str, Any]:
    """One child, to its kill or its end: its pid, exit code, and what the file holds after."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            child(folder, kill, stream)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stderr.flush()
            os._exit(code)
    if kill == "external":
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return {
        "kill": kill,
        "pid": pid,
        "code": os.waitstatus_to_exitcode(status),
        "committed": committed(folder / "runs.db"),
    }


def committed(db: Path) -> dict[str, list[Any]]:
    """Each task's committed state and attempts, as another process reads the file (none when
    the child died before the file or its schema was committed)."""
    if not db.exists():
        return {}
    conn = sqlite3.connect(db)
    try:
        tables = conn.execute("SELECT name FROM sqlite_master WHERE name = 'tasks'").fetchall()
        if not tables:  # killed while the file was being created
            return {}
        rows = conn.execute("SELECT id, state, attempts FROM tasks WHERE run_id = ?", (RUN,))
        return {task_id: [state, attempts] for task_id, state, attempts in rows}
    finally:
        conn.close()


def seed(request: dict[str, Any]) -> None:
    """The body of one seed process: every kill of the plan, then the run to its end."""
    folder = Path(request["dir"])
    stream, delay = bool(request["stream"]), float(request.get("delay", 0.0))
    phases = [fork(folder, kill, stream, delay) for kill in request["plan"]]
    phases.append(fork(folder, "", stream, delay))
    result = folder / "result.json"
    report = {"phases": phases, "result": result.read_text() if result.exists() else None}
    (folder / "report.json").write_text(json.dumps(report))


def serve() -> None:
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    assert threading.active_count() == 1, "the server must fork with no other thread"
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                seed(request)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        sys.stdout.write(f"done {os.waitstatus_to_exitcode(status)}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
