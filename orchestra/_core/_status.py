"""The status of a live run: what it has done, what it is doing, what it waits on, when it ends.

The run's `Report` counts as tasks end (`orchestra._core._report`: a few dict and int updates per task, no
clock read — the store already stamped the record). `snapshot(run)` reads the report, the store's
counters, the registry's agents and the router's lanes and returns a frozen `RunStatus`. The snapshot's cost is O(kinds + agents + priority levels + lanes),
never O(tasks), so a live view may poll it ten times a second on a run of a million tasks.

Definitions (the README's "Watching a run" says the same for users):

- **counts** by state: `pending` (waiting for dependencies or a group), `queued` (ready, waiting for
  a runner), `waiting` (claimed, waiting for room at an agent: its limit, a rate limit, an open
  breaker), `running`, `retrying` (between attempts, until a retry's due time), and the terminal
  `succeeded`, `failed`, `skipped`, `cancelled`.
- **throughput**: tasks ended per second over the last `WINDOW` seconds (a ring of one-second
  buckets), **recent error rate** the share of them that failed.
- **ETA**: for each kind, the remaining tasks times the mean duration of its ended tasks (the mean of
  all kinds for a kind with none ended yet), spread over the parallelism the kind has — the global
  limit, the limits of its agents whose breaker is not open, and no more than its remaining tasks;
  the run's ETA is the longest of those, or the whole remaining work over the global limit when
  the kinds together need more than it. A task's duration runs from its first attempt's start to
  its end (retries included), so the estimate learns the real cost of flaky agents.
- **bottleneck**: where the most tasks wait now. The agent (or kind) whose lane holds the most claimed
  tasks, with why (its limit, a rate limit, its breaker); else the global limit, when ready tasks
  queue while every slot is taken; else the kind with the longest ETA (the one the end of the run
  waits for). None when nothing is left.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from .._aggregate import percentile
from .._breaker import CLOSED, OPEN
from .._task import CANCELLED, FAILED, SKIPPED, SUCCEEDED
from ._report import ErrorSample, KindTally, Report, dollars

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from .._registry import AgentSlot, AgentState
    from ._run import Run

__all__ = (
    "AgentStatus",
    "Bottleneck",
    "ErrorSample",
    "KindStatus",
    "RunStatus",
    "snapshot",
)

WINDOW = 10  # seconds of history behind `throughput` and `recent_error_rate`
_UNLIMITED = sys.maxsize

_STATES = (
    "pending",
    "queued",
    "waiting",
    "running",
    "retrying",
    SUCCEEDED,
    FAILED,
    SKIPPED,
    CANCELLED,
)

RunState = Literal["starting", "running", "paused", "stopping", "finished"]


# -- what a snapshot shows ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KindStatus:
    """One kind of task in a run: how much is done and left, how long its tasks take, its ETA."""

    kind: str
    total: int  # admitted so far (spawned tasks once they can run)
    remaining: int
    succeeded: int
    failed: int
    skipped: int
    cancelled: int
    mean: float | None  # seconds per task, first attempt's start to end; None before one ended
    p95: float | None
    parallelism: int  # how many of its tasks can run at once (see the module's docstring)
    eta: float | None  # seconds until its remaining tasks are done at that parallelism

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class AgentStatus:
    """One agent now. Its counters and load are the orchestrator's (every run on it), except
    `waiting`, the tasks of this run waiting for room at it."""

    name: str
    kinds: tuple[str, ...]
    state: AgentState  # idle / busy / failing (recent health failures) / open (breaker open)
    breaker: str
    in_flight: int
    limit: int | None
    utilisation: float  # in_flight over its limit (or the global limit when it has none)
    waiting: int
    attempts: int
    succeeded: int
    failures: int
    last_error: str | None
    paused_for: float  # seconds left of a Retry-After that pauses it (0: none)
    next_probe_in: float | None = None  # its breaker is open: seconds to the next probe (0: due)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Bottleneck:
    """Where the run waits most now (see `orchestra._core._status` for the rule)."""

    reason: Literal[
        "agent limit", "rate limit", "breaker open", "kind", "concurrency", "slowest kind"
    ]
    agent: str | None = None
    kind: str | None = None
    waiting: int = 0  # tasks waiting there (0 for "slowest kind")

    def describe(self) -> str:
        where = self.agent or self.kind or "the global concurrency limit"
        if self.reason == "slowest kind":
            return f"kind {self.kind!r} (most work left)"
        if self.reason == "concurrency":
            return f"the global concurrency limit ({self.waiting} queued)"
        if self.agent is not None:
            return f"agent {where!r}: {self.reason} ({self.waiting} waiting)"
        return f"agents of kind {where!r} are full ({self.waiting} waiting)"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class RunStatus:
    """A run at one moment: counts, progress, pace, ETA, agents, queue, bottleneck, errors, spend
    (and the budget it is spent against).

    ``{"progress": ..., "active": ..., "completed": ...}`` (the seed's `get_status()`) is a subset of
    `to_dict()`. Times are seconds; `eta` is None until some task has ended (nothing to learn
    from yet). While a streamed input is still arriving (`input_complete` False), `total`,
    `progress` and `eta` cover the tasks admitted so far.
    """

    run_id: str
    state: RunState
    elapsed: float
    total: int
    completed: int  # ended, in any terminal state
    active: int  # attempts running now
    progress: float  # percent of `total` completed
    counts: Mapping[str, int]
    input_complete: bool
    throughput: float  # tasks ended per second over the last `window` seconds
    window: float
    eta: float | None
    error_rate: float  # failed / (succeeded + failed) over the run
    recent_error_rate: float  # the same over the last `window` seconds
    attempts: int
    retries: int
    fallbacks: int
    concurrency: int  # the global limit
    utilisation: float  # this run's running attempts over the global limit
    queue_by_priority: Mapping[int, int]
    kinds: tuple[KindStatus, ...]
    agents: tuple[AgentStatus, ...]
    bottleneck: Bottleneck | None
    errors: tuple[ErrorSample, ...]  # the last failed tasks, oldest first
    cost: float  # from `ctx.record_usage`
    tokens: Mapping[str, int]
    max_cost: float | None = None  # the run's budget (`Orchestrator(max_cost=...)`), USD
    max_tokens: int | None = None  # ... and in tokens of every kind together

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (priorities become string keys, as JSON objects need)."""
        data = asdict(self)
        data["counts"] = dict(self.counts)
        data["tokens"] = dict(self.tokens)
        data["queue_by_priority"] = {str(k): v for k, v in self.queue_by_priority.items()}
        data["kinds"] = [k.to_dict() for k in self.kinds]
        data["agents"] = [a.to_dict() for a in self.agents]
        data["agents"] = [{**a, "kinds": list(a["kinds"])} for a in data["agents"]]
        data["errors"] = [asdict(e) for e in self.errors]
        return data


# -- the snapshot ------------------------------------------------------------------------------


def snapshot(run: Run) -> RunStatus:
    """The status of `run` now. O(kinds + agents + priority levels + lanes), never O(tasks); call
    it on the run's event loop (it reads plain counters, without locks)."""
    report = run.report
    config = run.config
    limit = config.capacity.limit
    dispatcher = getattr(run, "dispatcher", None)
    store = getattr(run, "store", None)
    if dispatcher is None or store is None:  # not started yet
        return starting(run.run_id, limit)
    ended = run.ended
    now = (run.t_end if run.t_end is not None else dispatcher.now()) - run.t0
    unfinished: int = store.unfinished
    pending: int = store.pending
    running: int = dispatcher.running
    # A task cancelled (or timed out) while it was ready or waiting in a lane stays in that queue
    # or lane until a runner reaches it, and an attempt whose agent ignores its cancellation holds
    # its runner after its task ended: the states are capped by the tasks unfinished, so that
    # they add up to `total`, and a run with none unfinished has nothing queued or waiting.
    depths = _queue_depths(store) if unfinished else {}
    lanes = dispatcher.router.waiting() if unfinished else []
    room = max(0, unfinished - pending)
    in_attempts = min(running, room)
    queued = min(sum(depths.values()), room - in_attempts)
    held = min(sum(n for _, _, n in lanes), room - in_attempts - queued)

    succeeded = failed = skipped = cancelled = 0
    for k in report.kinds.values():
        succeeded += k.succeeded
        failed += k.failed
        skipped += k.skipped
        cancelled += k.cancelled
    completed = succeeded + failed + skipped + cancelled
    total = completed + unfinished
    counts = {
        "pending": pending,
        "queued": queued,
        "waiting": held,
        "running": in_attempts,
        "retrying": room - in_attempts - queued - held,
        "succeeded": succeeded,
        "failed": failed,
        "skipped": skipped,
        "cancelled": cancelled,
    }

    ended_w, failed_w, span = report.window(now, WINDOW)
    slots = config.registry.slots
    kinds = _kinds(report, unfinished, limit, config.registry.by_kind)
    # A paused (or stopping) run is not heading for an end, and one whose tasks wait for an
    # agent's breaker to close heads for it at the outage's pace: no time to it can be told.
    eta = (
        None
        if dispatcher.paused or _unwell(slots.values(), kinds)
        else _eta(kinds, limit, unfinished)
    )
    agents = _agents(slots.values(), lanes, limit, dispatcher.now())
    return RunStatus(
        run_id=run.run_id,
        state=(
            "finished"
            if ended
            else "stopping"
            if run.stopping
            else "paused"
            if dispatcher.paused
            else "running"
        ),
        elapsed=now,
        total=total,
        completed=completed,
        active=running,
        progress=100.0 * completed / total if total else 0.0,
        counts=counts,
        input_complete=run.input_complete,
        throughput=ended_w / span if span > 0 else 0.0,
        window=span,
        eta=eta,
        error_rate=failed / (succeeded + failed) if succeeded + failed else 0.0,
        recent_error_rate=failed_w / ended_w if ended_w else 0.0,
        attempts=report.attempts,
        retries=report.retries,
        fallbacks=report.fallbacks,
        concurrency=limit,
        utilisation=running / limit,
        queue_by_priority=depths,
        kinds=kinds,
        agents=agents,
        bottleneck=_bottleneck(lanes, kinds, queued, running, limit, dispatcher.now()),
        errors=tuple(report.errors),
        cost=dollars(report.cost),
        tokens=dict(report.tokens),
        max_cost=None if config.budget is None else config.budget.max_cost,
        max_tokens=None if config.budget is None else config.budget.max_tokens,
    )


def starting(run_id: str, limit: int) -> RunStatus:
    """The status of a run that has no tasks yet (its decomposer is at work)."""
    return RunStatus(
        run_id=run_id,
        state="starting",
        elapsed=0.0,
        total=0,
        completed=0,
        active=0,
        progress=0.0,
        counts=dict.fromkeys(_STATES, 0),
        input_complete=False,
        throughput=0.0,
        window=0.0,
        eta=None,
        error_rate=0.0,
        recent_error_rate=0.0,
        attempts=0,
        retries=0,
        fallbacks=0,
        concurrency=limit,
        utilisation=0.0,
        queue_by_priority={},
        kinds=(),
        agents=(),
        bottleneck=None,
        errors=(),
        cost=0.0,
        tokens={},
    )


def _queue_depths(store: Any) -> dict[int, int]:
    depths = getattr(store, "queue_depths", None)  # a store without a local queue has none
    return {} if depths is None else {p: n for p, n in depths().items() if n}


def _kinds(
    report: Report, unfinished: int, limit: int, by_kind: Mapping[str, list[AgentSlot]]
) -> tuple[KindStatus, ...]:
    # The kinds' own counts of what is left may drift from the store's exact `unfinished`
    # (idempotent re-admissions, spawned tasks not yet ready): the store's total wins, shared out
    # in proportion to the kinds' counts.
    left = {name: max(0, k.admitted - k.ended) for name, k in report.kinds.items()}
    counted = sum(left.values())
    scale = unfinished / counted if counted else 0.0
    all_count = sum(k.timed for k in report.kinds.values())
    all_mean = sum(k.busy for k in report.kinds.values()) / all_count if all_count else None
    out = []
    for name in sorted(report.kinds):
        k = report.kinds[name]
        remaining = round(left[name] * scale)
        mean = k.busy / k.timed if k.timed else None
        guess = mean if mean is not None else all_mean
        parallelism = _parallelism(by_kind.get(name, ()), limit)
        eta: float | None
        if not remaining:
            eta = 0.0
        elif guess is None:
            eta = None
        else:
            eta = remaining * guess / max(1, min(parallelism, remaining))
        out.append(
            KindStatus(
                kind=name,
                total=k.ended + remaining,
                remaining=remaining,
                succeeded=k.succeeded,
                failed=k.failed,
                skipped=k.skipped,
                cancelled=k.cancelled,
                mean=mean,
                p95=_p95(k) if k.timed else None,
                parallelism=parallelism,
                eta=eta,
            )
        )
    return tuple(out)


def _p95(k: KindTally) -> float:
    # Sorting the reservoir (up to 4096 values) costs ~0.3 ms: recomputed only when the kind's
    # count moved by more than 1/64 since, so a 10 Hz poll of a busy run stays cheap.
    sample = k.sample
    seen, value = k.p95
    if sample.count != seen and sample.count - seen >= max(1, seen >> 6):
        value = percentile(sorted(sample.sample), 0.95)
        k.p95 = (sample.count, value)
    return value


def _parallelism(slots: Iterable[AgentSlot], limit: int) -> int:
    """How many tasks of a kind can run at once: its agents' limits (those whose breaker is open
    left out, unless all are), within the global limit."""
    slots = list(slots)
    usable = [s for s in slots if s.breaker.state is not OPEN] or slots
    room = 0
    for slot in usable:
        concurrent = slot.concurrent
        if concurrent == _UNLIMITED:
            return limit
        room += concurrent
    return max(1, min(limit, room)) if usable else limit


def _unwell(slots: Iterable[AgentSlot], kinds: tuple[KindStatus, ...]) -> bool:
    """Whether an agent of a kind with tasks left has its breaker open (or probing). O(agents)."""
    left = {k.kind for k in kinds if k.remaining}
    return any(s.breaker.state is not CLOSED and not left.isdisjoint(s.kinds) for s in slots)


def _eta(kinds: tuple[KindStatus, ...], limit: int, unfinished: int) -> float | None:
    if not unfinished:
        return 0.0
    if any(k.eta is None for k in kinds if k.remaining) or not any(k.remaining for k in kinds):
        return None
    longest = max((k.eta or 0.0) for k in kinds)
    # The kinds share the global limit: together they cannot finish sooner than all their work
    # spread over it. (A kind without its own mean contributes the work its ETA was made of.)
    work = sum(
        k.remaining * k.mean
        if k.mean is not None
        else (k.eta or 0.0) * max(1, min(k.parallelism, k.remaining))
        for k in kinds
    )
    return max(longest, work / limit)


def _agents(
    slots: Iterable[AgentSlot],
    lanes: list[tuple[AgentSlot | None, str | None, int]],
    limit: int,
    now: float,
) -> tuple[AgentStatus, ...]:
    waiting: dict[str, int] = {}
    for slot, _, n in lanes:
        if slot is not None:
            waiting[slot.name] = waiting.get(slot.name, 0) + n
    out = []
    for slot in slots:
        concurrent = slot.concurrent
        own = None if concurrent == _UNLIMITED else concurrent
        room = min(limit, own) if own is not None else limit
        out.append(
            AgentStatus(
                name=slot.name,
                kinds=slot.kinds,
                state=slot.status(),
                breaker=slot.breaker.state,
                in_flight=slot.in_flight,
                limit=own,
                utilisation=slot.in_flight / room,
                waiting=waiting.get(slot.name, 0),
                attempts=slot.attempts,
                succeeded=slot.succeeded,
                failures=slot.failures,
                last_error=slot.last_error,
                paused_for=max(0.0, slot.paused_until - now),
                next_probe_in=slot.next_probe_in(now),
            )
        )
    return tuple(out)


def _bottleneck(
    lanes: list[tuple[AgentSlot | None, str | None, int]],
    kinds: tuple[KindStatus, ...],
    queued: int,
    running: int,
    limit: int,
    now: float,
) -> Bottleneck | None:
    if lanes:
        slot, kind, n = max(lanes, key=lambda lane: lane[2])
        if slot is None:
            return Bottleneck("kind", kind=kind, waiting=n)
        if slot.breaker.state is OPEN:
            reason: Any = "breaker open"
        elif slot.paused_until > now or (slot.limiters and slot.in_flight < slot.limit):
            reason = "rate limit"  # a Retry-After, or its limiters have no room before later
        else:
            reason = "agent limit"
        return Bottleneck(reason, agent=slot.name, kind=kind, waiting=n)
    if queued and running >= limit:
        return Bottleneck("concurrency", waiting=queued)
    left = [k for k in kinds if k.remaining]
    if not left:
        return None
    slowest = max(left, key=lambda k: math.inf if k.eta is None else k.eta)
    return Bottleneck("slowest kind", kind=slowest.kind)
