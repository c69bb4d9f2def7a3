"""A fuzzer of the core's invariants: random runs with every feature at once, in virtual time.

`tests/test_properties.py` checks the invariants one feature at a time; this file throws random
task graphs (priorities, tags, dependencies, spawns) at several agents per kind (fallback chains,
per-agent limits, shared `Concurrency` and `Rate` limiters, breakers on or off) whose calls play
random faults (retryable and permanent errors, 429 with Retry-After, hangs, slow calls, a
`CancelledError` raised by hand, a cancel swallowed, a coroutine returned by mistake), steers the
run with random control calls at random virtual times (cancel by every selector, pause, resume,
reprioritize, stop, a run timeout, the caller's own cancel), and checks on every run what must hold
whatever happened: see `check`.

The agents watch the limits themselves (`World`), so a breach is seen at the instant it happens.
Examples run derandomized; ``ORCHESTRA_FUZZ_EXAMPLES=2000`` runs more of them (at random), and
``ORCHESTRA_FUZZ_SQLITE=1`` runs them on `SQLiteStore`s.

What the fuzzer found is pinned by its own regression test (tests/test_cancellation.py,
``test_without_async_with_the_first_caller_may_cancel_once_its_run_is_over``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestra import (
    BreakerPolicy,
    Concurrency,
    Context,
    InputError,
    Orchestrator,
    PermanentError,
    Rate,
    RetryableError,
    RetryPolicy,
    RunResult,
    Task,
    TaskResult,
    Timeouts,
)
from orchestra._faults import raise_fault
from orchestra.events import (
    AttemptStarted,
    BreakerChanged,
    Event,
    FallbackUsed,
    TaskFinished,
    TaskReady,
)
from orchestra.testing import GARBAGE
from tests.helpers import (
    assert_no_leaks,
    fake_clock,
    live_tasks,
    not_garbage,
    sqlite_store,
    trips_after,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    import pytest

    from orchestra import RunHandle

SQLITE = bool(os.environ.get("ORCHESTRA_FUZZ_SQLITE"))
EXAMPLES = int(os.environ.get("ORCHESTRA_FUZZ_EXAMPLES", "0")) or 100
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 100,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,  # capsys: read and emptied by every example
    ],
    database=None,
)

KINDS = ("a", "b")
TAGS = ("g1", "g2")
OUTCOMES = (
    "ok",
    "ok",
    "ok",
    "error",  # retryable
    "permanent",
    "rate_limit",  # 429 with Retry-After
    "hang",
    "slow",
    "raise_cancelled",  # raises CancelledError with no cancel pending: a failed attempt
    "swallow",  # swallows the first cancel
    "coroutine",  # returns a coroutine: a forgotten await
    "garbage",  # the verifier rejects it: a retryable failure
    "retry_after",  # RetryableError(retry_after=...), raised by the agent itself
    "bug",  # a ValueError from the agent's own code: retried, never a health failure
    "judge_raises",  # the verifier raises on its output (KeyError): never the agent's failure
)
JUDGE_RAISES = "the verifier raises on this"
RETRY_AFTER = 1.5
ATTEMPT_TIMEOUT = 4.0
EPS = 1e-6


@dataclass
class Spec:
    id: str
    kind: str
    priority: int
    deps: list[str]
    tags: list[str]
    after_tags: list[str]  # depends_on_tags
    script: list[str]  # the task's n-th call (whichever agent) plays script[n], then "ok"
    latency: float
    spawns: bool
    refused: bool = False  # the safety check refuses it
    timeout: float | None = None  # its own deadline, over the orchestrator's
    key: str | None = None  # tasks with one key are the same work: one runs, the others follow


@dataclass
class AgentSpec:
    name: str
    kind: str
    limit: int | None
    shares_slots: bool  # uses the shared Concurrency
    shares_rate: bool  # uses the shared Rate


@dataclass
class Scenario:
    specs: list[Spec]
    agents: list[AgentSpec]
    concurrency: int
    max_attempts: int
    breaker: str  # "off", "quick" (opens on 2 tasks, 2 s cool-down) or "default"
    shared_slots: int
    rate: int  # requests per second of the shared Rate
    task_timeout: float | None
    run_timeout: float | None
    streamed: bool
    window: int | None
    actions: list[tuple[float, str, Any]]  # (delay, op, argument)
    caller_cancel: float | None  # run() under move_on_after (no handle)
    bystander: bool = False  # a second run of the same tasks at the same time
    elsewhere: bool = False  # the bystander's on another orchestrator that shares every limit
    broken: int | None = None  # a streamed input breaks (raises, or repeats an id) at this task


@dataclass
class CallRecord:
    agent: str
    task_id: str
    seq: int  # when it started, in the order of everything `World` saw
    start: float
    end: float | None = None
    outcome: str = ""
    ended_seq: int = -1
    retry_after: bool = False  # it raised a 429 with Retry-After, or a RetryableError with one
    http: bool = False  # ... a 429: that pauses everyone who shares a limit with its agent


@dataclass
class World:
    """What every agent of one example sees and what the test checks at the end."""

    scenario: Scenario
    seq: int = 0
    calls: list[CallRecord] = field(default_factory=list)
    by_task: Counter[str] = field(default_factory=Counter)
    running: int = 0
    by_agent: Counter[str] = field(default_factory=Counter)
    slots_held: int = 0
    violations: list[str] = field(default_factory=list)
    # (seq, what) of each control call that takes effect at once
    controls: list[tuple[int, str, Any]] = field(default_factory=list)
    stopped: tuple[float, float | None] | None = None  # (when, grace) of the first stop
    cancelled_at: dict[str, float] = field(default_factory=dict)  # by a handle's cancel
    started: float = 0.0
    ended: float = 0.0
    bystander: RunResult | None = None  # the result of the run nobody steers
    raised: BaseException | None = None  # what the steered run raised
    streamed: list[str] = field(default_factory=list)  # what its handle's results() gave

    def tick(self) -> int:
        self.seq += 1
        return self.seq


def _forgotten() -> Any:
    async def later() -> str:
        return "never awaited"

    return later()


class FuzzAgent:
    """Plays the task's script; counts itself in `World` so a limit's breach is seen at once."""

    def __init__(self, spec: AgentSpec, world: World, limits: list[Any]) -> None:
        self.name = spec.name
        self.kinds = (spec.kind,)
        # An object, not an int: one limit for the agent in both orchestrators that hold it.
        self.concurrency = None if spec.limit is None else Concurrency(spec.limit)
        self.limits = limits
        self.spec = spec
        self.world = world

    async def __call__(self, task: Task, ctx: Context) -> Any:
        world, scenario = self.world, self.world.scenario
        payload = task.payload
        task_id = task.id or ""
        n = world.by_task[task_id]
        world.by_task[task_id] += 1
        script = payload["script"]
        outcome = script[n] if n < len(script) else "ok"
        call = CallRecord(self.name, task_id, world.tick(), anyio.current_time(), outcome=outcome)
        world.calls.append(call)
        world.running += 1
        world.by_agent[self.name] += 1
        if self.spec.shares_slots:
            world.slots_held += 1
        if world.running > scenario.concurrency:
            world.violations.append(f"{world.running} calls at once, limit {scenario.concurrency}")
        limit = self.spec.limit
        if limit is not None and world.by_agent[self.name] > limit:
            world.violations.append(f"agent {self.name}: {world.by_agent[self.name]} > {limit}")
        if world.slots_held > scenario.shared_slots:
            world.violations.append(f"shared slots: {world.slots_held} > {scenario.shared_slots}")
        missing = set(payload["deps"]) - set(ctx.deps)
        if missing:
            world.violations.append(f"{task_id} ran without its dependencies' outputs {missing}")
        try:
            if payload["latency"]:
                await anyio.sleep(payload["latency"])
            if payload["spawns"]:
                ctx.spawn(Task(task.kind, _child(), id=f"{task_id}/c"))
            if outcome == "ok":
                return task_id
            if outcome == "raise_cancelled":
                raise asyncio.CancelledError  # by hand, with no cancel pending
            if outcome == "swallow":
                with contextlib.suppress(asyncio.CancelledError):
                    await anyio.sleep(2.0)  # swallowed once: the run must cancel it again
                await anyio.sleep(0.5)
                return task_id
            if outcome == "garbage":
                return GARBAGE
            if outcome == "judge_raises":
                return JUDGE_RAISES
            if outcome == "bug":
                raise ValueError(f"{task_id}: a bug in the agent")
            if outcome == "coroutine":
                return _forgotten()
            if outcome == "permanent":
                raise PermanentError(f"{task_id} fails for good")
            call.retry_after = outcome in ("rate_limit", "retry_after")
            call.http = outcome == "rate_limit"
            if outcome == "retry_after":
                raise RetryableError(f"{task_id}: come back later", retry_after=RETRY_AFTER)
            return await raise_fault(
                outcome, f"agent {self.name!r}", retry_after=RETRY_AFTER, latency=3.0
            )
        finally:
            call.end = anyio.current_time()
            call.ended_seq = world.tick()
            world.running -= 1
            world.by_agent[self.name] -= 1
            if self.spec.shares_slots:
                world.slots_held -= 1


def _child() -> dict[str, Any]:
    return {"script": [], "latency": 0.2, "spawns": False, "deps": [], "refused": False}


@st.composite
def scenarios(draw: st.DrawFn, *, streamed: bool | None = None) -> Scenario:
    n = draw(st.integers(1, 12))
    specs: list[Spec] = []
    for i in range(n):
        deps: list[int] = []
        if i:
            deps = draw(st.lists(st.integers(0, i - 1), max_size=2, unique=True))
        specs.append(
            Spec(
                id=f"t{i}",
                kind=draw(st.sampled_from(KINDS)),
                priority=draw(st.integers(-2, 2)),
                deps=[f"t{d}" for d in deps],
                # Members come first and waiters after, so a group never waits for itself.
                tags=draw(st.lists(st.sampled_from(TAGS), max_size=1)) if i < n // 2 else [],
                after_tags=draw(st.lists(st.sampled_from(TAGS), max_size=1)) if i >= n // 2 else [],
                script=draw(st.lists(st.sampled_from(OUTCOMES), max_size=3)),
                latency=draw(st.sampled_from((0.0, 0.0, 0.1, 0.5, 1.0))),
                spawns=draw(st.integers(0, 5)) == 0,
                refused=draw(st.integers(0, 12)) == 0,
                timeout=draw(st.sampled_from((None, None, None, 2.0, 7.0))),
                key=draw(st.sampled_from((None, None, None, "k0", "k1"))),
            )
        )
    agents: list[AgentSpec] = []
    for kind in KINDS:
        for j in range(draw(st.integers(1, 3))):
            agents.append(
                AgentSpec(
                    name=f"{kind}{j}",
                    kind=kind,
                    limit=draw(st.none() | st.integers(1, 3)),
                    shares_slots=draw(st.booleans()),
                    shares_rate=draw(st.booleans()),
                )
            )
    ids = [s.id for s in specs]
    op = st.sampled_from(
        (
            *("cancel_id", "cancel_kind", "cancel_tag", "cancel_agent", "cancel_priority"),
            *("pause", "resume", "reprioritize", "stop"),
        )
    )
    actions = draw(
        st.lists(
            st.tuples(
                st.sampled_from((0.0, 0.05, 0.3, 1.0, 2.5)),
                op,
                st.tuples(
                    st.sampled_from(ids),
                    st.sampled_from(KINDS),
                    st.sampled_from(TAGS),
                    st.sampled_from([a.name for a in agents]),
                    st.integers(-3, 3),
                    st.sampled_from((None, 0.0, 0.5, 3.0)),  # a stop's grace
                ),
            ),
            max_size=4,
        )
    )
    return Scenario(
        specs=specs,
        agents=agents,
        concurrency=draw(st.integers(1, 4)),
        max_attempts=draw(st.integers(1, 3)),
        breaker=draw(st.sampled_from(("off", "quick", "default"))),
        shared_slots=draw(st.integers(1, 3)),
        rate=draw(st.sampled_from((2, 5, 50))),
        task_timeout=draw(st.sampled_from((None, None, 6.0, 15.0))),
        run_timeout=draw(st.sampled_from((None, None, None, 4.0, 12.0))),
        streamed=draw(st.booleans()) if streamed is None else streamed,
        window=draw(st.none() | st.integers(1, 4)),
        actions=actions,
        caller_cancel=draw(st.sampled_from((None, None, None, None, 0.0, 0.4, 3.0))),
        bystander=draw(st.booleans()),
        elsewhere=draw(st.booleans()),
        broken=draw(st.none() | st.none() | st.integers(1, 12)),
    )


def task_list(scenario: Scenario, prefix: str = "") -> list[Task]:
    return [
        Task(
            s.kind,
            {
                "script": s.script,
                "latency": s.latency,
                "spawns": s.spawns,
                "deps": [prefix + d for d in s.deps],
                "refused": s.refused,
            },
            id=prefix + s.id,
            priority=s.priority,
            depends_on=[prefix + d for d in s.deps],
            depends_on_tags=s.after_tags,
            tags=s.tags,
            timeout=s.timeout,
            key=s.key,
        )
        for s in scenario.specs
    ]


BYSTANDER = "x-"  # the ids of a second run on the same orchestrator, which nobody steers


def source(scenario: Scenario, prefix: str = "") -> list[Task] | AsyncIterator[Task]:
    tasks = task_list(scenario, prefix)
    if not scenario.streamed:
        return tasks

    async def stream() -> AsyncIterator[Task]:
        for i, task in enumerate(tasks):
            if i % 3 == 2:
                await anyio.sleep(0.3)
            if i == scenario.broken and not prefix:
                if i % 2:
                    raise SourceBroke(f"the source broke before {task.id}")
                yield tasks[0]  # a duplicate id: an InputError when it arrives
            yield task

    return stream()


class SourceBroke(Exception):
    """What a broken streamed input raises."""


BREAKERS: dict[str, BreakerPolicy | None] = {
    "off": None,
    "quick": trips_after(2, cooldown=2.0),
    "default": BreakerPolicy(),
}


def judge(task: Task, output: Any) -> bool:
    """The verifier: rejects garbage, and raises (a bug of its own) on `JUDGE_RAISES`."""
    if output == JUDGE_RAISES:
        raise KeyError("the verifier broke")
    return not_garbage(task, output)


def bound(scenario: Scenario) -> float:
    """The longest a run may take in virtual time, from its policies: each task (and child), one
    after another, spends its attempts on every agent of its kind, each attempt as long as it can
    be (a hang to the attempt timeout, a swallowed cancel, a slow call) followed by the longest
    wait (a backoff, a Retry-After, a breaker's cool-down); plus the input's and the controls'
    own waits."""
    policy = BREAKERS[scenario.breaker]
    cooldown = 0.0 if policy is None else policy.longest
    attempt = ATTEMPT_TIMEOUT + 3.0 + 2.5 + 1.0  # + slow latency, swallow, task latency
    wait = max(1.0, RETRY_AFTER) + cooldown
    chain = max(Counter(a.kind for a in scenario.agents).values())
    per_task = chain * scenario.max_attempts * (attempt + wait)
    inputs = 0.3 * len(scenario.specs) + sum(delay for delay, _, _ in scenario.actions)
    return 2 * len(scenario.specs) * per_task + inputs + 3.0 + EPS


def build(scenario: Scenario, world: World) -> tuple[Orchestrator, Orchestrator]:
    """The steered run's orchestrator, and the bystander's: the same one, or another sharing its
    agents and its global limit."""
    slots = Concurrency(scenario.shared_slots)
    rate = Rate(scenario.rate, per=1.0)
    agents = [
        FuzzAgent(
            spec,
            world,
            [x for x, on in ((slots, spec.shares_slots), (rate, spec.shares_rate)) if on],
        )
        for spec in scenario.agents
    ]
    everyone = Concurrency(scenario.concurrency)
    orchs = [
        Orchestrator(
            agents=agents,
            concurrency=everyone,
            retry=RetryPolicy(max_attempts=scenario.max_attempts, base=0.2, cap=1.0),
            breaker=BREAKERS[scenario.breaker],
            timeouts=Timeouts(
                attempt=ATTEMPT_TIMEOUT, task=scenario.task_timeout, run=scenario.run_timeout
            ),
            success_threshold=0.0,
            verify=dict.fromkeys(KINDS, judge),
            safety=lambda task: not task.payload["refused"],
            window=scenario.window,
            seed=0,
            store=sqlite_store() if SQLITE else None,
        )
        for _ in range(2 if scenario.elsewhere else 1)
    ]
    return orchs[0], orchs[-1]


async def steer(handle: RunHandle, scenario: Scenario, world: World) -> None:
    """Plays the scenario's control calls at their times, then lets the run end."""
    for delay, op, (task_id, kind, tag, agent_name, number, grace) in scenario.actions:
        if delay:
            await anyio.sleep(delay)
        if handle.done:
            return
        if op == "stop":
            world.controls.append((world.tick(), "stop", None))
            world.stopped = (anyio.current_time(), grace)
            with contextlib.suppress(InputError, SourceBroke):  # the run's own error: see play
                await handle.stop(grace)
            return
        if op == "pause":
            handle.pause()
            world.controls.append((world.tick(), "pause", None))
        elif op == "resume":
            world.controls.append((world.tick(), "resume", None))
            handle.resume()
        elif op == "reprioritize":
            handle.reprioritize(task_id, number)
        else:
            selector: dict[str, Any] = {
                "cancel_id": {"task_id": task_id},
                "cancel_kind": {"kind": kind},
                "cancel_tag": {"tag": tag},
                "cancel_agent": {"agent": agent_name},
                "cancel_priority": {"priority": (number, number + 1)},
            }[op]
            done = handle.cancel(**selector)
            for i in done.cancelled:
                world.cancelled_at.setdefault(i, anyio.current_time())
            world.controls.append((world.tick(), "cancel", set(done.cancelled)))
    world.controls.append((world.tick(), "resume", None))
    handle.resume()  # a paused run would never end


async def play(scenario: Scenario) -> tuple[World, RunResult | None, list[Event]]:
    world = World(scenario)
    events: list[Event] = []
    orch, elsewhere = build(scenario, world)
    orch.subscribe(
        events.append,
        AttemptStarted,
        TaskFinished,
        TaskReady,
        BreakerChanged,
        FallbackUsed,
        buffer=1_000_000,
    )
    result: RunResult | None = None
    world.started = anyio.current_time()
    # Virtual time: a deadlock (nothing left to wake anyone) jumps straight past the bound.
    with anyio.fail_after(bound(scenario) + 1.0):
        if scenario.caller_cancel is not None:
            async with anyio.create_task_group() as tg:
                if scenario.bystander:

                    async def bystander() -> None:
                        world.bystander = await elsewhere.run(tasks=source(scenario, BYSTANDER))

                    tg.start_soon(bystander)
                with anyio.move_on_after(scenario.caller_cancel):
                    try:
                        result = await orch.run(tasks=source(scenario))
                    except (InputError, SourceBroke) as exc:
                        world.raised = exc
        else:
            async with orch, elsewhere, anyio.create_task_group() as tg:
                handle = orch.start(tasks=source(scenario))
                tg.start_soon(read, handle.results(), world)  # asked at once: sees every task
                other = None
                if scenario.bystander:
                    other = elsewhere.start(tasks=source(scenario, BYSTANDER))
                await steer(handle, scenario, world)
                try:
                    result = await handle
                except (InputError, SourceBroke) as exc:
                    world.raised = exc
                if other is not None:
                    world.bystander = await other
    world.ended = anyio.current_time()
    return world, result, events


async def read(results: AsyncIterator[TaskResult], world: World) -> None:
    async for r in results:
        world.streamed.append(r.task_id)


def check(scenario: Scenario, world: World, result: RunResult | None, events: list[Event]) -> None:
    assert not world.violations, world.violations
    assert world.running == 0
    # Every run ends, within what its policies allow.
    assert world.ended - world.started <= bound(scenario), world.ended - world.started
    # A broken input is raised to the caller: nothing else is.
    if world.raised is not None:
        assert scenario.streamed
        assert scenario.broken is not None
        assert result is None

    # The bystander run: what the steered run's controls did never reached it.
    def id_of(event: Event) -> str:
        if isinstance(event, BreakerChanged):
            return ""
        return event.result.task_id if isinstance(event, TaskFinished) else event.task_id  # type: ignore[attr-defined]

    if scenario.bystander:
        other = world.bystander
        assert other is not None
        ran = {BYSTANDER + s.id for s in scenario.specs}
        if scenario.run_timeout is None:
            assert other.metadata.total >= len(ran)
        assert {e.task_id for e in other.errors} <= ran | {i + "/c" for i in ran}
        for error in other.errors:
            assert error.error_type not in ("Cancelled", "Stopped"), error
        if scenario.run_timeout is None:
            assert other.status != "cancelled"
    every_event = events
    events = [e for e in events if not id_of(e).startswith(BYSTANDER)]
    all_calls = world.calls
    world.calls = [c for c in all_calls if not c.task_id.startswith(BYSTANDER)]

    finished = [e.result for e in events if isinstance(e, TaskFinished)]
    # Every task ends exactly once, in a terminal state.
    counts = Counter(r.task_id for r in finished)
    assert all(c == 1 for c in counts.values()), counts
    assert all(r.status in ("succeeded", "failed", "cancelled", "skipped") for r in finished)
    given = {s.id for s in scenario.specs}
    by_id = {r.task_id: r for r in finished}
    # The handle's results() gave each task once, the ones that ended.
    assert sorted(world.streamed) == sorted(set(world.streamed))
    if result is not None and scenario.caller_cancel is None:
        assert set(world.streamed) == set(by_id)
    if result is not None:
        # ... every task that was given, and the children of the successful spawns.
        if scenario.run_timeout is None and not scenario.streamed:
            assert given <= set(by_id), given - set(by_id)
        assert set(by_id) <= given | {f"{i}/c" for i in given}
        # The result adds up.
        meta = result.metadata
        assert meta.total == len(by_id), (meta.total, len(by_id))
        assert sum(meta.counts.values()) == meta.total
        statuses = Counter(r.status for r in finished)
        for status in ("succeeded", "failed", "cancelled", "skipped"):
            assert meta.counts.get(status, 0) == statuses[status], (status, meta.counts)
        assert {e.task_id for e in result.errors} == {
            i for i, r in by_id.items() if r.status != "succeeded"
        }
        if result.status == "success":
            assert statuses["succeeded"] == meta.total
        assert meta.peak_concurrency <= scenario.concurrency

    # Every call that started was a task that ended.
    for call in world.calls:
        assert call.end is not None
        if result is not None:
            assert call.task_id in by_id, call

    # A task never runs before its dependencies succeeded (in the order the events were sent).
    members = {t: [s.id for s in scenario.specs if t in s.tags] for t in TAGS}
    deps = {s.id: s.deps + [m for t in s.after_tags for m in members[t]] for s in scenario.specs}
    succeeded: set[str] = set()
    for event in events:
        if isinstance(event, TaskFinished):
            if event.result.status == "succeeded":
                succeeded.add(event.result.task_id)
        elif isinstance(event, AttemptStarted):
            assert set(deps.get(event.task_id, ())) <= succeeded, event

    # No attempt starts after a cancel that ended its task, after a stop, or while paused.
    paused_at: int | None = None
    spans: list[tuple[int, int]] = []
    for seq, what, arg in world.controls:
        if what == "cancel":
            late = [c for c in world.calls if c.task_id in arg and c.seq > seq]
            assert not late, ("started after its cancel", late)
        elif what == "stop":
            late = [c for c in world.calls if c.seq > seq]
            assert not late, ("started after the stop", late)
        elif what == "pause" and paused_at is None:
            paused_at = seq
        elif what == "resume" and paused_at is not None:
            spans.append((paused_at, seq))
            paused_at = None
    for lo, hi in spans:
        late = [c for c in world.calls if lo < c.seq < hi]
        assert not late, ("started while paused", late)

    # A task whose chain ran out (not its deadline) was offered to every agent of its kind: an
    # open breaker sends it to the next agent, or makes it wait for a probe, never ends it.
    for task_id, r in by_id.items():
        if r.status != "failed" or r.error_type in ("TaskTimeout", "Rejected"):
            continue
        # (An agent it waited for spent its attempts there on failed probes: no call.)
        tried = {c.agent for c in world.calls if c.task_id == task_id}
        tried.update(a.agent for a in r.failures or ())
        kind_agents = {a.name for a in scenario.agents if a.kind == r.kind}
        assert tried == kind_agents, ("failed with agents untried", task_id, tried, r)

    # Tasks with one key never run at once (one holds it, the others wait for its result); a task
    # with a key that succeeded without a call has the output of one with its key that succeeded.
    keys = {s.id: s.key for s in scenario.specs if s.key is not None}
    for c in world.calls:
        if c.task_id in keys:
            overlap = [
                d
                for d in world.calls
                if d is not c
                and keys.get(d.task_id) == keys[c.task_id]
                and d.task_id != c.task_id
                and d.seq < c.seq
                # (a call whose task ended, by a cancel or its deadline, unwinds at that instant)
                and (d.end is None or d.end > c.start + EPS)
            ]
            assert not overlap, ("two tasks with one key ran at once", c, overlap)
    called = {c.task_id for c in world.calls}
    for task_id, r in by_id.items():
        if r.status == "succeeded" and task_id in keys and task_id not in called:
            sources = [
                i
                for i, o in by_id.items()
                if i in called and keys.get(i) == keys[task_id] and o.status == "succeeded"
            ]
            if not sources and SQLITE:  # keys hold across the runs of a file: the bystander's
                elsewhere = [
                    c.task_id
                    for c in all_calls
                    if keys.get(c.task_id.removeprefix(BYSTANDER)) == keys[task_id]
                    and c.task_id.startswith(BYSTANDER)
                ]
                assert elsewhere, ("a task with a key succeeded with nothing run", task_id)
                continue
            assert sources, ("a task with a key succeeded with nothing run", task_id)
            assert r.output in [by_id[i].output for i in sources], (task_id, r.output)

    # Every change of agent is a fallback, reported as one: between two attempts of a task on
    # different agents, a FallbackUsed moved it.
    moves = Counter(
        e.task_id for e in events if isinstance(e, FallbackUsed) and e.to_agent is not None
    )
    for task_id, r in by_id.items():
        agents = [a.agent for a in r.failures or ()]
        if r.status == "succeeded" and r.agent is not None and r.attempts > len(agents):
            agents.append(r.agent)
        changes = sum(1 for x, y in itertools.pairwise(agents) if x != y)
        assert moves[task_id] >= changes, ("a silent change of agent", task_id, agents, moves)

    # The safety check refuses a task before any call.
    refused = {s.id for s in scenario.specs if s.refused}
    assert not [c for c in world.calls if c.task_id in refused]

    # What a cancel, a stop past its grace, the run timeout or the caller's cancel ended ends then.
    for task_id, at in world.cancelled_at.items():
        for c in world.calls:
            if c.task_id == task_id and c.start <= at:
                assert c.end is not None
                assert c.end <= at + EPS, ("ran on after its cancel", c, at)
    cutoffs = []
    if world.stopped is not None and world.stopped[1] is not None:
        cutoffs.append(world.stopped[0] + world.stopped[1])
    if scenario.run_timeout is not None:
        cutoffs.append(world.started + scenario.run_timeout)
    if scenario.caller_cancel is not None:
        cutoffs.append(world.started + scenario.caller_cancel)
    if cutoffs:
        for c in world.calls:
            assert c.end is not None
            assert c.end <= min(cutoffs) + EPS, ("ran on", c, cutoffs)

    # A task's deadline holds from its first time ready, whatever it waited for (a slot, a rate,
    # a retry, a breaker's probe, a pause).
    own = {s.id: s.timeout for s in scenario.specs if s.timeout is not None}
    ready: dict[str, float] = {}
    for event in events:
        if isinstance(event, TaskReady):
            ready.setdefault(event.task_id, event.at)
        elif isinstance(event, TaskFinished) and event.result.task_id in ready:
            limit = own.get(event.result.task_id, scenario.task_timeout)
            if limit is not None:
                over = event.at - ready[event.result.task_id] - limit
                assert over <= EPS, ("past its deadline", event.result, over)

    # An open breaker lets no attempt through; a half-open one, a single probe (in the order the
    # events were sent; the breakers are the steered orchestrator's, and its subscribers hear the
    # bystander's attempts there to the end, whichever caller was cancelled).
    # A probe whose task was cancelled ends unjudged and lets the next one through (README); its
    # task's end may be heard after that next probe starts, at the same instant.
    heard = every_event if not scenario.elsewhere else events
    cancelled_at = {
        (e.run_id, e.result.task_id): e.at
        for e in heard
        if isinstance(e, TaskFinished) and e.result.status == "cancelled"
    }
    breaker: dict[str, str] = {}
    probing: dict[str, AttemptStarted] = {}
    for event in heard:
        if isinstance(event, BreakerChanged):
            breaker[event.agent] = event.state
            probing.pop(event.agent, None)
        elif isinstance(event, AttemptStarted):
            now = breaker.get(event.agent, "closed")
            assert now != "open", ("an attempt through an open breaker", event)
            if now == "half_open":
                probe = probing.get(event.agent)
                if probe is not None:
                    abandoned = cancelled_at.get((probe.run_id, probe.task_id), math.inf)
                    assert abandoned <= event.at + EPS, ("a second probe", event)
                probing[event.agent] = event

    # The shared limits hold across both runs.
    world.calls = all_calls

    # The shared rate: at most limit + burst starts in any second.
    rated = {a.name for a in scenario.agents if a.shares_rate}
    starts = sorted(c.start for c in world.calls if c.agent in rated)
    for i, t in enumerate(starts):
        j = i
        while j < len(starts) and starts[j] < t + 1.0 - EPS:
            j += 1
        assert j - i <= scenario.rate + 1, ("rate exceeded", t, starts[i:j])

    # A 429 with Retry-After pauses every agent that shares a limit with the one that got it.
    agent_specs = {a.name: a for a in scenario.agents}

    def shares(a: AgentSpec, b: AgentSpec) -> bool:
        return (a.shares_slots and b.shares_slots) or (a.shares_rate and b.shares_rate)

    for hit in world.calls:
        if not hit.retry_after or hit.end is None:
            continue
        mine = agent_specs[hit.agent]
        early = [
            c
            for c in world.calls
            if hit.http
            and shares(mine, agent_specs[c.agent])
            and c.seq > hit.ended_seq
            and c.start < hit.end + RETRY_AFTER - EPS
        ]
        assert not early, ("started before the Retry-After", hit, early)
        # ... and the task that got it, on that agent, whatever it shares.
        again = [
            c
            for c in world.calls
            if c.task_id == hit.task_id
            and c.agent == hit.agent
            and c.seq > hit.ended_seq
            and c.start < hit.end + RETRY_AFTER - EPS
        ]
        assert not again, ("retried before the Retry-After", hit, again)


async def holds(scenario: Scenario, capsys: pytest.CaptureFixture[str]) -> None:
    """Play `scenario` in virtual time: every invariant holds, no task leaks, nothing printed."""
    before = live_tasks()
    async with fake_clock():
        world, result, events = await play(scenario)
    await assert_no_leaks(before)
    check(scenario, world, result, events)
    assert capsys.readouterr().out == ""


class TestFuzz:
    @FUZZ
    @given(scenario=scenarios())
    async def test_invariants_hold_in_random_runs(
        self, scenario: Scenario, capsys: pytest.CaptureFixture[str]
    ) -> None:
        await holds(scenario, capsys)

    @FUZZ
    @given(scenario=scenarios(streamed=True))
    async def test_invariants_hold_in_random_streamed_runs(
        self, scenario: Scenario, capsys: pytest.CaptureFixture[str]
    ) -> None:
        await holds(scenario, capsys)


@dataclass
class Pick:
    """One worker's choices: which task each call ran, and the priority changes between them."""

    seq: int = 0
    log: list[tuple[int, str, Any]] = field(default_factory=list)  # (seq, what, detail)

    def tick(self) -> int:
        self.seq += 1
        return self.seq


class PickAgent:
    def __init__(self, kind: str, pick: Pick) -> None:
        self.name = f"{kind}0"
        self.kinds = (kind,)
        self.pick = pick

    async def __call__(self, task: Task, ctx: Context) -> Any:
        self.pick.log.append((self.pick.tick(), "start", task.id))
        try:
            await anyio.sleep(task.payload["latency"])
            if task.payload["spawns"]:
                ctx.spawn(
                    Task(
                        task.kind,
                        {"latency": 0.1, "spawns": False},
                        id=f"{task.id}/c",
                        priority=task.payload["child"],
                    )
                )
            return task.id
        finally:
            self.pick.log.append((self.pick.tick(), "end", task.id))


@st.composite
def priority_runs(draw: st.DrawFn) -> tuple[list[Task], list[tuple[float, str, int]]]:
    n = draw(st.integers(2, 14))
    tasks = []
    for i in range(n):
        deps = draw(st.lists(st.integers(0, i - 1), max_size=2, unique=True)) if i else []
        tasks.append(
            Task(
                draw(st.sampled_from(KINDS)),
                {
                    "latency": draw(st.sampled_from((0.0, 0.1, 0.5, 1.0))),
                    "spawns": draw(st.integers(0, 4)) == 0,
                    "child": draw(st.integers(-2, 2)),
                },
                id=f"t{i}",
                priority=draw(st.integers(-2, 2)),
                depends_on=[f"t{d}" for d in deps],
            )
        )
    ids = [t.id or "" for t in tasks] + [f"{t.id}/c" for t in tasks]
    moves = draw(
        st.lists(
            st.tuples(
                st.sampled_from((0.0, 0.05, 0.3, 1.0)), st.sampled_from(ids), st.integers(-3, 3)
            ),
            max_size=5,
        )
    )
    return tasks, moves


class TestOneWorker:
    @FUZZ
    @given(run=priority_runs())
    async def test_the_worker_takes_the_most_urgent_ready_task(
        self, run: tuple[list[Task], list[tuple[float, str, int]]]
    ) -> None:
        """With one worker, every call runs a task no ready task outranks, priority changes
        included (a ready task: its dependencies' calls ended, or, for a child, its spawner's)."""
        tasks, moves = run
        pick = Pick()
        async with fake_clock():
            orch = Orchestrator(agents=[PickAgent(k, pick) for k in KINDS], concurrency=1)
            async with orch:
                handle = orch.start(tasks=tasks)
                for delay, task_id, priority in moves:
                    await anyio.sleep(delay)
                    if handle.reprioritize(task_id, priority):
                        pick.log.append((pick.tick(), "move", (task_id, priority)))
                result = await handle
        assert result.status == "success"
        rank: dict[str, int] = {t.id or "": t.priority for t in tasks}
        deps = {t.id or "": list(t.depends_on) for t in tasks}
        spawns = {t.id or "" for t in tasks if t.payload["spawns"]}
        for t in tasks:
            rank[f"{t.id}/c"] = t.payload["child"]
            deps[f"{t.id}/c"] = [t.id or ""]
        started: set[str] = set()
        ended: set[str] = set()
        for _, what, detail in pick.log:
            if what == "move":
                rank[detail[0]] = detail[1]
            elif what == "end":
                ended.add(detail)
            else:
                ready = [
                    i
                    for i in rank
                    if i not in started
                    and all(d in ended for d in deps[i])
                    and ("/" not in i or i.split("/")[0] in spawns)
                ]
                best = min(rank[i] for i in ready)
                assert rank[detail] == best, (detail, {i: rank[i] for i in ready})
                started.add(detail)
