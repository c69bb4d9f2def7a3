"""What watching a run costs: `snapshot(run)` on a run with 1,000,000 admitted tasks, and the
meter's share of a task's end.

    python -m benchmarks.status [N]

The run is real: N tasks admitted in one list, 100 of them running on an agent that waits until
released, the rest queued. The snapshot is polled while it is so (a live view polls ~10x a second),
then every task is let go and the run ends. Reported, never asserted.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
import timeit

from orchestra import Context, Orchestrator, Task, agent
from orchestra._core._report import Report
from orchestra._core._status import snapshot
from orchestra._record import Record
from orchestra._task import SUCCEEDED


def meter_cost(n: int = 200_000) -> float:
    """ns per `Report.finished` (a succeeded task with a duration), against an empty call."""
    records = []
    for i in range(n):
        record = Record(Task("work", i), i, None)
        record.status = SUCCEEDED
        record.agent = "w"
        record.started, record.finished = i * 1e-3, i * 1e-3 + 5e-4
        records.append(record)
    meter = Report()

    def noop(record: Record) -> None:
        return None

    def metered() -> None:
        for r in records:
            meter.finished(r)

    def bare() -> None:
        for r in records:
            noop(r)

    full = min(timeit.repeat(metered, number=1, repeat=5))
    base = min(timeit.repeat(bare, number=1, repeat=5))
    return (full - base) / n * 1e9


async def snapshot_cost(n: int) -> tuple[float, float, int]:
    release = asyncio.Event()

    @agent(kinds=["a", "b", "c"], concurrency=100)
    async def held(task: Task, ctx: Context) -> None:
        await release.wait()

    kinds = ("a", "b", "c")
    async with Orchestrator(agents=[held], concurrency=100) as orch:
        tasks = [Task(kinds[i % 3], i, priority=i % 5) for i in range(n)]
        running = asyncio.ensure_future(orch.run(tasks=tasks))
        while not orch._runs or orch._runs[0].dispatcher.running < 100:  # noqa: ASYNC110 (a poll: nothing signals it)
            await asyncio.sleep(0.01)
        run = orch._runs[0]
        times = []
        for _ in range(200):
            t = time.perf_counter()
            status = snapshot(run)
            times.append(time.perf_counter() - t)
        release.set()
        await running
    return statistics.median(times) * 1e6, max(times) * 1e6, status.total


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    median, worst, total = asyncio.run(snapshot_cost(n))
    print(
        f"| snapshot of a run with {total:,} admitted tasks | {median:.0f} µs median, {worst:.0f} µs max (200 polls) |"
    )
    print(f"| Report.finished per ended task | {meter_cost():.0f} ns over an empty call |")


if __name__ == "__main__":
    main()
