"""Limits in dispatch: rate limits and shared limiters on agents and orchestrators, reserved before
each attempt, trued up after it, and held by a 429's Retry-After for everyone who shares them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import pytest

from orchestra import (
    Concurrency,
    ConfigError,
    Context,
    Orchestrator,
    Rate,
    RateLimited,
    RetryableError,
    RetryPolicy,
    Task,
    agent,
)
from orchestra.testing import FakeClock, Probe, scripted
from tests.helpers import tasks_of

if TYPE_CHECKING:
    from collections.abc import Callable


class Timed:
    """An agent that records the (virtual) time each call starts; tasks in `fail_once` get one
    `RetryableError(retry_after=...)` (a 429 stand-in with the status code of one)."""

    def __init__(
        self,
        name: str,
        *,
        limits: Any = (),
        usage: int = 0,
        kind: str = "work",
        latency: float = 0.0,
        starts: list[tuple[str, float]] | None = None,
    ) -> None:
        self.name = name
        self.kinds = (kind,)
        self.limits = limits
        self.usage = usage
        self.latency = latency
        self.starts: list[tuple[str, float]] = [] if starts is None else starts

    async def __call__(self, task: Task, ctx: Context) -> Any:
        self.starts.append((task.id, anyio.current_time()))
        if self.latency:
            await anyio.sleep(self.latency)
        if self.usage:
            ctx.record_usage(input_tokens=self.usage)
        return task.payload


class Http429(Exception):
    """An HTTP 429 with a Retry-After, as an API client raises it."""

    status_code = 429

    def __init__(self, retry_after: float) -> None:
        super().__init__("429 Too Many Requests")
        self.response = type("R", (), {"headers": {"retry-after": str(retry_after)}})()


class TestRate:
    async def test_a_rate_spreads_the_calls_evenly(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        a = Timed("a", limits=[Rate(60, per=60)])
        orch = make_orchestrator(agents=[a], concurrency=10)
        t0 = clock.time()
        result = await orch.run(tasks=tasks_of(5))
        assert result.status == "success"
        # 60 a minute is one a second, never the minute's budget at once.
        assert [round(t - t0, 6) for _, t in a.starts] == [0, 1, 2, 3, 4]

    async def test_tokens_recorded_by_the_agent_are_charged_after_the_call(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        a = Timed("a", limits=[Rate(1000, per=1, unit="input_tokens")], usage=2000)
        orch = make_orchestrator(agents=[a], concurrency=10)
        t0 = clock.time()
        await orch.run(tasks=tasks_of(3))
        # Each call reported 2,000 tokens of a 1,000-a-second budget: the next waits 2 s (less
        # the rate's burst of one token, 1 ms).
        assert [t - t0 for _, t in a.starts] == pytest.approx([0, 2, 4], abs=2e-3)

    async def test_an_agents_estimate_is_reserved_before_the_call(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        class Estimating(Timed):
            def estimate(self, task: Task) -> dict[str, float]:
                return {"input_tokens": 500}

        a = Estimating("a", limits=[Rate(1000, per=1, unit="input_tokens", burst=1000)])
        orch = make_orchestrator(agents=[a], concurrency=10)
        t0 = clock.time()
        await orch.run(tasks=tasks_of(4))
        # 500 estimated tokens each, 1,000 a second with a burst of 1,000: two go at once, then
        # one every half second (the estimate stands: nothing recorded corrects it).
        assert [round(t - t0, 3) for _, t in a.starts] == [0, 0, 0.5, 1.0]

    async def test_a_rate_shared_by_two_agents_is_one_budget(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        key = [Rate(2, per=1)]
        a, b = Timed("a", limits=key), Timed("b", limits=key)
        orch = make_orchestrator(agents=[a, b], concurrency=10)
        t0 = clock.time()
        await orch.run(tasks=tasks_of(6))
        starts = sorted(round(t - t0, 6) for _, t in a.starts + b.starts)
        assert starts == [0, 0.5, 1, 1.5, 2, 2.5]
        assert a.starts
        assert b.starts


def interleaved(n: int, priorities: Callable[[int], int] = lambda i: 0) -> list[Task]:
    """``a0, b0, a1, b1, ...``: `n` tasks of kind "a" and `n` of kind "b", alternating in the input;
    the i-th of each kind has priority ``priorities(i)``."""
    return [
        Task(kind, i, id=f"{kind}{i}", priority=priorities(i)) for i in range(n) for kind in "ab"
    ]


def run_order(tasks: list[Task]) -> list[str]:
    """The ids of `tasks` in the run's order: priority, then input order."""
    return [t.id for _, t in sorted(enumerate(tasks), key=lambda it: (it[1].priority, it[0]))]


class TestSharedLimitOrder:
    """A limit shared by several agents grants room in the run's order (priority, then input
    order) across them, not to whichever agent's waiting tasks happen to be looked at first."""

    @pytest.mark.parametrize(
        "priorities",
        [lambda i: 0, lambda i: 0 if i < 3 else 1, lambda i: i % 2, lambda i: 2 - i // 2],
        ids=["one priority", "two priorities", "alternating", "falling"],
    )
    async def test_a_shared_rate_grants_room_in_the_runs_order(
        self,
        clock: FakeClock,
        make_orchestrator: Callable[..., Orchestrator],
        priorities: Callable[[int], int],
    ) -> None:
        key = [Rate(60, per=60)]
        starts: list[tuple[str, float]] = []
        a = Timed("a", kind="a", limits=key, starts=starts)
        b = Timed("b", kind="b", limits=key, starts=starts)
        orch = make_orchestrator(agents=[a, b], concurrency=10)
        tasks = interleaved(6, priorities)
        t0 = clock.time()
        result = await orch.run(tasks=tasks)
        assert result.status == "success"
        assert [i for i, _ in starts] == run_order(tasks)
        assert [round(t - t0, 6) for _, t in starts] == list(range(12))  # one a second

    async def test_a_shared_concurrency_grants_room_in_the_runs_order(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        key = [Concurrency(1)]
        starts: list[tuple[str, float]] = []
        a = Timed("a", kind="a", limits=key, latency=1.0, starts=starts)
        b = Timed("b", kind="b", limits=key, latency=1.0, starts=starts)
        orch = make_orchestrator(agents=[a, b], concurrency=10)
        tasks = interleaved(5, lambda i: i % 2)
        t0 = clock.time()
        await orch.run(tasks=tasks)
        assert [i for i, _ in starts] == run_order(tasks)
        assert [round(t - t0, 6) for _, t in starts] == list(range(10))

    async def test_a_rate_shared_by_two_orchestrators_goes_by_priority_across_them(
        self, clock: FakeClock
    ) -> None:
        key = [Rate(60, per=60)]
        starts: list[tuple[str, float]] = []
        first = Orchestrator(agents=[Timed("a", kind="a", limits=key, starts=starts)])
        second = Orchestrator(agents=[Timed("b", kind="b", limits=key, starts=starts)])
        t0 = clock.time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(first.run, [Task("a", i, id=f"a{i}", priority=1) for i in range(4)])
            tg.start_soon(second.run, [Task("b", i, id=f"b{i}") for i in range(4)])
        # a0 went at once, before b's tasks were admitted; then priority 0 (b) before 1 (a).
        assert [i for i, _ in starts] == ["a0", "b0", "b1", "b2", "b3", "a1", "a2", "a3"]
        assert [round(t - t0, 6) for _, t in starts] == list(range(8))


class TestSharedConcurrency:
    async def test_one_concurrency_for_two_agents(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        probe = Probe()
        key = Concurrency(3)
        agents = [
            scripted(name, ["work"], latency=1.0, probe=probe, concurrency=key)
            for name in ("a", "b")
        ]
        orch = make_orchestrator(agents=agents, concurrency=50)
        result = await orch.run(tasks=tasks_of(30))
        assert result.status == "success"
        assert probe.peak == 3
        assert key.in_use == 0

    async def test_one_concurrency_for_two_orchestrators(self, clock: FakeClock) -> None:
        probe = Probe()
        shared = Concurrency(4)
        first = Orchestrator(
            agents=[scripted("a", ["work"], latency=1.0, probe=probe)], concurrency=shared
        )
        second = Orchestrator(
            agents=[scripted("b", ["work"], latency=1.0, probe=probe)], concurrency=shared
        )
        results = []

        async def run(orch: Orchestrator) -> None:
            results.append(await orch.run(tasks=tasks_of(20)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, first)
            tg.start_soon(run, second)
        assert [r.status for r in results] == ["success", "success"]
        assert probe.peak == 4
        assert probe.peak_by_agent["a"] >= 1
        assert probe.peak_by_agent["b"] >= 1
        assert shared.in_use == 0


class TestRetryAfter:
    @pytest.mark.parametrize(
        "refusal",
        [
            lambda: Http429(retry_after=10),
            lambda: RateLimited("slow down", retry_after=10),  # an agent's own client's 429
        ],
        ids=["http 429", "RateLimited"],
    )
    async def test_a_429_holds_every_agent_that_shares_the_limit(
        self,
        clock: FakeClock,
        make_orchestrator: Callable[..., Orchestrator],
        refusal: Callable[[], Exception],
    ) -> None:
        key = [Concurrency(10)]
        hit: list[float] = []
        others: list[float] = []

        @agent(kinds=["hit"], limits=key)
        async def limited(task: Task, ctx: Context) -> str:
            hit.append(anyio.current_time())
            if len(hit) == 1:
                raise refusal()
            return "ok"

        @agent(kinds=["other"], limits=key)
        async def other(task: Task, ctx: Context) -> str:
            others.append(anyio.current_time())
            await anyio.sleep(1)
            return "ok"

        orch = make_orchestrator(
            agents=[limited, other], concurrency=10, retry=RetryPolicy(base=0.1)
        )
        t0 = clock.time()
        tasks = [
            Task("hit", 0, id="h"),
            *[Task("other", i, id=f"o{i}", priority=1) for i in range(3)],
        ]
        async with orch:
            result = await orch.run(tasks=tasks)
        assert result.status == "success"
        # `h` got the 429 at t=0; everyone on the key waited for its Retry-After, not only `h`.
        assert [round(t - t0, 6) for t in hit] == [0, 10]
        assert min(others) - t0 >= 10 - 1e-9

    @pytest.mark.parametrize("shared", [False, True], ids=["own limits", "a shared limit"])
    async def test_a_retry_after_that_is_not_a_rate_limit_holds_only_its_task(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator], shared: bool
    ) -> None:
        calls: list[tuple[str, float]] = []

        @agent(kinds=["work"], limits=[Concurrency(10)] if shared else ())
        async def busy(task: Task, ctx: Context) -> str:
            calls.append((task.id, anyio.current_time()))
            if task.id == "t0" and len(calls) == 1:
                raise RetryableError("try me later", retry_after=10)
            return "ok"

        orch = make_orchestrator(agents=[busy], concurrency=1, retry=RetryPolicy(base=0.1))
        t0 = clock.time()
        await orch.run(tasks=tasks_of(3))
        assert [(i, round(t - t0, 6)) for i, t in calls] == [
            ("t0", 0),
            ("t1", 0),
            ("t2", 0),
            ("t0", 10),
        ]


class TestLimitOptions:
    @pytest.mark.parametrize("limits", [["x"], "rate", [3], Rate(1)])
    def test_limits_must_be_a_list_of_limits(self, limits: Any) -> None:
        with pytest.raises(ConfigError, match="limits"):
            agent(kinds=["work"], limits=limits)(_noop)

    def test_an_orchestrators_concurrency_may_be_a_shared_limit(self) -> None:
        shared = Concurrency(7)
        assert Orchestrator(agents=[agent(kinds=["w"])(_noop)], concurrency=shared).concurrency == 7

    @pytest.mark.parametrize("value", ["3", 0, 2.5, True, None])
    def test_a_bad_concurrency_is_refused(self, value: Any) -> None:
        with pytest.raises(ConfigError, match="concurrency"):
            Orchestrator(agents=[agent(kinds=["w"])(_noop)], concurrency=value)


async def _noop(task: Task, ctx: Context) -> None:
    return None
