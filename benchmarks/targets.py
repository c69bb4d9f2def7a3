"""The targets, checked against the medians of one run: reported, never asserted.

Each is a ratio measured in the same run (orchestra against bare asyncio on the same machine at the
same moment), so a busy machine moves both sides. A target without a threshold (`None`) is reported
with its measurement and no verdict, for the rows the issue lists without a number.
"""

from __future__ import annotations

from .summary import Row, find, median, num

#: Issue 13 (core v2): the no-op dispatch and the spread over kinds and agents.
GATHER_SPEEDUP = 2.0
FLOOR_MAX = 6.0
SPREAD_MAX = 1.3
MEMORY_VS_GATHER = 0.6
STREAM_RSS_GROWTH_MB = 10.0
STREAM_PEAK_MB = 500.0
STREAM_FLAT = 0.9
#: Issue 16 (durable runs): SQLite task transitions per second, and durability's cost when latency-bound.
SQLITE_TRANSITIONS = 20_000
DURABLE_LATENCY_MAX = 1.05
#: Issue 24 (failures): a buggy minority ends within this many times the clean run plus its retry
#: backoff; a kind whose agent always raises within this many times one task's longest path alone.
FAILURES_SLACK = 2.0
#: Issue 26 (PostgreSQL): claim + run + complete with 2 worker processes, against the raw asyncpg
#: floor (and ahead of pgqueuer) in the same run; submit-to-first-claim p50; a standby's take-over
#: within the lease plus this.
PG_TASKS = 20_000
PG_WORKERS = 2
PG_VS_RAW = 0.4
PG_P50_MS = 10.0
PG_TAKEOVER_SLACK_S = 1.0
SVC_VS_DB = 0.5
#: Issue 27: an event reaches an SSE client within this (p95) while the run does ~1,000 transitions/s.
SVC_EVENTS_P95_MS = 500.0


def _target(
    name: str, threshold: str, measured: float | None, ok: bool | None, note: str = ""
) -> Row:
    return {"target": name, "threshold": threshold, "measured": measured, "met": ok, "note": note}


def targets(rows: list[Row]) -> list[Row]:
    """Every target this run has the rows for, in the report's order."""
    return [
        *_peers(rows),
        *_core_dispatch(rows),
        *_kinds(rows),
        *_spawn(rows),
        *_latency(rows),
        *_speedup(rows),
        *_memory(rows),
        *_stream(rows),
        *_claude(rows),
        *_durable(rows),
        *_failures(rows),
        *_postgres(rows),
        *_service(rows),
    ]


def _failures(rows: list[Row]) -> list[Row]:
    """Issue 24: a buggy minority, a kind always failing, an outage, an agent down for good."""
    out: list[Row] = []
    buggy = find(rows, scenario="failures", variant="buggy")
    if buggy is not None and "x_clean_plus_backoff" in buggy:
        x = buggy["x_clean_plus_backoff"]
        out.append(
            _target(
                f"{buggy['failed']['median']:,.0f} buggy tasks of {buggy['n']:,} (ValueError): "
                "time / (clean run + retry backoff)",
                f"≤ {FAILURES_SLACK:g}x",
                x,
                x <= FAILURES_SLACK,
                f"{num(buggy['wall_s']['median'])} s against a clean {num(buggy['clean_s'])} s "
                f"+ at most {num(buggy['backoff_bound_s'])} s of backoff; "
                f"breaker opened {buggy['breaker_opens']['max']:,.0f} times",
            )
        )
    always = find(rows, scenario="failures", variant="always_bug")
    if always is not None:
        wall = always["wall_s"]["median"]
        limit = FAILURES_SLACK * always["task_bound_s"]
        out.append(
            _target(
                f"a kind whose agent always raises a bug ({always['n']:,} tasks): time (s)",
                f"≤ {num(limit)} s",
                wall,
                wall <= limit,
                f"{FAILURES_SLACK:g} x one task alone ({always['max_attempts']} attempts and "
                f"their backoff: {num(always['task_bound_s'])} s); "
                f"{always['calls']['median']:,.0f} calls, "
                f"breaker opened {always['breaker_opens']['max']:,.0f} times",
            )
        )
    outage = find(rows, scenario="failures", variant="outage_3s")
    if outage is not None:
        failed = outage["failed"]["max"]
        what = f"an agent down {num(outage['outage_s'])} s, then back ({outage['n']:,} tasks)"
        out.append(
            _target(
                f"{what}: tasks failed",
                "0",
                failed,
                failed == 0,
                f"max over repetitions; {outage['probes']['median']:,.0f} probes",
            )
        )
        clean = outage.get("clean_s")
        out.append(
            _target(
                f"{what}: time (s)",
                "not set",
                outage["wall_s"]["median"],
                None,
                ""
                if clean is None
                else f"the outage + a clean run: {num(outage['outage_s'] + clean)} s",
            )
        )
    down = find(rows, scenario="failures", variant="down_for_good")
    if down is not None:
        wall = down["wall_s"]["median"]
        what = f"an agent down for good ({down['n']:,} tasks)"
        out.append(
            _target(
                f"{what}: time (s)",
                f"≤ {num(down['time_bound_s'])} s",
                wall,
                wall <= down["time_bound_s"],
                f"{down['max_attempts']} cool-downs (one failed probe each), a backoff and the "
                "calls",
            )
        )
        calls = down["calls"]["max"]
        bound = down["calls_bound"]
        out.append(
            _target(
                f"{what}: calls to the agent",
                f"≤ {bound:,}",
                calls,
                calls <= bound,
                f"max over repetitions; bound: {down['in_flight_bound']} first attempts in flight "
                f"x {down['max_attempts']} attempts + {down['probes_bound']} probes (one per "
                f"cool-down); {down['probes']['median']:,.0f} probes seen",
            )
        )
    return out


def _durable(rows: list[Row]) -> list[Row]:
    """Issue 16: transitions/s on SQLite, durability on the latency-bound run, resume time."""
    out: list[Row] = []
    for variant, what in (("sqlite_noop", "no-op"), ("sqlite_retry", "20 % retried once")):
        row = find(rows, scenario="durable", variant=variant)
        if row is None:
            continue
        rate = row["transitions_per_s"]["median"]
        x = row.get("x_memory_store")
        out.append(
            _target(
                f"SQLite task transitions/s, {what} (N={row['n']:,})",
                f"≥ {SQLITE_TRANSITIONS:,}/s",
                rate,
                rate >= SQLITE_TRANSITIONS,
                f"{num(row['transitions'] / row['n'])} transitions per task; "
                + ("" if x is None else f"{num(x)} x MemoryStore's time"),
            )
        )
    sqlite = find(rows, scenario="latency", variant="orchestra_sqlite")
    if sqlite is not None and "x_memory_store" in sqlite:
        x = sqlite["x_memory_store"]
        out.append(
            _target(
                "durability on the latency-bound run: SQLiteStore time / MemoryStore time",
                f"≤ {DURABLE_LATENCY_MAX:g}x",
                x,
                x <= DURABLE_LATENCY_MAX,
                f"{num(sqlite['wall_s']['median'])} s against "
                f"{num(sqlite['wall_s']['median'] / x)} s",
            )
        )
    resumed = find(rows, scenario="durable", variant="sqlite_resume")
    if resumed is not None:
        n = resumed["n"]
        for metric, what in (
            ("first_attempt_s", "to the first new attempt"),
            ("run_s", "to the end"),
        ):
            out.append(
                _target(
                    f"resume of a {n:,}-task run 90 % done: {what} (s)",
                    "not set",
                    resumed[metric]["median"],
                    None,
                    f"{resumed['resumed']:,} tasks came back done, {resumed['executed']:,} ran",
                )
            )
    return out


def _claude(rows: list[Row]) -> list[Row]:
    """Issue 15: throughput ≥ 0.95 of the budget's best, and no 429 provoked."""
    out: list[Row] = []
    for row in (r for r in rows if r["scenario"] == "claude" and "throughput_ratio" in r):
        ratio = row["throughput_ratio"]["median"]
        limited = row["rate_limited"]["max"]
        n = row["n"]
        out.append(
            _target(f"Claude calls: throughput / limit (N={n:,})", "0.95", ratio, ratio >= 0.95)
        )
        out.append(_target(f"Claude calls: 429s provoked (N={n:,})", "0", limited, limited == 0))
    return out


def _peers(rows: list[Row]) -> list[Row]:
    out: list[Row] = []
    dispatch = [r for r in rows if r["scenario"] == "dispatch" and r["variant"] == "orchestra"]
    langgraph_ns = [
        r["n"] for r in rows if r["scenario"] == "dispatch" and r["variant"] == "langgraph"
    ]
    for orch in dispatch:
        n, loop = orch["n"], orch["loop"]
        o = median(orch)
        for peer, need, label in (
            ("gather", 0.5, "≥ 0.5 x bare Semaphore+gather throughput"),
            ("aiometer", 3.0, "≥ 3 x aiometer throughput"),
            ("anyio", 3.0, "≥ 3 x anyio CapacityLimiter throughput"),
            ("langgraph", 20.0, "≥ 20 x LangGraph Send throughput"),
        ):
            peer_row = find(rows, scenario="dispatch", variant=peer, n=n, loop=loop)
            p = median(peer_row)
            if o is None or p is None:
                continue
            if peer == "langgraph" and n != max(langgraph_ns):
                continue
            ratio = p / o  # throughput ratio orchestra / peer = time ratio peer / orchestra
            pc, oc = median(peer_row, "cpu_s"), median(orch, "cpu_s")
            note = f"CPU-time ratio {num(pc / oc)}" if pc and oc else ""
            out.append(
                _target(f"{label} (N={n:,}, {loop})", f"{need:g}x", ratio, ratio >= need, note)
            )
    return out


def _core_dispatch(rows: list[Row]) -> list[Row]:
    """Issue 13: no-op throughput ≥ 2 x bare gather and ≤ 6 x the worker-queue floor's time."""
    out: list[Row] = []
    for orch in (r for r in rows if r["scenario"] == "dispatch" and r["variant"] == "orchestra"):
        n, loop = orch["n"], orch["loop"]
        o, oc = median(orch), median(orch, "cpu_s")
        floor_row = find(rows, scenario="dispatch", variant="worker_queue", n=n, loop=loop)
        if floor_row is None or o is None:
            continue  # only at the sizes the floor is measured at (20,000 and 100,000)
        gather_row = find(rows, scenario="dispatch", variant="gather", n=n, loop=loop)
        g = median(gather_row)
        if g is not None:
            gc = median(gather_row, "cpu_s")
            out.append(
                _target(
                    f"no-op throughput ≥ {GATHER_SPEEDUP:g} x bare gather (N={n:,}, {loop})",
                    f"≥ {GATHER_SPEEDUP:g}x",
                    g / o,
                    g / o >= GATHER_SPEEDUP,
                    f"gather time / orchestra time; CPU-time ratio {num(gc / oc)}"
                    if gc and oc
                    else "gather time / orchestra time",
                )
            )
        f = median(floor_row)
        if f:
            out.append(
                _target(
                    f"no-op time ≤ {FLOOR_MAX:g} x the worker-queue floor (N={n:,}, {loop})",
                    f"≤ {FLOOR_MAX:g}x",
                    o / f,
                    o / f <= FLOOR_MAX,
                    "orchestra time / worker-queue time",
                )
            )
    return out


def _kinds(rows: list[Row]) -> list[Row]:
    """Issue 13: per-task cost at 100 kinds, and at 100 agents of one kind, ≤ 1.3 x one kind's."""
    out: list[Row] = []
    for row in rows:
        if row["scenario"] != "kinds" or "x_one_kind" not in row:
            continue
        if row["kinds"] > 1:
            what = f"{row['kinds']} kinds, one agent each"
        elif row["agents"] > 1:
            what = f"{row['agents']} agents of one kind"
        else:
            continue
        x = row["x_one_kind"]
        out.append(
            _target(
                f"per-task cost at {what} ≤ {SPREAD_MAX:g} x 1 kind (N={row['n']:,}, {row['loop']})",
                f"≤ {SPREAD_MAX:g}x",
                x,
                x <= SPREAD_MAX,
                f"{num(row['us_per_task']['median'])} µs per task; "
                f"CPU-time ratio {num(row['x_one_kind_cpu'])}",
            )
        )
    return out


def _spawn(rows: list[Row]) -> list[Row]:
    """Issue 13 lists these rows with their before-numbers, no threshold: reported, no verdict."""
    out: list[Row] = []
    fanouts = sorted(
        (r for r in rows if r["scenario"] == "spawn" and r["variant"] == "orchestra_fanout"),
        key=lambda r: r["n"],
    )
    fanouts = [r for r in fanouts if "wall_s" in r]
    for row in fanouts:
        note = f"{num(row['wall_s']['median'])} s in all, CPU {num(row['cpu_s']['median'])} s"
        if row is not fanouts[0]:
            base = fanouts[0]
            scaling = row["us_per_task"]["median"] / base["us_per_task"]["median"]
            note += f"; per-child cost {num(scaling)} x that at K={base['n']:,} (1 = linear)"
        out.append(
            _target(
                f"fan-out: µs per child, one attempt spawning K={row['n']:,}",
                "not set",
                row["us_per_task"]["median"],
                None,
                note,
            )
        )
    chain = find(rows, scenario="spawn", variant="orchestra_chain")
    if chain is not None:
        out.append(
            _target(
                f"{chain['n']:,}-deep chain of spawned tasks: wall time (s)",
                "not set",
                chain["wall_s"]["median"],
                None,
                f"CPU {num(chain['cpu_s']['median'])} s; peak RSS {num(chain['peak_rss_mib']['max'])} MiB (max over repetitions), "
                f"{num(chain['bytes_per_task']['median'])} B per task",
            )
        )
        out.append(
            _target(
                f"{chain['n']:,}-deep chain of spawned tasks: peak RSS (MB)",
                "not set",
                chain["peak_rss_mib"]["max"] * 2**20 / 1e6,
                None,
                "whole process, max over repetitions",
            )
        )
    group = find(rows, scenario="spawn", variant="orchestra_group_chain")
    if group is not None:
        out.append(
            _target(
                f"group-cycle check: {group['n']:,}-member chain in an awaited group: wall time (s)",
                "not set",
                group["wall_s"]["median"],
                None,
                f"CPU {num(group['cpu_s']['median'])} s; "
                f"{num(group['us_per_task']['median'])} µs per member",
            )
        )
    return out


def _latency(rows: list[Row]) -> list[Row]:
    """Issue 13: latency-bound efficiency at least bare gather's in the same run."""
    lat = find(rows, scenario="latency", variant="orchestra")
    gather = find(rows, scenario="latency", variant="gather")
    if lat is None:
        return []
    eff = lat["efficiency"]["median"]
    if gather is None:
        return [_target("latency-bound efficiency", "≥ gather's", None, None, f"{num(eff)}")]
    ratio = eff / gather["efficiency"]["median"]
    return [
        _target(
            "latency-bound efficiency ≥ bare gather's",
            "≥ 1.0x",
            ratio,
            ratio >= 1.0,
            f"orchestra {num(eff)}, gather {num(gather['efficiency']['median'])} "
            f"(ideal {num(lat['ideal_s'])} s)",
        )
    ]


def _speedup(rows: list[Row]) -> list[Row]:
    out: list[Row] = []
    for row in rows:
        if row["scenario"] != "speedup" or row["variant"] != "orchestra" or "speedup" not in row:
            continue
        if row["limit"] == 1:
            continue
        ratio = row["speedup_vs_ideal"]
        achievable = row["achievable_speedup"] / min(row["n"], row["limit"])
        note = (
            f"speed-up {row['speedup']['median']:.1f}; a zero-overhead runtime reaches "
            f"{achievable:.3f} x min(N, limit) with these jittered latencies"
        )
        out.append(
            _target(
                f"speed-up ≥ 0.95 x min(N, limit) (limit {row['limit']})",
                "≥ 0.95",
                ratio,
                ratio >= 0.95,
                note,
            )
        )
    return out


def _memory(rows: list[Row]) -> list[Row]:
    mem = find(rows, scenario="memory", variant="orchestra")
    if mem is None or "x_gather_bytes" not in mem:
        return []
    x = mem["x_gather_bytes"]
    return [
        _target(
            f"memory per pending task ≤ {MEMORY_VS_GATHER:g} x bare gather",
            f"≤ {MEMORY_VS_GATHER:g}x",
            x,
            x <= MEMORY_VS_GATHER,
            f"{mem['bytes_per_task']['median']:.0f} B per pending task",
        )
    ]


def _stream(rows: list[Row]) -> list[Row]:
    million = find(rows, scenario="million", variant="orchestra_stream")
    if million is None:
        return []
    out: list[Row] = []
    peak = million["peak_rss_mib"]["max"] * 2**20 / 1e6
    out.append(
        _target(
            f"{million['n']:,}-task streamed run peak RSS < {STREAM_PEAK_MB:g} MB",
            f"< {STREAM_PEAK_MB:g} MB",
            peak,
            peak < STREAM_PEAK_MB,
            "peak over repetitions, whole process",
        )
    )
    growth = million.get("rss_last_quarter_mib")
    if growth is not None:
        mb = growth["max"] * 2**20 / 1e6
        out.append(
            _target(
                f"flat RSS: the last {million['n'] // 4:,} tasks add < {STREAM_RSS_GROWTH_MB:g} MB",
                f"< {STREAM_RSS_GROWTH_MB:g} MB",
                mb,
                mb < STREAM_RSS_GROWTH_MB,
                "RSS at the end minus RSS three quarters in, max over repetitions",
            )
        )
    slices: list[dict[str, float]] = million.get("slice_throughput", [])
    if len(slices) >= 2:
        flat = slices[-1]["median"] / slices[0]["median"]
        out.append(
            _target(
                "flat throughput: last slice ≥ 0.9 x the first",
                f"≥ {STREAM_FLAT:g}",
                flat,
                flat >= STREAM_FLAT,
                f"slices of {million['slice']:,} tasks; last / first tasks/s",
            )
        )
    return out


def _postgres(rows: list[Row]) -> list[Row]:
    """Issue 26: throughput with 2 workers (absolute, against pgqueuer and the raw floor), the
    submit-to-first-claim latency, a standby's take-over."""
    out: list[Row] = []
    orch = find(rows, scenario="postgres", variant=f"pg_orchestra_{PG_WORKERS}")
    if orch is not None:
        rate = orch["tasks_per_s"]["median"]
        what = f"orchestra, {PG_WORKERS} worker processes, N={orch['n']:,}"
        out.append(
            _target(
                f"PostgreSQL claim + run + complete, tasks/s ({what})",
                f"≥ {PG_TASKS:,}/s",
                rate,
                rate >= PG_TASKS,
                "durable commits, fencing on; from the workers' go to the `RunResult`",
            )
        )
        if "x_pgqueuer" in orch:
            x = orch["x_pgqueuer"]
            out.append(
                _target(
                    f"PostgreSQL: orchestra / pgqueuer (batch 100), tasks/s ({PG_WORKERS} processes)",
                    "> 1x",
                    x,
                    x > 1,
                    f"pgqueuer {num(rate / x)}/s",
                )
            )
        if "x_raw" in orch:
            x = orch["x_raw"]
            out.append(
                _target(
                    f"PostgreSQL: orchestra / raw asyncpg loop, tasks/s ({PG_WORKERS} processes)",
                    f"≥ {PG_VS_RAW:g}x",
                    x,
                    x >= PG_VS_RAW,
                    f"raw {num(rate / x)}/s",
                )
            )
    lat = find(rows, scenario="postgres", variant="pg_latency")
    if lat is not None:
        p50 = lat["p50_ms"]["median"]
        out.append(
            _target(
                "PostgreSQL submit-to-first-claim latency, p50 (ms), LISTEN/NOTIFY",
                f"≤ {PG_P50_MS:g} ms",
                p50,
                p50 <= PG_P50_MS,
                f"p95 {num(lat['p95_ms']['median'])} ms over {lat['samples']} samples",
            )
        )
    for variant, where in (
        ("pg_takeover_local", "same host"),
        ("pg_takeover_remote", "another host"),
    ):
        row = find(rows, scenario="postgres", variant=variant)
        if row is None:
            continue
        bound = row["lease_s"] + PG_TAKEOVER_SLACK_S
        worst = row["takeover_s"]["max"]
        out.append(
            _target(
                f"PostgreSQL standby take-over after a SIGKILL, {where} (s)",
                f"≤ lease + {PG_TAKEOVER_SLACK_S:g} s = {num(bound)} s",
                worst,
                worst <= bound,
                f"max over repetitions (median {num(row['takeover_s']['median'])} s); lease "
                f"{num(row['lease_s'])} s",
            )
        )
    return out


def _service(rows: list[Row]) -> list[Row]:
    """Issue 27: HTTP workers' claim + complete throughput against database workers'."""
    out: list[Row] = []
    for row in rows:
        store = "SQLite" if str(row.get("variant", "")).endswith("_sqlite") else "PostgreSQL"
        if row.get("scenario") == "service" and "page_p95_ms" in row:
            p95 = row["page_p95_ms"]["max"]
            out.append(
                _target(
                    f"Event to the dashboard page, p95 ({store}, N={row['n']:,}, "
                    f"{num(row['transitions_per_s']['median'])} transitions/s)",
                    f"≤ {SVC_EVENTS_P95_MS:g} ms",
                    p95,
                    p95 <= SVC_EVENTS_P95_MS,
                    f"max over repetitions; p50 {num(row['page_p50_ms']['median'])} ms "
                    "(headless Chromium)",
                )
            )
        if row.get("scenario") == "service" and "sse_p95_ms" in row:
            p95 = row["sse_p95_ms"]["max"]
            out.append(
                _target(
                    f"Event to SSE client, p95 ({store}, N={row['n']:,}, "
                    f"{num(row['transitions_per_s']['median'])} transitions/s)",
                    f"≤ {SVC_EVENTS_P95_MS:g} ms",
                    p95,
                    p95 <= SVC_EVENTS_P95_MS,
                    f"max over repetitions; p50 {num(row['sse_p50_ms']['median'])} ms",
                )
            )
        if row.get("scenario") != "service" or "x_db" not in row:
            continue
        workers = row["workers"]
        x = row["x_db"]
        out.append(
            _target(
                f"Workers over HTTP / on the database, tasks/s ({workers} worker"
                f"{'s' if workers > 1 else ''}, N={row['n']:,})",
                f"≥ {SVC_VS_DB:g}x",
                x,
                x >= SVC_VS_DB,
                f"through the service {num(row['tasks_per_s']['median'])}/s",
            )
        )
    return out
