"""What one limiter check costs: `python -m benchmarks.limits`.

The dispatcher asks its limiters once per attempt on its hot path, so a plain concurrency check must
cost well under a microsecond. Prints nanoseconds per call (best of five rounds of timeit), and the
cost of calling an empty function for scale. Reported, never asserted.
"""

from __future__ import annotations

import timeit
from typing import TYPE_CHECKING

from orchestra._limits import Concurrency, Rate, reserve_all

if TYPE_CHECKING:
    from collections.abc import Callable

CALLS = 200_000


def per_call_ns(fn: Callable[[], object]) -> float:
    return min(timeit.repeat(fn, number=CALLS, repeat=5)) / CALLS * 1e9


def main() -> None:
    slots, agent = Concurrency(10**9), Concurrency(10**9)
    rate = Rate(1e12, per=1.0, burst=1e12)
    tokens = Rate(1e12, per=1.0, unit="input_tokens", burst=1e12)
    cost = {"input_tokens": 1200, "output_tokens": 4096}
    pair = (slots, agent)
    key = (slots, agent, rate, tokens)

    def concurrency() -> None:
        slots.reserve(1.0, 1)
        slots.release(1, 1.0)

    def two_concurrency() -> None:
        reserve_all(pair, 1.0, 1)
        slots.release(1, 1.0)
        agent.release(1, 1.0)

    def claude_key() -> None:
        reserve_all(key, 1.0, cost)
        slots.release(cost, 1.0)
        agent.release(cost, 1.0)

    rows = [
        ("empty function call (scale)", per_call_ns(lambda: None)),
        ("Concurrency.reserve + release", per_call_ns(concurrency)),
        ("Rate.reserve (requests)", per_call_ns(lambda: rate.reserve(1.0, 1))),
        ("reserve_all(global, agent) + 2 releases", per_call_ns(two_concurrency)),
        ("reserve_all(2 slots, rpm, input tpm) + releases", per_call_ns(claude_key)),
    ]
    for name, ns in rows:
        print(f"{name:<50} {ns:7.0f} ns")


if __name__ == "__main__":
    main()
