"""Configuration: every option of `Orchestrator`, `RetryPolicy`, `BreakerPolicy`, `Timeouts` and
`@agent` given a wrong type or value raises `ConfigError` naming the option and the value, when it
is given (never a `TypeError` later, never silence); the right ones still pass."""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar

import pydantic
import pytest

from orchestra import (
    Agent,
    BreakerPolicy,
    ByKind,
    Collect,
    ConfigError,
    Context,
    Orchestrator,
    RetryPolicy,
    Task,
    Timeouts,
    agent,
)

NAN, INF = math.nan, math.inf
HUGE = 10**400  # an int no float holds: math.isfinite raised OverflowError on it
HUGE_SHOWN = "1" + "0" * 100  # the start of its (shortened) repr in a message


@agent(kinds=["work"])
async def writer(task: Task, ctx: Context) -> str:
    return "ok"


class Answer(pydantic.BaseModel):
    title: str


class Bad:
    """A value of no use anywhere, with a recognisable repr."""

    def __repr__(self) -> str:
        return "<bad>"


def assert_names(info: pytest.ExceptionInfo[ConfigError], name: str, shown: str) -> None:
    message = str(info.value)
    assert name.lower() in message.lower(), message
    assert shown in message, message


# (option, wrong value, what the message must show of it); the repr of the value by default.
ORCHESTRATOR: list[tuple[str, Any, str | None]] = [
    ("agents", None, None),
    ("agents", "writer", None),
    ("agents", writer, None),
    ("concurrency", "10", None),
    ("concurrency", 2.5, None),
    ("concurrency", True, None),
    ("concurrency", 0, None),
    ("concurrency", None, None),
    ("decomposer", "split", None),
    ("retry", {"max_attempts": 3}, None),
    ("retry_per_kind", [RetryPolicy()], None),
    ("retry_per_kind", {"work": 3}, "3"),
    ("fallbacks", ["writer"], None),
    ("fallbacks", {"work": "writer"}, "'writer'"),
    ("fallbacks", {"work": []}, "[]"),
    ("fallbacks", {"work": [1]}, "[1]"),
    ("fallbacks", {1: ["writer"]}, "1"),
    ("defaults", ["x"], None),
    ("defaults", {"work": Bad()}, "<bad>"),
    ("breaker", 5, None),
    ("timeouts", 5, None),
    ("timeouts", {"attempt": "5"}, "'5'"),
    ("timeouts", {"attempt": NAN}, "nan"),
    ("timeouts", {"task": INF}, "inf"),
    ("timeouts", {"overall": 10}, "overall"),
    ("success_threshold", "0.8", None),
    ("success_threshold", NAN, None),
    ("success_threshold", 1.5, None),
    ("success_threshold", -0.1, None),
    ("success_threshold", True, None),
    ("success_threshold", None, None),
    ("verify", {"work": "strict"}, "'strict'"),
    ("verify", [writer], None),
    ("safety", "yes", None),
    ("aggregate", "collect", None),
    ("aggregate", {"work": "collect"}, "'collect'"),
    ("aggregate", {"work": Bad()}, "<bad>"),
    ("aggregate", {1: Collect()}, "1"),
    ("aggregate", {"nokind": Collect()}, "nokind"),
    ("window", 2.5, None),
    ("window", 0, None),
    ("window", True, None),
    ("window", "100", None),
    ("seed", "abc", None),
    ("seed", 1.5, None),
    ("clock", "fake", None),
    ("on_threshold_missed", 3, None),
    ("drain_timeout", NAN, None),
    ("drain_timeout", INF, None),
    ("drain_timeout", -1, None),
    ("drain_timeout", "5", None),
    ("drain_timeout", HUGE, HUGE_SHOWN),
    ("success_threshold", HUGE, HUGE_SHOWN),
    ("max_cost", HUGE, HUGE_SHOWN),
    ("store", "runs.db", None),
    ("store", 42, None),
]

RETRY: list[tuple[str, Any, str | None]] = [
    ("max_attempts", "3", None),
    ("max_attempts", 2.0, None),
    ("max_attempts", True, None),
    ("max_attempts", 0, None),
    ("base", NAN, None),
    ("base", INF, None),
    ("base", "0.5", None),
    ("base", -1, None),
    ("base", True, None),
    ("cap", NAN, None),
    ("cap", INF, None),
    ("cap", "30", None),
    ("cap", HUGE, HUGE_SHOWN),
    ("jitter", "random", None),
    ("jitter", None, None),
    ("retryable", "ValueError", None),
    ("retryable", [1], None),
    ("retryable", (ValueError, "x"), None),
    ("permanent", 3, None),
    ("permanent", [int], None),
]

BREAKER: list[tuple[str, Any, str | None]] = [
    ("min_calls", "5", None),
    ("min_calls", 2.5, None),
    ("min_calls", True, None),
    ("min_calls", 0, None),
    ("cooldown", NAN, None),
    ("cooldown", INF, None),
    ("cooldown", "30", None),
    ("cooldown", -1, None),
    ("cooldown", HUGE, HUGE_SHOWN),
    ("failure_rate", 0, None),
    ("failure_rate", 1.5, None),
    ("failure_rate", NAN, None),
    ("failure_rate", "0.5", None),
    ("failure_rate", True, None),
    ("window", "20", None),
    ("window", 0, None),
    ("window", True, None),
    ("window", INF, None),
    ("max_cooldown", -1, None),
    ("max_cooldown", "30", None),
    ("outages", "ValueError", None),
    ("outages", (ValueError, 3), None),
]

TIMEOUTS: list[tuple[str, Any, str | None]] = [
    (name, value, None)
    for name in ("attempt", "task", "run")
    for value in ("5", 0, -1, NAN, INF, True)
] + [(name, HUGE, HUGE_SHOWN) for name in ("attempt", "task", "run")]

AGENT: list[tuple[str, Any, str | None]] = [
    ("kinds", "work", None),
    ("kinds", None, None),
    ("kinds", [], None),
    ("kinds", [1], None),
    ("kinds", [""], None),
    ("name", 3, None),
    ("name", "", None),
    ("concurrency", "2", None),
    ("concurrency", 2.5, None),
    ("concurrency", True, None),
    ("concurrency", 0, None),
    ("input", dict, None),
    ("input", "Answer", None),
    ("output", 3, None),
    ("executor", "fork", None),
    ("retry", {"max_attempts": 3}, None),
    ("timeout", NAN, None),
    ("timeout", INF, None),
    ("timeout", "5", None),
    ("timeout", 0, None),
    ("timeout", True, None),
    ("timeout", HUGE, HUGE_SHOWN),
]


def ids(cases: list[tuple[str, Any, str | None]]) -> list[str]:
    # Without the objects' addresses: the ids must be the same in every process (pytest-xdist's
    # workers each collect the tests and compare their lists).
    return [
        f"{name}={'HUGE' if value is HUGE else re.sub(r' at 0x[0-9a-f]+', '', repr(value))}"
        for name, value, _ in cases
    ]


class TestOrchestrator:
    @pytest.mark.parametrize(("name", "value", "shown"), ORCHESTRATOR, ids=ids(ORCHESTRATOR))
    def test_a_wrong_option_is_a_config_error(
        self, name: str, value: Any, shown: str | None
    ) -> None:
        options: dict[str, Any] = {"agents": [writer], name: value}
        with pytest.raises(ConfigError) as info:
            Orchestrator(**options)
        assert_names(info, name, shown or repr(value))

    @pytest.mark.parametrize(
        "options",
        [
            {"concurrency": 1},
            {"success_threshold": 0},
            {"success_threshold": 1},
            {"success_threshold": 0.5},
            {"window": None},
            {"seed": -5},
            {"drain_timeout": 0},
            {"timeouts": {"attempt": 1.5, "task": None}},
            {"timeouts": Timeouts(run=60)},
            {"fallbacks": {"work": ("writer",)}},
            {"defaults": {"work": {"answer": None}}},
            {"retry_per_kind": {"work": RetryPolicy(max_attempts=1)}},
            {"agents": (writer,)},
        ],
        ids=repr,
    )
    def test_right_options_pass(self, options: dict[str, Any]) -> None:
        options.setdefault("agents", [writer])
        Orchestrator(**options)

    def test_an_agent_objects_own_options_are_checked(self) -> None:
        class Summarizer:
            name = "summarizer"
            kinds = ("work",)
            retry: ClassVar = {"max_attempts": 3}

            async def __call__(self, task: Task, ctx: Context) -> str:
                return "ok"

        with pytest.raises(ConfigError, match=r"agent 'summarizer': retry must be a RetryPolicy"):
            Orchestrator(agents=[Summarizer()])


class Unprintable:
    """A value whose repr, str, eq and hash raise: an error about it must still be the clear one."""

    def __repr__(self) -> str:
        raise RuntimeError("repr")

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("eq")

    def __hash__(self) -> int:
        raise RuntimeError("hash")


class TestUnprintableValues:
    @pytest.mark.parametrize(
        "name", ["agents", "clock", "aggregate", "store", "timeouts", "retry", "concurrency"]
    )
    def test_the_config_error_shows_the_type(self, name: str) -> None:
        value: Any = [Unprintable()] if name == "agents" else Unprintable()
        with pytest.raises(ConfigError, match="<Unprintable>"):
            Orchestrator(**{"agents": [writer], name: value})


class TestPolicies:
    @pytest.mark.parametrize(("name", "value", "shown"), RETRY, ids=ids(RETRY))
    def test_retry_policy(self, name: str, value: Any, shown: str | None) -> None:
        with pytest.raises(ConfigError) as info:
            RetryPolicy(**{name: value})
        assert_names(info, f"RetryPolicy.{name}", shown or repr(value))

    @pytest.mark.parametrize(("name", "value", "shown"), BREAKER, ids=ids(BREAKER))
    def test_breaker_policy(self, name: str, value: Any, shown: str | None) -> None:
        with pytest.raises(ConfigError) as info:
            BreakerPolicy(**{name: value})
        assert_names(info, f"BreakerPolicy.{name}", shown or repr(value))

    @pytest.mark.parametrize(("name", "value", "shown"), TIMEOUTS, ids=ids(TIMEOUTS))
    def test_timeouts(self, name: str, value: Any, shown: str | None) -> None:
        with pytest.raises(ConfigError) as info:
            Timeouts(**{name: value})
        assert_names(info, f"Timeouts.{name}", shown or repr(value))

    @pytest.mark.parametrize(
        ("by_kind", "default", "shown"),
        [
            ({"work": 3}, None, "3"),
            ({"work": Collect()}, "sum", "'sum'"),
            (["work"], None, "['work']"),
        ],
    )
    def test_by_kind(self, by_kind: Any, default: Any, shown: str) -> None:
        with pytest.raises(ConfigError) as info:
            ByKind(by_kind, default=default)
        assert_names(info, "ByKind", shown)

    def test_exception_types_are_normalised_to_a_tuple(self) -> None:
        # Typed as tuples; one class or a list is accepted too, and stored as a tuple.
        one = RetryPolicy(retryable=KeyError)  # type: ignore[arg-type]
        listed = RetryPolicy(permanent=[KeyError, ValueError])  # type: ignore[arg-type]
        assert (one.retryable, listed.permanent) == ((KeyError,), (KeyError, ValueError))

    def test_right_values_pass(self) -> None:
        RetryPolicy(max_attempts=1, base=0, cap=0, jitter="none")
        BreakerPolicy(min_calls=1, cooldown=0, failure_rate=1, window=0.5, max_cooldown=0)
        BreakerPolicy(outages=ConnectionRefusedError)  # type: ignore[arg-type]
        Timeouts(attempt=0.001, task=10, run=None)


class TestAgent:
    @pytest.mark.parametrize(("name", "value", "shown"), AGENT, ids=ids(AGENT))
    def test_a_wrong_option_is_a_config_error(
        self, name: str, value: Any, shown: str | None
    ) -> None:
        options: dict[str, Any] = {"kinds": ["work"], name: value}

        async def fn(task: Task, ctx: Context) -> str:
            return "ok"

        with pytest.raises(ConfigError) as info:
            agent(fn, **options)
        assert_names(info, name, shown or repr(value))

    def test_agent_decorates_a_callable(self) -> None:
        with pytest.raises(ConfigError, match="@agent decorates a function, got 'fn'"):
            Agent("fn", kinds=["work"])  # type: ignore[arg-type]

    def test_right_options_pass(self) -> None:
        async def fn(task: Task, ctx: Context) -> str:
            return "ok"

        built = agent(
            fn, kinds=("work",), name="w", concurrency=2, input=Answer, output=Answer,
            retry=RetryPolicy(), timeout=1.5,
        )  # fmt: skip
        assert (built.name, built.kinds, built.concurrency) == ("w", ("work",), 2)


class TestRunArguments:
    """What `run`, `stream` and `start` take besides the input is checked before any work."""

    @pytest.mark.parametrize("run_id", [3, b"run", "", ["r"]], ids=repr)
    async def test_a_wrong_run_id_is_a_config_error_before_any_agent_runs(
        self, run_id: Any
    ) -> None:
        calls: list[str] = []

        @agent(kinds=["work"])
        async def counted(task: Task, ctx: Context) -> str:
            calls.append(task.id)
            return "ok"

        async with Orchestrator(agents=[counted]) as orch:
            for start in (
                lambda: orch.run(tasks=[Task("work")], run_id=run_id),
                lambda: orch.stream(tasks=[Task("work")], run_id=run_id).__anext__(),
                lambda: orch.start(tasks=[Task("work")], run_id=run_id),
            ):
                with pytest.raises(ConfigError) as info:
                    await start()
                assert_names(info, "run_id", repr(run_id))
        assert calls == []
