"""Agents: `@agent(...)`, agent-like objects, what they are told in their `Context`."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Literal

import anyio
import pytest
from pydantic import BaseModel

from orchestra import (
    Agent,
    AgentLike,
    ConfigError,
    Context,
    Orchestrator,
    RetryPolicy,
    Task,
    agent,
)

if TYPE_CHECKING:
    from orchestra.testing import FakeClock
    from tests.helpers import LogLines


class Answer(BaseModel):
    value: int


async def plain(task: Task, ctx: Context) -> Any:
    return task.payload


def sync_fn(task: Task) -> Any:
    return task.payload


def optional_ctx(task: Task, ctx: Context | None = None) -> str:
    return "fine"  # at module level: a worker process imports it by name


class TestDecorator:
    def test_defaults(self) -> None:
        a = agent(plain, kinds=["work"])
        assert isinstance(a, Agent)
        assert isinstance(a, AgentLike)
        assert a.name == "plain"
        assert tuple(a.kinds) == ("work",)
        assert a.concurrency is None
        assert a.timeout is None
        assert a.input is None
        assert a.output is None
        assert a.retry is None
        assert "plain" in repr(a)

    def test_every_option_is_kept(self) -> None:
        policy = RetryPolicy(max_attempts=2)

        @agent(
            kinds=["a", "b"],
            name="custom",
            concurrency=3,
            input=Answer,
            output=Answer,
            retry=policy,
            timeout=2.5,
        )
        async def fn(task: Task, ctx: Context) -> None:
            return None

        assert (fn.name, tuple(fn.kinds), fn.concurrency, fn.timeout) == (
            "custom",
            ("a", "b"),
            3,
            2.5,
        )
        assert fn.input is Answer
        assert fn.output is Answer
        assert fn.retry is policy

    @pytest.mark.parametrize(
        "options",
        [
            {"kinds": []},
            {"kinds": "work"},
            {"kinds": ["work", ""]},
            {"kinds": ["work", 3]},
            {"kinds": ["work"], "concurrency": 0},
            {"kinds": ["work"], "concurrency": -2},
            {"kinds": ["work"], "concurrency": 1.5},
            {"kinds": ["work"], "concurrency": True},
            {"kinds": ["work"], "timeout": 0},
            {"kinds": ["work"], "timeout": -1},
            {"kinds": ["work"], "timeout": math.nan},
            {"kinds": ["work"], "executor": "gpu"},
            {"kinds": ["work"], "executor": "thread"},  # `plain` is async
        ],
        ids=repr,
    )
    def test_bad_options(self, options: dict[str, Any]) -> None:
        with pytest.raises(ConfigError):
            agent(plain, **options)

    def test_a_sync_function_needs_an_executor(self) -> None:
        with pytest.raises(ConfigError, match="executor"):
            agent(sync_fn, kinds=["work"])
        assert agent(sync_fn, kinds=["work"], executor="thread").name == "sync_fn"

    @pytest.mark.parametrize("executor", ["thread", "process"])
    def test_an_off_loop_function_that_wants_a_ctx_is_refused_at_once(
        self, executor: Literal["thread", "process"]
    ) -> None:
        # Written like an async agent, `def fn(task, ctx)` failed every call with a TypeError
        # (retried, then the task failed) instead of at the decorator.
        def with_ctx(task: Task, ctx: Context) -> str:
            return "never"

        with pytest.raises(ConfigError, match=r"'with_ctx'.*fn\(task\)`, with no ctx"):
            agent(with_ctx, kinds=["work"], executor=executor)

        assert agent(optional_ctx, kinds=["work"], executor=executor).executor == executor

    def test_an_agent_that_does_not_take_task_and_ctx_is_refused_at_once(self) -> None:
        # Without the check, every attempt failed with a TypeError, retried three times.
        async def one(task: Task) -> str:
            return "never"

        async def three(task: Task, ctx: Context, extra: int) -> str:
            return "never"

        async def keyword_ctx(task: Task, *, ctx: Context) -> str:
            return "never"

        for fn in (one, three, keyword_ctx):
            with pytest.raises(ConfigError, match=r"\(task, ctx\)") as info:
                agent(fn, kinds=["work"])
            assert repr(fn.__name__) in str(info.value)

    def test_every_callable_that_takes_task_and_ctx_is_accepted(self) -> None:
        async def with_options(task: Task, ctx: Context, extra: int = 0) -> int:
            return extra

        async def variadic(*args: Any) -> None:
            return None

        async def payload_first(options: str, task: Task, ctx: Context) -> str:
            return options

        class Holder:
            async def handle(self, task: Task, ctx: Context) -> None:
                return None

        for fn in (
            plain,
            with_options,
            variadic,
            functools.partial(payload_first, "fast"),
            Holder().handle,
        ):
            assert agent(fn, kinds=["work"], name="ok").kinds == ("work",)

    def test_a_process_function_must_be_importable_by_name(self) -> None:
        # A lambda or a nested function cannot be found in the worker process: every attempt
        # failed with an AttributeError (retried, then the task failed).
        def nested(task: Task) -> str:
            return "never"

        for fn in (nested, lambda task: "never"):
            with pytest.raises(ConfigError, match="top of a module") as info:
                agent(fn, kinds=["work"], executor="process")
            assert "<locals>" in str(info.value)
        assert agent(nested, kinds=["work"], executor="thread").executor == "thread"


class TestAgentLikeObjects:
    async def test_an_object_with_name_kinds_and_async_call(self, clock: FakeClock) -> None:
        class Translator:
            name = "translator"
            kinds = ("translate",)
            concurrency = 2

            def __init__(self) -> None:
                self.now = 0
                self.peak = 0

            async def __call__(self, task: Task, ctx: Context) -> str:
                self.now += 1
                self.peak = max(self.peak, self.now)
                await anyio.sleep(1.0)
                self.now -= 1
                return str(task.payload).upper()

        translator = Translator()
        assert isinstance(translator, AgentLike)
        result = await Orchestrator(agents=[translator], concurrency=10).run(
            tasks=[Task("translate", w, id=w) for w in ("a", "b", "c", "d")]
        )
        assert result.data == {"a": "A", "b": "B", "c": "C", "d": "D"}
        assert translator.peak == 2  # its `concurrency` attribute is its limit
        assert result.metadata.tasks_per_agent == {"translator": 4}

    @pytest.mark.parametrize(
        "attributes",
        [
            {"concurrency": 0},
            {"concurrency": -1},
            {"concurrency": "2"},
            {"timeout": 0},
            {"timeout": -1.0},
            {"kinds": "work"},
            {"kinds": []},
        ],
        ids=repr,
    )
    def test_bad_attributes_of_an_agent_like_object_are_config_errors(
        self, attributes: dict[str, Any]
    ) -> None:
        # An object is checked as strictly as `@agent(...)`: concurrency 0 would hang every run,
        # kinds "work" would serve the kinds "w", "o", "r" and "k".
        class Custom:
            name = "custom"
            kinds: Any = ("work",)
            concurrency: Any = None
            timeout: Any = None

            async def __call__(self, task: Task, ctx: Context) -> None:
                return None

        obj = Custom()
        for key, value in attributes.items():
            setattr(obj, key, value)
        with pytest.raises(ConfigError):
            Orchestrator(agents=[obj])

    def test_an_object_whose_call_does_not_take_task_and_ctx_is_refused_at_once(self) -> None:
        class OneArgument:
            name = "one-argument"
            kinds = ("work",)

            async def __call__(self, task: Task) -> None:
                return None

        with pytest.raises(ConfigError, match=r"'one-argument'.*\(task, ctx\)"):
            Orchestrator(agents=[OneArgument()])  # type: ignore[list-item]

    async def test_a_declared_output_model_validates_and_converts(self, clock: FakeClock) -> None:
        @agent(kinds=["work"], output=Answer)
        async def answer(task: Task, ctx: Context) -> Any:
            return {"value": 42} if ctx.attempt > 1 else {"value": "not a number"}

        orch = Orchestrator(agents=[answer], retry=RetryPolicy(max_attempts=2, base=0.0), seed=1)
        result = await orch.run(tasks=[Task("work", None, id="x")])
        assert result.status == "success"
        assert result.data == {"x": Answer(value=42)}
        assert result.metadata.attempts == 2


class TestContext:
    async def test_what_an_attempt_is_told(self, clock: FakeClock) -> None:
        seen: list[tuple[Any, ...]] = []

        @agent(kinds=["work"], name="teller")
        async def teller(task: Task, ctx: Context) -> str:
            seen.append((ctx.run_id, ctx.task, ctx.agent, ctx.attempt, list(ctx.feedback)))
            if ctx.attempt < 3:
                raise ConnectionError(f"drop {ctx.attempt}")
            return "ok"

        orch = Orchestrator(agents=[teller], retry=RetryPolicy(max_attempts=3, base=0.0), seed=1)
        task = Task("work", None, id="x")
        result = await orch.run(tasks=[task])
        assert result.status == "success"
        assert [s[0] for s in seen] == [result.metadata.run_id] * 3
        assert all(s[1] is task for s in seen)
        assert [s[2] for s in seen] == ["teller"] * 3
        assert [s[3] for s in seen] == [1, 2, 3]
        assert seen[0][4] == []
        assert len(seen[2][4]) == 2
        assert "drop 1" in seen[2][4][0]
        assert "drop 2" in seen[2][4][1]

    async def test_record_usage_adds_up_in_the_metadata(self) -> None:
        @agent(kinds=["work"])
        async def llm(task: Task, ctx: Context) -> None:
            ctx.record_usage(cost=0.25, input_tokens=100, output_tokens=int(task.payload))

        result = await Orchestrator(agents=[llm]).run(
            tasks=[Task("work", n, id=f"t{n}") for n in (1, 2, 3)]
        )
        assert result.metadata.tokens == {"input_tokens": 300, "output_tokens": 6}
        assert result.metadata.cost == pytest.approx(0.75)

    @pytest.mark.parametrize(
        ("usage", "field"),
        [
            ({"input_tokens": math.nan}, "input_tokens"),  # the run's result raised
            ({"cost": 0.1, "model": 3}, "model"),  # the run's result raised
            ({"cost": math.nan}, "cost"),  # counted: every budget check passed
            ({"cost": -1.0}, "cost"),  # counted: spend went down
            ({"output_tokens": "5"}, "output_tokens"),  # a TypeError
        ],
        ids=repr,
    )
    async def test_wrong_usage_fails_the_attempt_not_the_run(
        self, usage: dict[str, Any], field: str
    ) -> None:
        @agent(kinds=["work"])
        async def llm(task: Task, ctx: Context) -> str:
            if task.id == "bad":
                ctx.record_usage(**usage)
            return "ok"

        result = await Orchestrator(agents=[llm], max_cost=1.0).run(
            tasks=[Task("work", id="bad"), Task("work", id="fine")]
        )
        assert result.data == {"fine": "ok"}
        error = result.error_for("bad")
        assert error is not None
        assert error.error_type == "InputError"
        assert field in error.message
        assert result.metadata.cost == 0.0

    async def test_the_log_is_bound_to_the_attempt(self, logs: LogLines) -> None:
        @agent(kinds=["work"], name="talker")
        async def talker(task: Task, ctx: Context) -> None:
            ctx.log.info("thinking", step=1)

        result = await Orchestrator(agents=[talker]).run(tasks=[Task("work", None, id="x")])
        [line] = [e for e in logs.entries if e["event"] == "thinking"]
        assert line["logger"] == "orchestra.agent"
        assert line["run_id"] == result.metadata.run_id
        assert (line["task_id"], line["kind"], line["agent"], line["attempt"]) == (
            "x",
            "work",
            "talker",
            1,
        )
        assert line["step"] == 1
