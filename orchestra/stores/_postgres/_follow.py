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
from ._settle import FORCED_PLANS, SESSION_PLANS, columns, settle

if TYPE_CHECKING:
    from collections.abc import Sequence

    import asyncpg

    from ._keys import Answer

__all__ = ("Heard", "decide", "heard")


class Heard(NamedTuple):
    """Ends heard from the feed: `ends` rows (id, state, output JSON, agent, error, error_type,
    attempts, started (wall seconds), defaulted, and the feed's own), in the order they were
    written (the ends one transaction wrote, by task id); `failures` by task id, rows (number, agent, error_type, message, started,
    duration, retry_in, traceback, status_code, api_error_type, request_id) in their order;
    `spawned` by parent, rows (id, kind, payload JSON, priority, depends_on, depends_on_tags,
    tags, key, timeout, critical, metadata JSON) in their order; `answers`, what the completions
    decided for the spawns' keys (`_keyed.spawn_answers`), by task id."""

    ends: list[Any]
    failures: dict[str, list[Any]]
    spawned: dict[str, list[Any]]
    answers: dict[str, Answer]


SWEEP_EVERY: Final = 256
"""The feed is vacuumed by the coordinator that reads its row numbered a multiple of this (a row
per transaction that wrote ends: a worker's batch of up to a hundred)."""

# One statement, one round trip per read: an end's failed attempts and spawns come with it, as
# arrays of rows (asyncpg decodes them to tuples), instead of two more statements by the ids
# read. Only a task that failed an attempt has rows in `attempts`: one that did not succeed, took
# more than one attempt (a lease lost counts as one) or succeeded with its default after its
# agents failed; the others skip that probe, and so do the ends of a batch that spawned nothing
# (the feed's row says so) skip the probe for spawns (NULL: nothing to take in). A row's ids are
# read from the primary key in one index scan (`= ANY`, in key order: a batch's ids are close to
# each other there), not one descent per id; a batch's ends are taken in in that order. Times
# are read as float8 seconds by date_part (extract would make a numeric of each first).
_HEARD = """
WITH taken AS (
    DELETE FROM orchestra.ended WHERE run_id = $1 RETURNING ids, n, spawned
)
SELECT t.id, t.state, t.output::text, t.agent, t.error, t.error_type, t.attempts,
    date_part('epoch', t.started), t.defaulted, taken.n % $2 = 0 AS sweep,
    CASE WHEN t.state <> 'succeeded' OR t.attempts > 1 OR t.defaulted THEN ARRAY(
        SELECT ROW(a.number, a.agent, a.error_type, a.message,
            date_part('epoch', a.started), a.duration, a.retry_in, a.traceback,
            a.status_code, a.api_error_type, a.request_id)
        FROM orchestra.attempts AS a WHERE a.run_id = $1 AND a.task_id = t.id
        ORDER BY a.number
    ) END AS failures,
    CASE WHEN taken.spawned THEN ARRAY(
        SELECT ROW(s.id, s.kind, s.payload::text, s.priority, s.depends_on, s.depends_on_tags,
            s.tags, s.key, s.timeout, s.critical, s.metadata::text)
        FROM orchestra.tasks AS s WHERE s.run_id = $1 AND s.parent = t.id
        ORDER BY s.idx
    ) END AS spawned
FROM taken JOIN orchestra.tasks AS t ON t.run_id = $1 AND t.id = ANY (taken.ids)
ORDER BY taken.n, t.id
"""

# (asyncpg's `Transaction` sends its BEGIN alone: with the plans' setting after it, one round
# trip more per read, for each of the run's few dozen ends.)
_BEGIN: Final = f"BEGIN; {FORCED_PLANS}"


async def heard(conn: asyncpg.Connection, run_id: str) -> Heard:
    """Take the ends of `run_id` that other processes wrote since the last call."""
    if conn.is_in_transaction():  # (a SET LOCAL would outlast this call in a caller's)
        found = await _take(conn, run_id, generic=False)
    else:
        # The read is by primary key or a task's parent whatever the batch (FORCED_PLANS).
        await conn.execute(_BEGIN)
        try:
            found = await _take(conn, run_id, generic=True)
        except BaseException:
            if not conn.is_closed():
                # (a connection cut mid-statement is closed, its transaction gone with it)
                await conn.execute("ROLLBACK")
            raise
        await conn.execute("COMMIT")
    # The rows read are deleted, and stay in the table and its index, dead, until a vacuum: each
    # read walked them all again (a bitmap scan does not learn that an entry is dead), its cost
    # growing with every row the feed had (with a row per end, 17 us per end on average over
    # 50,000, a tenth of that at first). Autovacuum looks once a minute at most; the feed is
    # vacuumed here every `SWEEP_EVERY` rows of all runs (the rows are numbered across them, so
    # one coordinator does each time), a table of a few hundred dead rows: a millisecond or so.
    if any(row[9] for row in found.ends) and not conn.is_in_transaction():
        # SKIP_LOCKED: another process (autovacuum) vacuuming it now is as good. TRUNCATE false:
        # giving its empty tail pages back takes an exclusive lock, which the workers' inserts
        # of ends hold off; the vacuum would retry it every 50 ms (64 ms per vacuum, measured)
        # and, once it has it, stop their completions meanwhile.
        await conn.execute("VACUUM (SKIP_LOCKED, TRUNCATE false) orchestra.ended")
    return found


async def _take(conn: asyncpg.Connection, run_id: str, *, generic: bool) -> Heard:
    ends = await conn.fetch(_HEARD, run_id, SWEEP_EVERY)
    failures: dict[str, list[Any]] = {}
    spawned: dict[str, list[Any]] = {}
    spawners = []  # of spawns with keys
    for row in ends:
        if row[10]:
            failures[row[0]] = row[10]
        if row[11]:
            spawned[row[0]] = spawns = row[11]
            if any(spawn[7] is not None for spawn in spawns):
                spawners.append(row[0])
    answers: dict[str, Answer] = {}
    if spawners:
        if generic:
            await conn.execute(SESSION_PLANS)
        answers = await spawn_answers(conn, run_id, sorted(spawners))
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
