"""A PostgreSQL database read for its user: its runs, workers, journal and dead letters, and a
run's failed tasks made runnable again (`PostgresStore.runs`, `.workers`, `.events`,
`.dead_letters`, `.retry`, and ``orchestra runs --dsn``). Coroutine functions of an asyncpg
connection, run by the store's `Database`.

The answers have the shapes of the SQLite store's (`stores/_sqlite/_admin.py`): dicts of a row's
columns, times as wall-clock floats (seconds since the epoch, from the database's
``timestamptz``), JSON columns as the text that was written. What only this store has is there
too (a run's lease token and expiry, a worker's ``expires`` and ``gone``).

**Retry** differs from SQLite's in where it leaves the work. On SQLite a reopened task is pending
and the next coordinator works out what it waits for; here readiness lives in the database
(``tasks.waiting``, ``edges``, ``groups``), and any worker serving the run may claim what is
ready. So `retry` puts every reopened task where admission would have put it: ready when what it
waits for is done, else pending with ``waiting`` counting what is not done yet and an edge from
each (a task skipped at its admission has none: nothing was to wake it); the skipped tasks
downstream of it whose every other dependency and group is still good reopened the same way; the
groups' ``open`` and ``failed`` counted again. All of it in one transaction that locks the run's
row, then its tasks, then its groups (the order admission and completion lock them in), so a
completion settling at the same time comes wholly before or after it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any, Final

import asyncpg

from ..._exceptions import InputError, StoreError
from ..._task import CANCELLED, FAILED, PENDING, SKIPPED, SUCCEEDED, TERMINAL
from . import _keyed as keyed
from ._database import _CONNECT_TIMEOUT, explain
from ._listen import notify
from ._schema import version_of
from ._sessions import PREFIX
from ._settle import columns, lock_groups, make_ready, transaction

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

__all__ = ("dead", "events", "horizon", "made", "retry", "run", "runs", "watch", "workers")

# What can no longer succeed: a task waiting for one of these, or for a group with a member in
# one of these, is skipped.
_DOOMED: Final = frozenset((FAILED, CANCELLED, SKIPPED))


def _epoch(column: str) -> str:
    """A ``timestamptz`` column as wall-clock seconds (a float, NULL kept), under its name."""
    return f"extract(epoch FROM {column})::float8 AS {column.rpartition('.')[2]}"


def _dicts(rows: Iterable[asyncpg.Record]) -> list[dict[str, Any]]:
    return [dict(row) for row in rows]


# -- reading -----------------------------------------------------------------------------------


async def made(dsn: str) -> bool:
    """Whether the database at `dsn` has orchestra's schema: asked on a connection of its own,
    since the store's pool makes the schema when it opens (a reader that only looks, such as
    ``orchestra runs``, asks first, and does not make it in a database given by mistake).

    Raises:
        StoreError: the database cannot be reached, or its ``orchestra`` schema is not ours.
    """
    try:
        conn = await asyncpg.connect(dsn, timeout=_CONNECT_TIMEOUT)
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        raise StoreError(explain(exc, dsn)) from exc
    try:
        return await version_of(conn) > 0
    finally:
        await conn.close()


_RUNS = f"""
SELECT id, {_epoch("created")}, {_epoch("updated")}, state, opened, owner, token,
    {_epoch("expires")}, input_closed, (owner IS NOT NULL AND expires > now()) AS held
FROM orchestra.runs ORDER BY created, id
"""


async def runs(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    """Every run, oldest first, with its tasks counted by state (`counts`); `held`: a
    coordinator's lease on it runs now (the database's clock)."""
    found = _dicts(await conn.fetch(_RUNS))
    counts: dict[str, dict[str, int]] = defaultdict(dict)
    for run_id, state, n in await conn.fetch(
        "SELECT run_id, state, count(*) FROM orchestra.tasks GROUP BY run_id, state "
        "ORDER BY run_id, state"
    ):
        counts[run_id][state] = n
    for run in found:
        run["counts"] = counts.get(run["id"], {})
    return found


_LATEST = f"""
SELECT id, {_epoch("created")}, {_epoch("updated")}, state, opened, owner, token,
    {_epoch("expires")}, input_closed, (owner IS NOT NULL AND expires > now()) AS held
FROM orchestra.runs
"""


async def latest(
    conn: asyncpg.Connection, limit: int, after: str | None, state: str | None
) -> list[dict[str, Any]]:
    """The newest runs first (by creation, then id), at most `limit`, as `runs` gives them: those
    listed after the run `after` (the last of the page before: older than it), of `state` only
    when given. Read along the ``runs_by_created`` index, and only their tasks counted."""
    where: list[str] = []
    args: list[Any] = [limit]
    if after is not None:
        row = await conn.fetchrow("SELECT created, id FROM orchestra.runs WHERE id = $1", after)
        if row is None:
            raise InputError(
                f"no run {after!r} to list the runs after: give the cursor a page of runs "
                "answered (its next_cursor), or none for the newest",
                field="cursor",
            )
        args += [row["created"], row["id"]]
        where.append(f"(created, id) < (${len(args) - 1}, ${len(args)})")
    if state is not None:
        args.append(state)
        where.append(f"state = ${len(args)}")
    found = _dicts(
        await conn.fetch(
            f"{_LATEST} {'WHERE ' + ' AND '.join(where) if where else ''} "
            "ORDER BY created DESC, id DESC LIMIT $1",
            *args,
        )
    )
    counts: dict[str, dict[str, int]] = defaultdict(dict)
    for run_id, task_state, n in await conn.fetch(
        "SELECT run_id, state, count(*) FROM orchestra.tasks WHERE run_id = ANY ($1::text[]) "
        "GROUP BY run_id, state ORDER BY run_id, state",
        [run["id"] for run in found],
    ):
        counts[run_id][task_state] = n
    for run in found:
        run["counts"] = counts.get(run["id"], {})
    return found


_RUN = f"""
SELECT id, {_epoch("created")}, {_epoch("updated")}, state, opened, owner, token,
    {_epoch("expires")}, input_closed, (owner IS NOT NULL AND expires > now()) AS held
FROM orchestra.runs WHERE id = $1
"""


async def run(conn: asyncpg.Connection, run_id: str, counts: bool = True) -> dict[str, Any] | None:
    """One run as `runs` gives it, or None: what a reader that follows one run asks often (a
    service's event stream) without counting every run's tasks; without `counts`, not even its
    own (a scan of its rows: a quarter of a second at a million tasks)."""
    row = await conn.fetchrow(_RUN, run_id)
    if row is None:
        return None
    found = dict(row)
    if not counts:
        return found
    counted = await conn.fetch(
        "SELECT state, count(*) FROM orchestra.tasks WHERE run_id = $1 GROUP BY state "
        "ORDER BY state",
        run_id,
    )
    found["counts"] = {row[0]: row[1] for row in counted}
    return found


_WORKERS = f"""
SELECT w.owner, w.host, w.pid, w.run_id, w.kinds, {_epoch("w.started")},
    {_epoch("w.heartbeat")}, {_epoch("w.expires")}, w.claimed, w.completed, w.refused,
    {_epoch("w.gone")}, (w.gone IS NULL AND w.expires >= now()) AS live,
    (SELECT count(*) FROM orchestra.tasks AS t WHERE t.lease_owner = w.owner) AS holding
FROM orchestra.workers AS w ORDER BY w.started, w.owner
"""


async def workers(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    """Every process that registered (`_processes.register`), oldest first: `live` when it has
    not said it stopped (`gone`) and its beat has not expired, `holding` the tasks it holds now."""
    return _dicts(await conn.fetch(_WORKERS))


async def _known(conn: asyncpg.Connection, run_id: str, task_id: str | None = None) -> None:
    """Refuse a run id (or a task id in it) the database does not know, naming what it knows.
    Locks nothing (`retry` locks the run's row itself)."""
    if await conn.fetchval("SELECT true FROM orchestra.runs WHERE id = $1", run_id) is None:
        _no_run(
            run_id,
            [
                r[0]
                for r in await conn.fetch("SELECT id FROM orchestra.runs ORDER BY created LIMIT 6")
            ],
        )
    if task_id is not None and (
        await conn.fetchval(
            "SELECT true FROM orchestra.tasks WHERE run_id = $1 AND id = $2", run_id, task_id
        )
        is None
    ):
        raise InputError(f"run {run_id!r} has no task {task_id!r}", task_id=task_id)


def _no_run(run_id: str, known: Sequence[str]) -> None:
    raise InputError(
        f"no run {run_id!r} in this database (its runs: "
        f"{', '.join(map(repr, known[:5])) or 'none'}{', ...' if len(known) > 5 else ''})",
        field="run_id",
    )


# The journal as its readers see it: the rows of `events` (coordinators taking the run, leases
# taken back, writes refused, retries, ...), and what the rows of a task say and no event row
# does: its admission, its failed attempts (`attempts`: their end is their start plus their
# duration; an attempt lost with its lease has no start and its `lease_expired` event says it),
# its last start and its end. An attempt's times are its process's clock readings, a task's end
# the database's: a process whose clock is ahead would date its attempts after the task's end,
# so what a task's row says is dated no later than its end (or now, for a task not ended), and
# its end no earlier than the last journal row about it. As in the SQLite store, the events one
# instant holds are ordered admitted, ready, started, the rest, the end.
# With `since` ($3), only the tasks that can have an event from then on are read into `t`: admitted
# since, ended since, or with a journal row or a failed attempt's end since (a task's synthetic
# start comes before its end, a failed attempt's end is its attempt's start plus its duration or
# the task's end, whichever is earlier, and its end event is its end or its last journal row,
# whichever is later). A follower polls `since` a moment ago: its poll read every task of the run
# and built its whole journal before the filter (3 to 4 s at 1,000,000 tasks).
_JOURNAL = f"""
WITH t AS (
    SELECT * FROM orchestra.tasks WHERE run_id = $1 AND ($2::text IS NULL OR id = $2)
        AND ($3::float8 IS NULL OR admitted >= to_timestamp($3::float8)
            OR finished >= to_timestamp($3::float8)
            OR id IN (SELECT task_id FROM orchestra.events
                WHERE run_id = $1 AND at >= to_timestamp($3::float8))
            OR (finished IS NULL AND id IN (SELECT task_id FROM orchestra.attempts
                WHERE run_id = $1 AND started + make_interval(secs => coalesce(duration, 0))
                    >= to_timestamp($3::float8))))
), e AS (
    SELECT * FROM orchestra.events WHERE run_id = $1 AND ($2::text IS NULL OR task_id = $2)
), a AS (
    SELECT a.task_id, a.number, a.agent, a.error_type, a.message,
        least(a.started + make_interval(secs => coalesce(a.duration, 0)),
            coalesce(t.finished, now())) AS ended
    FROM orchestra.attempts AS a JOIN t ON t.id = a.task_id
    WHERE a.run_id = $1 AND a.started IS NOT NULL
), last AS (
    SELECT task_id, max(at) AS at FROM e GROUP BY task_id
)
SELECT seq, run_id, task_id, {_epoch("at")}, event, agent, attempt, detail FROM (
    SELECT NULL::bigint AS seq, t.run_id, t.id AS task_id, t.admitted AS at,
        'admitted' AS event, NULL::text AS agent, NULL::integer AS attempt, NULL::text AS detail,
        0 AS rank
    FROM t
    UNION ALL
    SELECT e.seq, e.run_id, e.task_id, e.at, e.event, e.agent, e.attempt, e.detail,
        CASE e.event WHEN 'ready' THEN 1 WHEN 'started' THEN 2 ELSE 3 END
    FROM e
    UNION ALL
    SELECT NULL, $1, a.task_id, a.ended, 'attempt_failed', a.agent, a.number,
        a.error_type || ': ' || a.message, 3
    FROM a WHERE NOT EXISTS (
        SELECT FROM e WHERE e.task_id = a.task_id AND e.event = 'attempt_failed'
            AND e.attempt = a.number)
    UNION ALL
    SELECT NULL, t.run_id, t.id, least(t.started, t.finished), 'started', t.agent, t.attempts,
        NULL, 2
    FROM t WHERE t.started IS NOT NULL AND t.finished IS NOT NULL AND NOT EXISTS (
        SELECT FROM e WHERE e.task_id = t.id AND e.event = 'started' AND e.attempt = t.attempts)
    UNION ALL
    SELECT NULL, t.run_id, t.id, greatest(t.finished, last.at), t.state, t.agent, t.attempts,
        t.error, 4
    FROM t LEFT JOIN last ON last.task_id = t.id
    WHERE t.finished IS NOT NULL AND NOT EXISTS (
        SELECT FROM e WHERE e.task_id = t.id AND e.event = t.state AND e.attempt = t.attempts)
) AS journal
WHERE $3::float8 IS NULL OR journal.at >= to_timestamp($3::float8)
ORDER BY at, rank, seq NULLS FIRST, task_id
"""


# The time before which the journal can gain no more event dated by the database (wall time, the
# database's clock), for a reader that follows it (the service's event stream): a journal row is
# dated by its transaction's start (`now()`), so a transaction still running may yet commit rows
# dated from its start on, and none earlier. By start, not by transaction id (the outbox's
# `xmin < pg_snapshot_xmin(...)`): an id is given at a transaction's first write, so one that
# started earlier and wrote later gets an id above rows already committed, and dates its rows
# before theirs.
#
# Only orchestra's own sessions write the journal, and each is named so (`_sessions.PREFIX`, over
# any ``application_name`` the DSN gives): another application's transaction, or a psql session
# left open in the same database, holds nobody back. Nor, for ever, does one of ours: a
# transaction open longer than `bound` seconds (its process stopped, or a batch far longer than a
# stream should wait for) is not waited for; while there is one the answer is the settle rule,
# `settle` seconds behind now (and no later than the oldest other one), and what it commits comes
# late (the reader's late path). Sessions of other roles show no state without
# `pg_read_all_stats` (their name they show): while one of ours hides its state, the settle rule
# too. Other backends (autovacuum, replication) write no journal.
_HORIZON = """
WITH s AS (
    SELECT clock_timestamp() AS now, xact_start, state FROM pg_stat_activity
    WHERE datname = current_database() AND backend_type = 'client backend'
        AND pid <> pg_backend_pid() AND starts_with(application_name, $2)
)
SELECT extract(epoch FROM clock_timestamp())::float8 AS now,
    extract(epoch FROM min(xact_start) FILTER (
        WHERE xact_start > now - make_interval(secs => $1)))::float8 AS oldest,
    coalesce(bool_or(state IS NULL OR xact_start <= now - make_interval(secs => $1)), false)
        AS unknown
FROM s
"""


async def horizon(conn: asyncpg.Connection, settle: float, bound: float) -> float:
    """The journal's horizon (`_HORIZON`), a wall time: exact, or the database's now less
    `settle` while one of orchestra's sessions hides its state or has had a transaction open for
    longer than `bound` seconds."""
    row = await conn.fetchrow(_HORIZON, float(bound), PREFIX)
    assert row is not None
    now, oldest = float(row["now"]), row["oldest"]
    at = now - settle if row["unknown"] else now
    return at if oldest is None else min(at, float(oldest))


# The tasks of a run leased now (claimed, running), from `tasks_leased` (which holds the leased
# rows only, few however large the run): what has started and not ended. A task's start is not
# written when it is claimed (a write per task on the workers' hot path); a reader that follows
# the journal tells it from here while the task runs, and its row says it once it ended.
_LEASED = """
SELECT id, attempts FROM orchestra.tasks
WHERE lease_owner IS NOT NULL AND run_id = $1 AND lease_expires IS NOT NULL
ORDER BY id
"""


async def watch(
    conn: asyncpg.Connection, run_id: str, settle: float, bound: float
) -> tuple[float, list[tuple[str, int]]]:
    """What a reader that follows `run_id`'s journal asks before each read of it: the horizon
    (`horizon`), then the run's tasks leased now, (id, attempt)."""
    at = await horizon(conn, settle, bound)
    return at, [(row[0], row[1]) for row in await conn.fetch(_LEASED, run_id)]


async def events(
    conn: asyncpg.Connection, run_id: str, task_id: str | None, since: float | None = None
) -> list[dict[str, Any]]:
    """The journal of `run_id` (of one task, with `task_id`; from the wall time `since` on), in
    order (`_JOURNAL`)."""
    await _known(conn, run_id, task_id)
    return _dicts(await conn.fetch(_JOURNAL, run_id, task_id, since))


_DEAD = f"""
SELECT run_id, task_id, kind, payload::text AS payload, attempts, agent, error_type, error,
    {_epoch("finished")}
FROM orchestra.dead_letters WHERE run_id = $1 ORDER BY finished, task_id
"""

_ATTEMPTS = f"""
SELECT run_id, task_id, number, agent, error_type, message, {_epoch("started")}, duration,
    retry_in, traceback, status_code, api_error_type, request_id
FROM orchestra.attempts WHERE run_id = $1 AND task_id = ANY ($2::text[])
ORDER BY task_id, number, started NULLS LAST
"""


async def dead(conn: asyncpg.Connection, run_id: str) -> list[dict[str, Any]]:
    """The tasks of `run_id` that failed for good, each with every failed attempt
    (`attempts_list`, with its traceback)."""
    await _known(conn, run_id)
    letters = _dicts(await conn.fetch(_DEAD, run_id))
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in await conn.fetch(_ATTEMPTS, run_id, [letter["task_id"] for letter in letters]):
        by_task[row["task_id"]].append(dict(row))
    for letter in letters:
        letter["attempts_list"] = by_task.get(letter["task_id"], [])
        # A task that failed for good names no agent of its own (none gave it its output): the
        # one its last attempt ran on, as on SQLite.
        if letter["agent"] is None and letter["attempts_list"]:
            letter["agent"] = letter["attempts_list"][-1]["agent"]
    return letters


# -- retry -------------------------------------------------------------------------------------

# What `retry` writes into the journal before it reopens a task: the events its row said (its
# last start, its failed attempts, its end), which the reopened row no longer dates, dated as
# `_JOURNAL` dates them.
_KEEP = """
WITH t AS (
    SELECT * FROM orchestra.tasks WHERE run_id = $1 AND id = ANY ($2::text[])
), e AS (
    SELECT * FROM orchestra.events WHERE run_id = $1 AND task_id = ANY ($2::text[])
), last AS (
    SELECT task_id, max(at) AS at FROM e GROUP BY task_id
)
INSERT INTO orchestra.events (run_id, task_id, at, event, agent, attempt, detail)
SELECT run_id, task_id, at, event, agent, attempt, detail FROM (
    SELECT t.run_id, t.id AS task_id, least(t.started, t.finished) AS at, 'started' AS event,
        t.agent, t.attempts AS attempt, NULL::text AS detail, 0 AS rank
    FROM t WHERE t.started IS NOT NULL AND t.finished IS NOT NULL AND NOT EXISTS (
        SELECT FROM e WHERE e.task_id = t.id AND e.event = 'started' AND e.attempt = t.attempts)
    UNION ALL
    SELECT t.run_id, t.id,
        least(a.started + make_interval(secs => coalesce(a.duration, 0)),
            coalesce(t.finished, now())),
        'attempt_failed', a.agent, a.number, a.error_type || ': ' || a.message, 1
    FROM t JOIN orchestra.attempts AS a ON a.run_id = t.run_id AND a.task_id = t.id
    WHERE a.started IS NOT NULL AND NOT EXISTS (
        SELECT FROM e WHERE e.task_id = t.id AND e.event = 'attempt_failed'
            AND e.attempt = a.number)
    UNION ALL
    SELECT t.run_id, t.id, greatest(t.finished, last.at), t.state, t.agent, t.attempts,
        t.error, 2
    FROM t LEFT JOIN last ON last.task_id = t.id
    WHERE t.finished IS NOT NULL AND NOT EXISTS (
        SELECT FROM e WHERE e.task_id = t.id AND e.event = t.state AND e.attempt = t.attempts)
) AS kept
ORDER BY at, rank, task_id, attempt
"""

# A reopened task starts its chain of agents again: with no agent to go to (`target` NULL), its
# `agent_tries` keeps how many failed attempts came before, which count against no agent any more
# (as on SQLite). `lost` starts again too: a poison task retried by hand gets its leases'
# budget back (its attempts stay counted).
_REOPEN = """
UPDATE orchestra.tasks AS t
SET state = 'pending', waiting = u.waiting, target = NULL, tried = NULL,
    agent_tries = (SELECT count(*) FROM orchestra.attempts AS a
                   WHERE a.run_id = t.run_id AND a.task_id = t.id),
    lost = 0, feedback = NULL, due = NULL, deadline = NULL, started = NULL, finished = NULL,
    output = NULL, agent = NULL, error = NULL, error_type = NULL, defaulted = false,
    lease_owner = NULL, lease_expires = NULL
FROM unnest($2::text[], $3::integer[]) AS u (id, waiting)
WHERE t.run_id = $1 AND t.id = u.id
"""


# The ends a coordinator has not taken in yet of tasks now reopened are no longer true: taken out
# of the feed's rows (a row per transaction that wrote ends), a row left with none deleted.
_UNHEARD = """
UPDATE orchestra.ended AS f
SET ids = ARRAY(SELECT i FROM unnest(f.ids) AS i WHERE i <> ALL ($2::text[]))
WHERE f.run_id = $1 AND f.ids && $2::text[]
"""


class _Task:
    __slots__ = ("depends_on", "depends_on_tags", "finished", "id", "key", "state", "tags")

    def __init__(self, row: asyncpg.Record) -> None:
        self.id: str = row["id"]
        self.state: str = row["state"]
        # (each name once, in its order: a repeated dependency is waited for once, as admitted)
        self.depends_on: list[str] = list(dict.fromkeys(row["depends_on"] or ()))
        self.depends_on_tags: list[str] = list(dict.fromkeys(row["depends_on_tags"] or ()))
        self.tags: list[str] = list(dict.fromkeys(row["tags"] or ()))
        self.finished: float = row["finished"] or 0.0
        self.key: str | None = row["key"]


async def retry(
    conn: asyncpg.Connection,
    run_id: str,
    task_ids: list[str] | None,
    *,
    owner: str,
    lease: float,
) -> list[str]:
    """Make the failed tasks of `run_id` (those of `task_ids`) runnable again, and the skipped
    tasks downstream of them that nothing else dooms; returns the ids of the failed tasks
    reopened. Their attempts are kept (the count, and every failed one); the chain of agents
    starts again. What waits for nothing is ready at once (the run's listeners notified).

    A reopened task with an idempotency key claims it again for the run, as its admission did
    (`_keyed.admit_keys`), under `lease` seconds, for the run's coordinator if one holds the run,
    else for `owner` (the next coordinator adopts the run's holds): a key that succeeded since
    ends the task with that result, unexecuted; one another run holds keeps it back until that
    run is done with it."""

    async def step(conn: asyncpg.Connection) -> list[str]:
        return await _retry(conn, run_id, task_ids, owner, lease)

    return await transaction(conn, step)


async def _retry(
    conn: asyncpg.Connection, run_id: str, task_ids: list[str] | None, owner: str, lease: float
) -> list[str]:
    # The run's row first: a coordinator's fenced write (which holds it FOR SHARE, then writes
    # tasks) is wholly before or after this.
    run = await conn.fetchrow(
        "SELECT input_closed, owner FROM orchestra.runs WHERE id = $1 FOR UPDATE", run_id
    )
    if run is None:
        await _known(conn, run_id)
    assert run is not None
    input_closed: bool = run["input_closed"]
    # Every task of the run locked (in id order), then read: a dependency that ends while this
    # runs ends before (it is seen done) or after (its completion sees the dependents pending,
    # with their edges, and frees them).
    rows = await conn.fetch(
        "SELECT id, state, depends_on, depends_on_tags, tags, key, "
        "extract(epoch FROM finished)::float8 AS finished, admitted, idx, seq "
        "FROM orchestra.tasks WHERE run_id = $1 ORDER BY id FOR UPDATE",
        run_id,
    )
    tasks = {row["id"]: _Task(row) for row in rows}
    # In the order they were admitted (their queue places change as they become ready).
    ranked = [row["id"] for row in sorted(rows, key=lambda r: (r["admitted"], r["idx"], r["seq"]))]
    if task_ids is None:
        failed = [task_id for task_id in ranked if tasks[task_id].state == FAILED]
    else:
        failed = list(dict.fromkeys(task_ids))
        for task_id in failed:
            task = tasks.get(task_id)
            if task is None or task.state != FAILED:
                raise InputError(
                    f"run {run_id!r} has no task {task_id!r}"
                    if task is None
                    else f"task {task_id!r} of run {run_id!r} is {task.state}, not failed: "
                    "only failed tasks are retried",
                    task_id=task_id,
                    field="task_ids",
                )
    if not failed:
        return []
    reopened = _downstream(tasks, failed)
    state = {task_id: PENDING if task_id in reopened else t.state for task_id, t in tasks.items()}
    ids = [task_id for task_id in ranked if task_id in reopened]

    groups = await _recount_groups(conn, run_id, tasks, reopened, state)

    def done(tag: str) -> bool:
        """Whether a group is waited for no more: closed, or as good as closed, as admission
        judges it (`_graph._closable`): it closes only when an end concerns it, and none will."""
        group = groups.get(tag)
        if group is not None and group.closed:
            return True
        return (
            input_closed
            and (group is None or (group.open == 0 and group.failed is None))
            and state.get(tag, SUCCEEDED) in TERMINAL
        )

    waiting: list[int] = []
    edges: list[tuple[bool, str, str]] = []
    for task_id in ids:
        task = tasks[task_id]
        count = 0
        for dep in task.depends_on:
            if state.get(dep) != SUCCEEDED:
                count += 1
                edges.append((False, dep, task_id))
        for tag in task.depends_on_tags:
            if not done(tag):
                count += 1
                edges.append((True, tag, task_id))
        waiting.append(count)

    await conn.execute(_KEEP, run_id, ids)
    # Dated after everything said of the task before (an attempt's end is its process's clock
    # reading, which may be ahead of the database's): the journal says it failed, then retried.
    await conn.execute(
        "INSERT INTO orchestra.events (run_id, task_id, at, event) "
        "SELECT $1, u.id, greatest(now(), (SELECT max(e.at) FROM orchestra.events AS e "
        "WHERE e.run_id = $1 AND e.task_id = u.id)), 'retried' "
        "FROM unnest($2::text[]) WITH ORDINALITY AS u (id, n) ORDER BY u.n",
        run_id, ids,
    )  # fmt: skip
    await conn.execute(_REOPEN, run_id, ids, waiting)
    if edges:
        # A task skipped at its admission has no edge from what doomed it: one is made now, so
        # that its end frees it (`_settle`). An edge made before stays as it was.
        await conn.execute(
            "INSERT INTO orchestra.edges (run_id, on_group, source, dependent) "
            "SELECT $1, g, s, d FROM unnest($2::boolean[], $3::text[], $4::text[]) "
            "WITH ORDINALITY AS e (g, s, d, n) ORDER BY n ON CONFLICT DO NOTHING",
            run_id, *columns(edges, 3),
        )  # fmt: skip
    # The ends a coordinator has not taken in yet of tasks now reopened: no longer true.
    await conn.execute(_UNHEARD, run_id, ids)
    await conn.execute("DELETE FROM orchestra.ended WHERE run_id = $1 AND ids = '{}'", run_id)
    await conn.execute(
        "UPDATE orchestra.runs SET state = 'open', updated = now() WHERE id = $1", run_id
    )
    # Each key once, by the first reopened task with it (the others follow it in the run, as at
    # admission), unless a task of the run not reopened is still on its way with it.
    live = {t.key for t in tasks.values() if t.id not in reopened and t.state not in TERMINAL}
    wanted: dict[str, str] = {}
    for task_id in ids:
        key = tasks[task_id].key
        if key is not None and key not in live:
            wanted.setdefault(key, task_id)
    if wanted:
        await keyed.admit_keys(
            conn, run_id, list(wanted.items()), owner=run["owner"] or owner, lease=lease
        )
    ready = await make_ready(conn, run_id, [i for i, n in zip(ids, waiting, strict=True) if n == 0])
    if ready:
        # (`make_ready` told the run's channel; this tells the processes that serve any run)
        await notify(conn, run_id, "ready")
    return failed


def _downstream(tasks: dict[str, _Task], failed: Sequence[str]) -> set[str]:
    """`failed`, and the skipped tasks downstream of them (through dependencies, and groups they
    are members of) that nothing else dooms once those are reopened: no dependency of theirs,
    and no member of a group they wait for, failed, cancelled or skipped for good."""
    dependents: dict[str, list[str]] = defaultdict(list)
    waiters: dict[str, list[str]] = defaultdict(list)
    members: dict[str, list[str]] = defaultdict(list)
    for task in tasks.values():
        for dep in task.depends_on:
            dependents[dep].append(task.id)
        for tag in task.depends_on_tags:
            waiters[tag].append(task.id)
        for tag in task.tags:
            members[tag].append(task.id)
    reopened = set(failed)
    doomed_members = {
        tag: sum(tasks[m].state in _DOOMED for m in ids) for tag, ids in members.items()
    }

    def doomed(task_id: str) -> bool:
        task = tasks.get(task_id)
        return task is not None and task_id not in reopened and task.state in _DOOMED

    def reopen(task_id: str) -> None:
        reopened.add(task_id)
        for tag in tasks[task_id].tags:
            doomed_members[tag] -= 1

    for task_id in failed:
        for tag in tasks[task_id].tags:
            doomed_members[tag] -= 1
    # Each reopened task looks at what waits for it; one still doomed by something else is
    # looked at again when that is reopened.
    todo = list(failed)
    while todo:
        source = todo.pop()
        concerned = list(dependents.get(source, ()))
        for tag in tasks[source].tags:
            concerned.extend(waiters.get(tag, ()))
        for task_id in concerned:
            task = tasks[task_id]
            if task_id in reopened or task.state != SKIPPED:
                continue
            if any(doomed(dep) for dep in task.depends_on):
                continue
            if any(doomed_members.get(tag, 0) for tag in task.depends_on_tags):
                continue
            reopen(task_id)
            todo.append(task_id)
    return reopened


class _Counted:
    __slots__ = ("closed", "failed", "open")

    def __init__(self, open_: int, closed: bool, failed: str | None) -> None:
        self.open = open_
        self.closed = closed
        self.failed = failed


async def _recount_groups(
    conn: asyncpg.Connection,
    run_id: str,
    tasks: dict[str, _Task],
    reopened: set[str],
    state: dict[str, str],
) -> dict[str, _Counted]:
    """The groups the reopened tasks are members of, wait for or are named after, locked and
    counted again with their members' states after the retry (`state`): `open` their members not
    terminal, `failed` the first member (by its end) that can no longer succeed, if any; a group
    that closed reopens when a member of it is reopened, or the task named after it is (more
    members may come from it again: the group closes once it ended again, as it would have had
    it never ended)."""
    tags: set[str] = set()
    for task_id in reopened:
        task = tasks[task_id]
        tags.update(task.tags)
        tags.update(task.depends_on_tags)
        tags.add(task_id)
    locked = await lock_groups(conn, run_id, tags)
    if not locked:
        return {}
    members: dict[str, list[_Task]] = defaultdict(list)
    for task in tasks.values():
        for tag in task.tags:
            if tag in locked:
                members[tag].append(task)
    counted: dict[str, _Counted] = {}
    for tag, group in locked.items():
        ids = members.get(tag, [])
        reopens = any(m.id in reopened for m in ids)
        failed = group.failed
        if reopens:
            doomed = sorted(
                (m for m in ids if state[m.id] in _DOOMED), key=lambda m: (m.finished, m.id)
            )
            failed = (
                None
                if not doomed
                else f"group {tag!r} member {doomed[0].id!r} {state[doomed[0].id]}"
            )
        closed = group.closed and not (reopens or tag in reopened)
        open_ = sum(state[m.id] not in _DOOMED and state[m.id] != SUCCEEDED for m in ids)
        counted[tag] = _Counted(open_, closed, failed)
    changed = [
        tag
        for tag, c in counted.items()
        if (c.open, c.closed, c.failed)
        != (locked[tag].open, locked[tag].closed, locked[tag].failed)
    ]
    if changed:
        await conn.execute(
            "UPDATE orchestra.groups AS g SET open = u.open, closed = u.closed, failed = u.failed "
            "FROM unnest($2::text[], $3::integer[], $4::boolean[], $5::text[]) "
            "AS u (tag, open, closed, failed) WHERE g.run_id = $1 AND g.tag = u.tag",
            run_id, changed, [counted[t].open for t in changed],
            [counted[t].closed for t in changed], [counted[t].failed for t in changed],
        )  # fmt: skip
    return counted
