"""A resumed run's rows on PostgreSQL, read back into records (`stores/_resume.Reader`).

What `Resume` takes back, as the SQLite store's `_rows.py` reads it from its file: a task's row
becomes its `Record` (ended as it ended, times counted from the coordinator's zero `wall0`), and
the ``attempts`` rows its failed attempts.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Final

from ..._record import Record
from ..._task import (
    STATE_OF,
    TERMINAL,
    Attempt,
    Task,
)

if TYPE_CHECKING:
    import datetime
    from collections.abc import Sequence

    import asyncpg

__all__ = ("CHUNK", "STATES", "Rows", "ended_after", "load", "load_unfinished")

STATES: Final = STATE_OF  # the interned constants: the engine compares states by `is`

# A spawner's row before its spawns' (they are admitted in a later transaction), a batch's rows in
# their order.
_COLUMNS = """
SELECT id, parent, idx, named, kind, payload::text, depends_on, depends_on_tags, tags, key,
    timeout, critical, metadata::text, priority, state, attempts, agent_tries, target, tried,
    feedback::text, extract(epoch FROM started)::float8, extract(epoch FROM finished)::float8,
    output::text, agent, error, error_type, defaulted, took_key
FROM orchestra.tasks WHERE run_id = $1"""

_TASKS = _COLUMNS + " ORDER BY admitted, parent IS NOT NULL, idx"

_ENDED = ["succeeded", "failed", "cancelled", "skipped"]

# A run whose every task stands alone: none waits for another or a group, holds a key or was
# spawned. Its ended tasks matter to nothing but themselves, so a streamed run reads them as
# its input comes again (`load_unfinished`, `ended_after`), not all at once.
_ALONE = """
SELECT NOT EXISTS (
    SELECT 1 FROM orchestra.tasks WHERE run_id = $1 AND (
        parent IS NOT NULL OR key IS NOT NULL OR took_key OR cardinality(depends_on) > 0
        OR cardinality(depends_on_tags) > 0 OR cardinality(tags) > 0))
"""

_UNFINISHED = _COLUMNS + " AND state <> ALL ($2::text[]) ORDER BY idx, id"

# Keyset-paged in input order: each page one short statement (no transaction held open for the
# replay, which the sessions' idle-in-transaction timeout would cut), a scan of the run's rows
# (no index on `idx`: one more entry a task on the admission path, for the resume alone).
_ENDED_AFTER = (
    _COLUMNS + " AND state = ANY ($2::text[]) AND (idx, id) > ($3, $4) AND admitted < $6"
    " ORDER BY idx, id LIMIT $5"
)

_ATTEMPTS_OF = """
SELECT task_id, number, agent, error_type, message, extract(epoch FROM started)::float8,
    duration, retry_in, traceback, status_code, api_error_type, request_id
FROM orchestra.attempts WHERE run_id = $1 AND task_id = ANY ($2::text[])
ORDER BY task_id, number
"""


CHUNK: Final = 20_000  # ended rows read at a time (`ended_after`)

_ATTEMPTS = """
SELECT task_id, number, agent, error_type, message, extract(epoch FROM started)::float8,
    duration, retry_in, traceback, status_code, api_error_type, request_id
FROM orchestra.attempts WHERE run_id = $1
ORDER BY task_id, number
"""


async def load(conn: asyncpg.Connection, run_id: str) -> tuple[list[Any], list[Any]]:
    """The rows of `run_id`'s tasks (admission order) and of their failed attempts."""
    tasks = list(await conn.fetch(_TASKS, run_id))
    if not tasks:
        return [], []
    return tasks, list(await conn.fetch(_ATTEMPTS, run_id))


async def load_unfinished(
    conn: asyncpg.Connection, run_id: str
) -> tuple[list[Any], list[Any], datetime.datetime] | None:
    """For a run whose tasks all stand alone (`_ALONE`), the rows of its unfinished tasks and of
    their failed attempts, and the database's time as it read them (what `ended_after` reads is
    what was admitted before); None for any other run (read whole: `load`)."""
    if not await conn.fetchval(_ALONE, run_id):
        return None
    now = await conn.fetchval("SELECT now()")
    tasks = list(await conn.fetch(_UNFINISHED, run_id, _ENDED))
    return tasks, await _attempts_of(conn, run_id, tasks), now


async def ended_after(
    conn: asyncpg.Connection,
    run_id: str,
    after: tuple[int, str],
    before: datetime.datetime,
    limit: int = CHUNK,
) -> tuple[list[Any], list[Any]]:
    """The next `limit` rows of `run_id`'s ended tasks after `after` (index, id), in input
    order, admitted `before` (by an earlier process), and their failed attempts' rows."""
    tasks = list(await conn.fetch(_ENDED_AFTER, run_id, _ENDED, after[0], after[1], limit, before))
    return tasks, await _attempts_of(conn, run_id, tasks)


async def _attempts_of(conn: asyncpg.Connection, run_id: str, tasks: list[Any]) -> list[Any]:
    # Only a task that failed an attempt has rows there: one that did not succeed, took more
    # than one attempt (a lease lost is counted as one), or succeeded by its kind's default.
    ids = [row[0] for row in tasks if row[14] != "succeeded" or row[15] > 1 or row[26]]
    return list(await conn.fetch(_ATTEMPTS_OF, run_id, ids)) if ids else []


class Rows:
    """Records from one run's rows (`stores/_resume.Reader`)."""

    __slots__ = ("offset", "wall0")

    def __init__(self, wall0: float, offset: float) -> None:
        self.wall0 = wall0  # wall time of the mirror's zero
        self.offset = offset  # loop time + offset = wall time

    def failures(self, attempt_rows: list[Any]) -> dict[str, list[Attempt]]:
        """Failed attempts by task id, from rows (task id, then `attempt`'s columns)."""
        failures: dict[str, list[Attempt]] = {}
        for a in attempt_rows:
            failures.setdefault(a[0], []).append(self.attempt(a[1:]))
        return failures

    def attempt(self, a: Sequence[Any]) -> Attempt:
        """A failed attempt from its row: number, agent, error_type, message, started (wall
        seconds), duration, retry_in, traceback, status_code, api_error_type, request_id."""
        return Attempt(
            number=a[0], agent=a[1], error_type=a[2], message=a[3],
            started=(a[4] or self.wall0) - self.wall0, duration=a[5] or 0.0, retry_in=a[6],
            traceback=a[7], status_code=a[8], api_error_type=a[9], request_id=a[10],
        )  # fmt: skip

    def record(
        self, row: Any, stored: dict[str, tuple[Record, str]], failures: dict[str, list[Attempt]]
    ) -> Record:
        (task_id, parent, idx, named, kind, payload, depends_on, depends_on_tags, tags, key,
         timeout, critical, metadata, priority, state, attempts, agent_tries, target, tried,
         feedback, started, finished, output, agent, error, error_type, defaulted,
         _took_key) = row  # fmt: skip
        task = Task(
            kind, json.loads(payload), id=task_id, priority=priority,
            depends_on=depends_on or [], depends_on_tags=depends_on_tags or [], tags=tags or [],
            key=key, timeout=timeout, critical=critical,
            metadata=None if metadata is None else json.loads(metadata),
        )  # fmt: skip
        record = Record(task, idx, None if parent is None else stored[parent][0], named)
        record.state = state = STATES[state]
        record.attempts = attempts
        record.agent_tries = agent_tries
        record.target = target
        record.tried = None if tried is None else list(tried)
        record.feedback = None if feedback is None else json.loads(feedback)
        record.failures = failures.get(task_id)
        if started is not None:
            record.t_start = started - self.offset
        if output is not None:
            record.output = json.loads(output)
        if state in TERMINAL:
            record.status = state  # type: ignore[assignment]
            record.agent = agent
            record.started = None if started is None else started - self.wall0
            record.finished = (finished or self.wall0) - self.wall0
            record.error = error
            record.error_type = error_type
            record.defaulted = defaulted
        stored[task_id] = (record, payload)
        return record

    def took_key(self, row: Any) -> bool:
        return bool(row[27])

    @staticmethod
    def position(row: Any) -> tuple[int, str]:
        """Where a row stands in input order (`ended_after`): its index, then its id."""
        return row[2], row[0]
