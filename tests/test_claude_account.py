"""`ClaudeAccount`: one API key's client and limits, shared by the agents given it (a 429's and a
401's hold included), and what it refuses at construction. Against the fake Messages API over a
real local socket, in fake time."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import pytest
from anthropic import AsyncAnthropic

from orchestra import ConfigError, Task
from orchestra.agents.claude import ClaudeAccount, ClaudeAgent, ClaudeLimits, model_family
from tests.claude_fixtures import HAIKU, SONNET, account, api, client, research, run

if TYPE_CHECKING:
    from orchestra.testing import FakeClock
    from tests.fake_messages_api import FakeMessagesAPI

__all__ = ("account", "api", "client")  # fixtures, used by name


def clause(i: int = 0) -> Task:
    return Task("research", {"text": "The supplier's liability is unlimited."}, id=f"c{i}")


class TestSharing:
    async def test_agents_given_one_client_share_its_account_and_a_429s_hold(
        self, api: FakeMessagesAPI, client: AsyncAnthropic
    ) -> None:
        api.fail("rate_limit", times=1, retry_after=2)
        first = ClaudeAgent(name="a", kinds=["a"], model=SONNET, client=client)
        second = ClaudeAgent(name="b", kinds=["b"], model=SONNET, client=client)
        tasks = [Task("a", "x", id="x")] + [Task("b", f"y{i}", id=f"y{i}") for i in range(3)]
        result = await run(api, [first, second], tasks)
        assert result.status == "success"
        limited = api.answered(429)[0]
        after = [r for r in api.requests if r.received > limited.received]
        assert after, "nothing was sent after the 429"
        assert all(r.received >= limited.received + 2 for r in after)
        assert first.account is second.account  # one client, one key: one account

    async def test_agents_given_one_client_share_a_401s_hold(
        self, api: FakeMessagesAPI, client: AsyncAnthropic
    ) -> None:
        api.fail("authentication", duration=30)
        first = ClaudeAgent(name="a", kinds=["a"], model=SONNET, client=client)
        second = ClaudeAgent(name="b", kinds=["b"], model=HAIKU, client=client)
        first_result = await run(api, [first], [Task("a", "x", id="x")])
        assert first_result.status == "failed"
        # The key was refused on the first agent's call: the second's are not sent.
        result = await run(api, [second], [Task("b", "y", id="y")])
        error = result.error_for("y")
        assert error is not None
        assert "refused this key (401 authentication_error" in error.message
        assert len(api.requests) == 1

    async def test_agents_given_different_clients_have_their_own_accounts(
        self, api: FakeMessagesAPI, client: AsyncAnthropic
    ) -> None:
        async with AsyncAnthropic(api_key="sk-ant-other", base_url=api.url) as other:
            first = ClaudeAgent(name="a", kinds=["a"], model=SONNET, client=client)
            second = ClaudeAgent(name="b", kinds=["b"], model=SONNET, client=other)
            assert first.account is not second.account
            assert first.rate_limits is not second.rate_limits


class TestRefusedKey:
    async def test_an_invalid_key_fails_at_once_and_is_not_retried(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.fail("authentication")
        result = await run(api, [research(account)], [clause()])
        error = result.error_for("c0")
        assert error is not None
        assert len(api.requests) == 1
        assert error.status_code == 401
        assert error.attempts[0].api_error_type == "authentication_error"

    async def test_a_refused_key_sends_nothing_more_until_its_hold_ends(
        self, api: FakeMessagesAPI, account: ClaudeAccount, clock: FakeClock
    ) -> None:
        # A 401 is about the key: 30 tasks sent 30 requests, each paid for and failed. Now the
        # first answer holds the key, and the tasks after it fail unsent.
        api.fail("authentication", duration=30)  # the key is refused for a while
        agent = research(account, concurrency=3)
        result = await run(api, [agent], [clause(i) for i in range(30)])
        assert result.metadata.counts["failed"] == 30
        sent = len(api.requests)
        assert 1 <= sent <= 3  # those in flight when the first answer came
        unsent = [e for e in result.errors if "not sent" in e.message]
        assert len(unsent) == 30 - sent
        assert "refused this key (401 authentication_error" in unsent[0].message
        assert {e.error_type for e in unsent} == {"PermanentError"}
        # After the hold, a request tries the key again (the API takes it by then).
        await anyio.sleep(61)  # virtual time
        again = await run(api, [agent], [clause(99)])
        assert (again.status, len(api.requests)) == ("success", sent + 1)

    async def test_a_refusal_seen_on_another_clock_holds_nothing(
        self, api: FakeMessagesAPI, account: ClaudeAccount, clock: FakeClock
    ) -> None:
        # An account outlives a test (`ClaudeAccount.shared()`): a refusal seen on a FakeClock,
        # whose virtual time runs ahead of the loop's, held the next test's requests on the real
        # clock for as long as that lead. A time well before the refusal is another clock's, as
        # for limits and breakers (`CLOCK_SLIP`).
        api.fail("authentication", times=1)
        await run(api, [research(account)], [clause()])
        now = clock.now()
        assert account.refusal(now) is not None
        assert account.refusal(now - 30) is None  # another clock, far behind this one
        assert account.refusal(now + 61) is None  # the hold is over
        again = await run(api, [research(account)], [clause(1)])
        assert again.status == "failed"  # this clock: still held, unsent
        assert len(api.requests) == 1


class TestConfiguration:
    def test_no_api_key_is_a_config_error_before_any_request(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
        monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
        with pytest.raises(ConfigError, match=r"no API key.*ANTHROPIC_API_KEY"):
            ClaudeAccount(base_url="http://127.0.0.1:9")
        with pytest.raises(ConfigError, match="no API key"):
            ClaudeAgent(name="research", kinds=["research"], model=SONNET)  # the shared account
        ClaudeAccount(api_key="sk-ant-given", base_url="http://127.0.0.1:9")  # a key: fine

    def test_account_limits_keyed_by_a_model_id_are_its_familys(
        self, client: AsyncAnthropic
    ) -> None:
        """`limits={"claude-sonnet-4-5": ...}` was silently ignored: the agents ran on the smallest
        tier's defaults (50 requests a minute) instead of the budget given."""
        given = ClaudeLimits(requests_per_minute=1_000)
        for key in (SONNET, model_family(SONNET)):
            account = ClaudeAccount(client=client, limits={key: given})
            assert account.limits(SONNET) is given
        with pytest.raises(ConfigError, match=r"limits\[.*\] and limits\[.*\]: one family"):
            ClaudeAccount(
                client=client, limits={SONNET: given, model_family(SONNET): ClaudeLimits()}
            )

    def test_bad_account_prices_are_a_config_error(self, client: AsyncAnthropic) -> None:
        with pytest.raises(ConfigError, match=r"prices\['claude-x'\] must be a Price"):
            ClaudeAccount(client=client, prices={"claude-x": (1, 5)})  # type: ignore[dict-item]


class TestFamilies:
    def test_models_of_one_family_share_a_budget(self) -> None:
        assert model_family("claude-sonnet-4-5-20250929") == "sonnet-4"
        assert model_family("claude-sonnet-4-6") == "sonnet-4"
        assert model_family("claude-3-5-haiku-20241022") == "haiku-3"
        assert model_family("custom") == "custom"
        account = ClaudeAccount(client=AsyncAnthropic(api_key="k", max_retries=5))
        assert account.client.max_retries == 0  # orchestra's retry is the only retry
        assert account.limits("claude-sonnet-4-5") is account.limits("claude-sonnet-4-6")
        assert account.limits("claude-sonnet-4-5") is not account.limits(HAIKU)
