"""``orchestra serve`` (the service under uvicorn) and ``orchestra tokens`` (its bearer tokens).

Both keep to one store: ``--db FILE`` (a SQLiteStore's file, ./orchestra.db by default) or
``--dsn URL`` (a PostgresStore's database). The tokens live in that database, hashed; a token's
text is printed once, when it is made.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .._exceptions import ConfigError, InputError, StoreError
from .._extras import missing_extra
from ..stores import SQLiteStore
from ._batch import load_orchestrator

if TYPE_CHECKING:
    from .._core._orchestrator import Orchestrator

__all__ = ("serve", "tokens_app")

USAGE: Final = 2
DEFAULT_DB: Final = Path("orchestra.db")

Db = Annotated[
    Path | None,
    typer.Option(
        "--db",
        metavar="FILE",
        help="The SQLite file the runs and tokens are kept in (default ./orchestra.db).",
        show_default=False,
    ),
]
Dsn = Annotated[
    str | None,
    typer.Option(
        "--dsn",
        metavar="URL",
        help="The PostgreSQL database the runs and tokens are kept in, as "
        "postgresql://user@host:port/database (the postgres extra).",
        show_default=False,
    ),
]


def _fail(message: str) -> typer.Exit:
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"[bold red]orchestra:[/] {escape(message)}", markup=True
    )
    return typer.Exit(USAGE)


def _store(db: Path | None, dsn: str | None, lease: float | None = None) -> Any:
    """The store of `--db` or `--dsn` (./orchestra.db without either)."""
    if db is not None and dsn is not None:
        raise _fail("give --db FILE or --dsn URL, not both")
    try:
        if dsn is None:
            return SQLiteStore(db or DEFAULT_DB)
        try:
            from ..stores._postgres._store import PostgresStore
        except ImportError as exc:
            raise _fail(str(missing_extra("--dsn", "postgres", exc))) from None
        return PostgresStore(dsn) if lease is None else PostgresStore(dsn, lease=lease)
    except (ConfigError, StoreError) as exc:
        raise _fail(str(exc)) from None


def serve(
    agents: Annotated[
        str,
        typer.Option(
            "--agents",
            metavar="MODULE:NAME",
            help="The agents: an Orchestrator, a list of agents, or a function returning one "
            "(package.module:name or path/to/file.py:name). Its store is replaced by --db/--dsn.",
            show_default=False,
        ),
    ],
    db: Db = None,
    dsn: Dsn = None,
    host: Annotated[str, typer.Option("--host", help="The address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="The port to listen on.", min=0)] = 8000,
    cors_origin: Annotated[
        str | None,
        typer.Option(
            "--cors-origin",
            metavar="ORIGIN",
            help="Let browser pages of this one origin call the API (CORS is off without it).",
            show_default=False,
        ),
    ] = None,
    max_body: Annotated[
        int,
        typer.Option("--max-body", metavar="BYTES", help="The largest request body.", min=1),
    ] = 4 * 1024 * 1024,
    grace: Annotated[
        float,
        typer.Option(
            "--grace",
            metavar="SECONDS",
            help="On SIGTERM or Ctrl-C: how long the live runs' attempts may take to finish.",
            min=0,
        ),
    ] = 10.0,
    workers_token: Annotated[
        str | None,
        typer.Option(
            "--workers-token",
            metavar="TOKEN",
            envvar="ORCHESTRA_WORKERS_TOKEN",
            help="A token (32 characters or more) the service accepts with the worker role, kept "
            "hashed like the others: the one HTTP workers are started with. Read from "
            "$ORCHESTRA_WORKERS_TOKEN too, out of the process list.",
            show_default=False,
        ),
    ] = None,
    lease: Annotated[
        float | None,
        typer.Option(
            "--lease",
            metavar="SECONDS",
            help="With --dsn: how long this replica's hold on its runs lasts unrenewed (renewed "
            "every third of it): a replica killed has its runs taken over by another this long "
            "after (default 30).",
            min=0.1,
            show_default=False,
        ),
    ] = None,
) -> None:
    """Serve the REST API: submit, watch and steer runs over HTTP (the service extra).

    Every endpoint but /health and /ready needs a bearer token: make one with `orchestra tokens
    create --role ROLE` on the same --db or --dsn. The dashboard is at / (open it in a browser
    and paste a read token to watch, a control one to pause, resume, cancel and stop). SIGTERM or
    Ctrl-C stops gracefully: no new request, the live runs stopped within --grace. Several
    replicas may serve one --dsn; a SQLite file is served by one process.
    """
    try:
        import uvicorn

        from .._service._app import create_app
    except ModuleNotFoundError as exc:
        raise _fail(str(missing_extra("orchestra serve", "service", exc))) from None
    try:
        orch: Orchestrator = load_orchestrator(agents, _metrics())
    except (ConfigError, InputError) as exc:
        raise _fail(str(exc)) from None
    if lease is not None and dsn is None:
        raise _fail("--lease is for --dsn (replicas on PostgreSQL); a SQLite file has one")
    # One service process per SQLite file: held until this process ends.
    lock = _serve_lock(db or DEFAULT_DB) if dsn is None else None
    store = _store(db, dsn, lease)
    try:
        if workers_token is not None:
            from .._service._tokens import Tokens

            Tokens(store).ensure(workers_token, "worker", "workers (--workers-token)")
        orch.store = store
        app = create_app(orch, cors_origin=cors_origin, max_body=max_body, grace=grace)
        # uvicorn's own handling of SIGINT / SIGTERM: stop accepting, finish the requests under
        # way, then the app's lifespan ends (the live runs stopped within `grace`).
        uvicorn.run(
            app,
            host=host,
            port=port,
            log_level="info",
            timeout_graceful_shutdown=math.ceil(grace),
        )
    except (ConfigError, InputError, StoreError) as exc:
        raise _fail(str(exc)) from None
    finally:
        store.close()
        if lock is not None:
            lock.close()


def _serve_lock(db: Path) -> Any:
    """Hold the lock that says a service process serves the SQLite file `db`, or fail saying
    which process does. A SQLite file is one machine's, and a service process keeps the runs it
    started in its memory (their control, their results): a second one would start runs the
    first cannot control nor take over. An OS lock on a file beside it (``FILE.serve.lock``),
    which the system lets go of when the process ends however it ends (a SIGKILL too): no stale
    lock to clean up. (fcntl's, as the embedded PostgreSQL server's directory lock; not on
    Windows, where the lock is not taken.)"""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        return None
    path = db.with_name(db.name + ".serve.lock")
    try:
        lock = open(path, "a+")  # noqa: SIM115 - held open for the process's life
    except OSError as exc:
        raise _fail(
            f"cannot make {path} (the lock of the one process serving {db}): {exc}"
        ) from None
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        pid = lock.read().strip() or "unknown"
        lock.close()
        raise _fail(
            f"another `orchestra serve` (pid {pid}) serves {db}: a SQLite file is served by one "
            "process (one machine's file); to run several replicas, serve a PostgreSQL database "
            "(--dsn)"
        ) from None
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


tokens_app = typer.Typer(
    name="tokens",
    help="Make, list and revoke the service's bearer tokens (kept hashed in --db or --dsn).",
    no_args_is_help=True,
    add_completion=False,
)


def _tokens(db: Path | None, dsn: str | None) -> Any:
    from .._service._tokens import Tokens

    return Tokens(_store(db, dsn))


@tokens_app.command("create")
def create_token(
    role: Annotated[
        str,
        typer.Option(
            "--role", help="submit, read, control, worker or admin (all).", show_default=False
        ),
    ],
    name: Annotated[
        str | None, typer.Option("--name", help="A name to list and revoke it by.")
    ] = None,
    db: Db = None,
    dsn: Dsn = None,
) -> None:
    """Make a token and print it (once: only its hash is kept)."""
    tokens = _tokens(db, dsn)
    try:
        token, info = tokens.create(role, name)
    except (InputError, StoreError) as exc:
        raise _fail(str(exc)) from None
    finally:
        tokens.store.close()
    print(token)
    Console(stderr=True, highlight=False).print(
        f"token {info.id} ({info.role}{', ' + info.name if info.name else ''}): keep it, it is "
        "not shown again",
        markup=False,
    )


@tokens_app.command("list")
def list_tokens(
    db: Db = None,
    dsn: Dsn = None,
    jsonl: Annotated[bool, typer.Option("--jsonl", help="JSON lines, not a table.")] = False,
) -> None:
    """Every token (never its text): id, name, role, when made, when revoked."""
    tokens = _tokens(db, dsn)
    try:
        found = tokens.listed()
    except StoreError as exc:
        raise _fail(str(exc)) from None
    finally:
        tokens.store.close()
    if jsonl:
        for info in found:
            sys.stdout.write(json.dumps(info.to_dict()) + "\n")
        return
    table = Table("id", "name", "role", "created", "revoked")
    for info in found:
        table.add_row(info.id, info.name or "", info.role, _when(info.created), _when(info.revoked))
    Console(highlight=False, markup=False).print(table)


@tokens_app.command("revoke")
def revoke_token(
    which: Annotated[str, typer.Argument(metavar="ID_OR_NAME", help="The token's id or name.")],
    db: Db = None,
    dsn: Dsn = None,
) -> None:
    """Revoke a token (every token of that name): the service refuses it from its next request."""
    tokens = _tokens(db, dsn)
    try:
        revoked = tokens.revoke(which)
    except StoreError as exc:
        raise _fail(str(exc)) from None
    finally:
        tokens.store.close()
    if not revoked:
        raise _fail(f"no token with the id or name {which!r} (see `orchestra tokens list`)")
    print(f"revoked: {', '.join(info.id for info in revoked)}")


def _when(at: float | None) -> str:
    if at is None:
        return ""
    from datetime import datetime

    return datetime.fromtimestamp(at).isoformat(sep=" ", timespec="seconds")


def _metrics() -> list[Any]:
    """`/metrics`'s collector for an orchestrator this command builds from a list of agents: the
    metrics extra's `PrometheusMetrics` when prometheus_client is here, else none (the route then
    says what to install). One the user built keeps its own instruments."""
    try:
        from ..metrics import PrometheusMetrics
    except ModuleNotFoundError:  # prometheus_client is the metrics extra's
        return []
    return [PrometheusMetrics()]
