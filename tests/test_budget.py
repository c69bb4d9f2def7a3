"""A run's budget (`max_cost=`, `max_tokens=`) and its usage per agent and per model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import pytest

from orchestra import ConfigError, Orchestrator, RunResult, Task, agent

if TYPE_CHECKING:
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


class TestBudget:
    async def test_no_attempt_starts_once_the_cost_budget_is_spent(self, clock: FakeClock) -> None:
        spend = Spender("spend", cost=1.0, tokens=10)
        # Two at a time, 1 USD each, ending at 1 s, 1 s, 2 s, 2 s: at 3 USD (t2's end) t4 may
        # still start; t3's end makes 4 USD, over 3.5: t4 is cancelled and nothing else starts.
        orch = Orchestrator(agents=[spend], concurrency=2, max_cost=3.5, success_threshold=0.2)
        result = await orch.run(tasks=work(10))
        assert spend.calls == ["t0", "t1", "t2", "t3", "t4"]
        assert result.status == "partial"
        assert result.metadata.counts["succeeded"] == 4
        assert result.metadata.counts["cancelled"] == 6
        assert result.metadata.reason is not None
        assert "max_cost=3.5" in result.metadata.reason
        assert {e.error_type for e in result.errors} == {"BudgetExceeded"}
        assert "budget" in result.errors[0].remediation
        assert result.metadata.cost == pytest.approx(4.0)

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

    async def test_attempts_in_flight_are_cancelled_when_the_budget_is_spent(
        self, clock: FakeClock
    ) -> None:
        @agent(kinds=["work"], name="mixed")
        async def mixed(task: Task, ctx: Context) -> str:
            await anyio.sleep(1 if task.id == "t0" else 100)
            ctx.record_usage(cost=5.0)
            return task.id

        orch = Orchestrator(agents=[mixed], max_cost=5.0, success_threshold=0.0)
        result = await orch.run(tasks=work(3))
        assert result.metadata.elapsed == pytest.approx(1.0)
        assert result.metadata.counts["succeeded"] == 1
        assert result.metadata.counts["cancelled"] == 2
        assert result.status == "partial"

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
