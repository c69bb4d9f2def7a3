"""`Context.reserve`: an attempt trues its reservation on its agent's limits up before its call."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from orchestra import Orchestrator, Rate, Task, agent

if TYPE_CHECKING:
    from orchestra import Context
    from orchestra.testing import FakeClock


class Grower:
    """Reserves 10 input tokens, learns at the start of the attempt that it needs `need`, trues
    the reservation up, then "calls" (records the time) and uses exactly `need`."""

    def __init__(self, need: int, *, limits: Any = ()) -> None:
        self.name = "grower"
        self.kinds = ("work",)
        self.need = need
        self.limits = limits
        self.calls: list[float] = []
        self.seen: list[dict[str, float]] = []

    def estimate(self, task: Task) -> dict[str, float]:
        return {"input_tokens": 10}

    async def __call__(self, task: Task, ctx: Context) -> str:
        await ctx.reserve(input_tokens=self.need - ctx.reserved["input_tokens"])
        self.seen.append(dict(ctx.reserved))
        self.calls.append(anyio.current_time())
        await anyio.sleep(1)
        ctx.record_usage(input_tokens=self.need)
        return task.id


def work(n: int) -> list[Task]:
    return [Task("work", i, id=f"t{i}") for i in range(n)]


class TestReserve:
    async def test_an_increase_waits_for_room_on_the_rate(self, clock: FakeClock) -> None:
        # 600 tokens a minute (10 a second, a burst of 10): 300 tokens per call is 30 s of the
        # meter each; estimated at 10, all three would go at once.
        rate = Rate(600, per=60, unit="input_tokens", burst=10)
        grower = Grower(300, limits=[rate])
        result = await Orchestrator(agents=[grower], concurrency=3).run(tasks=work(3))
        assert result.status == "success"
        t0 = grower.calls[0]
        gaps = [round(t - t0) for t in grower.calls]
        assert gaps == [0, 30, 60]
        assert grower.seen[0] == {"requests": 1, "input_tokens": 300}

    async def test_a_decrease_gives_back_at_once(self, clock: FakeClock) -> None:
        rate = Rate(600, per=60, unit="input_tokens", burst=10)
        grower = Grower(1, limits=[rate])
        start = anyio.current_time()
        result = await Orchestrator(agents=[grower], concurrency=3).run(tasks=work(3))
        assert result.status == "success"
        # 10 reserved each (1 s of the meter), trued down to 1 (0.1 s) before the call: the
        # 2nd and 3rd go 0.1 s apart, not 1 s.
        assert [t - start for t in grower.calls] == pytest.approx([0.0, 0.1, 0.2])
        assert rate.in_use(anyio.current_time()) == pytest.approx(0.0)

    async def test_nothing_reserved_is_nothing_to_true_up(self, clock: FakeClock) -> None:
        seen: list[Any] = []

        @agent(kinds=["work"])  # no limits and no budget: the attempt reserved nothing
        async def plain(task: Task, ctx: Context) -> str:
            seen.append(ctx.reserved)
            await ctx.reserve(input_tokens=5)
            return "ok"

        result = await Orchestrator(agents=[plain]).run(tasks=work(1))
        assert result.status == "success", result.errors
        assert seen == [{}]

    async def test_an_agent_without_an_estimate_cannot_true_up(self, clock: FakeClock) -> None:
        @agent(kinds=["work"], limits=[Rate(10, per=1)])
        async def plain(task: Task, ctx: Context) -> str:
            await ctx.reserve(input_tokens=5)
            return "ok"

        result = await Orchestrator(agents=[plain]).run(tasks=work(1))
        assert result.status == "failed"
        assert result.errors[0].error_type == "InputError"
        assert "estimate" in result.errors[0].message

    @pytest.mark.parametrize("bad", [float("nan"), float("inf"), "5", True], ids=repr)
    async def test_a_wrong_amount_fails_the_attempt_and_leaves_the_rate_whole(
        self, clock: FakeClock, bad: Any
    ) -> None:
        # A NaN was added to the shared rate's meter: every later reservation compared with NaN.
        rate = Rate(600, per=60, unit="input_tokens", burst=10)
        grower = Grower(300, limits=[rate])

        async def call(task: Task, ctx: Context) -> str:
            if task.id == "t0":
                await ctx.reserve(input_tokens=bad)
            return task.id

        result = await Orchestrator(agents=[Wrapped(grower, call)]).run(tasks=work(2))
        error = result.error_for("t0")
        assert error is not None
        assert error.error_type == "InputError"
        assert "input_tokens" in error.message
        assert result.data == {"t1": "t1"}
        assert math.isfinite(rate.in_use(anyio.current_time()))


class Wrapped:
    """`Grower`'s name, kinds, estimate and limits around another call."""

    def __init__(self, inner: Grower, call: Any) -> None:
        self.name, self.kinds, self.limits = inner.name, inner.kinds, inner.limits
        self.estimate = inner.estimate
        self._call = call

    async def __call__(self, task: Task, ctx: Context) -> str:
        result: str = await self._call(task, ctx)
        return result


class TestUsageOfAnotherAgent:
    async def test_is_counted_under_its_name_and_not_on_the_attempt_s_limits(
        self, clock: FakeClock
    ) -> None:
        # The attempt reserves 10 tokens a call on a meter of 10 a second: what it spends for the
        # planner (500 tokens) would hold the next call back 50 s if it were trued up here.
        rate = Rate(600, per=60, unit="input_tokens", burst=10)
        calls: list[float] = []

        class Worker:
            name, kinds, limits = "worker", ("work",), [rate]

            def estimate(self, task: Task) -> dict[str, float]:
                return {"input_tokens": 10}

            async def __call__(self, task: Task, ctx: Context) -> str:
                calls.append(anyio.current_time())
                ctx.record_usage(input_tokens=10, cost=0.01)
                ctx.record_usage_for("planner", input_tokens=500, cost=0.5, model="m")
                return task.id

        worker = Worker()
        result = await Orchestrator(agents=[worker], concurrency=1).run(tasks=work(2))
        assert result.status == "success"
        assert calls[1] - calls[0] < 5
        per_agent = result.metadata.usage_per_agent
        assert per_agent["planner"]["input_tokens"] == 1000
        assert per_agent["worker"]["input_tokens"] == 20
        assert result.metadata.usage_per_model["m"]["input_tokens"] == 1000
        assert math.isclose(result.metadata.cost, 1.02)

    async def test_a_name_that_is_not_a_str_fails_the_attempt(self, clock: FakeClock) -> None:
        @agent(kinds=["work"])
        async def worker(task: Task, ctx: Context) -> str:
            ctx.record_usage_for(7, input_tokens=1)  # type: ignore[arg-type]
            return task.id

        result = await Orchestrator(agents=[worker]).run(tasks=work(1))
        assert result.status == "failed"
        assert "agent must be a str" in str(result.errors[0].message)
