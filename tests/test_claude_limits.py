"""`ClaudeLimits`: one key's per-minute budgets of a model family, adapted by the API's rate-limit
headers (never above a limit the user chose)."""

from __future__ import annotations

import pytest

from orchestra.agents.claude import ClaudeLimits
from tests.helpers import fake_clock


def _rfc3339(wall: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(wall, UTC).isoformat().replace("+00:00", "Z")


class TestServerHeaders:
    def test_headers_retune_a_default_budget_and_lower_a_configured_one(self) -> None:
        clock = fake_clock()
        default, configured = ClaudeLimits(), ClaudeLimits(requests_per_minute=100)
        headers = {
            "anthropic-ratelimit-requests-limit": "4000",
            "anthropic-ratelimit-input-tokens-limit": "50",
        }
        for limits in (default, configured):
            limits.observe_headers(headers, clock)
        assert default.requests.limit == 4000
        assert configured.requests.limit == 100  # a ceiling the user chose
        assert configured.input_tokens.limit == 50  # the server's is lower: it wins

    def test_remaining_zero_holds_until_the_reset(self) -> None:
        clock = fake_clock()
        limits = ClaudeLimits(requests_per_minute=600)
        reset = clock.wall() + 7
        stamp = _rfc3339(reset)
        limits.observe_headers(
            {
                "anthropic-ratelimit-requests-remaining": "0",
                "anthropic-ratelimit-requests-reset": stamp,
            },
            clock,
        )
        now = clock.now()
        assert limits.requests.reserve(now, 1) == pytest.approx(clock.to_loop(reset), abs=1e-3)

    def test_garbage_headers_change_nothing(self) -> None:
        limits = ClaudeLimits(requests_per_minute=60)
        limits.observe_headers(
            {
                "anthropic-ratelimit-requests-limit": "lots",
                "anthropic-ratelimit-requests-remaining": "-1",
                "anthropic-ratelimit-requests-reset": "soon",
            },
            fake_clock(),
        )
        assert limits.requests.limit == 60
        assert limits.requests.reserve(0.0, 1) == 0.0
