"""Claim + complete throughput on PostgreSQL: orchestra's claims (`orchestra.stores._postgres._leases`)
against pgqueuer and a raw asyncpg loop, on one server in the same run.

``python -m benchmarks.pg_claims [N] [REPS]`` (default 20,000 no-op tasks, 3 repetitions; needs the
bench dependency group for pgqueuer): one embedded PostgreSQL server (durable: fsync and
synchronous commits on), a database per contender. For each number of claimer processes (1, 2) and
each repetition, the contenders take turns (their order alternating): N tasks are written untimed,
then that many fresh processes (``--child``) connect, wait for a common start, and take the tasks
until none is left. Timed: from the start to the last process's exit; the median is reported.

- **orchestra**: `claim` of up to 100 tasks of a kind (each a fresh lease: owner, token, expiry on
  the database's clock; the attempt counted), then `complete` of the batch (fenced by the tokens),
  on a connection with `SERVER_SETTINGS`.
- **pgqueuer**: its own queue (jobs written with its batch `enqueue`), a `QueueManager` in drain
  mode with a no-op entrypoint and batches of 100.
- **raw**: the floor, ``UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED LIMIT 100)
  RETURNING``, then one ``UPDATE`` of the batch by ids: no lease, no token, no kinds.

Not wired into ``python -m benchmarks`` yet: the store these claims will serve is not written.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import asyncpg

from orchestra.stores._postgres._leases import SERVER_SETTINGS, End, claim, complete
from orchestra.stores._postgres._schema import migrate
from orchestra.stores._postgres._server import embedded_server

CONTENDERS = ("orchestra", "pgqueuer", "raw")
BATCH = 100
RUN = "bench"

_RAW_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    status text NOT NULL,
    payload json NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_queued ON jobs (id) WHERE status = 'queued';
"""
_RAW_CLAIM = """
UPDATE jobs SET status = 'picked' WHERE id IN (
    SELECT id FROM jobs WHERE status = 'queued' ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED
) RETURNING id, payload
"""
_RAW_DONE = "UPDATE jobs SET status = 'done' WHERE id = ANY ($1::bigint[])"


# -- filling a contender's queue (untimed) ---------------------------------------------------------


async def fill(contender: str, dsn: str, n: int) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        if contender == "orchestra":
            await migrate(conn)
            await conn.execute("TRUNCATE orchestra.runs CASCADE")
            await conn.execute("INSERT INTO orchestra.runs (id) VALUES ($1)", RUN)
            await conn.execute(
                "INSERT INTO orchestra.tasks (run_id, id, seq, idx, named, kind, payload, "
                "priority, state) SELECT $1, 't' || g, g, g, false, 'noop', to_json(g), 0, "
                "'ready' FROM generate_series(1, $2::integer) AS g",
                RUN, n,
            )  # fmt: skip
            await conn.execute("VACUUM ANALYZE orchestra.tasks")
        elif contender == "raw":
            await conn.execute(_RAW_SCHEMA)
            await conn.execute("TRUNCATE jobs")
            await conn.execute(
                "INSERT INTO jobs (status, payload) SELECT 'queued', to_json(g) "
                "FROM generate_series(1, $1::integer) AS g",
                n,
            )
            await conn.execute("VACUUM ANALYZE jobs")
        else:
            from pgqueuer import AsyncpgDriver, Queries

            queries = Queries(AsyncpgDriver(conn))
            if not await queries.schema_is_installed():
                await queries.install()
            await queries.clear_queue()
            for start in range(0, n, 1000):
                size = min(1000, n - start)
                await queries.enqueue(
                    ["noop"] * size,
                    [str(i).encode() for i in range(start, start + size)],
                    [0] * size,
                )
            await conn.execute("VACUUM ANALYZE pgqueuer")
    finally:
        await conn.close()


# -- a claimer process -----------------------------------------------------------------------------


async def work(contender: str, dsn: str, name: str) -> int:
    """Take tasks until none is left; returns how many this process completed."""
    # orchestra's settings for orchestra (statements planned for their batch); the others as
    # they come.
    settings = SERVER_SETTINGS if contender == "orchestra" else None
    conn = await asyncpg.connect(dsn, server_settings=settings)
    print("ready", flush=True)
    sys.stdin.readline()  # the common start
    done = 0
    try:
        if contender == "orchestra":
            while batch := await claim(conn, RUN, {"noop": BATCH}, owner=name, lease=30):
                ends = [End(task.id, task.token, "succeeded", "null") for task in batch]
                done += sum(await complete(conn, RUN, name, ends))
        elif contender == "raw":
            while rows := await conn.fetch(_RAW_CLAIM, BATCH):
                await conn.execute(_RAW_DONE, [row[0] for row in rows])
                done += len(rows)
        else:
            done = await _pgqueuer(conn)
    finally:
        if not conn.is_closed():
            await conn.close()
    return done


async def _pgqueuer(conn: asyncpg.Connection) -> int:
    from pgqueuer import AsyncpgDriver, Queries, QueueManager
    from pgqueuer.domain.types import QueueExecutionMode

    manager = QueueManager(Queries(AsyncpgDriver(conn)))
    count = 0

    @manager.entrypoint("noop")
    async def noop(job: Any) -> None:
        nonlocal count
        count += 1

    await manager.run(
        batch_size=BATCH, mode=QueueExecutionMode.drain, dequeue_timeout=timedelta(seconds=1)
    )
    return count


def child(contender: str, dsn: str, name: str) -> None:
    done = asyncio.run(work(contender, dsn, name))
    print(json.dumps({"done": done}), flush=True)


# -- the runner ------------------------------------------------------------------------------------


def measure(contender: str, dsn: str, processes: int, n: int) -> float:
    asyncio.run(fill(contender, dsn, n))
    command = [sys.executable, "-m", "benchmarks.pg_claims", "--child", contender, dsn]
    children = [
        subprocess.Popen(
            [*command, f"w{i}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for i in range(processes)
    ]
    for process in children:  # every one connected before any starts
        if process.stdout is None or process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"a {contender} claimer did not start")
    start = time.perf_counter()
    for process in children:
        if process.stdin is not None:
            process.stdin.write("go\n")
            process.stdin.flush()
    outputs = [process.communicate()[0] for process in children]
    elapsed = time.perf_counter() - start
    done = sum(json.loads(out.splitlines()[-1])["done"] for out in outputs)
    if done != n:
        raise RuntimeError(f"{contender} with {processes} processes completed {done} of {n}")
    return elapsed


def main(n: int, reps: int) -> None:
    server = embedded_server()
    try:
        dsns = {}
        for contender in CONTENDERS:
            asyncio.run(_create_database(server.dsn, contender))
            dsns[contender] = server.dsn_for(contender)
        print(f"PostgreSQL at {server.dsn} (durable), {n:,} no-op tasks, batches of {BATCH}\n")
        print(
            "| claimer processes | orchestra (tasks/s) | pgqueuer | raw asyncpg | orchestra / raw |"
        )
        print("| --- | --- | --- | --- | --- |")
        for processes in (1, 2):
            times: dict[str, list[float]] = {contender: [] for contender in CONTENDERS}
            for rep in range(reps):
                order = CONTENDERS if rep % 2 == 0 else CONTENDERS[::-1]
                for contender in order:
                    times[contender].append(measure(contender, dsns[contender], processes, n))
            rate = {c: n / statistics.median(times[c]) for c in CONTENDERS}
            print(
                f"| {processes} | {rate['orchestra']:,.0f} | {rate['pgqueuer']:,.0f} | "
                f"{rate['raw']:,.0f} | {rate['orchestra'] / rate['raw']:.2f} |"
            )
    finally:
        server.stop()


async def _create_database(dsn: str, name: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        main(
            int(sys.argv[1]) if len(sys.argv) > 1 else 20_000,
            int(sys.argv[2]) if len(sys.argv) > 2 else 3,
        )
