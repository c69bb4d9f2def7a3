"""The dispatcher: a pool of runners, the run's coroutines that each take a task, call its agent,
and tell the store what came of it, one attempt at a time. It never changes a task's state itself:
the store does.

No asyncio task per subtask: at most `concurrency` runners (started as work appears) take from the
store and await the agent call themselves, so 100k pending tasks are 100k small records, not 100k
coroutines. Which agent a task goes to, and where it waits when that agent has no room, is the
router's (`_routing.py`): the same cost whatever the number of kinds and agents. The attempt
itself, and where its output goes, is `_attempt.py`'s; the runner awaits a plain attempt's call
in its own frame. After a failed call, what comes next — a retry at a due time, the next agent of
the chain, the end of the chain (a default value or a failure) — is the recovery's
(`_recovery.py`).

A task waiting for a retry, a breaker or a rate limit holds no runner and no slot: its wait is a
due time in the store or in a lane, and one timer per run (`loop.call_at`, no task) wakes it.
"""

from __future__ import annotations

import asyncio
import math
from random import Random
from sys import getrefcount, maxsize
from typing import TYPE_CHECKING, Any

import anyio

from .._breaker import CLOSED
from .._clock import loop_time
from .._concurrency import Concurrency
from .._log import TASK_ID, CurrentTask
from .._task import RUNNING, Attempt
from ._attempt import Attempts
from ._recovery import Recovery
from ._routing import DEFAULT_COST, Router

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Sequence

    from .._limits import Cost
    from .._record import Record
    from .._registry import AgentSlot
    from ..stores._protocol import RunStore
    from ._context import Context
    from ._report import Report
    from ._runconfig import RunView

__all__ = ("Dispatcher",)

_YIELD_EVERY = 64  # a runner whose agents never suspend still lets the loop run this often
UNBOUNDED = maxsize  # `room`: no bound


class Dispatcher:
    """Runners, agent choice and the attempt loop of one run; the run's store holds the state."""

    def __init__(self, run: RunView, store: RunStore) -> None:
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
        self.instruments = config.instruments  # metrics and tracing hooks (None: none)
        self.router = Router(self, config.registry)
        self.recovery = Recovery(self)
        self.parked: list[asyncio.Future[None]] = []
        # Runners woken (`wake_one`) that have not run yet, and the wake-ups of ready tasks
        # (`wake`) owed meanwhile: see `wake_one`.
        self.waking = 0
        self.owed = 0
        self.attempts = Attempts(self, run, store, self.router, self.recovery)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._agents_of: dict[str, list[AgentSlot]] = {}  # the agents `room` counts, by kind
        # The run's own tasks (its runners) live in an asyncio.TaskGroup that `Run.execute` owns:
        # starting a task there costs a third of anyio's `start_soon` (measured ~9 µs against
        # ~28 µs here), which is what a pool of hundreds of runners pays before the first call.
        self._pool: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._runners = 0
        # What each runner works on, set around each attempt: read by `cancel_attempts`, and by the
        # log lines of the attempt as their `task_id` (see `CurrentTask`).
        self._running: dict[asyncio.Task[None], CurrentTask] = {}
        self.closing = False
        self.paused = False  # `pause()`: runners take nothing new (see `_take`)
        self.held = False  # `hold()`: the store's writes are behind; nothing new either
        self.halted = False  # paused or held: the one flag the runners read
        self.on_drained: Callable[[], None] | None = None  # paused, and no attempt runs any more
        self._loop: asyncio.AbstractEventLoop | None = None
        self._time: Callable[[], float] = anyio.current_time

    # -- time ------------------------------------------------------------------------------------

    def now(self) -> float:
        """The run's clock: the event loop's (virtual under a FakeClock). Stores take their times
        on it; a durable store converts them to wall time where it persists them."""
        return self._time()

    @property
    def running(self) -> int:
        """Attempts under way."""
        return self.attempts.running

    @property
    def cancelled(self) -> bool:
        """`cancel_all` was called: what an attempt returns or raises from now on is dropped."""
        return self.attempts.cancelled

    # -- runners ---------------------------------------------------------------------------------

    def start(self, pool: asyncio.TaskGroup, loop: asyncio.AbstractEventLoop) -> None:
        self._pool = pool
        self._loop = loop
        for _ in range(min(self._capacity.limit, self.store.unfinished) - self._runners):
            self._runners += 1
            self._spawn(self._runner())
        self.schedule()

    def bind_clock(self, loop: asyncio.AbstractEventLoop) -> None:
        self._time = loop_time(loop)
        self.router.bind_clock(self._time)
        self.attempts.bind_clock(self._time)

    def ready(self, record: Record) -> None:
        """The store made a task ready: get a runner to it."""
        if record.deadline is not None:
            self.schedule()
        self.wake()

    def wake(self) -> None:
        """A task can be claimed: wake a parked runner, or start one if the pool has room; owed
        while a runner woken has yet to run (see `wake_one`)."""
        if self.waking:
            self.owed += 1
        elif self.parked:
            self._wake()
        elif self._pool is not None and self._runners < self._capacity.limit and not self.closing:
            self._runners += 1
            self._spawn(self._runner())

    def ready_all(self, records: Sequence[Record]) -> None:
        """`ready` for a batch: the timer armed once, as many runners woken as can take them."""
        if records and records[0].deadline is not None:
            self.schedule()
        for i in range(len(records)):
            if self.waking:
                self.owed += len(records) - i
                return
            if self.parked:
                self._wake()
            elif (
                self._pool is not None and self._runners < self._capacity.limit and not self.closing
            ):
                self._runners += 1
                self._spawn(self._runner())
            else:
                return

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self._pool.create_task(coro)  # type: ignore[union-attr]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def stop(self) -> None:
        """No new attempt starts: parked runners leave, running ones leave after their attempt."""
        self.closing = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._wake_all()

    def cancel_all(self) -> None:
        """Cancel every runner, running or parked, until it leaves; no new attempt starts, and
        what an attempt returns or raises from now on is dropped (the run ends its task as
        cancelled)."""
        self.attempts.cancelled = True
        self.stop()
        self._cancel_runners()

    def _cancel_runners(self) -> None:
        # Cancel every runner still alive, and again at each turn of the loop until it has ended:
        # an agent that swallows one `CancelledError` is cancelled again at its next await, as an
        # anyio cancel scope would do (a bare `Task.cancel()` is delivered once). Written by hand
        # because a scope per runner costs ~8 µs at every runner's start (measured), paid by every
        # run; this costs nothing until a run is cancelled.
        alive = False
        for task in self._tasks:
            if not task.done():
                task.cancel()
                alive = True
        if alive and self._loop is not None:
            self._loop.call_soon(self._cancel_runners)

    # -- control (a run handle's) ------------------------------------------------------------------

    def pause(self) -> None:
        """No new attempt starts; running ones finish. Costs one flag check per take."""
        self.paused = self.halted = True
        if not self.running and self.on_drained is not None:
            self.on_drained()

    def resume(self) -> None:
        """Attempts start again: the parked runners wake, and the pool is topped up."""
        if not self.paused:
            return
        self.paused = False
        self._go_on()

    def hold(self, held: bool) -> None:
        """The store's writes are behind (True): like `pause`, no new attempt starts until they
        caught up (False). A run the user paused stays paused."""
        self.held = held
        if held:
            self.halted = True
        else:
            self._go_on()

    def _go_on(self) -> None:
        if self.paused or self.held:
            return
        self.halted = False
        self._wake_all()
        if self._pool is not None and self._loop is not None and not self.closing:
            self.start(self._pool, self._loop)

    def cancel_attempts(self, records: list[Record]) -> None:
        """Cancel the running attempts of `records` (the caller has ended the tasks in the store),
        each through its runner; the runner takes the next task (see `Attempts.raised`)."""
        wanted = set(records)
        hit = [(t, c, c.record) for t, c in self._running.items() if c.record in wanted]
        self._cancel_again(hit)

    def _cancel_again(
        self, hit: list[tuple[asyncio.Task[None], CurrentTask, Record | None]]
    ) -> None:
        # Cancel each runner still in the attempt it was told to end, and again at each turn of
        # the loop while it is: an agent that swallows one `CancelledError` is cancelled again at
        # its next await, as the run's own cancel does (`_cancel_runners`). The runner counts
        # them, and takes them all back when the attempt ends (`take_back_cancels`).
        again = []
        for task, current, record in hit:
            if current.record is record and not task.done():
                task.cancel()
                current.cancels += 1
                again.append((task, current, record))
        if again and self._loop is not None:
            self._loop.call_soon(self._cancel_again, again)

    def take_back_cancels(self, record: Record) -> bool:
        """Whether every cancellation pending on this runner is `cancel_attempts`' for `record`
        (its task is ended already): then they are taken back and the runner goes on. False: the
        run's own cancellation (or another), which the runner lets unwind."""
        me = asyncio.current_task()
        if me is None or self.cancelled or record.cancelling is None:
            return False
        current = self._running.get(me)
        if current is None or not current.cancels or me.cancelling() != current.cancels:
            return False
        for _ in range(current.cancels):
            me.uncancel()
        current.cancels = 0
        return True

    def wake_one(self) -> None:
        """Wake one parked runner, if any, unless one woken already has yet to run: that one looks
        at the queue and the slots as they are when it runs. The ready tasks' wake-ups meanwhile
        are owed (`wake`), and paid one at a time as runners take tasks (`_runner`), until one
        finds nothing to take. So a burst of ready tasks wakes runners one after another, as
        tasks are taken, not one per task at once: a runner whose agent returns without waiting
        takes the whole burst itself before the others run, and each of those would wake to find
        nothing (a worker's claims, of no-op tasks: nearly every wake-up was such). A slot
        freed meanwhile is owed too: several freed at once (another run's attempts ending) each
        start a task here, and the one woken runner takes only one of them."""
        if self.waking:
            self.owed += 1
        else:
            self._wake()

    def _wake(self) -> None:
        parked = self.parked
        while parked:
            waiter = parked.pop()
            if not waiter.done():
                waiter.set_result(None)
                self.waking += 1
                return

    def _wake_all(self) -> None:
        while self.parked:
            self._wake()

    async def _runner(self) -> None:
        # Parking on a bare future (not an anyio.Event) is the cheapest wait there is: one
        # allocation; `wake_one` wakes a runner when a task is ready or a slot frees.
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        assert me is not None
        store = self.store
        capacity = self._capacity
        limiter = capacity.limiter
        router = self.router
        attempts = self.attempts
        claim = store.claim
        only = router.only
        limit = capacity.limit
        cancelling = me.cancelling  # (a local: `me.cancelling()` is an unspecialized lookup)
        run = self.run
        current = self._running[me] = CurrentTask()
        # Each runner runs in its own copy of the context: the value never leaks out of it.
        TASK_ID.set(current)
        spare: Context | None = None
        # What `getrefcount` says of an object that only a local of this frame holds, read the
        # way the reuse test below reads it: 2 up to CPython 3.13 (the local and the call's
        # argument), 1 from 3.14 on, where the compiler may borrow a local it loads for a call.
        # A constant 2 there would hand an agent's kept context to the next attempt.
        probe = object()
        alone = getrefcount(probe)
        del probe
        done = 0
        try:
            while not self.closing:
                if (
                    self.halted
                    or router.recheck
                    or limiter.in_use >= limit
                    or router.budget is not None
                    or (record := claim()) is None
                ):
                    picked = self._take()  # paused, full, tasks in lanes first, or none ready
                    if picked is None:
                        # Nothing to do. If every unfinished task is running and the input is
                        # over, nothing can become ready but through them (a retry, a spawn, a
                        # dependent), and `ready` starts a runner then: leave now rather than be
                        # woken at the end only to leave. While a streamed input may bring more
                        # (a worker's claims come in bursts), park: waking a parked runner costs
                        # a fraction of starting a new one for each task.
                        if self.closing or (
                            store.unfinished <= attempts.running and not run.input_open
                        ):
                            return
                        self.owed = 0  # nothing it could take: none is owed a runner
                        waiter = loop.create_future()
                        self.parked.append(waiter)
                        try:
                            await waiter
                        finally:
                            if waiter.done() and not waiter.cancelled():  # woken: it runs now
                                self.waking -= 1
                        continue
                    record, token, slot, cost = picked
                else:
                    # The common choice, inline: the only agent of the kind, healthy, with room,
                    # nobody waiting in a lane, no limits of its own. `_choose` makes the others.
                    token = record.token
                    slot = only.get(record.kind) if record.target is None else None  # type: ignore[assignment]
                    if (
                        slot is not None
                        and record.deadline is None
                        and slot.breaker.state is CLOSED
                        and slot.in_flight < slot.limit
                        and not router.held
                        and not slot.limiters
                    ):
                        cost = None
                    elif (picked := self._choose(record)) is None:
                        continue  # it waits in a lane (or ended): claim the next one
                    else:
                        record, token, slot, cost = picked
                if self.owed and not self.waking:
                    # It took a task: the next owed wake-up (see `wake_one`).
                    self.owed -= 1
                    self.wake()
                current.record = record
                ctx = attempts.begin(record, token, slot, cost, spare)
                if ctx is False:
                    await attempts.run(record, token, slot, cost)
                elif ctx is not None:
                    # The plain attempt (see `orchestra._core._attempt`): the runner awaits the call.
                    spare = None
                    call = slot.call  # (a local: `slot.call(...)` is an unspecialized lookup)
                    try:
                        output = await call(record.task, ctx)
                        attempts.returned(record, token, slot, output, ctx)
                    except BaseException as exc:
                        if attempts.threw(record, token, slot, exc, ctx):
                            raise
                    if (
                        getrefcount(ctx) == alone  # only this frame holds it: no one kept it
                        and ctx._spawned is None
                        and ctx._usage is None
                        and ctx._on_end is None
                    ):
                        spare = ctx
                current.record = None
                # The run is cancelled, and the agent swallowed it: no new attempt. (Unless
                # `cancel_attempts` cancelled this attempt alone: the runner goes on.)
                if cancelling() and not self.take_back_cancels(record):
                    return
                done += 1
                if not done % _YIELD_EVERY:
                    await asyncio.sleep(0)
        finally:
            self._runners -= 1
            del self._running[me]

    # -- choosing --------------------------------------------------------------------------------

    def _take(self) -> tuple[Record, int, AgentSlot, Cost | None] | None:
        """The best task an agent has room for now, with its lease token, its agent and what it
        reserved on the agent's limits (or None: nothing can start now)."""
        if self.halted:
            if not self.running and self.on_drained is not None:
                self.on_drained()
            return None
        capacity = self._capacity
        limiter = capacity.limiter
        if limiter.in_use >= capacity.limit:
            capacity.blocked = True
            limiter.watch(self.wake_one)  # another orchestrator sharing it may free a slot
            return None
        router = self.router
        if router.recheck:  # tasks that waited for room in a lane go first
            picked = router.take_held()
            if picked is not None:
                return picked
        store = self.store
        while not self.closing:  # a reservation may end the run (its budget): then claim no more
            record = store.claim()
            if record is None:
                return None
            picked = self._choose(record)
            if picked is not None:
                return picked
        return None

    def _choose(self, record: Record) -> tuple[Record, int, AgentSlot, Cost | None] | None:
        """The agent for a claimed task, and what the task reserved on its limits; None when it
        waits in a lane for room (or ended: its deadline passed, its chain ran out)."""
        token = record.token
        router = self.router
        routed = router.route(record, token)
        if routed is None:
            return None
        if not routed.limiters and router.budget is None:
            return record, token, routed, None
        cost = router.reserve(record, token, routed)
        return None if cost is None else (record, token, routed, cost)

    # -- room (a store that shares the run with other processes asks) ---------------------------

    def room(self, kind: str, hold: bool = True) -> int:
        """How many more tasks of `kind` could start now: the free places of its agents and of
        its chain's, at most the global limit's free places, less the tasks waiting in their
        lanes and the kind's. An agent's free places: its own limit, or a shared `Concurrency`'s
        free places when fewer (counted once for the agents that share it), less its attempts
        in flight; one at most while it has other limits (a rate, a budget: how many they let
        through, only reserving tells), and while they have no room now, one if no task waits
        for it yet (it waits in its lane, whose timer wakes the run), else none. While an agent
        of the kind is down (its breaker not closed), no bound (`UNBOUNDED`). O(agents of the
        kind + tasks waiting). Not on the in-memory path: only a store that shares the run with
        other processes asks (see `stores/_room.py`). None while the run is paused or held: what
        it claimed would wait here while another process could run it.

        Without `hold` (a worker's claims: its claim loop looks again by itself, and what it
        holds waits while another process may have room), none for a wait: none while the
        limits have no room now, and while an agent is down, one for its probe if the probe may
        go now and no task waits for it yet, else none."""
        if self.halted:
            return 0
        router = self.router
        slots = self._agents_of.get(kind)
        if slots is None:
            by_name = self.registry.slots
            found = dict.fromkeys(router.kind_slots.get(kind, ()))
            found.update(dict.fromkeys(by_name[n] for n in router.chains.get(kind, ())))
            slots = self._agents_of[kind] = list(found)
        free = 0
        waiting = router.queued(kind)
        shared: dict[Concurrency, int] | None = None  # places under a shared `Concurrency`
        for slot in slots:
            queued = router.queued(slot)
            waiting += queued
            if slot.breaker.state is not CLOSED:
                if hold:
                    # Down: its kind's tasks are claimed as they come and wait for its probe,
                    # each charged an attempt when the probe fails, so that an agent down for
                    # good fails them fast; set aside, they would wait uncharged, a few at a time.
                    return UNBOUNDED
                # A worker: the probe's task, when it may go now; the rest stay in the store.
                if not queued and slot.breaker.available(self._time()):
                    free += 1
                continue
            places = slot.limit - slot.in_flight
            limiters = router.limiters(slot)
            under: Concurrency | None = None
            if limiters and places > 0:
                now = self._time()
                for limiter in limiters:
                    if isinstance(limiter, Concurrency):
                        left = limiter.limit - limiter.in_use
                        if under is None or left < under.limit - under.in_use:
                            under = limiter
                        places = min(places, left)
                    else:  # room for one at most: how many more, only reserving tells
                        places = min(places, 1)
                    if limiter.peek(now, DEFAULT_COST) > 0:  # room at T (a rate, a pause)
                        # One task waits for it: its lane's timer or watcher wakes the run then.
                        places = min(places, 0 if queued or not hold else 1)
            if places <= 0:
                continue
            if under is None:
                free += places
            else:  # agents sharing one limit have its free places once, not once each
                shared = shared or {}
                shared[under] = shared.get(under, 0) + places
        if shared:
            for limiter, places in shared.items():
                free += min(places, limiter.limit - limiter.in_use)
        capacity = self._capacity
        cap = capacity.limit - capacity.limiter.in_use
        return (free if free < cap else cap) - waiting

    # -- timers ----------------------------------------------------------------------------------

    def schedule(self) -> None:
        """Arm the run's one timer for its next due time (a retry, a deadline, a recovery)."""
        if self._loop is None or self.closing:
            return
        at = math.inf
        due = self.store.next_due()
        if due is not None:
            at = due
        wakeup = self.router.next_wakeup()
        if wakeup < at:
            at = wakeup
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
        now = self.router.reached = max(self._time(), self._timer_at)
        self._timer = None
        self._timer_at = math.inf
        if self.closing:
            return
        for record in self.store.due(now):
            state = record.state
            if state is RUNNING:
                continue  # its attempt's own cancel scope ends it at the deadline
            self.chain_end(
                record,
                record.token,
                f"the deadline passed while the task waited for attempt {record.attempts + 1}",
                "TaskTimeout",
            )
        waiting = self.router.due(now)
        self.schedule()
        # Wake a runner for each lane that may go on (and for retries the store made ready).
        for _ in range(waiting or 1):
            if self.parked:
                self.wake_one()
            elif self._pool is not None and self._runners < self._capacity.limit:
                self._runners += 1
                self._spawn(self._runner())

    # -- what a failure leads to (orchestra._core._recovery) --------------------------------------------

    def chain_end(
        self,
        record: Record,
        token: int,
        reason: str,
        error_type: str | None = None,
        attempt: Attempt | None = None,
    ) -> None:
        self.recovery.chain_end(record, token, reason, error_type, attempt)

    def emit_fallback(self, record: Record, slot: AgentSlot, nxt: Any, reason: str) -> None:
        self.recovery.emit_fallback(record, slot, nxt, reason)

    def moved(self, record: Record, slot: AgentSlot) -> None:
        self.recovery.moved(record, slot)
