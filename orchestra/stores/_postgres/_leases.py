"""Leases on PostgreSQL: the claim, the heartbeat, the fenced completion and failure, the hand-back
and the taking back of expired leases, as functions over one asyncpg connection.

Every process that runs tasks (a worker, a coordinator with agents of its own) takes them the same
way, and every step is one statement (one round trip, atomic on its own), but for a completion,
which settles what it ends in the same transaction (`_graph`):

- **Claim**: the best ready tasks of a run, by kinds (each kind at most its room: what the
  process's agents of that kind can start now), priority, then the order they became ready (FIFO
  as the memory store's queue: ``tasks.seq``), locked with
  ``FOR UPDATE SKIP LOCKED`` so that concurrent claimers take different rows without waiting for
  each other (an empty claim while others claim at once does not prove that nothing is ready: a
  claimer looks again when woken, or at its next poll). Each row claimed gets a fresh lease: the
  claimer's name, a fencing token from the sequence ``lease_tokens`` and an expiry on the
  database's clock (``now() + lease``). The claim counts the attempt the lease is for: a lease
  that expires has used it.
- **Heartbeat**: extends the leases the caller still holds (owner and token match), and says which
  it lost.
- **Complete** / **fail**: written only while the caller holds the lease under the same token; a
  write refused (the task was re-leased, taken back or ended meanwhile) changes nothing but the
  journal, which says so (a ``refused`` event). A completion admits the attempt's spawns (their
  idempotency keys decided across runs: `_keyed.admit_spawned`), ends its tasks and settles them
  (dependents made ready or skipped, groups counted, the run's channel notified) in one
  transaction: no coordinator takes part.
- **Release**: a claimed task the caller will not run goes back to ready at once, its attempt not
  counted (a worker stopping).
- **Take back**: whoever sees a lease past its expiry makes the task ready again (or failed, once
  lost `max_lost` times: a task that kills every process it reaches goes to the dead letters),
  the lost attempt recorded; rows are locked ``SKIP LOCKED`` and the expiry re-checked on the
  locked row, so each expired lease is taken back once however many processes look.

No time comes from the caller: leases, expiries and timestamps are the database's ``now()``, so a
process whose clock is off changes nothing.

**Connections** for these statements are made with `SERVER_SETTINGS` (`connect` does): each
statement is planned for the batch it is given. asyncpg prepares a statement once and PostgreSQL
then settles on a generic plan after five runs, one that assumes an array parameter holds 10 rows
and, costed with the statistics of a run whose tasks were not leased yet, may walk every lease of
the owner against every row of the batch (a completion of 100 took 2.5 ms planned so, 1.3 ms
planned for its batch). A completion, and the claim that may follow it in its transaction
(`complete_and_claim`), are the exception: their statements are written so that their generic
plans serve every batch, and run under them (`_settle.FORCED_PLANS`).
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import asyncpg

from .._protocol import KEEP
from ._graph import admit_in
from ._keyed import admit_spawned
from ._keys import finish_tasks
from ._listen import ENDED, channel_of
from ._sessions import cut_off
from ._settle import (
    FORCED_PLANS,
    QUEUE_STEP,
    SESSION_PLANS,
    Settled,
    concerns,
    end_cascade,
    settle,
    transaction,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from ..._admission import Admission
    from ..._task import Task

__all__ = (
    "SERVER_SETTINGS",
    "Claimed",
    "End",
    "Failed",
    "NextClaim",
    "TakenBack",
    "claim",
    "complete",
    "complete_and_claim",
    "connect",
    "fail",
    "heartbeat",
    "note",
    "release",
    "requeue",
    "take_back_expired",
)

MAX_LOST = 3
"""A task whose lease expires this many times fails (`take_back_expired`)."""

SERVER_SETTINGS: Final = {"plan_cache_mode": "force_custom_plan"}
"""The session settings of a connection these statements run on (``server_settings=`` of
``asyncpg.connect`` and ``asyncpg.create_pool``)."""


async def connect(dsn: str) -> asyncpg.Connection:
    """A connection to `dsn` with `SERVER_SETTINGS`."""
    return await asyncpg.connect(dsn, server_settings=SERVER_SETTINGS)


class Claimed(NamedTuple):
    """A task as its claimer gets it: what rebuilds its `Task`, and its lease's token (its expiry
    is the database's to know: ``tasks.lease_expires``). JSON columns are the text the store
    wrote; `deps` maps each task it waited for (dependencies, members of its groups) to that
    task's output, JSON text."""

    run_id: str
    id: str
    seq: int
    token: int
    kind: str
    payload: str
    priority: int
    attempts: int
    timeout: float | None
    critical: bool
    metadata: str | None
    depends_on: list[str] | None
    depends_on_tags: list[str] | None
    deps: dict[str, str | None]


class End(NamedTuple):
    """How a claimed task ended, for `complete`: `state` is terminal (succeeded, failed,
    cancelled, skipped); `output` JSON text or None; `attempts` every attempt it had, when its
    process retried it under the lease (None: the claims counted them); `defaulted`, its output
    is its kind's default; `started`, when its first attempt here started (wall time, seconds)."""

    id: str
    token: int
    state: str
    output: str | None = None
    agent: str | None = None
    error: str | None = None
    error_type: str | None = None
    attempts: int | None = None
    defaulted: bool = False
    started: float | None = None


class Failed(NamedTuple):
    """A failed attempt of a claimed task, for the ``attempts`` table (`complete`, `note`):
    `started` wall time in seconds."""

    number: int
    agent: str
    error_type: str
    message: str
    started: float | None = None
    duration: float | None = None
    retry_in: float | None = None
    traceback: str | None = None
    status_code: int | None = None
    api_error_type: str | None = None
    request_id: str | None = None


class TakenBack(NamedTuple):
    """A lease that expired and was taken back: the task is ready again, or `failed` (lost
    `MAX_LOST` times)."""

    run_id: str
    id: str
    owner: str
    token: int
    attempts: int
    failed: bool


# The rows are picked (and locked) by an uncommitted subquery that the UPDATE reads as an array
# of ids, so that its plan, generic or not, reads them back by primary key (a join with the
# picked rows may be planned as a walk of the run's tasks). The lease's fencing token is drawn
# once for the claim, not per row: each lease of a task still has a token no lease of that task
# had before (the sequence only grows), which is all the fence compares. It returns what the
# claimer needs of each row, no more: every value is decoded per claimed task (the run id is the
# caller's; a lease's expiry, a timestamp, cost a microsecond a row to decode, read by nobody).
_CLAIM = """
UPDATE orchestra.tasks AS t
SET state = 'claimed', token = (SELECT nextval('orchestra.lease_tokens')),
    attempts = t.attempts + 1, lease_owner = $5, lease_expires = now() + make_interval(secs => $6)
WHERE t.run_id = $1 AND t.id = ANY (ARRAY(
    SELECT c.id
    FROM unnest($2::text[], $3::integer[]) AS k (kind, room)
    CROSS JOIN LATERAL (
        SELECT r.id, r.priority, r.seq FROM orchestra.tasks AS r
        WHERE r.run_id = $1 AND r.state = 'ready' AND r.kind = k.kind
        ORDER BY r.priority, r.seq
        LIMIT k.room
        FOR UPDATE SKIP LOCKED
    ) AS c
    ORDER BY c.priority, c.seq
    LIMIT $4
))
RETURNING t.id, t.seq, t.token, t.kind, t.payload::text, t.priority, t.attempts, t.timeout,
    t.critical, t.metadata::text, t.depends_on, t.depends_on_tags
"""

# The outputs a claimed task's context shows: of its dependencies, and of its groups' members
# (the waiters given as pairs: waiter and dependency id, waiter and tag).
_DEPS = """
SELECT w.waiter, d.id, d.output::text
FROM unnest($2::text[], $3::text[]) AS w (waiter, dep)
JOIN orchestra.tasks AS d ON d.run_id = $1 AND d.id = w.dep
UNION ALL
SELECT w.waiter, d.id, d.output::text
FROM unnest($4::text[], $5::text[]) AS w (waiter, tag)
JOIN orchestra.tasks AS d ON d.run_id = $1 AND d.tags @> ARRAY[w.tag] AND d.id <> w.waiter
ORDER BY 1
"""


async def claim(
    conn: asyncpg.Connection,
    run_id: str,
    rooms: Mapping[str, int],
    *,
    owner: str,
    lease: float,
    limit: int | None = None,
) -> list[Claimed]:
    """Claim the best ready tasks of `run_id` for `owner`: of each kind in `rooms` at most its
    room, at most `limit` in all (None: the rooms' sum), by priority then admission order, each
    under a fresh lease of `lease` seconds on the database's clock. Returns them best first."""
    kinds, room, total = _rooms(rooms, limit)
    if not total:
        return []
    claimed = await _claim_rows(conn, run_id, kinds, room, total, owner, lease)
    waiting = [task for task in claimed if task.depends_on or task.depends_on_tags]
    if waiting:
        await _fill_deps(conn, run_id, waiting)
    return claimed


def _rooms(rooms: Mapping[str, int], limit: int | None) -> tuple[list[str], list[int], int]:
    """The kinds a claim asks for, each one's room, and the claim's total (0: nothing to ask)."""
    kinds = [kind for kind, room in rooms.items() if room > 0]
    if not kinds:
        return [], [], 0
    total = sum(rooms[kind] for kind in kinds)
    if limit is not None:
        total = min(total, limit)
    if total <= 0:
        return [], [], 0
    # Each kind's best rows are locked before the best of all are kept: a kind is asked for no
    # more than the whole claim can take, so that few rows are locked and let go untaken.
    return kinds, [min(rooms[kind], total) for kind in kinds], total


async def _claim_rows(
    conn: asyncpg.Connection,
    run_id: str,
    kinds: list[str],
    room: list[int],
    total: int,
    owner: str,
    lease: float,
) -> list[Claimed]:
    rows = await conn.fetch(_CLAIM, run_id, kinds, room, total, owner, float(lease))
    # Each built as the tuple it is, and sorted by a key read in C (per claimed task: `_make`
    # and a lambda are a Python call each).
    new = tuple.__new__
    return sorted((new(Claimed, (run_id, *row, {})) for row in rows), key=_BEST_FIRST)


_BEST_FIRST = attrgetter("priority", "seq")


async def _fill_deps(conn: asyncpg.Connection, run_id: str, waiting: Sequence[Claimed]) -> None:
    on_ids = [(task.id, dep) for task in waiting for dep in task.depends_on or ()]
    on_tags = [(task.id, tag) for task in waiting for tag in task.depends_on_tags or ()]
    by_id = {task.id: task for task in waiting}
    rows = await conn.fetch(_DEPS, run_id, *_columns(on_ids, 2), *_columns(on_tags, 2))
    for waiter, dep_id, output in rows:
        by_id[waiter].deps[dep_id] = output


def _columns(rows: Sequence[Sequence[Any]], width: int) -> list[list[Any]]:
    """`rows` as `width` column lists (for ``unnest``): empty lists when there are none."""
    if not rows:
        return [[] for _ in range(width)]
    return [list(column) for column in zip(*rows, strict=True)]


def _unnested(rows: Sequence[Sequence[Any]], width: int) -> list[list[Any] | None]:
    """`_columns` for a multi-argument ``unnest`` in FROM, which pads a shorter array with NULLs:
    a column of NULLs only (a batch of successes' errors, error types and attempts) is sent as
    one NULL. asyncpg checks each element of an array against three abstract base classes
    (whether it is a nested array) before it encodes it, a Python-level call each."""
    return [
        None if column.count(None) == len(column) else column for column in _columns(rows, width)
    ]


_HEARTBEAT = """
UPDATE orchestra.tasks AS t SET lease_expires = now() + make_interval(secs => $5)
FROM unnest($2::text[], $3::text[], $4::bigint[]) AS h (run_id, id, token)
WHERE t.run_id = h.run_id AND t.id = h.id AND t.token = h.token AND t.lease_owner = $1
    AND t.state IN ('claimed', 'running')
RETURNING t.run_id, t.id
"""


async def heartbeat(
    conn: asyncpg.Connection,
    owner: str,
    held: Sequence[tuple[str, str, int]],
    *,
    lease: float,
) -> set[tuple[str, str]]:
    """Extend the leases `owner` holds, `held` as (run id, task id, token), to `lease` seconds
    from now (the database's clock). Returns the (run id, task id) of the ones it no longer holds
    (re-leased, taken back, ended): their attempts must stop; their writes will be refused."""
    if not held:
        return set()
    runs, ids, tokens = _columns(held, 3)
    rows = await conn.fetch(_HEARTBEAT, owner, runs, ids, tokens, float(lease))
    extended = {(row[0], row[1]) for row in rows}
    return {(run, task) for run, task, _ in held} - extended


# A write refused is rare (its task was re-leased meanwhile): the journal's line for it is written
# by `_REFUSED`, only when some were, not by an anti-join of every batch with what it wrote.
_COMPLETE = """
WITH done AS (
    UPDATE orchestra.tasks AS t
    SET state = e.state, output = e.output::json, agent = e.agent, error = e.error,
        error_type = e.error_type, finished = now(), lease_owner = NULL, lease_expires = NULL,
        attempts = coalesce(e.attempts, t.attempts), defaulted = e.defaulted,
        started = coalesce(t.started, to_timestamp(e.started))
    FROM unnest($3::text[], $4::bigint[], $5::text[], $6::text[], $7::text[], $8::text[],
        $9::text[], $10::integer[], $11::boolean[], $12::float8[])
        AS e (id, token, state, output, agent, error, error_type, attempts, defaulted, started)
    -- (the fence so written: `_settle.FORCED_PLANS`)
    WHERE t.run_id = $1 AND t.id = e.id AND t.token = e.token
        AND coalesce(t.lease_owner, '') = $2 AND t.state IN ('claimed', 'running')
    RETURNING t.id, t.key IS NOT NULL AS keyed, t.tags IS NOT NULL AS tagged
), heard AS (
    -- the coordinator's run follows the ends it did not write itself (`orchestra.ended`): one
    -- row for the batch, saying whether its tasks spawned (admitted earlier in this transaction)
    INSERT INTO orchestra.ended (run_id, ids, spawned)
    SELECT $1, d.ids, EXISTS (
        SELECT FROM orchestra.tasks AS s WHERE s.run_id = $1 AND s.parent = ANY (d.ids)
    )
    FROM (SELECT array_agg(id) AS ids FROM done) AS d
    WHERE d.ids IS NOT NULL
        AND $2 IS DISTINCT FROM (SELECT owner FROM orchestra.runs WHERE id = $1)
), woken AS (
    -- and, while one holds the run, hears of them at the commit: an end that readies nothing
    -- notifies nobody otherwise, and a coordinator with nothing left to claim would wait for its
    -- poll (one that takes the run later reads the feed as it starts)
    SELECT pg_notify($13, $14) FROM (SELECT 1 FROM done LIMIT 1) AS d
    WHERE $2 <> (SELECT owner FROM orchestra.runs WHERE id = $1)
)
SELECT id, keyed, tagged FROM done LEFT JOIN woken ON true
"""

_REFUSED = """
INSERT INTO orchestra.events (run_id, task_id, event, agent, detail)
SELECT $1, e.id, 'refused', e.agent,
    e.state || ' from ' || $2 || ' refused: its lease (token ' || e.token || ') is no longer held'
FROM unnest($3::text[], $4::bigint[], $5::text[], $6::text[]) WITH ORDINALITY
    AS e (id, token, state, agent, n)
ORDER BY e.n
"""


# The ends `complete` may write, their rows locked: the spawns of an attempt are admitted while
# its task is still running, as the memory store admits them (what waits for the spawner waits).
_HELD = """
SELECT t.id FROM orchestra.tasks AS t
JOIN unnest($3::text[], $4::bigint[]) AS e (id, token) ON t.id = e.id AND t.token = e.token
WHERE t.run_id = $1 AND t.lease_owner = $2 AND t.state IN ('claimed', 'running')
ORDER BY t.id
FOR UPDATE OF t
"""


async def complete(
    conn: asyncpg.Connection,
    run_id: str,
    owner: str,
    ends: Sequence[End],
    *,
    spawned: Mapping[str, Sequence[Task]] | None = None,
    admission: Admission | None = None,
    failures: Mapping[str, Sequence[Failed]] | None = None,
    key_lease: float | None = None,
) -> list[bool]:
    """End claimed tasks of `run_id`, each only while `owner` holds its lease under the token it
    carries, and settle them in the same transaction (`_settle.settle`: dependents made ready or
    skipped, groups counted, the run's channel notified). `spawned`: the tasks each end's
    attempt spawned, by its id, admitted with it (checked by `admission`, the run's);
    `failures`: its failed attempts not yet written (`note`), by its id. Returns, for each end,
    whether it was written; a refused one is in the journal (its spawns and attempts dropped).
    The idempotency key of a task that ended (or was skipped) takes its end while the task's run
    holds the key (`_keys.finish_tasks`), announced to the key's waiters. With `key_lease`, a
    spawn's key is decided across runs with its admission (`_keyed.admit_spawned`, held for
    `key_lease` seconds): the spawn runs, ends with a stored result, or is held back while another
    run holds the key (without, it is decided within the run only, as `_graph.admit` decides).

    Raises:
        InputError: a spawn was refused: nothing was written.
    """
    done, _ = await _complete(
        conn, run_id, owner, ends, spawned, admission, failures, key_lease, None
    )
    return done


class NextClaim(NamedTuple):
    """The claim `complete_and_claim` makes after the ends it writes (`claim`'s arguments), and
    `taken`, called with what it claimed before the transaction commits: the caller may start
    those tasks while the commit is flushed to disk. Their leases hold once the commit returns;
    a commit that fails leaves them unleased (their ends are then refused, the tasks claimed
    again: executions are at least once), and a transaction run again (after a deadlock, or on
    a new connection when its own was lost) calls it again with what that run claimed."""

    rooms: Mapping[str, int]
    limit: int | None
    lease: float
    taken: Callable[[list[Claimed]], None] | None = None


async def complete_and_claim(
    conn: asyncpg.Connection,
    run_id: str,
    owner: str,
    ends: Sequence[End],
    then: NextClaim,
    *,
    spawned: Mapping[str, Sequence[Task]] | None = None,
    admission: Admission | None = None,
    failures: Mapping[str, Sequence[Failed]] | None = None,
    key_lease: float | None = None,
) -> tuple[list[bool], list[Claimed]]:
    """`complete`, then `claim` for `owner` in the same transaction (one commit, one round trip
    less): the room the ends give back is claimed as they are written, and what their settle made
    ready may be claimed at once. Returns whether each end was written, and the tasks claimed."""
    return await _complete(conn, run_id, owner, ends, spawned, admission, failures, key_lease, then)


async def _complete(
    conn: asyncpg.Connection,
    run_id: str,
    owner: str,
    ends: Sequence[End],
    spawned: Mapping[str, Sequence[Task]] | None,
    admission: Admission | None,
    failures: Mapping[str, Sequence[Failed]] | None,
    key_lease: float | None,
    then: NextClaim | None,
) -> tuple[list[bool], list[Claimed]]:
    if not ends:
        return [], []
    spawning = {task_id: tasks for task_id, tasks in (spawned or {}).items() if tasks}
    if spawning and admission is None:
        raise TypeError("complete: spawned tasks need the run's admission to be checked")
    keyed_spawns = key_lease is not None and any(
        t.key is not None for tasks in spawning.values() for t in tasks
    )

    # The completion, `concerns` and the claim have plans that serve any batch
    # (`_settle.FORCED_PLANS`), but in a caller's transaction, which a SET LOCAL would outlast
    # this call into. Set with the transaction's BEGIN (one round trip), unless spawns are
    # admitted first: those are planned for their batch.
    generic = not conn.is_in_transaction()
    begin = FORCED_PLANS if generic and not spawning else None

    async def step(conn: asyncpg.Connection) -> tuple[list[bool], list[Claimed]]:
        planned = begin is not None  # whether the statements run now run under `FORCED_PLANS`
        admitted: list[str] = []  # the spawns admitted, when some have keys
        if spawning:
            spawners = [end for end in ends if end.id in spawning]
            held = await conn.fetch(
                _HELD, run_id, owner, [e.id for e in spawners], [e.token for e in spawners]
            )
            for (task_id,) in held:
                ids, _, _ = await admit_in(
                    conn, run_id, spawning[task_id], admission,  # type: ignore[arg-type]
                    f"tasks spawned by {task_id!r}", False, 0, task_id,
                )  # fmt: skip
                if keyed_spawns:
                    admitted.extend(ids)
            if generic:
                await conn.execute(FORCED_PLANS)
                planned = True
        rows = await conn.fetch(
            _COMPLETE, run_id, owner, *_unnested(ends, len(End._fields)), channel_of(run_id), ENDED
        )
        written = {row[0] for row in rows}
        keyed = any(row[1] for row in rows)
        if len(written) < len(ends):
            refused = [(e.id, e.token, e.state, e.agent) for e in ends if e.id not in written]
            await conn.execute(_REFUSED, run_id, owner, *_columns(refused, 4))
        if failures:
            await _record(
                conn, run_id,
                [(task_id, f) for task_id, fs in failures.items() if task_id in written for f in fs],
            )  # fmt: skip
        ended = [(end.id, end.state) for end in ends if end.id in written]
        settled = Settled([], [])
        # A task with tags or a key concerns its groups or its key's holds: settled without
        # asking; the others are asked only whether something waits for them.
        if ended and (
            keyed
            or any(row[2] for row in rows)
            or await concerns(conn, run_id, [task_id for task_id, _ in ended], members=False)
        ):
            # What a settle and the keys run next is planned for its batch again (the session's).
            if planned:
                await conn.execute(SESSION_PLANS)
                planned = False
            settled = await end_cascade(conn, run_id, ended)
        elif planned and (admitted or keyed):
            await conn.execute(SESSION_PLANS)
            planned = False
        if admitted:
            # After the settle (a spawn it skipped claims nothing), before the keys of what
            # ended are written: the spawns' keys and those are locked together, in key order.
            assert key_lease is not None  # (`keyed_spawns` says so)
            finished = [task_id for task_id, _ in ended] + settled.skipped
            await admit_spawned(conn, run_id, admitted, finished, owner=owner, lease=key_lease)
        if keyed or settled.skipped:
            # The keys of what ended (the skipped too) take its end: waiters hear it at commit.
            await finish_tasks(conn, run_id, [task_id for task_id, _ in ended] + settled.skipped)
        claimed: list[Claimed] = []
        kinds, room, total = _rooms(then.rooms, then.limit) if then else ([], [], 0)
        if then and total:
            # Under the generic plan when nothing switched back (tests/test_pg_plans.py): its
            # rows are read by the indexes whatever the batch; planned otherwise. Rows are
            # locked SKIP LOCKED, never waited for: the lock order does not reach them.
            claimed = await _claim_rows(conn, run_id, kinds, room, total, owner, then.lease)
            waiting = [task for task in claimed if task.depends_on or task.depends_on_tags]
            if waiting:
                if planned:
                    await conn.execute(SESSION_PLANS)
                await _fill_deps(conn, run_id, waiting)
            if then.taken is not None:
                then.taken(claimed)  # the last statement ran: only the commit is left
        return [end.id in written for end in ends], claimed

    return await transaction(conn, step, begin=begin)


_ATTEMPTS = """
INSERT INTO orchestra.attempts (run_id, task_id, number, agent, error_type, message, started,
    duration, retry_in, traceback, status_code, api_error_type, request_id)
SELECT $1, a.id, a.number, a.agent, a.error_type, a.message, to_timestamp(a.started), a.duration,
    a.retry_in, a.traceback, a.status_code, a.api_error_type, a.request_id
FROM unnest($2::text[], $3::integer[], $4::text[], $5::text[], $6::text[], $7::float8[],
    $8::float8[], $9::float8[], $10::text[], $11::integer[], $12::text[], $13::text[])
    AS a (id, number, agent, error_type, message, started, duration, retry_in, traceback,
        status_code, api_error_type, request_id)
"""


async def _record(
    conn: asyncpg.Connection, run_id: str, failed: Sequence[tuple[str, Failed]]
) -> None:
    if failed:
        await conn.execute(
            _ATTEMPTS, run_id, *_columns([(task_id, *f) for task_id, f in failed], 12)
        )


_NOTED = """
UPDATE orchestra.tasks AS t SET attempts = greatest(t.attempts, n.attempts)
FROM unnest($2::text[], $3::integer[]) AS n (id, attempts)
WHERE t.run_id = $1 AND t.id = n.id
"""


async def note(
    conn: asyncpg.Connection,
    run_id: str,
    owner: str,
    failed: Sequence[tuple[str, int, Failed]],
) -> list[bool]:
    """Record failed attempts of claimed tasks that go on (retried by `owner` under its lease),
    `failed` as (task id, token, attempt): each only while `owner` holds the task under that
    token, its attempts counted up to the retry that follows. Returns, for each, whether it was
    written."""
    if not failed:
        return []

    async def step(conn: asyncpg.Connection) -> list[bool]:
        held = {
            row[0]
            for row in await conn.fetch(
                _HELD, run_id, owner, [f[0] for f in failed], [f[1] for f in failed]
            )
        }
        await _record(conn, run_id, [(task_id, f) for task_id, _, f in failed if task_id in held])
        # The lease now stands for the attempt after the last one noted: a lease lost, or a task
        # handed back, counts (or uncounts) that one, numbered after the failures written.
        last: dict[str, int] = {}
        for task_id, _, f in failed:
            if task_id in held:
                last[task_id] = max(last.get(task_id, 0), f.number)
        if last:
            await conn.execute(_NOTED, run_id, list(last), [n + 1 for n in last.values()])
        return [task_id in held for task_id, _, _ in failed]

    done: list[bool] = await transaction(conn, step)
    return done


# A retry due now goes to the back of its priority, as in memory.
_FAIL = f"""
WITH failed AS (
    UPDATE orchestra.tasks AS t
    SET state = CASE WHEN $6::float8 > 0 THEN 'retry_wait' ELSE 'ready' END,
        seq = CASE WHEN $6::float8 > 0 THEN t.seq
            ELSE nextval('orchestra.queue_order') * {QUEUE_STEP} END,
        due = CASE WHEN $6::float8 > 0 THEN now() + make_interval(secs => $6) END,
        target = CASE WHEN $7 THEN $8 ELSE t.target END,
        lease_owner = NULL, lease_expires = NULL
    WHERE t.run_id = $1 AND t.id = $2 AND t.token = $3 AND t.lease_owner = $4
        AND t.state IN ('claimed', 'running')
    RETURNING t.run_id, t.id, t.attempts
), recorded AS (
    INSERT INTO orchestra.attempts (run_id, task_id, number, agent, error_type, message, started,
        duration, retry_in, traceback)
    SELECT run_id, id, attempts, $5, $9, $10, now() - make_interval(secs => $11), $11, $6, $12
    FROM failed
), refused AS (
    INSERT INTO orchestra.events (run_id, task_id, event, agent, detail)
    SELECT $1, $2, 'refused', $5,
        'failure from ' || $4 || ' refused: its lease (token ' || $3 || ') is no longer held'
    WHERE NOT EXISTS (SELECT 1 FROM failed)
)
SELECT count(*) FROM failed
"""


async def fail(
    conn: asyncpg.Connection,
    run_id: str,
    task_id: str,
    token: int,
    *,
    owner: str,
    agent: str,
    error_type: str,
    message: str,
    duration: float = 0.0,
    retry_in: float = 0.0,
    next_agent: str | None = KEEP,
    traceback: str | None = None,
) -> bool:
    """A claimed task's attempt failed and the task goes on: ready again in `retry_in` seconds
    (the database's clock), on `next_agent` if given (None: any agent of its kind; `KEEP`, the
    default: the agent it has), the attempt
    recorded. Only while `owner` holds its lease under `token`; False (and a journal event) when
    the write was refused."""
    retarget = next_agent is not KEEP
    target = next_agent if retarget else None
    written: int = await conn.fetchval(
        _FAIL, run_id, task_id, token, owner, agent, float(retry_in), retarget, target,
        error_type, message, float(duration), traceback,
    )  # fmt: skip
    return written == 1


_RELEASE = """
UPDATE orchestra.tasks AS t
SET state = 'ready', attempts = t.attempts - 1, lease_owner = NULL, lease_expires = NULL
FROM unnest($2::text[], $3::text[], $4::bigint[]) AS h (run_id, id, token)
WHERE t.run_id = h.run_id AND t.id = h.id AND t.token = h.token AND t.lease_owner = $1
    AND t.state = 'claimed'
RETURNING t.run_id, t.id
"""


async def release(
    conn: asyncpg.Connection, owner: str, held: Sequence[tuple[str, str, int]]
) -> set[tuple[str, str]]:
    """Hand back claimed tasks `owner` will not run, `held` as (run id, task id, token): ready
    again at once, their attempts not counted. Returns the (run id, task id) handed back (a task
    whose lease `owner` lost meanwhile is not its to hand back)."""
    if not held:
        return set()
    runs, ids, tokens = _columns(held, 3)
    rows = await conn.fetch(_RELEASE, owner, runs, ids, tokens)
    return {(row[0], row[1]) for row in rows}


_REQUEUE = f"""
UPDATE orchestra.tasks AS t
SET state = 'ready', seq = nextval('orchestra.queue_order') * {QUEUE_STEP},
    priority = coalesce(h.priority, t.priority), lease_owner = NULL, lease_expires = NULL
FROM unnest($2::text[], $3::text[], $4::bigint[], $5::integer[])
    AS h (run_id, id, token, priority)
WHERE t.run_id = h.run_id AND t.id = h.id AND t.token = h.token AND t.lease_owner = $1
    AND t.state IN ('claimed', 'running')
RETURNING t.run_id, t.id
"""


async def requeue(
    conn: asyncpg.Connection, owner: str, held: Sequence[tuple[str, str, int, int | None]]
) -> set[tuple[str, str]]:
    """Put claimed tasks whose attempt failed back in their run's queue, behind the tasks ready
    at their priority (a retry due now, as in memory), `held` as (run id, task id, token,
    priority: its new one, or None to keep it): the attempt stays counted, the next claim counts
    the next one. Returns the (run id, task id)
    requeued (a task whose lease `owner` lost meanwhile is not its to requeue). The caller
    notifies the runs' channels."""
    if not held:
        return set()
    rows = await conn.fetch(_REQUEUE, owner, *_columns(held, 4))
    return {(row[0], row[1]) for row in rows}


_LAPSED = """
SELECT DISTINCT lease_owner FROM orchestra.tasks
WHERE lease_owner IS NOT NULL AND lease_expires < now() AND ($1::text IS NULL OR run_id = $1)
"""

STALLED: Final = 1.0
"""Seconds a lapsed owner's session may wait for its client inside a transaction before a sweep
ends it (`_sessions.cut_off`)."""

_TAKE_BACK = """
WITH expired AS (
    SELECT t.run_id, t.id, t.lease_owner, t.token FROM orchestra.tasks AS t
    WHERE t.lease_owner IS NOT NULL AND t.lease_expires < now()
        AND ($1::text IS NULL OR t.run_id = $1)
    ORDER BY t.lease_expires
    LIMIT $3
    FOR UPDATE SKIP LOCKED
), taken AS (
    UPDATE orchestra.tasks AS t
    SET state = CASE WHEN t.lost + 1 >= $2 THEN 'failed' ELSE 'ready' END,
        lost = t.lost + 1, lease_owner = NULL, lease_expires = NULL,
        finished = CASE WHEN t.lost + 1 >= $2 THEN now() END,
        error_type = CASE WHEN t.lost + 1 >= $2 THEN 'LeaseExpired' ELSE t.error_type END,
        error = CASE WHEN t.lost + 1 >= $2
            THEN 'its lease expired ' || (t.lost + 1) || ' times: every process that ran it '
                || 'stopped (killed, or paused past its lease)'
            ELSE t.error END
    FROM expired AS e
    WHERE t.run_id = e.run_id AND t.id = e.id
    RETURNING t.run_id, t.id, e.lease_owner, e.token, t.attempts, t.state = 'failed' AS failed
), recorded AS (
    INSERT INTO orchestra.attempts (run_id, task_id, number, agent, error_type, message)
    SELECT run_id, id, attempts, lease_owner, 'LeaseExpired',
        'the lease of ' || lease_owner || ' (token ' || token || ') expired'
    FROM taken
), journal AS (
    INSERT INTO orchestra.events (run_id, task_id, event, agent, attempt, detail)
    SELECT run_id, id, 'lease_expired', lease_owner, attempts,
        'taken back from ' || lease_owner || ' (token ' || token || ')'
        || CASE WHEN failed THEN ': failed, lost too often' ELSE '' END
    FROM taken
), heard AS (
    INSERT INTO orchestra.ended (run_id, ids)
    SELECT run_id, array_agg(id) FROM taken WHERE failed GROUP BY run_id
)
SELECT * FROM taken
"""


async def take_back_expired(
    conn: asyncpg.Connection,
    run_id: str | None = None,
    *,
    max_lost: int = MAX_LOST,
    limit: int = 1000,
) -> list[TakenBack]:
    """Take back the leases past their expiry (of `run_id`, or of every run), at most `limit`:
    each task is ready again, or failed once its lease was lost `max_lost` times; the attempt
    the lease was for is recorded (``LeaseExpired``). Safe to call from any number of processes
    at once: each expired lease is taken back by one of them."""

    async def step(conn: asyncpg.Connection) -> list[TakenBack]:
        # The rows of a lapsed owner stalled mid-statement stay locked (and skipped) for as long
        # as it is stopped: its stalled sessions are ended first (`_sessions`).
        await cut_off(conn, [row[0] for row in await conn.fetch(_LAPSED, run_id)], STALLED)
        taken = [
            TakenBack._make(row) for row in await conn.fetch(_TAKE_BACK, run_id, max_lost, limit)
        ]
        # A task failed so ends: what waits for it is skipped, its groups counted (by run).
        failed: dict[str, list[tuple[str, str]]] = {}
        for back in taken:
            if back.failed:
                failed.setdefault(back.run_id, []).append((back.id, "failed"))
        # Every run settled before any key is locked: keys come last in every transaction that
        # locks tasks (a claim locks its run's tasks and then keys, as this would otherwise lock
        # one run's keys and then another's tasks). Runs in id order, so that two of these lock
        # the runs' holds in one order.
        keyed: list[tuple[str, list[str]]] = []
        for run in sorted(failed):
            settled = await settle(conn, run, failed[run])
            keyed.append((run, [task_id for task_id, _ in failed[run]] + settled.skipped))
        for run, task_ids in keyed:
            await finish_tasks(conn, run, task_ids)
        return taken

    return await transaction(conn, step)
