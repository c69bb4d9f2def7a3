"""A run's keyed tasks on PostgreSQL: held back while a task of another run holds their
idempotency key, decided in the transaction that admits them (the key's holds themselves:
`_keys.py`).

Readiness lives in the database, so a task whose key another task holds must not be ready
there, or any worker would claim it. `admit_keys`, in the transaction that admits the tasks, claims their keys and acts on the answers: a task whose key is its own
goes on as admitted, one whose key succeeded before ends with that result (unexecuted, its
dependents readied), one whose key is held is *held back*: one more thing its ``waiting``
counts, said in the journal (``key_waits``), so neither a claim nor a dependency's end makes it
ready. `ask_again` (for the keys `Waiting` says are due) lets it go once the key is its own
(``key_taken``: ready when it waits for nothing else) or ends it with the result
(``key_reused``); `held_back` reads from the journal what a coordinator taking the run over
must wait for.

Spawned tasks (`admit_spawned`) have their keys decided in the completion that admits them, the
same way; the run's coordinator reads what was decided (`spawn_answers`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._task import SUCCEEDED
from ._keys import Answer, Held, Mine, Stored, claim
from ._settle import columns, make_ready, settle, transaction

if TYPE_CHECKING:
    from collections.abc import Sequence

    import asyncpg

__all__ = ("admit_keys", "admit_spawned", "ask_again", "held_back", "spawn_answers")


# -- a run's keyed tasks: held back while another task holds their key ---------------------------

_LOCK_TASKS = """
SELECT t.id, t.state FROM orchestra.tasks AS t
WHERE t.run_id = $1 AND t.id = ANY ($2::text[])
ORDER BY t.id
FOR UPDATE
"""

# The tasks of a run held back for their keys: pending ones whose last key event says so. The
# journal tells it (a task's row does not: `waiting` counts its dependencies and groups too).
_HELD_BACK = """
SELECT task_id, key FROM (
    SELECT DISTINCT ON (e.task_id) e.task_id, t.key, e.event
    FROM orchestra.events AS e
    JOIN orchestra.tasks AS t ON t.run_id = e.run_id AND t.id = e.task_id
    WHERE e.run_id = $1 AND e.event IN ('key_waits', 'key_taken', 'key_reused')
        AND t.state = 'pending' AND ($2::text[] IS NULL OR e.task_id = ANY ($2::text[]))
    ORDER BY e.task_id, e.seq DESC
) AS last
WHERE event = 'key_waits'
ORDER BY task_id
"""

# Held back: one more thing to wait for, so neither a claim nor `make_ready` takes it.
_HOLD = """
WITH held AS (
    UPDATE orchestra.tasks AS t SET waiting = t.waiting + 1, state = 'pending'
    FROM unnest($2::text[], $3::text[]) AS h (id, detail)
    WHERE t.run_id = $1 AND t.id = h.id AND t.state IN ('pending', 'ready')
    RETURNING t.id, h.detail
)
INSERT INTO orchestra.events (run_id, task_id, event, detail)
SELECT $1, id, 'key_waits', detail FROM held
"""

_LET_GO = """
WITH freed AS (
    UPDATE orchestra.tasks AS t SET waiting = t.waiting - 1
    FROM unnest($2::text[], $3::text[]) AS h (id, detail)
    WHERE t.run_id = $1 AND t.id = h.id AND t.state = 'pending'
    RETURNING t.id, t.waiting, h.detail
), journal AS (
    INSERT INTO orchestra.events (run_id, task_id, event, detail)
    SELECT $1, id, 'key_taken', detail FROM freed
)
SELECT id FROM freed WHERE waiting = 0
"""

_REUSE = """
WITH reused AS (
    UPDATE orchestra.tasks AS t
    SET state = 'succeeded', output = u.output::json, agent = u.agent, finished = now()
    FROM unnest($2::text[], $3::text[], $4::text[], $5::text[]) AS u (id, output, agent, detail)
    WHERE t.run_id = $1 AND t.id = u.id AND t.state IN ('pending', 'ready')
    RETURNING t.id, u.detail
), journal AS (
    INSERT INTO orchestra.events (run_id, task_id, event, detail)
    SELECT $1, id, 'key_reused', detail FROM reused
)
SELECT id FROM reused
"""


async def admit_keys(
    conn: asyncpg.Connection,
    run_id: str,
    wanted: Sequence[tuple[str, str]],
    *,
    owner: str,
    lease: float,
) -> dict[str, Answer]:
    """Claim the keys of tasks of `run_id` just admitted, `wanted` as (key, task id), for `owner`
    (the run's coordinator), and act on each answer: `Mine`, the task goes on as admitted (it
    holds the key: its end will be the key's); `Stored`, it ends now, succeeded with the stored
    output and agent, unexecuted (settled: what waits for it is readied); `Held`, it is held
    back (not ready, so no process claims it) until `ask_again` gives it the key or its result.

    Call it in the transaction that admits the tasks (`_graph.admit` runs in the caller's
    transaction), so that no process claims a keyed task before its key is decided; pass only
    the tasks that hold their key in the run (not the ones following another task of the run).
    Tasks already ended (skipped at admission) claim nothing and get no answer. Returns the
    answers by task id; wait for the `Held` ones (`Waiting`)."""
    return await _decide(conn, run_id, wanted, owner, lease, again=False)


async def ask_again(
    conn: asyncpg.Connection,
    run_id: str,
    wanted: Sequence[tuple[str, str]],
    *,
    owner: str,
    lease: float,
) -> dict[str, Answer]:
    """Claim again the keys of tasks of `run_id` held back for them (`admit_keys`), `wanted` as
    (key, task id): the keys `Waiting.due` gives. `Mine` (the holder failed, or its lease ran
    out), the task is let go: ready once it waits for nothing else; `Stored`, it ends with the
    result, unexecuted; `Held`, it stays held back (wait again). A task no longer held back (it
    ended meanwhile: skipped, cancelled) is passed over and gets no answer."""
    return await _decide(conn, run_id, wanted, owner, lease, again=True)


async def held_back(
    conn: asyncpg.Connection, run_id: str, task_ids: Sequence[str] | None = None
) -> list[tuple[str, str]]:
    """The tasks of `run_id` held back for their keys, as (key, task id): what a coordinator that
    takes the run over waits for (`ask_again` them at once). `task_ids`: only among these."""
    rows = await conn.fetch(_HELD_BACK, run_id, None if task_ids is None else list(task_ids))
    return [(row[1], row[0]) for row in rows]


async def _decide(
    conn: asyncpg.Connection,
    run_id: str,
    wanted: Sequence[tuple[str, str]],
    owner: str,
    lease: float,
    *,
    again: bool,
) -> dict[str, Answer]:
    if not wanted:
        return {}
    key_of = {task_id: key for key, task_id in wanted}

    async def step(conn: asyncpg.Connection) -> dict[str, Answer]:
        # The tasks' rows first (a completion locks a task's row before its key's), so that
        # none ends or is claimed while its key is decided.
        rows = await conn.fetch(_LOCK_TASKS, run_id, sorted(key_of))
        live = [row[0] for row in rows if row[1] in ("pending", "ready")]
        if again:
            held = {task_id for _, task_id in await held_back(conn, run_id, live)}
            live = [task_id for task_id in live if task_id in held]
        asked = [(key_of[task_id], task_id) for task_id in live]
        answers = dict(
            zip(live, await claim(conn, run_id, asked, owner=owner, lease=lease), strict=True)
        )
        hold: list[tuple[str, str]] = []
        let_go: list[tuple[str, str]] = []
        reuse: list[tuple[str, str, str | None, str]] = []
        for task_id, answer in answers.items():
            key = key_of[task_id]
            if isinstance(answer, Stored):
                why = f"key {key!r} succeeded before"
                reuse.append((task_id, answer.output, answer.agent, why))
            elif isinstance(answer, Held) and not again:
                why = f"key {key!r} is held by task {answer.task_id!r} of run {answer.run_id!r}"
                hold.append((task_id, f"{why} ({answer.owner})"))
            elif isinstance(answer, Mine) and again:
                let_go.append((task_id, f"key {key!r} taken (token {answer.token})"))
        if hold:
            await conn.execute(_HOLD, run_id, *columns(hold, 2))
        if let_go:
            freed = [row[0] for row in await conn.fetch(_LET_GO, run_id, *columns(let_go, 2))]
            await make_ready(conn, run_id, freed)
        if reuse:
            ended = [row[0] for row in await conn.fetch(_REUSE, run_id, *columns(reuse, 4))]
            await settle(conn, run_id, [(task_id, SUCCEEDED) for task_id in ended])
        return answers

    return await transaction(conn, step)


# -- spawned tasks: their keys decided in the completion that admits them -----------------------

# The keys the spawns just admitted hold in their run (the first task of the run with a key, or
# one that took it over there): the others follow a task of the run, and claim nothing.
_HOLDING = """
SELECT k.key, k.holder
FROM orchestra.tasks AS t
JOIN orchestra.run_keys AS k ON k.run_id = t.run_id AND k.key = t.key AND k.holder = t.id
WHERE t.run_id = $1 AND t.id = ANY ($2::text[]) AND t.key IS NOT NULL
ORDER BY k.key
"""

# Whose the run's holds are: its coordinator's. The run's row is read under a share lock: a
# coordinator taking the run over (which writes that row, then adopts the run's holds) comes
# wholly before this completion or after it, and so adopts the holds it makes.
_RUN_OWNER = "SELECT owner FROM orchestra.runs WHERE id = $1 FOR SHARE"

# Every existing key row the rest of the completion writes, locked at once in key order (see
# `_LOCK_OWNED`): the spawns' keys (`_CLAIM` locks them, taken or not) and the run's holds of the
# tasks it ended (`finish_tasks`). Two completions of two runs, each spawning a key the other
# holds while ending its own, would otherwise lock the two rows in opposite orders.
_LOCK_SPAWNED = """
SELECT k.key FROM orchestra.keys AS k
WHERE k.key = ANY ($2::text[]) OR (k.run_id = $1 AND k.state = 'claimed' AND k.key IN (
    SELECT t.key FROM orchestra.tasks AS t
    WHERE t.run_id = $1 AND t.id = ANY ($3::text[]) AND t.key IS NOT NULL))
ORDER BY k.key
FOR UPDATE OF k
"""


async def admit_spawned(
    conn: asyncpg.Connection,
    run_id: str,
    spawned: Sequence[str],
    ended: Sequence[str],
    *,
    owner: str,
    lease: float,
) -> None:
    """Decide the keys of tasks of `run_id` just admitted as an attempt's spawns (`spawned`, their
    ids), as `admit_keys` decides the input's: a spawn that holds its key in the run claims it
    across runs and goes on as admitted (`Mine`), ends at once with a stored success (`Stored`:
    unexecuted, its dependents readied), or is held back while another run holds it (`Held`:
    the run's coordinator waits for it, `spawn_answers`). The holds are the run's coordinator's,
    under `lease` seconds (it renews them with the run's), or `owner`'s (the process completing
    the spawner) when no coordinator holds the run. `ended`: the tasks the same transaction ended
    (their keys are written next, `finish_tasks`).

    Call it in the transaction that admitted them, once their spawner's end is settled (a spawn
    that end skipped claims nothing)."""
    if not spawned:
        return
    wanted = [(row[0], row[1]) for row in await conn.fetch(_HOLDING, run_id, list(spawned))]
    if not wanted:
        return
    holder = await conn.fetchval(_RUN_OWNER, run_id)
    await conn.execute(_LOCK_SPAWNED, run_id, [key for key, _ in wanted], list(ended))
    await _decide(conn, run_id, wanted, holder or owner, lease, again=False)


# What the database decided for the keys of tasks some ends spawned: the last key event of each
# (`_HOLD`, `_LET_GO`, `_REUSE` journal it), with the task's result and its key's holder.
_SPAWN_ANSWERS = """
SELECT t.id, t.state, coalesce(t.output::text, 'null'), t.agent, last.event, k.state, k.owner,
    k.run_id, k.task_id, greatest(extract(epoch FROM k.expires - now()), 0)::float8
FROM orchestra.tasks AS t
CROSS JOIN LATERAL (
    SELECT e.event FROM orchestra.events AS e
    WHERE e.run_id = $1 AND e.task_id = t.id
        AND e.event IN ('key_waits', 'key_taken', 'key_reused')
    ORDER BY e.seq DESC
    LIMIT 1
) AS last
LEFT JOIN orchestra.keys AS k ON k.key = t.key
WHERE t.run_id = $1 AND t.parent = ANY ($2::text[]) AND t.key IS NOT NULL
"""


async def spawn_answers(
    conn: asyncpg.Connection, run_id: str, parents: Sequence[str]
) -> dict[str, Answer]:
    """What the completions of `parents` (tasks of `run_id`) decided for the keys of the tasks
    their attempts spawned (`admit_spawned`), by task id, for the run's coordinator: `Stored`,
    the task ended with the key's stored success, unexecuted; `Held`, it is held back while
    another run holds the key (its `left` 0 when that run is done with the key already, or its
    hold lapsed: ask again at once, its announcement may have come before the wait). A spawn
    that holds its key, or follows a task of its run, or ended otherwise since, gets no answer."""
    answers: dict[str, Answer] = {}
    if not parents:
        return answers
    for row in await conn.fetch(_SPAWN_ANSWERS, run_id, list(parents)):
        task_id, state, output, agent, event, key_state, owner, held_run, held_task, left = row
        if event == "key_reused" and state == SUCCEEDED:
            answers[task_id] = Stored(output, agent)
        elif event == "key_waits" and state == "pending":
            if key_state != "claimed" or held_run == run_id:
                left = 0.0
            answers[task_id] = Held(owner or "", held_run or "", held_task or "", left or 0.0)
    return answers
