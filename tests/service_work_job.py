"""The service as a real process for tests/test_service_workers.py: uvicorn serving the app on
127.0.0.1, over a SQLite file or a PostgreSQL database with a short lease.

``python tests/service_work_job.py (--db FILE | --dsn URL) --port P --lease L --token T --admin A
[--paused]`` serves until killed, with T kept as a worker token and A as an admin one (as
``orchestra serve --workers-token`` keeps one). Its orchestrator's agent for kinds ``work`` and
``other``, ``here``, takes one task at a time and appends ``<task id> service`` to
``$WORKER_CALLS`` before it returns. With ``--paused``, every run it starts is paused at once (as
a test's coordinator pauses its run): the service coordinates, the HTTP workers run every task.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import anyio
import uvicorn

from orchestra import Context, Orchestrator, RunHandle, Task, agent
from orchestra._service._tokens import Tokens
from orchestra.service import create_app


def _record(task_id: str) -> None:
    line = f"{task_id} service\n".encode()
    fd = os.open(os.environ["WORKER_CALLS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


@agent(kinds=["work", "other"], concurrency=1)
async def here(task: Task, ctx: Context) -> Any:
    _record(task.id)
    await anyio.sleep(0.05)
    return task.payload * 2


class Paused(Orchestrator):
    """An orchestrator whose runs start paused: it runs none of their tasks itself."""

    def start(self, input: Any = None, **options: Any) -> RunHandle:
        handle = super().start(input, **options)
        handle.pause()
        return handle


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db")
    parser.add_argument("--dsn")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--lease", type=float, required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--admin", required=True)
    parser.add_argument("--paused", action="store_true")
    args = parser.parse_args()
    store: Any
    if args.db:
        from orchestra.stores import SQLiteStore

        store = SQLiteStore(args.db, lease=args.lease)
    else:
        from orchestra.stores._postgres._store import PostgresStore

        store = PostgresStore(args.dsn, lease=args.lease, poll=0.5)
    tokens = Tokens(store)
    tokens.ensure(args.token, "worker", "test workers")
    tokens.ensure(args.admin, "admin", "test admin")
    orch = (Paused if args.paused else Orchestrator)(agents=[here], store=store, seed=1)
    app = create_app(orch, grace=0.0)
    try:
        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    finally:
        store.close()


if __name__ == "__main__":
    main()
