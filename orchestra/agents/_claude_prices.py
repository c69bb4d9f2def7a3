"""What Claude's tokens cost: a price table per model that users can override and extend (checked
by `check_prices`), and the price of a usage (`cost_of`).

`PRICES` maps a model id, or the prefix of a family of ids (``"claude-sonnet-4"`` prices every
Sonnet 4.x id that has no row of its own), to USD per million tokens, from the Messages API's
published pricing page (platform.claude.com/docs/en/about-claude/pricing). The longest matching
prefix wins, so ``claude-sonnet-4-5-20250929`` finds ``claude-sonnet-4``. A cache write is the
five-minute one (1.25 times the input price); a one-hour write costs more and is priced as such
only when the response reports it (`usage.cache_creation.ephemeral_1h_input_tokens`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, NamedTuple

from .._exceptions import ConfigError

__all__ = ("PRICES", "Price", "Usage", "check_prices", "cost_of", "price_of")


class Price(NamedTuple):
    """USD per million tokens of one model."""

    input: float
    output: float
    cache_write: float | None = None
    """A five-minute cache write; None: 1.25 times `input`."""
    cache_read: float | None = None
    """A cache hit; None: 0.1 times `input`."""
    cache_write_1h: float | None = None
    """A one-hour cache write; None: 2 times `input`."""


PRICES: Final[Mapping[str, Price]] = {
    "claude-fable-5-2": Price(10, 50, cache_read=0.25),
    "claude-mythos-5-2": Price(10, 50, cache_read=0.25),
    "claude-fable-5-1": Price(10, 50, cache_read=0.25),
    "claude-mythos-5-1": Price(10, 50, cache_read=0.25),
    "claude-fable-5": Price(10, 50, cache_read=1.0),
    "claude-mythos-5": Price(10, 50, cache_read=1.0),
    "claude-opus-5-5": Price(4, 20, cache_read=0.20),
    "claude-opus-5": Price(5, 25),
    "claude-opus-4-5": Price(5, 25),
    "claude-opus-4-6": Price(5, 25),
    "claude-opus-4-7": Price(5, 25),
    "claude-opus-4-8": Price(5, 25),
    "claude-opus-4": Price(15, 75),  # Opus 4 and 4.1
    "claude-sonnet-5-5": Price(2, 10, cache_read=0.10),
    "claude-sonnet-5": Price(2, 10),
    "claude-sonnet-4": Price(3, 15),
    "claude-haiku-5-5": Price(0.10, 0.50),  # prompts up to 100,000 tokens
    "claude-haiku-4": Price(1, 5),
    "claude-3-5-haiku": Price(0.80, 4),
    "claude-3-haiku": Price(0.25, 1.25),
}
"""USD per million tokens, by model id or id prefix. Pass `prices={...}` to `ClaudeAgent` or
`ClaudeAccount` to override or extend it (a model that matches no row costs 0 and is logged)."""


def price_of(model: str, prices: Mapping[str, Price] = PRICES) -> Price | None:
    """The price of `model`: its own row, else the longest prefix of it that has one."""
    price = prices.get(model)
    if price is not None:
        return price
    best = ""
    for prefix in prices:
        if len(prefix) > len(best) and model.startswith(prefix):
            best = prefix
    return prices[best] if best else None


class Usage:
    """Token counts by name, read as the SDK's `Usage` (what `cost_of` prices): the units an
    attempt reserved, priced before it starts."""

    __slots__ = (
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
        "input_tokens",
        "output_tokens",
    )

    cache_creation = None

    def __init__(self, units: Mapping[str, float]) -> None:
        self.input_tokens = units.get("input_tokens", 0)
        self.output_tokens = units.get("output_tokens", 0)
        self.cache_creation_input_tokens = units.get("cache_creation_input_tokens", 0)
        self.cache_read_input_tokens = units.get("cache_read_input_tokens", 0)


def cost_of(price: Price, usage: Any) -> float:
    """USD of one response's `usage` (the SDK's `Usage`, or anything with its attributes)."""
    fresh = getattr(usage, "input_tokens", 0) or 0
    output = getattr(usage, "output_tokens", 0) or 0
    written = getattr(usage, "cache_creation_input_tokens", 0) or 0
    read = getattr(usage, "cache_read_input_tokens", 0) or 0
    hour = getattr(getattr(usage, "cache_creation", None), "ephemeral_1h_input_tokens", 0) or 0
    hour = min(hour, written)
    write = price.cache_write if price.cache_write is not None else 1.25 * price.input
    write_1h = price.cache_write_1h if price.cache_write_1h is not None else 2 * price.input
    hit = price.cache_read if price.cache_read is not None else 0.1 * price.input
    return (
        fresh * price.input
        + output * price.output
        + (written - hour) * write
        + hour * write_1h
        + read * hit
    ) / 1_000_000


def check_prices(name: str, prices: Any) -> None:
    """`prices` is None or a mapping of model ids (or id prefixes) to `Price` rows."""
    if prices is None:
        return
    if not isinstance(prices, Mapping):
        raise ConfigError(f"{name} must be a mapping of model id to Price, got {prices!r}")
    for model, price in prices.items():
        if not isinstance(model, str) or not model:
            raise ConfigError(f"{name}: a key must be a model id or prefix, got {model!r}")
        if not isinstance(price, Price):
            raise ConfigError(
                f"{name}[{model!r}] must be a Price(input, output, ...), got {price!r}"
            )
