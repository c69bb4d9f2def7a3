"""One run, top to bottom: admit tasks, dispatch them to agents, retry, fall back, finish.

The dispatcher is a pool of worker coroutines (at most the concurrency limit, started as work
appears), each pulling the best dispatchable task from the ready-queue and awaiting the agent call
itself: no asyncio task per subtask, so 100k pending tasks are 100k small nodes, not 100k coroutines.
A task waiting for a retry holds no worker and no slot: a sleeper puts it back in the queue.

Every state change of a task goes through `_attempt`, `_failed_attempt`, `_fallback` and `_settle`;
the terminal transition (`_settle`) happens exactly once per task.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import AsyncIterable, Callable, Iterable, Mapping
from datetime import UTC, datetime, timedelta
from random import Random
from typing import TYPE_CHECKING, Any, Final

import anyio
import structlog

from ._aggregate import percentile
from ._breaker import CLOSED
from ._context import Context
from ._events import (
    AttemptFailed,
    AttemptStarted,
    AttemptSucceeded,
    BreakerChanged,
    FallbackUsed,
    RetryScheduled,
    RunFinished,
    RunStarted,
    TaskFinished,
    TaskReady,
)
from ._exceptions import (
    AttemptTimeout,
    InputError,
    Rejected,
    TaskTimeout,
    VerificationError,
)
from ._graph import Graph, Group, Node
from ._result import AttemptRecord, ErrorRecord, RunMetadata, RunResult, RunStatus, TimingStats
from ._retry import RetryPolicy, backoff, classify
from ._scheduler import ReadyQueue
from ._task import (
    CANCELLED,
    FAILED,
    PENDING,
    READY,
    RETRY_WAIT,
    RUNNING,
    SKIPPED,
    SUCCEEDED,
    TERMINAL,
    Attempt,
    Task,
    TaskResult,
)
from ._verify import check_output, check_safety, verify

if TYPE_CHECKING:
    from anyio.abc import TaskGroup
    from anyio.streams.memory import MemoryObjectSendStream

    from ._aggregate import Accumulator
    from ._events import EventBus
    from ._registry import AgentSlot, Registry
    from ._retry import Timeouts
    from ._verify import Check

__all__ = ("Capacity", "Node", "Run", "RunConfig", "remediation")

log = structlog.get_logger("orchestra")

_EXHAUSTED: Final = object()  # `_pick`: no agent of the chain can take the task any more


class Capacity:
    """The orchestrator-wide concurrency limit, shared by its concurrent runs."""

    __slots__ = ("blocked", "in_flight", "limit", "runs")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self.blocked = False  # a worker found the limit reached: wake the other runs on release
        self.runs: list[Run] = []


class RunConfig:
    """What a run takes from its orchestrator (built once per orchestrator)."""

    __slots__ = (
        "aggregate",
        "bus",
        "capacity",
        "defaults",
        "on_threshold_missed",
        "registry",
        "retry",
        "retry_per_kind",
        "safety",
        "seed",
        "success_threshold",
        "timeouts",
        "verify",
        "window",
    )

    def __init__(
        self,
        *,
        registry: Registry,
        capacity: Capacity,
        bus: EventBus,
        retry: RetryPolicy,
        retry_per_kind: Mapping[str, RetryPolicy],
        timeouts: Timeouts,
        defaults: Mapping[str, Any],
        verify: Mapping[str, Check],
        safety: Callable[[Task], Any] | None,
        success_threshold: float,
        window: int,
        aggregate: Any,
        seed: int | None,
        on_threshold_missed: Callable[..., Any] | None,
    ) -> None:
        self.registry = registry
        self.capacity = capacity
        self.bus = bus
        self.retry = retry
        self.retry_per_kind = retry_per_kind
        self.timeouts = timeouts
        self.defaults = defaults
        self.verify = verify
        self.safety = safety
        self.success_threshold = success_threshold
        self.window = window
        self.aggregate = aggregate
        self.seed = seed
        self.on_threshold_missed = on_threshold_missed


class Run:
    """The state and the loop of one run."""

    def __init__(
        self,
        config: RunConfig,
        run_id: str,
        results: MemoryObjectSendStream[TaskResult] | None = None,
    ) -> None:
        self.config = config
        self.run_id = run_id
        self.registry = config.registry
        self.graph = Graph(self.registry.by_kind)
        self.queue = ReadyQueue()
        self.bus = config.bus
        self.rng = Random(config.seed)
        self._results = results
        self._acc: Accumulator = config.aggregate.begin()
        self._tg: TaskGroup | None = None
        self._parked: list[asyncio.Future[None]] = []
        self._workers = 0
        self._open = 0  # admitted tasks not yet terminal
        self._closing = False
        self._done = anyio.Event()
        self._window_free: anyio.Event | None = None
        self._input_error: InputError | None = None
        self._time: Callable[[], float] = time.monotonic
        self.t0 = 0.0
        # statistics
        self.running = 0
        self.peak = 0
        self.attempts = 0
        self.retries = 0
        self.fallbacks = 0
        self.counts: dict[str, dict[str, int]] = {}
        self.per_agent: dict[str, int] = {}
        self.durations: dict[str, array[float]] = {}
        self.defaulted: list[str] = []
        self.not_ok: list[Node] = []
        self.tokens: dict[str, int] = {}
        self.cost = 0.0
        self.reason: str | None = None
        self.cancelled = False
        self._debug = _debug_enabled()

    # -- the run, top to bottom --------------------------------------------------------------

    async def execute(self, source: Iterable[Task] | AsyncIterable[Task]) -> RunResult:
        loop = asyncio.get_running_loop()
        self._time = loop.time
        self.t0 = self._time()
        wall0 = datetime.now(UTC)
        whole = isinstance(source, list | tuple)
        if whole:  # a whole input is checked before anything runs
            self._admit(source, where="tasks", forward=True)  # type: ignore[arg-type]
            self._input_done()
        capacity = self.config.capacity
        capacity.runs.append(self)
        if self.bus.active:
            self.bus.emit(RunStarted(self.t0, self.run_id))
        timed_out = False
        with structlog.contextvars.bound_contextvars(run_id=self.run_id):
            log.info("run started", tasks=self._open if whole else None)
            try:
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    if not whole:
                        tg.start_soon(self._feed, source)
                    self._spawn_workers()
                    self._check_done()
                    with anyio.move_on_after(self.config.timeouts.run) as scope:
                        await self._done.wait()
                    timed_out = scope.cancelled_caught
                    tg.cancel_scope.cancel()
            finally:
                capacity.runs.remove(self)
                if self._results is not None:
                    self._results.close()
            if self._input_error is not None:
                raise self._input_error
            if timed_out:
                self.reason = f"run timeout after {self.config.timeouts.run}s"
                for node in self.graph.unfinished():
                    self._settle(node, CANCELLED, None, error=self.reason)
            result = self._result(wall0)
            log.info(
                "run finished", status=result.status, elapsed=round(result.metadata.elapsed, 6)
            )
        if self.bus.active:
            self.bus.emit(
                RunFinished(self._time(), self.run_id, result.status, result.metadata.elapsed)
            )
        return result

    # -- admission -----------------------------------------------------------------------------

    def _admit(
        self, tasks: Iterable[Any], *, where: str, forward: bool, closed_ok: bool = True
    ) -> None:
        new, skipped = self.graph.admit(
            tasks, where=where, forward=forward, closed_groups_ok=closed_ok
        )
        self._open += len(new)
        for node, reason in skipped:
            self._settle(node, SKIPPED, None, error=reason)
        for node in new:
            if node.waiting == 0 and node.state is PENDING:
                self._ready(node)

    async def _feed(self, source: Iterable[Task] | AsyncIterable[Task]) -> None:
        """Admit a streamed input, keeping at most `window` tasks unfinished (backpressure)."""
        window = self.config.window
        try:
            if isinstance(source, AsyncIterable):
                async for task in source:
                    await self._admit_streamed(task, window)
            else:
                for task in source:
                    await self._admit_streamed(task, window)
        except InputError as exc:
            self._input_error = exc
            self._finish_now()
            return
        self._input_done()
        self._check_done()

    async def _admit_streamed(self, task: Task, window: int) -> None:
        while self._open >= window:
            event = self._window_free = anyio.Event()
            await event.wait()
        self._admit((task,), where=f"input item {self.graph.seq}", forward=False)

    def _input_done(self) -> None:
        self.graph.source_done = True
        for tag, group in self.graph.groups.items():
            self._maybe_close(tag, group)

    def check_spawn(self, task: Task, parent: Node, pending: list[Task]) -> None:
        """`ctx.spawn`: check a task now; it is admitted when the spawning attempt succeeds."""
        graph = self.graph
        graph.check(task, f"task spawned by {parent.id!r}")
        if task.id in graph.nodes or any(p.id == task.id for p in pending):
            raise InputError(
                f"task {parent.id!r} spawns duplicate task id {task.id!r}",
                task_id=task.id,
                field="id",
            )
        known = {p.id for p in pending}
        for dep in task.depends_on:
            if dep not in graph.nodes and dep not in known:
                raise InputError(
                    f"task {task.id!r} (spawned by {parent.id!r}) depends on unknown task {dep!r}",
                    task_id=task.id,
                    field="depends_on",
                )
        for tag in task.tags:
            group = graph.groups.get(tag)
            if group is not None and group.closed:
                raise InputError(
                    f"task {parent.id!r} spawns {task.id!r} into group {tag!r}, which is closed",
                    task_id=task.id,
                    field="tags",
                )

    def deps_of(self, node: Node) -> dict[str, Any]:
        return self.graph.deps_of(node)

    def record_usage(self, cost: float, tokens: Mapping[str, int]) -> None:
        self.cost += cost
        for name, n in tokens.items():
            self.tokens[name] = self.tokens.get(name, 0) + n

    # -- dispatch --------------------------------------------------------------------------------

    def _ready(self, node: Node) -> None:
        node.state = READY
        timeout = node.task.timeout or self.config.timeouts.task
        if timeout is not None and node.deadline is None:
            node.deadline = self._time() + timeout
        self.queue.push(node)
        if self.bus.active:
            self.bus.emit(TaskReady(self._time(), self.run_id, node.id, node.kind, node.priority))
        if self._parked:
            self._wake_one()
        elif self._tg is not None and self._workers < self.config.capacity.limit:
            self._workers += 1
            self._tg.start_soon(self._worker)

    def _spawn_workers(self) -> None:
        want = min(self.config.capacity.limit, len(self.queue)) - self._workers
        for _ in range(want):
            self._workers += 1
            self._tg.start_soon(self._worker)  # type: ignore[union-attr]

    def _wake_one(self) -> None:
        parked = self._parked
        while parked:
            waiter = parked.pop()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _worker(self) -> None:
        # Parking on a bare future (not an anyio.Event) is the cheapest wait there is: one
        # allocation; the worker is woken by `_wake_one` when a task is ready or a slot frees.
        loop = asyncio.get_running_loop()
        try:
            while True:
                picked = self._next()
                if picked is None:
                    if self._closing:
                        return
                    waiter = loop.create_future()
                    self._parked.append(waiter)
                    await waiter
                    continue
                await self._attempt(*picked)
        finally:
            self._workers -= 1

    def _next(self) -> tuple[Node, AgentSlot] | None:
        """The best ready task with an agent free to take it, taken out of the queue (or None)."""
        capacity = self.config.capacity
        queue = self.queue
        while queue.size:
            if capacity.in_flight >= capacity.limit:
                capacity.blocked = True
                return None
            best = None
            for heap, entry in queue.heads():
                if best is not None and entry[:2] > best[1][:2]:
                    continue
                slot = self._pick(entry[2])  # type: ignore[arg-type]
                if slot is not None:
                    best = (heap, entry, slot)
                    if slot is _EXHAUSTED:
                        break
            if best is None:
                return None
            heap, entry, slot = best
            node: Node = queue.take(heap)  # type: ignore[assignment]
            if slot is _EXHAUSTED:
                self._chain_end(node, "no agent left in the fallback chain (circuit breakers open)")
                continue
            if node.deadline is not None and self._time() >= node.deadline:
                self._settle(
                    node,
                    FAILED,
                    None,
                    error=f"task timeout after {node.task.timeout or self.config.timeouts.task}s before its attempt started",
                    error_type="TaskTimeout",
                )
                continue
            if slot.breaker.state is not CLOSED:
                self._breaker_changed(slot, slot.breaker.on_dispatch(self._time()))
            return node, slot
        return None

    def _pick(self, node: Node) -> Any:
        """The agent for `node` now: a slot, None (all busy: wait), or _EXHAUSTED."""
        slot = node.agent
        if slot is None:
            chain = self.registry.chains.get(node.kind)
            if chain is not None:
                slot = node.agent = chain[node.chain_pos]
            else:
                return self._least_loaded(node)
        breaker = slot.breaker
        if breaker.state is not CLOSED and not breaker.available(self._time()):
            return self._skip_open(node, slot)
        return slot if slot.in_flight < slot.limit else None

    def _least_loaded(self, node: Node) -> Any:
        candidates = self.registry.by_kind[node.kind]
        tried = node.tried
        best = None
        healthy = False
        now = None
        for slot in candidates:
            if tried is not None and slot in tried:
                continue
            breaker = slot.breaker
            if breaker.state is not CLOSED:
                if now is None:
                    now = self._time()
                if not breaker.available(now):
                    continue
            healthy = True
            if slot.in_flight < slot.limit and (best is None or slot.load < best.load):
                best = slot
        if best is not None:
            return best
        return None if healthy else _EXHAUSTED

    def _skip_open(self, node: Node, slot: AgentSlot) -> Any:
        """`node`'s agent has an open breaker: go straight to the next agent of the chain."""
        self._mark_tried(node, slot)
        nxt = self._next_in_chain(node)
        self._emit_fallback(node, slot, nxt, "circuit breaker open")
        if nxt is None:
            return _EXHAUSTED
        return self._pick(node)

    # -- attempts ------------------------------------------------------------------------------

    async def _attempt(self, node: Node, slot: AgentSlot) -> None:
        capacity = self.config.capacity
        capacity.in_flight += 1
        slot.in_flight += 1
        self.running += 1
        if self.running > self.peak:
            self.peak = self.running
        node.state = RUNNING
        node.agent = slot
        node.attempts += 1
        node.agent_tries += 1
        slot.attempts += 1
        self.attempts += 1
        task = node.task
        start = self._time()
        if node.started is None:
            node.started = start
        ctx = Context(self, node, slot.name, node.attempts, node.feedback)
        bus = self.bus if self.bus.active else None
        if bus is not None:
            bus.emit(
                AttemptStarted(start, self.run_id, node.id, node.kind, slot.name, node.attempts)
            )
        try:
            call = slot.call if slot.fault is None else slot.fault.wrap(slot.call)
            if self.config.safety is not None and node.attempts == 1:
                await check_safety(self.config.safety, task)
            deadline = self._deadline(node, slot, start)
            if deadline is None:
                output = await call(task, ctx)
            else:
                with anyio.CancelScope(deadline=deadline) as scope:
                    output = await call(task, ctx)
                if scope.cancelled_caught:
                    if node.deadline is not None and deadline >= node.deadline:
                        raise TaskTimeout(
                            f"task timeout after {task.timeout or self.config.timeouts.task}s"
                        )
                    raise AttemptTimeout(
                        f"attempt timeout after {deadline - start:.3g}s on agent {slot.name!r}"
                    )
            if slot.output is not None:
                output = check_output(slot.output, output)
            check = self.config.verify.get(node.kind)
            if check is not None:
                await verify(check, task, output)
            if ctx._spawned:
                self._admit(
                    ctx._spawned,
                    where=f"tasks spawned by {node.id!r}",
                    forward=False,
                    closed_ok=False,
                )
        except Exception as exc:
            self._failed_attempt(node, slot, exc, start)
        else:
            end = self._time()
            slot.succeeded += 1
            if slot.breaker.state is not CLOSED or slot.breaker.consecutive:
                self._breaker_changed(slot, slot.breaker.on_success())
            if bus is not None:
                bus.emit(
                    AttemptSucceeded(
                        end, self.run_id, node.id, node.kind, slot.name, node.attempts, end - start
                    )
                )
            self._settle(node, SUCCEEDED, output, agent=slot.name)
        finally:
            capacity.in_flight -= 1
            slot.in_flight -= 1
            self.running -= 1
            if node.state is RUNNING:  # cancelled mid-call: the probe (if it was one) ends unjudged
                slot.breaker.on_abandon()
            if capacity.blocked:
                capacity.blocked = False
                for run in capacity.runs:
                    run._wake_one()
            elif self._parked:
                self._wake_one()

    def _deadline(self, node: Node, slot: AgentSlot, start: float) -> float | None:
        timeout = slot.timeout or self.config.timeouts.attempt
        deadline = None if timeout is None else start + timeout
        if node.deadline is not None and (deadline is None or node.deadline < deadline):
            return node.deadline
        return deadline

    def _failed_attempt(self, node: Node, slot: AgentSlot, exc: Exception, start: float) -> None:
        end = self._time()
        policy = slot.retry or self.config.retry_per_kind.get(node.kind) or self.config.retry
        retryable, retry_after = classify(exc, policy)
        error_type = type(exc).__name__
        message = _message(exc)
        slot.failures += 1
        slot.last_error = f"{error_type}: {message}"
        if not isinstance(exc, VerificationError | Rejected | InputError):
            self._breaker_changed(slot, slot.breaker.on_failure(end))
        attempt = Attempt(
            number=node.attempts,
            agent=slot.name,
            error_type=error_type,
            message=message,
            started=start - self.t0,
            duration=end - start,
        )
        if node.failures is None:
            node.failures = [attempt]
        else:
            node.failures.append(attempt)
        node.feedback.append(
            exc.feedback if isinstance(exc, VerificationError) else f"{error_type}: {message}"
        )
        if isinstance(exc, VerificationError):
            node.output = exc.output  # kept as the partial output if the task fails in the end
        if self.bus.active:
            self.bus.emit(
                AttemptFailed(
                    end,
                    self.run_id,
                    node.id,
                    node.kind,
                    slot.name,
                    node.attempts,
                    error_type,
                    message,
                    retryable,
                    end - start,
                )
            )
        if self._debug:
            log.debug(
                "attempt failed",
                task_id=node.id,
                agent=slot.name,
                attempt=node.attempts,
                error=f"{error_type}: {message}",
            )
        if isinstance(exc, TaskTimeout | Rejected):
            self._settle(
                node, FAILED, None, error=f"{error_type}: {message}", error_type=error_type
            )
            return
        if retryable and node.agent_tries < policy.max_attempts:
            delay = backoff(policy, node.agent_tries - 1, self.rng, retry_after)
            if node.deadline is not None and end + delay >= node.deadline:
                self._settle(
                    node,
                    FAILED,
                    None,
                    error=f"task timeout: the retry in {delay:.3g}s would pass the task's deadline",
                    error_type="TaskTimeout",
                )
                return
            attempt.retry_in = delay
            node.state = RETRY_WAIT
            self.retries += 1
            if self.bus.active:
                self.bus.emit(
                    RetryScheduled(
                        end, self.run_id, node.id, node.kind, slot.name, node.attempts, delay
                    )
                )
            self._tg.start_soon(self._retry_later, node, delay)  # type: ignore[union-attr]
            return
        reason = "permanent error" if not retryable else f"{policy.max_attempts} attempts failed"
        self._mark_tried(node, slot)
        nxt = self._next_in_chain(node)
        self._emit_fallback(node, slot, nxt, reason)
        if nxt is None:
            self._chain_end(node, reason)
        else:
            self._ready(node)

    async def _retry_later(self, node: Node, delay: float) -> None:
        await anyio.sleep(delay)
        if node.state is RETRY_WAIT:
            self._ready(node)

    def _mark_tried(self, node: Node, slot: AgentSlot) -> None:
        if node.tried is None:
            node.tried = [slot]
        elif slot not in node.tried:
            node.tried.append(slot)
        node.agent_tries = 0

    def _next_in_chain(self, node: Node) -> AgentSlot | None:
        """Move `node` to the next agent of its chain; None when the chain has run out."""
        chain = self.registry.chains.get(node.kind)
        if chain is not None:
            node.chain_pos += 1
            if node.chain_pos >= len(chain):
                node.agent = None
                return None
            node.agent = chain[node.chain_pos]
            return node.agent
        node.agent = None  # `_least_loaded` picks among the agents not tried yet
        tried = node.tried or ()
        return next((s for s in self.registry.by_kind[node.kind] if s not in tried), None)

    def _emit_fallback(
        self, node: Node, slot: AgentSlot, nxt: AgentSlot | None, reason: str
    ) -> None:
        if nxt is not None:
            self.fallbacks += 1
        if self.bus.active:
            self.bus.emit(
                FallbackUsed(
                    self._time(),
                    self.run_id,
                    node.id,
                    node.kind,
                    slot.name,
                    None if nxt is None else nxt.name,
                    reason,
                )
            )

    def _chain_end(self, node: Node, reason: str) -> None:
        """Every agent of the chain failed the task: its default value, or a failure."""
        defaults = self.config.defaults
        if node.kind in defaults:
            self.defaulted.append(node.id)
            self._settle(node, SUCCEEDED, defaults[node.kind], agent=None, defaulted=True)
            return
        last = node.failures[-1] if node.failures else None
        error_type = last.error_type if last is not None else "BreakerOpen"
        message = f"{last.error_type}: {last.message}" if last is not None else reason
        self._settle(node, FAILED, None, error=message, error_type=error_type)

    def _breaker_changed(self, slot: AgentSlot, state: str | None) -> None:
        if state is None:
            return
        previous = {"open": "closed", "half_open": "open", "closed": "half_open"}[state]
        log.warning("circuit breaker changed", agent=slot.name, state=state, previous=previous)
        if self.bus.active:
            self.bus.emit(BreakerChanged(self._time(), self.run_id, slot.name, state, previous))

    # -- the terminal transition ---------------------------------------------------------------

    def _settle(
        self,
        node: Node,
        status: str,
        output: Any,
        *,
        agent: str | None = None,
        error: str | None = None,
        error_type: str | None = None,
        defaulted: bool = False,
    ) -> None:
        """Put `node` (and what can no longer run because of it) in a terminal state, once."""
        cascade: list[tuple[Node, str]] | None = None
        while True:
            if node.state not in TERMINAL:
                cascade = self._settle_one(
                    node, status, output, agent, error, error_type, defaulted, cascade
                )
            if not cascade:
                return
            node, error = cascade.pop()
            status, output, agent, error_type, defaulted = (
                SKIPPED,
                None,
                None,
                "DependencyFailed",
                False,
            )

    def _settle_one(
        self,
        node: Node,
        status: str,
        output: Any,
        agent: str | None,
        error: str | None,
        error_type: str | None,
        defaulted: bool,
        cascade: list[tuple[Node, str]] | None,
    ) -> list[tuple[Node, str]] | None:
        if node.state is READY:
            self.queue.discard(node)
        node.state = status
        end = self._time()
        if status is SUCCEEDED:
            node.output = output
        result = TaskResult(
            node.task,
            node.seq,
            status,  # type: ignore[arg-type]
            node.output,
            agent,
            node.attempts,
            node.failures,
            None if node.started is None else node.started - self.t0,
            end - self.t0,
            error,
            defaulted,
            error_type,
        )
        node.result = result
        kind = node.kind
        counts = self.counts.get(kind)
        if counts is None:
            counts = self.counts[kind] = {}
        counts[status] = counts.get(status, 0) + 1
        if node.started is not None:
            durations = self.durations.get(kind)
            if durations is None:
                durations = self.durations[kind] = array("d")
            durations.append(end - node.started)
        graph = self.graph
        if status is SUCCEEDED:
            if agent is not None:
                self.per_agent[agent] = self.per_agent.get(agent, 0) + 1
            self._acc.add(result)
            dependents = node.dependents
            if dependents:
                for dep in dependents:
                    dep.waiting -= 1
                    if dep.waiting == 0 and dep.state is PENDING:
                        self._ready(dep)
        else:
            self.not_ok.append(node)
            if node.dependents:
                if cascade is None:
                    cascade = []
                reason = f"dependency {node.id!r} {status}"
                cascade.extend((dep, reason) for dep in node.dependents)
        node.dependents = None
        task = node.task
        if task.tags:
            for tag in task.tags:
                group = graph.groups[tag]
                group.open -= 1
                if status is not SUCCEEDED and group.failed is None:
                    group.failed = f"group {tag!r} member {node.id!r} {status}"
                    if cascade is None:
                        cascade = []
                    cascade.extend((w, group.failed) for w in group.waiters if w.state is PENDING)
                self._maybe_close(tag, group)
        if node.id in graph.groups:
            self._maybe_close(node.id, graph.groups[node.id])
        if self._debug:
            log.debug("task finished", task_id=node.id, kind=kind, status=status, agent=agent)
        if self.bus.active:
            self.bus.emit(TaskFinished(end, self.run_id, result))
        if self._results is not None:
            try:
                self._results.send_nowait(result)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._results = None  # the stream's reader went away; the run goes on
        self._open -= 1
        if self._window_free is not None and self._open < self.config.window:
            self._window_free.set()
            self._window_free = None
        if self._open == 0:
            self._check_done()
        return cascade

    def _maybe_close(self, tag: str, group: Group) -> None:
        # Only a group that somebody waits for is closed (and then refuses new members); a waiter
        # that arrives later finds a closable group satisfied (`Graph._wire`).
        if not group.waiters or not self.graph.closable(tag, group):
            return
        group.closed = True
        if group.failed is not None:
            return  # the waiters were skipped when the group failed
        for waiter in group.waiters:
            waiter.waiting -= 1
            if waiter.waiting == 0 and waiter.state is PENDING:
                self._ready(waiter)

    def _check_done(self) -> None:
        if self._open == 0 and self.graph.source_done:
            self._finish_now()

    def _finish_now(self) -> None:
        self._closing = True
        self._done.set()
        while self._parked:
            self._wake_one()

    # -- the result ------------------------------------------------------------------------------

    def _result(self, wall0: datetime) -> RunResult:
        elapsed = self._time() - self.t0
        total = sum(sum(c.values()) for c in self.counts.values())
        by_status: dict[str, int] = dict.fromkeys((SUCCEEDED, FAILED, SKIPPED, CANCELLED), 0)
        for counts in self.counts.values():
            for state, n in counts.items():
                by_status[state] += n
        succeeded = by_status[SUCCEEDED]
        rate = succeeded / total if total else 1.0
        threshold = self.config.success_threshold
        critical_failed = [n.id for n in self.not_ok if n.task.critical]
        status: RunStatus
        if self.cancelled:
            status = "cancelled"
        elif succeeded == total:
            status = "success"
        elif rate >= threshold and not critical_failed:
            status = "partial"
        else:
            status = "failed"
            if critical_failed and self.reason is None:
                self.reason = f"critical task {critical_failed[0]!r} did not succeed"
            elif self.reason is None:
                self.reason = f"success rate {rate:.3f} is below the threshold {threshold}"
        try:
            data = self._acc.finish()
        except Exception as exc:  # a user's reducer must not lose the run's result
            log.error("aggregator failed", exc_info=True)
            data = None
            self.reason = f"aggregator raised {type(exc).__name__}: {exc}"
        errors = [_error_record(node) for node in sorted(self.not_ok, key=_by_seq)]
        metadata = RunMetadata(
            run_id=self.run_id,
            started_at=wall0,
            finished_at=wall0 + timedelta(seconds=elapsed),
            elapsed=elapsed,
            total=total,
            counts=by_status,
            counts_by_kind={k: dict(sorted(v.items())) for k, v in sorted(self.counts.items())},
            success_rate=rate,
            success_threshold=threshold,
            attempts=self.attempts,
            retries=self.retries,
            fallbacks=self.fallbacks,
            agents_used=sorted(self.per_agent),
            tasks_per_agent=dict(sorted(self.per_agent.items())),
            time_per_kind={k: _timing(v) for k, v in sorted(self.durations.items())},
            peak_concurrency=self.peak,
            defaulted=self.defaulted,
            tokens=dict(sorted(self.tokens.items())),
            cost=self.cost,
            events_dropped=self.bus.dropped,
            reason=self.reason,
        )
        return RunResult(status=status, data=data, metadata=metadata, errors=errors)


def _by_seq(node: Node) -> int:
    return node.seq


def _timing(values: array[float]) -> TimingStats:
    ordered = sorted(values)
    return TimingStats(
        count=len(ordered),
        mean=sum(ordered) / len(ordered),
        p50=percentile(ordered, 0.5),
        p95=percentile(ordered, 0.95),
        max=ordered[-1],
    )


def _error_record(node: Node) -> ErrorRecord:
    result = node.result
    assert result is not None
    failures = node.failures or []
    error_type = result.error_type or (failures[-1].error_type if failures else "Error")
    message = result.error or (
        f"{failures[-1].error_type}: {failures[-1].message}" if failures else ""
    )
    return ErrorRecord(
        task_id=node.id,
        kind=node.kind,
        status=result.status,  # type: ignore[arg-type]
        error_type=error_type,
        message=message,
        attempts=[
            AttemptRecord(
                number=a.number,
                agent=a.agent,
                error_type=a.error_type,
                message=a.message,
                started=a.started,
                duration=a.duration,
                retry_in=a.retry_in,
            )
            for a in failures
        ],
        remediation=remediation(result.status, error_type, message, node),
        critical=node.task.critical,
        partial_output=node.output if result.status == FAILED else None,
    )


def remediation(status: str, error_type: str, message: str, node: Node) -> str:
    """A suggestion for the user, from what went wrong."""
    if status == SKIPPED:
        return f"Fix what failed first ({message}); this task runs once its dependencies succeed."
    if status == CANCELLED:
        return "The run was stopped before this task finished: raise the run timeout or re-run it."
    lowered = message.lower()
    if error_type == "TaskTimeout":
        return "Raise the task's timeout, lower its attempts or backoff, or speed up its agents."
    if error_type == "AttemptTimeout":
        return "Raise the attempt timeout (Timeouts(attempt=...) or @agent(timeout=...)) or check the agent's latency."
    if error_type == "Rejected":
        return "The safety check refused this task: change its payload or the check."
    if error_type == "VerificationError":
        return "The output kept failing verification: improve the agent or its prompt, or relax the verifier."
    if "429" in message or "rate" in lowered:
        return "The agent is rate limited: lower concurrency or the agent's limit, or raise your API quota."
    if error_type in ("ValidationError", "InputError", "PermanentError") or "400" in message:
        return "The request is invalid for this agent: fix the payload; retrying will not help."
    if error_type == "BreakerOpen":
        return "Every agent of the chain has an open circuit breaker: check the agents' health or add a fallback."
    return (
        "Add a fallback agent for this kind, raise max_attempts, or check the agent's error above."
    )


def _message(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 500 else text[:497] + "..."


def _debug_enabled() -> bool:
    """Whether per-task DEBUG lines are wanted: only when the application configured structlog
    (its unconfigured default prints every level, which would be a line per task) and at DEBUG."""
    if not structlog.is_configured():
        return False
    logger = structlog.get_logger("orchestra").bind()
    probe = getattr(logger, "is_enabled_for", None)
    return bool(probe(10)) if probe is not None else True
