"""The twelve scenarios of the suite, in a full size and a smoke size, and how to pick a subset.

A scenario is a list of groups; a group is the variants that measure the same thing at the same
size and are run one after another in each repetition (their order rotating from one repetition to
the next), so that a drift in the machine's speed lands on all of them alike.

`select` keeps the cases that match selectors such as ``kinds``, ``dispatch/gather`` or
``dispatch/orchestra@asyncio``; ``core-v2`` names the rows core v2's targets are read from,
``sqlite`` those of issue 16 (durable runs), ``postgres`` issue 26's (scenario 12).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .failures import VARIANTS as FAILURE_VARIANTS
from .failures import buggy_tasks
from .postgres import PROCRASTINATE_SHARE
from .spec import LOOPS, Spec

#: Variants of scenario 2 and 3 (LangGraph is added at its own sizes).
PEERS = ("orchestra", "gather", "taskgroup", "worker_queue", "anyio", "aiometer")


@dataclass(frozen=True, slots=True)
class Case:
    spec: Spec
    #: Run this case in at most this many repetitions (LangGraph at 20,000 takes ~50 s a run).
    max_reps: int | None = None


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    title: str
    groups: list[list[Case]] = field(default_factory=list)

    def cases(self) -> list[Case]:
        return [case for group in self.groups for case in group]


@dataclass(frozen=True, slots=True)
class Sizes:
    speedup_n: int = 200
    speedup_latency: float = 0.050
    speedup_jitter: float = 0.005
    speedup_limits: tuple[int, ...] = (1, 10, 50, 200)
    dispatch_ns: tuple[int, ...] = (20_000, 100_000)
    langgraph_ns: tuple[int, ...] = (2_000, 20_000)
    #: LangGraph grows faster than linearly; its largest size runs in this many repetitions.
    langgraph_big_reps: int = 2
    latency_n: int = 2_000
    latency: float = 0.050
    memory_n: int = 100_000
    memory_sleep: float = 0.001
    #: The streamed run; its last quarter is "the last million" of the RSS target.
    million_n: int = 4_000_000
    million_slice: int = 500_000
    million_reps: int = 2
    features_n: int = 100_000
    spread_ns: tuple[int, ...] = (20_000, 100_000)
    #: Scenario 7: this many kinds (one agent each), or this many agents for one kind.
    spread: int = 100
    fanout_ns: tuple[int, ...] = (20_000, 40_000)
    chain_n: int = 20_000
    group_chain_n: int = 8_000
    #: Scenario 8 runs in at most this many repetitions (a 40,000-child fan-out took 26 s).
    spawn_reps: int = 3
    #: Scenario 9: Claude calls against the fake Messages API under a tight budget.
    claude_n: int = 1_000
    #: Scenario 10: transitions per second at this size, no-op and with 20 % of tasks retried once.
    durable_n: int = 20_000
    #: Scenario 10: the size of the run resumed with 90 % of it done.
    resume_n: int = 100_000
    workers_n: int = 5_000
    #: Scenario 10 in full: no-op and retried runs, each beside MemoryStore. The smoke runs the
    #: retried one on SQLite alone (each child costs about a second, and a smoke is seconds).
    durable_full: bool = True
    #: Scenario 11: failures with the default policies, in real time, at their own limit.
    failures_n: int = 400
    #: Scenario 11's ``always_bug``: a kind whose agent always raises, this many tasks.
    failures_bug_n: int = 40
    failures_latency: float = 0.050
    failures_limit: int = 50
    #: Scenario 11: the retry backoff, breaker cool-downs and outage times this (1: the defaults).
    failures_time_scale: float = 1.0
    #: Scenario 12, PostgreSQL: claim + run + complete of this many no-op tasks by each number
    #: of processes; latency samples; the take-over rows' lease x this (1: 5 s), and whether
    #: the cross-host take-over runs (it waits a whole lease).
    pg_n: int = 20_000
    pg_workers: tuple[int, ...] = (1, 2, 4)
    pg_latency_n: int = 300
    pg_time_scale: float = 1.0
    pg_remote: bool = True
    #: Every contender of scenario 12 (the smoke: orchestra, the raw floor and pgqueuer);
    #: procrastinate at a hundredth of the size (one job per query: about 40/s here).
    pg_contenders: tuple[str, ...] = (
        "pg_orchestra", "pg_leases", "pg_raw", "pgqueuer", "procrastinate",
    )  # fmt: skip
    #: Scenario 13, workers over HTTP: claim + complete of this many no-op tasks by each number
    #: of worker processes, through the service and on the database.
    svc_n: int = 10_000
    svc_workers: tuple[int, ...] = (1, 2)
    #: Scenario 13: the run whose events an SSE client times, at ~1,000 transitions/s.
    svc_events_n: int = 10_000
    limit: int = 100
    reps: int = 5


FULL = Sizes()
SMOKE = Sizes(
    speedup_n=20,
    speedup_latency=0.005,
    speedup_jitter=0.0005,
    speedup_limits=(1, 10),
    dispatch_ns=(300,),
    langgraph_ns=(50,),
    langgraph_big_reps=1,
    latency_n=50,
    latency=0.005,
    memory_n=500,
    million_n=4_000,
    million_slice=500,
    million_reps=1,
    features_n=300,
    spread_ns=(300,),
    fanout_ns=(200, 400),
    chain_n=200,
    group_chain_n=200,
    spawn_reps=1,
    claude_n=100,
    durable_n=300,
    resume_n=1_000,
    workers_n=300,
    durable_full=False,
    failures_n=40,
    failures_bug_n=8,
    failures_latency=0.005,
    failures_limit=10,
    failures_time_scale=0.1,
    pg_n=300,
    pg_workers=(2,),
    pg_latency_n=20,
    pg_time_scale=0.4,
    pg_remote=False,
    pg_contenders=("pg_orchestra", "pg_raw", "pgqueuer"),
    svc_n=200,
    svc_workers=(1,),
    svc_events_n=300,
    limit=10,
    reps=1,
)


def plan(sizes: Sizes) -> list[Scenario]:
    limit = sizes.limit

    speedup = Scenario(
        "speedup",
        f"1. Parallel vs sequential: {sizes.speedup_n} simulated agent calls, "
        f"{sizes.speedup_latency * 1e3:g} ms ± {sizes.speedup_jitter * 1e3:g} ms, 4 kinds",
    )
    for c in sizes.speedup_limits:
        speedup.groups.append(
            [
                Case(
                    Spec(
                        "speedup",
                        variant,
                        sizes.speedup_n,
                        c,
                        work="sleep",
                        latency=sizes.speedup_latency,
                        jitter=sizes.speedup_jitter,
                        kinds=4,
                    )
                )
                for variant in ("orchestra", "gather")
            ]
        )

    dispatch = Scenario("dispatch", f"2. Dispatch overhead: no-op subtasks, limit {limit}")
    sizes_and_variants: dict[int, list[str]] = {}
    for n in sizes.dispatch_ns:
        sizes_and_variants.setdefault(n, []).extend(PEERS)
    for n in sizes.langgraph_ns:
        # orchestra and gather at LangGraph's sizes too, for a ratio measured side by side.
        for variant in ("orchestra", "gather", "langgraph"):
            if variant not in sizes_and_variants.setdefault(n, []):
                sizes_and_variants[n].append(variant)
    big_langgraph = max(sizes.langgraph_ns)
    for loop in ("asyncio", "uvloop"):
        for n, variants in sorted(sizes_and_variants.items()):
            group = []
            for variant in variants:
                max_reps = None
                if variant == "langgraph" and n == big_langgraph and n > min(sizes.langgraph_ns):
                    if loop == "uvloop":
                        continue  # ~50 s a run; its asyncio rows are the comparison
                    max_reps = sizes.langgraph_big_reps
                group.append(Case(Spec("dispatch", variant, n, limit, loop=loop), max_reps))
            dispatch.groups.append(group)

    latency = Scenario(
        "latency",
        f"3. Latency-bound efficiency: {sizes.latency_n} x {sizes.latency * 1e3:g} ms, limit {limit}",
    )
    latency.groups.append(
        [
            Case(
                Spec(
                    "latency",
                    variant,
                    sizes.latency_n,
                    limit,
                    work="sleep",
                    latency=sizes.latency,
                )
            )
            for variant in (*PEERS, "orchestra_sqlite", "langgraph")
        ]
    )

    memory = Scenario(
        "memory",
        f"4. Memory: {sizes.memory_n:,} pending subtasks "
        f"({sizes.memory_sleep * 1e3:g} ms each), limit {limit}",
    )
    memory.groups.append(
        [
            Case(
                Spec(
                    "memory",
                    variant,
                    sizes.memory_n,
                    limit,
                    work="sleep",
                    latency=sizes.memory_sleep,
                )
            )
            for variant in ("orchestra", "gather", "worker_queue")
        ]
    )

    million = Scenario(
        "million",
        f"5. {sizes.million_n:,} no-op tasks streamed from an async generator, limit {limit}",
    )
    million.groups.append(
        [
            Case(
                Spec("million", variant, sizes.million_n, limit, slice=sizes.million_slice),
                sizes.million_reps,
            )
            for variant in ("orchestra_stream", "worker_stream")
        ]
    )

    features = Scenario(
        "features",
        f"6. Cost of features: {sizes.features_n:,} no-op tasks, limit {limit}",
    )
    features.groups.append(
        [
            Case(Spec("features", variant, sizes.features_n, limit))
            for variant in (
                "orchestra_plain",
                "orchestra_retry",
                "orchestra_subscriber",
                "orchestra_structlog",
                "orchestra_verifier",
                "orchestra_prometheus",
                "orchestra_otel",
            )
        ]
    )

    kinds = Scenario(
        "kinds",
        f"7. Kinds and agents: no-op tasks over 1 kind, {sizes.spread} kinds (one agent each), "
        f"or {sizes.spread} agents of one kind, limit {limit}",
    )
    for n in sizes.spread_ns:
        kinds.groups.append(
            [
                Case(Spec("kinds", "orchestra", n, limit, kinds=k, agents=a))
                for k, a in ((1, 1), (sizes.spread, 1), (1, sizes.spread))
            ]
        )

    spawn = Scenario(
        "spawn",
        "8. Spawning: one attempt spawning K children, a chain of spawns, a chain inside an "
        f"awaited group, limit {limit}",
    )
    reps = sizes.spawn_reps
    spawn.groups.extend(
        [
            [Case(Spec("spawn", "orchestra_fanout", k, limit), reps) for k in sizes.fanout_ns],
            [Case(Spec("spawn", "orchestra_chain", sizes.chain_n, limit), reps)],
            [Case(Spec("spawn", "orchestra_group_chain", sizes.group_chain_n, limit), reps)],
        ]
    )

    claude = Scenario(
        "claude",
        f"9. Claude: {sizes.claude_n:,} calls against the local fake Messages API "
        "(1 s answers, a 600 RPM / 60,000 input TPM budget enforced), in virtual time",
    )
    claude.groups.append([Case(Spec("claude", "orchestra_claude", sizes.claude_n, 100), 1)])

    durable = Scenario(
        "durable",
        f"10. Durable runs on SQLite: {sizes.durable_n:,} tasks (no-op, and 20 % failing their first "
        f"attempt), a {sizes.resume_n:,}-task run resumed 90 % done, limit {limit}, and "
        f"{sizes.workers_n:,} tasks run by {'1, 2 and 3' if sizes.durable_full else '2'} worker "
        "processes",
    )
    pairs: tuple[tuple[str, ...], ...] = (
        ("memory_noop", "sqlite_noop"),
        ("memory_retry", "sqlite_retry"),
    )
    if not sizes.durable_full:
        pairs = (("sqlite_retry",),)
    durable.groups.extend(
        [Case(Spec("durable", variant, sizes.durable_n, limit)) for variant in pair]
        for pair in pairs
    )
    durable.groups.append([Case(Spec("durable", "sqlite_resume", sizes.resume_n, limit))])
    durable.groups.append(
        [
            Case(Spec("durable", f"sqlite_workers_{k}", sizes.workers_n, limit))
            for k in ((1, 2, 3) if sizes.durable_full else (2,))
        ]
    )

    scale = sizes.failures_time_scale
    failures = Scenario(
        "failures",
        f"11. Failures, default policies{'' if scale == 1 else f' (times x {scale:g})'}: {sizes.failures_n} x {sizes.failures_latency * 1e3:g} ms, "
        f"limit {sizes.failures_limit}, clean, with {len(buggy_tasks(sizes.failures_n))} buggy tasks, an outage, an agent down "
        f"for good; {sizes.failures_bug_n} tasks of a kind whose agent always raises",
    )
    failures.groups.append(
        [
            Case(
                Spec(
                    "failures",
                    variant,
                    sizes.failures_bug_n if variant == "always_bug" else sizes.failures_n,
                    sizes.failures_limit,
                    work="sleep",
                    latency=sizes.failures_latency,
                    time_scale=sizes.failures_time_scale,
                )
            )
            for variant in FAILURE_VARIANTS
        ]
    )

    pg = Scenario(
        "postgres",
        f"12. PostgreSQL (one durable server): {sizes.pg_n:,} no-op tasks claimed, run and "
        f"completed by {', '.join(map(str, sizes.pg_workers))} processes, batches of 100; "
        f"submit-to-first-claim latency ({sizes.pg_latency_n} samples); a standby taking over "
        "a killed coordinator's run",
    )
    pg.groups.append([Case(Spec("postgres", "pg_coordinator", sizes.pg_n, limit))])
    pg.groups.extend(
        [
            Case(
                Spec(
                    "postgres",
                    f"{c}_{w}",
                    sizes.pg_n // (PROCRASTINATE_SHARE if c == "procrastinate" else 1),
                    limit,
                )
            )
            for c in sizes.pg_contenders
        ]
        for w in sizes.pg_workers
    )
    pg.groups.append([Case(Spec("postgres", "pg_latency", sizes.pg_latency_n, limit))])
    pg.groups.append(
        [
            Case(Spec("postgres", variant, 20, limit, time_scale=sizes.pg_time_scale))
            for variant in ("pg_takeover_local", "pg_takeover_remote")[: 1 + sizes.pg_remote]
        ]
    )

    svc = Scenario(
        "service",
        f"13. Workers over HTTP (the service, on scenario 12's server): {sizes.svc_n:,} no-op "
        f"tasks claimed and completed by {', '.join(map(str, sizes.svc_workers))} `orchestra "
        "worker --url` processes, against as many `--dsn` ones; the time from an event to an "
        f"SSE client, a run of {sizes.svc_events_n:,} tasks at ~1,000 transitions/s",
    )
    svc.groups.extend(
        [Case(Spec("service", f"svc_{path}_{w}", sizes.svc_n, limit)) for path in ("http", "db")]
        for w in sizes.svc_workers
    )
    svc.groups.append(
        [
            Case(Spec("service", variant, sizes.svc_events_n, limit))
            for variant in ("svc_events_sse", "svc_events_sse_sqlite")
        ]
    )

    return [
        speedup, dispatch, latency, memory, million, features, kinds, spawn, claude, durable,
        failures, pg, svc,
    ]  # fmt: skip


SCENARIOS = (
    "speedup",
    "dispatch",
    "latency",
    "memory",
    "million",
    "features",
    "kinds",
    "spawn",
    "claude",
    "durable",
    "failures",
    "postgres",
    "service",
)

#: Named sets of selectors. ``core-v2``: the rows issue 13's targets are read from, on asyncio;
#: ``sqlite``: issue 16's (scenario 10, and scenario 3 on each store).
PRESETS: dict[str, tuple[str, ...]] = {
    "core-v2": (
        "dispatch/orchestra@asyncio",
        "dispatch/gather@asyncio",
        "dispatch/worker_queue@asyncio",
        "latency/orchestra",
        "latency/gather",
        "memory/orchestra",
        "memory/gather",
        "million",
        "kinds",
        "spawn",
    ),
    "sqlite": ("durable", "latency/orchestra", "latency/orchestra_sqlite"),
    "postgres": ("postgres",),
    "service": ("service",),
}


@dataclass(frozen=True, slots=True)
class Selector:
    """``scenario[/variant][@loop]``: which cases of the plan to run."""

    scenario: str
    variant: str | None = None
    loop: str | None = None

    @classmethod
    def parse(cls, text: str) -> Selector:
        rest, _, loop = text.partition("@")
        scenario, _, variant = rest.partition("/")
        if scenario not in SCENARIOS:
            raise ValueError(
                f"unknown scenario {scenario!r} in {text!r}; known: {', '.join(SCENARIOS)}"
            )
        if loop and loop not in LOOPS:
            raise ValueError(f"unknown loop {loop!r} in {text!r}; known: {', '.join(LOOPS)}")
        return cls(scenario, variant or None, loop or None)

    def __str__(self) -> str:
        variant = f"/{self.variant}" if self.variant else ""
        return self.scenario + variant + (f"@{self.loop}" if self.loop else "")

    def matches(self, spec: Spec) -> bool:
        return (
            spec.scenario == self.scenario
            and self.variant in (None, spec.variant)
            and self.loop in (None, spec.loop)
        )


def parse_selectors(texts: list[str]) -> list[Selector]:
    """Selectors from ``--only`` values: comma-separated, presets expanded. Raises ValueError."""
    out = []
    for text in texts:
        for item in filter(None, (part.strip() for part in text.split(","))):
            out += [Selector.parse(t) for t in PRESETS.get(item, (item,))]
    return out


def select(scenarios: list[Scenario], selectors: list[Selector]) -> list[Scenario]:
    """The scenarios with only the cases some selector matches (groups keep their order).

    Raises ValueError for a selector that matches no case (a misspelt variant, say).
    """
    cases = [case.spec for scenario in scenarios for case in scenario.cases()]
    idle = [s for s in selectors if not any(s.matches(spec) for spec in cases)]
    if idle:
        raise ValueError(
            f"no case matches {idle[0]}; variants: {sorted({c.variant for c in cases})}"
        )
    kept = []
    for scenario in scenarios:
        groups = [
            [case for case in group if any(s.matches(case.spec) for s in selectors)]
            for group in scenario.groups
        ]
        groups = [group for group in groups if group]
        if groups:
            kept.append(Scenario(scenario.name, scenario.title, groups))
    return kept
