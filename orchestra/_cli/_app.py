"""The `orchestra` command (typer and rich, the `cli` extra): `demo`, `run`, `worker`, `bench`,
`runs`, `serve`, `tokens`, `--version`.

Exit codes: 0 success, 1 failed, 2 usage error (bad arguments, a factory that does not load, an input
line that is not a task), 3 partial, 130 interrupted (Ctrl-C, or a run that ended cancelled).

Each command builds what it runs and hands it to one function that runs it and reports
(`run_demo`, `run_job`), through `orchestra._cli._console.watch`: the live view on stderr, SIGINT /
SIGTERM as a graceful stop (a second one cancels at once; the results written so far stay written
and the command exits 130), and, when stdin is a terminal, keys: p pause, r resume, s stop, c cancel.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import re
import runpy
import signal
import sys
import tomllib
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any, Final

import typer
from rich.console import Console
from rich.markup import escape

from .._core._orchestrator import LocalRuns
from .._exceptions import ConfigError, InputError, StoreError
from .._extras import missing_extra
from .._failure import describe, format_traceback, scrub, with_type
from .._version import __version__
from ..stores import SQLiteStore
from ..stores._worker import Worker, backend_of
from ._batch import EXIT_CODES, Batch, load_orchestrator, read_batch
from ._console import KEYS, watch
from ._runs import runs_app
from ._serve import serve, tokens_app

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator
    from contextlib import AbstractAsyncContextManager

    from .._core._orchestrator import Orchestrator
    from .._result import RunResult
    from ..stores._postgres._store import PostgresStore
    from ..stores._worker import Backend, WorkReport

__all__ = ("app", "main", "run_demo", "run_job")

INTERRUPTED: Final = 130
USAGE: Final = 2

app = typer.Typer(
    name="orchestra",
    help="Run many agent calls in parallel, safely.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",
    # A traceback of the user's factory or agents must not print their locals (API keys).
    pretty_exceptions_show_locals=False,
)


def _stderr() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def _fail(message: str, code: int = USAGE) -> typer.Exit:
    # The message holds the user's text (paths, exception messages): scrubbed of secrets, and
    # escaped, never read as markup.
    _stderr().print(f"[bold red]orchestra:[/] {escape(scrub(message))}", markup=True)
    return typer.Exit(code)


def _crashed(exc: BaseException) -> str:
    """Print the traceback of `exc` on stderr, bounded and scrubbed of secrets (neither Python's
    nor rich's would be), and return its type and message, scrubbed, for the closing line."""
    tb = format_traceback(exc)
    if tb:
        sys.stderr.write(tb)
        sys.stderr.flush()
    failure = describe(exc)
    return with_type(failure.error_type, failure.message)


def _load(target: str) -> Orchestrator:
    """`load_orchestrator`; a usage error (exit 2) when it fails. What the user's module or factory
    raised is its own bug: shown with its traceback, then named."""
    try:
        return load_orchestrator(target)
    except (ConfigError, InputError) as exc:
        raise _fail(str(exc)) from None
    except Exception as exc:
        raise _fail(f"{target} did not load: {_crashed(exc)}") from None


def _show_version(value: bool) -> None:
    if value:
        print(f"orchestra {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_show_version, is_eager=True, help="Show the version and exit."
        ),
    ] = False,
) -> None:
    """Run many agent calls in parallel, safely: priorities, limits, retries, fallbacks, circuit
    breakers and one structured result.

    Exit codes: 0 success, 1 failed, 2 usage error, 3 partial, 130 interrupted.
    """


# -- demo -----------------------------------------------------------------------------------------


@app.command()
def demo() -> None:
    """Run the bundled quickstart: simulated agents, no API key needed.

    Contracts are split into clauses, researched, summarised and verified, first one at a time,
    then 20 at once with one research agent rate limited and another going down mid-run. About
    five seconds.
    """
    try:
        result = asyncio.run(run_demo())
    except KeyboardInterrupt:
        raise _fail("interrupted", INTERRUPTED) from None
    if result.status == "cancelled":  # a signal or a key stopped it: exit as `orchestra run` does
        raise _fail("interrupted", INTERRUPTED)


async def run_demo() -> RunResult:
    """The demo, each of its runs with the live view on stderr (and signals as a graceful stop)."""
    from . import _demo

    return await _demo.main(run=_watched)


async def _watched(orch: Orchestrator, input: Any) -> RunResult:
    return await watch(orch, input)


# -- run ------------------------------------------------------------------------------------------


@app.command()
def run(
    target: Annotated[
        str,
        typer.Argument(
            metavar="MODULE:FACTORY",
            help="An Orchestrator, or a function returning one: package.module:name or "
            "path/to/file.py:name (the current directory is importable).",
            show_default=False,
        ),
    ],
    input: Annotated[
        Path,
        typer.Argument(
            metavar="INPUT.jsonl",
            help='One JSON value a line, \'-\' for stdin: tasks ({"kind": ..., "payload": ...}) '
            "or, when the orchestrator has a decomposer, its input items.",
            allow_dash=True,
            show_default=False,
        ),
    ],
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            metavar="RESULTS.jsonl",
            help="Where the task results go, one JSON line each as they finish (stdout by default).",
            allow_dash=True,
        ),
    ] = None,
    grace: Annotated[
        float,
        typer.Option(
            "--grace",
            metavar="SECONDS",
            help="On Ctrl-C (or SIGTERM, or the s key): how long running attempts may take to "
            "finish before they are cancelled. A second Ctrl-C cancels at once.",
            min=0,
        ),
    ] = 10.0,
    db: Annotated[
        Path | None,
        typer.Option(
            "--db",
            metavar="FILE",
            help="Keep the run in this SQLite file (SQLiteStore, created if missing), so that it "
            "can be resumed after a crash or a stop, and its failed tasks retried: run the same "
            "command again with its --run-id.",
            show_default=False,
        ),
    ] = None,
    dsn: Annotated[
        str | None,
        typer.Option(
            "--dsn",
            metavar="URL",
            help="Keep the run in this PostgreSQL database (PostgresStore, the postgres extra): "
            "workers on other machines join it (`orchestra worker --dsn`), and the same command "
            "run again with its --run-id resumes it, or, while the run's coordinator lives, "
            "waits as its standby and takes the run over if it dies.",
            show_default=False,
        ),
    ] = None,
    run_id: Annotated[
        str | None,
        typer.Option(
            "--run-id",
            metavar="ID",
            help="The run's id (a fresh one by default, printed at the end). With --db or "
            "--dsn, an id the store already holds resumes that run: what succeeded is not run "
            "again, what `orchestra runs retry` reopened runs again.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Run your orchestrator over a JSONL input: results as JSONL, a summary on stderr.

    With --db the run is kept in a SQLite file, with --dsn in a PostgreSQL database: the same
    command with --run-id resumes it (give the same input again) or runs the tasks `orchestra
    runs retry` reopened.

    Exit code: 0 success, 1 failed, 3 partial, 130 interrupted or cancelled, 2 usage error.
    """
    orch = _load(target)
    store: Any = None
    if db is not None and dsn is not None:
        raise _fail("give --db FILE or --dsn URL, not both")
    if db is not None or dsn is not None:
        try:
            store = SQLiteStore(db) if db is not None else _postgres(dsn)
        except (ConfigError, StoreError) as exc:
            raise _fail(str(exc)) from None
        orch.store = store  # the factory made it for this command: its runs go there
    try:
        source = "stdin" if str(input) == "-" else str(input)
        with _reading(input) as stream:
            batch = read_batch(orch, stream, source=source)
    except (ConfigError, InputError) as exc:
        raise _fail(str(exc)) from None
    except OSError as exc:
        raise _fail(f"cannot read {input}: {exc.strerror or exc}") from None
    keys = _keys() if str(input) != "-" else None  # stdin is the input: no keys
    try:
        with _writing(output) as out:
            result = run_job(batch, out, keys=keys, grace=grace, run_id=run_id)
    except OSError as exc:
        raise _fail(f"cannot write {output}: {exc.strerror or exc}") from None
    except KeyboardInterrupt:  # where signals cannot be caught (Windows)
        where = "stdout" if output is None or str(output) == "-" else str(output)
        raise _fail(
            f"interrupted: {batch.written} task results written to {where}", INTERRUPTED
        ) from None
    # A streamed input's bad task, or the decomposer's; a bad --run-id; a file that fails.
    except (InputError, ConfigError, StoreError) as exc:
        raise _fail(str(exc)) from None
    finally:
        if store is not None:
            store.close()
    console = _stderr()
    console.print(result.summary(), markup=False)
    if result.status == "cancelled":
        where = "stdout" if output is None or str(output) == "-" else str(output)
        console.print(f"{batch.written} task results written to {where}", markup=False)
    if db is not None:
        for line in _resume_hints(result, target, input, f"--db {db}", str(db)):
            console.print(line, markup=False)
    elif dsn is not None:  # (the DSN is not printed: it may hold a password)
        for line in _resume_hints(result, target, input, "--dsn $DSN", repr(store)):
            console.print(line, markup=False)
    raise typer.Exit(EXIT_CODES[result.status])


def _postgres(dsn: str | None) -> Any:
    """`PostgresStore(dsn)`, or the error that says which extra to install."""
    try:
        from orchestra.stores import PostgresStore
    except ModuleNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    return PostgresStore(dsn)  # type: ignore[arg-type]


def _resume_hints(
    result: RunResult, target: str, input: Path, option: str, where: str
) -> list[str]:
    """What to type to resume the run kept in the store (`option`: --db FILE or --dsn), or to
    retry its failed tasks."""
    rid = result.metadata.run_id
    again = f"orchestra run {target} {input} {option} --run-id {rid}"
    lines = [f"run {rid} is kept in {where}"]
    if result.status == "cancelled":
        lines.append(f"  resume it: {again}")
    elif result.errors:
        lines.append(f"  retry its failed tasks: orchestra runs retry {rid} {option}, then {again}")
    return lines


def run_job(
    batch: Batch,
    out: IO[str],
    *,
    keys: IO[str] | None = None,
    grace: float | None = 10.0,
    run_id: str | None = None,
) -> RunResult:
    """Run `batch` as `run_id`, its results to `out`, with the live view on stderr, SIGINT /
    SIGTERM as a graceful stop (a second one cancels at once) and control keys from `keys`."""
    if keys is not None:
        _stderr().print(f"keys: {KEYS}", markup=False)
    return asyncio.run(batch.run(out, keys=keys, grace=grace, run_id=run_id))


def _keys() -> IO[str] | None:
    """stdin when it is a terminal (keys steer the run), else None."""
    try:
        return sys.stdin if sys.stdin.isatty() else None
    except (AttributeError, ValueError):  # no stdin at all, or a closed one
        return None


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[Iterable[bytes]]:
    # Bytes: `read_jsonl` decodes each line, so a line that is not UTF-8 is named.
    if str(path) == "-":
        yield sys.stdin.buffer
        return
    with path.open("rb") as stream:
        yield stream


@contextlib.contextmanager
def _writing(path: Path | None) -> Iterator[IO[str]]:
    if path is None or str(path) == "-":
        yield sys.stdout
        sys.stdout.flush()
        return
    with path.open("w", encoding="utf-8") as stream:
        yield stream


# -- worker ---------------------------------------------------------------------------------------


@app.command()
def worker(
    agents: Annotated[
        str,
        typer.Option(
            "--agents",
            metavar="MODULE:NAME",
            help="The agents: an Orchestrator, a list of agents, or a function returning one "
            "(package.module:name or path/to/file.py:name). Their limits, retries and "
            "fallbacks apply here.",
            show_default=False,
        ),
    ],
    db: Annotated[
        Path | None,
        typer.Option(
            "--db", help="The SQLite file the runs are kept in (SQLiteStore).", show_default=False
        ),
    ] = None,
    dsn: Annotated[
        str | None,
        typer.Option(
            "--dsn",
            metavar="postgresql://...",
            help="The PostgreSQL database the runs are kept in (PostgresStore).",
            show_default=False,
        ),
    ] = None,
    url: Annotated[
        list[str] | None,
        typer.Option(
            "--url",
            metavar="http://host:8000",
            help="The service the runs are kept behind (`orchestra serve`): for a worker that "
            "cannot reach the database. Needs --token. Repeat it for replicas of one store: "
            "the worker moves to the next when the one it uses cannot be reached.",
            show_default=False,
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            metavar="TOKEN",
            envvar="ORCHESTRA_TOKEN",
            help="With --url: a bearer token of the worker role (`orchestra tokens create --role "
            "worker`). Read from $ORCHESTRA_TOKEN too, out of the process list.",
            show_default=False,
        ),
    ] = None,
    kinds: Annotated[
        str | None,
        typer.Option(
            "--kinds",
            metavar="KIND,KIND",
            help="The kinds to take, comma-separated (default: every kind the agents serve).",
        ),
    ] = None,
    run_id: Annotated[
        str | None,
        typer.Option(
            "--run-id", help="Serve this run only, and exit when it is over (default: every run)."
        ),
    ] = None,
    lease: Annotated[
        float,
        typer.Option(
            "--lease",
            metavar="SECONDS",
            help="How long a claim lasts without a heartbeat: a worker killed or paused longer "
            "loses its tasks, which run again elsewhere (with --url, the service's store says).",
            min=0.5,
        ),
    ] = 30.0,
    grace: Annotated[
        float,
        typer.Option(
            "--grace",
            metavar="SECONDS",
            help="With --dsn or --url: on SIGTERM or Ctrl-C, how long the running attempts may take to "
            "finish (a second signal cancels them at once).",
            min=0.0,
        ),
    ] = 10.0,
) -> None:
    """Work for the runs of a shared store: claim ready tasks, run them, write back the results.

    Start as many as you like, on the file (--db) or the database (--dsn) the runs' own processes
    use (`SQLiteStore(path)`, `PostgresStore(dsn)`), or through the service that keeps them
    (--url, with a worker token: `orchestra serve`). With --db, Ctrl-C or SIGTERM stops a worker at
    once: what it claimed and did not finish goes back to the queue (exit 130). With --dsn or
    --url, the first signal drains it: it claims no more, lets the running attempts finish within
    --grace, hands back the rest at once and exits 0; a second signal cancels at once (exit 130).

    Exit code: 0 done (the run of --run-id is over, or drained), 130 stopped, 2 usage error.
    """
    url = url or None  # (no --url: an empty list)
    if sum(x is not None for x in (db, dsn, url)) != 1:
        raise _fail(
            "give exactly one of --db FILE (SQLite), --dsn postgresql://... (PostgreSQL) and "
            "--url http://host:8000 (the service)"
        )
    if db is not None and not db.is_file():
        raise _fail(f"no such file: {db} (a run creates it: orch.run(..., run_id=...))")
    if url is not None and not token:
        raise _fail("--url needs a worker token: --token TOKEN, or $ORCHESTRA_TOKEN")
    orch = _load(agents)
    wanted = None if kinds is None else [k.strip() for k in kinds.split(",") if k.strip()]
    try:
        if url is not None:
            assert token is not None
            remote = _service_backend(url, token)
            report, interrupted = asyncio.run(_work(orch, remote, wanted, run_id, grace))
        else:
            store: SQLiteStore | PostgresStore
            if db is not None:
                store = SQLiteStore(db, lease=lease)
                drain = None
            else:
                assert dsn is not None
                store = _postgres_store(dsn, lease)
                drain = grace
            try:
                report, interrupted = asyncio.run(
                    _work(orch, lambda: contextlib.nullcontext(backend_of(store)), wanted, run_id,
                          drain)
                )  # fmt: skip
            finally:
                if not isinstance(store, SQLiteStore):  # (a file's writer thread ends with it)
                    store.close()
    except (ConfigError, InputError, StoreError) as exc:
        raise _fail(str(exc)) from None
    _stderr().print(
        f"worker {report.worker}: {report.claimed} claimed, {report.completed} completed, "
        f"{report.refused} refused, {report.lost} lost, {report.released} handed back, "
        f"{report.passed_on} passed on",
        markup=False,
    )
    raise typer.Exit(INTERRUPTED if interrupted else 0)


def _postgres_store(dsn: str, lease: float) -> PostgresStore:
    """A `PostgresStore` on `dsn`; a usage error when the `postgres` extra is not installed."""
    try:
        from ..stores._postgres._store import PostgresStore
    except ImportError as exc:
        raise _fail(
            f"--dsn needs the `postgres` extra (pip install 'orchestra[postgres]'): {exc}"
        ) from None
    return PostgresStore(dsn, lease=lease)


def _service_backend(
    urls: list[str], token: str
) -> Callable[[], AbstractAsyncContextManager[Backend]]:
    """The worker's backend through the service at `urls` (opened in the worker's loop); a usage
    error when the `remote` extra (httpx) is not installed.

    Several addresses are several ``--url`` options, not one comma-separated: a comma is a legal
    character of a URL (its path, its query), so splitting on it could cut one address in two."""
    try:
        from ..stores._http._worker import ServiceBackend
    except ImportError as exc:
        raise _fail(str(missing_extra("--url", "remote", exc))) from None
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise _fail(f"--url must be the service's http:// or https:// address, got {url!r}")
    return lambda: ServiceBackend(urls, token)


async def _work(
    orch: Orchestrator,
    opened: Callable[[], AbstractAsyncContextManager[Backend]],
    kinds: list[str] | None,
    run_id: str | None,
    grace: float | None,
) -> tuple[WorkReport, bool]:
    """`orch.work(...)` on the backend `opened()` gives, until it returns or SIGINT / SIGTERM
    stops it; its report, and whether a signal cancelled it. `grace` None: the first signal
    cancels (what it holds is handed back); a number: the first signal drains the worker
    (`Worker.drain`), a second one cancels."""
    loop = asyncio.get_running_loop()
    stopped = False
    async with orch, opened() as backend:
        worker = Worker(LocalRuns(orch), backend, run_id, kinds, backend.poll)
        job = asyncio.ensure_future(worker.run())
        draining: asyncio.Task[None] | None = None

        def stop() -> None:
            nonlocal stopped, draining
            if grace is not None and draining is None:
                draining = asyncio.ensure_future(worker.drain(grace))
                return
            stopped = True
            job.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop)
        try:
            await job
        except asyncio.CancelledError:
            if not stopped:
                raise
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            if draining is not None:
                draining.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await draining
    return worker.report, stopped


# -- bench ----------------------------------------------------------------------------------------


def _checkout() -> Path | None:
    """The source checkout with the benchmarks: the current directory or the package's parent."""
    for candidate in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (candidate / "benchmarks" / "__main__.py").is_file():
            return candidate
    return None


# Listed in the help only where it can work: an installed copy has no benchmarks package (called
# anyway, it says how to get a checkout).
@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
    hidden=_checkout() is None,
)
def bench(ctx: typer.Context) -> None:
    """Run the benchmarks of a source checkout (needs its bench dependency group).

    Every argument, --help included, goes to `python -m benchmarks`.
    """
    root = _checkout()
    missing = [] if root is None else _missing_bench_group(root)
    if root is None or missing:
        asked_help = any(a in ("--help", "-h") for a in ctx.args)
        if asked_help:
            print(ctx.get_help())
        _stderr().print(_how_to_bench(root, missing), markup=False)
        raise typer.Exit(0 if asked_help else USAGE)
    sys.path.insert(0, str(root))
    sys.argv = ["orchestra bench", *ctx.args]
    try:
        runpy.run_module("benchmarks", run_name="__main__", alter_sys=True)
    except KeyboardInterrupt:
        raise _fail("interrupted", INTERRUPTED) from None


def _missing_bench_group(root: Path) -> list[str]:
    """The distributions of the checkout's `bench` dependency group that are not installed, read
    from its pyproject.toml (so the list follows it); empty when it has no such group."""
    try:
        with (root / "pyproject.toml").open("rb") as file:
            groups = tomllib.load(file).get("dependency-groups", {})
    except (OSError, tomllib.TOMLDecodeError):
        return []
    missing = []
    for requirement in groups.get("bench", []):
        if not isinstance(requirement, str):
            continue  # an include of another group
        name = re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0]
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def _how_to_bench(root: Path | None, missing: list[str]) -> str:
    lines = ["orchestra bench runs the benchmark suite (benchmarks/) of a source checkout."]
    if root is None:
        lines += [
            f"No checkout here: looked for benchmarks/ in {Path.cwd()} and "
            f"{Path(__file__).resolve().parents[2]}.",
            "Get one, then run it from its root:",
            "  git clone <the orchestra repository> orchestra && cd orchestra",
            "  make bench            # installs the bench group with uv, then runs the suite",
            "  # or: uv sync --group bench --extra cli && uv run orchestra bench",
        ]
    if missing:
        where = f" in {root}" if root is not None else ""
        lines += [
            f"The bench dependency group is not installed (missing: {', '.join(missing)}). "
            f"Install it{where}:",
            "  uv sync --group bench --extra cli     # or: make bench",
        ]
    return "\n".join(lines)


# orchestra runs list|workers|show|dead|retry, each on --db FILE or --dsn URL (_runs.py)
app.add_typer(runs_app)
# orchestra serve, and orchestra tokens create|list|revoke (_serve.py)
app.command()(serve)
app.add_typer(tokens_app)


def main() -> None:
    """Entry point of the `orchestra` command.

    An error no command turned into a message (the user's decomposer raising, say) exits 1 with
    its traceback and a closing line, both scrubbed of secrets, instead of typer's traceback,
    which would show them.
    """
    try:
        app(prog_name="orchestra")
    except Exception as exc:
        _stderr().print(f"[bold red]orchestra:[/] {escape(_crashed(exc))}", markup=True)
        raise SystemExit(1) from None
