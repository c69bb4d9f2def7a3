"""Remediation: the advice of an error record follows what happened to its task."""

from __future__ import annotations

from typing import Any

import pytest

from orchestra._core._remediation import remediation
from orchestra._task import CANCELLED, FAILED, SKIPPED


class TestTasksThatNeverFailed:
    def test_a_skipped_task_names_what_failed_first(self) -> None:
        advice = remediation(SKIPPED, "Skipped", "dependency 'a' failed")
        assert "dependency 'a' failed" in advice
        assert "dependencies succeed" in advice

    @pytest.mark.parametrize(
        ("error_type", "words"),
        [
            ("RunTimeout", "run timeout"),
            ("BudgetExceeded", "budget"),
            ("Stopped", "stopped"),
            ("Cancelled", "metadata.cancellations"),
        ],
    )
    def test_a_cancelled_task_says_what_ended_it(self, error_type: str, words: str) -> None:
        assert words in remediation(CANCELLED, error_type, "")


class TestCredentials:
    @pytest.mark.parametrize(
        ("error_type", "message", "options"),
        [
            ("APIStatusError", "Error code: 401", {}),
            ("PermanentError", "the server said: Unauthorized", {}),
            ("APIStatusError", "refused", {"status_code": 401}),
            ("APIStatusError", "refused", {"api_error_type": "authentication_error"}),
            ("AuthenticationError", "refused", {}),
        ],
    )
    def test_a_rejected_key_names_the_api_key_not_the_payload(
        self, error_type: str, message: str, options: dict[str, Any]
    ) -> None:
        advice = remediation(FAILED, error_type, message, **options)
        assert "API key" in advice
        assert "payload" not in advice

    def test_a_forbidden_call_names_the_keys_permissions(self) -> None:
        advice = remediation(FAILED, "APIStatusError", "no", status_code=403)
        assert "permissions" in advice
        assert "will not help" in advice


class TestFallbackAdvice:
    def test_a_task_tried_on_one_agent_is_advised_a_fallback(self) -> None:
        assert "fallback" in remediation(FAILED, "ValueError", "boom", agents=1).lower()

    def test_a_task_tried_on_a_chain_is_not_advised_one(self) -> None:
        advice = remediation(FAILED, "ValueError", "boom", agents=2)
        assert "fallback" not in advice.lower()
        assert "Every agent of its chain failed" in advice

    @pytest.mark.parametrize(("agents", "advised"), [(1, True), (2, False)])
    def test_an_open_breaker_advises_a_fallback_only_without_one(
        self, agents: int, advised: bool
    ) -> None:
        advice = remediation(FAILED, "CircuitOpen", "open", agents=agents)
        assert "circuit breaker" in advice
        assert ("add a fallback agent" in advice) is advised


class TestFailuresByKind:
    @pytest.mark.parametrize(
        ("error_type", "message", "words"),
        [
            ("TaskTimeout", "", "task's timeout"),
            ("AttemptTimeout", "", "attempt timeout"),
            ("Rejected", "", "safety check"),
            ("VerificationError", "", "verification"),
            ("InvalidOutput", "", "JSON value"),
            ("InputError", "", "invalid"),
            ("RateLimited", "HTTP 429", "rate limited"),
            ("ValidationError", "", "fix the payload"),
            ("NoAgentLeft", "", "No agent of the chain"),
        ],
    )
    def test_the_advice_names_what_to_change(
        self, error_type: str, message: str, words: str
    ) -> None:
        assert words in remediation(FAILED, error_type, message)
