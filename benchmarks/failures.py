"""Scenario 11, failures (issue 24): what a buggy minority, an outage and an agent down for good
cost a run, with orchestra's default policies (`RetryPolicy()`, `BreakerPolicy()`) in real time.

Every variant runs ``spec.n`` tasks of one kind on one agent that sleeps ``spec.latency`` and
returns (or raises), under ``concurrency=spec.limit``:

- ``clean``: nothing fails; the reference the others are read against.
- ``buggy``: `BUGGY` tasks, spread evenly, raise a `ValueError` after their latency on every
  attempt: a bug in the agent's code, which no breaker counts. They fail after their attempts;
  the run should end within twice the clean run's time plus their retry backoff.
- ``always_bug``: every call raises a `ValueError` (a kind whose agent is broken): every task
  fails after its attempts, in seconds, and the breaker never opens.
- ``outage_3s``: ``simulate_agent_failure(orch, agent, mode="error", duration=OUTAGE_S)`` just
  before the run: connection errors for three seconds, then the agent is back. The breaker opens,
  probes, closes; within the retry budget nothing is lost.
- ``down_for_good``: every call raises a `ConnectionError` after its latency. The run must end in
  bounded time, with calls bounded by the first attempts in flight, their retries and one probe
  per cool-down.

Each returns its counts (succeeded, failed, attempts, the agent's calls, breaker opens and probes
from `BreakerChanged` events) and the bounds computed from the policies the run used, so the
targets (`targets._failures`) are read against numbers measured in the same child.

``spec.time_scale`` scales the retry backoff, the breaker's cool-downs and window, and the outage:
1 runs the defaults as a user gets them (no policy passed); the smoke's smaller value runs the
same code paths in a fraction of the time. The child's warm-up (its no-op spec of the variant)
runs the clean variant: it pays the imports and first calls without seconds of outage.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    from orchestra import BreakerPolicy, RetryPolicy

    from .spec import Spec

    Workload = Callable[[], Coroutine[Any, Any, dict[str, Any]]]

#: How many tasks of the ``buggy`` variant raise a bug.
BUGGY = 11
#: How long ``outage_3s`` takes its agent down, in seconds (times ``spec.time_scale``).
OUTAGE_S = 3.0
VARIANTS = ("clean", "buggy", "always_bug", "outage_3s", "down_for_good")


def buggy_tasks(n: int) -> frozenset[int]:
    """The payloads of the ``buggy`` variant's tasks that raise: `BUGGY` of them, spread evenly
    (fewer in a run under ten times that, such as the smoke's)."""
    return frozenset(range(0, n, max(n // BUGGY, 10))[:BUGGY])


def policies(scale: float) -> tuple[RetryPolicy, BreakerPolicy]:
    """orchestra's default retry and breaker policies, their times multiplied by ``scale``."""
    from orchestra import BreakerPolicy, RetryPolicy

    retry, breaker = RetryPolicy(), BreakerPolicy()
    if scale == 1:
        return retry, breaker
    return (
        RetryPolicy(
            max_attempts=retry.max_attempts,
            base=retry.base * scale,
            cap=retry.cap * scale,
            jitter=retry.jitter,
        ),
        BreakerPolicy(
            failure_rate=breaker.failure_rate,
            min_calls=breaker.min_calls,
            window=breaker.window * scale,
            cooldown=breaker.cooldown * scale,
            max_cooldown=breaker.longest * scale,
        ),
    )


def backoff_bound(retry: RetryPolicy) -> float:
    """The longest a task can wait between its attempts on one agent: every backoff at its
    largest (full jitter draws from [0, that])."""
    return sum(min(retry.cap, retry.base * 2.0**n) for n in range(retry.max_attempts - 1))


def cooldowns(breaker: BreakerPolicy, count: int) -> list[float]:
    """The first ``count`` cool-downs of a breaker whose probes keep failing."""
    out, cooldown = [], breaker.cooldown
    for _ in range(count):
        out.append(cooldown)
        cooldown = min(cooldown * 2, breaker.longest)
    return out


def probes_within(breaker: BreakerPolicy, elapsed: float) -> int:
    """How many probes a breaker open for ``elapsed`` seconds can let through: one per cool-down
    that ended by then."""
    count, at, cooldown = 0, 0.0, breaker.cooldown
    while cooldown > 0 and at + cooldown <= elapsed:
        at += cooldown
        count += 1
        cooldown = min(cooldown * 2, breaker.longest)
    return count


def bounds(
    spec: Spec, variant: str, retry: RetryPolicy, breaker: BreakerPolicy, elapsed: float
) -> dict[str, Any]:
    """The bounds the targets read, from the policies the run used (see benchmarks/README.md)."""
    attempts = retry.max_attempts
    backoff = backoff_bound(retry)
    out: dict[str, Any] = {
        "max_attempts": attempts,
        "backoff_bound_s": backoff,
        # One task alone, every attempt and every backoff at its longest.
        "task_bound_s": attempts * spec.latency + backoff,
    }
    if variant == "down_for_good":
        # A task waiting for the agent is charged one attempt per failed probe: it fails after
        # `max_attempts` cool-downs (1 + 2 + 4 s with the defaults); plus a backoff and the calls.
        out["time_bound_s"] = (
            sum(cooldowns(breaker, attempts)) + backoff + (attempts + 1) * spec.latency
        )
        # Calls that can start before the breaker opens: the limit's worth, plus one for each
        # slot a failure frees before the `min_calls`-th failure opens it; each of those tasks
        # may retry; then one probe per cool-down the run lasted.
        in_flight = min(spec.n, spec.limit + breaker.min_calls - 1)
        probes = probes_within(breaker, elapsed)
        out.update(
            in_flight_bound=in_flight,
            probes_bound=probes,
            calls_bound=in_flight * attempts + probes,
        )
    return out


def failures(spec: Spec) -> Workload:
    """Scenario 11's variant ``spec.variant`` (see the module's docstring)."""
    from orchestra import Orchestrator, Task, agent
    from orchestra.events import BreakerChanged
    from orchestra.testing import simulate_agent_failure

    variant = spec.variant if spec.work == "sleep" else "clean"  # the warm-up: see the docstring
    if variant not in VARIANTS:
        raise ValueError(f"unknown failures variant {variant!r}")
    n, latency, scale = spec.n, spec.latency, spec.time_scale
    retry, breaker = policies(scale)
    options: dict[str, Any] = {} if scale == 1 else {"retry": retry, "breaker": breaker}
    buggy = buggy_tasks(n) if variant == "buggy" else frozenset()
    calls = 0

    @agent(kinds=["work"], name="work")
    async def work(task: Any, ctx: Any) -> int:
        nonlocal calls
        calls += 1
        await asyncio.sleep(latency)
        if variant == "always_bug" or task.payload in buggy:
            raise ValueError(f"a bug in the agent's code, on payload {task.payload}")
        if variant == "down_for_good":
            raise ConnectionError("the service behind the agent is down")
        return int(task.payload)

    async def run() -> dict[str, Any]:
        breaker_states: list[str] = []

        def on_change(event: Any) -> None:
            breaker_states.append(event.state)

        start = time.perf_counter()
        async with Orchestrator(agents=[work], concurrency=spec.limit, **options) as orch:
            orch.subscribe(on_change, BreakerChanged)
            if variant == "outage_3s":
                simulate_agent_failure(orch, "work", mode="error", duration=OUTAGE_S * scale)
            result = await orch.run(tasks=[Task("work", i) for i in range(n)])
        elapsed = time.perf_counter() - start
        meta = result.metadata
        succeeded, failed = meta.counts.get("succeeded", 0), meta.counts.get("failed", 0)
        out: dict[str, Any] = {
            "status": str(result.status),
            "completed": succeeded + failed,
            "succeeded": succeeded,
            "failed": failed,
            "attempts": meta.attempts,
            "calls": calls,
            "breaker_opens": breaker_states.count("open"),
            "probes": breaker_states.count("half_open"),
            "outage_s": OUTAGE_S * scale if variant == "outage_3s" else 0.0,
            **bounds(spec, variant, retry, breaker, elapsed),
        }
        expected_failed = {"clean": 0, "buggy": len(buggy), "outage_3s": None}.get(variant, n)
        if expected_failed is not None and failed != expected_failed:
            # Not a missed target: the workload did not do what the row says it measures.
            out["error"] = f"{failed} tasks failed, expected {expected_failed}"
        return out

    return run
