"""Each process's sessions named after it, and the sessions of a stalled process cut off.

PostgreSQL ends a session that sits idle inside a transaction (`idle_in_transaction_session_timeout`,
a third of a lease) and cancels a statement that runs too long (`statement_timeout`), so that a
process paused mid-transaction (SIGSTOP, a frozen VM) does not hold its row locks for as long as it
is paused. One state escapes both: a client that stopped between the messages of one extended-
protocol exchange (asyncpg prepares a statement, gets its description, and only then binds and
runs it): the server waits for the client's next message inside the transaction, *active*, with
no statement running. Its locks then hold every process that needs those rows for as long as the
client is stopped (a standby taking the run over waited on them past its statement timeout, every
try: seen under load).

So every connection carries its process's name (`application_name`: ``orchestra host:pid``), and
a process that finds an owner's lease lapsed (a standby taking a run over, a sweep taking leases
back) first ends that owner's sessions that have been waiting for their client inside a
transaction for `stalled` seconds (`cut_off`): what `idle_in_transaction_session_timeout` would
have done. A session waiting for a lock or running a statement is not touched, nor one of a
process whose lease holds. Ending a session of the same role needs no privilege beyond it.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Iterable

    import asyncpg

__all__ = ("PREFIX", "application_name", "cut_off")

_NAME_MAX: Final = 63  # PostgreSQL keeps this many bytes of an application_name
PREFIX: Final = "orchestra "
"""What the `application_name` of every orchestra session starts with: set by orchestra over any
the DSN gives (`server_settings` win over the DSN's), so that a reader of `pg_stat_activity` tells
orchestra's sessions from any other application's (the journal's horizon, `_admin.horizon`)."""


def application_name() -> str:
    """This process's sessions' `application_name` (``orchestra host:pid``)."""
    return _tag(f"{socket.gethostname()}:{os.getpid()}")


def _tag(process: str) -> str:
    return f"{PREFIX}{process}"[:_NAME_MAX]


def _process_of(owner: str) -> str:
    """The process part of an owner's name (``host:pid`` of ``host:pid:suffix``)."""
    return owner.rsplit(":", 1)[0] if owner.count(":") >= 2 else owner


_CUT_OFF = """
SELECT count(pg_terminate_backend(a.pid)) FROM pg_stat_activity AS a
WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
    AND a.application_name = ANY ($1::text[])
    AND a.xact_start IS NOT NULL AND a.wait_event_type = 'Client'
    AND a.state_change < now() - make_interval(secs => $2)
"""


async def cut_off(conn: asyncpg.Connection, owners: Iterable[str], stalled: float) -> int:
    """End the sessions of the processes of `owners` (whose leases lapsed) that have waited for
    their client inside a transaction for `stalled` seconds; how many were ended."""
    tags = sorted({_tag(_process_of(owner)) for owner in owners if owner})
    if not tags:
        return 0
    ended: int = await conn.fetchval(_CUT_OFF, tags, float(stalled))
    return ended
