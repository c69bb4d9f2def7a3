"""Batch jobs: one orchestrator over a JSONL input, its task results out as JSONL.

The engine of ``orchestra run``, without the command line: `load_orchestrator` imports the user's
``module:factory``, `read_jsonl` reads the input (one JSON value per line), `run_batch` runs it
and writes each `TaskResult` as a JSON line as it finishes, and `RunResult.summary()` says how it
went.
`Batch.run` is the one seam a caller (the CLI's live view, its pause and cancel keys) wraps.

Without a decomposer every input line is a task (``{"kind": "research", "payload": ..., "id": ...}``,
the fields of `Task`); with one, the lines are the decomposer's input, handed over as one list.
Lines are checked once, here at the boundary, with pydantic; a bad line raises `InputError`
naming its line number and field before anything runs.
"""

from __future__ import annotations

import inspect
import json
import pkgutil
import re
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final

import pydantic
from pydantic_core import to_json

from .._core._instruments import last_agent
from .._core._orchestrator import Orchestrator
from .._exceptions import ConfigError, InputError
from .._output import jsonable
from .._spec import TaskSpec
from ._console import watch

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from rich.console import Console

    from .._result import RunResult
    from .._task import Task, TaskResult

__all__ = (
    "EXIT_CODES",
    "Batch",
    "TaskSpec",
    "load_orchestrator",
    "read_batch",
    "read_jsonl",
    "result_line",
)

EXIT_CODES: Final[Mapping[str, int]] = {"success": 0, "failed": 1, "partial": 3, "cancelled": 130}
"""The exit code of ``orchestra run`` for each run status (2 is a usage error, 130 an interrupt)."""


_DOTTED: Final = re.compile(r"(?!\d)\w+(\.(?!\d)\w+)*")
"""A dotted Python name (`jobs.contracts`, `build`): what `pkgutil.resolve_name` accepts."""


def load_orchestrator(target: str, instruments: Sequence[Any] = ()) -> Orchestrator:
    """The orchestrator `target` names: ``package.module:factory`` or ``path/to/file.py:factory``,
    where `factory` is an `Orchestrator` or a function returning one (called with no arguments),
    or a list of agents (or a function returning one): an orchestrator with the defaults and
    `instruments` (an orchestrator the user built keeps its own).

    The current directory is importable, as with ``python -m``. Raises `ConfigError` saying what is
    wrong (no colon, no such module or attribute, not an orchestrator).
    """
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(
            f"expected module:factory (for example jobs.contracts:build), got {target!r}"
        )
    if module.endswith(".py"):  # a script: import it by its name, from its folder
        path = Path(module).resolve()
        if not path.is_file():
            raise ConfigError(f"no such file: {module}")
        _importable(path.parent)
        module = path.stem
    else:
        _importable(Path.cwd())
    # Checked here: pkgutil's ValueError would look like a bug of the user's module.
    if not _DOTTED.fullmatch(module):
        raise ConfigError(
            f"cannot import {module!r}: not a dotted module name (give package.module:name, "
            "or path/to/file.py:name for a file)"
        )
    if not _DOTTED.fullmatch(attr):
        raise ConfigError(f"{attr!r} in {target!r} is not a Python name")
    try:
        # pkgutil.resolve_name is the standard library's "module:attr.path" resolver.
        obj = pkgutil.resolve_name(f"{module}:{attr}")
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name):
            raise ConfigError(f"cannot import {module!r}: no module named {exc.name!r}") from exc
        raise  # the user's module failed on an import of its own: show its traceback
    except AttributeError as exc:
        raise ConfigError(f"module {module!r} has no attribute {attr!r}") from exc
    if not isinstance(obj, Orchestrator | list | tuple):
        if not callable(obj):
            raise ConfigError(
                f"{target} is a {type(obj).__name__}, not an Orchestrator or a factory"
            )
        obj = obj()
    if isinstance(obj, list | tuple):  # a list of agents: an orchestrator with the defaults
        obj = Orchestrator(agents=list(obj), instruments=list(instruments))
    if inspect.isawaitable(obj):
        if inspect.iscoroutine(obj):
            obj.close()  # never awaited: no "coroutine was never awaited" warning
        raise ConfigError(f"{target} must return an Orchestrator, not a coroutine (make it a def)")
    if not isinstance(obj, Orchestrator):
        raise ConfigError(f"{target} returned a {type(obj).__name__}, not an Orchestrator")
    return obj


def _importable(folder: Path) -> None:
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


class _NotJSON(InputError):
    """A line that is not JSON (or not UTF-8); `before` holds the lines read before it."""

    def __init__(self, message: str, *, field: str, before: list[tuple[int, Any]]) -> None:
        super().__init__(message, field=field)
        self.before = before


def read_jsonl(stream: Iterable[str | bytes], *, source: str = "input") -> list[tuple[int, Any]]:
    """The line number and JSON value of every non-blank line of `stream`; `InputError` names a
    bad line. Lines as bytes are decoded as UTF-8 one by one, so the error names the line that
    is not (a text stream would fail somewhere in a block of lines, naming none)."""
    items: list[tuple[int, Any]] = []
    for number, read in enumerate(stream, 1):
        if isinstance(read, bytes):
            try:
                line = read.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _NotJSON(
                    f"{source}, line {number}: not UTF-8 (byte 0x{read[exc.start]:02x} at "
                    f"column {exc.start + 1}): JSON lines are UTF-8 text",
                    field=f"line {number}",
                    before=items,
                ) from None
        else:
            line = read
        if not line.strip():
            continue
        try:
            items.append((number, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise _NotJSON(
                f"{source}, line {number}: not JSON: {exc.msg}",
                field=f"line {number}",
                before=items,
            ) from exc
    return items


def read_batch(
    orch: Orchestrator, stream: Iterable[str | bytes], *, source: str = "input"
) -> Batch:
    """The JSONL `stream` as a `Batch` for `orch`. `InputError` names the first bad line, whether
    it is not JSON or not a task (a task's field is checked only once every line is read)."""
    try:
        lines = read_jsonl(stream, source=source)
    except _NotJSON as exc:
        Batch(orch, exc.before, source=source)  # a line before it that is not a task comes first
        raise
    return Batch(orch, lines, source=source)


_SPECS: Final = pydantic.TypeAdapter(list[TaskSpec])


def tasks_of(lines: Sequence[tuple[int, Any]], *, source: str = "input") -> list[Task]:
    """Every line's value as a `Task`; `InputError` names the first bad line and field."""
    try:
        specs = _SPECS.validate_python([value for _, value in lines])
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        where = error["loc"]
        line = lines[where[0]][0] if where and isinstance(where[0], int) else None
        field = ".".join(str(part) for part in where[1:]) or None
        if field is None:
            problem = "not a task: a task is a JSON object with a 'kind' (and 'payload', 'id', ...)"
        else:
            problem = f"{field}: {error['msg']}"
        raise InputError(f"{source}, line {line}: {problem}", field=field) from None
    return [spec.task() for spec in specs]


def result_line(result: TaskResult) -> str:
    """One task's result as a JSON line (no newline): id, kind, status, output, agent, attempts,
    timings, and the error of a task that did not succeed."""
    record: dict[str, Any] = {
        "task_id": result.task_id,
        "kind": result.kind,
        "status": result.status,
        "output": result.output,
        "agent": last_agent(result) or None,  # the one that succeeded, or the last one tried
        "attempts": result.attempts,
        "started": result.started,
        "finished": result.finished,
    }
    if result.error is not None:
        record["error_type"] = result.error_type
        record["error"] = result.error
    # What JSON cannot hold of an output is written as its repr, an iterator unread.
    return to_json(jsonable(record)).decode()


class Batch:
    """One orchestrator over one JSONL input: `run` writes results to `out` and returns the result."""

    def __init__(
        self, orch: Orchestrator, lines: Sequence[tuple[int, Any]], *, source: str = "input"
    ) -> None:
        self.orch = orch
        self.decomposed = orch.decomposer is not None
        # Checked before anything runs: a bad line costs no agent call.
        self.input: list[Any] = (
            [value for _, value in lines] if self.decomposed else tasks_of(lines, source=source)
        )
        self.written = 0

    def __len__(self) -> int:
        return len(self.input)

    async def run(
        self,
        out: IO[str],
        *,
        console: Console | None = None,
        keys: IO[str] | None = None,
        grace: float | None = 10.0,
        run_id: str | None = None,
    ) -> RunResult:
        """Run the input as `run_id` (a fresh id by default), writing each `TaskResult` to `out`
        as a JSON line as it finishes, with the live view on `console` and control keys from
        `keys` (see `orchestra._cli._console`)."""

        def write(result: TaskResult) -> None:
            out.write(result_line(result) + "\n")
            out.flush()  # each result is there as soon as it is known (`tail -f`, a crash)
            self.written += 1

        args: dict[str, Any] = {"input": self.input} if self.decomposed else {"tasks": self.input}
        return await watch(
            self.orch,
            write=write,
            console=console,
            keys=keys,
            grace=grace,
            run_id=run_id,
            **args,
        )
