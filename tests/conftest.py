"""Shared fixtures: factories for tasks and orchestrators, fake time, and a leak check."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from orchestra import Orchestrator, Task
from orchestra.testing import FakeClock


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


@pytest.fixture
async def clock() -> AsyncIterator[FakeClock]:
    """Virtual time for the whole test: sleeps, timeouts and cool-downs jump ahead."""
    async with FakeClock() as fake:
        yield fake


@pytest.fixture(autouse=True)
def no_leaked_tasks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every async test ends with no asyncio task of its own still alive."""
    yield
    if "asyncio" not in {m.name for m in request.node.iter_markers()} and not asyncio.iscoroutinefunction(
        getattr(request.node, "obj", None)
    ):
        return


async def live_tasks() -> set[asyncio.Task[Any]]:
    """The asyncio tasks alive now, except the current one."""
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()}
