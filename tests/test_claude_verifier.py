"""`ClaudeVerifier` against the fake Messages API: pass / fail, the feedback reaching the next
attempt's conversation, its spend in the run's metadata, its own retries."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest

from orchestra import ConfigError, Orchestrator, RetryPolicy, RunResult, Task, Verdict
from orchestra.agents import ClaudeAgent, ClaudeVerifier
from tests.claude_fixtures import HAIKU, SONNET, account, api, client
from tests.fake_messages_api import prompt_of

if TYPE_CHECKING:
    from orchestra.agents import ClaudeAccount
    from tests.fake_messages_api import FakeMessagesAPI

__all__ = ("account", "api", "client")  # fixtures, used by name


def scripted(verdicts: list[dict[str, Any]]) -> Any:
    """Answers: the writer's summary (numbered by its attempt), the reviewer's next verdict."""
    writes = iter(range(1, 100))
    pending = iter(verdicts)

    def respond(body: Any) -> str:
        if "strict reviewer" in str(body.get("system")):
            return json.dumps(next(pending))
        return f"summary v{next(writes)}"

    return respond


def writer(account: ClaudeAccount) -> ClaudeAgent:
    return ClaudeAgent(
        name="writer", kinds=["summarize"], model=SONNET, account=account, prompt="{payload}"
    )


async def summarize(account: ClaudeAccount, verifier: ClaudeVerifier) -> RunResult:
    """One contract summarized by the writer, checked by `verifier`, up to three attempts."""
    orch = Orchestrator(
        agents=[writer(account)],
        verify={"summarize": verifier},
        retry=RetryPolicy(max_attempts=3, base=0.1),
    )
    return await orch.run(tasks=[Task("summarize", "a contract", id="s")])


class TestVerdicts:
    async def test_a_fail_feeds_the_next_attempt_and_a_pass_ends_it(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.answer(
            *[
                scripted(
                    [
                        {"passed": False, "feedback": "cite clause 3"},
                        {"passed": True, "feedback": ""},
                    ]
                )
            ]
            * 4
        )
        verifier = ClaudeVerifier(model=HAIKU, criteria="cites every clause", account=account)
        result = await summarize(account, verifier)
        assert result.status == "success"
        assert result.data == {"s": "summary v2"}
        prompts = [prompt_of(r.body) for r in api.requests]
        assert len(prompts) == 4
        assert "cites every clause" in prompts[1]
        assert "summary v1" in prompts[1]
        assert "Feedback on your answer: cite clause 3" in prompts[2]
        usage = result.metadata.usage_per_agent
        assert set(usage) == {"writer", "claude-verifier"}
        assert usage["claude-verifier"]["input_tokens"] > 0
        assert set(result.metadata.usage_per_model) == {SONNET, HAIKU}
        assert verifier.spent["cost"] == pytest.approx(usage["claude-verifier"]["cost"])

    async def test_a_verdict_alone(self, api: FakeMessagesAPI, account: ClaudeAccount) -> None:
        api.answer(
            '{"passed": false, "feedback": "  too short "}', '{"passed": true, "feedback": ""}'
        )
        verifier = ClaudeVerifier(model=HAIKU, criteria="long enough", account=account)
        task = Task("summarize", {"text": "x"}, id="t")
        assert await verifier(task, "short") == Verdict.fail("too short")
        assert await verifier(task, {"summary": "long"}) == Verdict.ok()
        assert '"summary": "long"' in prompt_of(api.requests[1].body)

    async def test_an_overloaded_api_is_retried_by_the_verifier(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.fail("overloaded", times=2)
        api.answer('{"passed": true, "feedback": ""}')
        verifier = ClaudeVerifier(
            model=HAIKU, criteria="c", account=account, retry=RetryPolicy(base=0.1, max_attempts=3)
        )
        assert await verifier(Task("k", "p", id="t"), "out") == Verdict.ok()
        assert [r.status for r in api.requests] == [529, 529, 200]

    async def test_an_api_that_keeps_failing_fails_the_check(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        from anthropic import InternalServerError

        api.fail("overloaded")
        verifier = ClaudeVerifier(
            model=HAIKU, criteria="c", account=account, retry=RetryPolicy(base=0.1, max_attempts=2)
        )
        with pytest.raises(InternalServerError):
            await verifier(Task("k", "p", id="t"), "out")
        assert len(api.requests) == 2

    async def test_a_malformed_judgement_is_asked_again_and_never_reaches_the_writer(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        verdicts = iter(["I think it is fine.", '{"passed": true, "feedback": ""}'])

        def respond(body: Any) -> str:
            if "strict reviewer" in str(body.get("system")):
                return next(verdicts)
            return "summary v1"

        api.answer(respond, respond, respond)
        verifier = ClaudeVerifier(
            model=HAIKU, criteria="c", account=account, retry=RetryPolicy(base=0.1, max_attempts=2)
        )
        result = await summarize(account, verifier)
        assert result.status == "success"
        assert result.data == {"s": "summary v1"}
        # The writer was asked once: the reviewer's own garbage went back to the reviewer.
        models = [r.body["model"] for r in api.requests]
        assert models == [SONNET, HAIKU, HAIKU]
        again = api.requests[2].body["messages"]
        assert again[1] == {"role": "assistant", "content": "I think it is fine."}
        assert "did not match the required JSON schema" in again[2]["content"]

    async def test_a_judgement_that_stays_malformed_fails_the_check_but_not_as_a_rejection(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        from orchestra import RetryableError, VerificationError

        api.answer("yes", "still yes")
        verifier = ClaudeVerifier(
            model=HAIKU, criteria="c", account=account, retry=RetryPolicy(base=0.1, max_attempts=2)
        )
        with pytest.raises(RetryableError, match="'claude-verifier' gave no valid judgement") as e:
            await verifier(Task("k", "p", id="t"), "out")
        assert not isinstance(e.value, VerificationError)  # not the writer's rejected answer
        assert len(api.requests) == 2

    def test_a_retry_that_is_not_a_policy_is_a_config_error(self, account: ClaudeAccount) -> None:
        # It was taken, and the first verdict raised AttributeError (no max_attempts).
        with pytest.raises(ConfigError, match="retry must be a RetryPolicy, got 3"):
            ClaudeVerifier(model=HAIKU, criteria="correct", account=account, retry=3)  # type: ignore[arg-type]

    def test_empty_criteria_are_a_config_error(self, account: ClaudeAccount) -> None:
        with pytest.raises(ConfigError, match="criteria"):
            ClaudeVerifier(model=HAIKU, criteria=" ", account=account)
