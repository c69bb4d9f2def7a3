"""Chaos: thousands of tasks over six agents with seeded random faults, all in fake time.

Two kinds x three agents, fallback chains, per-agent and global limits. The faults: connection
errors, 500/529s, 429s with Retry-After, hangs cut by the attempt timeout, garbage rejected by an
output model (kind "alpha") or a verifier (kind "beta"), permanent errors, one agent dying for good
after N calls (`dies_after`) and another taken down mid-run (`simulate_agent_failure`). The last
agent of each chain stays healthy enough, so every task can and must succeed.

Checked: every task terminal exactly once; the limits never exceeded (`Probe`); every failed attempt
in the results matches the outcome the agent recorded for that task and attempt, and every failing
call shows up as a failed attempt; no asyncio task leaked.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anthropic
import anyio
import pydantic
import pytest

from orchestra import Context, Orchestrator, RetryPolicy, RunResult, Task, TaskResult
from orchestra.events import TaskFinished
from orchestra.testing import (
    FakeClock,
    Probe,
    RecoveryStatus,
    ScriptedAgent,
    recovery_status,
    scripted,
    simulate_agent_failure,
)
from tests.helpers import not_garbage, trips_after

if TYPE_CHECKING:
    from collections.abc import Sequence


pytestmark = pytest.mark.usefixtures("clock")

#: What the runtime must record for each scripted outcome. (anthropic is imported here, at
#: collection, rather than by the first rate limit in the middle of the run.)
ERROR_TYPE = {
    "error": "ConnectionError",
    "rate_limit": anthropic.RateLimitError.__name__,
    "overloaded": anthropic.APIStatusError.__name__,
    "server_error": anthropic.APIStatusError.__name__,
    "permanent": "PermanentError",
    "hang": "AttemptTimeout",
    "garbage": "VerificationError",
}
CONCURRENCY = 40
LIMITS = {"a1": 20, "a2": 10, "a3": 12, "b1": 15, "b2": 10, "b3": 12}
FLAKY = {"ok": 70, "error": 8, "server_error": 4, "overloaded": 3, "rate_limit": 5,
         "hang": 3, "garbage": 5, "permanent": 2}  # fmt: skip
HEALTHY = {"ok": 96, "error": 1, "rate_limit": 1, "hang": 1, "garbage": 1}  # never permanent
RETRY_AFTER = 2.0  # seconds, on every 429
STRIKE_PER_TASK = 0.02  # b1 goes down for good n_tasks * this virtual seconds into the run


class Answer(pydantic.BaseModel):
    agent: str
    task: str


class Modelled:
    """A scripted agent declaring an `output` model, so garbage is rejected by the model."""

    def __init__(self, inner: ScriptedAgent) -> None:
        self.inner = inner
        self.name = inner.name
        self.kinds = inner.kinds
        self.concurrency = inner.concurrency
        self.retry = inner.retry
        self.output = Answer

    async def __call__(self, task: Task, ctx: Context) -> Any:
        return await self.inner(task, ctx)


def fault_script(rng: random.Random, weights: dict[str, int], length: int) -> list[str]:
    return rng.choices(list(weights), weights=list(weights.values()), k=length)


@dataclass
class Chaos:
    result: RunResult
    finished: list[TaskResult]
    agents: dict[str, ScriptedAgent]
    probe: Probe
    recovery: RecoveryStatus
    task_ids: list[str]
    strike: float  # when b1 went down, in seconds since the run started
    dies_after: int  # a2's last good call


async def chaos_run(seed: int, n_tasks: int, clock: FakeClock) -> Chaos:
    rng = random.Random(seed)
    probe = Probe()
    script_len = 3 * n_tasks

    def make(name: str, kind: str, weights: dict[str, int], **options: Any) -> ScriptedAgent:
        return scripted(
            name,
            [kind],
            script=fault_script(rng, weights, script_len),
            latency=1.0,
            jitter=0.5,
            seed=rng.randrange(2**32),
            retry_after=RETRY_AFTER,
            probe=probe,
            concurrency=LIMITS[name],
            **options,
        )

    last = RetryPolicy(max_attempts=8, base=0.2, cap=5)  # the healthy end of each chain
    agents = {
        "a1": make("a1", "alpha", FLAKY),
        "a2": make("a2", "alpha", FLAKY, dies_after=n_tasks // 50, die_mode="overloaded"),
        "a3": make("a3", "alpha", HEALTHY, retry=last),
        "b1": make("b1", "beta", FLAKY),
        "b2": make("b2", "beta", FLAKY),
        "b3": make("b3", "beta", HEALTHY, retry=last),
    }
    orch = Orchestrator(
        agents=[Modelled(agents[n]) for n in ("a1", "a2", "a3")]
        + [agents[n] for n in ("b1", "b2", "b3")],
        concurrency=CONCURRENCY,
        fallbacks={"alpha": ["a1", "a2", "a3"], "beta": ["b1", "b2", "b3"]},
        retry=RetryPolicy(max_attempts=3, base=0.2, cap=5),
        breaker=trips_after(5, cooldown=30),
        timeouts={"attempt": 5},
        verify={"beta": not_garbage},
        seed=seed,
    )
    finished: list[TaskResult] = []
    orch.subscribe(lambda e: finished.append(e.result), TaskFinished, buffer=4 * n_tasks)
    tasks = [
        Task("alpha" if i % 2 else "beta", i, id=f"task-{i}", priority=i % 3)
        for i in range(n_tasks)
    ]
    strike: list[float] = []
    async with orch:
        t0 = clock.time()

        async def take_b1_down() -> None:
            await anyio.sleep(n_tasks * STRIKE_PER_TASK)
            strike.append(clock.time() - t0)
            simulate_agent_failure(orch, "b1", mode="error")

        async with anyio.create_task_group() as tg:
            tg.start_soon(take_b1_down)
            result = await orch.run(tasks=tasks)
        recovery = recovery_status(orch)
    assert strike, "the run ended before b1 was taken down"
    ids = [t.id or "" for t in tasks]
    return Chaos(result, finished, agents, probe, recovery, ids, strike[0], n_tasks // 50)


def check_invariants(chaos: Chaos) -> None:
    result, agents = chaos.result, chaos.agents

    # every task terminal exactly once, and every one succeeded
    ends = Counter(r.task_id for r in chaos.finished)
    assert set(ends) == set(chaos.task_ids)
    assert set(ends.values()) == {1}
    assert result.metadata.events_dropped == 0
    assert result.status == "success", result.errors[:3]
    assert result.metadata.counts["succeeded"] == len(chaos.task_ids)
    assert len(result.data) == len(chaos.task_ids)

    # limits
    assert chaos.probe.peak <= CONCURRENCY
    assert result.metadata.peak_concurrency <= CONCURRENCY
    for name, agent in agents.items():
        assert agent.max_in_flight <= LIMITS[name], name
    assert chaos.probe.current == 0

    # the records match the injected faults, both ways
    calls = {(name, c.task_id, c.attempt): c for name, a in agents.items() for c in a.calls}
    assert len(calls) == sum(len(a.calls) for a in agents.values())  # (agent, task, n) unique
    recorded: set[tuple[str, str, int]] = set()
    simulated = 0
    for task in chaos.finished:
        numbers = [a.number for a in task.failures or []]
        assert numbers == sorted(set(numbers)), task  # one record per attempt, in order
        assert task.attempts == len(numbers) + 1  # the failures, then the one that succeeded
        for attempt in task.failures or []:
            key = (attempt.agent, task.task_id, attempt.number)
            call = calls.get(key)
            if call is None:  # answered by the simulated fault: b1, down since the strike
                assert (attempt.agent, attempt.error_type) == ("b1", "ConnectionError"), key
                assert attempt.started >= chaos.strike - 1e-9, key
                simulated += 1
                continue
            assert attempt.error_type == ERROR_TYPE[call.outcome], (key, call.outcome)
            if call.outcome == "rate_limit" and attempt.retry_in is not None:
                assert attempt.retry_in >= RETRY_AFTER, key  # the server's hint was honoured
            recorded.add(key)
        ok = calls.get((task.agent or "", task.task_id, task.attempts))
        assert ok is not None, task
        assert ok.outcome == "ok", (task, ok)
    failing_calls = {k for k, c in calls.items() if c.outcome != "ok"}
    assert failing_calls == recorded  # no injected fault went unrecorded
    assert result.metadata.attempts == len(calls) + simulated

    # the dead and the downed agents
    dead = agents["a2"].outcomes()
    assert len(dead) > chaos.dies_after
    assert set(dead[chaos.dies_after :]) == {"overloaded"}
    assert chaos.strike < result.metadata.elapsed
    assert simulated > 0
    assert chaos.recovery == "recovered"
    assert chaos.recovery.agents == ["b1"]


class TestChaos:
    @pytest.mark.usefixtures("no_leaks")
    @pytest.mark.timeout(120)
    async def test_five_thousand_tasks_under_seeded_faults(self, clock: FakeClock) -> None:
        chaos = await chaos_run(seed=20241122, n_tasks=5000, clock=clock)
        check_invariants(chaos)
        outcomes = Counter(o for a in chaos.agents.values() for o in a.outcomes())
        assert set(ERROR_TYPE) <= set(outcomes)  # every kind of fault was injected
        assert chaos.result.metadata.retries > 100
        assert chaos.result.metadata.fallbacks > 100
        # every agent did some work, the downed one before it went down
        assert all(a.calls for a in chaos.agents.values())

    @pytest.mark.usefixtures("no_leaks")
    @pytest.mark.parametrize("seed", [1, 2, 3, 4])
    async def test_other_seeds_hold_the_same_invariants(self, clock: FakeClock, seed: int) -> None:
        chaos = await chaos_run(seed=seed, n_tasks=400, clock=clock)
        check_invariants(chaos)

    async def test_the_same_seed_replays_the_same_run(self, clock: FakeClock) -> None:
        first = await chaos_run(seed=7, n_tasks=200, clock=clock)
        second = await chaos_run(seed=7, n_tasks=200, clock=clock)

        def story(chaos: Chaos) -> Sequence[Any]:
            return [
                (
                    r.task_id,
                    r.agent,
                    r.attempts,
                    [(a.agent, a.error_type) for a in r.failures or []],
                )
                for r in sorted(chaos.finished, key=lambda r: r.task_id)
            ]

        assert story(first) == story(second)
        assert first.result.metadata.elapsed == pytest.approx(second.result.metadata.elapsed)
