"""Write a run's report: ``latest.json``, ``latest.md``, the PNG plots and the README section.

    python -m benchmarks.report [DIR]     # redraw DIR/latest.md and the plots from DIR/latest.json

The figures come from `summary` (medians, spreads, derived ratios) and `targets`; the tables here
show them with their spread, median [min-max] over repetitions.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from .plots import plots
from .summary import Row, num, summarize
from .targets import targets

README_START = "<!-- benchmark-results:start -->"
README_END = "<!-- benchmark-results:end -->"


# --------------------------------------------------------------------------- markdown


def _spread(s: dict[str, float]) -> str:
    return f"{num(s['median'])} [{num(s['min'])}-{num(s['max'])}]"


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return lines


def machine_line(results: Row) -> str:
    m = results["machine"]
    mem = f", {m['memory_bytes'] / 2**30:.1f} GiB RAM" if m.get("memory_bytes") else ""
    libs = ", ".join(f"{k} {v}" for k, v in m["libraries"].items() if v)
    rev = f" (git {m['git_revision']})" if m.get("git_revision") else ""
    if m.get("orchestra_source_sha256"):
        rev += f", orchestra sources sha256 {m['orchestra_source_sha256']}"
    return (
        f"**Machine:** {m['cpu']}, {m['cores']} cores{mem}; {m['platform']}; {m['python']}. "
        f"**Versions:** {libs}{rev}."
    )


def _load_line(results: Row) -> list[str]:
    loads = [r["loadavg_1m"] for r in results["runs"] if "loadavg_1m" in r]
    if not loads:
        return []
    cores = results["machine"].get("cores") or 1
    busy = sum(1 for x in loads if x > cores)
    return [
        f"Load average (1 min) when a child started: median {statistics.median(loads):.2f}, "
        f"max {max(loads):.2f} on {cores} cores (the suite itself accounts for about 1); "
        f"{busy} of {len(loads)} runs started above {cores}, i.e. with other work competing for "
        "the cores. Spreads widen with it.",
        "",
    ]


def _rows(summary: list[Row], scenario: str) -> list[Row]:
    return [r for r in summary if r["scenario"] == scenario]


def _failed_cell(row: Row) -> str:
    return f"failed ({row['failed']} runs)"


def markdown(
    results: Row,
    images: list[str],
    image_prefix: str = "",
    heading: str = "#",
    title: str = "orchestra benchmarks",
) -> str:
    summary: list[Row] = results["summary"]
    h2 = heading + "#"
    reps = results["reps"]
    lines = [
        f"{heading} {title}",
        "",
        f"Generated {results['generated']}{' (smoke size)' if results['smoke'] else ''} by "
        f"`python -m benchmarks` in {results['duration_s']:.0f} s: each variant in its own fresh "
        f"process, variants alternating, {reps} repetition{'s' if reps != 1 else ''} unless noted; "
        "cells show the median [min-max] over repetitions. Wall time is the workload alone "
        "(building the tasks included, interpreter start excluded).",
        "",
        machine_line(results),
        "",
        *_load_line(results),
        f"{h2} Targets",
        "",
    ]
    body = []
    for t in results["targets"]:
        met = "—" if t["met"] is None else ("met" if t["met"] else "**missed**")
        measured = "—" if t["measured"] is None else num(t["measured"])
        body.append([t["target"], t["threshold"], measured, met, t["note"]])
    lines += _table(["target", "threshold", "measured", "result", "note"], body)
    lines.append("")

    rows = _rows(summary, "speedup")
    if rows:
        lines += [f"{h2} {_title(results, 'speedup')}", ""]
        body = []
        for r in rows:
            if "wall_s" not in r:
                body.append([r["variant"], str(r["limit"]), _failed_cell(r), "", "", "", ""])
                continue
            sp = r.get("speedup")
            body.append(
                [
                    r["variant"],
                    str(r["limit"]),
                    _spread(r["wall_s"]),
                    _spread(sp) if sp else "—",
                    num(r["speedup_vs_ideal"]) if sp else "—",
                    num(r["efficiency_nominal"]),
                    num(r["efficiency_schedule"]),
                ]
            )
        lines += _table(
            [
                "variant",
                "limit",
                "wall (s)",
                "speed-up vs limit 1",
                "speed-up / min(N, limit)",
                "efficiency vs ceil(N/limit)·latency",
                "efficiency vs zero-overhead schedule",
            ],
            body,
        )
        lines += [
            "",
            "The zero-overhead schedule starts each task, in order, on the first free slot with the "
            "same seeded latencies: with ± jitter a run cannot end before its slowest task, so it is "
            "the reachable ideal, `ceil(N/limit)·latency` the nominal one.",
            "",
        ]

    rows = _rows(summary, "dispatch")
    if rows:
        lines += [f"{h2} {_title(results, 'dispatch')}", ""]
        body = []
        for r in rows:
            if "wall_s" not in r:
                body.append(
                    [r["loop"], f"{r['n']:,}", r["variant"], _failed_cell(r), "", "", "", ""]
                )
                continue
            x = r.get("x_orchestra_time")
            xc = r.get("x_orchestra_cpu")
            body.append(
                [
                    r["loop"],
                    f"{r['n']:,}",
                    r["variant"] + (f" ({r['reps']} reps)" if r["reps"] != results["reps"] else ""),
                    _spread(r["us_per_task"]),
                    num(r["throughput"]["median"]),
                    "—" if x is None else f"{num(x)}x",
                    _spread(r["cpu_us_per_task"]),
                    "—" if xc is None else f"{num(xc)}x",
                ]
            )
        lines += _table(
            [
                "loop",
                "N",
                "variant",
                "µs per subtask (wall)",
                "subtasks/s",
                "wall vs orchestra",
                "CPU µs per subtask",
                "CPU vs orchestra",
            ],
            body,
        )
        lines += [
            "",
            "CPU time (user + system of the child) is shown beside wall time: for no-op work they "
            "match on an idle machine, and the CPU figure is the one less disturbed when other work "
            "competes for the cores.",
            "",
        ]

    rows = _rows(summary, "latency")
    if rows:
        lines += [f"{h2} {_title(results, 'latency')}", ""]
        body = []
        for r in rows:
            if "wall_s" not in r:
                body.append([r["variant"], _failed_cell(r), ""])
                continue
            body.append([r["variant"], _spread(r["wall_s"]), _spread(r["efficiency"])])
        ideal = next((r["ideal_s"] for r in rows if "ideal_s" in r), None)
        lines += _table(
            ["variant", "wall (s)", f"efficiency (ideal {num(ideal) if ideal else '?'} s)"], body
        )
        lines.append("")
        if any(r["variant"] == "orchestra_sqlite" for r in rows):
            lines += [
                "`orchestra_sqlite` is `orchestra` on a `SQLiteStore` (a new file): what durability "
                "costs a run that waits on its agents.",
                "",
            ]

    rows = _rows(summary, "memory")
    if rows:
        lines += [f"{h2} {_title(results, 'memory')}", ""]
        body = []
        for r in rows:
            if "wall_s" not in r:
                body.append([r["variant"], _failed_cell(r), "", ""])
                continue
            x = r.get("x_gather_bytes")
            body.append(
                [
                    r["variant"],
                    _spread(r["peak_rss_mib"]),
                    _spread(r["bytes_per_task"]),
                    "—" if x is None else f"{num(x)}x",
                ]
            )
        lines += _table(
            ["variant", "peak RSS (MiB)", "bytes per pending subtask", "vs gather"], body
        )
        lines += [
            "",
            "Bytes per pending subtask = (peak RSS - RSS before the workload is built) / N.",
            "",
        ]

    rows = _rows(summary, "million")
    if rows:
        lines += [f"{h2} {_title(results, 'million')}", "", *_million(rows), ""]

    rows = _rows(summary, "features")
    if rows:
        lines += [f"{h2} {_title(results, 'features')}", ""]
        body = []
        for r in rows:
            if "wall_s" not in r:
                body.append([r["variant"], _failed_cell(r), "", "", "", ""])
                continue
            over = r.get("overhead_us_per_task")
            cpu_over = r.get("cpu_overhead_us_per_task")
            rel = r.get("overhead_relative")
            body.append(
                [
                    r["variant"],
                    _spread(r["us_per_task"]),
                    "—" if over is None or r["variant"] == "orchestra_plain" else f"{over:+.2f}",
                    "—"
                    if rel is None or r["variant"] == "orchestra_plain"
                    else f"{rel * 100:+.0f} %",
                    _spread(r["cpu_us_per_task"]),
                    "—"
                    if cpu_over is None or r["variant"] == "orchestra_plain"
                    else f"{cpu_over:+.2f}",
                ]
            )
        lines += _table(
            [
                "variant",
                "µs per task (wall)",
                "overhead µs per task vs plain",
                "relative",
                "CPU µs per task",
                "CPU overhead µs per task",
            ],
            body,
        )
        lines += [
            "",
            "plain: retries off (`RetryPolicy(max_attempts=1)`); each other row adds one feature to "
            "it. retry: `RetryPolicy(max_attempts=3)` (orchestra's default, used in every other "
            "scenario), no failures; subscriber: one callback counting "
            "events; structlog: the `orchestra` logger at INFO, so per-task DEBUG lines are "
            "dropped; verifier: one accepting verifier per kind; prometheus: "
            "`instruments=[PrometheusMetrics(registry=CollectorRegistry())]`; otel: "
            "`instruments=[OpenTelemetryTracing(tracer_provider=TracerProvider())]` (the SDK's, "
            "no exporter: three spans per task built and ended).",
            "",
        ]

    rows = _rows(summary, "kinds")
    if rows:
        lines += [f"{h2} {_title(results, 'kinds')}", "", *_kinds(rows), ""]

    rows = _rows(summary, "claude")
    if rows:
        lines += [f"{h2} {_title(results, 'claude')}", ""]
        body = []
        for r in rows:
            if "throughput_ratio" not in r:
                body.append([r["variant"], _failed_cell(r), "", "", ""])
                continue
            body.append(
                [
                    f"{r['variant']} n={r['n']}",
                    _spread(r["virtual_s"]),
                    _spread(r["smooth_ideal_s"]),
                    _spread(r["throughput_ratio"]),
                    _spread(r["rate_limited"]),
                ]
            )
        lines += _table(
            ["variant", "virtual s", "limit's best (s)", "throughput / limit", "429s"], body
        )
        lines += [
            "",
            "Throughput / limit = the limit's theoretical best (the binding budget's rate, "
            "requests paced evenly, plus one answer's latency) over the run's time, in virtual "
            "time; target >= 0.95 and no 429.",
            "",
        ]

    rows = _rows(summary, "spawn")
    if rows:
        lines += [f"{h2} {_title(results, 'spawn')}", "", *_spawn(rows, results["reps"]), ""]

    rows = _rows(summary, "durable")
    if rows:
        lines += [f"{h2} {_title(results, 'durable')}", "", *_durable(rows), ""]

    rows = _rows(summary, "failures")
    if rows:
        lines += [f"{h2} {_title(results, 'failures')}", "", *_failures(rows), ""]

    rows = _rows(summary, "postgres")
    if rows:
        lines += [f"{h2} {_title(results, 'postgres')}", "", *_postgres(rows), ""]

    rows = _rows(summary, "service")
    if rows:
        lines += [f"{h2} {_title(results, 'service')}", "", *_service(rows), ""]

    for image in images:
        lines += [f"![{Path(image).stem}]({image_prefix}{image})", ""]
    return "\n".join(lines).rstrip() + "\n"


def _million(rows: list[Row]) -> list[str]:
    body = []
    for r in rows:
        if "wall_s" not in r:
            body.append([r["variant"], _failed_cell(r), "", "", ""])
            continue
        growth = r.get("rss_last_quarter_mib")
        body.append(
            [
                r["variant"] + f" ({r['reps']} reps)",
                _spread(r["wall_s"]),
                _spread(r["peak_rss_mib"]),
                num(r["throughput"]["median"]),
                "—" if growth is None else _spread(growth),
            ]
        )
    n = rows[0]["n"]
    lines = _table(
        [
            "variant",
            "wall (s)",
            "peak RSS (MiB)",
            "tasks/s",
            f"RSS added by the last {n // 4:,} tasks (MiB)",
        ],
        body,
    )
    measured = [r for r in rows if r.get("slice_throughput")]
    size = next((r["slice"] for r in measured), 0)
    n_slices = max((len(r["slice_throughput"]) for r in measured), default=0)
    if n_slices:
        header = ["tasks completed"]
        for r in measured:
            header += [f"{r['variant']} tasks/s in slice", f"{r['variant']} RSS (MiB)"]
        slice_body = []
        for i in range(n_slices):
            cells = [f"{(i + 1) * size:,}"]
            for r in measured:
                tp, rss = r["slice_throughput"], r.get("slice_rss_mib") or r["slice_peak_rss_mib"]
                cells += [num(tp[i]["median"]), num(rss[i]["median"])] if i < len(tp) else ["", ""]
            slice_body.append(cells)
        lines += ["", *_table(header, slice_body)]
    lines += [
        "",
        f"Each slice is {size:,} completed tasks; the first includes the orchestrator's start. RSS "
        "is the resident set when the slice ended (`/proc/self/statm`), not the peak. "
        "`worker_stream` is the bare reference: a fixed pool of workers pulling from the same "
        "async generator.",
    ]
    return lines


def _kinds(rows: list[Row]) -> list[str]:
    body = []
    for r in rows:
        k, a = r["kinds"], r["agents"]
        spread = f"{k} kind{'s' if k != 1 else ''} x {a} agent{'s' if a != 1 else ''}"
        if "wall_s" not in r:
            body.append([f"{r['n']:,}", spread, _failed_cell(r), "", "", ""])
            continue
        x, xc = r.get("x_one_kind"), r.get("x_one_kind_cpu")
        body.append(
            [
                f"{r['n']:,}",
                spread,
                _spread(r["us_per_task"]),
                "—" if x is None else f"{num(x)}x",
                _spread(r["cpu_us_per_task"]),
                "—" if xc is None else f"{num(xc)}x",
            ]
        )
    return [
        *_table(
            [
                "N",
                "kinds x agents per kind",
                "µs per task (wall)",
                "vs 1 kind",
                "CPU µs per task",
                "CPU vs 1 kind",
            ],
            body,
        ),
        "",
        "orchestra with its defaults, the same N and global limit; tasks round-robin over the "
        "kinds; several agents of one kind are listed without `fallbacks=` (the least loaded "
        "healthy one is picked, the others are its fallbacks).",
    ]


def _spawn(rows: list[Row], reps: int) -> list[str]:
    body = []
    for r in rows:
        shapes: dict[str, str] = {
            "orchestra_fanout": f"fan-out: one attempt spawns {r['n']:,} children",
            "orchestra_chain": f"chain: each of {r['n']:,} tasks spawns the next",
            "orchestra_group_chain": f"group: {r['n']:,}-member chain in an awaited group",
        }
        what = shapes.get(r["variant"]) or str(r["variant"])
        if r["reps"] != reps:
            what += f" ({r['reps']} reps)"
        if "wall_s" not in r:
            body.append([what, _failed_cell(r), "", "", "", ""])
            continue
        body.append(
            [
                what,
                _spread(r["wall_s"]),
                _spread(r["cpu_s"]),
                _spread(r["us_per_task"]),
                _spread(r["peak_rss_mib"]),
                _spread(r["bytes_per_task"]),
            ]
        )
    return [
        *_table(
            [
                "shape",
                "wall (s)",
                "CPU (s)",
                "µs per child / link / member",
                "peak RSS (MiB)",
                "bytes per task",
            ],
            body,
        ),
        "",
        "Wall time from building the input to the run's result; the parent, or the waiter, is not "
        "counted in the per-task figures. Bytes per task = (peak RSS - RSS before the workload) / N.",
    ]


def _durable(rows: list[Row]) -> list[str]:
    body = []
    resumed = None
    workers = []
    for r in rows:
        if r["variant"] == "sqlite_resume":
            resumed = r
            continue
        if r["variant"].startswith("sqlite_workers_"):
            workers.append(r)
            continue
        if "wall_s" not in r:
            body.append([r["variant"], _failed_cell(r), "", "", "", ""])
            continue
        x = r.get("x_memory_store")
        body.append(
            [
                r["variant"],
                _spread(r["run_s"]),
                num(r["transitions"] / r["n"]),
                _spread(r["transitions_per_s"]),
                _spread(r["cpu_us_per_task"]),
                "—" if x is None else f"{num(x)}x",
            ]
        )
    lines = _table(
        [
            "variant",
            "run (s)",
            "transitions per task",
            "transitions/s",
            "CPU µs per task",
            "time vs MemoryStore",
        ],
        body,
    )
    lines += [
        "",
        "Transitions counted: a task's admission, then for each attempt ready, claimed, running and "
        "its end (failed and waiting for the retry, or succeeded): 1 + 4 x attempts, from the "
        "`RunResult`, checked against the file (task rows, attempts, failed-attempt rows). `_retry`: "
        "every fifth task fails its first attempt and is retried at once. Run time: building the "
        "tasks to the `RunResult`, every row committed.",
    ]
    if resumed is not None:
        if "wall_s" not in resumed:
            lines += ["", f"Resume: {_failed_cell(resumed)}."]
        else:
            lines += [
                "",
                *_table(
                    [
                        "tasks",
                        "done before the kill",
                        "to the first new attempt (s)",
                        "to the end (s)",
                    ],
                    [
                        [
                            f"{resumed['n']:,}",
                            f"{resumed['resumed']:,}",
                            _spread(resumed["first_attempt_s"]),
                            _spread(resumed["run_s"]),
                        ]
                    ],
                ),
                "",
                "The file is a real run's, killed with SIGKILL once 90 % of its tasks were committed "
                "as succeeded (the rest blocked in the agent or waiting); the same input is run again "
                "with the same run id, timed from the `orch.run` call.",
            ]
    if workers:
        body = [
            [str(r.get("workers", r["variant"][-1])), f"{r['n']:,}", _failed_cell(r), ""]
            if "wall_s" not in r
            else [
                str(r["workers"]),
                f"{r['n']:,}",
                _spread(r["run_s"]),
                _spread(r["tasks_per_s"]),
            ]
            for r in workers
        ]
        lines += [
            "",
            *_table(
                ["worker processes", "tasks", "run (s)", "tasks/s (claim + run + complete)"],
                body,
            ),
            "",
            "No-op tasks of one run, all claimed, run and completed by `orchestra worker` processes "
            "(started before the clock) for a coordinator that runs none itself; timed from "
            "`start` to the `RunResult` (every completion settled and committed), checked against "
            "the journal (one claim per task).",
        ]
    return lines


_PG_NAMES = {
    "pg_coordinator": "orchestra, the coordinator alone",
    "pg_orchestra": "orchestra (coordinator + `orch.work` processes)",
    "pg_leases": "orchestra's claim/complete statements alone",
    "pg_raw": "raw asyncpg loop (the floor)",
    "pgqueuer": "pgqueuer, batch 100",
    "procrastinate": "procrastinate, concurrency 100 (N / 100)",
}


def _postgres(rows: list[Row]) -> list[str]:
    throughput = [r for r in rows if r["variant"] in _PG_NAMES or r["variant"][-1].isdigit()]
    body = []
    for r in throughput:
        name, _, workers = r["variant"].rpartition("_")
        if r["variant"] == "pg_coordinator":
            name, workers = r["variant"], "0"
        label = _PG_NAMES.get(name, name)
        if "tasks_per_s" not in r:
            body.append([workers, label, f"{r['n']:,}", _failed_cell(r), "", "", "", "", ""])
            continue
        x_raw, x_pgq = r.get("x_raw"), r.get("x_pgqueuer")
        admit, last = r.get("admit_s"), r.get("last_end_s")
        body.append(
            [
                workers,
                label,
                f"{r['n']:,}",
                _spread(r["run_s"]),
                _spread(r["tasks_per_s"]),
                "—" if x_raw is None else f"{num(x_raw)}x",
                "—" if x_pgq is None else f"{num(x_pgq)}x",
                "" if last is None else _spread(last),
                "" if admit is None else _spread(admit),
            ]
        )
    body.sort(key=lambda cells: int(cells[0]))
    lines = _table(
        [
            "processes",
            "contender",
            "tasks",
            "run (s)",
            "tasks/s",
            "vs raw",
            "vs pgqueuer",
            "last end written (s)",
            "admission, untimed (s)",
        ],
        body,
    )
    lines += [
        "",
        "No-op tasks on one embedded PostgreSQL server, durable (`fsync` and "
        "`synchronous_commit` on), a fresh database per measurement, the processes started and "
        "connected before the clock. orchestra: a coordinator admits the run (its admission "
        "reported beside, untimed), then the clock runs from the workers' go to the "
        "coordinator's `RunResult` (every claim leased and fenced by its token, every completion "
        "committed with its dependents settled, every end heard by the coordinator); its own "
        "agent has one slot and takes 10 ms a call, so it runs a handful. The coordinator alone: "
        "its own no-op agent at limit 100 runs them all. Last end written: the latest task's `finished` in the database, from the go (the rest of the run's time is the coordinator hearing the ends and closing the run). The peers: their queue filled untimed, "
        "timed from the go to the last process's end of work.",
    ]
    lat = next((r for r in rows if r["variant"] == "pg_latency"), None)
    if lat is not None:
        lines += [""]
        if "p50_ms" not in lat:
            lines += [f"Latency: {_failed_cell(lat)}."]
        else:
            lines += _table(
                [
                    "samples",
                    "admit to the worker's agent call, p50 (ms)",
                    "p95 (ms)",
                    "max (ms)",
                    "admit to the result heard by the coordinator, p50 (ms)",
                    "p95 (ms)",
                ],
                [
                    [
                        str(lat["samples"]),
                        _spread(lat["p50_ms"]),
                        _spread(lat["p95_ms"]),
                        _spread(lat["max_ms"]),
                        _spread(lat["back_p50_ms"]),
                        _spread(lat["back_p95_ms"]),
                    ]
                ],
            )
            lines += [
                "",
                "One idle worker process (`orch.work`, woken by LISTEN/NOTIFY); the coordinator "
                "streams one task every 25 ms and runs none (paused, its one slot held by a "
                "task of its own). From the input generator handing over the task to the "
                "worker's agent being called (one host, one clock); the first 5 samples dropped.",
            ]
    takeovers = [r for r in rows if r["variant"].startswith("pg_takeover_")]
    if takeovers:
        body = [
            [
                "another host" if r["variant"].endswith("remote") else "same host",
                "" if "lease_s" not in r else num(r["lease_s"]),
                _failed_cell(r) if "takeover_s" not in r else _spread(r["takeover_s"]),
            ]
            for r in takeovers
        ]
        lines += [
            "",
            *_table(["holder", "lease (s)", "kill to the standby's first claim (s)"], body),
            "",
            "A coordinator process runs the run (its agent blocking), a standby process runs the "
            "same `orch.run(..., run_id=...)`; the first is killed with SIGKILL. On the same host "
            "the standby sees the holder's pid gone; as another host (the killed process's "
            "`socket.gethostname()` replaced) it waits for the lease to lapse.",
        ]
    return lines


def _service(rows: list[Row]) -> list[str]:
    body = []
    events = [r for r in rows if r["variant"].startswith("svc_events_sse")]
    rows = [r for r in rows if r not in events]
    if not rows:
        return _service_events(events)[1:]
    for r in sorted(rows, key=lambda r: (r.get("workers", 0), r["variant"])):
        _, path, workers = r["variant"].split("_")
        label = "`--url` (through the service)" if path == "http" else "`--dsn` (on the database)"
        if "tasks_per_s" not in r:
            body.append([workers, label, f"{r['n']:,}", _failed_cell(r), "", ""])
            continue
        x = r.get("x_db")
        body.append(
            [
                workers,
                label,
                f"{r['n']:,}",
                _spread(r["run_s"]),
                _spread(r["tasks_per_s"]),
                "" if x is None else f"{num(x)}x",
            ]
        )
    return [
        *_table(["workers", "path", "tasks", "run (s)", "tasks/s", "vs `--dsn`"], body),
        "",
        "No-op tasks of one run submitted to the service (`POST /api/runs`, untimed), its "
        "coordinator running none of them; the worker processes started and connected before "
        "the clock, which runs from their go to the last one's end of work (the run closed). "
        "The same embedded PostgreSQL server as scenario 12, a fresh database per measurement.",
        *_service_events(events),
    ]


def _service_events(rows: list[Row]) -> list[str]:
    if not rows:
        return []
    body, failed = [], []
    for r in sorted(rows, key=lambda r: r["variant"]):
        store = "SQLite" if r["variant"].endswith("_sqlite") else "PostgreSQL"
        if "sse_p50_ms" not in r:
            failed.append(f"Event to SSE client ({store}): {_failed_cell(r)}.")
            continue
        body.append(
            [
                store,
                f"{r['n']:,}",
                _spread(r["transitions_per_s"]),
                _spread(r["sse_p50_ms"]),
                _spread(r["sse_p95_ms"]),
                _spread(r["sse_max_ms"]),
                _spread(r["admitted_p50_ms"]),
                _spread(r["admitted_p95_ms"]),
                _spread(r["late"]),
                _spread(r["page_p50_ms"]) if "page_p50_ms" in r else "not sampled",
                _spread(r["page_p95_ms"]) if "page_p95_ms" in r else "",
            ]
        )
    table = (
        [
            "",
            *_table(
                [
                    "store",
                    "tasks",
                    "transitions/s",
                    "end to client, p50 (ms)",
                    "p95 (ms)",
                    "max (ms)",
                    "admission to client, p50 (ms)",
                    "p95 (ms)",
                    "told late",
                    "end to the page, p50 (ms)",
                    "p95 (ms)",
                ],
                body,
            ),
        ]
        if body
        else []
    )
    return [
        *table,
        *(line for f in failed for line in ("", f)),
        "",
        "Event to SSE client: the service runs the run itself (30 ms calls, 26 at once) while "
        "an SSE client reads its events; each sample is an event's arrival less its time in "
        "the journal (its transaction's start, no later than its commit; on SQLite the writer's "
        "stamp, before its window's commit). The tasks' ends are the steady stream; their "
        "admissions one burst at the submission; a task's start, read from its row once it "
        "ended, is told late (counted).",
    ]


def _count(s: dict[str, float]) -> str:
    """A count's median, with its range when the repetitions differ."""
    low, mid, high = (f"{s[k]:,.0f}" for k in ("min", "median", "max"))
    return mid if low == high else f"{mid} [{low}-{high}]"


def _failures(rows: list[Row]) -> list[str]:
    shapes = {
        "clean": "nothing fails",
        "buggy": "a buggy minority raises ValueError on every attempt",
        "always_bug": "a kind whose agent always raises ValueError",
        "outage_3s": "the agent down (connection errors), then back",
        "down_for_good": "the agent down for good (ConnectionError)",
    }
    body = []
    for r in rows:
        what = f"`{r['variant']}`: {shapes.get(r['variant'], '')}"
        if "wall_s" not in r:
            body.append([what, f"{r['n']:,}", _failed_cell(r), "", "", "", "", ""])
            continue
        x = r.get("x_clean_plus_backoff")
        body.append(
            [
                what,
                f"{r['n']:,}",
                _spread(r["wall_s"]),
                "—" if x is None else f"{num(x)}x",
                f"{_count(r['succeeded'])} / {_count(r['failed'])}",
                _count(r["calls"]),
                _count(r["attempts"]),
                f"{_count(r['breaker_opens'])} / {_count(r['probes'])}",
            ]
        )
    scale = rows[0]["spec"].get("time_scale", 1.0)
    scaled = "" if scale == 1 else f" (here every time of theirs x {scale:g}, the outage's too)"
    return [
        *_table(
            [
                "variant",
                "tasks",
                "wall (s)",
                "vs clean + retry backoff",
                "succeeded / failed",
                "calls to the agent",
                "`metadata.attempts`",
                "breaker opens / probes",
            ],
            body,
        ),
        "",
        "orchestra with its default policies (`RetryPolicy()`: 3 attempts, backoff 0.5 s doubling, "
        "full jitter, so at most 0.5 + 1.0 s between a task's attempts; `BreakerPolicy()`: "
        f"cool-down 1 s doubling per failed probe){scaled}, one agent sleeping its latency per "
        "call, in real time. `outage_3s` calls `simulate_agent_failure(orch, agent, "
        'mode="error", duration=3)` just before the run: its failed calls never reach the agent, '
        "so they are attempts, not calls. Breaker opens and probes are counted from "
        "`BreakerChanged` events.",
    ]


def _title(results: Row, name: str) -> str:
    for s in results["scenarios"]:
        if s["name"] == name:
            title: str = s["title"]
            return title
    return name


# --------------------------------------------------------------------------- files


def update_readme(readme: Path, section: str) -> None:
    """Replace the text between the README's result markers (appending them if absent)."""
    text = readme.read_text() if readme.exists() else "# orchestra benchmarks\n"
    block = f"{README_START}\n{section}{README_END}"
    if README_START in text and README_END in text:
        head, rest = text.split(README_START, 1)
        _, tail = rest.split(README_END, 1)
        text = head + block + tail
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    readme.write_text(text)


def write_all(
    results: Row, out: Path, *, plots_wanted: bool = True, readme: Path | None = None
) -> list[Path]:
    """Write ``latest.json``, ``latest.md``, the PNGs and (optionally) the README section."""
    out.mkdir(parents=True, exist_ok=True)
    results["summary"] = summarize(results["runs"])
    results["targets"] = targets(results["summary"])
    json_path = out / "latest.json"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    images = plots(results["summary"], out) if plots_wanted else []
    md_path = out / "latest.md"
    md_path.write_text(markdown(results, images))
    paths = [json_path, md_path, *(out / image for image in images)]
    if readme is not None:
        prefix = Path("results") if readme.parent != out else Path()
        rel = out.relative_to(readme.parent) if out.is_relative_to(readme.parent) else prefix
        section = markdown(
            results,
            images,
            image_prefix=f"{rel.as_posix()}/",
            heading="###",
            title=f"Run of {results['generated'][:10]}",
        )
        update_readme(readme, section)
        paths.append(readme)
    return paths


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0]) if args else Path(__file__).resolve().parent / "results"
    results = json.loads((out / "latest.json").read_text())
    default = Path(__file__).resolve().parent / "results"
    full_run = out.resolve() == default and not (results["smoke"] or results.get("only"))
    readme = default.parent / "README.md" if full_run else None
    for path in write_all(results, out, readme=readme):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
