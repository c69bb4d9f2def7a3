"""Fixtures shared by the Claude tests: the fake API, a client on it, an account, in fake time; an
agent on the account and a run of it. Imported by the test modules that use them
(`from tests.claude_fixtures import *`-free: each names what it takes)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, get_args

import pytest
from anthropic import AsyncAnthropic
from anthropic.types import Model

from orchestra import Orchestrator, RetryPolicy
from orchestra.agents.claude import ClaudeAccount, ClaudeAgent
from tests.fake_messages_api import FakeMessagesAPI

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from orchestra import RunResult, Task
    from orchestra.testing import FakeClock

API_KEY = "sk-ant-test-0123456789abcdefSECRET"
_IDS = get_args(get_args(Model)[0])
SONNET = next(m for m in _IDS if m.startswith("claude-sonnet-"))
HAIKU = next(m for m in _IDS if m.startswith("claude-haiku-"))


@pytest.fixture
async def api(clock: FakeClock, no_leaks: None) -> AsyncIterator[FakeMessagesAPI]:
    async with FakeMessagesAPI() as server:
        yield server


@pytest.fixture
async def client(api: FakeMessagesAPI) -> AsyncIterator[AsyncAnthropic]:
    async with AsyncAnthropic(api_key=API_KEY, base_url=api.url, max_retries=0) as anthropic:
        yield anthropic


@pytest.fixture
def account(client: AsyncAnthropic) -> ClaudeAccount:
    return ClaudeAccount(client=client)


def research(account: ClaudeAccount, **options: Any) -> ClaudeAgent:
    options.setdefault("name", "research")
    options.setdefault("kinds", ["research"])
    options.setdefault("model", SONNET)
    return ClaudeAgent(account=account, **options)


async def run(
    api: FakeMessagesAPI, agents: Sequence[ClaudeAgent], tasks: Sequence[Task], **options: Any
) -> RunResult:
    """Run `tasks`; the API key never appears in the result (when a request was sent)."""
    options.setdefault("retry", RetryPolicy(max_attempts=3, base=0.1))
    options.setdefault("seed", 7)
    async with Orchestrator(agents=list(agents), **options) as orch:
        result = await orch.run(tasks=list(tasks))
    if api.requests:
        api.assert_no_key_in(result.model_dump_json())
    return result
