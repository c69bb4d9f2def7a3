"""Nothing an agent returns or raises can crash a run: each crash of issue 13 (point 7) as a
regression test through the public API. The run completes, the task's record says clearly what went
wrong (with the traceback of every failed attempt), and `result.model_dump_json()` works."""

from __future__ import annotations

import asyncio
import gc
import json
import math
import sys
from typing import TYPE_CHECKING, Any

import anthropic
import httpx2
import pytest

from orchestra import Context, RetryableError, RetryPolicy, RunResult, Task, agent
from tests.helpers import run_recorded

if TYPE_CHECKING:
    from collections.abc import Callable

    from orchestra import Orchestrator
    from orchestra.result import ErrorRecord
    from tests.helpers import LogLines

pytestmark = pytest.mark.usefixtures("clock")

ONCE = RetryPolicy(max_attempts=1)


class Opaque:
    """An output JSON cannot hold, with a repr of its own."""

    def __repr__(self) -> str:
        return "Opaque(7)"


class Unprintable(Exception):
    """An agent's own exception whose `__str__` is broken."""

    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")


def assert_dumps(result: RunResult) -> None:
    """The result dumps to JSON and validates back to an equal result."""
    assert RunResult.model_validate_json(result.model_dump_json()) == result


def only_error(result: RunResult) -> ErrorRecord:
    (error,) = result.errors
    return error


def rate_limited(retry_after: str) -> anthropic.RateLimitError:
    request = httpx2.Request("POST", "https://api.anthropic.com/v1/messages")
    response = httpx2.Response(
        429, headers={"retry-after": retry_after, "request-id": "req_42"}, request=request
    )
    body = {"type": "error", "error": {"type": "rate_limit_error", "message": "Too many requests"}}
    return anthropic.RateLimitError(f"Error code: 429 - {body}", response=response, body=body)


class TestAnAgentsExceptions:
    async def test_an_exception_whose_str_raises_fails_the_attempt(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        @agent(kinds=["work"])
        async def broken(task: Task, ctx: Context) -> Any:
            raise Unprintable

        orch = make_orchestrator(agents=[broken], retry=RetryPolicy(max_attempts=2, base=0.1))
        result = await orch.run(tasks=[make_task("work", id="t")])
        assert result.status == "failed"
        error = only_error(result)
        assert error.error_type == "Unprintable"
        assert "Unprintable whose str() raised RuntimeError" in error.message
        assert len(error.attempts) == 2  # an unknown exception: retried, then failed
        assert_dumps(result)

    async def test_every_failed_attempt_keeps_its_traceback(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        @agent(kinds=["work"])
        async def buggy(task: Task, ctx: Context) -> Any:
            return task.payload["title"]  # the payload is None: TypeError

        orch = make_orchestrator(agents=[buggy], retry=RetryPolicy(max_attempts=2, base=0.1))
        result = await orch.run(tasks=[make_task("work", id="t")])
        attempts = only_error(result).attempts
        assert len(attempts) == 2
        for attempt in attempts:
            assert attempt.traceback is not None
            assert "<locals>.buggy\n" in attempt.traceback  # the frame that raised
            assert 'return task.payload["title"]' in attempt.traceback
            assert attempt.traceback.endswith("TypeError: 'NoneType' object is not subscriptable\n")
        assert_dumps(result)

    async def test_the_traceback_is_logged_when_debug_is_on(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
        logs: LogLines,
    ) -> None:
        @agent(kinds=["work"])
        async def buggy(task: Task, ctx: Context) -> Any:
            raise ValueError("the model said no")

        await make_orchestrator(agents=[buggy], retry=ONCE).run(tasks=[make_task("work", id="t")])
        (line,) = [e for e in logs.entries if e["event"] == "attempt failed"]
        assert line["log_level"] == "warning"
        assert (line["task_id"], line["agent"], line["error_type"]) == ("t", "buggy", "ValueError")
        assert line["traceback"].endswith("ValueError: the model said no\n")

    async def test_an_http_error_keeps_status_api_type_and_request_id(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        @agent(kinds=["work"])
        async def limited(task: Task, ctx: Context) -> Any:
            raise rate_limited("1")

        result = await make_orchestrator(agents=[limited], retry=ONCE).run(
            tasks=[make_task("work", id="t")]
        )
        error = only_error(result)
        (attempt,) = error.attempts
        fields = (attempt.status_code, attempt.api_error_type, attempt.request_id)
        assert fields == (429, "rate_limit_error", "req_42")
        assert (error.status_code, error.api_error_type, error.request_id) == fields
        assert "Too many requests" in attempt.message
        assert_dumps(result)


_BAD_HEADERS = ["soon", "", "-1", "nan", "inf"]
_BAD_NUMBERS = [-1, math.nan, math.inf, 10**400]


class TestAnAgentThatExitsOrIsInterrupted:
    @pytest.mark.parametrize(
        "options",
        [{}, {"timeouts": {"attempt": 5}}, {"verify": {"work": lambda task, output: True}}],
        ids=["common-attempt", "timed-attempt", "verified-attempt"],
    )
    async def test_sys_exit_fails_the_attempt_never_the_run(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
        options: dict[str, Any],
    ) -> None:
        @agent(kinds=["work"])
        async def quitter(task: Task, ctx: Context) -> Any:
            if task.id == "bad":
                sys.exit(3)  # a library that exits on a bad config, say
            return task.id

        orch = make_orchestrator(agents=[quitter], retry=ONCE, success_threshold=0.5, **options)
        tasks = [make_task("work", id=i) for i in ("a", "bad", "b")]
        result = await orch.run(tasks=tasks)
        assert result.status == "partial"
        assert result.data == {"a": "a", "b": "b"}
        error = only_error(result)
        assert (error.task_id, error.error_type) == ("bad", "SystemExit")
        assert [a.agent for a in error.attempts] == ["quitter"]

    @pytest.mark.parametrize(
        "options", [{}, {"timeouts": {"attempt": 5}}], ids=["common-attempt", "timed-attempt"]
    )
    async def test_a_keyboard_interrupt_stops_the_run_and_returns_its_partial_result(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
        options: dict[str, Any],
    ) -> None:
        started: list[str] = []

        @agent(kinds=["work"])
        async def interrupted(task: Task, ctx: Context) -> Any:
            started.append(task.id)
            if task.id == "slow":
                await asyncio.sleep(60)
            if task.id == "ctrl-c":
                await asyncio.sleep(1)  # "done" has succeeded by now; "slow" still runs
                raise KeyboardInterrupt
            return task.id

        orch = make_orchestrator(agents=[interrupted], **options)
        tasks = [make_task("work", id=i) for i in ("done", "slow", "ctrl-c")]
        tasks.append(make_task("work", id="later", depends_on=["ctrl-c"]))
        result = await orch.run(tasks=tasks)  # returned, as `run_main` returns on Ctrl-C
        assert result.status == "cancelled"
        assert result.data == {"done": "done"}
        assert result.metadata.reason == (
            "stopped by KeyboardInterrupt in agent 'interrupted' (task 'ctrl-c')"
        )
        assert {e.task_id: e.error_type for e in result.errors} == {
            "slow": "Stopped",
            "ctrl-c": "Stopped",
            "later": "Stopped",
        }
        assert started == ["done", "slow", "ctrl-c"]  # nothing ran after it


class TestMalformedRetryAfter:
    @pytest.mark.parametrize(
        "first",
        [lambda v=v: rate_limited(v) for v in _BAD_HEADERS]
        # 10**400 raised OverflowError in the recovery (math.isfinite of an int too large for a
        # float): the run crashed instead of backing off.
        + [lambda v=v: RetryableError("later", retry_after=v) for v in _BAD_NUMBERS],
        ids=[f"429 header {v!r}" for v in _BAD_HEADERS]
        + [f"agent's own {v}" for v in ("-1", "nan", "inf", "10**400")],
    )
    async def test_a_bad_retry_after_is_ignored_and_the_backoff_used(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
        first: Callable[[], Exception],
    ) -> None:
        calls = 0

        @agent(kinds=["work"])
        async def limited(task: Task, ctx: Context) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise first()
            return "done"

        orch = make_orchestrator(
            agents=[limited], retry=RetryPolicy(max_attempts=2, base=0.5, jitter="none")
        )
        result, _, rec = await run_recorded(orch, [make_task("work", id="t")])
        assert result.status == "success"
        assert rec.delays() == [0.5]
        assert_dumps(result)


class TestWhatAnAgentReturns:
    async def test_a_forgotten_await_fails_the_attempt_clearly(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        async def summarize(task: Task) -> str:
            return "summary"

        @agent(kinds=["work"])
        async def forgetful(task: Task, ctx: Context) -> Any:
            return summarize(task)  # no await

        orch = make_orchestrator(agents=[forgetful], retry=RetryPolicy(max_attempts=3, base=0.1))
        result = await orch.run(tasks=[make_task("work", id="t")])
        assert result.status == "failed"
        error = only_error(result)
        assert error.error_type == "InvalidOutput"
        assert "agent 'forgetful' returned a coroutine: did you forget `await`?" in error.message
        assert len(error.attempts) == 1  # a bug of the agent: not retried
        assert_dumps(result)
        gc.collect()  # an unclosed coroutine would warn "never awaited" here; warnings are errors

    async def test_a_forgotten_await_moves_down_the_fallback_chain(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        @agent(kinds=["work"])
        async def forgetful(task: Task, ctx: Context) -> Any:
            return asyncio.sleep(0, "late")

        @agent(kinds=["work"])
        async def careful(task: Task, ctx: Context) -> Any:
            return await asyncio.sleep(0, "on time")

        orch = make_orchestrator(
            agents=[forgetful, careful], fallbacks={"work": ["forgetful", "careful"]}
        )
        result = await orch.run(tasks=[make_task("work", id="t")])
        assert result.status == "success"
        assert result.data == {"t": "on time"}
        gc.collect()

    async def test_an_output_json_cannot_hold_is_kept_as_returned(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        odd = Opaque()

        @agent(kinds=["work"])
        async def anything(task: Task, ctx: Context) -> Any:
            return odd if task.id == "object" else {"ok": task.id}

        orch = make_orchestrator(agents=[anything])
        result = await orch.run(tasks=[make_task("work", id="object"), make_task("work", id="t")])
        assert result.status == "success"
        assert result.data["object"] is odd  # the agent's own object, not a copy or a refusal
        dumped = json.loads(result.model_dump_json())
        assert dumped["data"] == {"object": "Opaque(7)", "t": {"ok": "t"}}  # written as its repr

    async def test_an_iterator_output_is_never_consumed(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        @agent(kinds=["work"])
        async def names(task: Task, ctx: Context) -> Any:
            return map(str.upper, task.payload)

        orch = make_orchestrator(agents=[names])
        result = await orch.run(tasks=[make_task("work", ["a", "b"], id="t")])
        assert result.status == "success"
        output = result.data["t"]
        dumped = json.loads(result.model_dump_json())["data"]["t"]
        assert dumped.startswith("<map object at ")  # its repr: JSON cannot hold an iterator
        assert list(output) == ["A", "B"]  # dumping the result did not read it

    async def test_a_rejected_output_json_cannot_hold_is_kept_and_dumps_as_its_repr(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        from orchestra import VerificationError

        odd = Opaque()

        def strict(task: Task, output: Any) -> bool:
            raise VerificationError("no", output=odd)

        @agent(kinds=["work"])
        async def fine(task: Task, ctx: Context) -> Any:
            return "text"

        orch = make_orchestrator(agents=[fine], verify={"work": strict}, retry=ONCE)
        result = await orch.run(tasks=[make_task("work", id="t")])
        assert only_error(result).partial_output is odd
        dumped = json.loads(result.model_dump_json())
        assert dumped["errors"][0]["partial_output"] == "Opaque(7)"
