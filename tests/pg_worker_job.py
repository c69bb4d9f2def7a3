"""A worker process for tests/test_pg_processes.py: it lives in ``orchestra.workers`` and holds
leases until it is killed.

``python tests/pg_worker_job.py DSN OWNER LEASE`` registers (`Presence`: beats and sweeps every
third of LEASE), claims every ready task of kind ``a`` of run ``r`` under leases of LEASE seconds
that it never renews, prints ``claimed <n>`` (flushed), and waits to be killed.
"""

from __future__ import annotations

import os
import socket
import sys

import anyio

from orchestra.stores._postgres._leases import claim, connect
from orchestra.stores._postgres._processes import Presence


async def main(dsn: str, owner: str, lease: float) -> None:
    conn = await connect(dsn)
    async with Presence(dsn, owner, host=socket.gethostname(), pid=os.getpid(), lease=lease):
        claimed = await claim(conn, "r", {"a": 1000}, owner=owner, lease=lease)
        sys.stdout.write(f"claimed {len(claimed)}\n")
        sys.stdout.flush()
        await anyio.sleep_forever()


if __name__ == "__main__":
    dsn, owner, lease = sys.argv[1:4]
    anyio.run(main, dsn, owner, float(lease))
