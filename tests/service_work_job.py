"""The service as a real process for tests/test_service_workers.py: uvicorn serving the app on
127.0.0.1, over a SQLite file or a PostgreSQL database with a short lease.

``python tests/service_work_job.py (--db FILE | --dsn URL) --port P --lease L [--token T]``
serves until killed. With ``--token``, that text is kept as a worker token (as ``orchestra serve
--workers-token`` keeps one). Its orchestrator's agent for kinds ``work`` and ``other``, ``here``,
takes one task at a time and appends ``<task id> service`` to ``$WORKER_CALLS`` before it returns:
the service coordinates the submitted runs and may run a few of their tasks itself, the HTTP
workers run the rest.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import anyio
import uvicorn

from orchestra import Context, Orchestrator, Task, agent
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db")
    parser.add_argument("--dsn")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--lease", type=float, required=True)
    parser.add_argument("--token")
    args = parser.parse_args()
    store: Any
    if args.db:
        from orchestra.stores import SQLiteStore

        store = SQLiteStore(args.db, lease=args.lease)
    else:
        from orchestra.stores._postgres._store import PostgresStore

        store = PostgresStore(args.dsn, lease=args.lease, poll=0.5)
    if args.token:
        from orchestra._service._tokens import Tokens

        Tokens(store).ensure(args.token, "worker", "test workers")
    app = create_app(Orchestrator(agents=[here], store=store, seed=1), grace=0.0)
    try:
        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    finally:
        store.close()


if __name__ == "__main__":
    main()
