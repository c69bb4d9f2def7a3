"""What a no-op task costs with none of orchestra's features: the yardstick of the no-op rows of docs/benchmarks.md.

``python -m benchmarks.featureless [N ...]`` times, in this one process, bare ``Semaphore`` +
``gather`` and a loop that does only what any such runtime must: build the caller's `Task`s, give
each a generated id and a ten-field state object in a dict, queue them in a deque, drain the queue
with 100 worker coroutines that await the agent with a reused context, stamp two times, and return
``{id: output}`` in input order. No lease, routing, limit, breaker, counts, percentiles, events or
store: the gap between this and orchestra is what those cost; the gap between this and half of
gather is what is left for them if orchestra is to be twice as fast as gather.

Best of five runs after a warm-up, process time, µs per task. Not part of the suite's table (it is
not a product anybody would use), so it runs on demand.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from collections import deque
from typing import Any

from orchestra import Task

LIMIT = 100


class _State:
    __slots__ = (
        "attempts",
        "finished",
        "id",
        "index",
        "kind",
        "output",
        "state",
        "t_start",
        "task",
        "token",
    )

    def __init__(self, task: Task, index: int, task_id: str) -> None:
        self.task = task
        self.id = task_id
        self.kind = task.kind
        self.index = index
        self.state = "ready"
        self.token = 0
        self.attempts = 0
        self.output: Any = None
        self.t_start: float | None = None
        self.finished: float | None = None


class _Context:
    __slots__ = ("attempt", "state", "task")

    task: Task
    state: _State
    attempt: int


async def _noop(task: Task, ctx: _Context) -> Any:
    return None


async def featureless(n: int) -> int:
    tasks = [Task("k0", i) for i in range(n)]
    queue: deque[_State] = deque()
    states: dict[str, _State] = {}
    for index, task in enumerate(tasks, 1):
        task.id = task_id = f"{task.kind}#{index}"
        state = states[task_id] = _State(task, index, task_id)
        queue.append(state)
    done: list[_State] = []
    agents = {"k0": _noop}
    clock = time.monotonic

    async def worker() -> None:
        ctx = _Context()
        pop = queue.popleft
        while queue:
            state = pop()
            state.state = "running"
            state.token += 1
            state.attempts += 1
            state.t_start = clock()
            ctx.task, ctx.state, ctx.attempt = state.task, state, state.attempts
            state.output = await agents[state.kind](state.task, ctx)
            state.state = "succeeded"
            state.finished = clock()
            done.append(state)

    await asyncio.gather(*[worker() for _ in range(LIMIT)])
    done.sort(key=lambda s: s.index)
    return len({s.id: s.output for s in done})


async def gather(n: int) -> int:
    sem = asyncio.Semaphore(LIMIT)

    async def fn(item: int) -> None:
        return None

    async def limited(item: int) -> None:
        async with sem:
            return await fn(item)

    return len(await asyncio.gather(*[limited(i) for i in range(n)]))


def _best(runner: asyncio.Runner, fn: Any, n: int) -> float:
    runner.run(fn(200))
    best = float("inf")
    for _ in range(5):
        gc.collect()
        start = time.process_time()
        runner.run(fn(n))
        best = min(best, time.process_time() - start)
    return best / n * 1e6


def main(argv: list[str]) -> None:
    for n in [int(a) for a in argv] or [20_000, 100_000]:
        with asyncio.Runner() as runner:
            lean, bare = _best(runner, featureless, n), _best(runner, gather, n)
        print(f"N={n:,}: featureless {lean:.2f} µs per task, gather {bare:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
