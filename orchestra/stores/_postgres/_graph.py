"""A run's graph on PostgreSQL: admission of tasks into the database.

The meanings are the memory store's (`orchestra.stores._graph`): a task waits for its dependencies
and for the groups it waits for (``depends_on_tags``); a group closes once every member succeeded
and no more can come (the run's input closed, and the task whose id is the tag ended); a task
whose dependency or group member did not succeed is skipped, and so on down. Here the graph is
rows: ``tasks.waiting`` counts what a pending task still waits for, ``edges`` says whose end
concerns whom (in the order they were made), ``groups`` counts each tag's open members. What an
end frees or dooms is settled by `_settle`, in the transaction that ended it, so readiness needs
no coordinator: any process that completes a task readies its dependents.

**Admission** (`admit`): a batch enters whole or not at all, in one transaction. The checks are the
memory store's own (`GraphChecks`, and `GraphChecks.spawn` for each spawn, as the engine checks
it), run against a `Graph` holding what the database knows of the tasks the batch names (its ids,
its dependencies, the tasks named after its groups, and for a streamed or spawned member of a
group the tasks upstream of it) and of its groups. Those rows are locked first (the run's row
``FOR SHARE`` when the batch waits for groups, tasks ``FOR SHARE``, groups ``FOR UPDATE``), so an
end settled at the same time comes wholly before (the batch sees it) or after (it sees the
batch's edges). The writes are a few statements over arrays (``unnest``): tasks, edges, group
counts; then what waits for something that failed is skipped, and what waits for nothing is
ready (written ready by the insert itself, when nothing is skipped and no key is involved).

**Keys within a run** (`Graph.keys`, `Graph._follow`): ``run_keys`` says which task of the run
holds each key, ``follows`` which tasks follow it, in line. A task admitted with a key another
task of the run holds follows it (waits for it: one more in ``waiting``), ends at once with its
result if it has succeeded, or takes the key over if it ended otherwise, or if it waits for this
task (it then follows this one). The key's row is locked first, so the holder's end (`_settle`,
which ends its followers or hands the key on) comes wholly before the admission or after it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from ..._exceptions import InputError
from ..._output import json_text
from ..._record import Record
from ..._task import (
    PENDING,
    STATE_OF,
    SUCCEEDED,
    TERMINAL,
    Task,
)
from .._graph import Graph, Group
from .._graph_checks import GraphChecks
from ._listen import GLOBAL_CHANNEL, channel_of
from ._settle import (
    LOCK_GROUPS,
    QUEUE_STEP,
    columns,
    end_cascade,
    make_ready,
    skip_cascade,
    transaction,
)

if TYPE_CHECKING:
    from collections.abc import Collection, Sequence

    import asyncpg

    from ..._admission import Admission

__all__ = ("Admitted", "admit", "admit_in")


class Admitted(NamedTuple):
    """What an admission did: the ids admitted (in order; a task admitted before, the same, is
    not among them), the ones made ready at once, the ones skipped at once (something they wait
    for had failed)."""

    ids: list[str]
    ready: list[str]
    skipped: list[str]


# -- admission ---------------------------------------------------------------------------------


async def admit(
    conn: asyncpg.Connection,
    run_id: str,
    tasks: Sequence[Any],
    *,
    admission: Admission,
    where: str = "input",
    forward: bool = True,
    first_index: int = 0,
    parent: str | None = None,
) -> Admitted:
    """Admit a batch of `tasks` into `run_id` (its row in ``orchestra.runs`` must exist), all or
    nothing, with the memory store's checks and meanings (`MemoryRun.admit`): `forward`, a task
    may depend on a later one of the batch (a whole list; a streamed or spawned batch may only
    depend on tasks before it); `parent`, the id of the task that spawned them.

    Raises:
        InputError: a task is refused (a duplicate id, an unknown dependency, a cycle, a closed
            group, a payload JSON cannot hold): nothing of the batch was written.
    """

    async def step(conn: asyncpg.Connection) -> Admitted:
        ids, ready, skipped = await admit_in(
            conn, run_id, tasks, admission, where, forward, first_index, parent
        )
        return Admitted(ids, [task_id for task_id, _ in ready], skipped)

    return await transaction(conn, step)


async def admit_in(
    conn: asyncpg.Connection,
    run_id: str,
    tasks: Sequence[Any],
    admission: Admission,
    where: str,
    forward: bool,
    first_index: int,
    parent_id: str | None,
    generated: Collection[str] = (),
) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """`admit` inside the caller's transaction, without its notification: the ids admitted, the
    tasks made ready (id, kind), the ids skipped. `generated`: the ids of `tasks` their
    coordinator generated (its mirror names them first). An `InputError` may leave some of the
    batch written in that transaction: the caller rolls it back (`transaction` does)."""
    # Whether the input is closed decides whether a waiter of an empty group waits. Read under a
    # share lock of the run's row, taken first: a `close_input` running meanwhile (which updates
    # that row, then closes the groups it then sees) comes wholly before this batch or after it.
    waits_on_groups = any(_strings(getattr(task, "depends_on_tags", ())) for task in tasks)
    input_closed = False
    if waits_on_groups:
        input_closed = await conn.fetchval(
            "SELECT input_closed FROM orchestra.runs WHERE id = $1 FOR SHARE", run_id
        )
    graph, parent = await _known(conn, run_id, tasks, admission, forward, parent_id)
    checks = GraphChecks(graph, admission, False)
    if parent is not None:
        # Each spawn checked as the engine checks it when the attempt spawns it, which names one
        # given no id after its parent (`<parent id>/<kind>#<n>`): the same on any process.
        pending: dict[str, Task] = {}
        for task in tasks:
            checks.spawn(task, parent, pending)
            pending[task.id] = task
    batch, unnamed = checks.batch(
        tasks, where, forward, first_index, parent,
        [id(task) for task in tasks if task.id in generated] if generated else (),
    )  # fmt: skip
    if not batch:
        return [], [], []
    # What each task waits for, as `Graph._wire` counts it, task after task (a group's members of
    # this batch count before a later waiter of it looks).
    records = graph.records
    new = {task.id: task for task in batch}
    groups = graph.groups
    touched: dict[str, list[int]] = {}  # tag -> [members added, open added]
    waiting: list[int] = []
    edges: list[tuple[bool, str, str]] = []  # (on group, source, dependent), in wiring order
    skip: list[tuple[str, str]] = []
    for task in batch:
        count = 0
        reason: str | None = None
        for dep_id in dict.fromkeys(task.depends_on):
            if dep_id not in new:
                dep = records.get(dep_id)
                if dep is None or dep.state == SUCCEEDED:
                    continue
                if dep.state in TERMINAL:
                    reason = f"dependency {dep_id!r} {dep.state}"
                    continue
            count += 1
            edges.append((False, dep_id, task.id))
        for tag in dict.fromkeys(task.tags):
            group = groups.get(tag)
            if group is None:
                group = groups[tag] = Group()
            group.open += 1
            added = touched.setdefault(tag, [0, 0])
            added[0] += 1
            added[1] += 1
        for tag in dict.fromkeys(task.depends_on_tags):
            group = groups.get(tag)
            if group is None:
                group = groups[tag] = Group()
                touched.setdefault(tag, [0, 0])
            if group.failed is not None:
                reason = group.failed
            elif not (group.closed or _closable(graph, new, tag, group, input_closed)):
                count += 1
                edges.append((True, tag, task.id))
        waiting.append(count)
        if reason is not None:
            skip.append((task.id, reason))
    # What this batch readies at once is written ready, unless skips or keys come first (they
    # ready, or end, tasks that are queued ahead of the batch's, as in memory: `make_ready` below).
    keyed = any(task.key is not None for task in batch)
    ready_now = not skip and not keyed
    # Every row inserted has its foreign key checked by a query of PostgreSQL's own, planned
    # again for each row under the connections' `plan_cache_mode` (`_leases.SERVER_SETTINGS`):
    # 12 us per task of a large batch, for a lookup by primary key that one plan serves. A large
    # batch's inserts run under PostgreSQL's default mode; the rest of the transaction under the
    # connection's own (the session's value: its connections set it as they connect, never later).
    once = len(batch) + len(edges) >= _PLANNED_ONCE
    if once:
        await conn.execute("SET LOCAL plan_cache_mode = auto")
    readied = await _insert(
        conn, run_id, batch, waiting, unnamed, first_index, parent_id, where, ready_now
    )
    if edges:
        await conn.execute(
            "INSERT INTO orchestra.edges (run_id, on_group, source, dependent) "
            "SELECT $1, g, s, d FROM unnest($2::boolean[], $3::text[], $4::text[]) "
            "WITH ORDINALITY AS e (g, s, d, n) ORDER BY n ON CONFLICT DO NOTHING",
            run_id, *columns(edges, 3),
        )  # fmt: skip
    if once:
        await conn.execute("SET LOCAL plan_cache_mode TO DEFAULT")
    if touched:
        tags = list(touched)
        await conn.execute(
            "INSERT INTO orchestra.groups AS g (run_id, tag, members, open) "
            "SELECT $1, tag, m, o FROM unnest($2::text[], $3::integer[], $4::integer[]) "
            "AS u (tag, m, o) ON CONFLICT (run_id, tag) DO UPDATE "
            "SET members = g.members + excluded.members, open = g.open + excluded.open",
            run_id, tags, [touched[t][0] for t in tags], [touched[t][1] for t in tags],
        )  # fmt: skip
    if ready_now:
        return list(new), readied, []
    reused: list[tuple[str, str]] = []
    if keyed:
        reused = await _follow_keys(conn, run_id, batch, {t for t, _ in skip}, edges)
    ready: list[tuple[str, str]] = []
    skipped: list[str] = []
    if skip:
        settled = await skip_cascade(conn, run_id, skip)
        ready.extend(settled.ready)
        skipped.extend(settled.skipped)
    # As `MemoryRun._wire`: the skips first, then the tasks whose key's holder had succeeded end
    # with its result, each settled in turn, then the batch's tasks waiting for nothing are ready.
    for task_id, holder in reused:
        if await conn.fetchval(_REUSE, run_id, task_id, holder) is not None:
            ready = [r for r in ready if r[0] != task_id]  # (made ready by an earlier one)
            settled = await end_cascade(conn, run_id, [(task_id, SUCCEEDED)])
            ready.extend(settled.ready)
            skipped.extend(settled.skipped)
    ready.extend(await make_ready(conn, run_id, list(new)))
    return list(new), ready, skipped


# -- keys within a run -------------------------------------------------------------------------

# The batch's keys, each held by the first task admitted with it (none of the run had it), then
# locked (see `_settle._HELD_KEYS`); the holders' states are read by the next statement, whose
# snapshot comes after the lock.
_NEW_KEYS = """
INSERT INTO orchestra.run_keys (run_id, key, holder)
SELECT $1, k.key, k.holder FROM unnest($2::text[], $3::text[]) AS k (key, holder)
ON CONFLICT DO NOTHING
"""

_LOCK_KEYS = """
SELECT k.key, k.holder FROM orchestra.run_keys AS k
WHERE k.run_id = $1 AND k.key = ANY ($2::text[])
ORDER BY k.key
FOR UPDATE
"""

_STATES_OF = """
SELECT t.id, t.state FROM orchestra.tasks AS t WHERE t.run_id = $1 AND t.id = ANY ($2::text[])
"""

# Whether the task $2 waits, through its unfinished dependencies, the members of the open groups
# it waits for and the holders of the keys it follows, for the task $3 (`Graph._waits_for`).
_WAITS_FOR = """
WITH RECURSIVE up (id) AS (
    SELECT $2::text
    UNION
    SELECT n.id
    FROM up JOIN orchestra.tasks AS t ON t.run_id = $1 AND t.id = up.id
    CROSS JOIN LATERAL (
        SELECT d AS id FROM unnest(t.depends_on) AS d
        UNION ALL
        SELECT m.id FROM unnest(t.depends_on_tags) AS w (tag)
        JOIN orchestra.groups AS g ON g.run_id = $1 AND g.tag = w.tag AND NOT g.closed
        JOIN orchestra.tasks AS m ON m.run_id = $1 AND m.tags @> ARRAY[w.tag]
        UNION ALL
        SELECT k.holder FROM orchestra.run_keys AS k
        WHERE k.run_id = $1 AND k.key = t.key AND k.holder <> t.id
    ) AS next
    JOIN orchestra.tasks AS n ON n.run_id = $1 AND n.id = next.id
    WHERE n.state NOT IN ('succeeded', 'failed', 'cancelled', 'skipped')
)
SELECT EXISTS (SELECT FROM up WHERE id = $3)
"""

# A task that followed the holder $2 follows the new holder $3 first, before the ones that
# followed it (they follow $3 now, in their places).
_SWAP = """
WITH moved AS (
    UPDATE orchestra.follows SET holder = $3 WHERE run_id = $1 AND holder = $2 RETURNING n
)
INSERT INTO orchestra.follows (run_id, follower, holder, n)
SELECT $1, $2, $3, coalesce(
    (SELECT min(n) FROM moved) - 1, nextval(pg_get_serial_sequence('orchestra.follows', 'n')))
"""

_FOLLOW = """
INSERT INTO orchestra.follows (run_id, follower, holder)
SELECT $1, f.follower, f.holder FROM unnest($2::text[], $3::text[])
    WITH ORDINALITY AS f (follower, holder, n)
ORDER BY f.n
"""

_HOLDERS = """
UPDATE orchestra.run_keys AS k SET holder = u.holder
FROM unnest($2::text[], $3::text[]) AS u (key, holder)
WHERE k.run_id = $1 AND k.key = u.key
"""

_WAITS_MORE = """
UPDATE orchestra.tasks AS t SET waiting = t.waiting + u.more, took_key = t.took_key OR u.took
FROM unnest($2::text[], $3::integer[], $4::boolean[]) AS u (id, more, took)
WHERE t.run_id = $1 AND t.id = u.id
"""

# A task whose key's holder had succeeded ends with its result, unless it ended meanwhile (a
# skip). It may have been made ready meanwhile, by the end of another such task it depends on: as
# in memory, it ends all the same (no one can have claimed it: this transaction made it ready).
_REUSE = """
UPDATE orchestra.tasks AS t
SET state = 'succeeded', output = h.output, agent = h.agent, finished = now()
FROM orchestra.tasks AS h
WHERE t.run_id = $1 AND t.id = $2 AND t.state IN ('pending', 'ready') AND h.run_id = $1
    AND h.id = $3
RETURNING t.id
"""


async def _follow_keys(
    conn: asyncpg.Connection,
    run_id: str,
    batch: Sequence[Task],
    skipped: set[str],
    edges: Sequence[tuple[bool, str, str]],
) -> list[tuple[str, str]]:
    """`Graph.wire`'s keys for a batch just written: a task whose key another task of the run
    holds follows it (waits for it, to end with its result), takes the key over (its holder
    ended without succeeding, or waits for it: then the holder follows it), or, its holder having
    succeeded, is returned (with that holder's id) to end at once. Each in turn, as in memory."""
    firsts: dict[str, str] = {}
    for task in batch:
        if task.key is not None:
            firsts.setdefault(task.key, task.id)
    await conn.execute(_NEW_KEYS, run_id, list(firsts), list(firsts.values()))
    holders = {r[0]: r[1] for r in await conn.fetch(_LOCK_KEYS, run_id, sorted(firsts))}
    new = {task.id for task in batch}
    states: dict[str, str] = dict.fromkeys(new, PENDING)
    old = [h for h in set(holders.values()) if h not in new]
    if old:
        states.update((r[0], r[1]) for r in await conn.fetch(_STATES_OF, run_id, old))
    # Whom something of the batch waits for: only such a task (or a group's member) can be waited
    # for by its key's holder (`Graph._waits_for` is free for the others).
    awaited = {source for on_group, source, _ in edges if not on_group}
    keyed = [
        t for t in batch if t.key is not None and t.id not in skipped and holders[t.key] != t.id
    ]
    changed: dict[str, str] = {}  # key -> its new holder
    follows: list[tuple[str, str]] = []  # (follower, holder), not written yet
    more: dict[str, int] = {}  # task -> what it waits for more
    took: set[str] = set()
    reused: list[tuple[str, str]] = []
    for task in keyed:
        key: str = task.key  # type: ignore[assignment]
        holder = holders[key]
        state = states[holder]
        if state == SUCCEEDED:
            reused.append((task.id, holder))
            continue
        if state in TERMINAL:  # it failed, or was cancelled or skipped: this one runs
            holders[key] = changed[key] = task.id
            took.add(task.id)
            continue
        if state == PENDING and (task.id in awaited or task.tags):
            if holder not in new:  # its state may have changed since read: read it locked
                state = await conn.fetchval(
                    "SELECT state FROM orchestra.tasks WHERE run_id = $1 AND id = $2 FOR UPDATE",
                    run_id, holder,
                )  # fmt: skip
                states[holder] = state
            if state == PENDING:
                if changed:  # the walk reads who holds the keys now
                    await conn.execute(_HOLDERS, run_id, list(changed), list(changed.values()))
                if await conn.fetchval(_WAITS_FOR, run_id, holder, task.id):
                    # Were this one to wait for its holder, neither would ever run: it holds the
                    # key, and the holder (and the tasks that followed it) follow this one.
                    holders[key] = changed[key] = task.id
                    took.add(task.id)
                    if follows:
                        await conn.execute(_FOLLOW, run_id, *columns(follows, 2))
                        follows = []
                    await conn.execute(_SWAP, run_id, holder, task.id)
                    more[holder] = more.get(holder, 0) + 1
                    continue
        follows.append((task.id, holder))
        more[task.id] = more.get(task.id, 0) + 1
    if follows:
        await conn.execute(_FOLLOW, run_id, *columns(follows, 2))
    if changed:
        await conn.execute(_HOLDERS, run_id, list(changed), list(changed.values()))
    if more or took:
        ids = list(dict.fromkeys([*more, *took]))
        await conn.execute(
            _WAITS_MORE, run_id, ids, [more.get(i, 0) for i in ids], [i in took for i in ids]
        )
    return reused


def _closable(
    graph: Graph, new: dict[str, Task], tag: str, group: Group, input_closed: bool
) -> bool:
    """`Graph._closable` over what the database said: no member open, no more can come."""
    if group.closed or group.open or not input_closed or tag in new:
        return False
    owner = graph.records.get(tag)
    return owner is None or owner.state in TERMINAL


_STATES: Final = STATE_OF

_KNOWN = """
SELECT t.id, t.kind, t.payload::text, t.priority, t.depends_on, t.depends_on_tags, t.tags, t.key,
    t.state
FROM orchestra.tasks AS t
WHERE t.run_id = $1 AND t.id = ANY ($2::text[])
ORDER BY t.id
FOR SHARE
"""

# The tasks upstream of some (through their dependencies, and from an unfinished task that
# follows the holder of its key to that holder), for the group cycle check of a streamed or
# spawned member: read, not locked (an upstream task's end changes no edge of them).
_UPSTREAM = """
WITH RECURSIVE up (id) AS (
    SELECT unnest($2::text[])
    UNION
    SELECT next.id FROM up JOIN orchestra.tasks AS t ON t.run_id = $1 AND t.id = up.id
    CROSS JOIN LATERAL (
        SELECT d AS id FROM unnest(t.depends_on) AS d
        UNION ALL
        SELECT k.holder FROM orchestra.run_keys AS k
        WHERE k.run_id = $1 AND k.key = t.key AND k.holder <> t.id
            AND t.state NOT IN ('succeeded', 'failed', 'cancelled', 'skipped')
    ) AS next
)
SELECT t.id, t.kind, t.payload::text, t.priority, t.depends_on, t.depends_on_tags, t.tags, t.key,
    t.state
FROM orchestra.tasks AS t JOIN up USING (id)
WHERE t.run_id = $1
"""

_KEY_HOLDERS = """
SELECT key, holder FROM orchestra.run_keys WHERE run_id = $1 AND key = ANY ($2::text[])
"""

_GROUPS = """
SELECT g.tag, g.closed, g.failed, g.open,
    ARRAY(SELECT e.dependent FROM orchestra.edges AS e
          WHERE e.run_id = $1 AND e.on_group AND e.source = g.tag ORDER BY e.n) AS waiters
FROM orchestra.groups AS g
WHERE g.run_id = $1 AND g.tag = ANY ($2::text[])
"""


async def _known(
    conn: asyncpg.Connection,
    run_id: str,
    tasks: Sequence[Any],
    admission: Admission,
    forward: bool,
    parent_id: str | None,
) -> tuple[Graph, Record | None]:
    """A `Graph` of what the database knows that the checks and the wiring of `tasks` read,
    those rows locked."""
    ids: set[str] = set()
    tags: dict[str, None] = {}  # in the order the wiring meets them (the groups' order in memory)
    upstream: list[str] = []
    for task in tasks:
        if not isinstance(task, Task):
            continue
        if isinstance(task.id, str):
            ids.add(task.id)
        deps = _strings(task.depends_on)
        ids.update(deps)
        member_of = _strings(task.tags)
        tags.update(dict.fromkeys(member_of))
        tags.update(dict.fromkeys(_strings(task.depends_on_tags)))
        if not forward and member_of and deps:
            upstream.extend(deps)
    ids.update(tags)  # the tasks that own the groups
    if parent_id is not None:
        ids.add(parent_id)
    graph = Graph(admission, _NoOwner(), False)
    records = graph.records
    for row in await conn.fetch(_KNOWN, run_id, sorted(ids)):
        records[row[0]] = _record(row)
    if upstream:
        for row in await conn.fetch(_UPSTREAM, run_id, upstream):
            if row[0] not in records:
                records[row[0]] = _record(row)
        # Who holds the keys of those tasks: the checks follow a follower to its holder.
        keys = sorted({r.task.key for r in records.values() if r.task.key is not None})
        if keys:
            rows = await conn.fetch(_KEY_HOLDERS, run_id, keys)
            graph.keys.update((r[0], r[1]) for r in rows)
    if tags:
        # Every group the batch names, locked: a missing one is made (empty) so that it can be,
        # numbered in the order the memory store makes them (`close_input` goes by it).
        await conn.execute(
            "INSERT INTO orchestra.groups (run_id, tag) SELECT $1, g.tag "
            "FROM unnest($2::text[]) WITH ORDINALITY AS g (tag, n) ORDER BY g.n "
            "ON CONFLICT DO NOTHING",
            run_id, list(tags),
        )  # fmt: skip
        await conn.execute(LOCK_GROUPS, run_id, sorted(tags))
        for tag, closed, failed, open_, waiters in await conn.fetch(_GROUPS, run_id, sorted(tags)):
            group = graph.groups[tag] = Group()
            group.closed = closed
            group.failed = failed
            group.open = open_
            group.waiters = [Record(Task("", id=w), 0, None) for w in waiters]
    parent = None
    if parent_id is not None:
        parent = records.get(parent_id)
        if parent is None:
            raise InputError(
                f"task {parent_id!r} spawns tasks but is not a task of run {run_id!r}",
                task_id=parent_id,
                field="id",
            )
    return graph, parent


def _strings(value: Any) -> list[str]:
    """The strings of a list field (what is not one is refused by the checks, by name)."""
    if isinstance(value, (list, tuple)):
        return [v for v in value if type(v) is str]
    return []


def _record(row: Any) -> Record:
    task_id, kind, payload, priority, depends_on, depends_on_tags, tags, key, state = row
    task = Task(
        kind, json.loads(payload), id=task_id, priority=priority, depends_on=depends_on or [],
        depends_on_tags=depends_on_tags or [], tags=tags or [], key=key,
    )  # fmt: skip
    record = Record(task, 0, None)
    record.state = _STATES[state]
    return record


class _NoOwner:
    """The `Owner` of a `Graph` that only the checks read: nothing is ever made ready or ended
    through it."""

    def ready(self, record: Record) -> None:
        raise AssertionError("a checked graph readies nothing")  # pragma: no cover

    def end_one(self, *args: Any) -> None:
        raise AssertionError("a checked graph ends nothing")  # pragma: no cover


# A batch's rows; with $17, the ones waiting for nothing are written ready (queued in the batch's
# order, the run's listeners told of their kinds as `_settle.make_ready` tells them), not pending
# and then updated to ready: one write of each row, and one check of its run's key, not two.
_PLANNED_ONCE: Final = 100
"""Rows (tasks and edges) of a batch from which its inserts' key checks are planned once."""

_INSERT = f"""
WITH base AS (SELECT nextval('orchestra.queue_order') * {QUEUE_STEP} AS seq), written AS (
    INSERT INTO orchestra.tasks (run_id, id, seq, parent, idx, named, kind, payload, depends_on,
        depends_on_tags, tags, key, timeout, critical, metadata, priority, state, waiting)
    SELECT $1, u.id, base.seq + u.n, $2, u.idx, u.named, u.kind, u.payload::json,
        u.depends_on::text[], u.depends_on_tags::text[], u.tags::text[], u.key, u.timeout,
        u.critical, u.metadata::json, u.priority,
        CASE WHEN $17 AND u.waiting = 0 THEN 'ready' ELSE 'pending' END, u.waiting
    FROM base, unnest($3::text[], $4::integer[], $5::boolean[], $6::text[], $7::text[],
        $8::text[], $9::text[], $10::text[], $11::text[], $12::float8[], $13::boolean[],
        $14::text[], $15::integer[], $16::integer[])
        WITH ORDINALITY AS u (id, idx, named, kind, payload, depends_on, depends_on_tags, tags,
            key, timeout, critical, metadata, priority, waiting, n)
    ON CONFLICT (run_id, id) DO NOTHING
    RETURNING id, kind, seq, state = 'ready' AS ready
), woken AS (
    SELECT pg_notify($18, json_build_object('run', $1::text, 'kinds', k.kinds)::text),
        pg_notify($19, $1::text)
    FROM (SELECT array_agg(DISTINCT kind ORDER BY kind) AS kinds FROM written WHERE ready) AS k
    WHERE k.kinds IS NOT NULL
)
SELECT w.id, w.kind, w.seq, w.ready FROM written AS w LEFT JOIN woken ON true
"""


def row_json(task: Task, where: str) -> tuple[str, str | None]:
    """The JSON text of a task's payload and metadata, as its row keeps them; `InputError` naming
    the task and the field when JSON cannot hold one."""
    texts: list[str | None] = []
    for field in ("payload", "metadata"):
        value = getattr(task, field)
        if value is None and field == "metadata":
            texts.append(None)
            continue
        try:
            texts.append(json_text(value))
        except ValueError as exc:
            raise InputError(
                f"task {task.id!r} ({where}): {field} cannot be stored as JSON ({exc})",
                task_id=task.id,
                field=field,
            ) from None
    payload, metadata = texts
    assert payload is not None
    return payload, metadata


async def _insert(
    conn: asyncpg.Connection,
    run_id: str,
    batch: Sequence[Task],
    waiting: Sequence[int],
    unnamed: set[int],
    first_index: int,
    parent_id: str | None,
    where: str,
    ready_now: bool,
) -> list[tuple[str, str]]:
    """Write the batch's rows; with `ready_now`, the ones waiting for nothing ready (returned as
    (id, kind), in queue order)."""
    rows = []
    for index, (task, count) in enumerate(zip(batch, waiting, strict=True), first_index):
        payload, metadata = row_json(task, where)
        rows.append((
            task.id, index, not unnamed or id(task) not in unnamed, task.kind, payload,
            _array(task.depends_on), _array(task.depends_on_tags), _array(task.tags), task.key,
            task.timeout, task.critical, metadata, task.priority, count,
        ))  # fmt: skip
    found = await conn.fetch(
        _INSERT, run_id, parent_id, *columns(rows, 14), ready_now, channel_of(run_id),
        GLOBAL_CHANNEL,
    )  # fmt: skip
    written = {r[0] for r in found}
    if len(written) < len(rows):
        # Admitted by another transaction since this one looked (or a generated id that
        # another batch took): the whole batch is refused, as a duplicate is.
        task_id = next(row[0] for row in rows if row[0] not in written)
        raise InputError(f"duplicate task id {task_id!r}", task_id=task_id, field="id")
    return [(r[0], r[1]) for r in sorted(found, key=lambda r: r[2]) if r[3]]


def _array(values: Sequence[str]) -> str | None:
    """A list of names as the text of a PostgreSQL array (None when empty: the column's NULL)."""
    if not values:
        return None
    return (
        "{"
        + ",".join('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values)
        + "}"
    )
