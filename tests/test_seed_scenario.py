"""The seed scenario: ten tasks over four agents; agent-3 goes down mid-run; its tasks complete
through the fallback; `recovery_status(orch)` says "recovered"; the run succeeds; and running in
parallel takes less than half the time of running one task at a time.

Both runs are in fake time, so the ratio compares virtual seconds (`metadata.elapsed`): it is
deterministic, not a timing test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import pytest

from orchestra import Orchestrator, RetryPolicy, RunResult, Task, TaskResult
from orchestra.events import AttemptFailed, Event, FallbackUsed, TaskFinished
from orchestra.testing import (
    FakeClock,
    RecoveryStatus,
    ScriptedAgent,
    recovery_status,
    scripted,
    simulate_agent_failure,
)

if TYPE_CHECKING:
    from collections.abc import Callable

pytestmark = pytest.mark.usefixtures("clock")

STRIKE = 0.5  # virtual seconds into the run: agent-3 goes down, for good


@dataclass
class Scenario:
    result: RunResult
    results: dict[str, TaskResult]
    events: list[Event]
    agents: dict[str, ScriptedAgent]
    recovery: RecoveryStatus
    strike: float  # loop time of the failure


async def seed_scenario(
    clock: FakeClock,
    make_orchestrator: Callable[..., Orchestrator],
    make_task: Callable[..., Task],
    *,
    concurrency: int,
) -> Scenario:
    agents = {
        name: scripted(name, ["research"], latency=1.0, concurrency=1)
        for name in ("agent-1", "agent-2", "agent-3", "agent-4")
    }
    orch = make_orchestrator(
        agents=list(agents.values()),
        concurrency=concurrency,
        retry=RetryPolicy(max_attempts=2, base=0.25, cap=1),
    )
    events: list[Event] = []
    orch.subscribe(events.append)
    tasks = [make_task("research", {"clause": n}, id=f"clause-{n}") for n in range(10)]
    strike: list[float] = []
    async with orch:

        async def fail_agent_3() -> None:
            await anyio.sleep(STRIKE)
            strike.append(clock.time())
            simulate_agent_failure(orch, "agent-3", mode="error")

        async with anyio.create_task_group() as tg:
            tg.start_soon(fail_agent_3)
            result = await orch.run(tasks=tasks)
        recovery = recovery_status(orch)
    results = {e.result.task_id: e.result for e in events if isinstance(e, TaskFinished)}
    return Scenario(result, results, events, agents, recovery, strike[0])


class TestSeedScenario:
    async def test_agent_3_fails_mid_run_and_its_tasks_complete_through_the_fallback(
        self,
        clock: FakeClock,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
    ) -> None:
        run = await seed_scenario(clock, make_orchestrator, make_task, concurrency=4)

        assert run.result.status == "success"
        assert run.result.metadata.counts["succeeded"] == 10
        assert sorted(run.result.data) == sorted(f"clause-{n}" for n in range(10))

        # agent-3 worked before the failure and was hit by it afterwards
        assert run.agents["agent-3"].calls
        assert all(c.started < run.strike for c in run.agents["agent-3"].calls)
        hit = {e.task_id for e in run.events if isinstance(e, AttemptFailed)}
        assert hit
        assert all(
            e.agent == "agent-3" and e.error_type == "ConnectionError"
            for e in run.events
            if isinstance(e, AttemptFailed)
        )
        # ... and every task it failed finished on another agent, through the fallback
        for task_id in hit:
            assert run.results[task_id].ok
            assert run.results[task_id].agent not in (None, "agent-3")
        moved = {e.task_id for e in run.events if isinstance(e, FallbackUsed)}
        assert moved == hit
        assert run.result.metadata.fallbacks >= len(hit)

        assert run.recovery == "recovered"
        assert run.recovery.agents == ["agent-3"]
        assert run.recovery.pending == run.recovery.failed == []

    async def test_parallel_takes_less_than_half_the_sequential_time(
        self,
        clock: FakeClock,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
    ) -> None:
        sequential = await seed_scenario(clock, make_orchestrator, make_task, concurrency=1)
        parallel = await seed_scenario(clock, make_orchestrator, make_task, concurrency=4)
        assert sequential.result.status == parallel.result.status == "success"
        assert sequential.recovery == parallel.recovery == "recovered"
        assert sequential.result.metadata.peak_concurrency == 1
        assert parallel.result.metadata.peak_concurrency > 1
        seq, par = sequential.result.metadata.elapsed, parallel.result.metadata.elapsed
        assert seq >= 10  # ten one-second calls, one at a time
        assert par / seq < 0.5, (par, seq)
        assert list(sequential.result.data) == list(parallel.result.data)  # same tasks, same order
