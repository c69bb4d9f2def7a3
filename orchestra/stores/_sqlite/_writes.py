"""The SQL of a coordinator's run, run in the writer thread: its opening (the run's hold taken, its
rows loaded), each window's transaction, the claims of its idempotency keys, and its closing.

Everything here sees only plain values (tuples of rows, ids, times): the run builds the rows on the
loop (`_rows`) and hands them over (`_window`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..._exceptions import StoreError
from . import _leases as leases
from ._schema import rollback

if TYPE_CHECKING:
    import sqlite3

__all__ = ("LOAD", "claim_keys", "close_run", "open_run", "write")

_STATE = (
    "priority = ?, state = ?, attempts = ?, agent_tries = ?, target = ?, tried = ?, feedback = ?, "
    "token = ?, due = ?, deadline = ?, started = ?, finished = ?, output = ?, agent = ?, "
    "error = ?, error_type = ?, defaulted = ?"
)
_STATE_LEAN = (
    "priority = ?, state = ?, attempts = ?, agent_tries = ?, target = ?, tried = NULL, "
    "feedback = NULL, token = ?, due = NULL, deadline = NULL, started = ?, finished = ?, "
    "output = ?, agent = ?, error = NULL, error_type = NULL, defaulted = 0"
)
_HEAD = "run_id, id, seq, idx, named, kind, payload, admitted"
_STATIC = "parent, depends_on, depends_on_tags, tags, key, took_key, timeout, critical, metadata"
_STATE_COLUMNS = (
    "priority, state, attempts, agent_tries, target, tried, feedback, token, due, deadline, "
    "started, finished, output, agent, error, error_type, defaulted"
)
_STATE_COLUMNS_LEAN = (
    "priority, state, attempts, agent_tries, target, token, started, finished, output, agent"
)
_INSERT = (
    f"INSERT INTO tasks ({_HEAD}, {_STATIC}, {_STATE_COLUMNS}) VALUES ({', '.join('?' * 34)}) "
    "ON CONFLICT (run_id, id) DO NOTHING"
)
_INSERT_LEAN = (
    f"INSERT INTO tasks ({_HEAD}, {_STATE_COLUMNS_LEAN}) VALUES ({', '.join('?' * 18)}) "
    "ON CONFLICT (run_id, id) DO NOTHING"
)
_UPDATE = f"UPDATE tasks SET {_STATE} WHERE run_id = ? AND id = ?"
_UPDATE_LEAN = f"UPDATE tasks SET {_STATE_LEAN} WHERE run_id = ? AND id = ?"
# A shared run's (workers claim from it): the coordinator's write of a task a worker holds, or
# completed, is refused unless it ends the task (a cancel, a deadline: the coordinator's word is
# final, and the worker's late completion is then refused); the token never goes back.
_UPDATE_SHARED = (
    "UPDATE tasks SET "
    + _STATE.replace("token = ?", "token = max(token, ?)")
    + ", lease_owner = NULL, lease_expires = NULL WHERE run_id = ? AND id = ? "
    "AND (? OR (lease_owner IS NULL AND state != 'done'))"
)
LOAD = (
    "SELECT id, parent, idx, named, kind, payload, depends_on, depends_on_tags, tags, key, "
    "timeout, critical, metadata, priority, state, attempts, agent_tries, target, tried, "
    "feedback, token, started, finished, output, agent, error, error_type, defaulted, "
    "lease_owner, lease_expires, outcome, spawned, took_key FROM tasks WHERE run_id = ? "
    "ORDER BY seq"
)


def open_run(
    conn: sqlite3.Connection, run_id: str, now: float, name: str, lease: float
) -> tuple[list[Any], list[Any], int]:
    """Take run `run_id` (new or stored) as its coordinator `name` and load what it holds. A run
    whose coordinator is another live process (its heartbeat younger than that coordinator's
    lease, and its pid alive when it ran on this host) is refused."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        known = conn.execute(
            "SELECT owner, heartbeat, lease FROM runs WHERE id = ?", (run_id,)
        ).fetchone()
        if known is not None:
            holder, seen, held_for = known
            held_for = lease if held_for is None else held_for  # the holder's own lease
            if (
                holder is not None
                and holder != name
                and seen is not None
                and now - seen < held_for
                and leases.is_alive(holder, run_id)
            ):
                if leases.here(holder):
                    raise StoreError(
                        f"run {run_id!r} is already being run by this process, on another "
                        "SQLiteStore object of the file: a run has one coordinator (more "
                        "processes join it as workers: `orch.work(...)`)"
                    )
                host, _, rest = holder.partition(":")
                raise StoreError(
                    f"run {run_id!r} is already being run by another process (pid "
                    f"{rest.partition(':')[0]} on {host}, seen {max(now - seen, 0):.1f} s ago): "
                    "a run has one coordinator. More processes join it as workers "
                    "(`orch.work(...)`, `orchestra worker`); if that process is gone, its hold "
                    f"lapses {held_for:g} s after it was last seen"
                )
        if known is None:
            conn.execute(
                "INSERT INTO runs (id, created, updated, owner, heartbeat, lease) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (run_id, now, now, name, now, lease),
            )
            rows: list[Any] = []
            attempts: list[Any] = []
            seq = 0
        else:
            conn.execute(
                "UPDATE runs SET opened = opened + 1, updated = ?, state = 'open', owner = ?, "
                "heartbeat = ?, shared = 0, lease = ? WHERE id = ?",
                (now, name, now, lease, run_id),
            )
            rows = conn.execute(LOAD, (run_id,)).fetchall()
            attempts = conn.execute(
                "SELECT task_id, number, agent, error_type, message, started, duration, "
                "retry_in, traceback, status_code, api_error_type, request_id FROM attempts "
                "WHERE run_id = ? ORDER BY rowid",
                (run_id,),
            ).fetchall()
            seq = conn.execute(
                "SELECT coalesce(max(seq), 0) FROM tasks WHERE run_id = ?", (run_id,)
            ).fetchone()[0]
        conn.execute("COMMIT")
    except BaseException:
        rollback(conn)
        raise
    return rows, attempts, seq


def write(
    conn: sqlite3.Connection,
    run_id: str,
    new: tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]],
    dirty: tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]],
    attempts: list[tuple[Any, ...]],
    events: list[tuple[Any, ...]],
    keys: tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], tuple[float, str] | None] = (
        [],
        [],
        None,
    ),
    shared: list[tuple[Any, ...]] | None = None,
    beat: tuple[str, float, float, bool, bool, list[str]] | None = None,
    owner: str | None = None,
) -> leases.Polled | None:
    """One window of a run, in one transaction: new rows, changed rows (`shared`: those of a run
    workers claim from, `_UPDATE_SHARED`), failed attempts, journal events, keys; with `beat`
    (the coordinator's name, now, the lease, whether the run is shared, whether workers may hold
    its rows, the ids of the tasks it takes for workers'), the coordinator's heartbeat and what it learns of the workers
    (`_leases.poll`: while workers may hold rows, shared or not, their expired leases and
    completions too). With `owner` (the coordinator's name), nothing is written unless it still
    holds the run: one paused past its lease (SIGSTOP, a frozen VM) may have been replaced by
    another coordinator, whose rows it must not overwrite."""
    polled = None
    conn.execute("BEGIN IMMEDIATE")
    try:
        if owner is not None:
            _holds(conn, run_id, owner)
        succeeded, failed, keys_beat = keys
        if succeeded:  # (output, agent, key, owner): the result waiters take
            conn.executemany(
                "UPDATE keys SET state = 'succeeded', output = ?, agent = ? "
                "WHERE key = ? AND owner = ?",
                succeeded,
            )
        if failed:  # (error, now, key, owner): the next submitter of the key takes it over
            conn.executemany(
                "UPDATE keys SET state = 'failed', error = ?, heartbeat = ? "
                "WHERE key = ? AND owner = ? AND state = 'claimed'",
                failed,
            )
        if keys_beat is not None:  # (now, owner): this store's claims are live
            conn.execute(
                "UPDATE keys SET heartbeat = ? WHERE owner = ? AND state = 'claimed'", keys_beat
            )
        full, lean = new
        if full:
            conn.executemany(_INSERT, full)
        if lean:
            conn.executemany(_INSERT_LEAN, lean)
        full, lean = dirty
        if full:
            conn.executemany(_UPDATE, full)
        if lean:
            conn.executemany(_UPDATE_LEAN, lean)
        if shared:
            conn.executemany(_UPDATE_SHARED, shared)
        if attempts:
            conn.executemany(
                "INSERT INTO attempts VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", attempts
            )
        if events:
            conn.executemany(
                "INSERT INTO events (run_id, task_id, at, event, agent, attempt, detail) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                events,
            )
        if beat is not None:
            name, now, lease, is_shared, watching, remote = beat
            conn.execute(
                "UPDATE runs SET heartbeat = ?, shared = ? WHERE id = ? AND owner = ?",
                (now, int(is_shared), run_id, name),
            )
            polled = leases.poll(conn, run_id, now, lease, watching, remote)
        conn.execute("COMMIT")
    except BaseException:
        rollback(conn)
        raise
    return polled


def _holds(conn: sqlite3.Connection, run_id: str, owner: str) -> None:
    """Refuse a coordinator's write to a run that another process has taken over since."""
    row = conn.execute("SELECT owner FROM runs WHERE id = ?", (run_id,)).fetchone()
    if row is not None and row[0] != owner:
        holder = "no process now" if row[0] is None else f"process {row[0]}"
        raise StoreError(
            f"run {run_id!r} was taken over by another coordinator (it is held by {holder}): "
            f"this process ({owner}) stopped renewing its hold for longer than its lease "
            "(stopped, paused or starved), so nothing more of the run is written from here"
        )


def claim_keys(
    conn: sqlite3.Connection,
    owner: str,
    run_id: str,
    wanted: list[tuple[str, str]],
    now: float,
    lease: float,
) -> list[tuple[str, str | None, str | None]]:
    """Claim each key of `wanted` ((key, task id) pairs) for `owner`, in one transaction: SQLite's
    single writer lock (``BEGIN IMMEDIATE``) and the key's primary key make a claim atomic across
    store objects and processes. Each answer is ``("mine", None, None)`` (execute it),
    ``("done", output JSON, agent)`` (it succeeded: its stored result) or ``("wait", run id, task
    id)`` (another task holds it and is live). A key is taken over when its claim is this very
    task's (a resumed run), when its task failed, or when its owner stopped beating for `lease`
    seconds (a killed process)."""
    answers: list[tuple[str, str | None, str | None]] = []
    conn.execute("BEGIN IMMEDIATE")
    try:
        for key, task_id in wanted:
            claimed = conn.execute(
                "INSERT INTO keys (key, owner, run_id, task_id, state, heartbeat) "
                "VALUES (?, ?, ?, ?, 'claimed', ?) ON CONFLICT (key) DO NOTHING",
                (key, owner, run_id, task_id, now),
            )
            if claimed.rowcount == 1:
                answers.append(("mine", None, None))
                continue
            row = conn.execute(
                "SELECT run_id, task_id, state, heartbeat, output, agent FROM keys WHERE key = ?",
                (key,),
            ).fetchone()
            held_run, held_task, state, heartbeat, output, agent = row
            if state == "succeeded":
                answers.append(("done", "null" if output is None else output, agent))
            elif (
                state == "failed"
                or (held_run, held_task) == (run_id, task_id)
                or now - heartbeat > lease
            ):
                conn.execute(
                    "UPDATE keys SET owner = ?, run_id = ?, task_id = ?, state = 'claimed', "
                    "heartbeat = ?, error = NULL WHERE key = ?",
                    (owner, run_id, task_id, now, key),
                )
                answers.append(("mine", None, None))
            else:
                answers.append(("wait", held_run, held_task))
        conn.execute("COMMIT")
    except BaseException:
        rollback(conn)
        raise
    return answers


def close_run(conn: sqlite3.Connection, run_id: str, now: float, done: bool, name: str) -> None:
    """The coordinator lets go of its run: closed if it is done, else open for a later resume; no
    longer shared (workers claim nothing more of it)."""
    conn.execute(
        "UPDATE runs SET updated = ?, state = ?, owner = NULL, heartbeat = NULL, shared = 0 "
        "WHERE id = ? AND owner = ?",
        (now, "closed" if done else "open", run_id, name),
    )
