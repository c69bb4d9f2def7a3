"""Shared fixtures: factories for tasks and orchestrators, fake time, and a leak check."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest

from orchestra import Orchestrator, Task
from orchestra.testing import FakeClock

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable


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


@pytest.fixture
async def no_leaks() -> AsyncIterator[None]:
    """Fails the test if it leaves an asyncio task of its own running."""
    before = await live_tasks()
    yield
    for _ in range(3):  # let cancelled tasks finish unwinding
        await asyncio.sleep(0)
    leaked = await live_tasks() - before
    assert not leaked, f"leaked asyncio tasks: {leaked}"


async def live_tasks() -> set[asyncio.Task[Any]]:
    """The asyncio tasks alive now, except the current one."""
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()}
