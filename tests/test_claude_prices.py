"""What Claude's tokens cost: the price table's rows by model id or prefix, and a usage priced."""

from __future__ import annotations

import pytest

from orchestra.agents._claude_prices import cost_of, price_of
from orchestra.agents.claude import PRICES, Price
from tests.claude_fixtures import _IDS


class TestPrices:
    def test_prices_come_from_the_longest_matching_row(self) -> None:
        assert price_of("claude-sonnet-4-5-20250929") == PRICES["claude-sonnet-4"]
        assert price_of("claude-opus-4-5") == Price(5, 25)
        assert price_of("claude-opus-4-1") == Price(15, 75)
        assert price_of("not-a-claude") is None

    def test_cache_tokens_are_priced_as_writes_and_reads(self) -> None:
        class Usage:
            input_tokens = 1_000_000
            output_tokens = 0
            cache_creation_input_tokens = 1_000_000
            cache_read_input_tokens = 1_000_000
            cache_creation = None

        assert cost_of(Price(3, 15), Usage()) == pytest.approx(3 + 3.75 + 0.30)

    async def test_every_current_model_id_of_the_sdk_has_a_price(self) -> None:
        unpriced = [m for m in _IDS if price_of(m) is None and "preview" not in m]
        assert unpriced == []
