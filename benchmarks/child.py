"""Run exactly one spec in this (fresh) process and print one result line.

    python -m benchmarks.child '<spec as JSON>'

The variant is set up first (imports, agents, latencies), then the event loop is created and a
small untimed warm-up run of the same variant pays for lazy imports and first calls (anyio loads
its asyncio backend on first use, for example). Then the peak RSS so far is taken as the baseline
and the clock runs around the workload alone: not the interpreter start, not the imports, not the
loop's creation, not the warm-up. The last stdout line starting with
``BENCH_RESULT`` carries the record, so whatever else a library prints cannot be mistaken for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import os
import resource
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

from .spec import Spec, as_dict
from .variants import build

if TYPE_CHECKING:
    from collections.abc import Callable

MARKER = "BENCH_RESULT "


def _peak_rss_kb() -> int:
    # ru_maxrss is in KiB on Linux (bytes on macOS; the suite's numbers are taken on Linux).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def loop_factory(loop: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if loop == "asyncio":
        return asyncio.new_event_loop
    if loop == "uvloop":
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
        return factory
    raise ValueError(f"unknown loop {loop!r}")


def warmup_spec(spec: Spec) -> Spec:
    """A small no-op run of the same variant, so lazy imports and first-call costs are paid untimed."""
    n = min(spec.n, 2 * spec.limit, 200)
    return dataclasses.replace(spec, n=n, work="noop", latency=0.0, jitter=0.0, slice=0)


#: Scenarios whose workloads time themselves after their own untimed setup (their processes
#: started and connected, their queues filled): a warm-up would start it all once more.
SELF_TIMED = frozenset({"postgres", "service"})


def measure(spec: Spec) -> dict[str, Any]:
    warmup = None if spec.scenario in SELF_TIMED else build(warmup_spec(spec))
    workload = build(spec)
    # Another process busy on the machine shows here (the suite cannot stop one from running).
    record: dict[str, Any] = {"spec": as_dict(spec), "loadavg_1m": os.getloadavg()[0]}

    async def timed() -> dict[str, Any]:
        record["baseline_rss_kb"] = _peak_rss_kb()
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        extra = await workload()
        wall = time.perf_counter() - start
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        record["wall_s"] = wall
        record["cpu_s"] = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
        return extra

    with asyncio.Runner(loop_factory=loop_factory(spec.loop)) as runner:
        if warmup is not None:
            runner.run(warmup())
        gc.collect()
        record["extra"] = runner.run(timed())
    record["peak_rss_kb"] = _peak_rss_kb()
    completed = record["extra"].get("completed")
    if "error" not in record["extra"] and completed is not None and completed != spec.n:
        record["extra"]["error"] = f"completed {completed} of {spec.n} subtasks"
    return record


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m benchmarks.child '<spec JSON>'", file=sys.stderr)
        return 2
    spec = Spec.from_json(args[0])
    try:
        record = measure(spec)
    except Exception as exc:
        traceback.print_exc()
        record = {"spec": as_dict(spec), "error": f"{type(exc).__name__}: {exc}"}
    if "error" not in record and "error" in record.get("extra", {}):
        record["error"] = record["extra"]["error"]
    print(MARKER + json.dumps(record), flush=True)
    return 1 if "error" in record else 0


if __name__ == "__main__":
    sys.exit(main())
