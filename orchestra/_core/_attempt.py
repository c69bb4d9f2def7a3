"""The attempt: one call of one agent on one task, and where what it gives goes.

Two variants, side by side, chosen by one predicate (the first test of `Attempts.begin`):

- the **plain** attempt, the common one: nothing to watch around the agent's call (no attempt
  timeout, task deadline, verifier, output model, safety check, instrument, event subscriber,
  simulated fault, reservation on a limit or breaker probe). It is a sync pair around the call:
  `begin`, then `returned` (or `threw`), and the runner awaits the call itself in between. A
  coroutine per attempt would cost as much as the rest of a no-op task's dispatch, and each
  helper call or `try` block here costs about 2 % of a no-op task: the pair keeps to two calls;
- the **full** attempt (`run`), a coroutine: the safety check before a task's first attempt, the
  `AttemptStarted` event, the instruments around the call, the task's deadline and the attempt
  timeout, the output model and the kind's verifier, the breaker's probe.

Both end the same way, below them:

- `succeeded`: the store settles the task with the output and what the attempt spawned, and tells
  the run (its listener: the report, the aggregate, the result stream); then the breaker, when the
  attempt was its probe, and the subscribers of `AttemptSucceeded`;
- `raised`: a failed attempt goes to the recovery (`_recovery.py`: a retry at a due time, the next
  agent, the chain's end); the run's own cancellation unwinds the runner;
- `finished`: however it ended, the attempt gives back the slots it took (global, the agent's, its
  limits', trued up with what it really cost) and wakes a runner to use them.

The plain attempt's `returned` takes the common case of `succeeded` and of `finished` in one step
(nothing spawned, nothing reserved, nobody else to tell) and hands anything else to them.
"""

from __future__ import annotations

import asyncio
import math
from functools import partial
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol

import anyio

from .._breaker import CLOSED
from .._events import AttemptStarted, AttemptSucceeded
from .._exceptions import AttemptTimeout, Rejected, TaskTimeout
from .._failure import check_returned, describe
from .._log import get_logger
from .._task import FAILED, SUCCEEDED
from .._verify import check_output, check_safety, verify
from ._context import Context
from ._instruments import AttemptInfo

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._limits import Cost
    from .._record import Record
    from .._registry import AgentSlot
    from .._task import Task
    from ..stores._protocol import RunStore
    from ._recovery import Recovery
    from ._routing import Router
    from ._runconfig import RunView

__all__ = ("Attempts", "Owner")

log = get_logger("orchestra")


class Owner(Protocol):
    """What an attempt asks of the dispatcher that runs it."""

    parked: list[asyncio.Future[None]]  # runners waiting for something to do

    def wake_one(self) -> None: ...
    def take_back_cancels(self, record: Record) -> bool: ...


class Attempts:
    """The attempts of one run: both variants, their endings, and how many run now."""

    __slots__ = (
        "_attempt_timeout",
        "_bare",
        "_bus",
        "_capacity",
        "_instruments",
        "_limiter",
        "_owner",
        "_parked",
        "_recovery",
        "_report",
        "_router",
        "_run",
        "_safety",
        "_store",
        "_task_timeout",
        "_time",
        "_verify",
        "cancelled",
        "running",
    )

    def __init__(
        self, owner: Owner, run: RunView, store: RunStore, router: Router, recovery: Recovery
    ) -> None:
        config = run.config
        self._owner = owner
        self._parked = owner.parked
        self._run = run
        self._store = store
        self._report = run.report
        self._router = router
        self._recovery = recovery
        self._bus = config.bus
        self._capacity = config.capacity
        self._limiter = config.capacity.limiter
        self._verify = config.verify
        self._safety = config.safety
        self._attempt_timeout = config.timeouts.attempt
        self._task_timeout = config.timeouts.task
        self._instruments = config.instruments
        self._time: Callable[[], float] = anyio.current_time
        # Nothing around any call of the run: no attempt timeout, verifier, safety check or
        # instrument.
        self._bare = (
            self._attempt_timeout is None
            and not self._verify
            and self._safety is None
            and self._instruments is None
        )
        self.running = 0  # attempts under way
        # The run is cancelled (`Dispatcher.cancel_all`): what an attempt returns or raises from
        # now on is dropped (the run ends its task as cancelled).
        self.cancelled = False

    def bind_clock(self, time: Callable[[], float]) -> None:
        self._time = time

    # -- the plain attempt: `begin`, the runner awaits the call, then `returned` or `threw` ----

    def begin(
        self,
        record: Record,
        token: int,
        slot: AgentSlot,
        cost: Cost | None,
        spare: Context | None,
    ) -> Context | Literal[False] | None:
        """Start the attempt of `record` on `slot` (`cost`: what it reserved on the agent's
        limits) if it is the plain one, and give the context to call the agent with (`spare`,
        the runner's last one that nobody kept, made this attempt's). False: it is not plain,
        and `run` makes it; None: the lease went stale (the task was cancelled) before the call."""
        # The predicate: nothing to watch around the agent's call.
        if not (
            cost is None
            and record.deadline is None
            and slot.breaker.state is CLOSED
            and self._bare
            and slot.bare
            and slot.fault is None
            and not self._bus.active
        ):
            return False
        if not self._store.start(record, token, slot.name):
            return None
        self._limiter.in_use += 1
        slot.in_flight += 1
        running = self.running = self.running + 1
        report = self._report
        if running > report.peak:
            report.peak = running
        slot.attempts += 1
        report.attempts += 1
        if spare is None:
            return Context(self._run, record, slot.name, record.attempts, record.feedback or ())
        spare._record = record
        spare.task = record.task
        spare.agent = slot.name
        spare.attempt = record.attempts
        spare.feedback = record.feedback or ()
        return spare

    def returned(
        self, record: Record, token: int, slot: AgentSlot, output: Any, ctx: Context
    ) -> None:
        """The plain attempt's call returned `output`: the task ends with it, and the attempt is
        over. An output the check refuses, or a spawn the store refuses, raises before the end:
        the runner hands it to `threw`, and the attempt fails instead. (No `try` here: see the
        module's docstring.)"""
        if type(output) not in _PLAIN:
            check_returned(output, slot.name)
        if self.cancelled:
            pass  # the agent finished after the run's cancel: the run ends the task
        elif ctx._spawned is None:  # `succeeded`'s common case: nothing spawned, nobody told
            if self._store.succeed(record, token, output, slot.name):
                slot.succeeded += 1
        else:
            self.succeeded(record, token, slot, output, ctx, self._started(record))
        capacity = self._capacity
        limiter = self._limiter
        if (
            ctx._threads
            or capacity.blocked
            or self._router.held
            or len(capacity.runs) > 1
            or limiter.watchers is not None
            or limiter.line is not None
        ):
            self.finished(slot, None, ctx)
        else:  # `finished`'s common case: nothing reserved, nobody else to tell
            limiter.in_use -= 1
            slot.in_flight -= 1
            self.running -= 1
            if self._parked:
                self._owner.wake_one()

    def threw(
        self, record: Record, token: int, slot: AgentSlot, exc: BaseException, ctx: Context
    ) -> bool:
        """The plain attempt's call raised `exc`: `raised`, and the attempt is over. True: the
        runner lets `exc` unwind."""
        try:
            return self.raised(record, token, slot, exc, self._started(record), ctx)
        finally:
            self.finished(slot, None, ctx)

    def _started(self, record: Record) -> float:
        """When the plain attempt of `record` started: the store stamped it (`RunStore.start`)
        on the run's clock, as the task's first start or, when the task had one, its latest."""
        start = getattr(record, "t_retry", None)
        if start is None:
            start = record.t_start
        return self._time() if start is None else start

    # -- the full attempt ------------------------------------------------------------------------

    async def run(self, record: Record, token: int, slot: AgentSlot, cost: Cost | None) -> None:
        """The full attempt of `record` on `slot`, which reserved `cost` on the agent's limits."""
        self._limiter.in_use += 1
        slot.in_flight += 1
        running = self.running = self.running + 1
        report = self._report
        if running > report.peak:
            report.peak = running
        breaker = slot.breaker
        # Sent while the breaker is not closed, the attempt is its probe: its end alone is the
        # verdict. `unjudged` until the attempt ends one way or another (`raised` and
        # `succeeded` tell the breaker; else `finished` lets another probe out).
        probe = unjudged = breaker.state is not CLOSED
        if probe:
            self._recovery.breaker_changed(slot, breaker.state, breaker.on_dispatch(self._time()))
        ctx: Context | None = None
        try:
            if self._safety is not None and not record.attempts:
                try:
                    safe = await self._safe(record, token)
                except asyncio.CancelledError:
                    # `cancel_attempts` cancelled the task during its safety check: the runner
                    # goes on (as `raised` says for a cancel during the call).
                    if not self._owner.take_back_cancels(record):
                        raise
                    return
                if not safe:
                    return
            if not self._store.start(record, token, slot.name):
                return  # the lease went stale (the task was cancelled) before the call
            slot.attempts += 1
            report.attempts += 1
            start = self._time()
            ctx = Context(self._run, record, slot.name, record.attempts, record.feedback or ())
            if cost is not None:  # what `ctx.reserve` trues up
                ctx._reserved = (cost, self._router.limiters(slot))
            bus = self._bus if self._bus.active else None
            if bus is not None and bus.wants(AttemptStarted):
                bus.emit(
                    AttemptStarted(
                        start, self._run.run_id, record.id, record.kind, slot.name,
                        record.attempts,
                    )
                )  # fmt: skip
            try:
                instruments = self._instruments
                if instruments is not None:  # metrics, tracing: around the whole attempt
                    output = await instruments.attempt(
                        self._bounded_call(record, slot, ctx, start),
                        AttemptInfo(
                            self._run.info, record.task, slot.name, record.attempts, start, ctx
                        ),
                    )
                else:
                    output = await self._bounded_call(record, slot, ctx, start)
                if self.cancelled:
                    return  # the agent finished after the run's cancel: the run ends the task
                unjudged = False
                # Inside the `try`: a spawn the store refuses now fails the attempt.
                self.succeeded(record, token, slot, output, ctx, start, bus, probe)
            except BaseException as exc:
                unjudged = False  # `raised` tells the breaker, or lets another probe out
                if self.raised(record, token, slot, exc, start, ctx, probe):
                    raise
        except KeyboardInterrupt:  # in the safety check
            self._interrupted(record, slot)
        finally:
            self.finished(slot, cost, ctx, unjudged)

    async def _bounded_call(
        self, record: Record, slot: AgentSlot, ctx: Context, start: float
    ) -> Any:
        """`_call` within the task's deadline, which bounds the whole attempt: the call, the
        verifier, and what runs around them."""
        if record.deadline is None:
            return await self._call(record, slot, ctx, start)
        with anyio.CancelScope(deadline=record.deadline) as scope:
            output = await self._call(record, slot, ctx, start)
        if scope.cancelled_caught:
            raise TaskTimeout(f"task timeout: {record.task.timeout or self._task_timeout}s passed")
        return output

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
        check = self._verify.get(record.kind) if self._verify else None
        if slot.output is None and check is None:
            return output
        # What raises from here on is the output model's or the verifier's, never a health
        # failure of the agent (a verifier that calls a service which is down, say). Set only
        # here: the slot stays unset, and reads as False, for the attempts that judge nothing.
        ctx._judging = True
        if slot.output is not None:
            output = check_output(slot.output, output)
            check_returned(output, slot.name)  # the model instance, as the result will dump it
        if check is not None:
            await verify(check, record.task, output, ctx)
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
            self._store.settle(
                record, token, FAILED, error=f"Rejected: {message}", error_type="Rejected"
            )
            return False
        return True

    # -- the endings of both ---------------------------------------------------------------------

    def succeeded(
        self,
        record: Record,
        token: int,
        slot: AgentSlot,
        output: Any,
        ctx: Context,
        start: float,
        bus: Any = None,
        probe: bool = False,
    ) -> None:
        """The attempt succeeded: the task ends with `output`, and what the attempt spawned as one
        step (a spawn the store refuses now — its group closed meanwhile — raises `InputError`,
        which fails the attempt instead). `bus`: the run's, when someone listens; `probe`: the
        attempt was the breaker's probe."""
        spawned = ctx._spawned
        if spawned:
            if self._store.settle(
                record, token, SUCCEEDED, output, spawned=list(spawned.values()), agent=slot.name
            ):
                slot.succeeded += 1
            self._tell_success(record, slot, start, bus, probe)
            return
        if bus is not None or probe:
            self._tell_success(record, slot, start, bus, probe)
        # Counted when the store takes it (it refuses a task cancelled meanwhile: then it is not
        # the agent's success).
        if self._store.succeed(record, token, output, slot.name):
            slot.succeeded += 1

    def _tell_success(
        self, record: Record, slot: AgentSlot, start: float, bus: Any, probe: bool
    ) -> None:
        """Tell the breaker (when the attempt was its probe) and the subscribers."""
        breaker = slot.breaker
        if probe:
            previous = breaker.state
            state = breaker.on_success(probe)
            if state is not None:  # the probe succeeded: the agent is back
                self._recovery.breaker_changed(slot, previous, state)
                self._recovery.recovered(slot)
        if bus is not None and bus.wants(AttemptSucceeded):
            end = self._time()
            bus.emit(
                AttemptSucceeded(
                    end, self._run.run_id, record.id, record.kind, slot.name, record.attempts,
                    end - start,
                )
            )  # fmt: skip

    def raised(
        self,
        record: Record,
        token: int,
        slot: AgentSlot,
        exc: BaseException,
        start: float,
        ctx: Context | None,
        probe: bool = False,
    ) -> bool:
        """The attempt raised `exc` (the agent, its checks, or the store refusing its spawns).
        True when `exc` is not the attempt's to end (the run's own cancellation, a generator's
        close): the runner lets it unwind. A probe reports back to the breaker however it ends:
        its failure is a verdict; else another probe may go."""
        owner = self._owner
        cancelled = self.cancelled
        if isinstance(exc, asyncio.CancelledError):
            # Ours (the run is cancelled, or a deadline passed): unwind, unless
            # `cancel_attempts` cancelled this attempt alone (its task is ended already): then
            # the runner goes on. One the agent raised by itself (no cancellation pending on
            # this task): a failed attempt.
            me = asyncio.current_task()
            if me is None or me.cancelling() or cancelled:
                if probe:
                    slot.breaker.on_abandon()
                return not owner.take_back_cancels(record)
            self._recovery.failed(record, token, slot, exc, start, probe=probe)
        elif isinstance(exc, (Exception, SystemExit)):  # `sys.exit()` in an agent too
            if cancelled:  # raised over the run's cancel (from a `finally`, say)
                if probe:
                    slot.breaker.on_abandon()
                return False
            judged = getattr(ctx, "_judging", False)  # the output model's, or the verifier's
            self._recovery.failed(record, token, slot, exc, start, judged, probe)
        elif isinstance(exc, KeyboardInterrupt):
            if probe:
                slot.breaker.on_abandon()
            self._interrupted(record, slot)
        else:
            return True
        return False

    def _interrupted(self, record: Record, slot: AgentSlot) -> None:
        """A `KeyboardInterrupt` inside an attempt (the agent, its checks): the run stops at once,
        as a second Ctrl-C stops `run_main`'s, and returns its partial result. Raised on, it would
        leave the event loop and take the run's results with it."""
        log.warning("KeyboardInterrupt in an agent: stopping the run", task_id=record.id)
        self._run.stop(f"stopped by KeyboardInterrupt in agent {slot.name!r} (task {record.id!r})")

    def finished(
        self, slot: AgentSlot, cost: Cost | None, ctx: Context | None, unjudged: bool = False
    ) -> None:
        """An attempt is over, however it ended: give back what it took, and let a runner use it.
        `unjudged`: the attempt was the breaker's probe and ended before any verdict (refused,
        cancelled): another probe may go."""
        capacity = self._capacity
        router = self._router
        if ctx is not None and ctx._threads:
            # A thread the call abandoned still runs: its slots (global, the agent's, its
            # limits') stay taken until it ends.
            ctx._on_released(partial(self._thread_ended, slot, cost, ctx))
        else:
            self._release(slot, cost, ctx)
        self.running -= 1
        if unjudged:
            slot.breaker.on_abandon()
        if capacity.blocked or len(capacity.runs) > 1:
            # The freed slot (global, or this agent's, which other runs share) may be what
            # another run's parked runner waits for.
            capacity.blocked = False
            for run in capacity.runs:
                run.router.room(slot)
                run.wake_one()
        else:
            if router.held:
                router.room(slot)
            if self._parked:
                self._owner.wake_one()

    def _release(self, slot: AgentSlot, cost: Cost | None, ctx: Context | None) -> None:
        """Give back what an attempt took: the global slot, the agent's, and its limits (trued up
        with what the attempt really cost)."""
        self._limiter.release()
        slot.in_flight -= 1
        if cost is not None:
            now = self._time()
            actual = _actual(cost, ctx)
            for limiter in self._router.limiters(slot):
                limiter.reconcile(cost, actual, now)
                limiter.release(cost, now)

    def _thread_ended(self, slot: AgentSlot, cost: Cost | None, ctx: Context | None) -> None:
        """An abandoned thread of `slot` ended (see `Context.keep_slot`): its slots free now, for
        whichever runs wait for them (this one may be over)."""
        self._release(slot, cost, ctx)
        capacity = self._capacity
        capacity.blocked = False
        for run in capacity.runs:
            run.router.room(slot)
            run.wake_one()


def _actual(cost: Cost, ctx: Context | None) -> Cost:
    """What an attempt really cost: its request, and the units the agent recorded
    (`ctx.record_usage`); nothing when it never called the agent."""
    if ctx is None:
        return 0
    usage = ctx._usage
    if usage is None:
        return cost
    return {"requests": 1, **usage}


_PLAIN: Final = frozenset((str, int, float, bool, type(None)))
