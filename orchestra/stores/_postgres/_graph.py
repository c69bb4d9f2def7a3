"""A run's graph on PostgreSQL: admission of tasks, and the settling of an end, in the database.

The meanings are the memory store's (`orchestra.stores._graph`): a task waits for its dependencies
and for the groups it waits for (``depends_on_tags``); a group closes once every member succeeded
and no more can come (the run's input closed, and the task whose id is the tag ended); a task
whose dependency or group member did not succeed is skipped, and so on down. Here the graph is
rows: ``tasks.waiting`` counts what a pending task still waits for, ``edges`` says whose end
concerns whom (in the order they were made), ``groups`` counts each tag's open members.

- **Admission** (`admit`): a batch enters whole or not at all, in one transaction. The checks are
  the memory store's own (`GraphChecks`), run against a `Graph` holding what the database knows
  of the tasks the batch names (its ids, its dependencies, the tasks owning its groups, and for a
  spawned or streamed member of a group the tasks upstream of it) and of its groups: those rows
  are locked first (tasks ``FOR SHARE``, groups ``FOR UPDATE``), so an end settled at the same time
  either comes before (the batch sees it) or after (it sees the batch's edges). The writes are a
  few statements over arrays (``unnest``).
- **Settling** (`settle`): in the transaction that ended some tasks (`_claims.complete`), a
  success takes one off its dependents' and its groups' waiters' `waiting` and makes the ones at
  zero ready; any other end skips what waits for it, its groups' waiters included, transitively.
  Each statement that reads what an end concerns runs after the rows it depends on were locked
  (READ COMMITTED takes a snapshot per statement), so nothing admitted meanwhile is missed.
- **Wake-ups**: when tasks became ready, a NOTIFY on the run's channel (`channel_of`) carries the
  run id and their kinds, sent when the transaction commits.

Rows are locked in sorted order where a statement can choose; an end that reaches both tasks and
groups may still meet another transaction locking them the other way round: PostgreSQL then
aborts one of them with a deadlock error, and `transaction` runs it again.

Not here yet: idempotency keys within a run (a task whose key another task of the run holds runs
itself here; the memory store makes it follow that task).
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any, Final, NamedTuple, TypeVar

import asyncpg

from ..._exceptions import InputError
from ..._output import json_text
from ..._record import Record
from ..._task import (
    CANCELLED,
    CLAIMED,
    FAILED,
    PENDING,
    READY,
    RETRY_WAIT,
    RUNNING,
    SKIPPED,
    SUCCEEDED,
    TERMINAL,
    Task,
)
from .._graph import Graph, Group
from .._graph_checks import GraphChecks

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable, Sequence

    from ..._admission import Admission

__all__ = (
    "QUEUE_STEP",
    "Admitted",
    "Settled",
    "admit",
    "admit_in",
    "channel_of",
    "close_input",
    "notify_ready",
    "settle",
    "settle_in",
    "transaction",
)

_T = TypeVar("_T")

QUEUE_STEP: Final = 1 << 24
"""A task's place in its run's queue (``tasks.seq``) is a value of the sequence ``queue_order``
times this, plus its rank among the tasks queued by the same statement."""

GLOBAL_CHANNEL: Final = "orchestra"
_MAX_CHANNEL: Final = 63  # PostgreSQL's identifiers (and so channel names) are at most 63 bytes
_RETRIES: Final = 5  # a transaction aborted by a deadlock is run again this many times


def channel_of(run_id: str) -> str:
    """The channel of `run_id`'s notifications: ``orchestra:<run id>``, or, for a run id too long
    for a channel name, ``orchestra:#<its sha1>`` (what the run's listeners listen on)."""
    name = f"{GLOBAL_CHANNEL}:{run_id}"
    if len(name.encode()) <= _MAX_CHANNEL:
        return name
    return f"{GLOBAL_CHANNEL}:#{hashlib.sha1(run_id.encode()).hexdigest()}"


class Admitted(NamedTuple):
    """What an admission did: the ids admitted (in order; a task admitted before, the same, is
    not among them), the ones made ready at once, the ones skipped at once (something they wait
    for had failed)."""

    ids: list[str]
    ready: list[str]
    skipped: list[str]


class Settled(NamedTuple):
    """What settling ends did: the tasks made ready, in queue order, as (id, kind); the tasks
    skipped (what they waited for did not succeed)."""

    ready: list[tuple[str, str]]
    skipped: list[str]


async def transaction(
    conn: asyncpg.Connection, step: Callable[[asyncpg.Connection], Awaitable[_T]]
) -> _T:
    """Run `step` in a transaction of its own, run again when PostgreSQL aborted it to break a
    deadlock with another (each try starts from nothing: the aborted one left nothing). Inside a
    transaction already, `step` runs in it (a deadlock then aborts the caller's, which retries)."""
    if conn.is_in_transaction():
        return await step(conn)
    for attempt in range(_RETRIES):
        try:
            async with conn.transaction():
                return await step(conn)
        except asyncpg.DeadlockDetectedError:
            if attempt == _RETRIES - 1:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


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
        await notify_ready(conn, run_id, ready)
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
) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """`admit` inside the caller's transaction, without its notification: the ids admitted, the
    tasks made ready (id, kind), the ids skipped."""
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
    batch, unnamed = checks.batch(tasks, where, forward, first_index, parent)
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
    await _insert(conn, run_id, batch, waiting, unnamed, first_index, parent_id, where)
    if edges:
        await conn.execute(
            "INSERT INTO orchestra.edges (run_id, on_group, source, dependent) "
            "SELECT $1, g, s, d FROM unnest($2::boolean[], $3::text[], $4::text[]) "
            "WITH ORDINALITY AS e (g, s, d, n) ORDER BY n ON CONFLICT DO NOTHING",
            run_id, *_columns(edges, 3),
        )  # fmt: skip
    if touched:
        tags = list(touched)
        await conn.execute(
            "INSERT INTO orchestra.groups AS g (run_id, tag, members, open) "
            "SELECT $1, tag, m, o FROM unnest($2::text[], $3::integer[], $4::integer[]) "
            "AS u (tag, m, o) ON CONFLICT (run_id, tag) DO UPDATE "
            "SET members = g.members + excluded.members, open = g.open + excluded.open",
            run_id, tags, [touched[t][0] for t in tags], [touched[t][1] for t in tags],
        )  # fmt: skip
    settled = Settled([], [])
    if skip:
        settled = await _end_cascade(conn, run_id, await _skip(conn, run_id, skip))
    # As `MemoryRun._wire`: what the skips freed first, then the batch's tasks waiting for nothing.
    ready = [*settled.ready, *await _make_ready(conn, run_id, list(new))]
    skipped = [task_id for task_id, _ in skip]
    return list(new), ready, [*skipped, *settled.skipped]


def _closable(
    graph: Graph, new: dict[str, Task], tag: str, group: Group, input_closed: bool
) -> bool:
    """`Graph._closable` over what the database said: no member open, no more can come."""
    if group.closed or group.open or not input_closed or tag in new:
        return False
    owner = graph.records.get(tag)
    return owner is None or owner.state in TERMINAL


_STATES: Final = {
    s: s
    for s in (PENDING, READY, CLAIMED, RUNNING, RETRY_WAIT, SUCCEEDED, FAILED, CANCELLED, SKIPPED)
}

_KNOWN = """
SELECT t.id, t.kind, t.payload::text, t.priority, t.depends_on, t.depends_on_tags, t.tags, t.key,
    t.state
FROM orchestra.tasks AS t
WHERE t.run_id = $1 AND t.id = ANY ($2::text[])
ORDER BY t.id
FOR SHARE
"""

# The tasks upstream of some (through their dependencies), for the group cycle check of a
# streamed or spawned member: read, not locked (an upstream task's end changes no edge of them).
_UPSTREAM = """
WITH RECURSIVE up (id) AS (
    SELECT unnest($2::text[])
    UNION
    SELECT d FROM up JOIN orchestra.tasks AS t ON t.run_id = $1 AND t.id = up.id,
        unnest(t.depends_on) AS d
)
SELECT t.id, t.kind, t.payload::text, t.priority, t.depends_on, t.depends_on_tags, t.tags, t.key,
    t.state
FROM orchestra.tasks AS t JOIN up USING (id)
WHERE t.run_id = $1
"""

# Groups are locked by one statement and read by the next: a statement's snapshot is taken
# when it starts, so one that waited for a lock would not see the edges (waiters) committed by
# the transaction it waited for.
_LOCK_GROUPS = """
SELECT g.tag FROM orchestra.groups AS g
WHERE g.run_id = $1 AND g.tag = ANY ($2::text[])
ORDER BY g.tag
FOR UPDATE
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
    tags: set[str] = set()
    upstream: list[str] = []
    for task in tasks:
        if not isinstance(task, Task):
            continue
        if isinstance(task.id, str):
            ids.add(task.id)
        deps = _strings(task.depends_on)
        ids.update(deps)
        member_of = _strings(task.tags)
        tags.update(member_of)
        tags.update(_strings(task.depends_on_tags))
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
    if tags:
        # Every group the batch names, locked: a missing one is made (empty) so that it can be.
        await conn.execute(
            "INSERT INTO orchestra.groups (run_id, tag) SELECT $1, unnest($2::text[]) "
            "ON CONFLICT DO NOTHING",
            run_id, sorted(tags),
        )  # fmt: skip
        await conn.execute(_LOCK_GROUPS, run_id, sorted(tags))
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


_INSERT = f"""
WITH base AS (SELECT nextval('orchestra.queue_order') * {QUEUE_STEP} AS seq)
INSERT INTO orchestra.tasks (run_id, id, seq, parent, idx, named, kind, payload, depends_on,
    depends_on_tags, tags, key, timeout, critical, metadata, priority, state, waiting)
SELECT $1, u.id, base.seq + u.n, $2, u.idx, u.named, u.kind, u.payload::json,
    u.depends_on::text[], u.depends_on_tags::text[], u.tags::text[], u.key, u.timeout, u.critical,
    u.metadata::json, u.priority, 'pending', u.waiting
FROM base, unnest($3::text[], $4::integer[], $5::boolean[], $6::text[], $7::text[], $8::text[],
    $9::text[], $10::text[], $11::text[], $12::float8[], $13::boolean[], $14::text[],
    $15::integer[], $16::integer[])
    WITH ORDINALITY AS u (id, idx, named, kind, payload, depends_on, depends_on_tags, tags, key,
        timeout, critical, metadata, priority, waiting, n)
ON CONFLICT (run_id, id) DO NOTHING
RETURNING id
"""


async def _insert(
    conn: asyncpg.Connection,
    run_id: str,
    batch: Sequence[Task],
    waiting: Sequence[int],
    unnamed: set[int],
    first_index: int,
    parent_id: str | None,
    where: str,
) -> None:
    rows = []
    for index, (task, count) in enumerate(zip(batch, waiting, strict=True), first_index):
        try:
            payload = json_text(task.payload)
        except ValueError as exc:
            raise InputError(
                f"task {task.id!r} ({where}): payload cannot be stored as JSON ({exc})",
                task_id=task.id,
                field="payload",
            ) from None
        try:
            metadata = None if task.metadata is None else json_text(task.metadata)
        except ValueError as exc:
            raise InputError(
                f"task {task.id!r} ({where}): metadata cannot be stored as JSON ({exc})",
                task_id=task.id,
                field="metadata",
            ) from None
        rows.append((
            task.id, index, not unnamed or id(task) not in unnamed, task.kind, payload,
            _array(task.depends_on), _array(task.depends_on_tags), _array(task.tags), task.key,
            task.timeout, task.critical, metadata, task.priority, count,
        ))  # fmt: skip
    written = {r[0] for r in await conn.fetch(_INSERT, run_id, parent_id, *_columns(rows, 14))}
    if len(written) < len(rows):
        # Admitted by another transaction since this one looked (or a generated id that
        # another batch took): the whole batch is refused, as a duplicate is.
        task_id = next(row[0] for row in rows if row[0] not in written)
        raise InputError(f"duplicate task id {task_id!r}", task_id=task_id, field="id")


def _array(values: Sequence[str]) -> str | None:
    """A list of names as the text of a PostgreSQL array (None when empty: the column's NULL)."""
    if not values:
        return None
    return (
        "{"
        + ",".join('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values)
        + "}"
    )


def _columns(rows: Sequence[Sequence[Any]], width: int) -> list[list[Any]]:
    """`rows` as `width` column lists (for ``unnest``): empty lists when there are none."""
    if not rows:
        return [[] for _ in range(width)]
    return [list(column) for column in zip(*rows, strict=True)]


# -- settling ----------------------------------------------------------------------------------


async def settle(
    conn: asyncpg.Connection, run_id: str, ended: Sequence[tuple[str, str]]
) -> Settled:
    """Settle tasks of `run_id` that this transaction has just ended, `ended` as (id, terminal
    state) in the order they ended: what waited for a success and waits for nothing else now is
    made ready; what waited for anything else is skipped, and so on down; groups count their
    members' ends and close. Notifies the run's channel when something became ready. Call it in
    the transaction that ended them (`_claims.complete` does)."""
    settled = await settle_in(conn, run_id, ended)
    await notify_ready(conn, run_id, settled.ready)
    return settled


async def settle_in(
    conn: asyncpg.Connection, run_id: str, ended: Sequence[tuple[str, str]]
) -> Settled:
    """`settle` without its notification (the caller sends one for all it readied)."""
    if not ended:
        return Settled([], [])
    return await _end_cascade(conn, run_id, list(ended))


async def close_input(conn: asyncpg.Connection, run_id: str) -> Settled:
    """No more input will come to `run_id`: the groups whose members are all done close, and their
    waiters waiting for nothing else are made ready (notified)."""

    async def step(conn: asyncpg.Connection) -> Settled:
        await conn.execute("UPDATE orchestra.runs SET input_closed = true WHERE id = $1", run_id)
        tags = [r[0] for r in await conn.fetch(
            "SELECT tag FROM orchestra.groups WHERE run_id = $1 AND NOT closed", run_id
        )]  # fmt: skip
        readied: list[str] = []
        if tags:
            groups = await _lock_groups(conn, run_id, tags)
            await _close_groups(conn, run_id, groups, tags, readied, [])
        ready = await _make_ready(conn, run_id, readied)
        await notify_ready(conn, run_id, ready)
        return Settled(ready, [])

    return await transaction(conn, step)


# Task edges from ended tasks: each pending dependent with how many of them it waited for, by
# the order the first edge was made (the order the memory store frees dependents in).
_DEPENDENTS = """
WITH hit AS (
    SELECT e.dependent AS id, count(*) AS n, min(e.n) AS first,
        (array_agg(e.source ORDER BY e.n))[1] AS source
    FROM orchestra.edges AS e
    WHERE e.run_id = $1 AND NOT e.on_group AND e.source = ANY ($2::text[])
    GROUP BY e.dependent
), locked AS (
    SELECT t.id FROM orchestra.tasks AS t JOIN hit USING (id)
    WHERE t.run_id = $1 AND t.state = 'pending'
    ORDER BY t.id
    FOR UPDATE OF t
)
UPDATE orchestra.tasks AS t SET waiting = t.waiting - CASE WHEN $3 THEN hit.n ELSE 0 END
FROM hit JOIN locked USING (id)
WHERE t.run_id = $1 AND t.id = hit.id
RETURNING t.id, t.waiting, hit.first, hit.source
"""

# What the ended tasks concern beyond their dependents: their tags, and whether a group is
# named after them.
_ENDED = """
SELECT t.id, t.tags, EXISTS (
    SELECT FROM orchestra.groups AS g WHERE g.run_id = $1 AND g.tag = t.id) AS owns
FROM orchestra.tasks AS t
WHERE t.run_id = $1 AND t.id = ANY ($2::text[]) AND (t.tags IS NOT NULL OR EXISTS (
    SELECT FROM orchestra.groups AS g WHERE g.run_id = $1 AND g.tag = t.id))
"""


async def _end_cascade(
    conn: asyncpg.Connection, run_id: str, ended: list[tuple[str, str]]
) -> Settled:
    """`Graph.release` for ended tasks, and for what their ends skip, round after round; then
    what was freed is made ready (unless skipped meanwhile, as in memory)."""
    readied: list[str] = []
    skipped: list[str] = []
    while ended:
        skip: list[tuple[str, str]] = []
        by_status: dict[bool, list[str]] = {True: [], False: []}
        status_of = dict(ended)
        for task_id, state in ended:
            by_status[state == SUCCEEDED].append(task_id)
        if by_status[True]:
            rows = await conn.fetch(_DEPENDENTS, run_id, by_status[True], True)
            readied.extend(r[0] for r in sorted(rows, key=lambda r: r[2]) if r[1] == 0)
        if by_status[False]:
            rows = await conn.fetch(_DEPENDENTS, run_id, by_status[False], False)
            skip.extend(
                (r[0], f"dependency {r[3]!r} {status_of[r[3]]}")
                for r in sorted(rows, key=lambda r: r[2])
            )
        concerned = await conn.fetch(_ENDED, run_id, [task_id for task_id, _ in ended])
        if concerned:
            await _release_groups(conn, run_id, ended, concerned, readied, skip)
        if not skip:
            break
        ended = await _skip(conn, run_id, skip)
        skipped.extend(task_id for task_id, _ in ended)
    ready = await _make_ready(conn, run_id, readied)
    return Settled(ready, skipped)


class _Group:
    __slots__ = ("closed", "failed", "open", "tag", "waiters")

    def __init__(self, tag: str, open_: int, closed: bool, failed: str | None, waiters: bool):
        self.tag = tag
        self.open = open_
        self.closed = closed
        self.failed = failed
        self.waiters = waiters


async def _lock_groups(
    conn: asyncpg.Connection, run_id: str, tags: Iterable[str]
) -> dict[str, _Group]:
    """Lock these groups of the run, then read them (see `_LOCK_GROUPS`)."""
    ordered = sorted(set(tags))
    await conn.execute(_LOCK_GROUPS, run_id, ordered)
    rows = await conn.fetch(
        "SELECT g.tag, g.open, g.closed, g.failed, EXISTS (SELECT FROM orchestra.edges AS e "
        "WHERE e.run_id = $1 AND e.on_group AND e.source = g.tag) FROM orchestra.groups AS g "
        "WHERE g.run_id = $1 AND g.tag = ANY ($2::text[])",
        run_id, ordered,
    )  # fmt: skip
    return {r[0]: _Group(*r) for r in rows}


async def _release_groups(
    conn: asyncpg.Connection,
    run_id: str,
    ended: Sequence[tuple[str, str]],
    concerned: Sequence[Any],
    readied: list[str],
    skip: list[tuple[str, str]],
) -> None:
    """The groups' part of `Graph.release`: each ended member leaves its groups open count (a
    member that did not succeed fails them, skipping their waiters); the groups they are members
    of, or named after, close if they can."""
    info = {r[0]: (r[1] or [], r[2]) for r in concerned}
    tags: set[str] = set()
    for task_id, (member_of, owns) in info.items():
        tags.update(member_of)
        if owns:
            tags.add(task_id)
    groups = await _lock_groups(conn, run_id, tags)
    order: list[str] = []  # the groups to look at for closing, in the memory store's order
    failed_now: list[str] = []
    for task_id, state in ended:
        if task_id not in info:
            continue
        member_of, owns = info[task_id]
        for tag in member_of:
            group = groups[tag]
            group.open -= 1
            if state != SUCCEEDED and group.failed is None:
                group.failed = f"group {tag!r} member {task_id!r} {state}"
                failed_now.append(tag)
            order.append(tag)
        if owns:
            order.append(task_id)
    await conn.execute(
        "UPDATE orchestra.groups AS g SET open = u.open, failed = u.failed "
        "FROM unnest($2::text[], $3::integer[], $4::text[]) AS u (tag, open, failed) "
        "WHERE g.run_id = $1 AND g.tag = u.tag",
        run_id, list(groups), [g.open for g in groups.values()],
        [g.failed for g in groups.values()],
    )  # fmt: skip
    for tag in failed_now:
        if groups[tag].waiters:
            rows = await conn.fetch(
                "SELECT e.dependent FROM orchestra.edges AS e JOIN orchestra.tasks AS t "
                "ON t.run_id = e.run_id AND t.id = e.dependent WHERE e.run_id = $1 AND e.on_group "
                "AND e.source = $2 AND t.state = 'pending' ORDER BY e.n",
                run_id, tag,
            )  # fmt: skip
            skip.extend((r[0], groups[tag].failed) for r in rows)  # type: ignore[misc]
    await _close_groups(conn, run_id, groups, list(dict.fromkeys(order)), readied, skip)


async def _close_groups(
    conn: asyncpg.Connection,
    run_id: str,
    groups: dict[str, _Group],
    order: Sequence[str],
    readied: list[str],
    skip: list[tuple[str, str]],
) -> None:
    """`Graph._maybe_close` for these groups (locked), in `order`: a group somebody waits for,
    with no member open, once the input closed and the task named after it (if any) ended,
    closes; its waiters wait for it no more, unless it failed (they were skipped then)."""
    candidates = [tag for tag in order if tag in groups and _may_close(groups[tag])]
    if not candidates:
        return
    # Read after the groups were locked: an end or a `close_input` committed meanwhile is seen.
    row = await conn.fetchrow(
        "SELECT (SELECT input_closed FROM orchestra.runs WHERE id = $1), "
        "ARRAY(SELECT t.id FROM orchestra.tasks AS t WHERE t.run_id = $1 "
        "AND t.id = ANY ($2::text[]) AND t.state NOT IN "
        "('succeeded', 'failed', 'cancelled', 'skipped'))",
        run_id, candidates,
    )  # fmt: skip
    assert row is not None  # one row, always
    if not row[0]:
        return
    owners_live = set(row[1])
    closing = [tag for tag in candidates if tag not in owners_live]
    if not closing:
        return
    await conn.execute(
        "UPDATE orchestra.groups SET closed = true WHERE run_id = $1 AND tag = ANY ($2::text[])",
        run_id, closing,
    )  # fmt: skip
    freeing = [tag for tag in closing if groups[tag].failed is None]
    for tag in closing:
        groups[tag].closed = True
    if not freeing:
        return
    rows = await conn.fetch(
        """WITH hit AS (
            SELECT e.dependent AS id, count(*) AS n,
                min(array_position($2::text[], e.source) * 1e15 + e.n) AS first
            FROM orchestra.edges AS e
            WHERE e.run_id = $1 AND e.on_group AND e.source = ANY ($2::text[])
            GROUP BY e.dependent
        ), locked AS (
            SELECT t.id FROM orchestra.tasks AS t JOIN hit USING (id)
            WHERE t.run_id = $1 AND t.state = 'pending' ORDER BY t.id FOR UPDATE OF t
        )
        UPDATE orchestra.tasks AS t SET waiting = t.waiting - hit.n
        FROM hit JOIN locked USING (id)
        WHERE t.run_id = $1 AND t.id = hit.id
        RETURNING t.id, t.waiting, hit.first""",
        run_id, freeing,
    )  # fmt: skip
    readied.extend(r[0] for r in sorted(rows, key=lambda r: r[2]) if r[1] == 0)


def _may_close(group: _Group) -> bool:
    return group.waiters and not group.closed and group.open == 0


_SKIP = """
UPDATE orchestra.tasks AS t
SET state = 'skipped', error = u.reason, error_type = 'DependencyFailed', finished = now()
FROM (
    SELECT DISTINCT ON (id) id, reason FROM unnest($2::text[], $3::text[])
        WITH ORDINALITY AS s (id, reason, n)
    ORDER BY id, n
) AS u
WHERE t.run_id = $1 AND t.id = u.id AND t.state = 'pending'
RETURNING t.id
"""


async def _skip(
    conn: asyncpg.Connection, run_id: str, skip: Sequence[tuple[str, str]]
) -> list[tuple[str, str]]:
    """Skip these pending tasks (id, why); returns the ones skipped now, as ends to settle."""
    rows = await conn.fetch(_SKIP, run_id, *_columns(skip, 2))
    skipped = {r[0] for r in rows}
    return [
        (task_id, SKIPPED) for task_id in dict.fromkeys(t for t, _ in skip) if task_id in skipped
    ]


# One value of `queue_order` per statement, scaled by QUEUE_STEP, plus each task's rank: the
# tasks one statement queues keep their order (a sequence drawn once per row may hand its values
# out in another order than the rows').
_READY = f"""
WITH base AS (SELECT nextval('orchestra.queue_order') * {QUEUE_STEP} AS seq), freed AS (
    SELECT u.id, row_number() OVER (ORDER BY u.n) AS rank
    FROM unnest($2::text[]) WITH ORDINALITY AS u (id, n)
    JOIN orchestra.tasks AS t ON t.run_id = $1 AND t.id = u.id
    WHERE t.state = 'pending' AND t.waiting = 0
)
UPDATE orchestra.tasks AS t SET state = 'ready', seq = base.seq + freed.rank
FROM freed, base
WHERE t.run_id = $1 AND t.id = freed.id
RETURNING t.id, t.kind, t.seq
"""


async def _make_ready(
    conn: asyncpg.Connection, run_id: str, ids: Sequence[str]
) -> list[tuple[str, str]]:
    """Of `ids` (in the order they were freed), the ones pending and waiting for nothing become
    ready, queued in that order. Returns them as (id, kind)."""
    if not ids:
        return []
    rows = await conn.fetch(_READY, run_id, list(dict.fromkeys(ids)))
    return [(r[0], r[1]) for r in sorted(rows, key=lambda r: r[2])]


async def notify_ready(
    conn: asyncpg.Connection, run_id: str, ready: Sequence[tuple[str, str]]
) -> None:
    """Tell the run's listeners which kinds have tasks ready (delivered at commit)."""
    if not ready:
        return
    payload = json.dumps({"run": run_id, "kinds": sorted({kind for _, kind in ready})})
    await conn.execute("SELECT pg_notify($1, $2)", channel_of(run_id), payload)
