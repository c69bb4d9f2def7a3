"""One run, top to bottom: admit the input into the store, let the dispatcher work, hear every task
end, report.

`Run.execute` is the whole story: check a whole input before anything starts (or stream it in with
backpressure), start the dispatcher, wait until every admitted task is terminal (or the run
timeout passes, or the caller cancels), end what is left as cancelled, and build the `RunResult`.
A run *holds* a store (every task's state and transitions), a dispatcher (which task, which
agent), its input (`_input.py`: admission, whole or streamed) and a run handle's control
(`_control.py`: cancels, priorities); it is the store's listener: `ready` hands a task to the
dispatcher, `finished` folds a result into the aggregate, the report and the result stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import anyio
import structlog

from .._admission import Admission
from .._aggregate import Ordered
from .._budget import BUDGET_EXCEEDED, BudgetAccount
from .._clock import loop_time
from .._events import RunFinished, RunStarted, TaskFinished, TaskReady
from .._exceptions import StoreError
from .._failure import describe, with_type
from .._gc import paused, running
from .._log import get_logger
from .._task import SUCCEEDED
from ..stores._protocol import Selector
from ._control import Control
from ._dispatch import Dispatcher
from ._input import Input
from ._instruments import RunInfo
from ._report import Report

if TYPE_CHECKING:
    from collections.abc import AsyncIterable, Callable, Iterable, Mapping, Sequence

    from anyio.streams.memory import MemoryObjectSendStream

    from .._aggregate import Accumulator
    from .._record import Record
    from .._result import RunResult
    from .._task import Task, TaskResult
    from ..stores._protocol import RunStore
    from ._runconfig import RunConfig

__all__ = ("Run",)

log = get_logger("orchestra")


class Run:
    """The state of one run: its store, its dispatcher, its input, its report and its aggregate."""

    def __init__(self, config: RunConfig, run_id: str) -> None:
        self.config = config
        self.run_id = run_id
        self.report = Report(keeps_history=config.keeps_history)
        self.bus = config.bus
        self.t0 = 0.0
        self.t_end: float | None = None  # loop time when the run ended (for its status)
        self.debug = _debug_enabled()
        # A reader's stream of the results (see `attach_results`).
        self.result_stream: MemoryObjectSendStream[TaskResult] | None = None
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
        self.control = Control(self)  # a run handle's cancels and priorities
        self.input = Input(self, config.window, self.control)
        self._done = anyio.Event()
        self._streamed = False
        self._stop_reason: str | None = None
        self.stopping = False  # a run handle's `stop()` is waiting out its grace period
        self._budget = config.budget
        self._spent: str | None = None  # why the budget ended the run
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

    def room(self, kind: str, *, hold: bool = True) -> int:
        return self.dispatcher.room(kind, hold)

    def stalled(self, longer_than: float) -> list[str]:
        return [record.id for record in self.dispatcher.router.stalled(longer_than)]

    def finished(self, record: Record) -> None:
        status = record.status
        if status is SUCCEEDED and self._count_only and record.started is not None:
            # The common end, when nothing but the counts and a built-in aggregate hear of it
            # (what the in-memory store does itself with all but the last, in `quiet`): the
            # report's batch is counted only when something reads the counts (a status, the
            # result), in one go; the aggregate takes the store's records at the end.
            self.report.batch.append(record)
            if not self.store.unfinished and self.input.done:
                self.end()
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
        ending = self.control.ending
        if ending is not None:
            ending.append(record)
        if self.instruments is not None:
            self.instruments.task_ended(self.info, record)
        if self.result_stream is not None:
            try:
                self.result_stream.send_nowait(record)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self.result_stream = None  # the stream's reader went away; the run goes on
        feed = self.input
        if feed.room is not None:
            feed.room_freed()
        if not self.store.unfinished and feed.done:
            self.end()

    # -- the run ---------------------------------------------------------------------------------

    async def execute(self, source: Iterable[Task] | AsyncIterable[Task]) -> RunResult:
        with running():  # what the run admits is kept out of the GC's sight (see `_gc`)
            return await self._execute(source)

    async def _execute(self, source: Iterable[Task] | AsyncIterable[Task]) -> RunResult:
        config = self.config
        loop = asyncio.get_running_loop()
        # A store whose run another process may hold waits here until it is this one's (an
        # optional part of the protocol: `PostgresStore.prepare_run`, a standby coordinator):
        # before the run's zero, which its store takes as its own when it opens.
        prepare = getattr(config.store, "prepare_run", None)
        if prepare is not None:
            await prepare(self.run_id)
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
            dispatcher.router.budget = BudgetAccount(self._budget, self.report, self._budget_spent)
        if self.instruments is not None:
            self.info = RunInfo(self.run_id, self.t0, self)
        dropped = self.bus.dropped
        if self.bus.active:
            self.bus.emit(RunStarted(self.t0, self.run_id))
        if whole:  # a whole input is checked before anything runs
            try:
                self.input.admit_whole(source)  # type: ignore[arg-type]
            except BaseException:
                # Refused before anything ran: let go of the run in the store (a durable one
                # holds it, and renews the hold, from `open_run`), so that the same run id,
                # its input corrected, runs at once here or in another process. The refusal
                # is what the caller must see, not a failure to let go.
                with contextlib.suppress(StoreError):
                    self.store.close()
                raise
        if self.on_open is not None:
            self.on_open()  # before any attempt: a handle's pause or cancel holds from the start
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
                    feeder = None if whole else pool.create_task(self.input.feed(source))
                    if self.input.done and not self.store.unfinished:
                        self.end()
                    try:
                        with anyio.move_on_after(config.timeouts.run) as scope:
                            await self._done.wait()
                        timed_out = scope.cancelled_caught and self._stop_reason is None
                    finally:
                        # However it ends (done, timed out, the caller cancelled), before the
                        # group cancels its tasks: no attempt starts or settles after this.
                        dispatcher.cancel_all()  # parked and running runners
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
                    if self.result_stream is not None:
                        self.result_stream.close()
                    if cancelled:
                        self._emit_finished("cancelled", loop.time() - self.t0)
            if self.input.error is not None:
                if self.instruments is not None:
                    self.instruments.run_ended(self.info, "failed", loop.time() - self.t0)
                raise self.input.error
            result = self._result(wall0, self.bus.dropped - dropped)
            log.info(
                "run finished", status=result.status, elapsed=round(result.metadata.elapsed, 6)
            )
        self._emit_finished(result.status, result.metadata.elapsed)
        return result

    def _cancel_rest(self, timed_out: bool) -> None:
        """End every unfinished task as cancelled, once (the dispatcher's runners are gone by now)."""
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
        # Claimed or running ones come back flagged: their runners are gone, so end them here.
        for record in store.cancel(Selector(), reason, error_type):
            self.control.end_flagged(record, reason, error_type)

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
            input_unread=0 if self.input.done else self.input.left,
            input_complete=self.input.done,
        )

    def _aggregator_failed(self, exc: BaseException) -> None:
        """A user's aggregator raised: the run goes on; `data` is None and `metadata.reason` says why."""
        log.error("aggregator raised; data will be None", exc_info=True)
        failure = describe(exc)  # its text bounded and scrubbed: it becomes the result's reason
        self._agg_error = f"aggregator raised {with_type(failure.error_type, failure.message)}"

    def end(self) -> None:
        """The run is over (every task ended, its input failed, its budget is spent): `execute`
        wakes to end it, and no attempt starts from now on."""
        self._done.set()
        self.dispatcher.stop()

    # -- a run handle's: stop, read the results ------------------------------------------------

    @property
    def input_open(self) -> bool:
        """Whether more input may come (a streamed input not over yet)."""
        return not self.input.done

    def stop(self, reason: str) -> None:
        """End the run now: what runs is cancelled, what waits ends as cancelled ("Stopped"), and
        the run returns its `RunResult` with status "cancelled" and `reason`. Once; a run that
        already ended is left as it is."""
        if self._done.is_set():
            return
        self._stop_reason = reason
        self._done.set()
        self.dispatcher.stop()  # no attempt starts from now on, not even before the run wakes

    def attach_results(self, send: MemoryObjectSendStream[TaskResult]) -> None:
        """Send every `TaskResult` from now on to `send` (a run handle's reader); closed at the end."""
        if self.result_stream is None:
            self.result_stream = send
            self.listeners_changed()

    # -- who hears of a task's end ---------------------------------------------------------------

    def listeners_changed(self) -> None:
        """Decide whether a success is only counted (`finished`'s inline case, and the store's
        `quiet`): when nobody else hears of each task's end (no debug log, instrument, stream,
        input window, subscriber or simulated fault). Called at the start, when a reader comes,
        and by the orchestrator when a subscriber or a fault comes or goes mid-run."""
        self._count_only = (
            self._ordered is not None
            and not self.debug
            and self.instruments is None
            and self.result_stream is None
            and not self._streamed
            and not self.bus.active
            and not self._faults
        )
        self.quiet = self.report.batch if self._count_only else None

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
        return self.input.done

    @property
    def ended(self) -> bool:
        """The run is over: every task ended, or it was timed out or cancelled."""
        dispatcher = getattr(self, "dispatcher", None)
        return self._done.is_set() or (dispatcher is not None and dispatcher.cancelled)

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
            self.end()


def _debug_enabled() -> bool:
    """Whether per-task DEBUG lines are wanted: asked once per run, so a run at INFO builds none."""
    return logging.getLogger("orchestra").isEnabledFor(logging.DEBUG)
