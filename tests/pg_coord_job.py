"""A coordinator process for tests/test_pg_coord.py: it takes a run's lease and writes under it
until a write is refused.

``python tests/pg_coord_job.py DSN RUN_ID OWNER LEASE`` waits for the run (`take_over`), prints
``held <token>``, keeps the lease (`LeaseKeeper`) and, every 20 ms, writes a ``tick`` event in a
fenced transaction. A write refused (`LeaseLost`) prints ``refused`` and exits with 3; a
connection the server ended (a session paused inside its transaction past its idle limit) prints
``dropped`` and the next write goes through a new one. The keeper's report of a lost lease prints
``lost``. Each line is flushed at once: the test reads them as they come.
"""

from __future__ import annotations

import sys

import anyio
import asyncpg

from orchestra.stores._postgres._coordinator import LeaseKeeper, LeaseLost, fenced, take_over


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def main(dsn: str, run_id: str, owner: str, lease: float) -> int:
    conn = await asyncpg.connect(dsn)
    held = await take_over(conn, run_id, owner=owner, lease=lease, poll=0.05)
    say(f"held {held.token}")
    async with (
        asyncpg.create_pool(dsn, min_size=1, max_size=1) as pool,
        LeaseKeeper(pool, held, on_lost=lambda _lease: say("lost")),
    ):
        while True:
            try:
                async with fenced(conn, held):
                    await conn.execute(
                        "INSERT INTO orchestra.events (run_id, event, agent) "
                        "VALUES ($1, 'tick', $2)",
                        run_id, owner,
                    )  # fmt: skip
            except LeaseLost:
                say("refused")
                return 3
            # A connection the server ended while this process was stopped inside `fenced` (its
            # idle limit passed), as asyncpg tells it: the lost connection, or, when the loop
            # had read the server's goodbye but not yet the socket's end as the commit was sent,
            # InternalClientError "cannot switch to state 15; another operation (2) is in
            # progress" (tests/test_pg_coordinator.py reproduces both).
            except (
                asyncpg.PostgresError,
                asyncpg.InterfaceError,
                asyncpg.InternalClientError,
                OSError,
            ):
                say("dropped")
                conn.terminate()
                conn = await asyncpg.connect(dsn)
            await anyio.sleep(0.02)


if __name__ == "__main__":
    dsn, run_id, owner, lease = sys.argv[1:5]
    sys.exit(anyio.run(main, dsn, run_id, owner, float(lease)))
