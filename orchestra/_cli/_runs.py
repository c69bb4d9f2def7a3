"""`orchestra runs`: the durable runs of a SQLite file (`SQLiteStore`) or of a PostgreSQL database
(`PostgresStore`), read and retried.

``list``, ``show RUN_ID [--events] [--task ID] [--jsonl]``, ``dead RUN_ID [--jsonl]``, ``retry RUN_ID
[--task ID ...]``, ``workers [--jsonl]``, each with ``--db FILE`` or ``--dsn URL`` (one of them). Each
command is a thin shell over the store's Python API (`.runs`, `.events`, `.dead_letters`,
`.retry`, `.workers`, the same on both stores): tables on stdout through rich, JSON lines with
``--jsonl`` (one object a line, for `jq` and friends). Exit codes as the rest of the CLI: 0, and 2
for a usage error (a missing file, an unknown run or task id, a file that is not a SQLite store, a
database that cannot be reached). A DSN's password is never printed.
"""

from __future__ import annotations

import json
import re
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final
from urllib.parse import unquote, urlsplit

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .._exceptions import ConfigError, InputError, StoreError
from .._failure import with_type
from ..stores import SQLiteStore
from ..stores._sqlite import _leases as leases

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..stores._postgres._store import PostgresStore

__all__ = ("runs_app",)

USAGE: Final = 2

runs_app = typer.Typer(
    name="runs",
    help="Inspect and retry the durable runs of a SQLite file (--db) or a PostgreSQL database "
    "(--dsn).",
    no_args_is_help=True,
    add_completion=False,
)

Db = Annotated[
    Path | None,
    typer.Option(
        "--db", help="The SQLite file the runs are kept in (SQLiteStore).", show_default=False
    ),
]
Dsn = Annotated[
    str | None,
    typer.Option(
        "--dsn",
        help="The PostgreSQL database the runs are kept in (PostgresStore), as "
        "postgresql://user@host:port/database (a password may stand after the user, or come "
        "from PGPASSWORD or ~/.pgpass, out of the command line).",
        show_default=False,
    ),
]
RunId = Annotated[str, typer.Argument(help="The run id (`orch.run(..., run_id=...)`).")]
Jsonl = Annotated[
    bool, typer.Option("--jsonl", help="JSON lines on stdout, one object a line, not a table.")
]


def _stdout() -> Console:
    # Piped (not a terminal), a table is not cut to rich's default of 80 columns: lines stay whole
    # for grep.
    width = None if sys.stdout.isatty() else 200
    # No markup: what is printed is the user's (run and task ids, error messages, tracebacks), and
    # rich would eat "[redacted]" or fail on a "[/x]" in it.
    return Console(highlight=False, soft_wrap=True, width=width, markup=False)


def _fail(message: str) -> typer.Exit:
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"[bold red]orchestra:[/] {escape(message)}", markup=True
    )
    return typer.Exit(USAGE)


def _hidden(text: str, dsn: str) -> str:
    """`text` with the password of `dsn` masked, wherever it appears (a driver's message may
    quote the DSN)."""
    try:
        password = urlsplit(dsn).password
    except ValueError:  # an unreadable DSN: mask whatever stands between "user:" and "@"
        password = None
        found = re.match(r"[^:]+://[^:@/]*:([^@]*)@", dsn)
        if found:
            password = found.group(1)
    if password:
        for form in dict.fromkeys((password, unquote(password))):  # as written, and decoded
            text = text.replace(form, "***")
    return text


def _postgres(dsn: str) -> PostgresStore:
    try:
        from ..stores import PostgresStore
    except ModuleNotFoundError as exc:  # (its message says which extra to install)
        raise _fail(str(exc)) from None
    try:
        return PostgresStore(dsn)
    except ConfigError as exc:
        raise _fail(_hidden(str(exc), dsn)) from None


def _read(db: Path | None, dsn: str | None, read: Callable[[Any], Any]) -> Any:
    """`read(store)` on the file (`--db`) or the database (`--dsn`), its refusals (no such file,
    database, run or task; not a store) as usage errors: a message on stderr and exit code 2,
    never a traceback."""
    if (db is None) == (dsn is None):
        raise _fail(
            "give where the runs are kept: --db FILE (a SQLiteStore's file) or --dsn URL "
            "(a PostgresStore's database)" + (", not both" if db is not None else "")
        )
    if dsn is not None:
        return _read_postgres(dsn, read)
    assert db is not None
    if not db.is_file():
        raise _fail(f"{str(db)!r}: no such file (give the SQLite file of a SQLiteStore with --db)")
    store = SQLiteStore(db)
    try:
        return read(store)
    except (InputError, StoreError) as exc:
        raise _fail(str(exc)) from None
    finally:
        store.close()


def _read_postgres(dsn: str, read: Callable[[Any], Any]) -> Any:
    store = _postgres(dsn)
    import asyncpg  # (installed: the store `_postgres` made needs it)

    from ..stores._postgres import _admin
    from ..stores._postgres._database import where

    try:
        # Asked first: opening the store makes orchestra's schema in a database that has none,
        # and a command that reads must not make it in a database given by mistake.
        if not store.database.spawn(_admin.made, dsn).result():
            raise _fail(
                f"{where(dsn)} has no orchestra runs (no orchestra schema): give the DSN of the "
                "database a PostgresStore keeps its runs in"
            )
        return read(store)
    # A DSN asyncpg cannot read (a bad port, an unknown sslmode) it refuses with a ValueError or
    # an InterfaceError, before any connection; a user the database does not let read
    # orchestra's tables gets a PostgresError (permission denied).
    except (
        InputError,
        StoreError,
        ValueError,
        asyncpg.InterfaceError,
        asyncpg.PostgresError,
    ) as exc:
        raise _fail(_hidden(str(exc), dsn)) from None
    finally:
        store.close()


def _coordinator(run: dict[str, Any], now: float) -> str:
    """The process running a run now (``host:pid``, "shared" when workers may claim from it; on
    PostgreSQL the coordinator's name, while its lease holds)."""
    if "held" in run:  # PostgreSQL: the lease, judged on the database's clock
        return str(run["owner"]) if run["held"] and run["owner"] else ""
    owner, seen, lease = run.get("owner"), run.get("heartbeat"), run.get("lease") or 30.0
    if owner is None or seen is None or now - seen >= lease or not leases.is_alive(owner):
        return ""  # none, or it is gone (its lease lapsed, or its pid on this host ended)
    host, _, rest = owner.partition(":")
    return f"{host}:{rest.partition(':')[0]}" + (", shared" if run.get("shared") else "")


def _when(at: float | None) -> str:
    return (
        "" if at is None else datetime.fromtimestamp(at).isoformat(sep=" ", timespec="milliseconds")
    )


def _jsonl(rows: list[dict[str, Any]]) -> None:
    out = sys.stdout
    for row in rows:
        out.write(json.dumps(row, default=str) + "\n")
    out.flush()


@runs_app.command("list")
def list_runs(db: Db = None, dsn: Dsn = None, jsonl: Jsonl = False) -> None:
    """Every run in the store, oldest first, with its tasks counted by state."""
    runs: list[dict[str, Any]] = _read(db, dsn, lambda store: store.runs())
    if jsonl:
        _jsonl(runs)
        return
    table = Table("run id", "state", "created", "updated", "opened", "run by", "tasks")
    now = time.time()
    for run in runs:
        counts = run["counts"]
        table.add_row(
            run["id"],
            run["state"],
            _when(run["created"]),
            _when(run["updated"]),
            str(run["opened"]),
            _coordinator(run, now),
            ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "none",
        )
    _stdout().print(table)


@runs_app.command("workers")
def list_workers(db: Db = None, dsn: Dsn = None, jsonl: Jsonl = False) -> None:
    """The worker processes of the store (`orchestra worker`), live or gone."""
    found: list[dict[str, Any]] = _read(db, dsn, lambda store: store.workers())
    if jsonl:
        _jsonl(found)
        return
    table = Table("worker", "run", "kinds", "live", "last seen", "claimed", "completed", "holding")
    for worker in found:
        table.add_row(
            worker["owner"],
            worker["run_id"] or "any",
            ", ".join(worker["kinds"] or ()) or "any",
            "yes" if worker["live"] else "no",
            _when(worker["heartbeat"]),
            str(worker["claimed"]),
            str(worker["completed"]),
            str(worker["holding"]),
        )
    _stdout().print(table)


@runs_app.command()
def show(
    run_id: RunId,
    db: Db = None,
    dsn: Dsn = None,
    events: Annotated[bool, typer.Option("--events", help="The run's journal, in order.")] = False,
    task: Annotated[
        str | None, typer.Option("--task", help="One task's journal, from admitted to its end.")
    ] = None,
    jsonl: Jsonl = False,
) -> None:
    """A run: its tasks counted by state; with --events its journal, with --task one task's."""
    if events or task is not None or jsonl:
        journal: list[dict[str, Any]] = _read(db, dsn, lambda store: store.events(run_id, task))
        if jsonl:
            _jsonl(journal)
            return
        table = Table("at", "task", "event", "agent", "attempt", "detail")
        for event in journal:
            table.add_row(
                _when(event["at"]),
                event["task_id"] or "",
                event["event"],
                event["agent"] or "",
                "" if event["attempt"] is None else str(event["attempt"]),
                event["detail"] or "",
            )
        _stdout().print(table)
        return
    runs: list[dict[str, Any]] = _read(db, dsn, lambda store: store.runs())
    run = next((r for r in runs if r["id"] == run_id), None)
    if run is None:
        _read(db, dsn, lambda store: store.events(run_id))  # the store's refusal, naming the runs
        return
    console = _stdout()
    console.print(f"run {run['id']}: {run['state']}, opened {run['opened']} time(s)")
    console.print(f"created {_when(run['created'])}, updated {_when(run['updated'])}")
    table = Table("state", "tasks")
    for state, n in sorted(run["counts"].items()):
        table.add_row(state, str(n))
    console.print(table)


@runs_app.command()
def dead(run_id: RunId, db: Db = None, dsn: Dsn = None, jsonl: Jsonl = False) -> None:
    """The dead letters of a run: the tasks that failed for good, each with every attempt."""
    letters: list[dict[str, Any]] = _read(db, dsn, lambda store: store.dead_letters(run_id))
    if jsonl:
        _jsonl(letters)
        return
    console = _stdout()
    if not letters:
        console.print(f"run {run_id}: no dead letters")
    for letter in letters:
        error = with_type(letter["error_type"], letter["error"] or "")
        console.print(
            f"[bold]{escape(letter['task_id'])}[/] ({escape(letter['kind'])}): {escape(error)} "
            f"after {letter['attempts']} attempt(s)",
            markup=True,
        )
        for attempt in letter["attempts_list"]:
            console.print(
                f"  attempt {attempt['number']} on {attempt['agent']} at "
                f"{_when(attempt['started'])}: {attempt['error_type']}: {attempt['message']}"
            )
            if attempt["traceback"]:
                console.print("    " + attempt["traceback"].rstrip().replace("\n", "\n    "))


@runs_app.command()
def retry(
    run_id: RunId,
    db: Db = None,
    dsn: Dsn = None,
    task: Annotated[
        list[str] | None,
        typer.Option("--task", help="A failed task to retry (repeat it); all of them without."),
    ] = None,
) -> None:
    """Make failed tasks runnable again: with --db the next run of this run id on the file runs
    them; with --dsn any worker serving the run at once, or the run's next coordinator."""
    reopened: list[str] = _read(db, dsn, lambda store: store.retry(run_id, task or None))
    console = _stdout()
    if not reopened:
        console.print(f"run {run_id}: no failed task to retry")
        return
    again = f"run {run_id}: {len(reopened)} failed task(s) runnable again ({', '.join(reopened)}); "
    if dsn is not None:
        # (the DSN is not printed: it may hold a password)
        console.print(
            again + "workers serving the run (orchestra worker --dsn $DSN) run them now, what "
            "waits for them after them; without one, run it again: orchestra run "
            f"MODULE:FACTORY INPUT.jsonl --dsn $DSN --run-id {run_id} (from Python: "
            f"orch.run(..., run_id={run_id!r}) on a PostgresStore of this database)"
        )
        return
    console.print(
        again + f"run them with the run's command and input again: orchestra run MODULE:FACTORY "
        f"INPUT.jsonl --db {db} --run-id {run_id} (from Python: orch.run(..., "
        f"run_id={run_id!r}) on this file)"
    )
