"""A run's budget (`max_cost=`, `max_tokens=`) and its usage per agent and per model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import pytest

from orchestra import ConfigError, Orchestrator, RunResult, Task, agent

if TYPE_CHECKING:
    from collections.abc import Mapping

    from orchestra import Context
    from orchestra.testing import FakeClock


class Spender:
    """An agent that takes 1 s and reports `cost` and `tokens` per call; it counts its calls."""

    def __init__(self, name: str, *, cost: float, tokens: int) -> None:
        self.name = name
        self.kinds = ("work",)
        self.cost = cost
        self.tokens = tokens
        self.calls: list[str] = []

    async def __call__(self, task: Task, ctx: Context) -> str:
        self.calls.append(task.id)
        await anyio.sleep(1)
        ctx.record_usage(cost=self.cost, input_tokens=self.tokens, output_tokens=1)
        return task.id


def work(n: int, **fields: Any) -> list[Task]:
    return [Task("work", i, id=f"t{i}", **fields) for i in range(n)]


class TestUsagePerAgentAndModel:
    async def test_usage_is_split_by_agent_and_by_model(self, clock: FakeClock) -> None:
        @agent(kinds=["a"], name="first")
        async def first(task: Task, ctx: Context) -> None:
            ctx.record_usage(cost=0.5, model="m-1", input_tokens=10, output_tokens=2)

        @agent(kinds=["b"], name="second")
        async def second(task: Task, ctx: Context) -> None:
            ctx.record_usage(cost=0.25, model="m-1", input_tokens=1, output_tokens=1)
            ctx.record_usage(cost=1.0, model="m-2", input_tokens=100, output_tokens=0)

        tasks = [Task("a", None, id="a1"), Task("a", None, id="a2"), Task("b", None, id="b1")]
        result = await Orchestrator(agents=[first, second]).run(tasks=tasks)
        meta = result.metadata
        assert meta.usage_per_agent == {
            "first": {"cost": 1.0, "input_tokens": 20, "output_tokens": 4},
            "second": {"cost": 1.25, "input_tokens": 101, "output_tokens": 1},
        }
        assert meta.usage_per_model == {
            "m-1": {"cost": 1.25, "input_tokens": 21, "output_tokens": 5},
            "m-2": {"cost": 1.0, "input_tokens": 100, "output_tokens": 0},
        }
        assert meta.cost == pytest.approx(2.25)
        assert RunResult.model_validate_json(result.model_dump_json()) == result

    async def test_costs_add_up_without_float_noise(self, clock: FakeClock) -> None:
        # 0.1 + 0.2 is 0.30000000000000004 in floats: what a run shows is to a billionth.
        @agent(kinds=["work"], name="cheap")
        async def cheap(task: Task, ctx: Context) -> None:
            ctx.record_usage(cost=task.payload, model="m", input_tokens=1)

        tasks = [Task("work", 0.1, id="a"), Task("work", 0.2, id="b")]
        async with Orchestrator(agents=[cheap], concurrency=1) as orch:
            handle = orch.start(tasks=tasks)
            result = await handle
            status = handle.status()
        assert 0.1 + 0.2 != 0.3
        assert result.metadata.cost == 0.3
        assert result.metadata.usage_per_agent["cheap"]["cost"] == 0.3
        assert result.metadata.usage_per_model["m"]["cost"] == 0.3
        assert status.cost == 0.3

    async def test_a_failed_attempts_usage_counts(self, clock: FakeClock) -> None:
        @agent(kinds=["work"], name="flaky")
        async def flaky(task: Task, ctx: Context) -> str:
            ctx.record_usage(cost=0.1, model="m", input_tokens=5)
            if ctx.attempt == 1:
                raise ConnectionError("dropped")
            return "ok"

        result = await Orchestrator(agents=[flaky], seed=1).run(tasks=work(1))
        assert result.status == "success"
        assert result.metadata.usage_per_model["m"] == {"cost": 0.2, "input_tokens": 10}

    async def test_no_usage_reported_leaves_the_tables_empty(self, clock: FakeClock) -> None:
        @agent(kinds=["work"])
        async def quiet(task: Task, ctx: Context) -> None:
            return None

        result = await Orchestrator(agents=[quiet]).run(tasks=work(3))
        assert result.metadata.usage_per_agent == {}
        assert result.metadata.usage_per_model == {}


class Estimating(Spender):
    """A `Spender` that says before each call what it may cost: `reserve` tokens (`estimate`),
    at `usd_per_token` (`cost_of`); it reports `tokens` and their price after the call."""

    def __init__(
        self, name: str, *, reserve: int, tokens: int, usd_per_token: float = 0.0, wait: float = 1
    ) -> None:
        super().__init__(name, cost=tokens * usd_per_token, tokens=tokens - 1)
        self.reserve = reserve
        self.usd_per_token = usd_per_token
        self.wait = wait

    def estimate(self, task: Task) -> dict[str, float]:
        return {
            "input_tokens": self.reserve // 2,
            "output_tokens": self.reserve - self.reserve // 2,
        }

    def cost_of(self, units: Mapping[str, float]) -> float:
        return sum(n for unit, n in units.items() if unit != "requests") * self.usd_per_token


class TestBudget:
    async def test_no_attempt_starts_once_the_cost_budget_is_spent(self, clock: FakeClock) -> None:
        spend = Spender("spend", cost=1.0, tokens=10)
        # Two at a time, 1 USD each, ending at 1 s, 1 s, 2 s, 2 s: at 3 USD (t2's end) t4 may
        # still start, and finishes (4 and then 5 USD); nothing else starts.
        orch = Orchestrator(agents=[spend], concurrency=2, max_cost=3.5, success_threshold=0.2)
        result = await orch.run(tasks=work(10))
        assert spend.calls == ["t0", "t1", "t2", "t3", "t4"]
        assert result.status == "partial"
        assert result.metadata.counts["succeeded"] == 5
        assert result.metadata.counts["cancelled"] == 5
        assert result.metadata.reason is not None
        assert "max_cost=3.5" in result.metadata.reason
        assert {e.error_type for e in result.errors} == {"BudgetExceeded"}
        assert "budget" in result.errors[0].remediation
        assert result.metadata.cost == pytest.approx(5.0)

    async def test_a_token_budget_fails_a_run_below_its_threshold(self, clock: FakeClock) -> None:
        spend = Spender("spend", cost=0.0, tokens=100)
        orch = Orchestrator(agents=[spend], concurrency=1, max_tokens=250)
        result = await orch.run(tasks=work(10))
        assert len(spend.calls) == 3  # 101, 202, 303 tokens: the third reaches 250
        assert result.status == "failed"
        assert result.metadata.reason is not None
        assert "max_tokens=250" in result.metadata.reason

    async def test_a_budget_never_reached_changes_nothing(self, clock: FakeClock) -> None:
        spend = Spender("spend", cost=0.01, tokens=1)
        result = await Orchestrator(agents=[spend], max_cost=100.0).run(tasks=work(20))
        assert result.status == "success"
        assert result.metadata.reason is None
        assert len(spend.calls) == 20

    async def test_attempts_in_flight_finish_when_the_budget_is_spent(
        self, clock: FakeClock
    ) -> None:
        @agent(kinds=["work"], name="mixed")
        async def mixed(task: Task, ctx: Context) -> str:
            await anyio.sleep(1 if task.id == "t0" else 100)
            ctx.record_usage(cost=5.0)
            return task.id

        orch = Orchestrator(agents=[mixed], max_cost=5.0, success_threshold=0.0)
        result = await orch.run(tasks=[*work(3), Task("work", 9, id="late", depends_on=["t0"])])
        # t1 and t2 started with t0 and run to their end (their spend counted); "late", ready
        # at 1 s when 5 USD were spent, never starts.
        assert result.metadata.elapsed == pytest.approx(100.0)
        assert result.metadata.counts["succeeded"] == 3
        assert result.metadata.counts["cancelled"] == 1
        assert result.metadata.cost == pytest.approx(15.0)
        assert result.status == "partial"


class TestPredictiveBudget:
    @pytest.mark.parametrize("concurrency", [1, 4])
    async def test_a_cost_budget_of_exactly_n_calls_allows_n_calls(
        self, clock: FakeClock, concurrency: int
    ) -> None:
        # Each call may cost 100 tokens at 0.01 USD (1 USD); it really costs 0.5 USD. A budget of
        # 3 USD admits 3 calls at once, whatever they will really cost: never a 4th in flight.
        spend = Estimating("spend", reserve=100, tokens=50, usd_per_token=0.01)
        orch = Orchestrator(agents=[spend], concurrency=concurrency, max_cost=3.0)
        result = await orch.run(tasks=work(3))
        assert result.status == "success"
        assert len(spend.calls) == 3
        assert result.metadata.cost == pytest.approx(1.5)

    async def test_the_call_that_would_exceed_the_cost_budget_never_starts(
        self, clock: FakeClock
    ) -> None:
        # 1 USD may be spent by each call, 0.5 USD is: 2.5 USD admit 2 calls at once, then a
        # third once one has ended (1 + 0.5 + 1 = 2.5), ... 4 calls in all (2 + 4 * 0.5 > 2.5).
        spend = Estimating("spend", reserve=100, tokens=50, usd_per_token=0.01)
        orch = Orchestrator(agents=[spend], concurrency=8, max_cost=2.5, success_threshold=0.1)
        result = await orch.run(tasks=work(10))
        assert len(spend.calls) == 4
        assert result.metadata.cost == pytest.approx(2.0)
        assert result.metadata.counts["succeeded"] == 4
        assert result.metadata.counts["cancelled"] == 6
        assert result.status == "partial"
        assert result.metadata.reason is not None
        assert "would be exceeded" in result.metadata.reason
        assert {e.error_type for e in result.errors} == {"BudgetExceeded"}

    async def test_a_token_budget_of_exactly_n_calls_allows_n_calls(self, clock: FakeClock) -> None:
        # Each call reserves 100 tokens and uses all of them: 300 tokens are 3 calls, no 4th.
        spend = Estimating("spend", reserve=100, tokens=100)
        orch = Orchestrator(agents=[spend], concurrency=4, max_tokens=300, success_threshold=0.1)
        result = await orch.run(tasks=work(5))
        assert len(spend.calls) == 3
        assert result.metadata.counts["succeeded"] == 3
        assert result.metadata.counts["cancelled"] == 2
        assert sum(result.metadata.tokens.values()) == 300
        assert result.metadata.reason is not None
        assert "max_tokens=300" in result.metadata.reason

    async def test_a_waiting_attempt_starts_when_one_in_flight_costs_less_than_it_reserved(
        self, clock: FakeClock
    ) -> None:
        # 250 tokens admit 2 reservations of 100 at once (t0, t1). When t0 ends having used 50,
        # t2 fits (50 + 100 + 100); when t1 ends, t3 does not (100 + 100 + 100) and waits for
        # t2; then 150 + 100 fits; then 200 + 100 does not and nothing is in flight: the end.
        spend = Estimating("spend", reserve=100, tokens=50)
        orch = Orchestrator(agents=[spend], concurrency=10, max_tokens=250, success_threshold=0.1)
        result = await orch.run(tasks=work(10))
        assert spend.calls == ["t0", "t1", "t2", "t3"]
        assert result.metadata.elapsed == pytest.approx(3.0)
        assert sum(result.metadata.tokens.values()) == 200

    async def test_without_a_budget_nothing_is_reserved(self, clock: FakeClock) -> None:
        spend = Estimating("spend", reserve=10**9, tokens=10**9, usd_per_token=1.0)
        result = await Orchestrator(agents=[spend], concurrency=4).run(tasks=work(8))
        assert result.status == "success"
        assert len(spend.calls) == 8

    async def test_each_run_has_its_own_budget(self, clock: FakeClock) -> None:
        spend = Spender("spend", cost=1.0, tokens=1)
        orch = Orchestrator(agents=[spend], concurrency=1, max_cost=2.0, success_threshold=0.0)
        first = await orch.run(tasks=work(5))
        second = await orch.run(tasks=work(5))
        assert first.metadata.counts["succeeded"] == second.metadata.counts["succeeded"] == 2

    @pytest.mark.parametrize(
        ("option", "value"),
        [("max_cost", 0), ("max_cost", -1.0), ("max_cost", "1"), ("max_tokens", 0)],
    )
    def test_a_bad_budget_is_a_config_error(self, option: str, value: Any) -> None:
        with pytest.raises(ConfigError, match=option):
            Orchestrator(agents=[Spender("s", cost=0, tokens=0)], **{option: value})


class TestBrokenPrice:
    async def test_a_cost_of_that_raises_prices_the_attempt_at_0(self, clock: FakeClock) -> None:
        class Broken(Estimating):
            def cost_of(self, units: Mapping[str, float]) -> float:
                raise ValueError("no price table")

        spend = Broken("spend", reserve=10, tokens=10, usd_per_token=0.1)
        result = await Orchestrator(agents=[spend], concurrency=1, max_cost=2.5).run(tasks=work(5))
        # Priced at 0 before, 1 USD after each call: the spend so far stops the run at 3 USD.
        assert len(spend.calls) == 3
        assert result.metadata.cost == pytest.approx(3.0)
