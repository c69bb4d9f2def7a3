"""``orchestra serve`` (the service under uvicorn) and ``orchestra tokens`` (its bearer tokens).

Both keep to one store: ``--db FILE`` (a SQLiteStore's file, ./orchestra.db by default) or
``--dsn URL`` (a PostgresStore's database). The tokens live in that database, hashed; a token's
text is printed once, when it is made.
"""

from __future__ import annotations

import json
import math
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


def _store(db: Path | None, dsn: str | None) -> Any:
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
        return PostgresStore(dsn)
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
) -> None:
    """Serve the REST API: submit, watch and steer runs over HTTP (the service extra).

    Every endpoint but /health and /ready needs a bearer token: make one with `orchestra tokens
    create --role ROLE` on the same --db or --dsn. The dashboard is at / (open it in a browser
    and paste a read token to watch, an admin one to pause, resume, cancel and stop). SIGTERM or
    Ctrl-C stops gracefully: no new request, the live runs stopped within --grace.
    """
    try:
        import uvicorn

        from .._service._app import create_app
    except ModuleNotFoundError as exc:
        raise _fail(str(missing_extra("orchestra serve", "service", exc))) from None
    try:
        orch: Orchestrator = load_orchestrator(agents)
    except (ConfigError, InputError) as exc:
        raise _fail(str(exc)) from None
    store = _store(db, dsn)
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
