"""The bundled demo that `orchestra demo` runs: examples/quickstart.py, shipped in the package.

Runs with no API key. Four kinds of agents with realistic latencies: `split` turns a contract into
clauses (spawning one `research` task per clause), `research` assesses a clause, `summarize` waits for
every clause of its contract, `verify` checks the summary. One research agent is rate limited at
first and another goes down mid-run: retries and the fallback chain carry its tasks.

Shipped in the package so that an install can run it; examples/quickstart.py runs it from a
checkout. It prints its report to stdout: it is a program, run by the `orchestra` command, not
library code.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .. import Context, Orchestrator, RetryPolicy, RunResult, Task, Verdict, agent

Runner = Callable[[Orchestrator, Any], Awaitable[RunResult]]
"""How `main` runs one orchestrator over its input: `Orchestrator.run` by default; the `orchestra`
command passes its own (a live view, keys to pause and cancel)."""

RNG = random.Random(7)
CONTRACTS = [
    {
        "id": f"contract-{n}",
        "urgent": n % 3 == 0,
        "clauses": [f"clause {n}.{i}: the party shall ..." for i in range(RNG.randint(3, 6))],
    }
    for n in range(8)
]


async def latency(mean: float) -> None:
    await asyncio.sleep(max(0.001, RNG.gauss(mean, mean / 5)))


@agent(kinds=["split"])
async def splitter(task: Task, ctx: Context) -> int:
    await latency(0.03)
    for i, text in enumerate(task.payload["clauses"]):
        ctx.spawn(
            Task(
                "research",
                {"text": text},
                id=f"{task.id}/c{i}",
                tags=[task.id],
                priority=task.priority,
            )
        )
    return len(task.payload["clauses"])


class Researcher:
    """A research agent; `down` makes it fail from its n-th call on (a crash mid-run)."""

    def __init__(self, name: str, *, down_after: int | None = None, rate_limited: int = 0) -> None:
        self.name = name
        self.kinds = ["research"]
        self.concurrency = 6
        self.down_after = down_after
        self.rate_limited = rate_limited
        self.calls = 0

    async def __call__(self, task: Task, ctx: Context) -> dict[str, Any]:
        self.calls += 1
        await latency(0.08)
        if self.calls <= self.rate_limited:
            from .. import RetryableError

            raise RetryableError("429 rate limited", retry_after=0.05)
        if self.down_after is not None and self.calls > self.down_after:
            raise ConnectionError(f"{self.name} is down")
        risk = ("low", "medium", "high")[hash(task.payload["text"]) % 3]
        return {"clause": task.payload["text"], "risk": risk, "by": self.name}


@agent(kinds=["summarize"])
async def summarizer(task: Task, ctx: Context) -> dict[str, Any]:
    await latency(0.12)
    clauses = [out for tid, out in sorted(ctx.deps.items()) if "/" in tid]
    high = [c["clause"] for c in clauses if c["risk"] == "high"]
    return {"contract": task.payload, "clauses": len(clauses), "high_risk": high}


@agent(kinds=["verify"])
async def verifier(task: Task, ctx: Context) -> bool:
    await latency(0.05)
    summary: dict[str, Any] = ctx.deps[f"{task.payload}/summary"]
    return bool(summary["clauses"] > 0)


def check_summary(task: Task, output: Any) -> Verdict:
    return Verdict(passed=output["clauses"] > 0, feedback="a summary must cover its clauses")


def decompose(contracts: list[dict[str, Any]]) -> list[Task]:
    tasks = []
    for c in contracts:
        prio = 0 if c["urgent"] else 5
        cid = c["id"]
        tasks += [
            Task("split", c, id=cid, priority=prio),
            Task(
                "summarize",
                cid,
                id=f"{cid}/summary",
                depends_on=[cid],
                depends_on_tags=[cid],
                priority=prio,
            ),
            Task(
                "verify",
                cid,
                id=f"{cid}/verify",
                depends_on=[f"{cid}/summary"],
                priority=prio,
                critical=True,
            ),
        ]
    return tasks


def build(concurrency: int, *, faults: bool) -> Orchestrator:
    """The contract pipeline with `concurrency` slots; with `faults`, one research agent is rate
    limited at first and another goes down after its fourth call."""
    research = [
        Researcher("research-a", rate_limited=2 if faults else 0),
        Researcher("research-b", down_after=4 if faults else None),
        Researcher("research-c"),
    ]
    return Orchestrator(
        agents=[splitter, *research, summarizer, verifier],
        concurrency=concurrency,
        decomposer=decompose,
        retry=RetryPolicy(max_attempts=2, base=0.02, cap=0.5),
        verify={"summarize": check_summary},
        success_threshold=0.9,
        seed=1,
    )


async def analyse(orch: Orchestrator, run: Runner) -> tuple[RunResult, float]:
    start = time.perf_counter()
    result = await run(orch, CONTRACTS)
    return result, time.perf_counter() - start


def show(label: str, result: RunResult, seconds: float) -> None:
    m = result.metadata
    print(f"\n== {label}: {result.status} in {seconds:.2f}s ==")
    print(
        f"tasks {m.total} {m.counts}  attempts {m.attempts}  retries {m.retries}  fallbacks {m.fallbacks}"
    )
    print(f"peak concurrency {m.peak_concurrency}  tasks per agent {m.tasks_per_agent}")
    for kind, t in m.time_per_kind.items():
        print(
            f"  {kind:<10} n={t.count:<3} mean {t.mean * 1000:6.1f} ms  p95 {t.p95 * 1000:6.1f} ms"
        )
    for err in result.errors:
        print(f"  error {err.task_id}: {err.message} -> {err.remediation}")


async def default_run(orch: Orchestrator, contracts: Any) -> RunResult:
    return await orch.run(contracts)


async def main(run: Runner = default_run) -> RunResult:
    """Analyse the contracts sequentially, then in parallel with faults, print both and the speed-up;
    return the parallel run's result (or the sequential one's, when it was stopped)."""
    sequential, t_seq = await analyse(build(1, faults=False), run)
    show("sequential (concurrency 1)", sequential, t_seq)
    if sequential.status == "cancelled":
        # Stopped (Ctrl-C, SIGTERM, the s key): the user asked the demo to end, not to go on
        # with the second run and compare it with a half-done first one.
        return sequential
    parallel, t_par = await analyse(build(20, faults=True), run)
    show("parallel (concurrency 20, an agent rate limited, another down mid-run)", parallel, t_par)
    summary = parallel.data["contract-0/summary"]
    print(f"\ncontract-0: {summary['clauses']} clauses, high risk: {summary['high_risk']}")
    print(
        f"\nspeed-up: {t_seq / t_par:.1f}x  (same {parallel.metadata.total} tasks, same answers: "
        f"{sequential.data.keys() == parallel.data.keys()})"
    )
    return parallel


if __name__ == "__main__":
    asyncio.run(main())
