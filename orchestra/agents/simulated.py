"""Simulated agents: realistic latencies and failure rates, no network. For demos and benchmarks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..testing import ScriptedAgent

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from .._task import Task

__all__ = ("simulated",)


def simulated(
    name: str,
    kinds: Sequence[str],
    *,
    latency: float = 0.05,
    jitter: float = 0.01,
    failure_rate: float = 0.0,
    failure_mode: str = "error",
    output: Any | Callable[[Task], Any] = None,
    concurrency: int | None = None,
    seed: int | None = None,
) -> ScriptedAgent:
    """An agent that takes `latency` ± `jitter` seconds per call and fails `failure_rate` of them
    (in `failure_mode`, see `orchestra.testing.scripted`), returning `output` (or ``output(task)``)."""
    return ScriptedAgent(
        name,
        kinds,
        latency=latency,
        jitter=jitter,
        failure_rate=failure_rate,
        failure_mode=failure_mode,
        output=output,
        concurrency=concurrency,
        seed=seed,
    )
