"""What one child process runs: a `Spec` names the scenario, the variant and its sizes.

The parent builds specs from the plan in `scenarios.py`, hands each one to a fresh
`python -m benchmarks.child` as JSON, and reads back one result line. This module is the
leaf both sides share, so it imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import random
from dataclasses import dataclass
from typing import Any

#: Event loops a spec may ask for.
LOOPS = ("asyncio", "uvloop")


@dataclass(frozen=True, slots=True)
class Spec:
    """One (scenario, variant, parameters) triple: exactly what one child process runs."""

    scenario: str
    variant: str
    n: int
    limit: int
    loop: str = "asyncio"
    #: "noop" (return at once) or "sleep" (await asyncio.sleep(latency ± jitter)).
    work: str = "noop"
    latency: float = 0.0
    jitter: float = 0.0
    #: How many task kinds the work is spread over, round-robin.
    kinds: int = 1
    #: How many orchestra agents serve each kind (no explicit fallback chain).
    agents: int = 1
    #: Streamed runs report throughput per slice of this many completed tasks (0: no slices).
    slice: int = 0
    #: Failure scenarios: the retry backoff, the breaker's cool-downs and the outage are scaled
    #: by this (1: orchestra's defaults, as a user gets them).
    time_scale: float = 1.0
    seed: int = 20240601

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Spec:
        return cls(**json.loads(text))

    def key(self) -> tuple[str, str, int, int, str, int, int]:
        """What repetitions of the same measurement share."""
        return (self.scenario, self.variant, self.n, self.limit, self.loop, self.kinds, self.agents)

    def label(self) -> str:
        spread = ""
        if self.kinds != 1 or self.agents != 1:
            spread = f" kinds={self.kinds} agents/kind={self.agents}"
        return (
            f"{self.scenario}/{self.variant} n={self.n} limit={self.limit} loop={self.loop}{spread}"
        )


def latencies(spec: Spec) -> list[float]:
    """The per-task latencies of a "sleep" workload, seeded so every variant sleeps the same."""
    if spec.jitter == 0:
        return [spec.latency] * spec.n
    rng = random.Random(spec.seed)
    return [spec.latency + rng.uniform(-spec.jitter, spec.jitter) for _ in range(spec.n)]


def list_schedule_makespan(durations: list[float], limit: int) -> float:
    """Wall time of a zero-overhead runtime that starts each task, in order, on the first free slot.

    With jittered latencies this, not ``ceil(N / limit) * latency``, is what a perfect
    dispatcher can reach: at limit >= N the run lasts as long as its slowest task.
    """
    slots = [0.0] * min(limit, max(len(durations), 1))
    for duration in durations:
        heapq.heappush(slots, heapq.heappop(slots) + duration)
    return max(slots)


def as_dict(spec: Spec) -> dict[str, Any]:
    return dataclasses.asdict(spec)
