"""The agents of the `orchestra serve` replicas of tests/test_service_replicas.py: ``work`` takes
$REPLICA_DELAY seconds, notes its execution (the task's id, a line appended to
$REPLICA_EXECUTIONS once its call ended) and returns its payload."""

from __future__ import annotations

import os
from typing import Any

import anyio

from orchestra import Orchestrator, Task, agent


def build() -> Orchestrator:
    # Opened once, O_APPEND: each note one write of one line, whole whichever process writes.
    noted = os.open(os.environ["REPLICA_EXECUTIONS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    delay = float(os.environ.get("REPLICA_DELAY", "0.02"))

    @agent(kinds=["work"])
    async def work(task: Task, ctx: object) -> Any:
        await anyio.sleep(delay)
        os.write(noted, f"{task.id}\n".encode())
        return task.payload

    return Orchestrator(agents=[work], concurrency=10)
