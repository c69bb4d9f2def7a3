"""The SQL a run's coordinator and its worker processes share: claims, leases, completions.

One process runs a run (its *coordinator*: the `orch.run(..., run_id=...)` that admits the input,
makes tasks ready, settles them and builds the result); worker processes (`orch.work(...)`,
``orchestra worker``) take ready tasks of their kinds from the same file and run them. SQLite's
single writer lock (``BEGIN IMMEDIATE``) makes every step here atomic across processes:

- **Claim** (a worker): the best ready rows of its kinds become ``claimed`` under a lease — the
  worker's name in `lease_owner`, a wall-clock `lease_expires`, and a fencing token (`token` + 1).
  A row is claimable only while its run is ``shared``: the coordinator takes its own tasks through
  the file too from then on (`claim_offered`), so no row is ever claimed twice.
- **Complete** (a worker): the row becomes ``done`` with its outcome, output and spawned tasks,
  only if it still carries the worker's lease and token: a worker that comes back after its lease
  expired (a SIGSTOP, a long GC) is refused, whatever it computed. An attempt that fails while its
  task goes on (a retry on the worker) is written the same way, fenced, as it fails: a lease lost
  later counts it, and the next attempt, wherever it runs, is numbered after it.
- **Beat** (a worker): its leases are extended; the ones it no longer holds (expired and taken back,
  or the task cancelled by the coordinator) are reported, for it to cancel their attempts.
- **Poll** (the coordinator, in its window's transaction): leases past their expiry are taken back
  (the attempt counted; the coordinator then writes the task ready again, or failed), and the
  ``done`` rows are read, for the coordinator to settle them (which readies dependents, admits
  spawns, and writes the task's final state).

Times are wall clock (`time.time()`): leases must mean the same in every process.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._schema import rollback

if TYPE_CHECKING:
    import sqlite3
    from collections.abc import Sequence

__all__ = (
    "Claimed",
    "Polled",
    "beat",
    "claim",
    "claim_offered",
    "complete",
    "coordinating",
    "here",
    "identity",
    "is_alive",
    "poll",
    "register",
    "release",
    "unregister",
)

# A claimed task, as a worker gets it: everything to rebuild its `Task`, and its dependencies'
# outputs (JSON text by id) for `ctx.deps`.
_CLAIM_COLUMNS = (
    "run_id, id, seq, token, kind, payload, priority, timeout, critical, metadata, attempts, "
    "depends_on, depends_on_tags, tags"
)


def identity(owner: str) -> str:
    """A process's name in the file: ``host:pid:owner`` (a coordinator's, a worker's)."""
    return f"{socket.gethostname()}:{os.getpid()}:{owner}"


# The runs this process coordinates now, as (coordinator name, run id). The file's hold on a run
# names a process, and only that process can tell whether a hold in its name is live: another
# `SQLiteStore` object's run, or one that ended but could not let go of it (its file locked or
# full then). Process-wide, as the pid in the name is.
_COORDINATING: set[tuple[str, str]] = set()


def coordinating(name: str, run_id: str, live: bool) -> None:
    """This process starts (`live`) or stops coordinating run `run_id` as `name`."""
    if live:
        _COORDINATING.add((name, run_id))
    else:
        _COORDINATING.discard((name, run_id))


def here(name: str) -> bool:
    """Whether `name` (from `identity`) is this process's."""
    host, _, rest = name.partition(":")
    return host == socket.gethostname() and rest.partition(":")[0] == str(os.getpid())


def is_alive(name: str, run_id: str | None = None) -> bool:
    """Whether the process `name` (from `identity`) may still be running: False only when it ran
    on this host and its pid is gone (another host's process cannot be checked: its heartbeat
    says). With `run_id`, whether it still coordinates that run: in this process, known here."""
    host, _, rest = name.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return True
    pid = int(pid_text)
    if pid == os.getpid():
        return run_id is None or (name, run_id) in _COORDINATING
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


# -- a worker --------------------------------------------------------------------------------------


def register(
    conn: sqlite3.Connection, name: str, run_id: str | None, kinds: Sequence[str] | None, now: float
) -> None:
    host, _, rest = name.partition(":")
    conn.execute(
        "INSERT OR REPLACE INTO workers (owner, host, pid, run_id, kinds, started, heartbeat) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        (name, host, int(rest.partition(":")[0]), run_id,
         None if kinds is None else json.dumps(list(kinds)), now, now),
    )  # fmt: skip


def unregister(conn: sqlite3.Connection, name: str) -> None:
    conn.execute("DELETE FROM workers WHERE owner = ?", (name,))


class Claimed:
    """One task a worker claimed (plain values, built in the writer thread)."""

    __slots__ = (
        "attempts",
        "critical",
        "depends_on",
        "depends_on_tags",
        "deps",
        "id",
        "kind",
        "metadata",
        "payload",
        "priority",
        "run_id",
        "seq",
        "tags",
        "timeout",
        "token",
    )

    def __init__(self, row: Sequence[Any]) -> None:
        (self.run_id, self.id, self.seq, self.token, self.kind, self.payload, self.priority,
         self.timeout, self.critical, self.metadata, self.attempts, depends_on, depends_on_tags,
         tags) = row  # fmt: skip
        self.depends_on: list[str] = [] if depends_on is None else json.loads(depends_on)
        self.depends_on_tags: list[str] = (
            [] if depends_on_tags is None else json.loads(depends_on_tags)
        )
        self.tags: list[str] = [] if tags is None else json.loads(tags)
        self.deps: dict[str, str | None] = {}  # dependency id -> its output (JSON text)


def claim(
    conn: sqlite3.Connection,
    name: str,
    run_id: str | None,
    kinds: Sequence[str] | Mapping[str, int] | None,
    n: int,
    now: float,
    lease: float,
) -> tuple[list[Claimed], list[str]]:
    """Claim up to `n` ready tasks of `kinds` (None: any; a mapping: at most so many of each) of
    the shared runs (of `run_id` only, if given), best first (priority, then admission order; runs
    oldest first), in one transaction. Returns the claimed tasks and the ids of the runs open for
    claims."""
    rooms = dict(kinds) if isinstance(kinds, Mapping) else None
    # A look first, without the write lock (WAL: readers never wait): an idle worker polling
    # takes no write transaction from the coordinator.
    kind_filter = ""
    params: tuple[Any, ...] = ()
    if kinds is not None:
        kind_filter = f" AND kind IN ({', '.join('?' * len(kinds))})"
        params = tuple(kinds)
    candidates = "SELECT id FROM runs WHERE shared = 1 AND state = 'open'" + (
        " ORDER BY created" if run_id is None else " AND id = ?"
    )
    args = () if run_id is None else (run_id,)
    runs = [r[0] for r in conn.execute(candidates, args)]
    if not runs or not any(
        conn.execute(
            f"SELECT 1 FROM tasks WHERE run_id = ? AND state = 'ready'{kind_filter} LIMIT 1",
            (run, *params),
        ).fetchone()
        for run in runs
    ):
        return [], runs
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("UPDATE workers SET heartbeat = ? WHERE owner = ?", (now, name))
        runs = [r[0] for r in conn.execute(candidates, args)]  # again, under the lock
        claimed: list[Claimed] = []
        for run in runs:
            if len(claimed) >= n:
                break
            if rooms is None:
                rows = conn.execute(
                    "UPDATE tasks SET state = 'claimed', token = token + 1, lease_owner = ?, "
                    "lease_expires = ? WHERE rowid IN (SELECT rowid FROM tasks WHERE run_id = ? "
                    f"AND state = 'ready' AND lease_owner IS NULL{kind_filter} ORDER BY priority, "
                    f"seq LIMIT ?) RETURNING {_CLAIM_COLUMNS}",
                    (name, now + lease, run, *params, n - len(claimed)),
                ).fetchall()
            else:
                rows = _claim_within(conn, name, now + lease, run, rooms, n - len(claimed))
            batch = sorted((Claimed(row) for row in rows), key=lambda c: (c.priority, c.seq))
            for task in batch:
                _dependencies(conn, task)
            claimed.extend(batch)
        if claimed:
            conn.executemany(
                "INSERT INTO events (run_id, task_id, at, event, agent, attempt, detail) "
                "VALUES (?, ?, ?, 'claimed', NULL, ?, ?)",
                [
                    (c.run_id, c.id, now, c.attempts, f"by {name} (token {c.token})")
                    for c in claimed
                ],
            )
            conn.execute(
                "UPDATE workers SET claimed = claimed + ? WHERE owner = ?", (len(claimed), name)
            )
        conn.execute("COMMIT")
    except BaseException:
        rollback(conn)
        raise
    return claimed, runs


def _claim_within(
    conn: sqlite3.Connection,
    name: str,
    expires: float,
    run: str,
    rooms: dict[str, int],
    n: int,
) -> list[Any]:
    """`claim`'s update for one run when each kind has a room of its own (`rooms`, used up here):
    the best ready rows of the kinds that still have room, at most `n`."""
    open_kinds = [kind for kind, room in rooms.items() if room > 0]
    if not open_kinds or n <= 0:
        return []
    picked: list[int] = []
    # Best first; read until `n` are picked (the kinds that are full are skipped, not claimed).
    cursor = conn.execute(
        "SELECT rowid, kind FROM tasks WHERE run_id = ? AND state = 'ready' AND lease_owner IS "
        f"NULL AND kind IN ({', '.join('?' * len(open_kinds))}) ORDER BY priority, seq",
        (run, *open_kinds),
    )
    for rowid, kind in cursor:
        if rooms[kind] > 0:
            rooms[kind] -= 1
            picked.append(rowid)
            if len(picked) >= n or not any(room > 0 for room in rooms.values()):
                break
    cursor.close()
    if not picked:
        return []
    return conn.execute(
        "UPDATE tasks SET state = 'claimed', token = token + 1, lease_owner = ?, lease_expires = ? "
        f"WHERE rowid IN ({', '.join('?' * len(picked))}) RETURNING {_CLAIM_COLUMNS}",
        (name, expires, *picked),
    ).fetchall()


def _dependencies(conn: sqlite3.Connection, task: Claimed) -> None:
    """The outputs of what `task` waited for (its dependencies, the members of its groups)."""
    if task.depends_on:
        marks = ", ".join("?" * len(task.depends_on))
        for dep_id, output in conn.execute(
            f"SELECT id, output FROM tasks WHERE run_id = ? AND id IN ({marks})",
            (task.run_id, *task.depends_on),
        ):
            task.deps[dep_id] = output
    for tag in task.depends_on_tags:
        for dep_id, output in conn.execute(
            "SELECT t.id, t.output FROM tasks AS t, json_each(t.tags) AS j "
            "WHERE t.run_id = ? AND j.value = ? ORDER BY t.seq",
            (task.run_id, tag),
        ):
            task.deps[dep_id] = output


def complete(
    conn: sqlite3.Connection,
    name: str,
    now: float,
    ends: Sequence[tuple[Any, ...]],
    attempts: Sequence[Sequence[tuple[Any, ...]]],
    failed: Sequence[tuple[str, str, int, tuple[Any, ...]]] = (),
) -> list[bool]:
    """Write what a worker's tasks came to, each only if the worker still holds its lease under
    the same token. `ends`: (outcome, output JSON, agent, error, error_type, defaulted, attempts,
    started, finished, spawned JSON, run id, task id, token); `attempts[i]`: the attempts rows
    of `ends[i]`'s failed attempts not written yet. `failed`: (run id, task id, token, attempts
    row) of attempts that failed on the worker while their tasks go on (a retry), written as
    they fail, so that a lease lost later counts them (the next attempt is numbered after them)
    and keeps them in the task's history. Returns, for each end, whether it was accepted."""
    accepted: list[bool] = []
    conn.execute("BEGIN IMMEDIATE")
    try:
        for run_id, task_id, token, row in failed:
            if conn.execute(
                "UPDATE tasks SET attempts = max(attempts, ?) WHERE run_id = ? AND id = ? "
                "AND token = ? AND lease_owner = ? AND state IN ('claimed', 'running')",
                (row[2], run_id, task_id, token, name),
            ).rowcount:
                conn.execute(
                    "INSERT INTO attempts VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row
                )
        events = []
        for end, failed in zip(ends, attempts, strict=True):
            changed = conn.execute(
                "UPDATE tasks SET state = 'done', outcome = ?, output = ?, agent = ?, error = ?, "
                "error_type = ?, defaulted = ?, attempts = ?, started = ?, finished = ?, "
                "spawned = ?, lease_owner = NULL, lease_expires = NULL "
                "WHERE run_id = ? AND id = ? AND token = ? AND lease_owner = ? "
                "AND state IN ('claimed', 'running')",
                (*end, name),
            ).rowcount
            ok = changed == 1
            accepted.append(ok)
            run_id, task_id, token = end[-3:]
            if ok:
                if failed:
                    conn.executemany(
                        "INSERT INTO attempts VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        failed,
                    )
            else:
                events.append(
                    (run_id, task_id, now, "refused", end[2], end[6],
                     f"{end[0]} from {name} refused: its lease (token {token}) is no longer held")
                )  # fmt: skip
        if events:
            conn.executemany(
                "INSERT INTO events (run_id, task_id, at, event, agent, attempt, detail) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                events,
            )
        conn.execute(
            "UPDATE workers SET completed = completed + ?, heartbeat = ? WHERE owner = ?",
            (sum(accepted), now, name),
        )
        conn.execute("COMMIT")
    except BaseException:
        rollback(conn)
        raise
    return accepted


def beat(
    conn: sqlite3.Connection, name: str, now: float, lease: float
) -> tuple[set[tuple[str, str, int]], list[str]]:
    """Extend a worker's leases; return the (run id, task id, token) it still holds, and the ids
    of the runs open for claims."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("UPDATE workers SET heartbeat = ? WHERE owner = ?", (now, name))
        conn.execute(
            "UPDATE tasks SET lease_expires = ? WHERE lease_owner = ? "
            "AND state IN ('claimed', 'running')",
            (now + lease, name),
        )
        held = {
            (r, t, k)
            for r, t, k in conn.execute(
                "SELECT run_id, id, token FROM tasks WHERE lease_owner = ? "
                "AND state IN ('claimed', 'running')",
                (name,),
            )
        }
        runs = [
            r[0] for r in conn.execute("SELECT id FROM runs WHERE shared = 1 AND state = 'open'")
        ]
        conn.execute("COMMIT")
    except BaseException:
        rollback(conn)
        raise
    return held, runs


def release(
    conn: sqlite3.Connection, name: str, held: Sequence[tuple[str, str, int]] | None
) -> int:
    """Hand back tasks a worker claimed and did not complete (it is stopping; or `held`, the
    (run id, task id, token) of each, are ones it will not run): ready again, no attempt
    counted. `held` None: every task it still holds. Returns how many were still its own."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        count = 0
        if held is None:
            count = conn.execute(
                "UPDATE tasks SET state = 'ready', token = token + 1, lease_owner = NULL, "
                "lease_expires = NULL WHERE lease_owner = ? AND state = 'claimed'",
                (name,),
            ).rowcount
            held = ()
        for run_id, task_id, token in held:
            count += conn.execute(
                "UPDATE tasks SET state = 'ready', token = token + 1, lease_owner = NULL, "
                "lease_expires = NULL WHERE run_id = ? AND id = ? AND token = ? "
                "AND lease_owner = ? AND state = 'claimed'",
                (run_id, task_id, token, name),
            ).rowcount
        conn.execute("COMMIT")
    except BaseException:
        rollback(conn)
        raise
    return count


# -- the coordinator -------------------------------------------------------------------------------


def claim_offered(conn: sqlite3.Connection, run_id: str, task_id: str, owner: str) -> bool:
    """The coordinator `owner` takes one of its own ready rows (one a worker could claim too):
    True if it was still ready, and the run still its own (one statement: atomic on its own; a
    coordinator paused past its lease and replaced must not take its successor's rows)."""
    return (
        conn.execute(
            "UPDATE tasks SET state = 'claimed' WHERE run_id = ? AND id = ? AND state = 'ready' "
            "AND lease_owner IS NULL AND EXISTS (SELECT 1 FROM runs WHERE id = ? AND owner = ?)",
            (run_id, task_id, run_id, owner),
        ).rowcount
        == 1
    )


class Polled:
    """What the coordinator's window learned of its shared run (built in the writer thread)."""

    __slots__ = ("done", "done_attempts", "expired", "expired_attempts", "released", "workers")

    def __init__(self) -> None:
        self.workers: list[str | None] = []  # the kinds (JSON) of the live workers for this run
        self.expired: list[tuple[str, str, int]] = []  # (task id, its lost worker, attempts)
        self.expired_attempts: list[tuple[Any, ...]] = []  # their failed attempts' rows
        self.done: list[tuple[Any, ...]] = []  # the rows workers completed
        self.done_attempts: list[tuple[Any, ...]] = []  # their failed attempts' rows
        self.released: list[str] = []  # tasks of `remote` a worker handed back: ready, unleased


def poll(
    conn: sqlite3.Connection,
    run_id: str,
    now: float,
    lease: float,
    shared: bool,
    remote: Sequence[str] = (),
) -> Polled:
    """Inside the coordinator's write transaction: the live workers that may serve the run and,
    once workers may hold its rows (`shared`: the run is shared, or a resumed run has tasks a
    worker held), the leases expired (taken back, the attempt counted), the rows workers
    completed, and which of the tasks the coordinator takes for workers' (`remote`) are ready
    and unleased again (a stopping worker handed them back: nothing else would bring them back
    to it)."""
    polled = Polled()
    polled.workers = [
        kinds
        for (kinds,) in conn.execute(
            "SELECT kinds FROM workers WHERE heartbeat > ? AND (run_id IS NULL OR run_id = ?)",
            (now - lease, run_id),
        )
    ]
    if not shared:
        return polled
    expired = conn.execute(
        "SELECT id, lease_owner, attempts + 1 FROM tasks WHERE lease_owner IS NOT NULL "
        "AND run_id = ? AND lease_expires < ? AND state IN ('claimed', 'running')",
        (run_id, now),
    ).fetchall()
    if expired:  # held by the coordinator (no worker may claim them) until it decides: ready
        # again, or failed for good (`Sharing._expired`)
        conn.executemany(
            "UPDATE tasks SET state = 'claimed', token = token + 1, attempts = ?, "
            "lease_owner = NULL, lease_expires = NULL WHERE run_id = ? AND id = ?",
            [(attempts, run_id, task_id) for task_id, _, attempts in expired],
        )
        polled.expired = expired
        # What the lost workers wrote of the attempts that failed there before (a retry):
        # history the coordinator has not heard of yet.
        polled.expired_attempts = _attempts_of(conn, run_id, [row[0] for row in expired])
    if remote:
        polled.released = [
            task_id
            for (task_id,) in conn.execute(
                "SELECT id FROM tasks WHERE run_id = ? AND id IN (SELECT value FROM json_each(?)) "
                "AND state = 'ready' AND lease_owner IS NULL",
                (run_id, json.dumps(list(remote))),
            )
        ]
    polled.done = conn.execute(
        "SELECT id, outcome, output, agent, error, error_type, defaulted, attempts, started, "
        "finished, spawned FROM tasks WHERE run_id = ? AND state = 'done'",
        (run_id,),
    ).fetchall()
    if polled.done:
        polled.done_attempts = _attempts_of(conn, run_id, [row[0] for row in polled.done])
    return polled


def _attempts_of(conn: sqlite3.Connection, run_id: str, ids: Sequence[str]) -> list[Any]:
    """The attempts rows of the tasks `ids` of a run, in the order they were written."""
    rows: list[Any] = []
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        rows.extend(
            conn.execute(
                "SELECT task_id, number, agent, error_type, message, started, duration, "
                "retry_in, traceback, status_code, api_error_type, request_id FROM attempts "
                f"WHERE run_id = ? AND task_id IN ({', '.join('?' * len(chunk))}) "
                "ORDER BY rowid",
                (run_id, *chunk),
            ).fetchall()
        )
    return rows
