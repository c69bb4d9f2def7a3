"""Shared fixtures: factories for tasks and orchestrators, fake time, a leak check, orchestra's log
lines captured, and structlog and `logging` left as found; every test that starts a process marked
`subprocess`. Plain helper functions are in `tests/helpers.py`."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

import pytest
import structlog

from orchestra import Orchestrator, Task
from tests.helpers import LogLines, assert_no_leaks, fake_clock, live_tasks, reap_spawned

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator

    from orchestra.testing import FakeClock

# The session's PostgreSQL server and a database per test, for the tests that ask for them.
pytest_plugins = ("tests.pg",)


@pytest.fixture
def make_task() -> Callable[..., Task]:
    """`make_task("kind", payload, id=..., ...)`; ids default to t1, t2, ... in call order."""
    counter = iter(range(1, 1_000_000))

    def make(kind: str = "work", payload: Any = None, **fields: Any) -> Task:
        fields.setdefault("id", f"t{next(counter)}")
        return Task(kind, payload, **fields)

    return make


@pytest.fixture
def make_orchestrator() -> Callable[..., Orchestrator]:
    """`make_orchestrator(agents=[...], **options)` with a fixed seed, so jitter is reproducible."""

    def make(**options: Any) -> Orchestrator:
        options.setdefault("seed", 1234)
        return Orchestrator(**options)

    return make


# ORCHESTRA_TEST_CLOCK_START=84895939.95678604 pytest ...: every test's virtual time starts there (this
# fixture, and `tests.helpers.fake_clock()` for a test that installs its own clock), not at the loop's
# own time, which is the machine's uptime. Float rounding of every time computed on the loop's clock
# depends on that value: a CI host up for a week hung a test that never hung on a machine just booted
# (that start hangs test_dispatch.py::TestPerAgentLimit::test_holds_under_errors on the code before
# commit 8386f31). A start hits the rounding of some instants only: after touching due times,
# deadlines or timers, run the suite at a few (1e6 + 0.1, 3.3e7, 1.7e9, ...). Unset (the default):
# the loop's own time, as `FakeClock()` does.
@pytest.fixture
async def clock() -> AsyncIterator[FakeClock]:
    """Virtual time for the whole test: sleeps, timeouts and cool-downs jump ahead."""
    async with fake_clock() as fake:
        yield fake


@pytest.fixture
async def no_leaks() -> AsyncIterator[None]:
    """Fails the test if it leaves an asyncio task of its own running."""
    before = live_tasks()
    yield
    await assert_no_leaks(before)


# The ways a process starts, as Python's audit events name them: `subprocess.Popen` (`run_python`,
# `spawn`, the CLI's tests), `os.fork` (multiprocessing's default start on Linux, a forked child).
_PROCESS_EVENTS = frozenset(
    {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system"}
)
_started: list[str] = []


def _note_process(event: str, args: tuple[Any, ...]) -> None:
    if event in _PROCESS_EVENTS:
        _started.append(event)


sys.addaudithook(_note_process)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _started.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """A test that starts a process (itself, through a fixture of any scope set up for it, or
    through orchestra) must be marked `subprocess`, so that ``-m "not subprocess"`` is the
    in-process suite and the mark never lies."""
    yield
    if _started and item.get_closest_marker("subprocess") is None:
        pytest.fail(
            f"{item.nodeid} starts a process ({_started[0]}): mark it @pytest.mark.subprocess",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def _reap_spawned() -> Iterator[None]:
    """Every process a test started with `tests.helpers.spawn` is killed and waited for when the
    test ends, however it ends."""
    yield
    reap_spawned()


@pytest.fixture
def restore_structlog() -> Iterator[None]:
    """Leave structlog as it was found: unconfigured defaults."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> LogLines:
    """orchestra's log lines as event dicts, captured through `logging` (DEBUG and up)."""
    caplog.set_level(logging.DEBUG, logger="orchestra")
    return LogLines(caplog)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Leave the ``"orchestra"`` logger as it was found (`configure_logging` changes it)."""
    root = logging.getLogger("orchestra")
    saved = (list(root.handlers), root.level, root.propagate)
    yield
    root.handlers[:], root.level, root.propagate = saved[0], saved[1], saved[2]
