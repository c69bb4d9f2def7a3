"""What a failed attempt leads to: its record, the agent's breaker, then a retry at a due time, the
next agent of the task's chain, or the chain's end (the kind's default value, or a failure).

The dispatcher runs attempts; this decides, from the attempt's error and the policies, what comes
next, and tells the store (`fail` with the next step, or `settle`). It asks its dispatcher for the
run's store, router, report, events and clock, through `Owner`, rather than being part of it: the
run path of an attempt reads top to bottom in `orchestra._core._attempt`, and what failure means here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from .._breaker import CLOSED, HALF_OPEN, OPEN, is_outage
from .._events import AttemptFailed, BreakerChanged, FallbackUsed, RetryScheduled
from .._exceptions import RateLimited, Rejected, TaskTimeout, VerificationError
from .._failure import describe
from .._log import get_logger
from .._retry import backoff, classify
from .._task import CANCELLED, FAILED, SUCCEEDED, Attempt
from ._routing import NONE_LEFT

if TYPE_CHECKING:
    from random import Random

    from .._events import EventBus
    from .._record import Record
    from .._registry import AgentSlot
    from .._retry import RetryPolicy
    from ..stores._protocol import RunStore
    from ._instruments import Instruments
    from ._report import Report
    from ._routing import Router
    from ._runconfig import RunConfig, RunView

__all__ = ("Owner", "Recovery")

log = get_logger("orchestra")


class Owner(Protocol):
    """What the recovery asks of its dispatcher: the run's parts, its clock and its timer."""

    run_id: str
    run: RunView
    config: RunConfig
    store: RunStore
    router: Router
    report: Report
    bus: EventBus
    instruments: Instruments | None
    rng: Random

    def now(self) -> float: ...
    def schedule(self) -> None: ...


class Recovery:
    """The failure half of one run's dispatcher."""

    __slots__ = ("_moving", "_owner")

    def __init__(self, dispatcher: Owner) -> None:
        self._owner = dispatcher
        # Tasks that left an agent for any other of their kind (no explicit chain), with that
        # agent and why: the fallback is told once the router picks where they go (`moved`).
        self._moving: dict[Record, tuple[AgentSlot, str]] = {}

    def failed(
        self,
        record: Record,
        token: int,
        slot: AgentSlot,
        exc: BaseException,
        start: float,
        judged: bool = False,
        probe: bool = False,
    ) -> None:
        """An attempt of `record` on `slot` raised `exc` (from the output check or the verifier
        when `judged`: never the agent's health failure); `probe`: the attempt was the breaker's
        probe (sent while it was not closed), whose end alone closes or reopens it."""
        end = self._owner.now()
        policy = self._policy(slot, record.kind)
        retryable, retry_after = classify(exc, policy)
        failure = describe(exc)
        error_type, message = failure.error_type, failure.message
        slot.failures += 1
        slot.last_error = f"{error_type}: {message}"
        breaker = slot.breaker
        previous = breaker.state
        if not judged and is_outage(exc, breaker.policy):
            # The service behind the agent is unwell (a timeout, a connection error, a 5xx): it
            # counts towards the breaker. A bug in the agent's code does not.
            state = breaker.on_failure(end, record.id, slot.succeeded, probe)
            self.breaker_changed(slot, previous, state)
            if state is OPEN and previous is HALF_OPEN:
                self.probe_failed(slot, f"{error_type}: {message}")
        elif probe and isinstance(exc, TaskTimeout):
            # The task's own deadline cut the probe short: the service has not answered yet,
            # which says nothing either way. Another probe may go.
            breaker.on_abandon()
        elif probe and breaker.on_success(probe) is CLOSED:
            # The probe ended and the service answered (a permanent error, a rejected output, a
            # bug of the agent's own): it is up. A probe always reports back, however it ends.
            self.breaker_changed(slot, previous, CLOSED)
            self.recovered(slot)
        if (
            retryable
            and retry_after is not None
            and slot.limiters
            and (isinstance(exc, RateLimited) or _is_rate_limit(failure.status_code))
        ):
            # Every task that shares this agent's rate limits waits with it, not only this one.
            self._owner.router.pause(slot, end + retry_after)
        attempt = Attempt(
            number=record.attempts,
            agent=slot.name,
            error_type=error_type,
            message=message,
            started=start - self._owner.run.t0,
            duration=end - start,
            traceback=failure.traceback,
            status_code=failure.status_code,
            api_error_type=failure.api_error_type,
            request_id=failure.request_id,
        )
        if isinstance(exc, VerificationError):
            # The rejected output is kept as the partial output if the task fails in the end.
            self._owner.store.note(record, token, exc.feedback, partial=exc.output)
        else:
            self._owner.store.note(record, token, f"{error_type}: {message}")
        if self._owner.bus.active:
            self._owner.bus.emit(
                AttemptFailed(
                    end, self._owner.run_id, record.id, record.kind, slot.name, record.attempts,
                    error_type, message, retryable, end - start,
                )
            )  # fmt: skip
        if record.cancelling is not None:
            self._owner.store.settle(
                record, token, CANCELLED, error=record.cancelling, error_type="Cancelled",
                attempt=attempt,
            )  # fmt: skip
            return
        # A failure path only, so it may cost a log line: a WARNING an application sees with
        # logging's defaults, the traceback too when DEBUG is on.
        log.warning(
            "attempt failed",
            task_id=record.id,
            kind=record.kind,
            agent=slot.name,
            attempt=record.attempts,
            error_type=error_type,
            error=message,
            **({"traceback": failure.traceback} if self._owner.run.debug else {}),
        )
        if isinstance(exc, TaskTimeout):
            self.chain_end(record, token, message, "TaskTimeout", attempt)
            return
        if isinstance(exc, Rejected):
            self._owner.store.settle(
                record,
                token,
                FAILED,
                error=f"Rejected: {message}",
                error_type="Rejected",
                attempt=attempt,
            )
            return
        reason = _attempts_failed(record.agent_tries) if retryable else "permanent error"
        if retryable and record.agent_tries < policy.max_attempts:
            delay = backoff(policy, record.agent_tries - 1, self._owner.rng, retry_after)
            retry_at = self._owner.now() + delay
            if record.deadline is not None and retry_at >= record.deadline:
                # Waiting would pass the task's deadline: the next agent of the chain, now.
                self.fall_back(
                    record,
                    token,
                    slot,
                    attempt,
                    f"a retry in {delay:.3g}s would pass the task's deadline",
                    "TaskTimeout",
                )
                return
            attempt.retry_in = delay
            self._owner.report.retries += 1
            log.info(
                "retry scheduled",
                task_id=record.id,
                kind=record.kind,
                agent=slot.name,
                attempt=record.attempts,
                delay=round(delay, 3),
            )
            if self._owner.instruments is not None:
                self._owner.instruments.retried(
                    self._owner.run.info, record.task, slot.name, record.attempts, delay
                )
            if self._owner.bus.active:
                self._owner.bus.emit(
                    RetryScheduled(
                        end, self._owner.run_id, record.id, record.kind, slot.name, record.attempts,
                        delay,
                    )
                )  # fmt: skip
            self._owner.store.fail(record, token, attempt, retry_at=retry_at)
            self._owner.schedule()
            return
        self.fall_back(record, token, slot, attempt, reason, exhausted=retryable)

    def _policy(self, slot: AgentSlot, kind: str) -> RetryPolicy:
        """The retry policy of a task of `kind` on `slot`: the agent's own, the kind's, the run's."""
        config = self._owner.config
        return slot.retry or config.retry_per_kind.get(kind) or config.retry

    def probe_failed(self, slot: AgentSlot, error: str) -> None:
        """`slot`'s probe failed (its breaker opened again): every task, in every run, that waits
        for it with nowhere else to go spends an attempt there (`CircuitOpen`, carrying the
        probe's error), so an agent down for good fails its tasks after their attempts — a few
        probes, not a call per task — and one back within their retry budget loses nothing."""
        for dispatcher in self._owner.config.capacity.runs:
            if dispatcher.paused:
                # A paused run starts no attempt, so it spends none: its waiting tasks are looked
                # at again when it resumes (and wait for the next probe then, on a timer).
                dispatcher.router.room(slot)
            else:
                dispatcher.recovery.charge_waiting(slot, error)

    def charge_waiting(self, slot: AgentSlot, error: str) -> None:
        """`probe_failed` for this run's tasks waiting for `slot`."""
        d = self._owner
        waiting = d.router.stranded(slot)
        if not waiting:
            return
        store = d.store
        breaker = slot.breaker
        now = d.now()
        message = f"circuit breaker open: the probe failed with {error}"
        for record, token in waiting:
            if not store.start(record, token, slot.name):
                continue  # it ended while it waited
            d.report.attempts += 1  # an attempt of the task's, not a call: `slot.attempts` is not
            policy = self._policy(slot, record.kind)
            attempt = Attempt(
                number=record.attempts,
                agent=slot.name,
                error_type="CircuitOpen",
                message=message,
                started=now - d.run.t0,
                duration=0.0,
            )
            if d.bus.active:
                d.bus.emit(
                    AttemptFailed(
                        now, d.run_id, record.id, record.kind, slot.name, record.attempts,
                        "CircuitOpen", message, True, 0.0,
                    )
                )  # fmt: skip
            if record.cancelling is not None:
                store.settle(
                    record, token, CANCELLED, error=record.cancelling, error_type="Cancelled",
                    attempt=attempt,
                )  # fmt: skip
                continue
            if record.agent_tries >= policy.max_attempts:
                self.fall_back(
                    record, token, slot, attempt, _attempts_failed(record.agent_tries),
                    exhausted=True,
                )  # fmt: skip
                continue
            retry_at = breaker.recovers_at(now)  # when the next probe may go
            if record.deadline is not None and retry_at >= record.deadline:
                self.fall_back(
                    record, token, slot, attempt,
                    "the next probe would come after the task's deadline", "TaskTimeout",
                )  # fmt: skip
                continue
            attempt.retry_in = delay = retry_at - now
            d.report.retries += 1
            if d.bus.active:
                d.bus.emit(
                    RetryScheduled(
                        now, d.run_id, record.id, record.kind, slot.name, record.attempts, delay
                    )
                )
            store.fail(record, token, attempt, retry_at=retry_at)
        d.schedule()

    def fall_back(
        self,
        record: Record,
        token: int,
        slot: AgentSlot,
        attempt: Attempt,
        reason: str,
        error_type: str | None = None,
        *,
        exhausted: bool = False,
    ) -> None:
        """`slot` is done with `record`: the next agent of the chain gets it, or the chain ends.
        `reason` says why, on `slot`; `exhausted` when its retries were used up, so the task's
        error counts its attempts on every agent, not on the last one only."""
        nxt = self._owner.router.next_agent(record, slot)
        if nxt is NONE_LEFT:
            self.emit_fallback(record, slot, nxt, reason)
            if exhausted:
                reason = _task_attempts_failed(record, attempt)
            self.chain_end(record, token, reason, error_type, attempt)
        elif record.kind in self._owner.router.chains:
            self.emit_fallback(record, slot, nxt, reason)
            self._owner.store.fail(record, token, attempt, next_agent=nxt)
        else:  # no explicit chain: whichever agent of the kind not used up has room first
            self._moving[record] = (slot, reason)
            self._owner.store.fail(record, token, attempt, next_agent=None)

    def moved(self, record: Record, slot: AgentSlot) -> None:
        """The router picked `slot` for `record`: if it is leaving another agent (`fall_back`
        without a chain), that is the fallback, told now that where it goes is known."""
        moving = self._moving.pop(record, None)
        if moving is not None:
            self.emit_fallback(record, moving[0], slot, moving[1])

    def emit_fallback(self, record: Record, slot: AgentSlot, nxt: Any, reason: str) -> None:
        """Tell that `record` moves from `slot` to `nxt` (or to nobody: `NONE_LEFT`)."""
        if nxt is not NONE_LEFT:
            self._owner.report.fallbacks += 1
            log.info(
                "fallback used",
                task_id=record.id,
                kind=record.kind,
                agent=slot.name,
                to_agent=getattr(nxt, "name", nxt),
                reason=reason,
            )
        if self._owner.instruments is not None:
            self._owner.instruments.fell_back(
                self._owner.run.info,
                record.task,
                slot.name,
                None if nxt is NONE_LEFT else getattr(nxt, "name", nxt),
                reason,
            )
        if self._owner.bus.active:
            to = None if nxt is NONE_LEFT else getattr(nxt, "name", nxt)
            self._owner.bus.emit(
                FallbackUsed(
                    self._owner.now(),
                    self._owner.run_id,
                    record.id,
                    record.kind,
                    slot.name,
                    to,
                    reason,
                )
            )

    def chain_end(
        self,
        record: Record,
        token: int,
        reason: str,
        error_type: str | None = None,
        attempt: Attempt | None = None,
    ) -> None:
        """The task can go no further (every agent of its chain failed it, or its deadline
        passed): it takes its kind's default value if there is one, else it fails."""
        defaults = self._owner.config.defaults
        store = self._owner.store
        if record.kind in defaults:
            # (listed in `metadata.defaulted` as the report counts its end, like one defaulted
            # in another process)
            store.settle(
                record, token, SUCCEEDED, defaults[record.kind], defaulted=True, attempt=attempt
            )
            return
        last = attempt or (record.failures[-1] if record.failures else None)
        if error_type is not None:
            message = f"{error_type}: {reason}"
        elif last is None:
            error_type, message = "NoAgentLeft", reason
        else:
            error_type, message = last.error_type, f"{last.error_type}: {last.message} ({reason})"
        store.settle(record, token, FAILED, error=message, error_type=error_type, attempt=attempt)

    def recovered(self, slot: AgentSlot) -> None:
        """`slot`'s breaker closed: the tasks waiting for it (in every run) may go."""
        for run in self._owner.config.capacity.runs:
            run.router.room(slot)
            run.wake_one()

    def breaker_changed(self, slot: AgentSlot, previous: str, state: str | None) -> None:
        if state is None:
            return
        log.warning("circuit breaker changed", agent=slot.name, state=state, previous=previous)
        if self._owner.bus.active:
            self._owner.bus.emit(
                BreakerChanged(self._owner.now(), self._owner.run_id, slot.name, state, previous)
            )


def _attempts_failed(count: int) -> str:
    return f"{count} attempt failed" if count == 1 else f"{count} attempts failed"


def _task_attempts_failed(record: Record, last: Attempt) -> str:
    """How many attempts `record` spent in all, and on which agents when on more than one."""
    agents = dict.fromkeys([*(a.agent for a in record.failures or ()), last.agent])
    where = f" on {', '.join(agents)}" if len(agents) > 1 else ""
    return f"{_attempts_failed(record.attempts)}{where}"


def _is_rate_limit(status: int | None) -> bool:
    return status in (429, 529)
