"""What a Claude call takes from the input-token budget: the prompt counted by the API's
`count_tokens` before the call (``count_tokens=True``), and the cache writes (and, on older models,
the cache reads) an answer reports. Against the fake Messages API over a real local socket, in
fake time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import pytest

from orchestra import ConfigError, Rate, Task
from orchestra.agents.claude import ClaudeAccount, ClaudeAgent, ClaudeLimits, Price
from tests.claude_fixtures import SONNET, account, api, client, research
from tests.claude_fixtures import run as run_claude
from tests.fake_messages_api import FakeMessagesAPI, _tokens

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from orchestra import RunResult

# A model of the 3 generation, whose cache reads count against the input budget (an id of that
# family the SDK does not list: its listed ones are deprecated, and it warns on each call).
__all__ = ("account", "api", "client")  # fixtures, used by name

OLD_HAIKU = "claude-3-9-haiku"


async def run(
    api: FakeMessagesAPI, agents: Sequence[ClaudeAgent], tasks: Sequence[Task], **options: Any
) -> RunResult:
    """`claude_fixtures.run`, which must end in success or say why it did not."""
    result = await run_claude(api, agents, tasks, **options)
    assert result.status == "success" or result.metadata.reason, result.errors
    return result


def long_prompt(tokens: int) -> Callable[[Task, Any], str]:
    """A prompt of `tokens` tokens (by the fake API's count) that the local estimate cannot see:
    it reads templates, not functions."""

    def prompt(task: Task, ctx: Any) -> str:
        return "wor " * tokens

    return prompt


def messages_calls(api: FakeMessagesAPI) -> list[float]:
    return [r.received for r in api.requests if r.path.split("?")[0] == "/v1/messages"]


def taken(meter: Rate) -> float:
    """The units `meter` admitted since loop time 0, drained or not (its drain time in units)."""
    now = anyio.current_time()
    return (now + meter.in_use(now) * meter.interval) / meter.interval


class TestCountTokens:
    @pytest.mark.parametrize("count", [True, False])
    async def test_a_long_prompt_waits_for_room_before_its_call_is_sent(
        self, api: FakeMessagesAPI, account: ClaudeAccount, count: bool
    ) -> None:
        # 12,000 input tokens a minute (200 a second). Each prompt is 10,000 tokens that the
        # local estimate (~10) misses: counted, the second call waits until the first one's
        # 10,000 have drained (50 s); estimated only, both go at once and overrun the budget.
        limits = ClaudeLimits(
            requests_per_minute=60_000,
            input_tokens_per_minute=12_000,
            output_tokens_per_minute=6_000_000,
        )
        agent = research(
            account,
            prompt=long_prompt(10_000),
            rate_limits=limits,
            count_tokens=count,
            max_tokens=16,
        )
        api.latency = 5.0  # the first call is still out when the second is taken
        tasks = [Task("research", i, id=f"c{i}") for i in range(2)]
        result = await run(api, [agent], tasks)
        assert result.status == "success"
        first, second = messages_calls(api)
        assert len(api.counted()) == (2 if count else 0)
        if count:
            assert second - first >= 10_000 * 60 / 12_000 - 1
        else:
            assert second - first < 1

    async def test_the_count_is_of_the_request_sent(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        agent = research(account, system="You assess clauses.", count_tokens=True, max_tokens=64)
        await run(api, [agent], [Task("research", "Clause 7.", id="c0")])
        counted, sent = api.requests
        assert counted.path == "/v1/messages/count_tokens"
        assert counted.body["messages"] == sent.body["messages"]
        assert counted.body["system"] == sent.body["system"]
        assert counted.body["model"] == SONNET
        assert "max_tokens" not in counted.body
        assert counted.received <= sent.received

    async def test_a_failed_count_keeps_the_local_estimate_and_the_call_goes_on(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        # The count's own rate limit (a 429 of count_tokens) neither fails nor delays the call,
        # nor holds the Messages budget.
        api.fail("rate_limit", path="/v1/messages/count_tokens", retry_after=30)
        agent = research(account, count_tokens=True)
        result = await run(api, [agent], [Task("research", "Clause 7.", id="c0")])
        assert result.status == "success"
        assert [r.status for r in api.requests] == [429, 200]
        assert result.metadata.elapsed < 1

    async def test_the_budget_sees_the_counted_tokens(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        # Counted, each call may take 10,000 + 16 tokens: a budget of 15,000 tokens lets one
        # call go at a time, and ends the run after the first (10,000 + a few real tokens
        # spent leave no room for another).
        agent = research(account, prompt=long_prompt(10_000), count_tokens=True, max_tokens=16)
        tasks = [Task("research", i, id=f"c{i}") for i in range(3)]
        result = await run(api, [agent], tasks, max_tokens=15_000, success_threshold=0.1)
        assert len(messages_calls(api)) == 1
        assert result.metadata.counts["succeeded"] == 1
        assert sum(result.metadata.tokens.values()) <= 15_000

    def test_count_tokens_must_be_a_bool(self, account: ClaudeAccount) -> None:
        with pytest.raises(ConfigError, match="count_tokens"):
            research(account, count_tokens="yes")


class TestCacheTokensOnTheInputBudget:
    @pytest.mark.parametrize(("model", "reads_count"), [(SONNET, False), (OLD_HAIKU, True)])
    async def test_cache_writes_and_reads_are_taken_from_the_input_budget(
        self, api: FakeMessagesAPI, account: ClaudeAccount, model: str, reads_count: bool
    ) -> None:
        # A budget so large that nothing waits (no time passes): the meter's use is exactly
        # what the calls took.
        limits = ClaudeLimits(
            requests_per_minute=10**6,
            input_tokens_per_minute=60_000_000,
            output_tokens_per_minute=10**9,
        )
        api.limits = dict.fromkeys(api.limits, 10**10)  # its headers leave the meters as they are
        system = "Rule. " * 1_000  # 1,500 tokens, cached
        agent = research(account, model=model, system=system, cache_system=True, rate_limits=limits)
        meter = limits.input_tokens
        start = taken(meter)
        first = await run(api, [agent], [Task("research", "Clause 1.", id="c0")])
        used = taken(meter) - start
        written = first.metadata.tokens["cache_creation_input_tokens"]
        assert written == _tokens(system.rstrip("\n")) or written > 1_000
        assert used == pytest.approx(first.metadata.tokens["input_tokens"] + written, abs=1)

        second = await run(api, [agent], [Task("research", "Clause 2.", id="c1")])
        read = second.metadata.tokens["cache_read_input_tokens"]
        assert read == written
        fresh = second.metadata.tokens["input_tokens"]
        more = taken(meter) - start - used
        assert more == pytest.approx(fresh + (read if reads_count else 0), abs=1)


class TestBudget:
    @pytest.mark.parametrize("option", ["max_cost", "max_tokens"])
    async def test_a_budget_of_exactly_three_calls_allows_three(
        self, api: FakeMessagesAPI, account: ClaudeAccount, option: str
    ) -> None:
        # Counted, each call holds 2,000 input tokens and its max_tokens=10 output tokens, and
        # uses exactly those (the answers are 10 words): the budget of three such calls lets
        # three go, one after the other, and the fourth never starts.
        price = Price(3, 15)
        agent = research(
            account,
            prompt=long_prompt(2_000),
            count_tokens=True,
            max_tokens=10,
            prices={SONNET: price},
        )
        api.answer(*["ten words " * 5] * 5)
        call_tokens = 2_000 + 10
        call_cost = (2_000 * 3 + 10 * 15) / 1e6
        budget = {"max_cost": 3 * call_cost, "max_tokens": 3 * call_tokens}[option]
        tasks = [Task("research", i, id=f"c{i}") for i in range(5)]
        result = await run(
            api, [agent], tasks, concurrency=1, success_threshold=0.5, **{option: budget}
        )
        assert len(messages_calls(api)) == 3
        assert result.metadata.counts == {**result.metadata.counts, "succeeded": 3, "cancelled": 2}
        assert sum(result.metadata.tokens.values()) == 3 * call_tokens
        assert result.metadata.cost == pytest.approx(3 * call_cost)
        assert result.status == "partial"
        assert {e.error_type for e in result.errors} == {"BudgetExceeded"}
        assert result.metadata.reason is not None
        assert option in result.metadata.reason

    async def test_waiting_attempts_that_cannot_grow_end_the_run_uncalled(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        # All five start on their small local estimates; counted (2,010 tokens a call), no
        # two fit a budget of 3,000 beside the others' estimates: one is called at most, and
        # no call ever goes over the budget.
        agent = research(account, prompt=long_prompt(2_000), count_tokens=True, max_tokens=10)
        tasks = [Task("research", i, id=f"c{i}") for i in range(5)]
        result = await run(api, [agent], tasks, max_tokens=3_000, success_threshold=0.0)
        assert len(messages_calls(api)) <= 1
        assert sum(result.metadata.tokens.values()) <= 3_000
        assert result.metadata.counts["cancelled"] >= 4
        assert result.metadata.reason is not None
