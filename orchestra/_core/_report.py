"""The report of a run: the tally kept as tasks end, and the `RunResult` built from it once, by the
status rules.

Counting happens on the hot path (a few dict updates per task); everything else — status rules,
percentiles (`_durations`), error records with their remediations (`_remediation`), the pydantic
models — happens once, at the end.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter, deque
from dataclasses import dataclass
from datetime import datetime, timedelta
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from .._aggregate import percentile
from .._result import (
    AttemptRecord,
    CancelRecord,
    ErrorRecord,
    Outcome,
    RunMetadata,
    RunResult,
    TimingStats,
)
from .._task import CANCELLED, FAILED, SKIPPED, SUCCEEDED
from ._durations import Durations
from ._remediation import remediation

if TYPE_CHECKING:
    from collections.abc import Iterable

    from .._record import Record
    from .._task import Task

__all__ = ("ErrorSample", "KindTally", "Report", "dollars")


class KindTally:
    """The counts of one kind in one run, as its tasks are admitted and end."""

    __slots__ = (
        "admitted",
        "busy",
        "cancelled",
        "failed",
        "longest",
        "p95",
        "sample",
        "skipped",
        "succeeded",
        "timed",
    )

    def __init__(self) -> None:
        self.admitted = 0
        self.succeeded = 0
        self.failed = 0
        self.skipped = 0
        self.cancelled = 0
        self.timed = 0  # ended tasks that had started (their durations are in `busy`)
        self.busy = 0.0  # the sum of their durations: the mean is exact
        self.longest = 0.0
        # A bounded reservoir fed every duration up to `_EXACT`, then one in `_EVERY`: the
        # percentiles of a run need a fair sample, not every value, and this halves the cost.
        self.sample = Durations()
        self.p95: tuple[int, float] = (0, 0.0)  # (sample.count when computed, value): `_status`

    @property
    def ended(self) -> int:
        return self.succeeded + self.failed + self.skipped + self.cancelled

    def counts(self) -> dict[str, int]:
        """The terminal states that occurred, by name (sorted), with their counts."""
        pairs = (
            (CANCELLED, self.cancelled),
            (FAILED, self.failed),
            (SKIPPED, self.skipped),
            (SUCCEEDED, self.succeeded),
        )
        return {state: n for state, n in pairs if n}

    def timing(self) -> TimingStats:
        ordered = sorted(self.sample.sample)
        return TimingStats(
            count=self.timed,
            mean=self.busy / self.timed,
            p50=percentile(ordered, 0.5),
            p95=percentile(ordered, 0.95),
            max=self.longest,
        )


_finished_of = attrgetter("finished")
_EXACT = 1_024
_EVERY = 8  # a power of two (a mask)
BATCH = 256  # successes counted at once (see `Report.finished`)
_GROUP = 16  # a batch of several kinds is counted kind by kind when they average this many
_RING = 16  # one-second buckets of ended tasks kept (a power of two above the status's window)
RECENT_ERRORS = 20  # failed tasks kept for the live status
_MESSAGE = 300  # characters of an error message kept there


@dataclass(frozen=True, slots=True)
class ErrorSample:
    """A task that failed, as the live view lists it."""

    task_id: str
    kind: str
    agent: str | None
    error_type: str
    message: str
    at: float  # seconds since the run started
    remediation: str = ""  # what to do about it, as its error record in the result will say


class Report:
    """What a run counts, as it goes: the live status reads it (`orchestra._core._status`), and the
    `RunResult` is built from it at the end.

    Ending a task costs a list append (a success, counted with the next batch of them in a few
    quick passes) or a dict lookup and a few int and float updates, and no clock read (the store
    stamped the record's times): counts per kind and state, durations (exact count, mean and max; a
    sample for percentiles), successes per agent, the tasks that did not succeed (for the error
    records), tasks ended and failed per second (a ring of one-second buckets), the last failures.
    Tasks of the input are counted as admitted when the run admits them; spawned ones when they
    first become ready (or are skipped)."""

    __slots__ = (
        "_kinds",
        "attempts",
        "batch",
        "cancellations",
        "cancelled",
        "cost",
        "critical_failed",
        "cut_short",
        "defaulted",
        "ended",
        "errors",
        "failed",
        "fallbacks",
        "keeps_history",
        "not_ok",
        "peak",
        "per_agent",
        "reason",
        "retries",
        "ring_ended",
        "ring_failed",
        "ring_second",
        "second",
        "second_end",
        "tokens",
        "usage_per_agent",
        "usage_per_model",
    )

    def __init__(self, *, keeps_history: bool = True) -> None:
        self.attempts = 0
        self.retries = 0
        self.fallbacks = 0
        self.peak = 0
        self._kinds: dict[str, KindTally] = {}
        # Succeeded tasks not counted yet: counted `BATCH` at a time (see `finished`), and before
        # anything reads what they change or another task's end is counted.
        self.batch: list[Record] = []
        self.per_agent: dict[str, int] = {}
        # The tasks that did not succeed, for the `RunResult`'s error records, and the cancels;
        # without `keeps_history`, only the ids of the critical ones that did not succeed (they
        # decide its status).
        self.keeps_history = keeps_history
        self.not_ok: list[Record] = []
        self.critical_failed: list[str] = []
        self.defaulted: list[str] = []
        self.tokens: dict[str, int] = {}
        self.cost = 0.0
        self.usage_per_agent: dict[str, dict[str, float]] = {}
        self.usage_per_model: dict[str, dict[str, float]] = {}
        self.reason: str | None = None
        self.cancelled = False
        self.cancellations: list[CancelRecord] = []  # the run handle's cancels, as they happen
        self.cut_short = False  # the run timeout ended it: never "success"
        # The current second's ended and failed tasks are plain attributes; `_turn` files them in
        # the ring when a task ends in a later second.
        self.second = 0
        self.second_end = 1.0
        self.ended = 0
        self.failed = 0
        self.ring_second = [-1] * _RING  # which second each bucket holds
        self.ring_ended = [0] * _RING
        self.ring_failed = [0] * _RING
        self.errors: deque[ErrorSample] = deque(maxlen=RECENT_ERRORS)

    # -- as tasks come and go ---------------------------------------------------------------------

    @property
    def kinds(self) -> dict[str, KindTally]:
        """The counts per kind, every ended task counted."""
        if self.batch:
            self.fold()
        return self._kinds

    def _kind(self, kind: str) -> KindTally:
        tally = self._kinds.get(kind)
        if tally is None:
            tally = self._kinds[kind] = KindTally()
        return tally

    def admitted(self, tasks: Iterable[Task]) -> None:
        """Count a batch of admitted tasks (one pass over their kinds)."""
        kinds = [task.kind for task in tasks]
        if not kinds:
            return
        if kinds.count(kinds[0]) == len(kinds):  # one kind (an identity test each, in C):
            self._kind(kinds[0]).admitted += len(kinds)  # no hashing
            return
        for kind, n in Counter(kinds).items():
            self._kind(kind).admitted += n

    def admitted_one(self, kind: str) -> None:
        self._kind(kind).admitted += 1

    def ready(self, record: Record) -> None:
        """A spawned task became ready: the first time counts it as admitted."""
        if record.attempts == 0:
            self._kind(record.kind).admitted += 1

    def finished(self, record: Record) -> None:
        """Count one ended task (the store has stamped its times and status).

        A success is only put aside, and counted with the next `BATCH` of them in one go
        (`fold`): counting one at a time was a fifth of a no-op task's whole cost, and a batch
        of one kind within one second is a few quick passes. Everything that reads what a success
        changes (`kinds`, `window`, `result`) counts the batch first, as does the end of a task
        that did not succeed (so the counts keep the order the tasks ended in). A success by its
        kind's default is counted alone, listed in `metadata.defaulted` wherever it ended (here,
        in a worker, in an earlier process)."""
        if record.status is SUCCEEDED and record.started is not None and not record.defaulted:
            done = self.batch
            done.append(record)
            if len(done) >= BATCH:
                self.fold()
            return
        if self.batch:
            self.fold()
        self._one(record)

    def fold(self) -> None:
        """Count the successes put aside by `finished`: by second (they are in the order they
        ended, so their `finished` times never decrease), and within a second by kind, each
        kind's in one go."""
        batch = self.batch  # the same list to the end: the run's store appends to it (`quiet`)
        done = batch.copy()
        batch.clear()
        while done[-1].finished >= self.second_end:  # some end in a later second
            cut = bisect_left(done, self.second_end, key=_finished_of)
            if cut:
                self._fold_second(done[:cut])
            self._turn(done[cut].finished)
            done = done[cut:]
        self._fold_second(done)

    def _fold_second(self, done: list[Record]) -> None:
        """`fold` for successes that all ended within the current second."""
        kinds = {record.kind for record in done}
        if len(kinds) * _GROUP > len(done):  # many kinds, a few tasks each: one at a time
            for record in done:
                self._one(record)
            return
        self.ended += len(done)
        per_agent = self.per_agent
        for agent, count in Counter([record.agent for record in done]).items():
            if agent is not None:
                per_agent[agent] = per_agent.get(agent, 0) + count
        if len(kinds) == 1:
            self._fold_kind(self._kind(done[0].kind), done)
            return
        by_kind: dict[str, list[Record]] = {}
        for record in done:  # tasks of many kinds ending together (in their order, per kind)
            group = by_kind.get(record.kind)
            if group is None:
                by_kind[record.kind] = [record]
            else:
                group.append(record)
        for name, group in by_kind.items():
            self._fold_kind(self._kind(name), group)

    def _fold_kind(self, kind: KindTally, done: list[Record]) -> None:
        """Count successes of one kind, all within the current second."""
        n = len(done)
        kind.succeeded += n
        # Every record of a batch has started (`finished` batches no other).
        took = [record.finished - record.started for record in done]  # type: ignore[operator]
        kind.busy += sum(took)
        longest = max(took)
        if longest > kind.longest:
            kind.longest = longest
        timed = kind.timed
        kind.timed = timed + n
        # What `_one` samples: every duration up to the `_EXACT`-th, then every `_EVERY`-th.
        exact = max(0, min(n, _EXACT - timed))
        kind.sample.extend(took[:exact] + took[exact + (-(timed + exact + 1)) % _EVERY :: _EVERY])

    def _one(self, record: Record) -> None:
        kind = self._kinds.get(record.kind)
        if kind is None:
            kind = self._kind(record.kind)
        end = record.finished
        if end >= self.second_end:
            self._turn(end)
        self.ended += 1
        if record.status is SUCCEEDED:
            kind.succeeded += 1
            agent = record.agent
            if agent is not None:
                per_agent = self.per_agent
                per_agent[agent] = per_agent.get(agent, 0) + 1
            if record.defaulted:
                self.defaulted.append(record.id)
        else:
            self._not_ok(kind, record)
        started = record.started
        if started is not None:
            took = end - started
            kind.busy += took
            if took > kind.longest:
                kind.longest = took
            kind.timed = timed = kind.timed + 1
            if timed <= _EXACT or not timed & (_EVERY - 1):
                kind.sample.add(took)

    def _turn(self, end: float) -> None:
        """File the current second's counts in the ring and start the second `end` falls in."""
        i = self.second & (_RING - 1)
        self.ring_second[i] = self.second
        self.ring_ended[i] = self.ended
        self.ring_failed[i] = self.failed
        self.second = int(end)
        self.second_end = self.second + 1.0
        self.ended = self.failed = 0

    def window(self, now: float, seconds: int) -> tuple[int, int, float]:
        """Tasks ended and failed in the last `seconds` (at most the ring's) before `now`, and the
        span covered."""
        if self.batch:
            self.fold()
        current = int(now)
        first = current - seconds + 1
        ended = failed = 0
        if first <= self.second <= current:
            ended, failed = self.ended, self.failed
        for i, second in enumerate(self.ring_second):
            if first <= second <= current and second != self.second:
                ended += self.ring_ended[i]
                failed += self.ring_failed[i]
        return ended, failed, min(now, now - first)

    def _not_ok(self, kind: KindTally, record: Record) -> None:
        if self.keeps_history:
            self.not_ok.append(record)
        elif record.task.critical:
            self.critical_failed.append(record.id)
        status = record.status
        if status is FAILED:
            kind.failed += 1
            self.failed += 1
            failures = record.failures
            last = failures[-1] if failures else None
            error_type = record.error_type or (last.error_type if last else "Error")
            message = record.error or (last.message if last else "")
            self.errors.append(
                ErrorSample(
                    task_id=record.id,
                    kind=record.kind,
                    agent=record.agent or (last.agent if last is not None else None),
                    error_type=error_type,
                    message=message[:_MESSAGE],
                    at=record.finished,
                    # Worked out now, on the failure's path, while the attempts are at hand: the
                    # live view shows the advice the result's error record will give.
                    remediation=remediation(
                        FAILED,
                        error_type,
                        message,
                        agents=len({a.agent for a in failures or ()}),
                        status_code=None if last is None else last.status_code,
                        api_error_type=None if last is None else last.api_error_type,
                    ),
                )
            )
        elif status is SKIPPED:
            kind.skipped += 1
            if record.parent is not None:  # a skipped task was never ready: count it here
                kind.admitted += 1
        else:
            kind.cancelled += 1

    def usage(
        self,
        cost: float,
        tokens: dict[str, int] | Any,
        agent: str | None = None,
        model: str | None = None,
    ) -> None:
        self.cost += cost
        for name, n in tokens.items():
            self.tokens[name] = self.tokens.get(name, 0) + n
        if agent is not None:
            _add(self.usage_per_agent, agent, cost, tokens)
        if model is not None:
            _add(self.usage_per_model, model, cost, tokens)

    def result(
        self,
        *,
        run_id: str,
        wall0: datetime,
        elapsed: float,
        threshold: float,
        data: Any,
        events_dropped: int,
        resumed: int = 0,
        input_complete: bool = True,
        input_unread: int | None = 0,
    ) -> RunResult:
        """The `RunResult` of what was counted, by the status rules (docs/failures.md). A run that ended before the
        end of its input (`input_complete` False: a run timeout, a budget, a stop) is never ok:
        the threshold is a promise about the whole input, which it cannot show it kept. Its
        `input_unread` items, when known, count in the success rate as not succeeded."""
        if self.batch:
            self.fold()
        kinds, per_agent, not_ok = self.kinds, self.per_agent, self.not_ok
        counts = {name: kind.counts() for name, kind in sorted(kinds.items())}
        counts = {name: by_state for name, by_state in counts.items() if by_state}
        by_status: dict[str, int] = dict.fromkeys((SUCCEEDED, FAILED, SKIPPED, CANCELLED), 0)
        for by_kind in counts.values():
            for name, n in by_kind.items():
                by_status[name] += n
        total = sum(by_status.values())
        succeeded = by_status[SUCCEEDED]
        counted = total + (input_unread or 0)
        rate = succeeded / counted if counted else 1.0
        critical = [n.id for n in not_ok if n.task.critical] + self.critical_failed
        if not input_complete and self.reason is not None:
            left = "an unknown number of" if input_unread is None else str(input_unread)
            self.reason += f", before the end of the input ({left} items unread)"
        status: Outcome
        if self.cancelled:
            status = "cancelled"
        elif not input_complete:
            status = "failed"
        elif succeeded == total and not self.cut_short:
            status = "success"
        elif rate >= threshold and not critical:
            status = "partial"
        else:
            status = "failed"
            if self.reason is None:
                self.reason = (
                    f"critical task {critical[0]!r} did not succeed"
                    if critical
                    else f"success rate {rate:.3f} is below the threshold {threshold}"
                )
        metadata = RunMetadata(
            run_id=run_id,
            started_at=wall0,
            finished_at=wall0 + timedelta(seconds=elapsed),
            elapsed=elapsed,
            total=total,
            counts=by_status,
            counts_by_kind=counts,
            success_rate=rate,
            success_threshold=threshold,
            attempts=self.attempts,
            retries=self.retries,
            fallbacks=self.fallbacks,
            agents_used=sorted(per_agent),
            tasks_per_agent=dict(sorted(per_agent.items())),
            time_per_kind={
                name: kind.timing() for name, kind in sorted(kinds.items()) if kind.timed
            },
            peak_concurrency=self.peak,
            defaulted=self.defaulted,
            tokens=dict(sorted(self.tokens.items())),
            cost=dollars(self.cost),
            usage_per_agent=_sorted_usage(self.usage_per_agent),
            usage_per_model=_sorted_usage(self.usage_per_model),
            events_dropped=events_dropped,
            resumed=resumed,
            input_complete=input_complete,
            input_unread=input_unread,
            reason=self.reason,
            cancellations=self.cancellations,
        )
        errors = [_error_record(record) for record in sorted(not_ok, key=_position)]
        return RunResult(status=status, data=data, metadata=metadata, errors=errors)


def _position(record: Record) -> tuple[int, ...]:
    return record.order


def _error_record(record: Record) -> ErrorRecord:
    failures = record.failures or []
    error_type = record.error_type or (failures[-1].error_type if failures else "Error")
    last = failures[-1] if failures else None
    message = record.error or (f"{last.error_type}: {last.message}" if last else "")
    return ErrorRecord(
        task_id=record.id,
        kind=record.kind,
        status=record.status,  # type: ignore[arg-type]
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
                traceback=a.traceback,
                status_code=a.status_code,
                api_error_type=a.api_error_type,
                request_id=a.request_id,
            )
            for a in failures
        ],
        remediation=remediation(
            record.status,
            error_type,
            message,
            agents=len({a.agent for a in failures}),
            status_code=None if last is None else last.status_code,
            api_error_type=None if last is None else last.api_error_type,
        ),
        critical=record.task.critical,
        partial_output=record.output if record.status == FAILED else None,
        status_code=None if last is None else last.status_code,
        api_error_type=None if last is None else last.api_error_type,
        request_id=None if last is None else last.request_id,
    )


def _add(table: dict[str, dict[str, float]], key: str, cost: float, tokens: Any) -> None:
    row = table.get(key)
    if row is None:
        row = table[key] = {"cost": 0.0}
    row["cost"] += cost
    for name, n in tokens.items():
        row[name] = row.get(name, 0) + n


def _sorted_usage(table: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {
        key: {name: dollars(n) if name == "cost" else n for name, n in sorted(row.items())}
        for key, row in sorted(table.items())
    }


def dollars(cost: float) -> float:
    """A sum of costs as shown: to a billionth of a dollar, without the noise of adding floats
    (0.1 + 0.2 is 0.30000000000000004; a price per token is 1e-8 dollars at the least)."""
    return round(cost, 9)
