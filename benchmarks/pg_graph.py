"""Claim + complete throughput on PostgreSQL when completions ready dependents
(`orchestra.stores._postgres._graph`), from one connection.

``python -m benchmarks.pg_graph [N] [REPS]`` (default 20,000 no-op tasks, 3 repetitions): one
embedded PostgreSQL server (durable: fsync and synchronous commits on), a database per shape and
repetition. The tasks are admitted untimed (`_graph.admit`); timed: one connection claims up to 100
ready tasks (`claim`) and completes them as one batch (`complete`, which settles them in its
transaction), until none is left; the median of the repetitions is reported.

- **independent**: no dependencies (what settling costs when it finds nothing to free);
- **chain**: each task depends on the one before (one task ready at a time: a claim and a
  completion per task, the worst case);
- **fan-in**: groups of 100 parents and one child depending on all of them (the child made ready
  by the last parent's completion).

Not wired into ``python -m benchmarks``: the store these pieces serve is not written yet.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

import asyncpg

from orchestra import Task
from orchestra._admission import Admission
from orchestra.stores._postgres._graph import admit
from orchestra.stores._postgres._leases import SERVER_SETTINGS, End, claim, complete
from orchestra.stores._postgres._schema import migrate
from orchestra.stores._postgres._server import embedded_server

SHAPES = ("independent", "chain", "fan-in")
BATCH = 100
RUN = "bench"


def tasks_of(shape: str, n: int) -> list[Task]:
    if shape == "independent":
        return [Task("a", None, id=f"t{i}") for i in range(n)]
    if shape == "chain":
        return [
            Task("a", None, id=f"t{i}", depends_on=[f"t{i - 1}"] if i else []) for i in range(n)
        ]
    tasks = []
    for group in range(n // (BATCH + 1)):
        parents = [f"p{group}.{i}" for i in range(BATCH)]
        tasks += [Task("a", None, id=p) for p in parents]
        tasks.append(Task("a", None, id=f"c{group}", depends_on=parents))
    return tasks


async def once(server_dsn: str, name: str, shape: str, n: int) -> tuple[int, float]:
    admin = await asyncpg.connect(server_dsn)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    dsn = server_dsn.rpartition("/")[0] + "/" + name
    conn = await asyncpg.connect(dsn, server_settings=SERVER_SETTINGS)
    try:
        await migrate(conn)
        await conn.execute("INSERT INTO orchestra.runs (id) VALUES ($1)", RUN)
        tasks = tasks_of(shape, n)
        await admit(conn, RUN, tasks, admission=Admission(["a"], {}))
        done = 0
        start = time.perf_counter()
        while batch := await claim(conn, RUN, {"a": BATCH}, owner="w", lease=30):
            ends = [End(task.id, task.token, "succeeded", "null") for task in batch]
            await complete(conn, RUN, "w", ends)
            done += len(batch)
        took = time.perf_counter() - start
        assert done == len(tasks)
        return done, took
    finally:
        await conn.close()


def main(n: int, reps: int) -> None:
    with embedded_server() as server:
        for shape in SHAPES:
            rates = []
            for rep in range(reps):
                done, took = asyncio.run(
                    once(server.dsn, f"bench_{shape.replace('-', '_')}_{rep}", shape, n)
                )
                rates.append(done / took)
            print(
                f"{shape:12} {statistics.median(rates):>9,.0f} tasks/s "
                f"(of {reps}: {', '.join(f'{r:,.0f}' for r in rates)})"
            )


if __name__ == "__main__":
    main(
        int(sys.argv[1]) if len(sys.argv) > 1 else 20_000,
        int(sys.argv[2]) if len(sys.argv) > 2 else 3,
    )
