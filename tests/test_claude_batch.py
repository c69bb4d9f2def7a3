"""`ClaudeBatchAgent` against the fake Message Batches API: gathering by count and by time,
polling, mixed results mapped back to their tasks, retries, half price, cancellation."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from orchestra import ConfigError, Orchestrator, RetryPolicy, Task
from orchestra.agents import ClaudeAgent, ClaudeBatchAgent
from orchestra.agents._claude_prices import PRICES, price_of
from tests.claude_fixtures import SONNET, account, api, client
from tests.fake_messages_api import prompt_of

if TYPE_CHECKING:
    from orchestra import RunResult
    from orchestra.agents import ClaudeAccount
    from tests.fake_messages_api import FakeMessagesAPI

__all__ = ("account", "api", "client")  # fixtures, used by name


def batcher(account: ClaudeAccount, **options: Any) -> ClaudeBatchAgent:
    options.setdefault("name", "bulk")
    options.setdefault("kinds", ["research"])
    options.setdefault("model", SONNET)
    options.setdefault("prompt", "Clause: {payload}")
    return ClaudeBatchAgent(account=account, **options)


def clauses(n: int) -> list[Task]:
    return [Task("research", f"clause {i}", id=f"c{i}") for i in range(n)]


async def run(agents: list[Any], tasks: list[Task], **options: Any) -> RunResult:
    options.setdefault("retry", RetryPolicy(max_attempts=3, base=1.0))
    options.setdefault("seed", 3)
    async with Orchestrator(agents=agents, **options) as orch:
        return await orch.run(tasks=tasks)


def batch_posts(api: FakeMessagesAPI) -> list[Any]:
    return [r.body for r in api.requests if r.method == "POST" and r.path == "/v1/messages/batches"]


class TestGathering:
    async def test_tasks_go_in_batches_of_the_size_and_come_back_to_their_tasks(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        agent = batcher(account, batch_size=5, max_wait=30)
        result = await run([agent], clauses(10))
        assert result.status == "success"
        assert [len(b["requests"]) for b in batch_posts(api)] == [5, 5]
        for i in range(10):
            assert result.data[f"c{i}"] == f"echo: Clause: clause {i}"
        assert not any(r.path == "/v1/messages" for r in api.requests)  # none went one by one
        assert len(agent.batches) == 2

    async def test_a_partial_batch_goes_after_max_wait(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.batch_latency = 10.0
        t0 = anyio.current_time()
        result = await run([batcher(account, batch_size=100, max_wait=2.0)], clauses(3))
        assert result.status == "success"
        posts = [r for r in api.requests if r.path == "/v1/messages/batches"]
        assert len(posts) == 1
        assert posts[0].received - t0 == pytest.approx(2.0, abs=0.05)
        assert result.metadata.elapsed >= 12.0  # gathered 2 s, processed 10 s, then polled

    async def test_polling_backs_off(self, api: FakeMessagesAPI, account: ClaudeAccount) -> None:
        api.batch_latency = 100.0
        agent = batcher(account, batch_size=1, poll_interval=5.0, max_poll_interval=40.0)
        await run([agent], clauses(1))
        polls = [r.received for r in api.requests if r.method == "GET" and "results" not in r.path]
        gaps = [round(b - a) for a, b in itertools.pairwise(polls)]
        assert gaps[:4] == [10, 20, 40, 40]


class TestOutcomes:
    async def test_a_batch_with_mixed_results(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        def which(*names: str) -> Any:
            return lambda params: any(f"clause {n}" == prompt_of(params)[8:] for n in names)

        api.batch_outcome("errored", match=which("1"))
        api.batch_outcome("expired", match=which("2"))
        api.batch_outcome("canceled", match=which("3"))
        # c1, c2 and c3 fail in every batch; c0 and c4 succeed in the first.
        result = await run([batcher(account, batch_size=5, max_wait=1)], clauses(5))
        assert result.status == "failed"  # 2 of 5 is below the default threshold
        assert result.data == {"c0": "echo: Clause: clause 0", "c4": "echo: Clause: clause 4"}
        errors = {e.task_id: e for e in result.errors}
        assert set(errors) == {"c1", "c2", "c3"}
        assert errors["c1"].error_type == "BatchRequestFailed"
        assert "overloaded_error" in errors["c1"].message
        assert "expired" in errors["c2"].message
        assert "canceled" in errors["c3"].message
        assert all(len(e.attempts) == 3 for e in errors.values())  # retried, in later batches
        sizes = [len(b["requests"]) for b in batch_posts(api)]
        assert sizes[0] == 5
        assert sum(sizes[1:]) == 6  # two retries of each of the three

    async def test_a_retried_request_succeeds_in_a_later_batch(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.batch_outcome("expired", match=lambda params: len(batch_posts(api)) == 1)
        result = await run([batcher(account, batch_size=2, max_wait=1)], clauses(2))
        assert result.status == "success"
        assert result.metadata.retries == 2

    @pytest.mark.parametrize("fault", ["overloaded", "server_error", "rate_limit"])
    async def test_a_failed_poll_keeps_the_batch(
        self, api: FakeMessagesAPI, account: ClaudeAccount, fault: Any
    ) -> None:
        # A poll that meets a 529 / 500 / 429 is polled again: the batch runs on at the API (and
        # is paid for), so its requests must not be failed and sent again in a second batch.
        api.fail(fault, times=2, path="/v1/messages/batches/*")
        agent = batcher(account, batch_size=2, poll_interval=5.0)
        result = await run([agent], clauses(2))
        assert result.status == "success"
        assert result.metadata.retries == 0
        assert len(batch_posts(api)) == 1
        assert len(agent.batches) == 1
        assert len([r for r in api.requests if r.status != 200]) == 2

    async def test_a_poll_that_keeps_failing_fails_the_attempts_and_cancels_the_batch(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.fail("server_error", path="/v1/messages/batches/*")
        agent = batcher(account, batch_size=1, poll_interval=1.0)
        result = await run([agent], clauses(1), retry=RetryPolicy(max_attempts=1))
        error = result.error_for("c0")
        assert error is not None
        assert error.attempts[0].status_code == 500
        assert len(api.batches) == 1
        assert any(r.path.endswith("/cancel") for r in api.requests)  # asked, best effort

    async def test_usage_costs_half_the_price(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        result = await run([batcher(account, batch_size=4)], clauses(4))
        price = price_of(SONNET, PRICES)
        assert price is not None
        tokens = result.metadata.usage_per_model[SONNET]
        full = (tokens["input_tokens"] * price.input + tokens["output_tokens"] * price.output) / 1e6
        assert result.metadata.cost == pytest.approx(full / 2)
        assert result.metadata.usage_per_agent["bulk"]["cost"] == pytest.approx(full / 2)

    async def test_a_cancelled_run_cancels_its_batch(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.batch_latency = 1_000.0
        agent = batcher(account, batch_size=2, poll_interval=5.0)
        async with Orchestrator(agents=[agent]) as orch:
            handle = orch.start(tasks=clauses(2))
            await anyio.sleep(12)
            result = await handle.stop(0, reason="enough")
            await anyio.sleep(0.1)  # the poller hears that nobody waits any more
        assert result.status == "cancelled"
        assert any(r.path.endswith("/cancel") for r in api.requests)
        assert all(b.canceled for b in api.batches.values())

    async def test_closing_the_agent_cancels_its_open_batches(
        self, api: FakeMessagesAPI, account: ClaudeAccount
    ) -> None:
        api.batch_latency = 1_000.0
        agent = batcher(account, batch_size=2, poll_interval=5.0)
        async with Orchestrator(agents=[agent]) as orch:
            handle = orch.start(tasks=clauses(2))
            while not agent.batches:
                await anyio.sleep(1)
            (first,) = agent.batches
            await agent.aclose()  # returns once its pollers have ended
            assert api.batches[first].canceled  # not left running (and billed) at the API
            await handle.stop(0, reason="closed")


class TestOptions:
    def test_bad_options_are_config_errors(self, account: ClaudeAccount) -> None:
        with pytest.raises(ConfigError, match="batch_size"):
            batcher(account, batch_size=0)
        with pytest.raises(ConfigError, match="stream"):
            batcher(account, stream=True)

    def test_it_reserves_nothing_on_the_messages_limits(self, account: ClaudeAccount) -> None:
        assert batcher(account).limits == ()
        assert ClaudeAgent(name="a", kinds=["k"], model=SONNET, account=account).limits != ()
