"""The dispatcher: a pool of worker coroutines, each taking the best dispatchable task and calling
its agent, then retrying, falling back or finishing it.

No asyncio task per subtask: at most `concurrency` workers (started as work appears) pull from the
ready-queue and await the agent call themselves, so 100k pending tasks are 100k small nodes, not
100k coroutines, and the common path is a handful of attribute updates around one `await`.
A task waiting for its retry holds no worker and no slot: a sleeper puts it back in the queue.
Limits: the global one is a counter shared by the orchestrator's runs, the per-agent ones are
counters on the agents' slots; a worker takes a task only when both have room, and the `finally`
of every attempt gives both back, so they hold under errors and cancellation alike.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
from heapq import heappop, heappush
from random import Random
from typing import TYPE_CHECKING, Any, Final

import anyio
import structlog

from ._breaker import CLOSED
from ._context import Context
from ._events import (
    AttemptFailed,
    AttemptStarted,
    AttemptSucceeded,
    BreakerChanged,
    FallbackUsed,
    RetryScheduled,
    TaskReady,
)
from ._exceptions import AttemptTimeout, InputError, Rejected, TaskTimeout, VerificationError
from ._failure import check_returned, describe
from ._retry import RetryPolicy, Timeouts, backoff, classify
from ._scheduler import ReadyQueue
from ._task import FAILED, PENDING, READY, RETRY_WAIT, RUNNING, SUCCEEDED, Attempt
from ._verify import check_output, check_safety, verify

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Mapping

    from ._events import EventBus
    from ._graph import Node
    from ._registry import AgentSlot, Registry
    from ._report import Report
    from ._task import Task
    from ._verify import Check

__all__ = ("Capacity", "Dispatcher", "RunConfig")

log = structlog.get_logger("orchestra")

# The task id in structlog's context, for every log line of the agent call. Named as
# `structlog.contextvars.bind_contextvars` names its variables, so `merge_contextvars` picks it up;
# set directly (0.1 µs, against 1.5 µs for bind + reset): each worker runs in its own copy of the
# context, so the value never leaks out of the worker.
_TASK_ID: Final = contextvars.ContextVar[Any]("structlog_task_id", default=...)
_EXHAUSTED: Final = object()  # `_pick`: no agent of the chain can take the task any more
_YIELD_EVERY = 64  # a worker whose agents never suspend still lets the loop run this often


class Capacity:
    """The orchestrator-wide concurrency limit, shared by its concurrent runs."""

    __slots__ = ("blocked", "in_flight", "limit", "runs")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self.blocked = False  # a worker found the limit reached: wake the other runs on release
        self.runs: list[Dispatcher] = []


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


class Dispatcher:
    """Workers, agent choice and the attempt loop of one run. `Run` adds admission and settling."""

    def __init__(self, config: RunConfig, run_id: str) -> None:
        self.config = config
        self.run_id = run_id
        self.registry = config.registry
        self.queue = ReadyQueue()
        self.bus = config.bus
        self.rng = Random(config.seed)
        self.report: Report
        self._capacity = config.capacity
        self._chains = config.registry.chains
        # Kinds served by one agent and no chain: no choice to make at dispatch.
        self._only: dict[str, AgentSlot] = {
            kind: slots[0]
            for kind, slots in config.registry.by_kind.items()
            if len(slots) == 1 and kind not in config.registry.chains
        }
        self._verify = config.verify
        self._safety = config.safety
        self._attempt_timeout = config.timeouts.attempt
        self._task_timeout = config.timeouts.task
        # The run's own tasks (workers, retry sleepers, the deadline watcher, the input feeder)
        # live in an asyncio.TaskGroup that `Run.execute` owns: starting a task there costs a
        # third of anyio's `start_soon` (measured ~9 µs against ~28 µs here), which is what a
        # pool of hundreds of workers pays before the first call. `_tasks` lets the run cancel
        # what is left when it is over.
        self._pool: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._parked: list[asyncio.Future[None]] = []
        self._workers = 0
        self._closing = False
        self._running = 0
        self._open = 0  # admitted tasks not yet terminal
        self._active = 0  # tasks ready, running or waiting for a retry (the window's measure)
        self._deadlines: list[tuple[float, int, Node]] = []  # task deadlines of queued tasks
        self._watch_wake: anyio.Event | None = None
        self._watching = False
        self._time: Callable[[], float] = anyio.current_time
        self.t0 = 0.0
        self._debug = False  # per-task DEBUG lines wanted (set by `Run`)

    # Defined by `Run`: the terminal transition of a task.
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
        raise NotImplementedError

    def _admit_spawned(self, tasks: list[Task], parent: Node) -> None:
        raise NotImplementedError

    # -- workers ---------------------------------------------------------------------------------

    def _ready(self, node: Node) -> None:
        if node.state is PENDING:
            self._active += 1
        node.state = READY
        if node.deadline is None:
            timeout = node.task.timeout or self._task_timeout
            if timeout is not None:
                node.deadline = self._time() + timeout
        if node.deadline is not None:
            self._watch(node)  # again after a retry: the watcher forgot it while it ran
        self.queue.push(node)
        if self.bus.active and self.bus.wants(TaskReady):
            self.bus.emit(TaskReady(self._time(), self.run_id, node.id, node.kind, node.priority))
        if self._parked:
            self._wake_one()
        elif self._pool is not None and self._workers < self._capacity.limit:
            self._workers += 1
            self._spawn(self._worker())

    def _watch(self, node: Node) -> None:
        """Fail `node` at its deadline if it is still waiting in the queue then (running attempts
        have their own cancel scope; retries check before they wait)."""
        deadline: float = node.deadline  # type: ignore[assignment]  # set by `_ready`
        heappush(self._deadlines, (deadline, node.seq, node))
        if self._watch_wake is not None:
            self._watch_wake.set()
        elif self._pool is not None and not self._watching:
            self._watching = True
            self._spawn(self._watcher())

    async def _watcher(self) -> None:
        deadlines = self._deadlines
        while True:
            while deadlines and deadlines[0][2].state is not READY:
                heappop(deadlines)  # started, retried or done: its deadline is handled elsewhere
            if not deadlines:
                self._watching = False
                return
            now = self._time()
            deadline, _, node = deadlines[0]
            if deadline <= now:
                heappop(deadlines)
                self._chain_end(
                    node,
                    f"the deadline passed while the task waited for attempt {node.attempts + 1}",
                    "TaskTimeout",
                )
                continue
            wake = self._watch_wake = anyio.Event()
            with anyio.move_on_after(deadline - now):
                await wake.wait()
            self._watch_wake = None

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self._pool.create_task(coro)  # type: ignore[union-attr]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _cancel_all(self) -> None:
        for task in self._tasks:
            task.cancel()

    def _start_workers(self, pool: asyncio.TaskGroup) -> None:
        self._pool = pool
        if self._deadlines and not self._watching:
            self._watching = True
            self._spawn(self._watcher())
        for _ in range(min(self._capacity.limit, len(self.queue)) - self._workers):
            self._workers += 1
            self._spawn(self._worker())

    def _wake_one(self) -> None:
        parked = self._parked
        while parked:
            waiter = parked.pop()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _stop_workers(self) -> None:
        self._closing = True
        while self._parked:
            self._wake_one()

    async def _worker(self) -> None:
        # Parking on a bare future (not an anyio.Event) is the cheapest wait there is: one
        # allocation; `_wake_one` wakes a worker when a task is ready or a slot frees.
        loop = asyncio.get_running_loop()
        done = 0
        try:
            while True:
                picked = self._next()
                if picked is None:
                    # Nothing to do. If every unfinished task is running, nothing can become
                    # ready but through them (a retry, a spawn, a dependent), and `_ready` starts
                    # a worker then: leave now rather than be woken at the end only to leave.
                    if self._closing or self._open <= self._running:
                        return
                    waiter = loop.create_future()
                    self._parked.append(waiter)
                    await waiter
                    continue
                await self._attempt(*picked)
                done += 1
                if not done % _YIELD_EVERY:
                    await asyncio.sleep(0)
        finally:
            self._workers -= 1

    def _next(self) -> tuple[Node, AgentSlot] | None:
        """The best ready task with an agent free to take it, taken out of the queue (or None)."""
        capacity = self._capacity
        queue = self.queue
        while queue.size:
            if capacity.in_flight >= capacity.limit:
                capacity.blocked = True
                return None
            best: Node | None = None
            best_queue = best_slot = None
            for kind_queue in queue.kinds.values():
                node = kind_queue.head()
                if node is None:
                    continue
                if best is not None and (
                    node.priority > best.priority
                    or (node.priority == best.priority and node.qseq > best.qseq)
                ):
                    continue
                slot = self._pick(node)
                if slot is not None:
                    best, best_queue, best_slot = node, kind_queue, slot
                    if slot is _EXHAUSTED:
                        break
            if best is None:
                return None
            node = queue.take(best_queue)  # type: ignore[arg-type]
            if best_slot is _EXHAUSTED:
                self._chain_end(node, "every agent of the chain has an open circuit breaker")
                continue
            if node.deadline is not None and self._time() >= node.deadline:
                self._chain_end(
                    node,
                    f"the deadline passed before attempt {node.attempts + 1} started",
                    "TaskTimeout",
                )
                continue
            slot = best_slot
            breaker = slot.breaker  # type: ignore[union-attr]
            if breaker.state is not CLOSED:
                self._breaker_changed(slot, breaker.state, breaker.on_dispatch(self._time()))  # type: ignore[arg-type]
            return node, slot  # type: ignore[return-value]
        return None

    def _pick(self, node: Node) -> Any:
        """The agent for `node` now: a slot, None (all busy: wait), or _EXHAUSTED."""
        slot = node.slot
        if slot is None:
            slot = self._only.get(node.kind)
            if slot is None or node.tried is not None:
                chain = self._chains.get(node.kind)
                if chain is None:
                    return self._least_loaded(node)
                slot = node.slot = chain[node.chain_pos]
        breaker = slot.breaker
        if breaker.state is not CLOSED and not breaker.available(self._time()):
            return self._skip_open(node, slot)
        return slot if slot.in_flight < slot.limit else None

    def _least_loaded(self, node: Node) -> Any:
        tried = node.tried
        best = None
        healthy = False
        for slot in self.registry.by_kind[node.kind]:
            if tried is not None and slot in tried:
                continue
            breaker = slot.breaker
            if breaker.state is not CLOSED and not breaker.available(self._time()):
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

    # -- one attempt -----------------------------------------------------------------------------

    async def _attempt(self, node: Node, slot: AgentSlot) -> None:
        capacity = self._capacity
        capacity.in_flight += 1
        slot.in_flight += 1
        self._running += 1
        report = self.report
        if self._running > report.peak:
            report.peak = self._running
        node.state = RUNNING
        node.slot = slot
        task = node.task
        _TASK_ID.set(node.id)
        try:
            if self._safety is not None and not node.attempts and not await self._safe(node):
                return
            node.attempts += 1
            node.agent_tries += 1
            slot.attempts += 1
            report.attempts += 1
            start = self._time()
            if node.t_start is None:
                node.t_start = start
            ctx = Context(self, node, slot.name, node.attempts, node.feedback or ())  # type: ignore[arg-type]
            bus = self.bus if self.bus.active else None
            if bus is not None and bus.wants(AttemptStarted):
                bus.emit(
                    AttemptStarted(start, self.run_id, node.id, node.kind, slot.name, node.attempts)
                )
            try:
                if (
                    node.deadline is None
                    and slot.fault is None
                    and slot.timeout is None
                    and self._attempt_timeout is None
                    and slot.output is None
                    and not self._verify
                ):
                    output = await slot.call(task, ctx)  # the common case: nothing around the call
                    check_returned(output, slot.name)
                elif node.deadline is None:
                    output = await self._call(node, slot, ctx, start)
                else:
                    # The task's deadline bounds the whole attempt: the call, the verifier, and
                    # what runs around them.
                    with anyio.CancelScope(deadline=node.deadline) as scope:
                        output = await self._call(node, slot, ctx, start)
                    if scope.cancelled_caught:
                        raise TaskTimeout(
                            f"task timeout: {task.timeout or self._task_timeout}s passed"
                        )
                if ctx._spawned:
                    self._admit_spawned(ctx._spawned, node)
            except asyncio.CancelledError as exc:
                # Ours (the run is cancelled, or a deadline passed): let it unwind. One the agent
                # raised by itself (no cancellation pending on this task): a failed attempt.
                current = asyncio.current_task()
                if current is None or current.cancelling():
                    raise
                self._failed_attempt(node, slot, exc, start)
            except Exception as exc:
                self._failed_attempt(node, slot, exc, start)
            else:
                slot.succeeded += 1
                breaker = slot.breaker
                if breaker.consecutive or breaker.state is not CLOSED or breaker.recent is not None:
                    self._breaker_changed(slot, breaker.state, breaker.on_success())
                if bus is not None and bus.wants(AttemptSucceeded):
                    end = self._time()
                    bus.emit(
                        AttemptSucceeded(
                            end,
                            self.run_id,
                            node.id,
                            node.kind,
                            slot.name,
                            node.attempts,
                            end - start,
                        )
                    )
                self._settle(node, SUCCEEDED, output, agent=slot.name)
        finally:
            capacity.in_flight -= 1
            slot.in_flight -= 1
            self._running -= 1
            if node.state is RUNNING:  # cancelled mid-call: a half-open probe ends unjudged
                slot.breaker.on_abandon()
            if capacity.blocked or len(capacity.runs) > 1:
                # The freed slot (global, or this agent's, which other runs share) may be what
                # another run's parked worker waits for.
                capacity.blocked = False
                for run in capacity.runs:
                    run._wake_one()
            elif self._parked:
                self._wake_one()

    async def _call(self, node: Node, slot: AgentSlot, ctx: Context, start: float) -> Any:
        """The agent call with its fault (simulated), its attempt timeout, its output check and
        the kind's verifier: an exception here is a failed attempt."""
        call = slot.call if slot.fault is None else slot.fault.wrap(slot.call)
        timeout = slot.timeout or self._attempt_timeout
        if timeout is None:
            output = await call(node.task, ctx)
        else:
            with anyio.CancelScope(deadline=start + timeout) as scope:
                output = await call(node.task, ctx)
            if scope.cancelled_caught:
                raise AttemptTimeout(f"attempt timeout after {timeout}s on agent {slot.name!r}")
        check_returned(output, slot.name)  # before a verifier sees it
        if slot.output is not None:
            output = check_output(slot.output, output)
            check_returned(output, slot.name)  # the model instance, as the result will dump it
        check = self._verify.get(node.kind) if self._verify else None
        if check is not None:
            await verify(check, node.task, output)
        return output

    async def _safe(self, node: Node) -> bool:
        """The safety check, before the task's first attempt (not counted as one). A refusal (or a
        check that raises or passes the task's deadline) fails the task, unretried."""
        check: Callable[[Task], Any] = self._safety  # type: ignore[assignment]
        try:
            with anyio.CancelScope(deadline=node.deadline or math.inf) as scope:
                await check_safety(check, node.task)
            if scope.cancelled_caught:
                raise Rejected("the safety check did not answer before the task's deadline")
        except Rejected as exc:
            self._settle(node, FAILED, None, error=f"Rejected: {exc}", error_type="Rejected")
            return False
        return True

    def _failed_attempt(
        self, node: Node, slot: AgentSlot, exc: BaseException, start: float
    ) -> None:
        end = self._time()
        policy = slot.retry or self.config.retry_per_kind.get(node.kind) or self.config.retry
        retryable, retry_after = classify(exc, policy)
        failure = describe(exc)
        error_type, message = failure.error_type, failure.message
        slot.failures += 1
        slot.last_error = f"{error_type}: {message}"
        if not isinstance(exc, VerificationError | Rejected | InputError):
            breaker = slot.breaker
            self._breaker_changed(slot, breaker.state, breaker.on_failure(end))
        attempt = Attempt(
            number=node.attempts,
            agent=slot.name,
            error_type=error_type,
            message=message,
            started=start - self.t0,
            duration=end - start,
            traceback=failure.traceback,
            status_code=failure.status_code,
            api_error_type=failure.api_error_type,
            request_id=failure.request_id,
        )
        if self._debug:
            log.debug(
                "attempt failed",
                task_id=node.id,
                agent=slot.name,
                attempt=node.attempts,
                error_type=error_type,
                error=message,
                status_code=failure.status_code,
                request_id=failure.request_id,
                traceback=failure.traceback,
            )
        if node.failures is None:
            node.failures = [attempt]
        else:
            node.failures.append(attempt)
        if node.feedback is None:
            node.feedback = []
        if isinstance(exc, VerificationError):
            node.feedback.append(exc.feedback)
            node.output = exc.output  # kept as the partial output if the task fails in the end
        else:
            node.feedback.append(f"{error_type}: {message}")
        if self.bus.active:
            self.bus.emit(
                AttemptFailed(
                    end, self.run_id, node.id, node.kind, slot.name, node.attempts,
                    error_type, message, retryable, end - start,
                )
            )  # fmt: skip
        if isinstance(exc, TaskTimeout):
            self._chain_end(node, message, "TaskTimeout")
            return
        if isinstance(exc, Rejected):
            self._settle(node, FAILED, None, error=f"Rejected: {message}", error_type="Rejected")
            return
        reason = f"{policy.max_attempts} attempts failed" if retryable else "permanent error"
        if retryable and node.agent_tries < policy.max_attempts:
            delay = backoff(policy, node.agent_tries - 1, self.rng, retry_after)
            if node.deadline is not None and end + delay >= node.deadline:
                # Waiting would pass the task's deadline: the next agent of the chain, now.
                self._fall_back(
                    node,
                    slot,
                    f"a retry in {delay:.3g}s would pass the task's deadline",
                    error_type="TaskTimeout",
                )
                return
            attempt.retry_in = delay
            node.state = RETRY_WAIT
            self.report.retries += 1
            if self.bus.active:
                self.bus.emit(
                    RetryScheduled(
                        end, self.run_id, node.id, node.kind, slot.name, node.attempts, delay
                    )
                )
            self._spawn(self._retry_later(node, delay))
            return
        self._fall_back(node, slot, reason)

    def _fall_back(
        self, node: Node, slot: AgentSlot, reason: str, error_type: str | None = None
    ) -> None:
        """`slot` is done with `node`: the next agent of the chain gets it, or the chain ends."""
        self._mark_tried(node, slot)
        nxt = self._next_in_chain(node)
        self._emit_fallback(node, slot, nxt, reason)
        if nxt is None:
            self._chain_end(node, reason, error_type)
        else:
            self._ready(node)

    async def _retry_later(self, node: Node, delay: float) -> None:
        await anyio.sleep(delay)
        if node.state is RETRY_WAIT:
            self._ready(node)

    # -- fallback chains and breakers ------------------------------------------------------------

    def _mark_tried(self, node: Node, slot: AgentSlot) -> None:
        if node.tried is None:
            node.tried = [slot]
        elif slot not in node.tried:
            node.tried.append(slot)
        node.agent_tries = 0

    def _next_in_chain(self, node: Node) -> AgentSlot | None:
        """Move `node` to the next agent of its chain; None when the chain has run out."""
        chain = self._chains.get(node.kind)
        if chain is not None:
            node.chain_pos += 1
            if node.chain_pos >= len(chain):
                node.slot = None
                return None
            node.slot = chain[node.chain_pos]
            return node.slot
        # Among the agents serving the kind and not tried yet: the least loaded healthy one (or,
        # all breakers open, the first, whose open breaker moves the task on at dispatch).
        tried = node.tried or ()
        untried = [s for s in self.registry.by_kind[node.kind] if s not in tried]
        if not untried:
            node.slot = None
            return None
        now = self._time()
        healthy = [s for s in untried if s.breaker.available(now)]
        node.slot = min(healthy, key=_load) if healthy else untried[0]
        return node.slot

    def _emit_fallback(
        self, node: Node, slot: AgentSlot, nxt: AgentSlot | None, reason: str
    ) -> None:
        if nxt is not None:
            self.report.fallbacks += 1
        if self.bus.active:
            self.bus.emit(
                FallbackUsed(
                    self._time(), self.run_id, node.id, node.kind, slot.name,
                    None if nxt is None else nxt.name, reason,
                )
            )  # fmt: skip

    def _chain_end(self, node: Node, reason: str, error_type: str | None = None) -> None:
        """The task can go no further (every agent of its chain failed it, or its deadline
        passed): it takes its kind's default value if there is one, else it fails."""
        defaults = self.config.defaults
        if node.kind in defaults:
            self.report.defaulted.append(node.id)
            self._settle(node, SUCCEEDED, defaults[node.kind], defaulted=True)
            return
        last = node.failures[-1] if node.failures else None
        if error_type is not None:
            message = f"{error_type}: {reason}"
        elif last is None:
            error_type, message = "BreakerOpen", reason
        else:
            error_type, message = last.error_type, f"{last.error_type}: {last.message} ({reason})"
        self._settle(node, FAILED, None, error=message, error_type=error_type)

    def _breaker_changed(self, slot: AgentSlot, previous: str, state: str | None) -> None:
        if state is None:
            return
        log.warning("circuit breaker changed", agent=slot.name, state=state, previous=previous)
        if self.bus.active:
            self.bus.emit(BreakerChanged(self._time(), self.run_id, slot.name, state, previous))


def _load(slot: AgentSlot) -> float:
    return slot.load
