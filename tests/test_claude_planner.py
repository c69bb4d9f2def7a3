"""`ClaudePlanner` against the fake Messages API: a plan constrained to the kinds, checked as any
input is, re-planned with the error as feedback, never run when invalid."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest
from pydantic import BaseModel

from orchestra import ConfigError, InputError, Orchestrator, Task, agent
from orchestra.agents import ClaudePlanner
from tests.claude_fixtures import SONNET, account, api, client
from tests.fake_messages_api import prompt_of

if TYPE_CHECKING:
    from orchestra import Context
    from orchestra.agents import ClaudeAccount
    from tests.fake_messages_api import FakeMessagesAPI

__all__ = ("account", "api", "client")  # fixtures, used by name


def plan(*tasks: dict[str, Any]) -> str:
    return json.dumps({"tasks": list(tasks)})


class Clause(BaseModel):
    text: str


@agent(kinds=["research", "summarize"])
async def worker(task: Task, ctx: Context) -> str:
    return f"{task.kind}:{task.payload}:{sorted(ctx.deps)}"


class TestPlanning:
    async def test_a_valid_plan_runs(self, api: FakeMessagesAPI, account: ClaudeAccount) -> None:
        api.answer(
            plan(
                {"id": "r1", "kind": "research", "payload": "clause 1"},
                {"id": "r2", "kind": "research", "payload": "clause 2"},
                {"id": "s", "kind": "summarize", "payload": "all", "depends_on": ["r1", "r2"]},
            )
        )
        planner = ClaudePlanner(
            model=SONNET,
            kinds={"research": "assess one clause", "summarize": "sum up"},
            account=account,
        )
        result = await Orchestrator(agents=[worker], decomposer=planner).run("a contract")
        assert result.status == "success"
        assert result.data["s"] == "summarize:all:['r1', 'r2']"
        body = api.requests[0].body
        schema = json.dumps(body["output_config"]["format"]["schema"])
        assert '"research"' in schema
        assert '"summarize"' in schema
        assert "- research: assess one clause" in body["system"]
        assert prompt_of(body).endswith("a contract")
        assert planner.spent["input_tokens"] > 0
        # The plan's spend is the run's: in its totals, under the planner's name and model.
        usage = result.metadata.usage_per_agent["claude-planner"]
        assert usage["input_tokens"] == planner.spent["input_tokens"]
        assert usage["cost"] == pytest.approx(planner.spent["cost"]) != 0
        assert result.metadata.usage_per_model[SONNET]["input_tokens"] >= usage["input_tokens"]
        assert result.metadata.cost >= planner.spent["cost"]

    async def test_an_invalid_plan_is_planned_again_with_the_error(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.answer(
            plan(
                {"id": "a", "kind": "research", "payload": "x", "depends_on": ["b"]},
                {"id": "b", "kind": "research", "payload": "y", "depends_on": ["a"]},
            ),
            plan({"id": "a", "kind": "research", "payload": "x"}),
        )
        planner = ClaudePlanner(model=SONNET, kinds=["research", "summarize"], account=account)
        tasks = await planner("job")
        assert [t.id for t in tasks] == ["a"]
        second = prompt_of(api.requests[1].body)
        assert "That plan is invalid: dependency cycle" in second

    @pytest.mark.parametrize(
        ("bad", "problem"),
        [
            (plan({"id": "a", "kind": "deploy", "payload": "x"}), "kind: Input should be"),
            (plan({"id": "a", "kind": "research", "payload": "x", "depends_on": ["z"]}), "'z'"),
            (
                plan(
                    {"id": "a", "kind": "research", "payload": "x"},
                    {"id": "a", "kind": "research", "payload": "y"},
                ),
                "'a'",
            ),
            (plan(), "no task"),
            ("not json at all", "Invalid JSON"),
        ],
    )
    async def test_no_work_starts_on_an_invalid_plan(
        self, api: FakeMessagesAPI, account: ClaudeAccount, bad: str, problem: str
    ) -> None:
        api.answer(bad, bad)
        calls: list[str] = []

        @agent(kinds=["research", "summarize"])
        async def watched(task: Task, ctx: Context) -> None:
            calls.append(task.id)

        planner = ClaudePlanner(
            model=SONNET, kinds=["research", "summarize"], account=account, max_plans=2
        )
        with pytest.raises(InputError, match="no valid plan in 2 tries") as caught:
            await Orchestrator(agents=[watched], decomposer=planner).run("job")
        assert problem in str(caught.value)
        assert calls == []
        assert len(api.requests) == 2

    async def test_payload_models_are_in_the_schema_and_checked(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.answer(
            plan({"id": "a", "kind": "research", "payload": {"wrong": 1}}),
            plan({"id": "a", "kind": "research", "payload": {"text": "clause"}}),
        )
        planner = ClaudePlanner(
            model=SONNET, kinds=["research"], payloads={"research": Clause}, account=account
        )
        tasks = await planner("job")
        assert tasks[0].payload == Clause(text="clause")
        schema = json.dumps(api.requests[0].body["output_config"]["format"]["schema"])
        assert '"text"' in schema

    def test_bad_options_are_config_errors(self, account: ClaudeAccount) -> None:
        with pytest.raises(ConfigError, match="kinds"):
            ClaudePlanner(model=SONNET, kinds=[], account=account)
        with pytest.raises(ConfigError, match="payloads"):
            ClaudePlanner(model=SONNET, kinds=["a"], payloads={"b": Clause}, account=account)
        with pytest.raises(ConfigError, match="max_plans"):
            ClaudePlanner(model=SONNET, kinds=["a"], max_plans=0, account=account)

    @pytest.mark.parametrize(
        ("options", "shown"),
        [
            ({"kinds": 3}, "3"),  # TypeError: 'int' object is not iterable
            ({"kinds": [1]}, "[1]"),
            ({"kinds": {"a": 3}}, "3"),
            ({"payloads": {"a": 3}}, "3"),  # PydanticSchemaGenerationError
            ({"max_tasks": 0}, "0"),
            ({"max_tasks": "10"}, "'10'"),
            ({"retry": 3}, "3"),  # AttributeError at the first plan
        ],
        ids=repr,
    )
    def test_wrong_values_are_config_errors_naming_them(
        self, account: ClaudeAccount, options: dict[str, Any], shown: str
    ) -> None:
        options = {"kinds": ["a"], **options}
        with pytest.raises(ConfigError) as info:
            ClaudePlanner(model=SONNET, account=account, **options)
        name = next(iter(set(options) - {"kinds"}), "kinds")
        assert name in str(info.value)
        assert shown in str(info.value)

    def test_kinds_with_descriptions_pass(self, account: ClaudeAccount) -> None:
        planner = ClaudePlanner(model=SONNET, kinds={"a": "the a's"}, account=account)
        assert planner.kinds == ("a",)
