"""Claude agents (orchestra.agents.claude) against the fake Messages API over a real local socket,
through the official client, in fake time: the server's clock and the client's are the loop's, so
a 60-second budget or a 2-second Retry-After take milliseconds."""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
from typing import TYPE_CHECKING, Any, Literal

import pytest
from anthropic import AsyncAnthropic
from pydantic import BaseModel

from orchestra import Orchestrator, RetryPolicy, Task
from orchestra._retry import classify
from orchestra.agents.claude import (
    ClaudeAccount,
    ClaudeLimits,
    Price,
    StreamTimeout,
    StructuredOutputError,
)
from tests.claude_fixtures import (
    API_KEY,
    HAIKU,
    SONNET,
    account,
    api,
    client,
    research,
    run,
)
from tests.fake_messages_api import FakeMessagesAPI
from tests.helpers import REPO, LogLines, run_python

if TYPE_CHECKING:
    from collections.abc import Sequence

    from orchestra.testing import FakeClock
    from tests.helpers import LogLines

__all__ = ("account", "api", "client")  # fixtures, used by name


class ClauseRisk(BaseModel):
    risk: Literal["low", "medium", "high"]
    reason: str


def clause(i: int = 0, text: str = "The supplier's liability is unlimited.") -> Task:
    return Task("research", {"text": text}, id=f"c{i}")


GOOD = '{"risk": "high", "reason": "uncapped liability"}'


class TestStructuredOutput:
    async def test_an_answer_is_validated_into_the_output_model(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.answer(GOOD)
        agent = research(
            account, system="You assess contract clauses.", prompt="Clause: {payload[text]}",
            output=ClauseRisk,
        )  # fmt: skip
        result = await run(api, [agent], [clause()])
        assert result.status == "success"
        assert result.data["c0"] == ClauseRisk(risk="high", reason="uncapped liability")
        (request,) = api.requests
        body = request.body
        assert body["model"] == SONNET
        assert body["system"] == "You assess contract clauses."
        assert body["messages"] == [
            {"role": "user", "content": "Clause: The supplier's liability is unlimited."}
        ]
        schema = body["output_config"]["format"]
        assert schema["type"] == "json_schema"
        assert set(schema["schema"]["properties"]) == {"risk", "reason"}
        assert schema["schema"]["additionalProperties"] is False  # the SDK's strict transform

    @pytest.mark.parametrize(
        ("model", "structured"), [(SONNET, "tool"), ("claude-3-haiku-20240307", "auto")]
    )
    async def test_without_structured_outputs_the_answer_is_a_forced_tool_call(
        self, api: FakeMessagesAPI, account: ClaudeAccount, model: str, structured: Any
    ) -> None:
        api.answer('{"risk": "extreme"}', GOOD)
        agent = research(
            account, model=model, prompt="Clause: {payload[text]}", output=ClauseRisk,
            structured=structured,
        )  # fmt: skip
        result = await run(api, [agent], [clause()])
        assert result.status == "success"
        assert result.data["c0"] == ClauseRisk(risk="high", reason="uncapped liability")
        first, second = api.requests
        body = first.body
        assert "output_config" not in body
        (tool,) = body["tools"]
        assert body["tool_choice"] == {"type": "tool", "name": tool["name"]}
        assert set(tool["input_schema"]["properties"]) == {"risk", "reason"}
        # The invalid first answer went back, with the errors, as for structured outputs.
        messages = second.body["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant", "user"]
        assert "JSON schema" in messages[2]["content"]

    async def test_an_invalid_answer_is_retried_with_the_errors_in_the_conversation(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.answer('{"risk": "extreme"}', GOOD)
        agent = research(account, prompt="Clause: {payload[text]}", output=ClauseRisk)
        result = await run(api, [agent], [clause()])
        assert result.status == "success"
        assert result.data["c0"].risk == "high"
        first, second = api.requests
        messages = second.body["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant", "user"]
        assert messages[0] == first.body["messages"][0]
        assert messages[1]["content"] == '{"risk": "extreme"}'
        assert "risk" in messages[2]["content"]
        assert "reason" in messages[2]["content"]
        assert "JSON schema" in messages[2]["content"]
        # Both answers' tokens were spent, and both are counted.
        spent = sum(r.body and _input_tokens(r) for r in api.requests)
        assert result.metadata.tokens["input_tokens"] == spent
        assert result.metadata.tokens["output_tokens"] == 2 + 5  # the two answers' words

    async def test_an_answer_that_stays_invalid_fails_with_the_answer_kept(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.answer("not json", "still not json", "nope")
        result = await run(api, [research(account, output=ClauseRisk)], [clause()])
        error = result.error_for("c0")
        assert error is not None
        assert [a.error_type for a in error.attempts] == ["StructuredOutputError"] * 3
        assert error.partial_output == "nope"
        assert len(api.requests) == 3

    async def test_without_an_output_model_the_answer_is_text(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.answer("A plain answer.")
        result = await run(api, [research(account)], [clause()])
        assert result.data["c0"] == "A plain answer."
        assert "output_config" not in api.requests[0].body

    async def test_a_text_cut_at_max_tokens_is_the_answer_with_a_warning(
        self, api: FakeMessagesAPI, account: ClaudeAccount, logs: LogLines
    ) -> None:
        logs.level(logging.WARNING)
        api.answer("one two three four five")
        result = await run(api, [research(account, max_tokens=3)], [clause()])
        assert result.data["c0"] == "one two three"
        (warning,) = [e for e in logs.entries if e["event"] == "answer cut at max_tokens"]
        assert (warning["agent"], warning["max_tokens"], warning["task_id"]) == (
            "research",
            3,
            "c0",
        )

    async def test_the_prompt_sees_the_outputs_of_dependencies(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.answer("first", "second")
        summarize = research(
            account, name="summarize", kinds=["summarize"], prompt="{payload} after {deps[a]}"
        )
        tasks = [
            Task("research", "one", id="a"),
            Task("summarize", "two", id="b", depends_on=["a"]),
        ]
        result = await run(api, [research(account), summarize], tasks)
        assert result.data == {"a": "first", "b": "second"}
        assert api.requests[1].body["messages"][0]["content"] == "two after first"

    async def test_a_prompt_that_names_a_missing_field_fails_the_task_naming_it(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        agent = research(account, prompt="{payload[title]}")
        result = await run(api, [agent], [clause()])
        error = result.error_for("c0")
        assert error is not None
        assert error.error_type == "PermanentError"
        assert "'c0'" in error.message
        assert "title" in error.message
        assert api.requests == []

    async def test_the_system_prompt_can_be_cached(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        await run(api, [research(account, system="Long rules.", cache_system=True)], [clause()])
        assert api.requests[0].body["system"] == [
            {"type": "text", "text": "Long rules.", "cache_control": {"type": "ephemeral"}}
        ]


def _input_tokens(request: Any) -> int:
    from tests.fake_messages_api import _tokens

    return _tokens(request.prompt)


class TestErrors:
    async def test_a_400_is_permanent_and_its_record_says_what_the_api_said(
        self, api: FakeMessagesAPI, account: ClaudeAccount, logs: LogLines
    ) -> None:
        api.fail("prompt_too_long", times=1)
        result = await run(api, [research(account)], [clause()])
        error = result.error_for("c0")
        assert error is not None
        assert len(api.requests) == 1  # not retried
        (attempt,) = error.attempts
        assert attempt.status_code == 400
        assert attempt.api_error_type == "invalid_request_error"
        assert "prompt is too long" in attempt.message
        assert attempt.request_id is not None
        assert attempt.request_id.startswith("req_")
        assert error.status_code == 400
        assert any(e["event"] == "attempt failed" for e in logs.entries)  # the WARNING lines, read
        api.assert_no_key_in(logs.text())
        api.assert_no_key_in(json.dumps(logs.entries, default=str))

    async def test_a_rejected_key_is_not_retried_and_its_remediation_names_the_api_key(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.fail("authentication", times=1)
        result = await run(api, [research(account)], [clause()])
        error = result.error_for("c0")
        assert error is not None
        assert len(api.requests) == 1
        assert error.status_code == 401
        assert "API key" in error.remediation
        assert "payload" not in error.remediation

    @pytest.mark.parametrize("fault", ["server_error", "overloaded"])
    async def test_5xx_and_529_are_retried(
        self, api: FakeMessagesAPI, account: ClaudeAccount, fault: Literal["server_error"]
    ) -> None:
        api.fail(fault, times=2)
        result = await run(api, [research(account)], [clause()])
        assert result.status == "success"
        assert [r.status for r in api.requests] == [
            api.requests[0].status,
            api.requests[0].status,
            200,
        ]
        assert api.requests[0].status in (500, 529)
        assert result.metadata.retries == 2

    async def test_a_429_retry_after_holds_every_agent_on_the_key(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.fail("rate_limit", times=1, retry_after=2)
        first = research(account, name="a", kinds=["a"])
        second = research(account, name="b", kinds=["b"])
        assert first.rate_limits is second.rate_limits  # one key, one family: one budget
        tasks = [Task("a", "x", id="x")] + [Task("b", f"y{i}", id=f"y{i}") for i in range(3)]
        result = await run(api, [first, second], tasks)
        assert result.status == "success"
        limited = api.answered(429)[0]
        after = [r for r in api.requests if r.received > limited.received]
        assert after, "nothing was sent after the 429"
        assert all(r.received >= limited.received + 2 for r in after)

    async def test_a_429_with_only_the_reset_headers_waits_for_the_reset(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.fail("rate_limit", times=1, ratelimit_reset=5)
        tasks = [clause(i) for i in range(3)]
        result = await run(api, [research(account)], tasks)
        assert result.status == "success"
        limited = api.answered(429)[0]
        assert "retry-after" not in limited.headers
        after = [r for r in api.requests if r.received > limited.received]
        assert len(after) == 3
        assert min(r.received for r in after) >= limited.received + 4.99

    async def test_an_error_answer_gives_its_tokens_back(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.fail("overloaded", times=1)
        result = await run(api, [research(account)], [clause()])
        # Only the successful answer's tokens are counted; the 529 recorded zero.
        assert result.metadata.tokens["input_tokens"] == _input_tokens(api.requests[1])

    async def test_a_200_that_is_no_message_is_retried_with_a_clear_error(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.fail("garbage")  # a proxy's 200 with JSON that is not a Message
        result = await run(api, [research(account)], [clause()])
        error = result.error_for("c0")
        assert error is not None
        assert [r.outcome for r in api.requests] == ["garbage"] * 3  # retried
        attempt = error.attempts[-1]
        assert [a.error_type for a in error.attempts] == ["APIResponseValidationError"] * 3
        assert attempt.status_code == 200
        assert attempt.request_id is not None
        assert "not a Message" in attempt.message

    async def test_a_body_cut_mid_way_is_a_connection_error_and_retried(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.fail("cut", times=2)
        result = await run(api, [research(account)], [clause()])
        assert result.status == "success"
        assert [r.outcome for r in api.requests] == ["cut", "cut", "ok"]
        assert result.metadata.retries == 2

    async def test_x_should_retry_false_makes_a_500_permanent(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.fail("server_error", times=1, headers={"x-should-retry": "false"})
        result = await run(api, [research(account)], [clause()])
        assert result.status == "failed"
        assert len(api.requests) == 1


class TestAccounting:
    async def test_usage_and_cost_of_every_attempt_are_recorded(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.answer("bad", GOOD)
        agent = research(account, output=ClauseRisk, prices={SONNET: Price(3, 15)})
        result = await run(api, [agent], [clause()])
        tokens = result.metadata.tokens
        assert tokens["input_tokens"] == sum(_input_tokens(r) for r in api.requests)
        assert tokens["output_tokens"] == 1 + 5
        assert tokens["cache_read_input_tokens"] == 0
        expected = (tokens["input_tokens"] * 3 + tokens["output_tokens"] * 15) / 1e6
        assert result.metadata.cost == pytest.approx(expected)
        assert agent.spent["cost"] == pytest.approx(expected)


class TestRateLimits:
    async def test_a_burst_of_1000_tasks_keeps_within_rpm_and_tpm(
        self, clock: FakeClock, account: ClaudeAccount
    ) -> None:
        rpm, itpm, otpm = 1_200, 60_000, 60_000
        async with FakeMessagesAPI(
            requests_per_minute=rpm, input_tokens_per_minute=itpm, output_tokens_per_minute=otpm
        ) as api:
            fresh = ClaudeAccount(client=account.client.with_options(base_url=api.url))
            limits = ClaudeLimits(
                requests_per_minute=rpm,
                input_tokens_per_minute=itpm,
                output_tokens_per_minute=otpm,
            )
            agent = research(fresh, rate_limits=limits, max_tokens=16)
            # 100 tokens a prompt: 100,000 input tokens at 60,000 a minute bind (100 s), before
            # the requests (1,000 at 1,200 a minute: 50 s) and the output tokens (16,000 reserved).
            tasks = [Task("research", f"{i:04d}" * 100, id=f"c{i}") for i in range(1000)]
            result = await run(api, [agent], tasks, concurrency=200)
            requests = api.requests
        assert result.status == "success"
        assert len(requests) == 1000
        times = sorted(r.received for r in requests)
        # Never a minute's budget at once: at most a second's worth (+1) in any second.
        assert _most_in_window(times, 1.0) <= rpm / 60 + 1
        assert _most_in_window(times, 60.0) <= rpm + 1
        tokens = sorted((r.received, _input_tokens(r)) for r in requests)
        assert _most_tokens_in_window(tokens, 60.0) <= itpm + itpm / 60
        # The input tokens bind: the run goes at (nearly) their pace, and never faster.
        spent = sum(n for _, n in tokens)
        ideal = (spent - itpm / 60) / itpm * 60
        assert ideal * 0.99 <= times[-1] - times[0] <= ideal / 0.95

    async def test_agents_sharing_a_budget_send_in_the_runs_order(
        self, clock: FakeClock, api: FakeMessagesAPI, client: AsyncAnthropic
    ) -> None:
        budget = ClaudeLimits(requests_per_minute=60)
        account = ClaudeAccount(client=client, limits={SONNET: budget})
        agents = [research(account, name=kind, kinds=[kind], prompt="{payload}") for kind in "ab"]
        assert agents[0].rate_limits is agents[1].rate_limits is budget
        # Tasks of the two agents alternate in the input; priority 0 before priority 1.
        tasks = [
            Task(kind, f"{kind}{i}", id=f"{kind}{i}", priority=i // 3)
            for i in range(6)
            for kind in "ab"
        ]
        t0 = clock.time()
        result = await run(api, agents, tasks)
        assert result.status == "success"
        assert [r.prompt for r in api.requests] == [t.id for t in tasks]
        assert [round(r.received - t0) for r in api.requests] == list(range(12))

    @pytest.mark.parametrize(
        ("known", "count"),
        [("configured", False), ("from the headers", False), ("configured", True)],
    )
    async def test_a_prompt_over_the_whole_minutes_budget_fails_unsent_and_holds_nobody(
        self, clock: FakeClock, account: ClaudeAccount, known: str, count: bool
    ) -> None:
        # The API answers such a request 429 every time, and each 429's Retry-After would hold
        # every agent on the key: it must fail at once, saying why, and cost the others nothing.
        async with FakeMessagesAPI(enforce_limits=True, input_tokens_per_minute=1_000) as api:
            fresh = ClaudeAccount(client=account.client.with_options(base_url=api.url))
            limits = ClaudeLimits(input_tokens_per_minute=1_000 if known == "configured" else None)
            big = research(fresh, name="big", kinds=["big"], rate_limits=limits, count_tokens=count)
            small = research(fresh, name="small", kinds=["small"], rate_limits=limits)
            tasks = [Task("small", "y", id="s0")]  # its answer's headers tell the limit
            tasks += [Task("big", "x" * 8_000, id="big", depends_on=["s0"])]  # ~2,000 tokens
            tasks += [Task("small", "y", id=f"s{i}") for i in (1, 2)]
            result = await run(api, [big, small], tasks)
            requests = api.requests
        error = result.error_for("big")
        assert error is not None
        assert error.error_type == "PermanentError"
        assert "1000 input tokens per minute" in error.message
        assert len(error.attempts) == 1
        assert not [r for r in requests if r.status == 429]
        assert all("x" * 100 not in r.prompt for r in requests if r.path == "/v1/messages")
        assert result.metadata.tokens["input_tokens"] == sum(
            _input_tokens(r) for r in requests if r.status == 200 and r.path == "/v1/messages"
        )  # the refused call gave its reservation back

    async def test_a_prompt_estimated_over_the_budget_but_counted_within_it_is_sent(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        limits = ClaudeLimits(input_tokens_per_minute=1_000)
        # 3,800 characters: about 1,090 tokens by the local estimate, 950 by the count.
        result = await run(api, [research(account, rate_limits=limits)], [clause(0, "x" * 3_800)])
        assert result.status == "success"
        assert len(api.counted()) == 1
        assert api.answered(200)[-1].path == "/v1/messages"


class TestStreaming:
    async def test_a_streamed_answer_is_read_whole(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.answer(GOOD)
        agent = research(account, output=ClauseRisk, stream=True, idle_timeout=1)
        result = await run(api, [agent], [clause()])
        assert result.data["c0"].reason == "uncapped liability"
        assert result.metadata.tokens["output_tokens"] == 5

    async def test_a_stalled_stream_fails_on_the_idle_timeout(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.fail("stall", times=1, events=3)  # message_start, block start, one token: then nothing
        agent = research(
            account, stream=True, first_token_timeout=5, idle_timeout=0.5, timeout=60,
            max_tokens=64,
        )  # fmt: skip
        result = await run(api, [agent], [clause()])
        assert result.status == "success"
        stalled, retried = api.requests
        assert stalled.outcome == "stall"
        # The attempt ended on the idle timeout, far before the 60-second attempt timeout.
        assert retried.received - stalled.received < 1.0
        # What the stalled stream reported (its input tokens) was spent and counted.
        assert result.metadata.tokens["input_tokens"] == 2 * _input_tokens(stalled)
        assert result.metadata.retries == 1

    async def test_a_stream_without_a_first_token_fails_on_that_timeout(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.fail("stall", events=1)  # every stream: message_start only
        agent = research(account, stream=True, first_token_timeout=2, timeout=60)
        result = await run(api, [agent], [clause()], retry=RetryPolicy(max_attempts=2, base=0.1))
        error = result.error_for("c0")
        assert error is not None
        assert [a.error_type for a in error.attempts] == ["StreamTimeout", "StreamTimeout"]
        assert "first token" in error.attempts[0].message
        assert error.attempts[0].duration == pytest.approx(2, abs=0.05)

    async def test_a_server_that_never_answers_fails_on_the_first_token_timeout(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.fail("hang")  # no response headers at all: the stream never opens
        agent = research(account, stream=True, first_token_timeout=2, timeout=600)
        result = await run(api, [agent], [clause()], retry=RetryPolicy(max_attempts=1))
        error = result.error_for("c0")
        assert error is not None
        (attempt,) = error.attempts
        assert attempt.error_type == "StreamTimeout"
        assert "first token" in attempt.message
        # The attempt ended on the first-token timeout, not on the 600-second attempt timeout,
        # and the client closed the connection.
        assert attempt.duration == pytest.approx(2, abs=0.05)
        (hung,) = api.requests
        assert hung.outcome == "disconnected"

    def test_stream_timeouts_need_streaming(self, account: ClaudeAccount) -> None:
        from orchestra import ConfigError

        with pytest.raises(ConfigError, match="stream=True"):
            research(account, idle_timeout=1)


class TestConfiguration:
    @pytest.mark.parametrize(
        ("option", "field"),
        [
            ({"prices": {SONNET: (3, 15)}}, "prices"),  # a tuple, not a Price: failed after a call
            ({"prices": [Price(3, 15)]}, "prices"),
            ({"cache_system": "yes"}, "cache_system"),
            ({"stream": "no"}, "stream"),
            ({"params": [("temperature", 0)]}, "params"),
            ({"params": {"model": HAIKU}}, "params may not set model"),
            (
                {"params": {"max_tokens": 5, "stream": True}},
                "params may not set max_tokens, stream",
            ),
            ({"params": {"tools": []}, "output": ClauseRisk}, "params may not set tools"),
        ],
    )
    def test_bad_options_are_config_errors_naming_the_field(
        self, account: ClaudeAccount, option: dict[str, Any], field: str
    ) -> None:
        from orchestra import ConfigError

        with pytest.raises(ConfigError, match=f"agent 'research': {field}"):
            research(account, **option)


class TestPackaging:
    @pytest.mark.subprocess
    @pytest.mark.parametrize(
        "module", sorted(path.stem for path in (REPO / "orchestra" / "agents").glob("*claude*.py"))
    )
    def test_every_claude_module_may_be_imported_first(self, module: str) -> None:
        # The Claude modules import one way (`claude.py` on top): none imports another that
        # imports it back, so whichever a program imports first loads.
        done = run_python("-c", f"import orchestra.agents.{module}", cwd=REPO, timeout=60)
        assert done.returncode == 0, done.stderr

    @pytest.mark.subprocess
    def test_the_core_and_orchestra_agents_do_not_import_the_sdk(self) -> None:
        code = (
            "import sys, orchestra, orchestra.agents, orchestra.testing\n"
            "assert 'anthropic' not in sys.modules, 'anthropic was imported'\n"
            "orchestra.agents.ClaudeAgent\n"
            "assert 'anthropic' in sys.modules\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True)

    def test_without_the_sdk_the_import_error_names_the_extra(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        import importlib

        monkeypatch.setitem(sys.modules, "anthropic", None)  # import anthropic raises ImportError
        monkeypatch.delitem(sys.modules, "orchestra.agents.claude")
        with pytest.raises(ModuleNotFoundError) as info:
            importlib.import_module("orchestra.agents.claude")
        assert "pip install 'orchestra-runtime[claude]'" in str(info.value)
        assert info.value.name == "anthropic"

    async def test_the_fault_kit_raises_equivalent_errors_without_the_sdk(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from orchestra._failure import describe
        from orchestra._faults import SimulatedAPIError, raise_fault

        monkeypatch.setitem(sys.modules, "anthropic", None)  # import anthropic raises ImportError
        with pytest.raises(SimulatedAPIError) as caught:
            await raise_fault("rate_limit", "agent 'x'", retry_after=3)
        assert classify(caught.value, RetryPolicy()) == (True, 3.0)
        assert describe(caught.value).status_code == 429
        with pytest.raises(SimulatedAPIError) as overloaded:
            await raise_fault("overloaded", "agent 'x'")
        assert classify(overloaded.value, RetryPolicy()) == (True, None)

    def test_errors_are_the_core_ones(self) -> None:
        from orchestra import RetryableError, VerificationError

        assert issubclass(StreamTimeout, RetryableError)
        assert issubclass(StructuredOutputError, VerificationError)


def _most_in_window(times: Sequence[float], width: float) -> int:
    best, start = 0, 0
    for end, t in enumerate(times):
        while times[start] <= t - width:
            start += 1
        best = max(best, end - start + 1)
    return best


def _most_tokens_in_window(points: Sequence[tuple[float, int]], width: float) -> int:
    best, start, total = 0, 0, 0
    for t, n in points:
        total += n
        while points[start][0] <= t - width:
            total -= points[start][1]
            start += 1
        best = max(best, total)
    return best


class TestFallback:
    async def test_repeated_529s_move_the_task_to_the_fallback_model(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.fail("overloaded", match=lambda body: body["model"] == SONNET)
        api.answer(GOOD)
        main = research(account, output=ClauseRisk)
        cheap = research(account, name="research-fast", model=HAIKU, output=ClauseRisk)
        result = await run(
            api,
            [main, cheap],
            [clause()],
            fallbacks={"research": ["research", "research-fast"]},
            retry=RetryPolicy(max_attempts=3, base=0.1),
        )
        assert result.status == "success"
        assert result.data["c0"] == ClauseRisk(risk="high", reason="uncapped liability")
        assert [(r.body["model"], r.status) for r in api.requests] == [
            (SONNET, 529),
            (SONNET, 529),
            (SONNET, 529),
            (HAIKU, 200),
        ]
        assert result.metadata.fallbacks == 1
        assert result.metadata.tasks_per_agent == {"research-fast": 1}
        assert set(result.metadata.usage_per_model) == {SONNET, HAIKU}
        assert result.metadata.usage_per_model[SONNET]["input_tokens"] == 0  # errors cost 0


class TestSecrets:
    async def test_the_key_is_in_no_log_event_error_or_result(
        self, api: FakeMessagesAPI, account: ClaudeAccount, logs: LogLines
    ) -> None:
        # Every path that carries an error's text: a 400 (permanent), a 429 and 529s (retried),
        # a dropped connection; the logs at debug level, every event, the result and its errors.
        api.fail("prompt_too_long", match=lambda body: "c1" in json.dumps(body))
        api.fail("rate_limit", times=1, retry_after=1)
        api.fail("overloaded", times=2)
        api.fail("drop", times=1)
        events: list[str] = []
        agent = research(account, prompt="{task.id}: {payload[text]}")
        async with Orchestrator(
            agents=[agent],
            retry=RetryPolicy(max_attempts=6, base=0.1),
            seed=1,
            success_threshold=0.5,
        ) as orch:
            orch.subscribe(lambda event: events.append(repr(event)))
            result = await orch.run(tasks=[clause(0), clause(1), clause(2)])
        assert result.status == "partial"
        assert result.errors[0].status_code == 400
        assert len(events) > 10
        assert len(logs.entries) > 5  # DEBUG lines: every failed attempt
        texts = [result.model_dump_json(), *events, *map(repr, logs.entries), logs.text()]
        api.assert_no_key_in(*texts)
        assert not any(API_KEY in text for text in texts)
        assert API_KEY not in repr(account) + repr(agent)


class TestEnforcedLimits:
    async def test_the_fake_api_answers_a_burst_over_its_budget_with_429s(
        self, clock: FakeClock
    ) -> None:
        # What the benchmark's "429s provoked" counts: a client that does not pace itself.
        async with (
            FakeMessagesAPI(requests_per_minute=3, enforce_limits=True) as api,
            AsyncAnthropic(api_key=API_KEY, base_url=api.url, max_retries=0) as client,
        ):
            for _ in range(5):
                with contextlib.suppress(Exception):
                    await client.messages.create(
                        model=SONNET, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
                    )
            assert [r.status for r in api.requests] == [200, 200, 200, 429, 429]
            assert api.requests[3].outcome == "rate_limit"
