"""The report of a run: counters kept as tasks finish, and the `RunResult` built from them once.

Counting happens on the hot path (a few dict updates per task); everything else — status rules,
percentiles, error records with remediations, the pydantic models — happens once, at the end.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from random import Random
from typing import TYPE_CHECKING, Any

from pydantic_core import to_json

from ._aggregate import percentile
from ._result import (
    AttemptRecord,
    CancelRecord,
    ErrorRecord,
    RunMetadata,
    RunResult,
    RunStatus,
    TimingStats,
)
from ._task import CANCELLED, FAILED, SKIPPED, SUCCEEDED

if TYPE_CHECKING:
    from collections.abc import Iterable

    from .stores._memory import Record as Node

__all__ = ("Report", "remediation")


class Report:
    """What a run counts: live counters, and the tallies of settled tasks.

    A whole-list run tallies its nodes once, at the end (nothing per task on the hot path); a
    streamed run tallies a succeeded task when it compacts it away (`Graph.compact`)."""

    __slots__ = (
        "attempts",
        "cancellations",
        "cancelled",
        "cost",
        "counts",
        "cut_short",
        "defaulted",
        "durations",
        "fallbacks",
        "not_ok",
        "peak",
        "per_agent",
        "reason",
        "retries",
        "tokens",
    )

    def __init__(self) -> None:
        self.attempts = 0
        self.retries = 0
        self.fallbacks = 0
        self.peak = 0
        self.counts: dict[str, dict[str, int]] = {}
        self.durations: dict[str, Durations] = {}
        self.per_agent: dict[str, int] = {}
        self.not_ok: list[Node] = []
        self.defaulted: list[str] = []
        self.tokens: dict[str, int] = {}
        self.cost = 0.0
        self.reason: str | None = None
        self.cancelled = False
        self.cancellations: list[CancelRecord] = []  # the run handle's cancels, as they happen
        self.cut_short = False  # the run timeout ended it: never "success"

    def tally(self, node: Node) -> None:
        """Count one settled task."""
        kind, state = node.kind, node.status
        by_kind = self.counts.get(kind)
        if by_kind is None:
            by_kind = self.counts[kind] = {}
        by_kind[state] = by_kind.get(state, 0) + 1
        if node.started is not None:
            durations = self.durations.get(kind)
            if durations is None:
                durations = self.durations[kind] = Durations()
            durations.add(node.finished - node.started)
        if state == SUCCEEDED:
            if node.agent is not None:
                self.per_agent[node.agent] = self.per_agent.get(node.agent, 0) + 1
        else:
            self.not_ok.append(node)

    def tally_all(self, nodes: Iterable[Node]) -> None:
        """`tally` for many settled tasks at once (a whole-list run, at its end): the same counts,
        with the durations of each kind added in one go."""
        counts = self.counts
        per_agent = self.per_agent
        not_ok = self.not_ok
        spans: dict[str, list[float]] = {}
        for node in nodes:
            kind, state = node.kind, node.status
            by_kind = counts.get(kind)
            if by_kind is None:
                by_kind = counts[kind] = {}
            by_kind[state] = by_kind.get(state, 0) + 1
            started = node.started
            if started is not None:
                values = spans.get(kind)
                if values is None:
                    values = spans[kind] = []
                values.append(node.finished - started)
            if state == SUCCEEDED:
                agent = node.agent
                if agent is not None:
                    per_agent[agent] = per_agent.get(agent, 0) + 1
            else:
                not_ok.append(node)
        for kind, values in spans.items():
            durations = self.durations.get(kind)
            if durations is None:
                durations = self.durations[kind] = Durations()
            durations.extend(values)

    def usage(self, cost: float, tokens: dict[str, int] | Any) -> None:
        self.cost += cost
        for name, n in tokens.items():
            self.tokens[name] = self.tokens.get(name, 0) + n

    def result(
        self,
        nodes: Iterable[Node],
        *,
        run_id: str,
        wall0: datetime,
        elapsed: float,
        threshold: float,
        data: Any,
        events_dropped: int,
        resumed: int = 0,
    ) -> RunResult:
        """The `RunResult` of the settled `nodes` (those not tallied yet), by DESIGN.md's rules."""
        self.tally_all(nodes)
        counts, durations, per_agent, not_ok = (
            self.counts,
            self.durations,
            self.per_agent,
            self.not_ok,
        )
        by_status: dict[str, int] = dict.fromkeys((SUCCEEDED, FAILED, SKIPPED, CANCELLED), 0)
        for by_kind in counts.values():
            for name, n in by_kind.items():
                by_status[name] += n
        total = sum(by_status.values())
        succeeded = by_status[SUCCEEDED]
        rate = succeeded / total if total else 1.0
        critical = [n.id for n in not_ok if n.task.critical]
        status: RunStatus
        if self.cancelled:
            status = "cancelled"
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
            counts_by_kind={k: dict(sorted(v.items())) for k, v in sorted(counts.items())},
            success_rate=rate,
            success_threshold=threshold,
            attempts=self.attempts,
            retries=self.retries,
            fallbacks=self.fallbacks,
            agents_used=sorted(per_agent),
            tasks_per_agent=dict(sorted(per_agent.items())),
            time_per_kind={k: _timing(v) for k, v in sorted(durations.items())},
            peak_concurrency=self.peak,
            defaulted=self.defaulted,
            tokens=dict(sorted(self.tokens.items())),
            cost=self.cost,
            events_dropped=events_dropped,
            resumed=resumed,
            reason=self.reason,
            cancellations=self.cancellations,
        )
        errors = [_error_record(node) for node in sorted(not_ok, key=_position)]
        return RunResult(status=status, data=data, metadata=metadata, errors=errors)


def _position(node: Node) -> tuple[int, ...]:
    return node.order


class Durations:
    """Task durations of one kind in bounded memory: exact count, mean and max, and percentiles
    from a uniform sample of at most `SAMPLE` durations (exact while there are no more than that).

    The sample is a reservoir kept by Li's algorithm L, which draws random numbers only for the
    values it keeps (a few thousand for a million tasks), seeded so a run's report is reproducible.
    """

    SAMPLE = 4096
    __slots__ = ("count", "max", "next", "rng", "sample", "total", "weight")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.max = 0.0
        self.sample: list[float] = []
        self.rng: Random | None = None
        self.weight = 1.0
        self.next = 0  # the count at which the next value enters the sample (once it is full)

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        if value > self.max:
            self.max = value
        if self.count <= self.SAMPLE:
            self.sample.append(value)
            if self.count == self.SAMPLE:
                self.rng = Random(self.SAMPLE)
                self._skip()
            return
        if self.count == self.next:
            self.sample[self.rng.randrange(self.SAMPLE)] = value  # type: ignore[union-attr]
            self._skip()

    def extend(self, values: list[float]) -> None:
        """`add` each of `values`: the exact figures in C (sum, max), the sample as `add` keeps it."""
        if not values:
            return
        if not self.count and len(values) > self.SAMPLE:
            # All at once (a whole-list run's durations, at its end): a uniform sample drawn in
            # one go, and the reservoir's state as algorithm L would have left it: the largest key
            # of a kept value is the k-th smallest of n uniform keys, Beta(k, n - k + 1)
            # distributed. (Walking algorithm L over the values costs ~0.3 µs each.)
            n, k = len(values), self.SAMPLE
            rng = self.rng = Random(k)
            self.count = n
            self.total = sum(values)
            self.max = max(values)
            self.sample = rng.sample(values, k)
            self.weight = rng.betavariate(k, n - k + 1)
            self.next = n + int(math.log(rng.random() or 1e-300) / math.log1p(-self.weight)) + 1
            return
        room = self.SAMPLE - self.count
        head, rest = (values[:room], values[room:]) if room > 0 else ([], values)
        for value in head:
            self.add(value)
        if not rest:
            return
        self.total += sum(rest)
        top = max(rest)
        if top > self.max:
            self.max = top
        start = self.count
        self.count += len(rest)
        # Algorithm L over the rest: only the values that enter the sample are looked at.
        rng: Random = self.rng  # type: ignore[assignment]
        while self.next <= self.count:
            self.sample[rng.randrange(self.SAMPLE)] = rest[self.next - start - 1]
            self._skip_from(self.next)

    def _skip(self) -> None:
        self._skip_from(self.count)

    def _skip_from(self, count: int) -> None:
        rng: Random = self.rng  # type: ignore[assignment]
        self.weight *= math.exp(math.log(rng.random() or 1e-300) / self.SAMPLE)
        gap = math.log(rng.random() or 1e-300) / math.log1p(-self.weight)
        self.next = count + int(gap) + 1


def _timing(durations: Durations) -> TimingStats:
    ordered = sorted(durations.sample)
    return TimingStats(
        count=durations.count,
        mean=durations.total / durations.count,
        p50=percentile(ordered, 0.5),
        p95=percentile(ordered, 0.95),
        max=durations.max,
    )


def _error_record(node: Node) -> ErrorRecord:
    result = node
    failures = node.failures or []
    error_type = result.error_type or (failures[-1].error_type if failures else "Error")
    last = failures[-1] if failures else None
    message = result.error or (f"{last.error_type}: {last.message}" if last else "")
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
                traceback=a.traceback,
                status_code=a.status_code,
                api_error_type=a.api_error_type,
                request_id=a.request_id,
            )
            for a in failures
        ],
        remediation=remediation(result.status, error_type, message),
        critical=node.task.critical,
        partial_output=_keepable(node.output) if result.status == FAILED else None,
        status_code=None if last is None else last.status_code,
        api_error_type=None if last is None else last.api_error_type,
        request_id=None if last is None else last.request_id,
    )


def _keepable(output: Any) -> Any:
    """`output` if the result can dump it to JSON, else None: a verifier's `VerificationError` may
    carry anything as its output, and a result that cannot be dumped is worse than a missing one."""
    if output is None or type(output) in (str, int, float, bool):
        return output
    try:
        to_json(output)
    except Exception:
        return None
    return output


def remediation(status: str, error_type: str, message: str) -> str:
    """A suggestion for the user, from what went wrong."""
    if status == SKIPPED:
        return f"Fix what failed first ({message}); this task runs once its dependencies succeed."
    if status == CANCELLED:
        if error_type == "RunTimeout":
            return (
                "The run ended before this task finished: raise the run timeout, or run it again."
            )
        if error_type == "Stopped":
            return "The run was stopped before this task finished: run it again to finish it."
        return "It was cancelled (see metadata.reason and metadata.cancellations): run it again if it is still wanted."
    lowered = message.lower()
    if error_type == "TaskTimeout":
        return "Raise the task's timeout, lower its attempts or backoff, or speed up its agents."
    if error_type == "AttemptTimeout":
        return "Raise the attempt timeout (timeouts={'attempt': ...} or @agent(timeout=...)) or check the agent's latency."
    if error_type == "Rejected":
        return "The safety check refused this task: change its payload or the check."
    if error_type == "VerificationError":
        return "The output kept failing verification: improve the agent or its prompt, or relax the verifier."
    if error_type == "InvalidOutput":
        return "The agent returned what a result cannot hold: fix the agent as the message says (an `await`, a JSON-serialisable output)."
    if error_type == "InputError":
        return "The task (or a task it spawned) is invalid: fix it as the message says; retrying will not help."
    if "429" in message or "rate limit" in lowered:
        return "The agent is rate limited: lower concurrency or the agent's limit, or raise your API quota."
    if error_type in ("ValidationError", "PermanentError") or "400" in message:
        return "The request is invalid for this agent: fix the payload; retrying will not help."
    if error_type == "NoAgentLeft":
        return (
            "No agent of the chain could take the task: add an agent for this kind or a fallback."
        )
    return (
        "Add a fallback agent for this kind, raise max_attempts, or check the agent's error above."
    )
