"""Medians and spreads over repetitions, and the figures derived from them.

Medians are over repetitions; the spread kept is the minimum and maximum. Ratios between variants
are ratios of medians measured in the same run.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from .spec import Spec, latencies, list_schedule_makespan

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

Row = dict[str, Any]


def stats(values: Iterable[float]) -> dict[str, float]:
    """Median, minimum and maximum."""
    xs = sorted(values)
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1]}


def _metric_fns() -> dict[str, Callable[[Row], float]]:
    return {
        "wall_s": lambda r: float(r["wall_s"]),
        "cpu_s": lambda r: float(r["cpu_s"]),
        "us_per_task": lambda r: r["wall_s"] / r["spec"]["n"] * 1e6,
        "cpu_us_per_task": lambda r: r["cpu_s"] / r["spec"]["n"] * 1e6,
        "throughput": lambda r: r["spec"]["n"] / r["wall_s"],
        "peak_rss_mib": lambda r: r["peak_rss_kb"] / 1024,
        "bytes_per_task": lambda r: (
            (r["peak_rss_kb"] - r["baseline_rss_kb"]) * 1024 / r["spec"]["n"]
        ),
    }


def summarize(runs: list[Row]) -> list[Row]:
    """One row per `Spec.key` (scenario, variant, sizes, loop): medians and spreads over repetitions."""
    groups: dict[tuple[Any, ...], list[Row]] = defaultdict(list)
    order: list[tuple[Any, ...]] = []
    for run in runs:
        key = Spec(**run["spec"]).key()
        if key not in groups:
            order.append(key)
        if "error" not in run:
            groups[key].append(run)
    rows: list[Row] = []
    for key in order:
        ok = groups[key]
        spec = Spec(**next(r["spec"] for r in runs if Spec(**r["spec"]).key() == key))
        row: Row = {
            "scenario": spec.scenario,
            "variant": spec.variant,
            "n": spec.n,
            "limit": spec.limit,
            "loop": spec.loop,
            "kinds": spec.kinds,
            "agents": spec.agents,
            "spec": json.loads(spec.to_json()),
            "reps": len(ok),
            "failed": sum(1 for r in runs if "error" in r and Spec(**r["spec"]).key() == key),
        }
        if ok:
            for name, fn in _metric_fns().items():
                row[name] = stats(fn(r) for r in ok)
            _add_extras(row, spec, ok)
        rows.append(row)
    _add_derived(rows)
    return rows


def _add_extras(row: Row, spec: Spec, ok: list[Row]) -> None:
    extras = [r["extra"] for r in ok]
    if "throughput_ratio" in extras[0]:  # scenario 9: Claude calls under a budget
        for name in ("throughput_ratio", "rate_limited", "virtual_s", "smooth_ideal_s"):
            row[name] = stats(float(e[name]) for e in extras)
    if "events" in extras[0]:
        row["events"] = stats(float(e["events"]) for e in extras)
    if "transitions" in extras[0]:  # scenario 10: store transitions over the run's own time
        row["run_s"] = stats(e["run_s"] for e in extras)
        row["transitions"] = extras[0]["transitions"]
        row["transitions_per_s"] = stats(e["transitions"] / e["run_s"] for e in extras)
    if "tasks_per_s" in extras[0]:  # scenarios 10 and 12: worker processes
        row["run_s"] = stats(e["run_s"] for e in extras)
        row["tasks_per_s"] = stats(e["tasks_per_s"] for e in extras)
        row["workers"] = extras[0]["workers"]
        for name in ("admit_s", "last_end_s", "by_coordinator"):  # scenario 12: orchestra
            if name in extras[0]:
                row[name] = stats(float(e[name]) for e in extras)
    if "p50_ms" in extras[0]:  # scenario 12: submit-to-first-claim latency
        for name in ("p50_ms", "p95_ms", "max_ms", "back_p50_ms", "back_p95_ms"):
            row[name] = stats(e[name] for e in extras)
        row["samples"] = extras[0]["samples"]
    if "sse_p50_ms" in extras[0]:  # scenario 13: an event's time to an SSE client
        for name in ("sse_p50_ms", "sse_p95_ms", "sse_max_ms", "admitted_p50_ms",
                     "admitted_p95_ms", "transitions_per_s", "late"):  # fmt: skip
            row[name] = stats(float(e[name]) for e in extras)
        row["samples"] = extras[0]["samples"]
        if all("page_p95_ms" in e for e in extras):  # and to the dashboard page (Chromium)
            for name in ("page_p50_ms", "page_p95_ms"):
                row[name] = stats(float(e[name]) for e in extras)
    if "takeover_s" in extras[0]:  # scenario 12: a standby taking over a killed coordinator
        row["takeover_s"] = stats(e["takeover_s"] for e in extras)
        row["lease_s"] = extras[0]["lease_s"]
    if "first_attempt_s" in extras[0]:  # scenario 10: a run resumed
        row["run_s"] = stats(e["run_s"] for e in extras)
        row["first_attempt_s"] = stats(e["first_attempt_s"] for e in extras)
        row["resumed"] = extras[0]["resumed"]
        row["executed"] = extras[0]["executed"]
    if "breaker_opens" in extras[0]:  # scenario 11: failures
        for name in ("succeeded", "failed", "attempts", "calls", "breaker_opens", "probes"):
            row[name] = stats(float(e[name]) for e in extras)
        for name in ("max_attempts", "backoff_bound_s", "task_bound_s", "outage_s"):
            row[name] = extras[0][name]
        # A bound that depends on how long a repetition lasted: its tightest.
        for name in ("time_bound_s", "in_flight_bound", "probes_bound", "calls_bound"):
            if name in extras[0]:
                row[name] = min(e[name] for e in extras)
    if "slice_s" in extras[0]:
        size = extras[0]["slice"]
        n_slices = min(len(e["slice_s"]) for e in extras)
        row["slice"] = size
        row["slice_throughput"] = [
            stats(size / e["slice_s"][i] for e in extras) for i in range(n_slices)
        ]
        row["slice_peak_rss_mib"] = [
            stats(e["slice_peak_rss_kb"][i] / 1024 for e in extras) for i in range(n_slices)
        ]
        if "slice_rss_kb" in extras[0]:
            row["slice_rss_mib"] = [
                stats(e["slice_rss_kb"][i] / 1024 for e in extras) for i in range(n_slices)
            ]
            # "The last million" of a 4,000,000-task run: the RSS its last quarter adds.
            quarter = spec.n // 4 // size if size else 0
            if quarter and n_slices == spec.n // size and n_slices > quarter:
                row["rss_last_quarter_mib"] = stats(
                    (e["slice_rss_kb"][-1] - e["slice_rss_kb"][-1 - quarter]) / 1024 for e in extras
                )


def find(rows: list[Row], **match: Any) -> Row | None:
    """The first measured row whose fields equal ``match``."""
    for row in rows:
        if all(row.get(k) == v for k, v in match.items()) and "wall_s" in row:
            return row
    return None


def median(row: Row | None, metric: str = "wall_s") -> float | None:
    """The row's median of ``metric``, or None when the row or the metric is missing."""
    if row is None or metric not in row:
        return None
    value: float = row[metric]["median"]
    return value


def _add_derived(rows: list[Row]) -> None:
    for row in rows:
        if "wall_s" not in row:
            continue
        spec = Spec(**row["spec"])
        wall = row["wall_s"]
        if spec.scenario == "speedup":
            lat = latencies(spec)
            schedule = list_schedule_makespan(lat, spec.limit)
            nominal = math.ceil(spec.n / spec.limit) * spec.latency
            row["ideal_nominal_s"] = nominal
            row["ideal_schedule_s"] = schedule
            row["efficiency_nominal"] = nominal / wall["median"]
            row["efficiency_schedule"] = schedule / wall["median"]
            row["achievable_speedup"] = sum(lat) / schedule
            sequential = median(
                find(rows, scenario="speedup", variant=spec.variant, n=spec.n, limit=1)
            )
            if sequential is not None:
                row["speedup"] = {
                    "median": sequential / wall["median"],
                    "min": sequential / wall["max"],
                    "max": sequential / wall["min"],
                }
                row["speedup_vs_ideal"] = row["speedup"]["median"] / min(spec.n, spec.limit)
        elif spec.scenario == "latency":
            ideal = math.ceil(spec.n / spec.limit) * spec.latency
            row["ideal_s"] = ideal
            row["efficiency"] = {
                "median": ideal / wall["median"],
                "min": ideal / wall["max"],
                "max": ideal / wall["min"],
            }
        if spec.scenario == "dispatch":
            orch = median(
                find(rows, scenario="dispatch", variant="orchestra", n=spec.n, loop=spec.loop)
            )
            if orch is not None:
                row["x_orchestra_time"] = wall["median"] / orch
            orch_cpu = median(
                find(rows, scenario="dispatch", variant="orchestra", n=spec.n, loop=spec.loop),
                "cpu_s",
            )
            if orch_cpu:
                row["x_orchestra_cpu"] = row["cpu_s"]["median"] / orch_cpu
        if spec.scenario == "latency" and spec.variant == "orchestra_sqlite":
            memory = median(find(rows, scenario="latency", variant="orchestra"))
            if memory is not None:
                row["x_memory_store"] = wall["median"] / memory
        if spec.scenario == "durable" and spec.variant in ("sqlite_noop", "sqlite_retry"):
            twin = spec.variant.replace("sqlite", "memory")
            memory = median(find(rows, scenario="durable", variant=twin, n=spec.n), "run_s")
            if memory is not None:
                row["x_memory_store"] = row["run_s"]["median"] / memory
        if spec.scenario == "postgres" and "tasks_per_s" in row:
            # Read against the raw floor and pgqueuer with as many processes, in the same run.
            workers = row["workers"]
            rate = row["tasks_per_s"]["median"]
            for peer in ("pg_raw", "pgqueuer"):
                other = median(
                    find(rows, scenario="postgres", variant=f"{peer}_{workers}"), "tasks_per_s"
                )
                if other:
                    row[f"x_{peer.removeprefix('pg_')}"] = rate / other
        if spec.scenario == "service" and spec.variant.startswith("svc_http_"):
            # Read against the database workers of as many processes, in the same run.
            workers = row["workers"]
            db = median(find(rows, scenario="service", variant=f"svc_db_{workers}"), "tasks_per_s")
            if db and "tasks_per_s" in row:
                row["x_db"] = row["tasks_per_s"]["median"] / db
        if spec.scenario == "failures" and spec.variant != "clean":
            # Read against the clean run: the buggy minority's target, the outage's time.
            clean = median(find(rows, scenario="failures", variant="clean"))
            if clean is not None:
                row["clean_s"] = clean
                if spec.variant == "buggy":  # the clean run plus the longest retry backoff
                    row["x_clean_plus_backoff"] = wall["median"] / (clean + row["backoff_bound_s"])
        if spec.scenario == "memory":
            gather = median(find(rows, scenario="memory", variant="gather"), "bytes_per_task")
            if gather:
                row["x_gather_bytes"] = row["bytes_per_task"]["median"] / gather
        if spec.scenario == "kinds":
            one = find(rows, scenario="kinds", n=spec.n, loop=spec.loop, kinds=1, agents=1)
            if one is not None:
                row["x_one_kind"] = wall["median"] / one["wall_s"]["median"]
                row["x_one_kind_cpu"] = row["cpu_s"]["median"] / one["cpu_s"]["median"]
        if spec.scenario == "features":
            plain = median(find(rows, scenario="features", variant="orchestra_plain", n=spec.n))
            plain_cpu = median(
                find(rows, scenario="features", variant="orchestra_plain", n=spec.n), "cpu_s"
            )
            if plain_cpu is not None:
                row["cpu_overhead_us_per_task"] = (
                    (row["cpu_s"]["median"] - plain_cpu) / spec.n * 1e6
                )
            if plain is not None:
                row["overhead_us_per_task"] = (wall["median"] - plain) / spec.n * 1e6
                row["overhead_relative"] = wall["median"] / plain - 1


def num(x: float) -> str:
    """Three significant figures, thousands separated from 100 up."""
    if x == 0:
        return "0"
    a = abs(x)
    if a >= 100:
        return f"{x:,.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"
