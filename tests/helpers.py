"""Plain helpers shared by several test files: ``from tests.helpers import ...``.

Fixtures live in `conftest.py`; these are ordinary functions, for the places a fixture cannot reach
(hypothesis examples, module-level factories) and for one-line calls inside a test.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from orchestra import BreakerPolicy, Task
from orchestra.stores import SQLiteStore
from orchestra.testing import GARBAGE, FakeClock, Recorder

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    import pytest

    from orchestra import Orchestrator, RunResult, TaskResult

REPO = Path(__file__).resolve().parent.parent
"""The checkout's root: the folder that holds `orchestra/`, `tests/` and `examples/`."""

_START = os.environ.get("ORCHESTRA_TEST_CLOCK_START", "").strip()
CLOCK_START = float(_START) if _START else None
"""Where every test's virtual time starts, from ``ORCHESTRA_TEST_CLOCK_START`` (see conftest.py);
None (unset): at the loop's own time, as `FakeClock()` does."""


def fake_clock(*, autojump_threshold: float = 0.0) -> FakeClock:
    """A `FakeClock` starting at `CLOCK_START`: what a test that installs its own clock uses."""
    return FakeClock(autojump_threshold=autojump_threshold, start=CLOCK_START)


def tasks_of(n: int, kind: str = "work", prefix: str = "t") -> list[Task]:
    """`n` tasks of `kind` with payloads 0..n-1 and ids ``{prefix}0``, ``{prefix}1``, ..."""
    return [Task(kind, i, id=f"{prefix}{i}") for i in range(n)]


async def run_recorded(
    orch: Orchestrator, tasks: Sequence[Task]
) -> tuple[RunResult, dict[str, TaskResult], Recorder]:
    """Run `tasks` with a fresh `Recorder` subscribed: the result, every task's result by id, and
    the recorder (its events are all delivered once `run` returns)."""
    rec = Recorder()
    orch.subscribe(rec)
    result = await orch.run(tasks=list(tasks))
    return result, rec.results(), rec


def not_garbage(task: Task, output: Any) -> bool:
    """A verifier that rejects the `GARBAGE` a scripted agent returns."""
    return output is not GARBAGE


def live_tasks() -> set[asyncio.Task[Any]]:
    """The asyncio tasks alive now, except the current one."""
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()}


async def assert_no_leaks(before: set[asyncio.Task[Any]]) -> None:
    """Fails if an asyncio task not in `before` is still alive once cancelled ones have unwound."""
    for _ in range(3):  # let cancelled tasks finish unwinding
        await asyncio.sleep(0)
    leaked = live_tasks() - before
    assert not leaked, f"leaked asyncio tasks: {leaked}"


def run_python(
    *args: str, cwd: Path, timeout: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python *args`` in a fresh interpreter (this one's executable), its output captured as text.

    It does not raise on a non-zero exit: the test asserts on `returncode` and shows `stderr`."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


_SPAWNED: list[subprocess.Popen[Any]] = []


def spawn(args: Sequence[str], **options: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(args, **options)``, reaped when the test ends (`reap_spawned`, run by an
    autouse fixture of conftest.py): a test that fails or times out before it waits for its
    processes would leave them running, and their `Popen` objects to be collected later, in
    another test, as ``ResourceWarning: subprocess N is still running`` and unclosed pipes."""
    process = subprocess.Popen(args, **options)
    _SPAWNED.append(process)
    return process


def reap_spawned() -> None:
    """Kill what `spawn` started and is still running (a stopped process too), wait for it, and
    close its pipes."""
    while _SPAWNED:
        process = _SPAWNED.pop()
        if process.poll() is None:
            process.kill()
        process.wait()
        for pipe in (process.stdin, process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()


class LogLines:
    """orchestra's log records captured by pytest's `caplog`, read back as structlog event dicts
    (a record's `msg` is its event dict) with ``log_level`` and ``logger`` added."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self.caplog = caplog

    def level(self, level: int) -> None:
        """Capture from `level` up (the ``"orchestra"`` logger's level, as an application sets it)."""
        self.caplog.set_level(level, logger="orchestra")

    @property
    def entries(self) -> list[dict[str, Any]]:
        return [
            {**record.msg, "log_level": record.levelname.lower(), "logger": record.name}
            for record in self.caplog.records
            if record.name.split(".")[0] == "orchestra" and isinstance(record.msg, dict)
        ]

    def text(self) -> str:
        """Every captured line as a plain `logging` formatter prints it."""
        return "\n".join(
            logging.Formatter("%(levelname)s %(name)s %(message)s").format(record)
            for record in self.caplog.records
        )


_DB_DIR: list[str] = []  # one temporary directory for the stores the contract suite builds


def sqlite_store() -> SQLiteStore:
    """A `SQLiteStore` on a fresh file (the contract suite's factory takes no arguments, so not
    pytest's `tmp_path`: one directory per session, removed at exit)."""
    if not _DB_DIR:
        _DB_DIR.append(tempfile.mkdtemp(prefix="orchestra-stores-"))
        atexit.register(shutil.rmtree, _DB_DIR[0], True)
    return SQLiteStore(Path(_DB_DIR[0]) / f"{uuid.uuid4().hex}.db")


class AppLines:
    """An application's own structlog logger (`log`): context variables merged, rendered as JSON;
    each line lands parsed in `lines`."""

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []
        self.log = structlog.wrap_logger(
            self,
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.JSONRenderer(),
            ],
        )

    def msg(self, message: str) -> None:
        self.lines.append(json.loads(message))

    info = msg


def trips_after(tasks: int, cooldown: float = 30.0) -> BreakerPolicy:
    """A breaker that opens once `tasks` distinct tasks failed with a health failure and none
    succeeded in between (a rate of 1 over a window longer than any test), for a fixed `cooldown`."""
    return BreakerPolicy(
        min_calls=tasks, failure_rate=1.0, window=3600.0, cooldown=cooldown, max_cooldown=cooldown
    )


# A breaker that never opens, for tests whose failures are the scenario's, not an outage.
NEVER_OPENS = BreakerPolicy(min_calls=1_000_000)
