"""The coordinator's jobs on PostgreSQL: what its run (`_run.py`) asks of the database, each run in
the store's thread on a pooled connection (`_database.py`).

- `take_over` / `open_run`: wait as a standby until the run is free, take it, read what an earlier
  coordinator left of it (its tasks taken back, its keys adopted);
- `apply`: the run's writes, in order: the coordinator's own (input, decided ends, priorities, the
  input's close) fenced by its lease on the run, its tasks' ends and failed attempts fenced by
  their leases (with what the database decided for the keys of their spawns);
- `claim_step`: the ends other processes wrote heard, lapsed leases swept, tasks claimed;
- `ask_again`: the keys another run held, asked for again;
- `close_run`: what the run still holds handed back, the run closed and given up.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import asyncpg

from ..._log import get_logger
from . import _coordinator as coordinator
from . import _follow as follow
from . import _keyed as keyed
from . import _keys as keys
from . import _leases as leases
from ._graph import admit_in
from ._listen import notify
from ._rows import load, load_unfinished
from ._sessions import cut_off
from ._settle import RETRIES, close_input

if TYPE_CHECKING:
    import datetime
    from collections.abc import Awaitable, Callable

    from ..._admission import Admission
    from ._planner import Growth
    from ._store import PostgresStore

__all__ = (
    "Applied",
    "again_on_deadlock",
    "apply",
    "ask_again",
    "claim_step",
    "close_run",
    "coordinator_name",
    "open_run",
    "take_over",
)

_T = TypeVar("_T")

log = get_logger("orchestra")


def coordinator_name(store: PostgresStore) -> str:
    """This process's name as the database knows it (``host:pid:store id``): the holder of its
    runs' leases and of its tasks' leases."""
    return f"{socket.gethostname()}:{os.getpid()}:{store.owner}"


async def take_over(
    conn: asyncpg.Connection, run_id: str, owner: str, lease: float, poll: float
) -> None:
    """Wait, as a standby, until `run_id` is free for `owner`, and take it (`PostgresStore.
    prepare_run`)."""
    host = socket.gethostname()
    said = False
    while True:
        held = await coordinator.holder(conn, run_id)
        if held is None or held.owner is None or held.owner == owner or held.remaining <= 0:
            break
        name, _, rest = held.owner.partition(":")
        pid = rest.partition(":")[0]
        if name == host and pid.isdigit() and not _alive(int(pid)):
            # Its process is gone (this host can tell): its lease is let go of now.
            await conn.execute(
                "UPDATE orchestra.runs SET expires = now() - interval '1 second' "
                "WHERE id = $1 AND owner = $2",
                run_id, held.owner,
            )  # fmt: skip
            break
        if not said:
            log.info(
                "waiting for the run's coordinator to let go (a standby)",
                run_id=run_id, holder=held.owner, remaining=round(held.remaining, 1),
            )  # fmt: skip
            said = True
        await asyncio.sleep(min(poll, held.remaining) + 0.005)
    await coordinator.take_over(conn, run_id, owner=owner, lease=lease, poll=poll)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


async def open_run(
    conn: asyncpg.Connection, run_id: str, owner: str, lease: float, streamed: bool = False
) -> tuple[
    coordinator.Lease | coordinator.Holder,
    list[Any],
    list[Any],
    list[tuple[str, str]],
    datetime.datetime | None,
]:
    """Take the run (made when new) and read what an earlier coordinator left of it; the tasks
    that coordinator held are taken back at once (their attempts counted), its process gone.
    A `streamed` run whose tasks stand alone reads its unfinished tasks only (`load_unfinished`),
    the ended ones later, as its input comes again: the last value is then the database's time
    as it read them (None: every row is read)."""
    taken = await coordinator.acquire(conn, run_id, owner=owner, lease=lease)
    if taken is None:
        holder = await coordinator.holder(conn, run_id)
        assert holder is not None  # acquire makes the run
        return holder, [], [], [], None
    await conn.execute("UPDATE orchestra.runs SET state = 'open' WHERE id = $1", run_id)
    # The earlier coordinators of the run (the journal names each) are gone or fenced off: what
    # they held is taken back now, not when its lease would lapse; and a stopped one's session
    # stalled mid-statement would hold those rows for as long as it is stopped (`_sessions`).
    found = await conn.fetch(
        "SELECT DISTINCT agent FROM orchestra.events "
        "WHERE run_id = $1 AND event = 'coordinator' AND agent <> $2",
        run_id, owner,
    )  # fmt: skip
    before = [row[0] for row in found]
    await cut_off(conn, before, lease / 3)
    expired = await conn.fetchval(
        "UPDATE orchestra.tasks SET lease_expires = now() - interval '1 second' "
        "WHERE run_id = $1 AND lease_owner = ANY ($2::text[]) RETURNING 1",
        run_id, before,
    )  # fmt: skip
    if expired:
        await leases.take_back_expired(conn, run_id)
    # A run new or empty has no row: nothing to read ahead.
    exists = await conn.fetchval(
        "SELECT EXISTS (SELECT 1 FROM orchestra.tasks WHERE run_id = $1)", run_id
    )
    alone = await load_unfinished(conn, run_id) if streamed and exists else None
    rows, attempts = alone[:2] if alone is not None else await load(conn, run_id)
    held: list[tuple[str, str]] = []
    if rows and alone is None:
        # The run's holds of keys are this coordinator's now; what waited, waits again (a run
        # read ahead holds no key).
        await keys.adopt(conn, run_id, owner=owner, lease=lease)
        held = await keyed.held_back(conn, run_id)
    return taken, rows, attempts, held, None if alone is None else alone[2]


async def claim_step(
    conn: asyncpg.Connection,
    run_id: str,
    rooms: dict[str, int],
    owner: str,
    lease: float,
    limit: int | None,
    sweep: bool = False,
) -> tuple[follow.Heard, list[leases.Claimed]]:
    if sweep:
        # Leases that lapsed (a worker gone; a claim whose answer a lost connection dropped):
        # taken back here too, so that a run with no live worker left never waits for them.
        await leases.take_back_expired(conn, run_id)
    heard = await follow.heard(conn, run_id)
    claimed: list[leases.Claimed] = []
    if any(room > 0 for room in rooms.values()):
        claimed = await leases.claim(conn, run_id, rooms, owner=owner, lease=lease, limit=limit)
    return heard, claimed


class Applied(NamedTuple):
    """What the database made of the run's writes: the ends it refused (a lease lost), and its
    answers for the keys of the tasks admitted (by task id)."""

    refused: list[str]
    answers: dict[str, keys.Answer]


async def ask_again(
    conn: asyncpg.Connection,
    run_id: str,
    lease: coordinator.Lease,
    wanted: list[tuple[str, str]],
) -> dict[str, keys.Answer]:
    async def write() -> dict[str, keys.Answer]:
        async with coordinator.fenced(conn, lease):
            return await keyed.ask_again(conn, run_id, wanted, owner=lease.owner, lease=lease.lease)

    return await again_on_deadlock(write)


async def again_on_deadlock(write: Callable[[], Awaitable[_T]]) -> _T:
    """`write` (a fenced transaction of the coordinator's), run again when PostgreSQL aborted it
    to break a deadlock, as `_settle.transaction` runs any other: a settle cascade locks rows of
    a run in an order an admission or the input's close may meet the other way round (the lock
    order in `_settle`). The aborted one left nothing."""
    for attempt in range(RETRIES):
        try:
            return await write()
        except asyncpg.DeadlockDetectedError:
            if attempt == RETRIES - 1:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


async def apply(
    conn: asyncpg.Connection,
    run_id: str,
    lease: coordinator.Lease,
    admission: Admission,
    growth: Growth,
    ops: list[tuple[str, Any]],
) -> Applied:
    """Tell the database what the run did, in order: the coordinator's own writes (input,
    decided ends, priorities, the input's close) fenced by its lease on the run, its tasks' ends
    and failed attempts fenced by their leases. Returns the ids whose end was refused. Input
    admitted counts towards `growth` (the planner's statistics measured again when due)."""
    refused: list[str] = []
    admitted = 0
    answers: dict[str, keys.Answer] = {}
    i = 0
    while i < len(ops):
        kind = ops[i][0]
        j = i
        while (
            j < len(ops)
            and (ops[j][0] in _FENCED) == (kind in _FENCED)
            and (kind in _FENCED or ops[j][0] == kind)
        ):
            j += 1
        group = ops[i:j]
        if kind in _FENCED:

            async def write(group: list[tuple[str, Any]] = group) -> None:
                found: dict[str, keys.Answer] = {}  # kept once committed
                async with coordinator.fenced(conn, lease):
                    readied = False
                    for what, op in merged(group):
                        readied = (
                            await fenced_op(conn, run_id, lease, admission, what, op, found)
                            or readied
                        )
                    if readied:
                        await notify(conn, run_id)
                answers.update(found)

            await again_on_deadlock(write)
            admitted += sum(len(op[0]) for what, op in group if what == "admit")
        elif kind == "end":
            ends = [op[0] for _, op in group]
            spawned = {op[0].id: op[1] for _, op in group if op[1]}
            failures = {op[0].id: op[2] for _, op in group if op[2]}
            done = await leases.complete(
                conn, run_id, lease.owner, ends, spawned=spawned, admission=admission,
                failures=failures, key_lease=lease.lease,
            )  # fmt: skip
            refused.extend(end.id for end, ok in zip(ends, done, strict=True) if not ok)
            # What the completions decided for their spawns' keys (read after their commit:
            # only this coordinator asks for a held-back spawn's key again, once it knows).
            spawners = [
                end.id for end, ok in zip(ends, done, strict=True)
                if ok and any(t.key is not None for t in spawned.get(end.id, ()))
            ]  # fmt: skip
            if spawners:
                answers.update(await keyed.spawn_answers(conn, run_id, spawners))
        elif kind == "note":
            await leases.note(conn, run_id, lease.owner, [op for _, op in group])
        else:  # "requeue"
            if await leases.requeue(conn, lease.owner, [op for _, op in group]):
                await notify(conn, run_id)
        i = j
    if admitted:
        await growth.admit(conn, admitted)
    return Applied(refused, answers)


_FENCED = frozenset(("admit", "decide", "priority", "close_input"))


def merged(group: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Consecutive items of a streamed input (each its own op) as one batch."""
    merged: list[tuple[str, Any]] = []
    for what, op in group:
        if what == "admit" and merged and merged[-1][0] == "admit":
            tasks, where, forward, first, wanted, generated = merged[-1][1]
            more, where2, forward2, first2, wanted2, generated2 = op
            if (where, forward, where2, forward2) == (
                "input item",
                False,
                "input item",
                False,
            ) and (first2 == first + len(tasks)):
                merged[-1] = (
                    "admit",
                    (tasks + more, where, forward, first, wanted + wanted2, generated | generated2),
                )
                continue
        if what == "decide" and merged and merged[-1][0] == "decide":
            merged[-1] = ("decide", [*merged[-1][1], op])
            continue
        merged.append((what, [op] if what == "decide" else op))
    return merged


async def fenced_op(
    conn: asyncpg.Connection,
    run_id: str,
    lease: coordinator.Lease,
    admission: Admission,
    what: str,
    op: Any,
    answers: dict[str, keys.Answer],
) -> bool:
    """One of the coordinator's own writes; True when it may have made tasks ready."""
    if what == "admit":
        tasks, where, forward, first, wanted, generated = op
        _, ready, _ = await admit_in(
            conn, run_id, tasks, admission, where, forward, first, None, generated
        )
        if wanted:  # in the admission's transaction: no keyed task is claimed before its key
            answers.update(
                await keyed.admit_keys(conn, run_id, wanted, owner=lease.owner, lease=lease.lease)
            )
        return bool(ready)
    if what == "decide":
        ended, skipped = await follow.decide(conn, run_id, op)
        await keys.finish_tasks(conn, run_id, ended + skipped)
        return False
    if what == "priority":
        task_id, priority = op
        await conn.execute(
            "UPDATE orchestra.tasks SET priority = $3 WHERE run_id = $1 AND id = $2 "
            "AND state IN ('pending', 'ready', 'retry_wait')",
            run_id, task_id, priority,
        )  # fmt: skip
        return False
    await close_input(conn, run_id)  # "close_input": notifies what it readies
    return False


# The run let go of in one statement (one round trip, one commit, at the end of every run): the
# claims of this process whose answer the run's end left unread handed back, then the run
# closed (when every task ended) and given up, both fenced by the lease's token as
# `_coordinator.fenced` and `hand_over` fence them.
_CLOSE = """
WITH unread AS (
    UPDATE orchestra.tasks SET state = 'ready', attempts = attempts - 1, lease_owner = NULL,
        lease_expires = NULL
    WHERE run_id = $1 AND lease_owner = $2 AND state = 'claimed'
)
UPDATE orchestra.runs
SET state = CASE WHEN $4 THEN 'closed' ELSE state END, owner = NULL, expires = NULL,
    updated = now()
WHERE id = $1 AND owner = $2 AND token = $3
RETURNING true
"""


async def close_run(
    conn: asyncpg.Connection,
    lease: coordinator.Lease,
    held: list[tuple[str, str, int]],
    done: bool,
    keyed: bool,
) -> None:
    """Hand back the tasks still held, unstarted (no attempt counted) — and any other claim of
    this process on the run (one whose answer the run's end left unread) — and, unless every task
    ended, the keys the run holds (another run waiting for one takes it over); mark the run
    closed when all its tasks ended, and give the run up (a standby or the next coordinator takes
    it now)."""
    await leases.release(conn, lease.owner, held)
    if keyed and not done:
        await keys.release_run(conn, lease.run_id, lease.owner)
    let_go = await conn.fetchval(_CLOSE, lease.run_id, lease.owner, lease.token, done)
    if not let_go and done:
        # Taken over meanwhile: the run is not this process's to close. The fence journals the
        # refusal (and raises, as it does for any write of a coordinator fenced off).
        with contextlib.suppress(coordinator.LeaseLost):
            async with coordinator.fenced(conn, lease):
                pass  # pragma: no cover - the fence refuses before the block
