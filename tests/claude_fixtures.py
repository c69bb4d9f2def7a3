"""Fixtures shared by the Claude tests: the fake API, a client on it, an account, in fake time.
Imported by the test modules that use them (`from tests.claude_fixtures import *`-free: each
names what it takes)."""

from __future__ import annotations

from typing import TYPE_CHECKING, get_args

import pytest
from anthropic import AsyncAnthropic
from anthropic.types import Model

from orchestra.agents.claude import ClaudeAccount
from tests.fake_messages_api import FakeMessagesAPI

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

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
