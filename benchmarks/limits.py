"""What one limiter check costs: `python -m benchmarks.limits`.

The dispatcher asks its limiters once per attempt on its hot path, so a plain concurrency check must
cost well under a microsecond. Prints nanoseconds per call (best of five rounds of timeit), and the
cost of calling an empty function for scale, and what a whole task costs when two agents share one
`Concurrency(4)` (its waiting tasks take turns in the run's order: see `Line`). Reported, never
asserted.
"""

from __future__ import annotations

import asyncio
import time
import timeit
from typing import TYPE_CHECKING

from orchestra import Orchestrator, Task, agent
from orchestra._concurrency import Concurrency
from orchestra._limits import reserve_all
from orchestra._rate import Rate

if TYPE_CHECKING:
    from collections.abc import Callable

CALLS = 200_000


def per_call_ns(fn: Callable[[], object]) -> float:
    return min(timeit.repeat(fn, number=CALLS, repeat=5)) / CALLS * 1e9


def shared_dispatch_us(tasks: int = 20_000) -> float:
    """CPU µs per no-op task (each yields once) of two agents sharing one `Concurrency(4)`."""
    key = [Concurrency(4)]

    async def work(task: Task, ctx: object) -> None:
        await asyncio.sleep(0)

    agents = [agent(kinds=[name], limits=key, name=name)(work) for name in "ab"]

    async def run() -> float:
        orch = Orchestrator(agents=agents)
        batch = [Task("ab"[i % 2], i, id=f"t{i}") for i in range(tasks)]
        start = time.process_time()
        await orch.run(tasks=batch)
        return (time.process_time() - start) / tasks * 1e6

    return min(asyncio.run(run()) for _ in range(3))


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
    print(
        f"{'task of 2 agents sharing Concurrency(4) (dispatch)':<50} {shared_dispatch_us():7.1f} µs"
    )


if __name__ == "__main__":
    main()
