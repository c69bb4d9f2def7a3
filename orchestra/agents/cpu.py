"""A CPU agent: a plain function run in a worker process (or thread) so it never blocks the loop."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from .._agent import Agent

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ("cpu_agent",)


def cpu_agent(
    fn: Callable[[Any], Any],
    *,
    kinds: Sequence[str],
    name: str | None = None,
    concurrency: int | None = None,
    executor: Literal["process", "thread"] = "process",
) -> Agent:
    """Register a CPU-bound ``fn(task) -> output`` as an agent run in anyio's process pool.

    `fn` must be importable by module and name (defined at the top of a module), as any function
    sent to another process. Use ``executor="thread"`` for code that releases the GIL (numpy, I/O).
    """
    return Agent(fn, kinds=kinds, name=name, concurrency=concurrency, executor=executor)
