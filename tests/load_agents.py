"""The agents of the `orchestra serve` replicas of tests/test_service_load.py
(``--agents tests/load_agents.py:build``): every run they start, or take over, is paused at once,
so that the replicas coordinate the runs and the HTTP workers run every task (a task run by a
replica would append to no calls file and could not be counted)."""

from __future__ import annotations

from typing import Any

from orchestra import Context, Orchestrator, RunHandle, Task, agent


@agent(kinds=["work"])
async def unused(task: Task, ctx: Context) -> Any:
    raise AssertionError("a paused replica ran a task")  # never: its runs are paused


class Paused(Orchestrator):
    """An orchestrator whose runs start paused: it runs none of their tasks itself."""

    def start(self, input: Any = None, **options: Any) -> RunHandle:
        handle = super().start(input, **options)
        handle.pause()
        return handle


def build() -> Orchestrator:
    return Paused(agents=[unused])
