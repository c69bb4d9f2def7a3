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
