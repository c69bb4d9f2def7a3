"""Invariants over random runs: random task graphs, priorities, limits and latencies, in virtual time.

Each example builds its own `FakeClock` with `fake_clock()` (hypothesis examples cannot share function
fixtures).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestra import Context, Orchestrator, PermanentError, RetryPolicy, Task
from orchestra.events import AttemptStarted, Event, TaskFinished
from orchestra.testing import Probe
from tests.helpers import NEVER_OPENS, assert_no_leaks, fake_clock, live_tasks

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

KINDS = ("a", "b")
LATENCIES = (0.0, 0.1, 0.5, 1.0, 2.5)


@dataclass
class Spec:
    """One task of a random scenario."""

    id: str
    kind: str
    priority: int
    deps: list[str]
    latency: float
    fails: bool
    flaky: bool
    spawns: bool = False  # spawns one child, "<id>/child", before it fails or succeeds


def payload(
    latency: float, *, fails: bool = False, flaky: bool = False, spawns: bool = False
) -> dict[str, Any]:
    return {"latency": latency, "fails": fails, "flaky": flaky, "spawns": spawns}


@dataclass
class Scenario:
    specs: list[Spec]
    concurrency: int
    agents: dict[str, tuple[str, int | None]]  # name -> (kind, limit)
    cancel_after: float = 0.0
    streamed: bool = False  # given as an async generator (admitted one by one) or a whole list
    window: int | None = None

    def task_list(self) -> list[Task]:
        return [
            Task(
                s.kind,
                payload(s.latency, fails=s.fails, flaky=s.flaky, spawns=s.spawns),
                id=s.id,
                priority=s.priority,
                depends_on=list(s.deps),
            )
            for s in self.specs
        ]

    def tasks(self) -> list[Task] | AsyncIterator[Task]:
        if not self.streamed:
            return self.task_list()

        async def stream() -> AsyncIterator[Task]:
            for i, task in enumerate(self.task_list()):
                if i % 3 == 2:
                    await anyio.sleep(0.2)
                yield task

        return stream()

    def expected_statuses(self) -> dict[str, str]:
        status: dict[str, str] = {}
        for s in self.specs:  # dependencies come first
            if any(status[d] != "succeeded" for d in s.deps):
                status[s.id] = "skipped"
            else:
                status[s.id] = "failed" if s.fails else "succeeded"
                if s.spawns and not s.fails:  # only a successful attempt's spawn is admitted
                    status[f"{s.id}/child"] = "succeeded"
        return status


@st.composite
def scenarios(draw: st.DrawFn, *, with_deps: bool = True, failures: bool = True) -> Scenario:
    n = draw(st.integers(1, 25))
    specs = []
    for i in range(n):
        deps: list[int] = []
        if with_deps and i:
            deps = draw(st.lists(st.integers(0, i - 1), max_size=3, unique=True))
        specs.append(
            Spec(
                id=f"t{i}",
                kind=draw(st.sampled_from(KINDS)),
                priority=draw(st.integers(-3, 3)),
                deps=[f"t{d}" for d in deps],
                latency=draw(st.sampled_from(LATENCIES)),
                fails=failures and draw(st.integers(0, 9)) == 0,
                flaky=failures and draw(st.integers(0, 4)) == 0,
                spawns=draw(st.integers(0, 4)) == 0,
            )
        )
    agents: dict[str, tuple[str, int | None]] = {}
    for kind in KINDS:
        for j in range(draw(st.integers(1, 2))):
            agents[f"{kind}{j}"] = (kind, draw(st.none() | st.integers(1, 4)))
    return Scenario(
        specs=specs,
        concurrency=draw(st.integers(1, 6)),
        agents=agents,
        cancel_after=draw(st.sampled_from((0.0, 0.05, 0.3, 1.0, 2.0, 4.0))),
        streamed=draw(st.booleans()),
        window=draw(st.none() | st.integers(1, 6)),
    )


_CHILD = payload(0.1)


class PropAgent:
    """Sleeps the task's latency; spawns a child when told to; then fails when told to
    (permanently, or its first attempt only)."""

    def __init__(self, name: str, kind: str, limit: int | None, probe: Probe) -> None:
        self.name = name
        self.kinds = (kind,)
        self.concurrency = limit
        self.probe = probe

    async def __call__(self, task: Task, ctx: Context) -> Any:
        self.probe.enter(self.name)
        try:
            payload = task.payload
            if payload["latency"]:
                await anyio.sleep(payload["latency"])
            if payload["spawns"]:
                ctx.spawn(Task(task.kind, _CHILD, id=f"{task.id}/child"))
            if payload["fails"]:
                raise PermanentError(f"{task.id} fails")
            if payload["flaky"] and ctx.attempt == 1:
                raise ConnectionError(f"{task.id} flaked")
            return task.id
        finally:
            self.probe.exit(self.name)


def build(scenario: Scenario, probe: Probe) -> Orchestrator:
    agents = [
        PropAgent(name, kind, limit, probe) for name, (kind, limit) in scenario.agents.items()
    ]
    return Orchestrator(
        agents=agents,
        concurrency=scenario.concurrency,
        window=scenario.window,
        retry=RetryPolicy(max_attempts=2, base=0.05, cap=0.1),
        breaker=NEVER_OPENS,  # failures here are the scenario's, not an outage
        success_threshold=0.0,
        seed=0,
    )


class TestInvariants:
    @settings(max_examples=30, deadline=None)
    @given(scenario=scenarios())
    async def test_every_task_ends_once_within_the_limits_after_its_dependencies(
        self, scenario: Scenario
    ) -> None:
        before = live_tasks()
        async with fake_clock():
            probe = Probe()
            events: list[Event] = []
            orch = build(scenario, probe)
            orch.subscribe(events.append, AttemptStarted, TaskFinished, buffer=100_000)
            result = await orch.run(tasks=scenario.tasks())
        await assert_no_leaks(before)

        assert result.metadata.events_dropped == 0
        finished = [e.result for e in events if isinstance(e, TaskFinished)]
        expected = scenario.expected_statuses()  # spawned children included
        # every task ends in exactly one terminal state, exactly once
        assert Counter(r.task_id for r in finished) == dict.fromkeys(expected, 1)
        assert {r.task_id: r.status for r in finished} == expected
        assert result.metadata.total == len(expected)

        # the global and per-agent limits are never exceeded
        assert probe.peak <= scenario.concurrency
        assert result.metadata.peak_concurrency <= scenario.concurrency
        for name, peak in probe.peak_by_agent.items():
            limit = scenario.agents[name][1]
            assert limit is None or peak <= limit
        assert probe.current == 0

        # a task never starts before its dependencies succeeded
        deps = {s.id: s.deps for s in scenario.specs}
        succeeded: set[str] = set()
        for event in events:
            if isinstance(event, TaskFinished):
                if event.result.status == "succeeded":
                    succeeded.add(event.result.task_id)
            elif isinstance(event, AttemptStarted):
                assert set(deps.get(event.task_id, ())) <= succeeded, event

    @settings(max_examples=30, deadline=None)
    @given(
        priorities=st.lists(st.integers(-5, 5), min_size=1, max_size=30),
        kinds=st.lists(st.sampled_from(KINDS), min_size=30, max_size=30),
        latencies=st.lists(st.sampled_from(LATENCIES), min_size=30, max_size=30),
    )
    async def test_dispatch_follows_priority_then_admission_order(
        self, priorities: list[int], kinds: list[str], latencies: list[float]
    ) -> None:
        async with fake_clock():
            probe = Probe()
            agents = [PropAgent(f"{k}0", k, None, probe) for k in KINDS]
            orch = Orchestrator(agents=agents, concurrency=1)
            started: list[str] = []
            orch.subscribe(lambda e: started.append(e.task_id), AttemptStarted, buffer=100_000)
            tasks = [
                Task(kinds[i], payload(latencies[i]), id=f"t{i}", priority=p)
                for i, p in enumerate(priorities)
            ]
            result = await orch.run(tasks=tasks)
        assert result.status == "success"
        expected = [f"t{i}" for _, i in sorted((p, i) for i, p in enumerate(priorities))]
        assert started == expected

    @settings(max_examples=30, deadline=None)
    @given(scenario=scenarios())
    async def test_a_cancelled_run_leaks_nothing_and_frees_every_slot(
        self, scenario: Scenario
    ) -> None:
        before = live_tasks()
        async with fake_clock():
            probe = Probe()
            orch = build(scenario, probe)
            with anyio.move_on_after(scenario.cancel_after):
                await orch.run(tasks=scenario.tasks())
            await assert_no_leaks(before)
            assert probe.current == 0
            assert all(s["in_flight"] == 0 for s in orch.agents_status())
            # The global count came back to 0 too: a new run gets every slot again.
            limits = [limit for kind, limit in scenario.agents.values() if kind == "a"]
            room = math.inf if None in limits else sum(x for x in limits if x is not None)
            n = scenario.concurrency
            again_tasks = [Task("a", payload(1.0), id=f"again{i}") for i in range(n)]
            with anyio.fail_after(100.0):
                again = await orch.run(tasks=again_tasks)
        assert again.status == "success"
        assert again.metadata.peak_concurrency == min(n, room)
