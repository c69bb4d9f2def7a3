"""The dispatcher: a pool of worker coroutines that choose a task and its agent, call the agent,
and tell the store what came of it. It never changes a task's state itself: the store does.

No asyncio task per subtask: at most `concurrency` workers (started as work appears) take from the
store and await the agent call themselves, so 100k pending tasks are 100k small records, not 100k
coroutines. Choosing costs the same whatever the number of kinds and agents: the store hands out
its best ready task; the task's agent is its target, the only agent of its kind, the first open
agent of its chain, or the next agent of its kind's rotation. When that agent has no room (its
limit is reached, its breaker is open, or a rate limit's Retry-After holds it), the task waits in
a small *lane* of that agent (or of its kind) that is looked at again when the agent frees a slot
or its wait ends — never a scan of all kinds or agents.

A task waiting for a retry, a breaker or a rate limit holds no worker and no slot: its wait is a
due time in the store or in a lane, and one timer per run (`loop.call_at`, no task) wakes it.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
from collections import deque
from functools import partial
from heapq import heappop, heappush
from random import Random
from typing import TYPE_CHECKING, Any, Final

import anyio
import structlog

from ._breaker import CLOSED, HALF_OPEN
from ._context import Context
from ._events import (
    AttemptFailed,
    AttemptStarted,
    AttemptSucceeded,
    BreakerChanged,
    FallbackUsed,
    RetryScheduled,
)
from ._exceptions import AttemptTimeout, Rejected, TaskTimeout, VerificationError
from ._failure import check_returned, describe
from ._retry import RetryPolicy, Timeouts, backoff, classify
from ._task import CANCELLED, CLAIMED, FAILED, RUNNING, SUCCEEDED, Attempt
from ._verify import check_output, check_safety, verify

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Mapping

    from ._events import EventBus
    from ._registry import AgentSlot, Registry
    from ._report import Report
    from ._run import Run
    from ._store import RunStore
    from ._task import Task
    from ._verify import Check
    from .stores._memory import Record

__all__ = ("Capacity", "Dispatcher", "RunConfig")

log = structlog.get_logger("orchestra")

# The task id in structlog's context, for every log line of the agent call. Named as
# `structlog.contextvars.bind_contextvars` names its variables, so `merge_contextvars` picks it up;
# set directly (0.1 µs, against 1.5 µs for bind + reset): each worker runs in its own copy of the
# context, so the value never leaks out of the worker.
_TASK_ID: Final = contextvars.ContextVar[Any]("structlog_task_id", default=...)
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
        "store",
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
        store: Any,
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
        self.store = store
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


class Lane:
    """Claimed tasks waiting for room at one agent (or at any agent of one kind), best first."""

    __slots__ = ("heap", "kind", "queued", "slot")

    def __init__(self, slot: AgentSlot | None, kind: str | None) -> None:
        self.slot = slot
        self.kind = kind
        self.heap: list[tuple[int, int, Record, int]] = []  # (priority, order, record, token)
        self.queued = False  # in the dispatcher's `_recheck`


class Dispatcher:
    """Workers, agent choice and the attempt loop of one run; the run's store holds the state."""

    def __init__(self, run: Run, store: RunStore) -> None:
        config = run.config
        self.config = config
        self.run = run
        self.run_id = run.run_id
        self.store = store
        self.report: Report = run.report
        self.registry = config.registry
        self.bus = config.bus
        self.rng = Random(config.seed)
        self._capacity = config.capacity
        self._slots = config.registry.slots
        self._chains = {k: [s.name for s in c] for k, c in config.registry.chains.items()}
        self._kind_slots = config.registry.by_kind
        # Kinds served by one agent and no chain: no choice to make at dispatch.
        self._only: dict[str, AgentSlot] = {
            kind: slots[0]
            for kind, slots in config.registry.by_kind.items()
            if len(slots) == 1 and kind not in config.registry.chains
        }
        # The rotation of each kind served by several agents: the registry's, so that concurrent
        # runs spread their tasks over the agents together.
        self._cursor = config.registry.cursor
        self._verify = config.verify
        self._safety = config.safety
        self._attempt_timeout = config.timeouts.attempt
        self._lanes: dict[Any, Lane] = {}  # by slot (an agent's lane) or by kind (any agent's)
        self._recheck: deque[Lane] = deque()  # lanes whose agents may have room now
        self._wakeups: list[tuple[float, int, Lane]] = []  # (loop time, order, lane)
        self._order = 0
        self._held = 0  # tasks waiting in lanes
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        # The run's own tasks (its workers) live in an asyncio.TaskGroup that `Run.execute` owns:
        # starting a task there costs a third of anyio's `start_soon` (measured ~9 µs against
        # ~28 µs here), which is what a pool of hundreds of workers pays before the first call.
        self._pool: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.cancelled = False  # `cancel_all` was called: an outcome that arrives after is dropped
        self._parked: list[asyncio.Future[None]] = []
        self._workers = 0
        self.closing = False
        self.running = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._time: Callable[[], float] = anyio.current_time

    # -- time ------------------------------------------------------------------------------------

    def now(self) -> float:
        """The run's clock: the event loop's (virtual under a FakeClock). Stores take their times
        on it; a durable store converts them to wall time where it persists them."""
        return self._time()

    # -- workers ---------------------------------------------------------------------------------

    def start(self, pool: asyncio.TaskGroup, loop: asyncio.AbstractEventLoop) -> None:
        self._pool = pool
        self._loop = loop
        for _ in range(min(self._capacity.limit, self.store.unfinished) - self._workers):
            self._workers += 1
            self._spawn(self._worker())
        self._schedule()

    def bind_clock(self, loop: asyncio.AbstractEventLoop) -> None:
        self._time = loop.time

    def ready(self, record: Record) -> None:
        """The store made a task ready: get a worker to it."""
        if record.deadline is not None:
            self._schedule()
        if self._parked:
            self.wake_one()
        elif self._pool is not None and self._workers < self._capacity.limit and not self.closing:
            self._workers += 1
            self._spawn(self._worker())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self._pool.create_task(coro)  # type: ignore[union-attr]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def stop(self) -> None:
        """No new attempt starts: parked workers leave, running ones leave after their attempt."""
        self.closing = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._parked:
            self.wake_one()

    def cancel_all(self) -> None:
        """Cancel every worker, running or parked, until it leaves; no new attempt starts, and
        what an attempt returns or raises from now on is dropped (the run ends its task as
        cancelled)."""
        self.cancelled = True
        self.stop()
        self._cancel_workers()

    def _cancel_workers(self) -> None:
        # Cancel every worker still alive, and again at each turn of the loop until it has ended:
        # an agent that swallows one `CancelledError` is cancelled again at its next await, as an
        # anyio cancel scope would do (a bare `Task.cancel()` is delivered once). Written by hand
        # because a scope per worker costs ~8 µs at every worker's start (measured), paid by every
        # run; this costs nothing until a run is cancelled.
        alive = False
        for task in self._tasks:
            if not task.done():
                task.cancel()
                alive = True
        if alive and self._loop is not None:
            self._loop.call_soon(self._cancel_workers)

    def wake_one(self) -> None:
        """Wake one parked worker, if any."""
        parked = self._parked
        while parked:
            waiter = parked.pop()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _worker(self) -> None:
        # Parking on a bare future (not an anyio.Event) is the cheapest wait there is: one
        # allocation; `wake_one` wakes a worker when a task is ready or a slot frees.
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        done = 0
        try:
            while not self.closing:
                picked = self._take()
                if picked is None:
                    # Nothing to do. If every unfinished task is running, nothing can become
                    # ready but through them (a retry, a spawn, a dependent), and `ready` starts
                    # a worker then: leave now rather than be woken at the end only to leave.
                    if self.store.unfinished <= self.running or self.closing:
                        return
                    waiter = loop.create_future()
                    self._parked.append(waiter)
                    await waiter
                    continue
                await self._attempt(*picked)
                if me is not None and me.cancelling():
                    return  # the run is cancelled, and the agent swallowed it: no new attempt
                done += 1
                if not done % _YIELD_EVERY:
                    await asyncio.sleep(0)
        finally:
            self._workers -= 1

    # -- choosing --------------------------------------------------------------------------------

    def _take(self) -> tuple[Record, int, AgentSlot] | None:
        """The best task an agent has room for now, with its lease token and its agent (or None)."""
        capacity = self._capacity
        if capacity.in_flight >= capacity.limit:
            capacity.blocked = True
            return None
        recheck = self._recheck
        while recheck:
            picked = self._from_lane(recheck[0])
            if picked is not None:
                return picked
            recheck.popleft().queued = False
        store = self.store
        while True:
            record = store.claim()
            if record is None:
                return None
            token = record.token
            slot = self._route(record, token)
            if slot is not None:
                return record, token, slot

    def _route(self, record: Record, token: int) -> AgentSlot | None:
        """The agent for a claimed task if it has room now; else the task waits in a lane (or
        ends: its deadline passed) and None is returned."""
        deadline = record.deadline
        if deadline is not None and self._time() >= deadline:
            self._chain_end(
                record,
                token,
                f"the deadline passed before attempt {record.attempts + 1} started",
                "TaskTimeout",
            )
            return None
        target = record.target
        if target is None:
            slot = self._only.get(record.kind)
            if slot is None:
                return self._route_kind(record, token)
        else:
            slot = self._slots[target]
        if slot.breaker.state is not CLOSED or slot.paused_until:
            return self._route_unwell(record, token, slot)
        if slot.in_flight < slot.limit:
            lane = self._lanes.get(slot)
            if lane is None or not lane.heap:
                return slot
        self._hold(record, token, self._lane(slot, None))
        return None

    def _route_kind(self, record: Record, token: int, join: bool = True) -> AgentSlot | None:
        """A task that may go to any agent of its kind not used up: its chain's first, or the next
        in the kind's rotation that has room. With `join`, it queues behind the kind's waiting
        tasks rather than overtake them."""
        kind = record.kind
        chain = self._chains.get(kind)
        if chain is not None:
            tried = record.tried
            for name in chain:
                if tried is None or name not in tried:
                    return self._route_unwell(record, token, self._slots[name])
            self._chain_end(record, token, "every agent of the chain was used up")
            return None
        lane = self._lanes.get(kind)
        if join and lane is not None and lane.heap:  # others wait already: join them (O(1))
            self._hold(record, token, lane)
            return None
        slots = self._kind_slots[kind]
        n = len(slots)
        first = self._cursor.get(kind, 0)
        tried = record.tried
        now = self._time()
        usable = False
        for i in range(n):
            slot = slots[(first + i) % n]
            if tried is not None and slot.name in tried:
                continue
            if not self._usable(slot, now):
                continue
            usable = True
            if slot.in_flight < slot.limit:
                self._cursor[kind] = (first + i + 1) % n
                return slot
        if usable:
            self._hold(record, token, self._lane(None, kind))
            return None
        return self._wait_for_recovery(record, token, [s for s in slots if not _used(record, s)])

    def _route_unwell(self, record: Record, token: int, slot: AgentSlot) -> AgentSlot | None:
        """`slot` may have an open breaker or a rate-limit pause: go to the next usable agent of
        the task's chain (or kind), or wait for the first of them to recover."""
        now = self._time()
        if self._usable(slot, now):
            if slot.in_flight < slot.limit:
                return slot
            self._hold(record, token, self._lane(slot, None))
            return None
        candidates = self._untried(record, slot)
        for other in candidates:
            if other is not slot and self._usable(other, now):
                self._emit_fallback(record, slot, other, "circuit breaker open")
                if other.in_flight < other.limit:
                    return other
                self._hold(record, token, self._lane(other, None))
                return None
        return self._wait_for_recovery(record, token, candidates or [slot])

    def _untried(self, record: Record, slot: AgentSlot) -> list[AgentSlot]:
        """The agents `record` may still go to, `slot` first, in chain (or registry) order."""
        chain = self._chains.get(record.kind)
        names = chain if chain is not None else [s.name for s in self._kind_slots[record.kind]]
        tried = record.tried
        out = [slot]
        for name in names:
            if name != slot.name and (tried is None or name not in tried):
                out.append(self._slots[name])
        return out

    def _usable(self, slot: AgentSlot, now: float) -> bool:
        if slot.paused_until:
            if now < slot.paused_until:
                return False
            slot.paused_until = 0.0
        return slot.breaker.state is CLOSED or slot.breaker.available(now)

    def _wait_for_recovery(
        self, record: Record, token: int, slots: list[AgentSlot]
    ) -> AgentSlot | None:
        """Every agent the task may go to is unwell: it waits (within its deadline) in the lane of
        the one that recovers first, never fails for it."""
        now = self._time()
        best = min(slots, key=lambda s: _recovers_at(s, now))
        lane = self._lane(best, None)
        self._hold(record, token, lane)
        at = _recovers_at(best, now)
        if at < math.inf:
            self._order += 1
            heappush(self._wakeups, (at, self._order, lane))
            self._schedule()
        return None

    def _lane(self, slot: AgentSlot | None, kind: str | None) -> Lane:
        key: Any = slot if slot is not None else kind
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = Lane(slot, kind)
        return lane

    def _hold(self, record: Record, token: int, lane: Lane) -> None:
        self._order += 1
        heappush(lane.heap, (record.priority, self._order, record, token))
        self._held += 1

    def _from_lane(self, lane: Lane) -> tuple[Record, int, AgentSlot] | None:
        """The best task of `lane` if its agent has room now (the task is routed again: its agent
        may have changed while it waited)."""
        heap = lane.heap
        now = self._time()
        while heap:
            _, _, record, token = heap[0]
            if record.token != token or record.state is not CLAIMED:
                heappop(heap)  # it ended (deadline, cancel) while it waited
                self._held -= 1
                continue
            slot = lane.slot
            if slot is not None:
                if not self._usable(slot, now):
                    self._reroute(lane)  # its agent went down while they waited
                    return None
                if slot.in_flight >= slot.limit:
                    return None
            elif not any(
                s.in_flight < s.limit and self._usable(s, now) and not _used(record, s)
                for s in self._kind_slots[lane.kind]  # type: ignore[index]
            ):
                return None
            heappop(heap)
            self._held -= 1
            if slot is not None:
                return record, token, slot
            slot = self._route_kind(record, token, join=False)
            if slot is not None:
                return record, token, slot
        return None

    def _pause(self, slot: AgentSlot, until: float) -> None:
        """No task starts on `slot` before `until` (a rate limit's Retry-After)."""
        if until <= slot.paused_until:
            return
        slot.paused_until = until
        self._order += 1
        heappush(self._wakeups, (until, self._order, self._lane(slot, None)))
        self._schedule()

    def _reroute(self, lane: Lane) -> None:
        """Route again every task waiting in `lane` (its agent became unusable): each goes to
        another agent's lane, or waits for the first of its agents to recover."""
        waiting = lane.heap
        lane.heap = []
        self._held -= len(waiting)
        for _, _, record, token in waiting:
            if record.token != token or record.state is not CLAIMED:
                continue
            slot = self._route(record, token)
            if slot is not None:  # room now: it waits at the head of that agent's lane
                other = self._lane(slot, None)
                self._hold(record, token, other)
                if not other.queued:
                    other.queued = True
                    self._recheck.append(other)

    def room(self, slot: AgentSlot) -> None:
        """`slot` may have room now (a slot freed, its breaker closed): look at its lanes again."""
        lane = self._lanes.get(slot)
        if lane is not None and lane.heap and not lane.queued:
            lane.queued = True
            self._recheck.append(lane)
        for kind in slot.kinds:
            lane = self._lanes.get(kind)
            if lane is not None and lane.heap and not lane.queued:
                lane.queued = True
                self._recheck.append(lane)

    # -- timers ----------------------------------------------------------------------------------

    def _schedule(self) -> None:
        """Arm the run's one timer for its next due time (a retry, a deadline, a recovery)."""
        if self._loop is None or self.closing:
            return
        at = math.inf
        due = self.store.next_due()
        if due is not None:
            at = due
        if self._wakeups and self._wakeups[0][0] < at:
            at = self._wakeups[0][0]
        if at >= self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        if at == math.inf:
            self._timer = None
            self._timer_at = math.inf
            return
        self._timer_at = at
        self._timer = self._loop.call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        # asyncio runs a timer up to its clock resolution early: the time it was set for counts
        # as reached, or a due retry would wait one more loop turn (and a seeded run would not
        # replay exactly).
        now = max(self._time(), self._timer_at)
        self._timer = None
        self._timer_at = math.inf
        if self.closing:
            return
        for record in self.store.due(now):
            state = record.state
            if state is RUNNING:
                continue  # its attempt's own cancel scope ends it at the deadline
            self._chain_end(
                record,
                record.token,
                f"the deadline passed while the task waited for attempt {record.attempts + 1}",
                "TaskTimeout",
            )
        wakeups = self._wakeups
        while wakeups and wakeups[0][0] <= now:
            lane = heappop(wakeups)[2]
            if lane.heap and not lane.queued:
                lane.queued = True
                self._recheck.append(lane)
        self._schedule()
        # Wake a worker for each lane that may go on (and for retries the store made ready).
        for _ in range(len(self._recheck) or 1):
            if self._parked:
                self.wake_one()
            elif self._pool is not None and self._workers < self._capacity.limit:
                self._workers += 1
                self._spawn(self._worker())

    # -- one attempt -----------------------------------------------------------------------------

    async def _attempt(self, record: Record, token: int, slot: AgentSlot) -> None:
        capacity = self._capacity
        capacity.in_flight += 1
        slot.in_flight += 1
        self.running += 1
        report = self.report
        if self.running > report.peak:
            report.peak = self.running
        breaker = slot.breaker
        probe = False
        if breaker.state is not CLOSED:
            probe = True
            self._breaker_changed(slot, breaker.state, breaker.on_dispatch(self._time()))
        store = self.store
        task = record.task
        _TASK_ID.set(record.id)
        ctx: Context | None = None
        try:
            if (
                self._safety is not None
                and not record.attempts
                and not await self._safe(record, token)
            ):
                return
            if not store.start(record, token, slot.name):
                return  # the lease went stale (the task was cancelled) before the call
            slot.attempts += 1
            report.attempts += 1
            start = self._time()
            ctx = Context(self.run, record, slot.name, record.attempts, record.feedback or ())
            bus = self.bus if self.bus.active else None
            if bus is not None and bus.wants(AttemptStarted):
                bus.emit(
                    AttemptStarted(
                        start, self.run_id, record.id, record.kind, slot.name, record.attempts
                    )
                )
            try:
                if (
                    record.deadline is None
                    and slot.fault is None
                    and slot.timeout is None
                    and self._attempt_timeout is None
                    and slot.output is None
                    and not self._verify
                ):
                    output = await slot.call(task, ctx)  # the common case: nothing around the call
                    if type(output) not in _PLAIN:
                        check_returned(output, slot.name)
                elif record.deadline is None:
                    output = await self._call(record, slot, ctx, start)
                else:
                    # The task's deadline bounds the whole attempt: the call, the verifier, and
                    # what runs around them.
                    with anyio.CancelScope(deadline=record.deadline) as scope:
                        output = await self._call(record, slot, ctx, start)
                    if scope.cancelled_caught:
                        raise TaskTimeout(
                            f"task timeout: {task.timeout or self.config.timeouts.task}s passed"
                        )
                if self.cancelled:
                    return  # the agent finished after the run's cancel: the run ends the task
                spawned = ctx._spawned
                if spawned:
                    # The spawns enter with the success, as one step; a spawn the store refuses
                    # now (its group closed meanwhile) fails the attempt instead.
                    store.settle(
                        record,
                        token,
                        SUCCEEDED,
                        output,
                        spawned=list(spawned.values()),
                        agent=slot.name,
                    )
                    probe = False
                    self._succeeded(record, slot, start, bus)
                    return
            except asyncio.CancelledError as exc:
                # Ours (the run is cancelled, or a deadline passed): let it unwind. One the agent
                # raised by itself (no cancellation pending on this task): a failed attempt.
                current = asyncio.current_task()
                if current is None or current.cancelling() or self.cancelled:
                    raise
                probe = False
                self._failed(record, token, slot, exc, start)
            except Exception as exc:
                if self.cancelled:
                    return  # raised over the run's cancel (say, from a `finally`): cancelled
                probe = False
                self._failed(record, token, slot, exc, start)
            else:
                probe = False
                self._succeeded(record, slot, start, bus)
                store.settle(record, token, SUCCEEDED, output, agent=slot.name)
        finally:
            if ctx is not None and ctx._threads:
                # A thread the call abandoned still runs: the slot stays taken until it ends.
                ctx._on_released(partial(self._thread_ended, slot))
            else:
                capacity.in_flight -= 1
                slot.in_flight -= 1
            self.running -= 1
            if probe:  # cancelled (or refused before the call): the probe ends unjudged
                breaker.on_abandon()
            if capacity.blocked or len(capacity.runs) > 1:
                # The freed slot (global, or this agent's, which other runs share) may be what
                # another run's parked worker waits for.
                capacity.blocked = False
                for run in capacity.runs:
                    run.room(slot)
                    run.wake_one()
            else:
                if self._held:
                    self.room(slot)
                if self._parked:
                    self.wake_one()

    def _thread_ended(self, slot: AgentSlot) -> None:
        """An abandoned thread of `slot` ended (see `Context._keep_slot`): its slot frees now, for
        whichever runs wait for it (this one may be over)."""
        capacity = self._capacity
        capacity.in_flight -= 1
        slot.in_flight -= 1
        capacity.blocked = False
        for run in capacity.runs:
            run.room(slot)
            run.wake_one()

    def _succeeded(self, record: Record, slot: AgentSlot, start: float, bus: Any) -> None:
        slot.succeeded += 1
        breaker = slot.breaker
        if breaker.consecutive or breaker.state is not CLOSED or breaker.recent is not None:
            previous = breaker.state
            self._breaker_changed(slot, previous, breaker.on_success())
            if previous is not CLOSED:
                self._recovered(slot)
        if bus is not None and bus.wants(AttemptSucceeded):
            end = self._time()
            bus.emit(
                AttemptSucceeded(
                    end, self.run_id, record.id, record.kind, slot.name, record.attempts,
                    end - start,
                )
            )  # fmt: skip

    async def _call(self, record: Record, slot: AgentSlot, ctx: Context, start: float) -> Any:
        """The agent call with its fault (simulated), its attempt timeout, its output check and
        the kind's verifier: an exception here is a failed attempt."""
        call = slot.call if slot.fault is None else slot.fault.wrap(slot.call)
        timeout = slot.timeout or self._attempt_timeout
        if timeout is None:
            output = await call(record.task, ctx)
        else:
            with anyio.CancelScope(deadline=start + timeout) as scope:
                output = await call(record.task, ctx)
            if scope.cancelled_caught:
                raise AttemptTimeout(f"attempt timeout after {timeout}s on agent {slot.name!r}")
        if type(output) not in _PLAIN:
            check_returned(output, slot.name)  # before a verifier sees it
        if slot.output is not None:
            output = check_output(slot.output, output)
            check_returned(output, slot.name)  # the model instance, as the result will dump it
        check = self._verify.get(record.kind) if self._verify else None
        if check is not None:
            await verify(check, record.task, output)
        return output

    async def _safe(self, record: Record, token: int) -> bool:
        """The safety check, before the task's first attempt (not counted as one). A refusal (or a
        check that raises or passes the task's deadline) fails the task, unretried."""
        check: Callable[[Task], Any] = self._safety  # type: ignore[assignment]
        deadline = math.inf if record.deadline is None else record.deadline
        try:
            with anyio.CancelScope(deadline=deadline) as scope:
                await check_safety(check, record.task)
            if scope.cancelled_caught:
                raise Rejected("the safety check did not answer before the task's deadline")
        except Rejected as exc:
            message = describe(exc).message
            self.store.settle(
                record, token, FAILED, error=f"Rejected: {message}", error_type="Rejected"
            )
            return False
        return True

    def _failed(
        self, record: Record, token: int, slot: AgentSlot, exc: BaseException, start: float
    ) -> None:
        end = self._time()
        policy = slot.retry or self.config.retry_per_kind.get(record.kind) or self.config.retry
        retryable, retry_after = classify(exc, policy)
        failure = describe(exc)
        error_type, message = failure.error_type, failure.message
        slot.failures += 1
        slot.last_error = f"{error_type}: {message}"
        breaker = slot.breaker
        previous = breaker.state
        if retryable and not isinstance(exc, VerificationError | TaskTimeout):
            # A health failure (timeout, connection error, 429/5xx, an agent's crash): it counts.
            self._breaker_changed(slot, previous, breaker.on_failure(end))
            if retry_after is not None and slot.limiters and _is_rate_limit(failure.status_code):
                # Every task that shares this agent's rate limits waits with it, not only this one.
                self._pause(slot, end + retry_after)
        elif previous is not CLOSED:
            # The agent answered (a permanent error, a rejected output): it is up. A half-open
            # probe always reports back, whatever its outcome.
            self._breaker_changed(slot, previous, breaker.on_success())
            self._recovered(slot)
        attempt = Attempt(
            number=record.attempts,
            agent=slot.name,
            error_type=error_type,
            message=message,
            started=start - self.run.t0,
            duration=end - start,
            traceback=failure.traceback,
            status_code=failure.status_code,
            api_error_type=failure.api_error_type,
            request_id=failure.request_id,
        )
        if record.feedback is None:
            record.feedback = []
        if isinstance(exc, VerificationError):
            record.feedback.append(exc.feedback)
            record.output = exc.output  # kept as the partial output if the task fails in the end
        else:
            record.feedback.append(f"{error_type}: {message}")
        if self.run.debug:
            log.debug(
                "attempt failed",
                task_id=record.id,
                agent=slot.name,
                attempt=record.attempts,
                error_type=error_type,
                error=message,
                traceback=failure.traceback,
            )
        if self.bus.active:
            self.bus.emit(
                AttemptFailed(
                    end, self.run_id, record.id, record.kind, slot.name, record.attempts,
                    error_type, message, retryable, end - start,
                )
            )  # fmt: skip
        if record.cancelling is not None:
            self.store.settle(
                record, token, CANCELLED, error=record.cancelling, error_type="Cancelled",
                attempt=attempt,
            )  # fmt: skip
            return
        if isinstance(exc, TaskTimeout):
            self._chain_end(record, token, message, "TaskTimeout", attempt)
            return
        if isinstance(exc, Rejected):
            self.store.settle(
                record,
                token,
                FAILED,
                error=f"Rejected: {message}",
                error_type="Rejected",
                attempt=attempt,
            )
            return
        reason = f"{policy.max_attempts} attempts failed" if retryable else "permanent error"
        if retryable and record.agent_tries < policy.max_attempts:
            delay = backoff(policy, record.agent_tries - 1, self.rng, retry_after)
            retry_at = self._time() + delay
            if record.deadline is not None and retry_at >= record.deadline:
                # Waiting would pass the task's deadline: the next agent of the chain, now.
                self._fall_back(
                    record,
                    token,
                    slot,
                    attempt,
                    f"a retry in {delay:.3g}s would pass the task's deadline",
                    "TaskTimeout",
                )
                return
            attempt.retry_in = delay
            self.report.retries += 1
            if self.bus.active:
                self.bus.emit(
                    RetryScheduled(
                        end, self.run_id, record.id, record.kind, slot.name, record.attempts,
                        delay,
                    )
                )  # fmt: skip
            self.store.fail(record, token, attempt, retry_at=retry_at)
            self._schedule()
            return
        self._fall_back(record, token, slot, attempt, reason)

    def _fall_back(
        self,
        record: Record,
        token: int,
        slot: AgentSlot,
        attempt: Attempt,
        reason: str,
        error_type: str | None = None,
    ) -> None:
        """`slot` is done with `record`: the next agent of the chain gets it, or the chain ends."""
        nxt = self._next_agent(record, slot)
        self._emit_fallback(record, slot, nxt, reason)
        if nxt is _NONE_LEFT:
            self._chain_end(record, token, reason, error_type, attempt)
        elif record.kind in self._chains:
            self.store.fail(record, token, attempt, next_agent=nxt)
        else:  # no explicit chain: whichever agent of the kind not used up has room first
            self.store.fail(record, token, attempt, next_agent=None)

    def _next_agent(self, record: Record, slot: AgentSlot) -> Any:
        """The name of the agent after `slot` in `record`'s chain (without an explicit chain: the
        least loaded usable agent of the kind not used up), or `_NONE_LEFT`."""
        tried = record.tried or ()
        chain = self._chains.get(record.kind)
        if chain is not None:
            for name in chain:
                if name != slot.name and name not in tried:
                    return name
            return _NONE_LEFT
        untried = [
            s for s in self._kind_slots[record.kind] if s is not slot and s.name not in tried
        ]
        if not untried:
            return _NONE_LEFT
        now = self._time()
        usable = [s for s in untried if self._usable(s, now)]
        return min(usable, key=_load).name if usable else untried[0].name

    def _emit_fallback(self, record: Record, slot: AgentSlot, nxt: Any, reason: str) -> None:
        if nxt is not _NONE_LEFT:
            self.report.fallbacks += 1
        if self.bus.active:
            to = None if nxt is _NONE_LEFT else getattr(nxt, "name", nxt)
            self.bus.emit(
                FallbackUsed(
                    self._time(), self.run_id, record.id, record.kind, slot.name, to, reason
                )
            )

    def _chain_end(
        self,
        record: Record,
        token: int,
        reason: str,
        error_type: str | None = None,
        attempt: Attempt | None = None,
    ) -> None:
        """The task can go no further (every agent of its chain failed it, or its deadline
        passed): it takes its kind's default value if there is one, else it fails."""
        defaults = self.config.defaults
        store = self.store
        if record.kind in defaults:
            if store.settle(
                record, token, SUCCEEDED, defaults[record.kind], defaulted=True, attempt=attempt
            ):
                self.report.defaulted.append(record.id)
            return
        last = attempt or (record.failures[-1] if record.failures else None)
        if error_type is not None:
            message = f"{error_type}: {reason}"
        elif last is None:
            error_type, message = "BreakerOpen", reason
        else:
            error_type, message = last.error_type, f"{last.error_type}: {last.message} ({reason})"
        store.settle(record, token, FAILED, error=message, error_type=error_type, attempt=attempt)

    # -- breakers --------------------------------------------------------------------------------

    def _recovered(self, slot: AgentSlot) -> None:
        """`slot`'s breaker closed: the tasks waiting for it (in every run) may go."""
        for run in self._capacity.runs:
            run.room(slot)
            run.wake_one()

    def _breaker_changed(self, slot: AgentSlot, previous: str, state: str | None) -> None:
        if state is None:
            return
        log.warning("circuit breaker changed", agent=slot.name, state=state, previous=previous)
        if self.bus.active:
            self.bus.emit(BreakerChanged(self._time(), self.run_id, slot.name, state, previous))


_NONE_LEFT: Final[Any] = object()
_PLAIN: Final = frozenset((str, int, float, bool, type(None)))


def _load(slot: AgentSlot) -> float:
    return slot.load


def _used(record: Record, slot: AgentSlot) -> bool:
    tried = record.tried
    return tried is not None and slot.name in tried


def _recovers_at(slot: AgentSlot, now: float) -> float:
    """The loop time at which `slot` may take a task again (as far as its breaker and its
    rate-limit pause say)."""
    at = slot.paused_until if slot.paused_until > now else now
    breaker = slot.breaker
    if breaker.state is CLOSED:
        return at
    if breaker.state is HALF_OPEN:
        return at if not breaker.probing else math.inf  # the probe's outcome will wake it
    return max(at, now + breaker.reopens_in(now))


def _is_rate_limit(status: int | None) -> bool:
    return status in (429, 529)
