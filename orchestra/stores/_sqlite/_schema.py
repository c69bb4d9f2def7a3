"""The SQLite store's schema and its migrations (`PRAGMA user_version` counts the ones applied).

A migration is a tuple of statements, applied in one `BEGIN IMMEDIATE` transaction together with
the version bump, after re-reading the version inside the transaction: two processes opening a new
file at once apply each migration once. Migrations are only ever appended; a file whose version is
newer than `MIGRATIONS` was written by a newer orchestra and is refused.

Times are wall-clock seconds (`time.time()`), never loop times: they must mean the same in the next
process. JSON columns hold `pydantic_core.to_json` text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._exceptions import StoreError

if TYPE_CHECKING:
    import sqlite3

__all__ = ("MIGRATIONS", "migrate", "refuse_foreign", "rollback")

_V1 = (
    # One row per run. `owner` and `heartbeat`: a coordinator process holds its run under a lease,
    # so that a second coordinator of the same run id is refused.
    """CREATE TABLE runs (
        id TEXT PRIMARY KEY,
        created REAL NOT NULL,
        updated REAL NOT NULL,
        state TEXT NOT NULL DEFAULT 'open',          -- open | closed
        opened INTEGER NOT NULL DEFAULT 1,           -- how many processes have run it
        owner TEXT,
        heartbeat REAL
    )""",
    # One row per task. Static columns are written once, at admission; the others follow every
    # transition (batched). `seq` is the admission order within the run, `parent` the spawner.
    """CREATE TABLE tasks (
        run_id TEXT NOT NULL,
        id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        parent TEXT,
        idx INTEGER NOT NULL,
        named INTEGER NOT NULL,
        kind TEXT NOT NULL,
        payload TEXT NOT NULL,
        depends_on TEXT,
        depends_on_tags TEXT,
        tags TEXT,
        key TEXT,
        timeout REAL,
        critical INTEGER NOT NULL DEFAULT 0,
        metadata TEXT,
        priority INTEGER NOT NULL,
        state TEXT NOT NULL,
        attempts INTEGER NOT NULL DEFAULT 0,
        agent_tries INTEGER NOT NULL DEFAULT 0,
        target TEXT,
        tried TEXT,
        feedback TEXT,
        token INTEGER NOT NULL DEFAULT 0,
        lease_owner TEXT,
        lease_expires REAL,
        due REAL,
        deadline REAL,
        started REAL,
        finished REAL,
        output TEXT,
        agent TEXT,
        error TEXT,
        error_type TEXT,
        defaulted INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (run_id, id)
    )""",
    # What a worker process will claim from: the ready tasks of its kinds, best first.
    "CREATE INDEX tasks_ready ON tasks (run_id, state, kind, priority, seq)",
    # Idempotency across runs: the stored result of a key.
    "CREATE INDEX tasks_by_key ON tasks (key, state) WHERE key IS NOT NULL",
    # Every failed attempt, with its traceback (times: wall time the attempt started).
    """CREATE TABLE attempts (
        run_id TEXT NOT NULL,
        task_id TEXT NOT NULL,
        number INTEGER NOT NULL,
        agent TEXT NOT NULL,
        error_type TEXT NOT NULL,
        message TEXT NOT NULL,
        started REAL,
        duration REAL,
        retry_in REAL,
        traceback TEXT,
        status_code INTEGER,
        api_error_type TEXT,
        request_id TEXT
    )""",
    "CREATE INDEX attempts_by_task ON attempts (run_id, task_id)",
    # The journal: append-only, one row per transition, in order.
    """CREATE TABLE events (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        run_id TEXT NOT NULL,
        task_id TEXT,
        at REAL NOT NULL,
        event TEXT NOT NULL,
        agent TEXT,
        attempt INTEGER,
        detail TEXT
    )""",
    "CREATE INDEX events_by_task ON events (run_id, task_id)",
    # Dead letters: the tasks that failed for good (their attempts are in `attempts`).
    """CREATE VIEW dead_letters AS
        SELECT run_id, id AS task_id, kind, payload, attempts, agent, error_type, error, finished
        FROM tasks WHERE state = 'failed'""",
)

_V2 = (
    # Written for speed (`python -m benchmarks.sqlite`): the index a worker
    # claims from holds the ready tasks only (in one process a row is mostly written once the
    # task has ended, and then enters no index at all), ...
    "DROP INDEX tasks_ready",
    "CREATE INDEX tasks_ready ON tasks (run_id, kind, priority, seq) WHERE state = 'ready'",
    # ... a task's admission is its row (`admitted`, wall time), not a journal row: the journal's
    # readers add an `admitted` event from it (see `SQLiteStore.events`), ...
    "ALTER TABLE tasks ADD COLUMN admitted REAL",
    # ... and the journal is numbered by its rowid (append-only: never reused), not AUTOINCREMENT
    # (which writes `sqlite_sequence` on every insert).
    """CREATE TABLE events_v2 (
        seq INTEGER PRIMARY KEY,
        run_id TEXT NOT NULL,
        task_id TEXT,
        at REAL NOT NULL,
        event TEXT NOT NULL,
        agent TEXT,
        attempt INTEGER,
        detail TEXT
    )""",
    "INSERT INTO events_v2 SELECT seq, run_id, task_id, at, event, agent, attempt, detail FROM events",
    "DROP TABLE events",
    "ALTER TABLE events_v2 RENAME TO events",
    "CREATE INDEX events_by_task ON events (run_id, task_id)",
    # Idempotency keys across store objects and processes: a key's row is claimed by the first
    # submitter (its `owner`, one per store object), which writes the result there; the others
    # wait for it. `heartbeat` (wall time) is refreshed by the owner at each commit: a claim whose
    # owner stopped beating (a killed process) is taken over, and so is a key whose task failed.
    """CREATE TABLE keys (
        key TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        run_id TEXT NOT NULL,
        task_id TEXT NOT NULL,
        state TEXT NOT NULL,                         -- claimed | succeeded | failed
        heartbeat REAL NOT NULL,
        output TEXT,
        agent TEXT,
        error TEXT                                   -- why it failed (state 'failed')
    )""",
    "CREATE INDEX keys_claimed ON keys (owner) WHERE state = 'claimed'",
    # A key that succeeded before v2 is a succeeded key row.
    """INSERT INTO keys (key, owner, run_id, task_id, state, heartbeat, output, agent)
        SELECT key, '', run_id, id, 'succeeded', coalesce(finished, 0), output, agent
        FROM tasks WHERE key IS NOT NULL AND state = 'succeeded'
        ON CONFLICT (key) DO NOTHING""",
)

_V3 = (
    # Worker processes. A run's coordinator (the process running it) holds
    # it: `owner` names the process (host, pid, store) and `heartbeat` is refreshed at least once a
    # second; a second coordinator of a live run is refused. `shared` says the coordinator takes
    # its own tasks through the file too, so that workers may claim the ready ones.
    "ALTER TABLE runs ADD COLUMN shared INTEGER NOT NULL DEFAULT 0",
    # The coordinator's lease (seconds): how long its hold outlives its last heartbeat.
    "ALTER TABLE runs ADD COLUMN lease REAL",
    # What a worker says of a task it ran (state 'done' until the coordinator takes it in): its
    # end (`outcome`: succeeded, failed, ...) and the tasks its attempt spawned (JSON).
    "ALTER TABLE tasks ADD COLUMN outcome TEXT",
    "ALTER TABLE tasks ADD COLUMN spawned TEXT",
    "CREATE INDEX tasks_done ON tasks (run_id) WHERE state = 'done'",
    "CREATE INDEX tasks_leased ON tasks (lease_owner) WHERE lease_owner IS NOT NULL",
    # The worker processes, for coordinators to see (a run with a live worker for one of its kinds
    # is shared) and for `orchestra runs workers`: `kinds` is a JSON list (NULL: every kind),
    # `run_id` the one run it serves (NULL: any).
    """CREATE TABLE workers (
        owner TEXT PRIMARY KEY,
        host TEXT NOT NULL,
        pid INTEGER NOT NULL,
        run_id TEXT,
        kinds TEXT,
        started REAL NOT NULL,
        heartbeat REAL NOT NULL,
        claimed INTEGER NOT NULL DEFAULT 0,
        completed INTEGER NOT NULL DEFAULT 0
    )""",
)

_V4 = (
    # A task that took its key over at its admission from another task of the run (which waited
    # for it): on resume the key goes back to it, not to the first task with the key.
    "ALTER TABLE tasks ADD COLUMN took_key INTEGER NOT NULL DEFAULT 0",
)

_V5 = (
    # The service's bearer tokens (``orchestra tokens``): a token is kept as the SHA-256 of its
    # text (`hash`), never as the text; `role` what it may do; `revoked` (wall time) once revoked.
    """CREATE TABLE tokens (
        id TEXT PRIMARY KEY,
        name TEXT,
        role TEXT NOT NULL,
        hash TEXT NOT NULL UNIQUE,
        created REAL NOT NULL,
        revoked REAL
    )""",
)

_V6 = (
    # The newest runs first, a page at a time (`SQLiteStore.latest_runs`, the service's
    # ``GET /api/runs``): read along this index, not sorted from every run.
    "CREATE INDEX runs_by_created ON runs (created, id)",
)

_V7 = (
    # The service's idempotency keys (``Idempotency-Key``): the run each started and the SHA-256
    # of the request that started it (`digest`), so that the key sent again with another request
    # is refused rather than answered with a run that request did not ask for.
    """CREATE TABLE service_keys (
        key TEXT PRIMARY KEY,
        run_id TEXT NOT NULL,
        digest TEXT NOT NULL,
        created REAL NOT NULL
    )""",
)

MIGRATIONS: tuple[tuple[str, ...], ...] = (_V1, _V2, _V3, _V4, _V5, _V6, _V7)
"""Schema version n is reached by applying `MIGRATIONS[:n]`; append, never edit."""


def refuse_foreign(conn: sqlite3.Connection, where: str) -> None:
    """Refuse a SQLite database of another application: one with tables and no schema version of
    ours (a migration creates its tables and sets the version in one transaction, so a file of
    ours never has tables at version 0). Checked before anything is written to the file: neither
    our schema nor WAL mode (which stays with a file) is put into someone else's database."""
    # One statement, so one snapshot of the file: read as two, another process creating the
    # schema could commit between them (version 0, then its tables), and a new file opened by a
    # coordinator and a worker at once was refused as someone else's.
    version, names = conn.execute(
        "SELECT (SELECT user_version FROM pragma_user_version), "
        "(SELECT group_concat(name, char(0)) FROM (SELECT name FROM sqlite_master "
        "WHERE type IN ('table', 'view') ORDER BY name))"
    ).fetchone()
    if version != 0:
        return
    tables = names.split("\0") if names else []
    if tables:
        shown = ", ".join(tables[:5]) + (", ..." if len(tables) > 5 else "")
        raise StoreError(
            f"database {where!r} is not a SQLiteStore file: it holds another application's "
            f"tables ({shown}); give a SQLiteStore a file of its own (a new path creates one)"
        )


def migrate(conn: sqlite3.Connection, where: str) -> None:
    """Bring the database to the newest schema (a new file gets all of it)."""
    newest = len(MIGRATIONS)
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > newest:
        raise StoreError(
            f"{where} has schema version {version}, newer than this orchestra knows ({newest}): "
            "upgrade orchestra to open it"
        )
    while version < newest:
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]  # another process's?
            if version < newest:
                for statement in MIGRATIONS[version]:
                    conn.execute(statement)
                version += 1
                conn.execute(f"PRAGMA user_version = {version}")
            conn.execute("COMMIT")
        except BaseException:
            rollback(conn)
            raise


def rollback(conn: sqlite3.Connection) -> None:
    """Roll back the transaction a failed step was in, if SQLite has not already: on some errors
    (a full disk, an I/O error) it rolls back by itself, and a second ROLLBACK would raise over the
    error that says what happened."""
    if conn.in_transaction:
        conn.execute("ROLLBACK")
