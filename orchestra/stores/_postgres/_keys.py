"""Idempotency keys on PostgreSQL: claimed, renewed, finished and waited for across runs and
processes, as functions over one asyncpg connection.

The meanings are the SQLite store's (`orchestra.stores._sqlite._keys`): a key is a row of
``orchestra.keys``; the first submitter claims it and runs its task, whose end is written into the
row; the others wait for that end and reuse a success (the task ends with the stored output,
without executing), or take the key over from a task that did not succeed. Here a hold is a lease,
as a task's is (`_leases.py`): the holder's name (``owner``), a fencing token from the sequence
``lease_tokens`` and an expiry on the database's clock.

- **Claim** (`claim`): many keys at once, each answered for its task: `Mine` (a fresh token: run
  the task), `Stored` (it succeeded before: its output and agent) or `Held` (a live task of
  another run holds it: whose, and how long its lease has left). A hold is its run's: within a
  run the tasks that share a key are one piece of work (the run's graph makes them follow the
  one that holds it). A key is taken over (`Mine`) when its task failed, when its lease expired
  (the holder's process died or stopped renewing), or when the claimer's run holds it already (a
  resumed run, a standby coordinator: the older token is fenced off; `adopt` takes all of a
  run's holds at once). One ``INSERT ... ON CONFLICT DO UPDATE`` decides each key atomically
  against concurrent claimers, and locks the rows it did not take, so the answer read next in
  the same transaction is the state those rows keep until it commits.
- **Renew** (`renew`): the holder extends the leases it still holds (owner and token match);
  `renew_run`, all of a run's holds that are still its coordinator's.
- **Finish**: a keyed task's end is written into its key's row in the transaction that ends the
  task, while the task's run holds the key (`finish_tasks`, which `_leases.complete` calls: a
  success with its output; anything else failed, for the next submitter to take over, once no
  task of the run with that key is left to run it); the holder may also end a hold itself
  (`finish`: a task its run ended without a completion, a hold it lets go of), fenced by owner
  and token; a run stopped unfinished lets go of its holds (`release_run`).
- **Waiting**: every finish sends a NOTIFY on `KEY_CHANNEL` (its payload: `signal_of` the key),
  delivered when its transaction commits; a waiter (`Waiting`) asks again when it hears its key,
  or once the holder's lease runs out, whichever comes first.
- **A run's keyed tasks** (held back while another task holds their key, decided with their
  admission): `_keyed.py`.

No time comes from the caller: leases and their expiry are the database's ``now()``; a `Held`
says how many seconds its lease has left, so a waiter on a machine whose clock is off waits the
right time.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from typing import TYPE_CHECKING, Any, Final, NamedTuple, TypeAlias

from ._settle import columns, transaction

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    import asyncpg

__all__ = (
    "KEY_CHANNEL",
    "RECENT",
    "Answer",
    "Held",
    "KeyEnd",
    "Mine",
    "Stored",
    "Waiting",
    "adopt",
    "claim",
    "finish",
    "finish_tasks",
    "release_run",
    "renew",
    "renew_run",
    "signal_of",
)

KEY_CHANNEL: Final = "orchestra.keys"
"""The channel a key's finish is announced on (its payload: `signal_of` the key). Not of the form
``orchestra:<run id>`` (`_listen.channel_of`), so no run's channel can be it."""

_MAX_SIGNAL: Final = 200  # bytes of a key sent as itself; longer ones as a digest (NOTIFY < 8000)


def signal_of(key: str) -> str:
    """The payload of `key`'s notifications on `KEY_CHANNEL`: the key itself, or, for a key longer
    than 200 bytes, ``#`` and the hex SHA-256 of it (the same as the SQL of `_SIGNAL` makes)."""
    data = key.encode()
    if len(data) <= _MAX_SIGNAL:
        return key
    return "#" + hashlib.sha256(data).hexdigest()


# `signal_of` in SQL, of a column or parameter named `key`.
_SIGNAL = f"""CASE WHEN octet_length(key) <= {_MAX_SIGNAL} THEN key
    ELSE '#' || encode(sha256(convert_to(key, 'UTF8')), 'hex') END"""


class Mine(NamedTuple):
    """The key is the caller's now (its run's hold): run the task. `token` fences the hold
    (`renew`, `finish`)."""

    token: int


class Stored(NamedTuple):
    """The key succeeded before: end the task with this result, without executing it. `output` is
    JSON text (``null`` for a None output)."""

    output: str
    agent: str | None


class Held(NamedTuple):
    """A live task of another run holds the key: `owner`'s, task `task_id` of run `run_id`, its
    lease running out in `left` seconds (the database's clock). Wait for its finish, then ask
    again."""

    owner: str
    run_id: str
    task_id: str
    left: float


Answer: TypeAlias = Mine | Stored | Held
"""What `claim` answers for one key."""


# Each key taken by its claimer (inserted, or taken over) in key order (concurrent claimers of
# several keys lock them in one order); the rows not taken are locked all the same (DO UPDATE
# locks the conflicting row whether its WHERE holds or not), so `_READ` sees them as they stay.
_CLAIM = """
INSERT INTO orchestra.keys AS k (key, owner, token, expires, run_id, task_id, state)
SELECT w.key, $2, nextval('orchestra.lease_tokens'), now() + make_interval(secs => $3), $1,
    w.task_id, 'claimed'
FROM unnest($4::text[], $5::text[]) AS w (key, task_id)
ORDER BY w.key
ON CONFLICT (key) DO UPDATE
SET owner = excluded.owner, token = excluded.token, expires = excluded.expires,
    run_id = excluded.run_id, task_id = excluded.task_id, state = 'claimed', output = NULL,
    agent = NULL, error = NULL
WHERE k.state = 'failed'
    OR (k.state = 'claimed' AND (k.expires < now() OR k.run_id = excluded.run_id))
RETURNING k.key, k.token
"""

_READ = """
SELECT key, state, coalesce(output::text, 'null'), agent, owner, run_id, task_id,
    greatest(extract(epoch FROM expires - now()), 0)::float8
FROM orchestra.keys WHERE key = ANY ($1::text[])
"""


async def claim(
    conn: asyncpg.Connection,
    run_id: str,
    wanted: Sequence[tuple[str, str]],
    *,
    owner: str,
    lease: float,
) -> list[Answer]:
    """Claim each key of `wanted`, (key, task id) pairs of `run_id`, for `owner` under a lease of
    `lease` seconds on the database's clock, in one transaction. Returns an answer per pair, in
    their order: `Mine`, `Stored` or `Held`. Tasks of the run wanting one key get one answer (the
    hold is the run's; the row names the first of them)."""
    if not wanted:
        return []
    first = dict(reversed(wanted))  # key -> the first task that wants it
    keys, task_ids = list(first), list(first.values())

    async def step(conn: asyncpg.Connection) -> dict[str, Answer]:
        taken: dict[str, Answer] = {
            key: Mine(token)
            for key, token in await conn.fetch(_CLAIM, run_id, owner, float(lease), keys, task_ids)
        }
        rest = [key for key in keys if key not in taken]
        if rest:
            for key, state, output, agent, holder, held_run, held_task, left in await conn.fetch(
                _READ, rest
            ):
                # Locked by `_CLAIM` and not taken: a success, or a live hold of another task.
                if state == "succeeded":
                    taken[key] = Stored(output, agent)
                else:
                    taken[key] = Held(holder, held_run, held_task, left)
        return taken

    answers = await transaction(conn, step)
    return [answers[key] for key, _ in wanted]


# Every statement that changes several keys' rows locks them first in key order, as `_CLAIM`
# does: an update locks rows in whatever order its plan meets them, and two transactions locking
# the same rows in two orders deadlock (PostgreSQL aborts one of them). The update then writes
# only the rows locked (``key = ANY`` of them): its own snapshot is newer, and a row that came to
# match meanwhile (a claim of the run, or of the same owner on another connection, committed
# while the lock waited for a later key) would be locked there, out of order.
_LOCK_OWNED = """
SELECT key FROM orchestra.keys
WHERE owner = $1 AND key = ANY ($2::text[]) AND state = 'claimed'
ORDER BY key
FOR UPDATE
"""

_LOCK_RUN = """
SELECT key FROM orchestra.keys
WHERE run_id = $1 AND owner = $2 AND state = 'claimed'
ORDER BY key
FOR UPDATE
"""

_LOCK_RUN_ALL = """
SELECT key FROM orchestra.keys WHERE run_id = $1 AND state = 'claimed' ORDER BY key FOR UPDATE
"""

_ADOPT = """
UPDATE orchestra.keys
SET owner = $2, token = nextval('orchestra.lease_tokens'),
    expires = now() + make_interval(secs => $3)
WHERE run_id = $1 AND state = 'claimed' AND key = ANY ($4::text[])
RETURNING key, token
"""


async def adopt(
    conn: asyncpg.Connection, run_id: str, *, owner: str, lease: float
) -> dict[str, int]:
    """Take every hold of `run_id` for `owner` (a coordinator that took the run over), each under
    a fresh token and lease: the old coordinator's renewals and finishes are refused from now on.
    Returns the tokens by key."""

    async def step(conn: asyncpg.Connection) -> list[Any]:
        locked = [row[0] for row in await conn.fetch(_LOCK_RUN_ALL, run_id)]
        return await conn.fetch(_ADOPT, run_id, owner, float(lease), locked)

    return {row[0]: row[1] for row in await transaction(conn, step)}


_RENEW = """
UPDATE orchestra.keys AS k SET expires = now() + make_interval(secs => $4)
FROM unnest($2::text[], $3::bigint[]) AS h (key, token)
WHERE k.key = h.key AND k.token = h.token AND k.owner = $1 AND k.state = 'claimed'
    AND k.key = ANY ($5::text[])
RETURNING k.key
"""


async def renew(
    conn: asyncpg.Connection, owner: str, held: Sequence[tuple[str, int]], *, lease: float
) -> set[str]:
    """Extend the holds `owner` has, `held` as (key, token), to `lease` seconds from now (the
    database's clock). A hold whose lease expired but that nobody took over is still its holder's
    and is extended. Returns the keys it no longer holds (taken over, or finished)."""
    if not held:
        return set()
    keys, tokens = columns(held, 2)

    async def step(conn: asyncpg.Connection) -> list[Any]:
        locked = [row[0] for row in await conn.fetch(_LOCK_OWNED, owner, keys)]
        return await conn.fetch(_RENEW, owner, keys, tokens, float(lease), locked)

    rows = await transaction(conn, step)
    return set(keys) - {row[0] for row in rows}


_RENEW_RUN = """
UPDATE orchestra.keys SET expires = now() + make_interval(secs => $3)
WHERE run_id = $1 AND owner = $2 AND state = 'claimed' AND key = ANY ($4::text[])
"""


async def renew_run(conn: asyncpg.Connection, run_id: str, owner: str, *, lease: float) -> int:
    """Extend every hold of `run_id` that `owner` has (its coordinator's, with the run's own
    lease), to `lease` seconds from now: no tokens to keep. A hold another run took over, or
    that a coordinator taking the run over adopted (`adopt`), is no longer `owner`'s and stays
    as it is. Returns how many were extended."""

    async def step(conn: asyncpg.Connection) -> str:
        locked = [row[0] for row in await conn.fetch(_LOCK_RUN, run_id, owner)]
        status: str = await conn.execute(_RENEW_RUN, run_id, owner, float(lease), locked)
        return status

    return int((await transaction(conn, step)).rpartition(" ")[2])


class KeyEnd(NamedTuple):
    """How a hold ends, for `finish`: `succeeded` with its task's `output` (JSON text) and
    `agent`, or failed (`error` says why), for the next submitter to take over."""

    key: str
    token: int
    succeeded: bool
    output: str | None = None
    agent: str | None = None
    error: str | None = None


_FINISH = f"""
WITH done AS (
    UPDATE orchestra.keys AS k
    SET state = CASE WHEN e.ok THEN 'succeeded' ELSE 'failed' END,
        output = CASE WHEN e.ok THEN e.output::json END,
        agent = CASE WHEN e.ok THEN e.agent END,
        error = CASE WHEN e.ok THEN NULL ELSE e.error END
    FROM unnest($2::text[], $3::bigint[], $4::boolean[], $5::text[], $6::text[], $7::text[])
        AS e (key, token, ok, output, agent, error)
    WHERE k.key = e.key AND k.token = e.token AND k.owner = $1 AND k.state = 'claimed'
        AND k.key = ANY ($8::text[])
    RETURNING k.key
)
SELECT key, pg_notify('{KEY_CHANNEL}', {_SIGNAL}) FROM done
"""


async def finish(conn: asyncpg.Connection, owner: str, ends: Sequence[KeyEnd]) -> list[bool]:
    """End holds of `owner`, each only while it holds the key under the token it carries, and
    announce them on `KEY_CHANNEL` (when the caller's transaction commits, if it is in one).
    Returns, for each end, whether it was written."""
    if not ends:
        return []

    async def step(conn: asyncpg.Connection) -> list[Any]:
        locked = [row[0] for row in await conn.fetch(_LOCK_OWNED, owner, [e.key for e in ends])]
        return await conn.fetch(_FINISH, owner, *columns(ends, len(KeyEnd._fields)), locked)

    written = {row[0] for row in await transaction(conn, step)}
    return [end.key in written for end in ends]


# A run that stops with tasks unfinished lets go of its holds, but for the keys of tasks a worker
# runs (claimed or running): their completion ends the key.
_RELEASE_RUN = f"""
WITH done AS (
    UPDATE orchestra.keys AS k SET state = 'failed', error = $3
    WHERE k.run_id = $1 AND k.owner = $2 AND k.state = 'claimed' AND k.key = ANY ($4::text[])
        AND NOT EXISTS (
        SELECT FROM orchestra.tasks AS t
        WHERE t.run_id = $1 AND t.key = k.key AND t.state IN ('claimed', 'running'))
    RETURNING k.key
)
SELECT key, pg_notify('{KEY_CHANNEL}', {_SIGNAL}) FROM done
"""


async def release_run(conn: asyncpg.Connection, run_id: str, owner: str) -> list[str]:
    """`owner`, the coordinator of `run_id`, stops it with tasks unfinished (to be resumed): its
    holds are let go, as a failure would, so that a run waiting for one takes it at once instead
    of waiting out the lease (the resumed run claims it again, or reuses that run's result),
    except the keys of tasks a worker is running (their completion ends the key). Announced on
    `KEY_CHANNEL`. Returns the keys let go."""

    async def step(conn: asyncpg.Connection) -> list[Any]:
        locked = [row[0] for row in await conn.fetch(_LOCK_RUN, run_id, owner)]
        return await conn.fetch(
            _RELEASE_RUN, run_id, owner, "released: its run ended first", locked
        )

    return [row[0] for row in await transaction(conn, step)]


# The rows `_FINISH_TASKS` may write, locked first in key order (see `_LOCK_OWNED`): the run's
# holds only (a completion locks no other run's key, so none orders it against that run's rows).
# A claim of the run that commits while this waits is not written by this end (it came after).
_LOCK_KEYS = """
SELECT k.key FROM orchestra.keys AS k
WHERE k.run_id = $1 AND k.state = 'claimed' AND k.key IN (
    SELECT t.key FROM orchestra.tasks AS t
    WHERE t.run_id = $1 AND t.id = ANY ($2::text[]) AND t.key IS NOT NULL)
ORDER BY k.key
FOR UPDATE OF k
"""

# A task's end written into its key's row, while its run holds the key: a success at once; any
# other end only when no task of the run with that key is left to end it (the one that takes the
# key over in the run runs it). One end per key: a success first.
_FINISH_TASKS = f"""
WITH ended AS (
    SELECT DISTINCT ON (t.key) t.key, t.state, t.output, t.agent, t.error
    FROM orchestra.tasks AS t
    WHERE t.run_id = $1 AND t.id = ANY ($2::text[]) AND t.key IS NOT NULL
        AND t.state IN ('succeeded', 'failed', 'cancelled', 'skipped')
    ORDER BY t.key, t.state = 'succeeded' DESC, t.id
), done AS (
    UPDATE orchestra.keys AS k
    SET state = CASE WHEN e.state = 'succeeded' THEN 'succeeded' ELSE 'failed' END,
        output = CASE WHEN e.state = 'succeeded' THEN coalesce(e.output, 'null'::json) END,
        agent = CASE WHEN e.state = 'succeeded' THEN e.agent END,
        error = CASE WHEN e.state = 'succeeded' THEN NULL
            ELSE e.state || coalesce(': ' || e.error, '') END
    FROM ended AS e
    WHERE k.key = e.key AND k.run_id = $1 AND k.state = 'claimed' AND k.key = ANY ($3::text[])
        AND (e.state = 'succeeded' OR NOT EXISTS (
            SELECT FROM orchestra.tasks AS o
            WHERE o.run_id = $1 AND o.key = e.key
                AND o.state NOT IN ('succeeded', 'failed', 'cancelled', 'skipped')))
    RETURNING k.key
)
SELECT key, pg_notify('{KEY_CHANNEL}', {_SIGNAL}) FROM done
"""


async def finish_tasks(conn: asyncpg.Connection, run_id: str, task_ids: Iterable[str]) -> list[str]:
    """Write the ends of tasks of `run_id` that this transaction has just ended into their keys'
    rows, and announce them on `KEY_CHANNEL`: a success with its output and agent; any other end
    as failed (for the next submitter to take over) once no task of the run with that key is
    left unended (one that took the key over in the run will end it). Tasks without a key, or not
    ended, are passed over. Call it in the transaction that ended them, after their rows were
    written (`_leases.complete` does). Returns the keys written.

    A key is written only while its run holds it (the row is claimed by the run): a key taken
    over by another run (its lease expired) is that run's now. The fence is the task's own: its
    end was written only under its lease, in this transaction, and the key's row is locked here.
    A hold's token is not asked for: the process that completes a task (a worker) is not the one
    that claimed its key (the run's coordinator), a hold taken again by the run (a standby
    coordinator resuming it) is still the one this end belongs to, and within a run the tasks
    that share a key are one piece of work (the others follow the one that holds it, and one of
    them takes it over if it does not succeed)."""
    ids = list(task_ids)
    if not ids:
        return []
    locked = [row[0] for row in await conn.fetch(_LOCK_KEYS, run_id, ids)]
    return [row[0] for row in await conn.fetch(_FINISH_TASKS, run_id, ids, locked)]


RECENT: Final = 5.0
"""Seconds a `Waiting` remembers an announcement of a key nobody waited for: far longer than an
answer takes to come back from the database and be waited for (a round trip, a turn of a
loop), short enough that what it remembers stays small."""


class Waiting:
    """The keys a run waits for while other tasks hold them, and when to ask for each again: as
    soon as its finish is heard on `KEY_CHANNEL` (`heard`, a `_listen.Listener`'s callback), else
    once its holder's lease has run out (`Held.left`: a holder that died is taken over then).
    Times are the caller's clock (any monotonic one): only durations come from the database.

    A finish may be announced between the database's answer and the `wait` for it (the answer
    crosses threads and loops; the announcement another connection): an announcement no key
    waited for, heard with its time, is remembered for `RECENT` seconds, and a key waited for
    after its announcement is due at once (asked again, it is answered as it is now)."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}  # key -> when to ask again at the latest
        self._by_signal: dict[str, set[str]] = {}  # payload -> the keys it announces
        self._heard: set[str] = set()
        # Announcements no key waited for: payload -> when heard, the oldest first.
        self._recent: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._until)

    def __contains__(self, key: object) -> bool:
        return key in self._until

    def wait(self, key: str, held: Held, now: float) -> None:
        """Wait for `key`, which `claim` answered `held` at `now`: due at once if its finish was
        announced in the last `RECENT` seconds, unheard (the answer may be older than that)."""
        self._until[key] = now + held.left
        signal = signal_of(key)
        self._by_signal.setdefault(signal, set()).add(key)
        announced = self._recent.pop(signal, None)
        if announced is not None and announced > now - RECENT:
            self._heard.add(key)
        else:
            self._heard.discard(key)

    def heard(self, _channel: str, payload: str, now: float | None = None) -> bool:
        """A finish was announced (`payload`: `signal_of` its key), heard at `now` (if given, an
        announcement no key waits for is remembered: `wait`). True when a key waited for is due
        now (another key with the same digest may be woken too: it asks, and waits on)."""
        keys = self._by_signal.get(payload)
        if not keys:
            if now is not None:
                self._remember(payload, now)
            return False
        self._heard.update(keys)
        return True

    def _remember(self, payload: str, now: float) -> None:
        recent = self._recent
        recent.pop(payload, None)  # (to the end: the newest)
        recent[payload] = now
        for old, at in list(itertools.islice(recent.items(), 2)):
            if at > now - RECENT:
                break
            del recent[old]  # two at most per call: the oldest go as fast as others come

    def hear_all(self) -> None:
        """Every key waited for is due (a listener that listens again after a lost connection:
        what was announced meanwhile is lost, so ask for them all; its ``on_reconnect``)."""
        self._heard.update(self._until)

    def forget(self, key: str) -> None:
        """Stop waiting for `key` (its task ended otherwise)."""
        if self._until.pop(key, None) is not None:
            signal = signal_of(key)
            keys = self._by_signal[signal]
            keys.discard(key)
            if not keys:
                del self._by_signal[signal]
        self._heard.discard(key)

    def due(self, now: float) -> list[str]:
        """The keys to ask for again now (heard finished, or their holder's lease ran out),
        no longer waited for: `claim` them, and `wait` again for the ones still `Held`."""
        keys = [key for key, until in self._until.items() if key in self._heard or until <= now]
        for key in keys:
            self.forget(key)
        return keys

    def next_look(self) -> float:
        """When the first lease waited for runs out (``inf`` when none is): the latest time to
        look again without a notification (a lost one, or a listener away)."""
        return min(self._until.values(), default=math.inf)
