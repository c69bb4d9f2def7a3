"""What a coordinator learns from the database, and the ends only it decides, in SQL.

- **Heard ends** (`heard`): the tasks of its run that other processes ended (a worker's
  completion, a lease lost too often), taken from the feed ``orchestra.ended`` (`_leases.complete`
  and `_leases.take_back_expired` write it in the transaction of the end): each row is deleted in
  the transaction that reads it, so every end is heard once, whatever order the transactions that
  wrote them committed in. With each end come its failed attempts and the tasks its attempt
  spawned (admitted in the same transaction), with what that transaction decided for their keys,
  for the coordinator's run to take in as if the task had ended there.
- **Decided ends** (`decide`): tasks the coordinator ends itself (a cancel, a deadline passed), not
  as a lease holder: written under the fence of its lease on the run (`_coordinator.fenced`),
  whoever holds the task (a worker holding one finds its lease gone at its next heartbeat, and its
  completion is refused), and settled in the same transaction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, NamedTuple

from ._keyed import spawn_answers
from ._settle import GENERIC_PLANS, SESSION_PLANS, columns, settle

if TYPE_CHECKING:
    from collections.abc import Sequence

    import asyncpg

    from ._keys import Answer

__all__ = ("Heard", "decide", "heard")


class Heard(NamedTuple):
    """Ends heard from the feed: `ends` rows (id, state, output JSON, agent, error, error_type,
    attempts, started (wall seconds), defaulted, and a flag of the feed's own), in the order they
    were written; `failures`
    rows (task id, number, agent, error_type, message, started, duration, retry_in, traceback,
    status_code, api_error_type, request_id); `spawned` rows (parent, id, kind, payload JSON,
    priority, depends_on, depends_on_tags, tags, key, timeout, critical, metadata JSON), each
    parent's in their order; `answers`, what the completions decided for the spawns' keys
    (`_keyed.spawn_answers`), by task id."""

    ends: list[Any]
    failures: list[Any]
    spawned: list[Any]
    answers: dict[str, Answer]


SWEEP_EVERY: Final = 2048
"""The feed is vacuumed by the coordinator that reads its row numbered a multiple of this."""

_HEARD = """
WITH taken AS (
    DELETE FROM orchestra.ended WHERE run_id = $1 RETURNING id, n
)
SELECT t.id, t.state, t.output::text, t.agent, t.error, t.error_type, t.attempts,
    extract(epoch FROM t.started)::float8, t.defaulted, taken.n % $2 = 0 AS sweep
FROM taken JOIN orchestra.tasks AS t ON t.run_id = $1 AND t.id = taken.id
ORDER BY taken.n
"""

_FAILURES = """
SELECT task_id, number, agent, error_type, message, extract(epoch FROM started)::float8,
    duration, retry_in, traceback, status_code, api_error_type, request_id
FROM orchestra.attempts WHERE run_id = $1 AND task_id = ANY ($2::text[])
ORDER BY task_id, number
"""

_SPAWNED = """
SELECT parent, id, kind, payload::text, priority, depends_on, depends_on_tags, tags, key,
    timeout, critical, metadata::text
FROM orchestra.tasks WHERE run_id = $1 AND parent = ANY ($2::text[])
ORDER BY parent, idx
"""


async def heard(conn: asyncpg.Connection, run_id: str) -> Heard:
    """Take the ends of `run_id` that other processes wrote since the last call."""
    generic = not conn.is_in_transaction()  # (a SET LOCAL would outlast this block in a caller's)
    async with conn.transaction():
        # These reads are by primary key or a task's parent whatever the batch (GENERIC_PLANS).
        if generic:
            await conn.execute(GENERIC_PLANS)
        ends = list(await conn.fetch(_HEARD, run_id, SWEEP_EVERY))
        if not ends:
            return Heard([], [], [], {})
        ids = [row[0] for row in ends]
        failures = list(await conn.fetch(_FAILURES, run_id, ids))
        spawned = list(await conn.fetch(_SPAWNED, run_id, ids))
        answers: dict[str, Answer] = {}
        spawners = sorted({row[0] for row in spawned if row[8] is not None})
        if spawners:
            if generic:
                await conn.execute(SESSION_PLANS)
            answers = await spawn_answers(conn, run_id, spawners)
    # The rows read are deleted, and stay in the table and its index, dead, until a vacuum: each
    # read walked them all again (a bitmap scan does not learn that an entry is dead), its cost
    # growing with every end of the run (17 us per end on average over 50,000, a tenth of that
    # at first). Autovacuum looks once a minute at most; the feed is vacuumed here every
    # `SWEEP_EVERY` ends of all runs (the rows are numbered across them, so one coordinator does
    # each time), a table of a few thousand dead rows: a millisecond or so.
    if any(row[9] for row in ends) and not conn.is_in_transaction():
        # SKIP_LOCKED: another process (autovacuum) vacuuming it now is as good. TRUNCATE false:
        # giving its empty tail pages back takes an exclusive lock, which the workers' inserts
        # of ends hold off; the vacuum would retry it every 50 ms (64 ms per vacuum, measured)
        # and, once it has it, stop their completions meanwhile.
        await conn.execute("VACUUM (SKIP_LOCKED, TRUNCATE false) orchestra.ended")
    return Heard(ends, failures, spawned, answers)


_DECIDE = """
UPDATE orchestra.tasks AS t
SET state = d.state, error = d.error, error_type = d.error_type, output = d.output::json,
    agent = d.agent, defaulted = d.defaulted, finished = now(), lease_owner = NULL,
    lease_expires = NULL
FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
    $8::boolean[]) AS d (id, state, error, error_type, output, agent, defaulted)
WHERE t.run_id = $1 AND t.id = d.id
    AND t.state NOT IN ('succeeded', 'failed', 'cancelled', 'skipped')
RETURNING t.id, t.state
"""


async def decide(
    conn: asyncpg.Connection,
    run_id: str,
    ends: Sequence[tuple[str, str, str | None, str | None, str | None, str | None, bool]],
) -> tuple[list[str], list[str]]:
    """End tasks of `run_id` as the coordinator decided, `ends` as (id, state, error,
    error_type, output JSON, agent, defaulted), in the caller's transaction (the fenced one),
    settling them. A task already ended is left as it is. Returns the ids ended now, and the
    ids skipped because of them."""
    if not ends:
        return [], []
    rows = await conn.fetch(_DECIDE, run_id, *columns(ends, 7))
    done = {row[0]: row[1] for row in rows}
    settled = await settle(conn, run_id, [(e[0], done[e[0]]) for e in ends if e[0] in done])
    return [e[0] for e in ends if e[0] in done], settled.skipped
