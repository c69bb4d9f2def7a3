"""The SQLite store's I/O: its one connection, the one thread that uses it, and the SQL it runs.

Everything here runs in the writer thread and sees only plain values (tuples of rows, ids, times):
`SQLiteRun` (orchestra/stores/_sqlite.py) builds the rows on the loop and hands them over. Each job
is a function of the connection first; a `sqlite3` error in it reaches its caller as a `StoreError`
that says what is wrong with the file (`explain`).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from concurrent.futures import Future
from queue import SimpleQueue
from typing import TYPE_CHECKING, Any

from .._exceptions import InputError, StoreError
from . import _sqlite_leases as leases
from ._schema import migrate, refuse_foreign, rollback

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

__all__ = (
    "LOAD",
    "Writer",
    "claim_keys",
    "close_run",
    "dead",
    "events",
    "explain",
    "open_run",
    "retry",
    "runs",
    "workers",
    "write",
)


class Writer:
    """The store's one connection and the one thread that uses it, fed through a queue.

    Written by hand rather than with a `ThreadPoolExecutor`: the store closes its connection from a
    `weakref.finalize` (a store nobody closed), which may run inside any allocation, even while the
    executor's own locks are held; `queue.SimpleQueue.put` is safe there (it is made for it), an
    executor's `submit` is not. A daemon thread: a store left open never keeps the interpreter
    from exiting (a transaction it was in is rolled back by SQLite; commits stay)."""

    def __init__(self, path: Path, busy_timeout: float = 10.0) -> None:
        self.path = path
        self.busy_timeout = busy_timeout
        self.jobs: SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]] | None] = (
            SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self.closed = False
        # The file it opened, as SQLite resolved it (a relative path against the working
        # directory then), and its (device, inode); None: no file (":memory:").
        self._file: tuple[str, int, int] | None = None

    def submit(self, job: Callable[..., Any], args: tuple[Any, ...]) -> Future[Any]:
        future: Future[Any] = Future()
        if self.closed:  # no thread would ever answer: the caller would wait forever
            future.set_exception(
                StoreError(
                    f"database {str(self.path)!r}: its SQLiteStore was closed (store.close()): "
                    "open a new SQLiteStore on the file to use it again"
                )
            )
            return future
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._work, name=f"orchestra-sqlite:{self.path.name}", daemon=True
            )
            self._thread.start()
        self.jobs.put((job, args, future))
        return future

    def stop(self) -> None:
        """No more jobs: the thread closes the connection after the ones already queued (safe
        in a `weakref.finalize`: an attribute set and a `SimpleQueue.put`)."""
        self.closed = True
        self.jobs.put(None)

    def _work(self) -> None:
        conn: sqlite3.Connection | None = None
        try:
            while (item := self.jobs.get()) is not None:
                job, args, future = item
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    if conn is None:
                        conn = self._connect()
                    else:
                        self._same_file()
                    result = job(conn, *args)
                except sqlite3.Error as exc:
                    error = StoreError(explain(exc, self.path))
                    error.__cause__ = exc
                    future.set_exception(error)
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
        finally:
            if conn is not None:
                conn.close()

    def _connect(self) -> sqlite3.Connection:
        _refuse_tiny(self.path)
        conn = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=self.busy_timeout
        )
        try:
            refuse_foreign(conn, str(self.path))
            _wal(conn, self.busy_timeout)
            conn.execute("PRAGMA synchronous = NORMAL")
            migrate(conn, str(self.path))
        except BaseException:
            conn.close()
            raise
        where = os.path.abspath(self.path)
        try:
            found = os.stat(where)
        except FileNotFoundError:  # an in-memory database
            self._file = None
        else:
            self._file = (where, found.st_dev, found.st_ino)
        return conn

    def _same_file(self) -> None:
        """Refuse to go on when the path no longer names the file the connection has open: SQLite
        keeps writing to a deleted file (and its deleted WAL) without an error, and all of it is
        gone once the connection closes. One `stat` a job (a window): about a microsecond."""
        if self._file is None:
            return
        where, device, inode = self._file
        try:
            found = os.stat(where)
        except FileNotFoundError:
            how = "deleted"
        else:
            if found.st_ino == inode and found.st_dev == device:
                return
            how = "replaced"
        raise StoreError(
            f"database {str(self.path)!r}: the file was {how} while this SQLiteStore had it open "
            "(what it wrote since is not in the file at that path, and is lost when the store "
            "closes): nothing more is written. Put the run's file back at the path (from a "
            "backup) and open a new SQLiteStore on it to resume the run from what it holds; or "
            "start the run again on a new file"
        )


def _refuse_tiny(path: Path) -> None:
    """Refuse a non-empty file too short to be a SQLite database (a page is at least 512 bytes):
    SQLite takes a one-byte file for an empty database and writes a new one over it (a longer
    file without its header it refuses itself, "not a database"). A file that short is read by
    no SQLite connection, so this look at it cannot drop one's locks (closing any descriptor of a
    file drops the process's POSIX locks on it)."""
    try:
        size = os.stat(path).st_size
    except OSError:  # missing (created now), or not a file: SQLite says what is wrong
        return
    if 0 < size < 512:
        raise StoreError(
            f"database {str(path)!r}: it is not a SQLite database ({size} bytes, without "
            "SQLite's header): left as it is. Give a SQLiteStore a new path, or the path of "
            "its database file"
        )


def _wal(conn: sqlite3.Connection, busy_timeout: float) -> None:
    """Put the file in WAL mode, waiting up to `busy_timeout` for a lock held by another
    connection: SQLite answers this pragma SQLITE_BUSY at once, without its busy handler, while
    another process opens the same new file (a worker started with its coordinator)."""
    deadline = time.monotonic() + busy_timeout
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc).lower() or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)  # on the store's own thread: blocking it is what a busy wait does


def explain(exc: sqlite3.Error, path: Path) -> str:
    """What is wrong with the file, in words, from SQLite's error code (its message when the code
    says nothing more)."""
    message = str(exc)
    code = getattr(exc, "sqlite_errorname", None) or ""  # Python 3.11+: "SQLITE_IOERR_WRITE"
    lowered = message.lower()
    if code.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in lowered:
        hint = "another process holds it locked"
    elif code.startswith("SQLITE_READONLY") or "readonly" in lowered or "read-only" in lowered:
        hint = "it is read-only"
    elif code == "SQLITE_FULL" or "full" in lowered:
        hint = "the disk is full"
    elif code.startswith("SQLITE_IOERR") or "disk i/o error" in lowered:
        hint = (
            "writing or reading it failed: the disk may be full or failing, or the file may have "
            "reached a size limit"
        )
    elif (
        code.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB"))
        or "not a database" in lowered
        or "malformed" in lowered
        or "corrupt" in lowered
    ):
        hint = "it is not a SQLite database, or it is corrupt"
    elif code.startswith("SQLITE_CANTOPEN") or "unable to open" in lowered:
        hint = "it cannot be opened (does its directory exist?)"
    else:
        hint = "SQLite refused it"
    detail = f"{type(exc).__name__}: {message}" + (f", {code}" if code else "")
    return f"database {str(path)!r}: {hint} ({detail})"


# -- jobs of the writer thread (each gets the connection first) -----------------------------------

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
    (`_sqlite_leases.poll`: while workers may hold rows, shared or not, their expired leases and
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
# admission, its last start, its end), which are not written as rows (see `SQLiteRun.flush`). A
# file written before schema v2 has them as rows: they are not added twice. A task's end is dated
# no earlier than its last journal row: two times of one instant are sums of different floats (an
# attempt's end is its start plus its duration, its task's end a clock reading), and one unit in
# the last place put a task's end before the failure that ended it.
_JOURNAL = """
    SELECT seq, run_id, task_id, at, event, agent, attempt, detail FROM (
        SELECT NULL AS seq, run_id, id AS task_id, admitted AS at, 'admitted' AS event,
               NULL AS agent, NULL AS attempt, NULL AS detail, 0 AS rank
        FROM tasks t WHERE run_id = :run AND (:task IS NULL OR id = :task) AND admitted IS NOT NULL
        UNION ALL
        SELECT seq, run_id, task_id, at, event, agent, attempt, detail,
               CASE event WHEN 'ready' THEN 1 WHEN 'started' THEN 2 ELSE 3 END
        FROM events WHERE run_id = :run AND (:task IS NULL OR task_id = :task)
        UNION ALL
        SELECT NULL, run_id, id, started, 'started', agent, attempts, NULL, 2
        FROM tasks t WHERE run_id = :run AND (:task IS NULL OR id = :task)
            AND started IS NOT NULL AND finished IS NOT NULL AND NOT EXISTS (
                SELECT 1 FROM events e WHERE e.run_id = t.run_id AND e.task_id = t.id
                AND e.event = 'started' AND e.attempt = t.attempts)
        UNION ALL
        SELECT NULL, run_id, id, max(finished, coalesce((
                   SELECT max(e.at) FROM events e WHERE e.run_id = t.run_id AND e.task_id = t.id
               ), finished)), state, agent, attempts, error, 4
        FROM tasks t WHERE run_id = :run AND (:task IS NULL OR id = :task)
            AND finished IS NOT NULL AND NOT EXISTS (
                SELECT 1 FROM events e WHERE e.run_id = t.run_id AND e.task_id = t.id
                AND e.event = t.state AND e.attempt = t.attempts)
    ) ORDER BY at, rank, seq
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


def events(conn: sqlite3.Connection, run_id: str, task_id: str | None) -> list[dict[str, Any]]:
    _known(conn, run_id, task_id)
    return _rows(conn.execute(_JOURNAL, {"run": run_id, "task": task_id}))


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
    return dead
