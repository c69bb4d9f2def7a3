"""A SQLite file read for its user: its runs, workers, journal and dead letters, and a run's
failed tasks reopened (`SQLiteStore.runs`, `.workers`, `.events`, `.dead_letters`, `.retry`, and
``orchestra runs``). Jobs of the writer thread (`_writer`), as every use of the file is.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ..._exceptions import InputError
from ._schema import rollback

if TYPE_CHECKING:
    import sqlite3

__all__ = ("dead", "events", "latest", "retry", "run", "runs", "workers")


def _rows(cursor: sqlite3.Cursor) -> list[dict[str, Any]]:
    names = [d[0] for d in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def runs(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    runs = _rows(conn.execute("SELECT * FROM runs ORDER BY created"))
    for run in runs:
        run["counts"] = dict(
            conn.execute(
                "SELECT state, count(*) FROM tasks WHERE run_id = ? GROUP BY state", (run["id"],)
            ).fetchall()
        )
    return runs


def latest(
    conn: sqlite3.Connection, limit: int, after: str | None, state: str | None
) -> list[dict[str, Any]]:
    """The newest runs first (by creation, then id), at most `limit`, as `runs` gives them: those
    listed after the run `after` (the last of the page before: older than it), of `state` only
    when given. Read along the ``runs_by_created`` index, whatever the number of runs."""
    where, args = [], {"limit": limit, "state": state}
    if after is not None:
        row = conn.execute("SELECT created, id FROM runs WHERE id = ?", (after,)).fetchone()
        if row is None:
            raise InputError(
                f"no run {after!r} to list the runs after: give the cursor a page of runs "
                "answered (its next_cursor), or none for the newest",
                field="cursor",
            )
        where.append("(created, id) < (:created, :id)")
        args.update(created=row[0], id=row[1])
    if state is not None:
        where.append("state = :state")
    found = _rows(
        conn.execute(
            f"SELECT * FROM runs {'WHERE ' + ' AND '.join(where) if where else ''} "
            "ORDER BY created DESC, id DESC LIMIT :limit",
            args,
        )
    )
    for one in found:
        one["counts"] = dict(
            conn.execute(
                "SELECT state, count(*) FROM tasks WHERE run_id = ? GROUP BY state", (one["id"],)
            ).fetchall()
        )
    return found


def run(conn: sqlite3.Connection, run_id: str, counts: bool = True) -> dict[str, Any] | None:
    """One run as `runs` gives it, or None; without `counts`, its row alone (no scan of its
    tasks)."""
    found = _rows(conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)))
    if not found:
        return None
    (one,) = found
    if not counts:
        return one
    one["counts"] = dict(
        conn.execute(
            "SELECT state, count(*) FROM tasks WHERE run_id = ? GROUP BY state", (run_id,)
        ).fetchall()
    )
    return one


def workers(conn: sqlite3.Connection, now: float, lease: float) -> list[dict[str, Any]]:
    found = _rows(conn.execute("SELECT * FROM workers ORDER BY started"))
    for worker in found:
        worker["kinds"] = None if worker["kinds"] is None else json.loads(worker["kinds"])
        worker["live"] = now - worker["heartbeat"] < lease
        worker["holding"] = conn.execute(
            "SELECT count(*) FROM tasks WHERE lease_owner = ?", (worker["owner"],)
        ).fetchone()[0]
    return found


# The journal as its readers see it: the `events` rows, and the events a task's row says (its
# admission, its last start, its end), which are not written as rows (see `Window.flush`). A
# file written before schema v2 has them as rows: they are not added twice. A task's end is dated
# no earlier than its last journal row: two times of one instant are sums of different floats (an
# attempt's end is its start plus its duration, its task's end a clock reading), and one unit in
# the last place put a task's end before the failure that ended it. `since` is tested in each part
# on what it dates by, so that a reader that follows the journal (the service's event stream, ten
# times a second) pays the per-task lookups of the events table only for what is new: a task's last
# event per task is read once (`l`), not looked up for every task (measured at 10,000 tasks: 9 ms
# a read of the last 0.1 s against 12.5). A task a worker completed (``done``) has not ended yet:
# its end is the one its coordinator settles (a success, or a failure it may retry elsewhere),
# told once then.
_JOURNAL = """
    SELECT seq, run_id, task_id, at, event, agent, attempt, detail FROM (
        SELECT NULL AS seq, run_id, id AS task_id, admitted AS at, 'admitted' AS event,
               NULL AS agent, NULL AS attempt, NULL AS detail, 0 AS rank
        FROM tasks t WHERE run_id = :run AND (:task IS NULL OR id = :task) AND admitted IS NOT NULL
            AND (:since IS NULL OR admitted >= :since)
        UNION ALL
        SELECT seq, run_id, task_id, at, event, agent, attempt, detail,
               CASE event WHEN 'ready' THEN 1 WHEN 'started' THEN 2 ELSE 3 END
        FROM events WHERE run_id = :run AND (:task IS NULL OR task_id = :task)
            AND (:since IS NULL OR at >= :since)
        UNION ALL
        SELECT NULL, run_id, id, started, 'started', agent, attempts, NULL, 2
        FROM tasks t WHERE run_id = :run AND (:task IS NULL OR id = :task)
            AND started IS NOT NULL AND finished IS NOT NULL
            AND (:since IS NULL OR started >= :since) AND NOT EXISTS (
                SELECT 1 FROM events e WHERE e.run_id = t.run_id AND e.task_id = t.id
                AND e.event = 'started' AND e.attempt = t.attempts)
        UNION ALL
        SELECT NULL, t.run_id, t.id, max(t.finished, coalesce(l.at, t.finished)), t.state,
               t.agent, t.attempts, t.error, 4
        FROM tasks t LEFT JOIN (
                SELECT task_id, max(at) AS at FROM events WHERE run_id = :run GROUP BY task_id
            ) AS l ON l.task_id = t.id
        WHERE t.run_id = :run AND (:task IS NULL OR t.id = :task) AND t.finished IS NOT NULL
            AND t.state != 'done'
            AND (:since IS NULL OR t.finished >= :since OR l.at >= :since)
            AND NOT EXISTS (
                SELECT 1 FROM events e WHERE e.run_id = t.run_id AND e.task_id = t.id
                AND e.event = t.state AND e.attempt = t.attempts)
    ) WHERE :since IS NULL OR at >= :since ORDER BY at, rank, seq
"""


def _known(conn: sqlite3.Connection, run_id: str, task_id: str | None = None) -> None:
    """Refuse a run id (or a task id in it) the file does not know, naming what it knows."""
    if conn.execute("SELECT 1 FROM runs WHERE id = ?", (run_id,)).fetchone() is None:
        known = [row[0] for row in conn.execute("SELECT id FROM runs ORDER BY created LIMIT 6")]
        raise InputError(
            f"no run {run_id!r} in this file (its runs: "
            f"{', '.join(map(repr, known[:5])) or 'none'}{', ...' if len(known) > 5 else ''})",
            field="run_id",
        )
    if task_id is not None and (
        conn.execute(
            "SELECT 1 FROM tasks WHERE run_id = ? AND id = ?", (run_id, task_id)
        ).fetchone()
        is None
    ):
        raise InputError(f"run {run_id!r} has no task {task_id!r}", task_id=task_id)


def events(
    conn: sqlite3.Connection, run_id: str, task_id: str | None, since: float | None = None
) -> list[dict[str, Any]]:
    _known(conn, run_id, task_id)
    return _rows(conn.execute(_JOURNAL, {"run": run_id, "task": task_id, "since": since}))


# What `retry` writes into the journal before it reopens a task: the events its row said (its last
# start, its end), which the reopened row no longer says.
_KEEP_STARTED = """
    INSERT INTO events (run_id, task_id, at, event, agent, attempt, detail)
    SELECT run_id, id, started, 'started', agent, attempts, NULL FROM tasks t
    WHERE run_id = :run AND id IN (SELECT value FROM json_each(:ids)) AND started IS NOT NULL
        AND finished IS NOT NULL AND NOT EXISTS (
            SELECT 1 FROM events e WHERE e.run_id = t.run_id AND e.task_id = t.id
            AND e.event = 'started' AND e.attempt = t.attempts)
"""
# A task's end is after every event of it, as the journal tells it (`_JOURNAL`): the end kept
# here takes the same time, or a reopened task's `failed` could come before its last
# `attempt_failed` (stamped from the attempt's own clock readings, a hair apart).
_KEEP_ENDED = """
    INSERT INTO events (run_id, task_id, at, event, agent, attempt, detail)
    SELECT run_id, id, max(finished, coalesce((
               SELECT max(e.at) FROM events e WHERE e.run_id = t.run_id AND e.task_id = t.id
           ), finished)), state, agent, attempts, error FROM tasks t
    WHERE run_id = :run AND id IN (SELECT value FROM json_each(:ids)) AND finished IS NOT NULL
        AND NOT EXISTS (
            SELECT 1 FROM events e WHERE e.run_id = t.run_id AND e.task_id = t.id
            AND e.event = t.state AND e.attempt = t.attempts)
"""
# A reopened task starts its chain of agents again: with no agent to go to (`target` NULL), its
# `agent_tries` keeps how many failed attempts came before, which count against no agent any more
# (`MemoryRun.restore`, `tries_on`). With a target, it is the attempts made on that agent.
_REOPEN = """
    UPDATE tasks SET state = 'pending', target = NULL, tried = NULL,
        agent_tries = (SELECT count(*) FROM attempts a WHERE a.run_id = tasks.run_id
                       AND a.task_id = tasks.id),
        feedback = NULL, due = NULL, deadline = NULL, started = NULL, finished = NULL,
        output = NULL, agent = NULL, error = NULL, error_type = NULL, defaulted = 0
    WHERE run_id = :run AND id IN (SELECT value FROM json_each(:ids))
"""


def retry(
    conn: sqlite3.Connection, run_id: str, task_ids: list[str] | None, now: float
) -> list[str]:
    """Reopen the failed tasks of a run (those of `task_ids`), and its skipped ones (a skipped
    task whose dependency still failed is skipped again when the run resumes). Attempts are kept:
    the count, and every failed one in `attempts`; the chain of agents starts again."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        _known(conn, run_id)
        states = dict(
            conn.execute(
                "SELECT id, state FROM tasks WHERE run_id = ? AND state IN ('failed', 'skipped')",
                (run_id,),
            ).fetchall()
        )
        if task_ids is None:
            failed = [i for i, state in states.items() if state == "failed"]
        else:
            failed = list(dict.fromkeys(task_ids))
            for task_id in failed:
                if states.get(task_id) != "failed":
                    row = conn.execute(
                        "SELECT state FROM tasks WHERE run_id = ? AND id = ?", (run_id, task_id)
                    ).fetchone()
                    raise InputError(
                        f"run {run_id!r} has no task {task_id!r}"
                        if row is None
                        else f"task {task_id!r} of run {run_id!r} is {row[0]}, not failed: "
                        "only failed tasks are retried",
                        task_id=task_id,
                        field="task_ids",
                    )
        reopened = [*failed, *(i for i, state in states.items() if state == "skipped")]
        if reopened:
            ids = {"run": run_id, "ids": json.dumps(reopened)}
            conn.execute(_KEEP_STARTED, ids)
            conn.execute(_KEEP_ENDED, ids)
            conn.executemany(
                "INSERT INTO events (run_id, task_id, at, event) VALUES (?, ?, ?, 'retried')",
                [(run_id, task_id, now) for task_id in reopened],
            )
            conn.execute(_REOPEN, ids)
            conn.execute("UPDATE runs SET state = 'open', updated = ? WHERE id = ?", (now, run_id))
        conn.execute("COMMIT")
    except BaseException:
        rollback(conn)
        raise
    return failed


def dead(conn: sqlite3.Connection, run_id: str) -> list[dict[str, Any]]:
    _known(conn, run_id)
    dead = _rows(
        conn.execute("SELECT * FROM dead_letters WHERE run_id = ? ORDER BY finished", (run_id,))
    )
    for letter in dead:
        letter["attempts_list"] = _rows(
            conn.execute(
                "SELECT * FROM attempts WHERE run_id = ? AND task_id = ? ORDER BY rowid",
                (run_id, letter["task_id"]),
            )
        )
        # A task that failed for good names no agent of its own (none gave it its output): the
        # one its last attempt ran on.
        if letter["agent"] is None and letter["attempts_list"]:
            letter["agent"] = letter["attempts_list"][-1]["agent"]
    return dead
