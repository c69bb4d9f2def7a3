"""One run, top to bottom: admit the input into the store, let the dispatcher work, hear every task
end, report.

`Run.execute` is the whole story: check a whole input before anything starts (or stream it in with
backpressure), start the workers, wait until every admitted task is terminal (or the run timeout
passes, or the caller cancels), end what is left as cancelled, and build the `RunResult`. A run
*holds* a store (every task's state and transitions) and a dispatcher (which task, which agent);
it is the store's listener: `ready` hands a task to the dispatcher, `finished` folds a result into
the aggregate, the report and the result stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, Iterable, Iterator
from datetime import UTC, datetime
from itertools import islice
from operator import length_hint
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import structlog

from .._admission import Admission
from .._aggregate import Ordered
from .._budget import BUDGET_EXCEEDED, BudgetGate
from .._clock import loop_time
from .._events import RunFinished, RunStarted, TaskFinished, TaskReady
from .._failure import describe, with_type
from .._gc import paused, running
from .._log import get_logger
from .._result import CancelRecord
from .._task import CANCELLED, CLAIMED, RUNNING, SUCCEEDED, Attempt, Task
from ..stores._protocol import Selector
from ._dispatch import Dispatcher
from ._instruments import RunInfo
from ._report import Report

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from anyio.streams.memory import MemoryObjectSendStream

    from .._aggregate import Accumulator
    from .._budget import Budget
    from .._events import EventBus
    from .._faults import Faults
    from .._limits import Capacity
    from .._record import Record
    from .._registry import Registry
    from .._result import RunResult
    from .._retry import RetryPolicy, Timeouts
    from .._task import TaskResult
    from .._verify import Check
    from ..stores._protocol import RunStore
    from ._instruments import Instruments

__all__ = ("Run", "RunConfig")

log = get_logger("orchestra")

_CHUNK = 1_024  # a plain iterable input is admitted this many tasks at a time


class RunConfig:
    """What a run takes from its orchestrator (built once per orchestrator)."""

    __slots__ = (
        "aggregate",
        "budget",
        "bus",
        "capacity",
        "defaults",
        "faults",
        "instruments",
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
        faults: Faults,
        instruments: Instruments | None = None,
        budget: Budget | None = None,
    ) -> None:
        self.registry = registry
        self.instruments = instruments  # metrics and tracing hooks; None: none, nothing to call
        self.budget = budget
        self.faults = faults  # the simulated failures (the fault kit's): they hear how tasks end
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


class Run:
    """The state of one run: its store, its dispatcher, its report and its aggregate."""

    def __init__(self, config: RunConfig, run_id: str) -> None:
        self.config = config
        self.run_id = run_id
        self.report = Report()
        self.bus = config.bus
        self.t0 = 0.0
        self.t_end: float | None = None  # loop time when the run ended (for its status)
        self.debug = _debug_enabled()
        # A reader's stream of the results (see `attach_results`).
        self._results: MemoryObjectSendStream[TaskResult] | None = None
        self._acc: Accumulator = config.aggregate.begin()
        # A built-in aggregate: a whole-list run gives it the store's successes at its end.
        self._ordered = self._acc if isinstance(self._acc, Ordered) else None
        self._count_only = False  # see `listeners_changed`
        # The store's (`Listener.quiet`): see `listeners_changed`.
        self.quiet: list[Record] | None = None
        # The orchestrator's simulated faults by agent, as they come and go (a dict: its truth test
        # is the one cost per task end when there are none).
        self._faults = config.faults.by_agent
        self._agg_error: str | None = None
        self._window = config.window
        self._window_free: anyio.Event | None = None
        self._done = anyio.Event()
        self._input_done = False
        # Items of a streamed input never read when the run ended before its end: known for an
        # iterator with a length hint, else None (a generator's rest is unknown).
        self._input_left: int | None = None
        self._input_error: BaseException | None = None
        self._streamed = False
        self._stop_reason: str | None = None
        self.stopping = False  # a run handle's `stop()` is waiting out its grace period
        self._budget = config.budget
        self._spent: str | None = None  # why the budget ended the run
        self._ended: list[Record] | None = None  # the tasks that end during a `cancel` call
        # A run handle's cancels and priorities made before the run had its tasks, applied to a
        # streamed input's tasks as they are admitted (see `cancel_standing`).
        self._standing: list[tuple[Selector, str, dict[str, Any], CancelRecord, bool]] = []
        self._priorities: dict[str, int] = {}
        self.on_open: Callable[[], None] | None = None  # a run handle's: the run has its store
        self.instruments = config.instruments
        self.info: RunInfo  # what the instruments see of this run (set when it has some)
        self.store: RunStore
        self.dispatcher: Dispatcher

    # -- the listener of the store ---------------------------------------------------------------

    def ready(self, record: Record) -> None:
        if self.bus.active and self.bus.wants(TaskReady):
            self.bus.emit(
                TaskReady(
                    self.dispatcher.now(), self.run_id, record.id, record.kind, record.priority
                )
            )
        if record.parent is not None:
            self.report.ready(record)
        self.dispatcher.ready(record)

    def ready_all(self, records: Sequence[Record]) -> None:
        if self.bus.active and self.bus.wants(TaskReady):
            for record in records:
                self.ready(record)
            return
        self.dispatcher.ready_all(records)

    def wake(self) -> None:
        self.dispatcher.wake()

    def hold(self, held: bool) -> None:
        self.dispatcher.hold(held)

    def finished(self, record: Record) -> None:
        status = record.status
        if status is SUCCEEDED and self._count_only and record.started is not None:
            # The common end, when nothing but the counts and a built-in aggregate hear of it
            # (what the in-memory store does itself with all but the last, in `quiet`): the
            # report's batch is counted only when something reads the counts (a status, the
            # result), in one go; the aggregate takes the store's records at the end.
            self.report.batch.append(record)
            if not self.store.unfinished and self._input_done:
                self._finish()
            return
        self.report.finished(record)
        if status is SUCCEEDED and self._agg_error is None:
            try:
                self._acc.add(record)
            except (Exception, asyncio.CancelledError) as exc:  # a user's reducer (sync code:
                # a CancelledError from it is its own) must not lose the run's result
                self._aggregator_failed(exc)
        if self._faults:
            self.config.faults.task_ended(record.id, status)
        if self.debug:
            log.debug(
                "task finished",
                task_id=record.id,
                kind=record.kind,
                status=status,
                agent=record.agent,
            )
        if self.bus.active and self.bus.wants(TaskFinished):
            self.bus.emit(TaskFinished(self.dispatcher.now(), self.run_id, record))
        if self._ended is not None:
            self._ended.append(record)
        if self.instruments is not None:
            self.instruments.task_ended(self.info, record)
        if self._results is not None:
            try:
                self._results.send_nowait(record)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._results = None  # the stream's reader went away; the run goes on
        if self._window_free is not None:
            self._window_free.set()
            self._window_free = None
        if not self.store.unfinished and self._input_done:
            self._finish()

    # -- the run ---------------------------------------------------------------------------------

    async def execute(self, source: Iterable[Task] | AsyncIterable[Task]) -> RunResult:
        with running():  # what the run admits is kept out of the GC's sight (see `_gc`)
            return await self._execute(source)

    async def _execute(self, source: Iterable[Task] | AsyncIterable[Task]) -> RunResult:
        config = self.config
        loop = asyncio.get_running_loop()
        self.t0 = loop.time()  # virtual under a FakeClock
        wall0 = datetime.now(UTC)
        whole = isinstance(source, list | tuple)
        self._streamed = not whole
        self.listeners_changed()
        registry = config.registry
        self.store = config.store.open_run(
            self.run_id,
            admission=Admission(
                [k for k, v in registry.by_kind.items() if v], registry.input_models()
            ),
            listener=self,
            clock=loop_time(loop),
            task_timeout=config.timeouts.task,
            compact=not whole,
        )
        dispatcher = self.dispatcher = Dispatcher(self, self.store)
        dispatcher.bind_clock(loop)
        if self._budget is not None:  # checked before each attempt (see `_budget`)
            dispatcher.router.gate = BudgetGate(self._budget, self.report, self._budget_spent)
        if self.instruments is not None:
            self.info = RunInfo(self.run_id, self.t0, self)
        dropped = self.bus.dropped
        if self.bus.active:
            self.bus.emit(RunStarted(self.t0, self.run_id))
        if whole:  # a whole input is checked before anything runs
            self.store.admit(source, where="tasks", forward=True)  # type: ignore[arg-type]
            self.report.admitted(source)  # type: ignore[arg-type]
            self._close_input()
        if self.on_open is not None:
            self.on_open()  # before any worker: a handle's pause or cancel holds from the start
        if self.instruments is not None:
            self.instruments.run_started(self.info)
        capacity = config.capacity
        capacity.runs.append(dispatcher)
        timed_out = cancelled = False
        with structlog.contextvars.bound_contextvars(run_id=self.run_id):
            log.info("run started", tasks=self.store.unfinished if whole else "streamed")
            try:
                async with asyncio.TaskGroup() as pool:
                    dispatcher.start(pool, loop)
                    feeder = None if whole else pool.create_task(self._feed(source))
                    if self._input_done and not self.store.unfinished:
                        self._finish()
                    try:
                        with anyio.move_on_after(config.timeouts.run) as scope:
                            await self._done.wait()
                        timed_out = scope.cancelled_caught and self._stop_reason is None
                    finally:
                        # However it ends (done, timed out, the caller cancelled), before the
                        # group cancels its tasks: no attempt starts or settles after this.
                        dispatcher.cancel_all()  # parked and running workers
                        if feeder is not None:
                            feeder.cancel()
            except asyncio.CancelledError:
                cancelled = True
                raise
            finally:
                self.t_end = loop.time()
                capacity.runs.remove(dispatcher)
                dispatcher.stop()
                try:
                    # Durable before anything leaves the run; what `_cancel_rest` ends next is not
                    # written down: the run id resumes a stopped or cancelled run from here.
                    self.store.close()
                finally:
                    if (
                        cancelled
                        or timed_out
                        or self._stop_reason is not None
                        or self._spent is not None
                    ):
                        self._cancel_rest(timed_out)
                    if self._results is not None:
                        self._results.close()
                    if cancelled:
                        self._emit_finished("cancelled", loop.time() - self.t0)
            if self._input_error is not None:
                if self.instruments is not None:
                    self.instruments.run_ended(self.info, "failed", loop.time() - self.t0)
                raise self._input_error
            result = self._result(wall0, self.bus.dropped - dropped)
            log.info(
                "run finished", status=result.status, elapsed=round(result.metadata.elapsed, 6)
            )
        self._emit_finished(result.status, result.metadata.elapsed)
        return result

    def _cancel_rest(self, timed_out: bool) -> None:
        """End every unfinished task as cancelled, once (the workers are gone by now)."""
        if timed_out:
            reason = f"run timeout after {self.config.timeouts.run}s"
            error_type = "RunTimeout"
            self.report.reason = reason
            self.report.cut_short = True
        elif self._spent is not None:
            reason, error_type = self._spent, BUDGET_EXCEEDED
            self.report.reason = reason
            self.report.cut_short = True
        elif self._stop_reason is not None:
            reason, error_type = self._stop_reason, "Stopped"
            self.report.reason = reason
            self.report.cancelled = True
        else:
            reason, error_type = "the run was cancelled", "Cancelled"
            self.report.cancelled = True
        store = self.store
        # Claimed or running ones come back flagged: their workers are gone, so end them here.
        for record in store.cancel(Selector(), reason, error_type):
            self._end_flagged(record, reason, error_type)

    def _end_flagged(self, record: Record, reason: str, error_type: str) -> None:
        """End a claimed or running task a cancel flagged, here: what its attempt still does
        (returns, raises) is refused by the store from now on. A running one ends on the agent
        it ran on ("the last one tried": a metrics label, `orchestra run`'s line), the attempt
        the cancel cut short listed last in its attempts (its error record lists every one)."""
        cut = None
        if record.state == RUNNING and record.target is not None:
            start = getattr(record, "t_retry", None) if record.attempts > 1 else record.t_start
            now = self.dispatcher.now()
            if start is None:
                start = now
            cut = Attempt(
                number=record.attempts,
                agent=record.target,
                error_type=error_type,
                message=reason,
                started=start - self.t0,
                duration=max(0.0, now - start),
            )
        self.store.settle(
            record,
            record.token,
            CANCELLED,
            agent=None if cut is None else cut.agent,
            error=reason,
            error_type=error_type,
            attempt=cut,
        )

    def _emit_finished(self, status: str, elapsed: float) -> None:
        if self.instruments is not None:
            self.instruments.run_ended(self.info, status, elapsed)
        if self.bus.active:
            self.bus.emit(RunFinished(self.dispatcher.now(), self.run_id, status, elapsed))

    def _result(self, wall0: datetime, dropped: int) -> RunResult:
        with paused(self.report.attempts):  # a few objects per task, all kept: see `_gc`
            return self._build_result(wall0, dropped)

    def _build_result(self, wall0: datetime, dropped: int) -> RunResult:
        if not self._streamed and self._ordered is not None:
            # A whole-list run's store has every record, in input order: its successes are the
            # aggregate's results, sorted already (the aggregate was not given those that ended
            # in `quiet`).
            self._ordered.in_order([r for r in self.store.results() if r.status is SUCCEEDED])
        data = None
        if self._agg_error is None:
            try:
                data = self._acc.finish()
            except (Exception, asyncio.CancelledError) as exc:  # a user's reducer (sync code:
                # a CancelledError from it is its own) must not lose the run's result
                self._aggregator_failed(exc)
        if self._agg_error is not None:
            self.report.reason = self._agg_error
        return self.report.result(
            run_id=self.run_id,
            wall0=wall0,
            elapsed=self.dispatcher.now() - self.t0,
            threshold=self.config.success_threshold,
            data=data,
            events_dropped=dropped,
            resumed=self.store.resumed,
            input_unread=0 if self._input_done else self._input_left,
            input_complete=self._input_done,
        )

    def _aggregator_failed(self, exc: BaseException) -> None:
        """A user's aggregator raised: the run goes on; `data` is None and `metadata.reason` says why."""
        log.error("aggregator raised; data will be None", exc_info=True)
        failure = describe(exc)  # its text bounded and scrubbed: it becomes the result's reason
        self._agg_error = f"aggregator raised {with_type(failure.error_type, failure.message)}"

    def _finish(self) -> None:
        self._done.set()
        self.dispatcher.stop()

    # -- control (a run handle's) ----------------------------------------------------------------

    def stop(self, reason: str) -> None:
        """End the run now: what runs is cancelled, what waits ends as cancelled ("Stopped"), and
        the run returns its `RunResult` with status "cancelled" and `reason`. Once; a run that
        already ended is left as it is."""
        if self._done.is_set():
            return
        self._stop_reason = reason
        self._done.set()
        self.dispatcher.stop()  # no attempt starts from now on, not even before the run wakes

    def cancel(
        self, selector: Selector, reason: str, described: dict[str, Any], *, quiet: bool = False
    ) -> CancelRecord:
        """Cancel the unfinished tasks `selector` matches, as one step: waiting ones end at once,
        running ones end now too and their attempts are cancelled through their workers; their
        dependents are skipped. Returns (and records in the report) what ended."""
        store = self.store
        if selector.agent is not None:  # the tasks waiting for room at the agent are bound to it
            selector = selector.holding(self.dispatcher.router.held_for(selector.agent))
        ended = self._ended = []
        try:
            flagged = store.cancel(selector, reason, "Cancelled")
            for record in flagged:  # ended here: the cancel is done when this call returns
                self._end_flagged(record, reason, "Cancelled")
        finally:
            self._ended = None
        if flagged:
            self.dispatcher.cancel_attempts(flagged)
        cancelled = [r.id for r in ended if r.status == CANCELLED]
        skipped = [r.id for r in ended if r.status != CANCELLED]
        record = CancelRecord(
            at=self.dispatcher.now() - self.t0,
            reason=reason,
            selector=described,
            cancelled=cancelled,
            skipped=skipped,
        )
        if (cancelled or skipped) and not quiet:  # quiet: the caller files it (`_admitted`)
            self.report.cancellations.append(record)
        return record

    def cancel_standing(self, selector: Selector, reason: str, described: dict[str, Any]) -> None:
        """A cancel made before the run had its tasks (a run handle's, deferred): applied now to
        what is admitted, and, while a streamed input is still arriving, to each task admitted
        later, as it is admitted. What it ends is one `CancelRecord`."""
        done = self.cancel(selector, reason, described)
        if not self._input_done:
            filed = bool(done.cancelled or done.skipped)  # in the report already
            self._standing.append((selector, reason, described, done, filed))

    def reprioritize(self, task_id: str, priority: int) -> bool:
        """Give a task that has not started another priority: in the store's queue, or where it
        waits for an agent's slot (claimed, in a lane). False if it does not wait."""
        store = self.store
        if store.reprioritize(task_id, priority):
            return True
        if store.state_of(task_id) is not CLAIMED:  # running, ended or unknown: no lane to search
            return False
        router = self.dispatcher.router
        lane = router.holding(task_id)  # O(tasks in lanes)
        if lane is None or not store.reprioritize(task_id, priority, claimed=True):
            return False
        router.moved(lane, task_id)
        return True

    def reprioritize_standing(self, task_id: str, priority: int) -> None:
        """A `reprioritize` made before the run had its tasks: applied now, or when the task is
        admitted (a streamed input still arriving)."""
        if not self.reprioritize(task_id, priority) and not self._input_done:
            self._priorities[task_id] = priority

    def _admitted(self, tasks: Sequence[Task]) -> None:
        """Apply the standing cancels and priorities to tasks of a streamed input just admitted."""
        priorities = self._priorities
        if priorities:
            for task in tasks:
                priority = priorities.pop(task.id, None)
                if priority is not None:
                    self.store.reprioritize(task.id, priority)
        for i, (selector, reason, described, done, filed) in enumerate(self._standing):
            ids = [task.id for task in tasks]
            if selector.task_ids is not None:
                ids = [task_id for task_id in ids if task_id in selector.task_ids]
            if not ids:
                continue
            among = Selector(
                task_ids=ids,
                kind=selector.kind,
                tag=selector.tag,
                agent=selector.agent,
                priority=selector.priority,
            )
            more = self.cancel(among, reason, described, quiet=True)
            if not (more.cancelled or more.skipped):
                continue
            # The cancel's record grows in place as the input arrives (nobody else sees it before
            # the run ends): a new record for each task admitted copied every id so far, O(n^2)
            # over a streamed input.
            done.cancelled.extend(more.cancelled)
            done.skipped.extend(more.skipped)
            if not filed:
                self.report.cancellations.append(done)
                self._standing[i] = (selector, reason, described, done, True)

    def attach_results(self, send: MemoryObjectSendStream[TaskResult]) -> None:
        """Send every `TaskResult` from now on to `send` (a run handle's reader); closed at the end."""
        if self._results is None:
            self._results = send
            self.listeners_changed()

    def listeners_changed(self) -> None:
        """Decide whether a success is only counted (`finished`'s inline case, and the store's
        `quiet`): when nobody else hears of each task's end (no debug log, instrument, stream,
        input window, subscriber or simulated fault). Called at the start, when a reader comes,
        and by the orchestrator when a subscriber or a fault comes or goes mid-run."""
        self._count_only = (
            self._ordered is not None
            and not self.debug
            and self.instruments is None
            and self._results is None
            and not self._streamed
            and not self.bus.active
            and not self._faults
        )
        self.quiet = self.report.batch if self._count_only else None

    # -- streamed input --------------------------------------------------------------------------

    async def _feed(self, source: Iterable[Task] | AsyncIterable[Task]) -> None:
        """Admit a streamed input, with backpressure (at most `window` tasks unfinished, unless
        none can progress without more input: see `_wait_for_window`; and none while the store's
        writes are behind: `RunStore.backpressure`).

        What the input raises (an `InputError` for a bad task, or the source's own error) ends the
        run and reaches the caller as it is; the source is closed however the run ends."""
        pulled = 0
        store = self.store
        iterator: Iterator[Task] | None = None
        try:
            if isinstance(source, AsyncIterable):
                async for task in source:  # each item admitted as soon as it arrives
                    if store.unfinished >= self._window or self._results is not None:
                        await self._wait_for_window()
                    while (behind := store.backpressure()) is not None:
                        await behind
                    store.admit_one(task, pulled)
                    self.report.admitted_one(task.kind)
                    pulled += 1
                    if self._standing or self._priorities:
                        self._admitted((task,))
            else:  # a plain iterable never waits: admit it in chunks, as the window allows
                iterator = iter(source)
                while True:
                    await self._wait_for_window()
                    while (behind := store.backpressure()) is not None:
                        await behind
                    room = max(1, min(_CHUNK, self._window - store.unfinished - self._unread()))
                    chunk = list(islice(iterator, room))
                    if not chunk:
                        break
                    store.admit(chunk, where="input item", forward=False, first_index=pulled)
                    self.report.admitted(chunk)
                    pulled += len(chunk)
                    if self._standing or self._priorities:
                        self._admitted(chunk)
                    await anyio.lowlevel.checkpoint()  # let the workers start on it
        except (Exception, SystemExit, KeyboardInterrupt) as exc:
            # `sys.exit()` and Ctrl-C from the source too: raised in this task, they would leave the
            # event loop and abandon the caller's `await`; the caller gets them once the run ends.
            self._input_error = exc
            self._finish()
            return
        finally:
            if iterator is not None:  # read before `_close`, which may end a generator
                hint = length_hint(iterator, -1)
                self._input_left = hint if hint >= 0 else None
            with anyio.CancelScope(shield=True):
                await _close(source)
        self._close_input()
        if not store.unfinished:
            self._finish()

    async def _wait_for_window(self) -> None:
        # Every unfinished task counts, and every result the stream's reader has not taken yet;
        # but when no task is ready or running (all wait for dependencies or groups that only the
        # rest of the input can complete) and no result waits for the reader, more input is the
        # only way forward, and it is let in.
        store = self.store
        while True:
            unread = self._unread()
            if store.unfinished + unread < self._window or not (
                unread or store.unfinished > store.pending
            ):
                return
            event = self._window_free = anyio.Event()
            await event.wait()

    def _unread(self) -> int:
        results = self._results
        return 0 if results is None else results.statistics().current_buffer_used

    def reader_progress(self) -> None:
        """The stream's reader took a result: the window may have room."""
        if self._window_free is not None:
            self._window_free.set()
            self._window_free = None

    # -- what the instruments read (`RunInfo`) ---------------------------------------------------

    def now(self) -> float:
        """The run's clock (the event loop's, virtual under a FakeClock)."""
        return self.dispatcher.now()

    @property
    def running(self) -> int:
        """Attempts under way."""
        return self.dispatcher.running

    @property
    def unfinished(self) -> int:
        """Admitted tasks not yet terminal."""
        return self.store.unfinished

    @property
    def waiting(self) -> int:
        """Admitted tasks waiting for their dependencies (never ready yet)."""
        return self.store.pending

    @property
    def input_complete(self) -> bool:
        """Every task of the input has been admitted (a streamed input may still be arriving)."""
        return self._input_done

    @property
    def ended(self) -> bool:
        """The run is over: every task ended, or it was timed out or cancelled."""
        dispatcher = getattr(self, "dispatcher", None)
        return self._done.is_set() or (dispatcher is not None and dispatcher.cancelled)

    def _close_input(self) -> None:
        self._input_done = True
        self._standing.clear()
        self._priorities.clear()
        self.store.close_input()

    def record_usage(
        self,
        cost: float,
        tokens: Mapping[str, int],
        agent: str | None = None,
        model: str | None = None,
    ) -> None:
        self.report.usage(cost, tokens, agent, model)

    def _budget_spent(self, reason: str) -> None:
        """The budget refused an attempt and none is in flight: no attempt will start again, so
        the run ends (see `_budget`)."""
        if self._spent is None and not self._done.is_set():
            log.warning("run budget reached; ending the run", reason=reason)
            self._spent = reason
            self._finish()


async def _close(source: object) -> None:
    aclose = getattr(source, "aclose", None)
    if aclose is not None:
        await aclose()
        return
    close = getattr(source, "close", None)
    if close is not None:
        close()


def _debug_enabled() -> bool:
    """Whether per-task DEBUG lines are wanted: asked once per run, so a run at INFO builds none."""
    return logging.getLogger("orchestra").isEnabledFor(logging.DEBUG)
