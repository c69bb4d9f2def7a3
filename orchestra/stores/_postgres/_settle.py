"""Settling on PostgreSQL: what an end frees or dooms in a run's graph, in the transaction that
ended it (`_leases.complete`, and `_graph.admit` for what it skips at once).

The meanings are the memory store's `Graph.release`: a success takes one off its dependents' and
its groups' waiters' ``waiting`` and makes the ones at zero ready; any other end skips what waits
for it, its groups' waiters included, and so on down; a group closes once every member succeeded
and no more can come (the run's input closed, and the task whose id is the tag ended). A task
that held its key within the run (``run_keys``) ends the tasks that follow it (``follows``) with
its output and agent when it succeeded, each end settled in turn, or hands the key to the first of
them still unfinished when it did not (`Graph._followed`). These ends are written by whichever
process settles the holder's end, and go to no feed: a coordinator that hears the holder's end
(`_follow.heard`) ends its followers in its mirror, as it skips its dependents. What
became ready is queued in the order the memory store would queue it (``tasks.seq``,
`QUEUE_STEP`), and a NOTIFY on the run's channel (`channel_of`) carries the run id and the kinds
of what became ready, and one on `GLOBAL_CHANNEL` the run id (for the processes that serve every
run), delivered when the transaction commits, so idle processes wake.

Each statement that reads what an end concerns runs after the rows it depends on were locked
(READ COMMITTED takes a snapshot per statement), so nothing admitted meanwhile is missed. Rows are
locked in sorted order where a statement can choose; an end that reaches both tasks and groups
may still meet another transaction locking them the other way round: PostgreSQL then aborts one
of them with a deadlock error, and `transaction` runs it again.

**Lock order.** The one order is runs, tasks, run_keys, follows, groups, keys; within a kind, by
id, key or tag (``ORDER BY ... FOR UPDATE``, or ``_CLAIM``'s ``ORDER BY``), and runs by id where
one transaction settles several. A statement that writes rows locked by an earlier one writes
only those (its snapshot is newer: a row that came to match meanwhile would be locked then, out
of order). The paths that lock more than one kind in one transaction:

============================  ==============================================================
path                          rows locked, in this order
============================  ==============================================================
admission (`_graph.admit_in`  runs (share: the fence, ``input_closed``) > tasks named (share,
in a fenced write, then       by id) > groups (by tag) > run_keys (by key) > tasks (a pending
`admit_keys`)                 holder, followers) > follows > settle > keys
settle (`settle`)             tasks (dependents, by id) > run_keys (by key) > follows > tasks
                              (followers) > groups (by tag) > tasks (waiters, by id); again
                              for each round of skips
complete; fenced decide       tasks (ended) > settle > keys (`finish_tasks`: the run's holds
(`_follow.decide`)            of the ended and skipped tasks, by key)
complete with spawns that     tasks (ended) > admission of the spawns (as above, without
have keys (`_keys.            `admit_keys`) > settle > runs (share: whose the holds are) > keys
admit_spawned`)               (the spawns' keys and the run's holds of what ended, by key) > tasks
                              (the keyed spawns, by id) > keys (`_CLAIM`: the same, locked) >
                              tasks (settle of a reused result) > keys (`finish_tasks`: locked)
take_back_expired             tasks (expired, SKIP LOCKED) > settle of each run > keys
close_input (fenced)          runs > groups (by tag) > tasks (waiters, by id)
retry (`_admin`)              runs > tasks (every task of the run, by id) > groups > keys
admit_keys, ask_again         tasks (the keyed, by id) > keys (`_CLAIM`, by key) > tasks (the
(`_keyed._decide`)            same) > settle of a reused result
claim, renew, renew_run,      keys only, by key (`release_run` reads tasks without locking)
finish, release_run, adopt
============================  ==============================================================

A claim in a completion's transaction (`_leases.complete_and_claim`) locks its tasks last, after
the keys: ``SKIP LOCKED``, it never waits for a lock, and so cannot take part in a deadlock.

What goes against the order, and so may deadlock: a settle cascade locks tasks again after
run_keys and groups, and so meets an admission (run_keys, then a pending holder's task row) or
`close_input` (groups, then their waiters) that locks the same rows the other way round; and
`_decide` settles a reused result after locking keys (no transaction locks those tasks after
keys it holds: a completion locks only its run's holds, and a key becomes the run's when the
claim commits); a completion whose spawns have keys locks the run's row (shared) after tasks, as
a spawn waiting for groups does, and decides the spawns' keys after settling, as `_decide` does
(the spawns' rows are its own, uncommitted: only a reused spawn's cascade reaches other rows, and
it may lock another run's key, which that run's completion locks after its tasks). PostgreSQL
aborts one of two deadlocked transactions: `transaction` runs it again, and so does `_jobs` a
coordinator's fenced write.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, NamedTuple, TypeVar

import asyncpg

from ..._task import SKIPPED, SUCCEEDED
from ._listen import GLOBAL_CHANNEL, channel_of

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable, Sequence

__all__ = (
    "FORCED_PLANS",
    "LOCK_GROUPS",
    "QUEUE_STEP",
    "RETRIES",
    "SESSION_PLANS",
    "Settled",
    "close_input",
    "columns",
    "concerns",
    "end_cascade",
    "lock_groups",
    "make_ready",
    "settle",
    "skip_cascade",
    "skip_pending",
    "transaction",
)

_T = TypeVar("_T")

QUEUE_STEP: Final = 1 << 24
"""A task's place in its run's queue (``tasks.seq``) is a value of the sequence ``queue_order``
times this, plus its rank among the tasks queued by the same statement."""

RETRIES: Final = 5
"""A transaction aborted by a deadlock is run again this many times."""

# Connections plan each statement for its parameters (`_leases.SERVER_SETTINGS`), but for the few
# statements of the hot path that run in a transaction after `FORCED_PLANS` (until
# `SESSION_PLANS`): a worker's completion and the claim that follows it
# (`_leases.complete_and_claim`), and the coordinator's read of the ended feed. Their generic plan
# reads the tasks by primary key whatever the batch, and planning each batch again cost more than
# running it; it is used from the first batch: PostgreSQL's own choice (``auto``) costs it for
# statistics that do not fit (the claim's for a tenth of the run's ready tasks) and would plan
# most batches anyway (the feed's read: 37 plans in 50 reads). tests/test_pg_plans.py checks
# those plans. A completion's fence is written ``coalesce(t.lease_owner, '') = $2`` for that:
# with ``t.lease_owner = $2`` a generic plan walks the partial index ``tasks_leased`` (every
# lease of the table, and its dead entries) against every row of the batch instead.
FORCED_PLANS: Final = "SET LOCAL plan_cache_mode = force_generic_plan"
SESSION_PLANS: Final = "SET LOCAL plan_cache_mode TO DEFAULT"


class Settled(NamedTuple):
    """What settling ends did: the tasks made ready, in queue order, as (id, kind); the tasks
    skipped (what they waited for did not succeed)."""

    ready: list[tuple[str, str]]
    skipped: list[str]


async def transaction(
    conn: asyncpg.Connection,
    step: Callable[[asyncpg.Connection], Awaitable[_T]],
    *,
    begin: str | None = None,
) -> _T:
    """Run `step` in a transaction of its own, run again when PostgreSQL aborted it to break a
    deadlock with another (each try starts from nothing: the aborted one left nothing). Inside a
    transaction already, `step` runs in it (a deadlock then aborts the caller's, which retries).
    `begin`: statements the transaction starts with (``SET LOCAL ...``), sent with its BEGIN
    (not run inside a caller's transaction: the caller's SET LOCAL is the caller's)."""
    if conn.is_in_transaction():
        return await step(conn)
    for attempt in range(RETRIES):
        try:
            if begin is None:
                async with conn.transaction():
                    return await step(conn)
            else:
                return await _begun(conn, step, begin)
        except asyncpg.DeadlockDetectedError:
            if attempt == RETRIES - 1:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


async def _begun(
    conn: asyncpg.Connection, step: Callable[[asyncpg.Connection], Awaitable[_T]], begin: str
) -> _T:
    """`step` in a transaction begun with `begin`, by hand: asyncpg's `Transaction` sends its
    BEGIN alone, and so a transaction that starts with a setting took one round trip more (a
    worker's completion, every batch)."""
    await conn.execute(f"BEGIN; {begin}")
    try:
        result = await step(conn)
    except BaseException:
        if not conn.is_closed():  # (a connection cut mid-statement is closed, its transaction gone)
            await conn.execute("ROLLBACK")
        raise
    await conn.execute("COMMIT")
    return result


def columns(rows: Sequence[Sequence[Any]], width: int) -> list[list[Any]]:
    """`rows` as `width` column lists (for ``unnest``): empty lists when there are none."""
    if not rows:
        return [[] for _ in range(width)]
    return [list(column) for column in zip(*rows, strict=True)]


# Groups are locked by one statement and read by the next: a statement's snapshot is taken
# when it starts, so one that waited for a lock would not see the edges (waiters) committed by
# the transaction it waited for.
LOCK_GROUPS = """
SELECT g.tag FROM orchestra.groups AS g
WHERE g.run_id = $1 AND g.tag = ANY ($2::text[])
ORDER BY g.tag
FOR UPDATE
"""

# -- settling ----------------------------------------------------------------------------------


async def settle(
    conn: asyncpg.Connection, run_id: str, ended: Sequence[tuple[str, str]]
) -> Settled:
    """Settle tasks of `run_id` that this transaction has just ended, `ended` as (id, terminal
    state) in the order they ended: what waited for a success and waits for nothing else now is
    made ready; what waited for anything else is skipped, and so on down; groups count their
    members' ends and close. Notifies the run's channel when something became ready. Call it in
    the transaction that ended them (`_leases.complete` does)."""
    if not ended or not await concerns(conn, run_id, [task_id for task_id, _ in ended]):
        return Settled([], [])
    return await end_cascade(conn, run_id, list(ended))


async def concerns(
    conn: asyncpg.Connection, run_id: str, ids: Sequence[str], *, members: bool = True
) -> bool:
    """Whether the ends of these tasks of `run_id`, written by this transaction, concern anything
    `settle` would change (dependents, groups, keys): most batches of a run without them do not.
    `members` False: the caller knows that none of the tasks has tags or a key (what the end's
    write returned: a task's are written once, at its admission), so only what waits for them is
    looked at."""
    concerned: bool = await conn.fetchval(_CONCERNS if members else _WAITED_FOR, run_id, ids)
    return concerned


# Whether ends concern anything at all (what `_ENDS` reads, with the same snapshot rules: a
# statement after the ends' own): most batches of a run without dependencies, groups or keys
# concern nothing, and this is planned in half of `_ENDS`'s time (a completion runs it under
# `FORCED_PLANS`: planned once).
_WAITED_FOR = """
SELECT EXISTS (
    SELECT FROM orchestra.edges WHERE run_id = $1 AND NOT on_group AND source = ANY ($2::text[])
) OR EXISTS (
    SELECT FROM orchestra.groups WHERE run_id = $1 AND tag = ANY ($2::text[])
)
"""
_CONCERNS = f"""{_WAITED_FOR.rstrip()} OR EXISTS (
    SELECT FROM orchestra.tasks WHERE run_id = $1 AND id = ANY ($2::text[])
        AND (tags IS NOT NULL OR key IS NOT NULL)
)
"""


async def close_input(conn: asyncpg.Connection, run_id: str) -> Settled:
    """No more input will come to `run_id`: the groups whose members are all done close, and their
    waiters waiting for nothing else are made ready (notified)."""

    async def step(conn: asyncpg.Connection) -> Settled:
        await conn.execute("UPDATE orchestra.runs SET input_closed = true WHERE id = $1", run_id)
        # In the order the groups were made, as the memory store closes them (and so readies
        # their waiters).
        tags = [r[0] for r in await conn.fetch(
            "SELECT tag FROM orchestra.groups WHERE run_id = $1 AND NOT closed ORDER BY n", run_id
        )]  # fmt: skip
        readied: list[str] = []
        if tags:
            groups = await lock_groups(conn, run_id, tags)
            await _close_groups(conn, run_id, groups, tags, readied, [])
        return Settled(await make_ready(conn, run_id, readied), [])

    return await transaction(conn, step)


# What ended tasks concern: each pending dependent (task edges), with how many successes it
# waited for, the first edge's order (the order the memory store frees dependents in) and the
# first end that was not a success, if any; then the ended tasks that are members of groups or
# have a group named after them.
_ENDS = """
WITH ended AS (
    SELECT * FROM unnest($2::text[], $3::boolean[]) AS x (id, ok)
), hit AS (
    SELECT e.dependent AS id, count(*) FILTER (WHERE x.ok) AS n, min(e.n) AS first,
        (array_agg(e.source ORDER BY e.n) FILTER (WHERE NOT x.ok))[1] AS doomed_by
    FROM orchestra.edges AS e JOIN ended AS x ON x.id = e.source
    WHERE e.run_id = $1 AND NOT e.on_group
    GROUP BY e.dependent
), locked AS (
    SELECT t.id FROM orchestra.tasks AS t JOIN hit USING (id)
    WHERE t.run_id = $1 AND t.state = 'pending'
    ORDER BY t.id
    FOR UPDATE OF t
), freed AS (
    UPDATE orchestra.tasks AS t SET waiting = t.waiting - hit.n
    FROM hit JOIN locked USING (id)
    WHERE t.run_id = $1 AND t.id = hit.id
    RETURNING t.id, t.waiting, hit.first, hit.doomed_by
)
SELECT true AS dependent, id, waiting, first, doomed_by, NULL::text[] AS tags, false AS owns,
    NULL::text AS key
FROM freed
UNION ALL
SELECT false, t.id, NULL, NULL, NULL, t.tags, EXISTS (
    SELECT FROM orchestra.groups AS g WHERE g.run_id = $1 AND g.tag = t.id), t.key
FROM orchestra.tasks AS t
WHERE t.run_id = $1 AND t.id = ANY ($2::text[]) AND (t.tags IS NOT NULL OR t.key IS NOT NULL
    OR EXISTS (SELECT FROM orchestra.groups AS g WHERE g.run_id = $1 AND g.tag = t.id))
"""


async def end_cascade(
    conn: asyncpg.Connection, run_id: str, ended: list[tuple[str, str]]
) -> Settled:
    """`Graph.release` for ended tasks, then for what their ends skip, and so on down (`_skip`);
    then what was freed is made ready (unless skipped meanwhile, as in memory)."""
    readied: list[str] = []
    skip: list[tuple[str, str]] = []
    await _release(conn, run_id, ended, readied, skip)
    skipped = await _skip(conn, run_id, skip, readied) if skip else []
    return Settled(await make_ready(conn, run_id, readied), skipped)


async def skip_cascade(
    conn: asyncpg.Connection, run_id: str, skip: Sequence[tuple[str, str]]
) -> Settled:
    """Skip these pending tasks (id, why), in this order, each with what its skip skips in turn
    (as `MemoryRun._wire` ends each one it skips at admission); then what was freed is made
    ready."""
    readied: list[str] = []
    skipped = await _skip(conn, run_id, list(reversed(skip)), readied)
    return Settled(await make_ready(conn, run_id, readied), skipped)


async def _skip(
    conn: asyncpg.Connection,
    run_id: str,
    stack: list[tuple[str, str]],
    readied: list[str],
) -> list[str]:
    """Skip the tasks of `stack` (id, why) and what waits for them, and so on down, as the memory
    store does (`MemoryRun._end`): a stack, the last pushed skipped first, each skip's release
    pushing what it dooms. Returns the ids skipped.

    What a cascade of skips makes ready (a key handed on, a group closed by the skip of the task
    it is named after) is queued in the order the memory store reaches it. That order is the
    stack's, one task at a time, a few statements each; most cascades make at most one task
    ready, and then any order of the same skips does: those go by rounds (all the tasks one
    round skips in a few statements), in a savepoint, and only a cascade that made several tasks
    ready is undone and done again one task at a time."""
    cascade_ready: list[str] = []
    skipped: list[str] = []
    # Written as statements, not asyncpg's `Transaction`: that refuses to be a savepoint of a
    # transaction begun by hand (`transaction`'s ``begin``).
    await conn.execute(f"SAVEPOINT {_SKIPS}")
    try:
        # (reversed: a task pushed twice is skipped for the reason pushed last, as in memory)
        ended = await skip_pending(conn, run_id, stack[::-1])
        while ended:
            skipped.extend(task_id for task_id, _ in ended)
            more: list[tuple[str, str]] = []
            await _release(conn, run_id, ended, cascade_ready, more)
            ended = await skip_pending(conn, run_id, more[::-1]) if more else []
    except BaseException:
        await conn.execute(f"ROLLBACK TO SAVEPOINT {_SKIPS}")
        raise
    if len(cascade_ready) < 2:
        await conn.execute(f"RELEASE SAVEPOINT {_SKIPS}")
        readied.extend(cascade_ready)
        return skipped
    await conn.execute(f"ROLLBACK TO SAVEPOINT {_SKIPS}; RELEASE SAVEPOINT {_SKIPS}")
    skipped = []
    stack = list(stack)
    while stack:
        task_id, why = stack.pop()
        if not await skip_pending(conn, run_id, [(task_id, why)]):
            continue  # ended already (skipped by an earlier push)
        skipped.append(task_id)
        more = []
        await _release(conn, run_id, [(task_id, SKIPPED)], readied, more)
        stack.extend(more)
    return skipped


_SKIPS: Final = "orchestra_skips"  # `_skip`'s savepoint


async def _release(
    conn: asyncpg.Connection,
    run_id: str,
    ended: list[tuple[str, str]],
    readied: list[str],
    skip: list[tuple[str, str]],
) -> None:
    """One round of `end_cascade`, in the memory store's order: what waited for the ended tasks
    (freed, or doomed: on `skip`), then the tasks that follow them (their keys), then their
    groups."""
    status_of = dict(ended)
    rows = await conn.fetch(
        _ENDS, run_id, [task_id for task_id, _ in ended],
        [state == SUCCEEDED for _, state in ended],
    )  # fmt: skip
    freed = sorted((r for r in rows if r[0]), key=lambda r: r[3])
    for _, task_id, waiting, _, doomed_by, _, _, _ in freed:
        if doomed_by is not None:
            skip.append((task_id, f"dependency {doomed_by!r} {status_of[doomed_by]}"))
        elif waiting == 0:
            readied.append(task_id)
    concerned = [r[1:] for r in rows if not r[0]]
    keyed = [(r[0], r[6]) for r in concerned if r[6] is not None]
    if keyed:
        await _pass_keys(conn, run_id, ended, keyed, readied, skip)
    grouped = [r for r in concerned if r[4] is not None or r[5]]
    if grouped:
        await _release_groups(conn, run_id, ended, grouped, readied, skip)


# -- keys within a run: the ends of what follows a key's holder ---------------------------------

# The keys the ended tasks hold, locked: an admission that would make a task follow one of them
# locks its key first, so it comes wholly before this end (its follower is seen below) or after
# (it sees the holder ended). The followers are read by the next statement, whose snapshot comes
# after the lock (see `LOCK_GROUPS`).
_HELD_KEYS = """
SELECT k.key, k.holder FROM orchestra.run_keys AS k
JOIN unnest($2::text[], $3::text[]) AS e (id, key) ON k.key = e.key AND k.holder = e.id
WHERE k.run_id = $1
ORDER BY k.key
FOR UPDATE OF k
"""

# The followers of ended holders, taken off them (the ones that go on are put back under their
# heir), with their states and their places in line.
_TAKE_FOLLOWERS = """
DELETE FROM orchestra.follows AS f USING orchestra.tasks AS t
WHERE f.run_id = $1 AND f.holder = ANY ($2::text[]) AND t.run_id = $1 AND t.id = f.follower
RETURNING f.holder, f.follower, f.n, t.state
"""

# Followers of a holder that succeeded end with its result: the same work, done once.
_END_FOLLOWERS = """
UPDATE orchestra.tasks AS t
SET state = 'succeeded', output = h.output, agent = h.agent, finished = now()
FROM unnest($2::text[], $3::text[]) AS f (id, holder)
JOIN orchestra.tasks AS h ON h.run_id = $1 AND h.id = f.holder
WHERE t.run_id = $1 AND t.id = f.id AND t.state = 'pending'
RETURNING t.id
"""

# The first follower of a holder that did not succeed takes its key, and waits for it no more;
# the others follow that heir, in their places.
_HAND_ON = """
WITH keys AS (
    UPDATE orchestra.run_keys AS k SET holder = h.heir
    FROM unnest($2::text[], $3::text[]) AS h (key, heir)
    WHERE k.run_id = $1 AND k.key = h.key
), rest AS (
    INSERT INTO orchestra.follows (run_id, follower, holder, n)
    SELECT $1, r.follower, r.holder, r.n
    FROM unnest($4::text[], $5::text[], $6::bigint[]) AS r (follower, holder, n)
)
UPDATE orchestra.tasks AS t SET waiting = t.waiting - 1
FROM unnest($3::text[]) AS h (heir)
WHERE t.run_id = $1 AND t.id = h.heir
RETURNING t.id, t.waiting
"""


async def _pass_keys(
    conn: asyncpg.Connection,
    run_id: str,
    ended: Sequence[tuple[str, str]],
    keyed: Sequence[tuple[str, str]],
    readied: list[str],
    skip: list[tuple[str, str]],
) -> None:
    """`Graph._followed` for the ended tasks (`keyed`: those with a key, as (id, key)) that held
    their keys: a holder that succeeded ends its followers with its output and agent (each end
    settled in turn, as in memory); one that did not hands its key to its first follower still
    unfinished (ready once it waits for nothing else), whom the others now follow."""
    held = await conn.fetch(_HELD_KEYS, run_id, *columns(keyed, 2))
    if not held:
        return
    key_of = {holder: key for key, holder in held}
    rows = sorted(await conn.fetch(_TAKE_FOLLOWERS, run_id, list(key_of)), key=lambda r: r[2])
    line: dict[str, list[tuple[str, int, str]]] = {}  # holder -> (follower, n, state), in line
    for holder, follower, n, state in rows:
        line.setdefault(holder, []).append((follower, n, state))
    ending: list[tuple[str, str]] = []  # (follower, holder)
    heirs: list[tuple[str, str]] = []  # (key, heir)
    rest: list[tuple[str, str, int]] = []  # (follower, its new holder, n)
    for task_id, state in ended:
        # A follower waits for its holder, so the ones still to come are pending (the others
        # ended meanwhile: skipped, cancelled).
        live = [f for f in line.get(task_id, ()) if f[2] == "pending"]
        if not live:
            continue
        if state == SUCCEEDED:
            ending.extend((follower, task_id) for follower, _, _ in live)
            continue
        heir = live[0][0]
        heirs.append((key_of[task_id], heir))
        rest.extend((follower, heir, n) for follower, n, _ in live[1:])
    if heirs:
        rows = await conn.fetch(_HAND_ON, run_id, *columns(heirs, 2), *columns(rest, 3))
        free = {heir for heir, waiting in rows if waiting == 0}
        readied.extend(heir for _, heir in heirs if heir in free)
    if ending:
        done = {r[0] for r in await conn.fetch(_END_FOLLOWERS, run_id, *columns(ending, 2))}
        for follower, _ in ending:
            if follower in done:  # its end frees what waited for it, before its holder's groups
                await _release(conn, run_id, [(follower, SUCCEEDED)], readied, skip)


class _Group:
    __slots__ = ("closed", "failed", "open", "tag", "waiters")

    def __init__(self, tag: str, open_: int, closed: bool, failed: str | None, waiters: bool):
        self.tag = tag
        self.open = open_
        self.closed = closed
        self.failed = failed
        self.waiters = waiters


async def lock_groups(
    conn: asyncpg.Connection, run_id: str, tags: Iterable[str]
) -> dict[str, _Group]:
    """Lock these groups of the run, then read them (see `LOCK_GROUPS`)."""
    ordered = sorted(set(tags))
    await conn.execute(LOCK_GROUPS, run_id, ordered)
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
    info = {r[0]: (r[4] or [], r[5]) for r in concerned}
    tags: set[str] = set()
    for task_id, (member_of, owns) in info.items():
        tags.update(member_of)
        if owns:
            tags.add(task_id)
    groups = await lock_groups(conn, run_id, tags)
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


async def skip_pending(
    conn: asyncpg.Connection, run_id: str, skip: Sequence[tuple[str, str]]
) -> list[tuple[str, str]]:
    """Skip these pending tasks (id, why); returns the ones skipped now, as ends to settle."""
    rows = await conn.fetch(_SKIP, run_id, *columns(skip, 2))
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
), readied AS (
    UPDATE orchestra.tasks AS t SET state = 'ready', seq = base.seq + freed.rank
    FROM freed, base
    WHERE t.run_id = $1 AND t.id = freed.id
    RETURNING t.id, t.kind, t.seq
), woken AS (
    SELECT pg_notify($3, json_build_object('run', $1::text, 'kinds', k.kinds)::text),
        pg_notify($4, $1::text)
    FROM (SELECT array_agg(DISTINCT kind ORDER BY kind) AS kinds FROM readied) AS k
    WHERE k.kinds IS NOT NULL
)
SELECT r.id, r.kind, r.seq FROM readied AS r LEFT JOIN woken ON true
"""


async def make_ready(
    conn: asyncpg.Connection, run_id: str, ids: Sequence[str]
) -> list[tuple[str, str]]:
    """Of `ids` (in the order they were freed), the ones pending and waiting for nothing become
    ready, queued in that order, and the run's listeners are told which kinds have tasks ready
    (a NOTIFY, delivered when the transaction commits). Returns them as (id, kind)."""
    if not ids:
        return []
    rows = await conn.fetch(
        _READY, run_id, list(dict.fromkeys(ids)), channel_of(run_id), GLOBAL_CHANNEL
    )
    return [(r[0], r[1]) for r in sorted(rows, key=lambda r: r[2])]
