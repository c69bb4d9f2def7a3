"""The structured answer of a run: `RunResult` with status, data, metadata and errors.

Pydantic models, built once per run (never on the hot path), so a result round-trips through JSON:
`RunResult.model_validate_json(result.model_dump_json()) == result` when its outputs are JSON values.
Outputs (`data`, `partial_output`) are the agents' own objects, kept as returned; the JSON dump writes
what JSON cannot hold of them (an object, an array, an iterator) as its repr, and never reads an
iterator (`orchestra._output.jsonable`).

`str()` of a result or of its metadata is a few lines for people (`print(result)`); the repr stays
the full model, for debugging.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer

from ._output import jsonable

__all__ = (
    "AttemptRecord",
    "CancelRecord",
    "ErrorRecord",
    "Outcome",
    "RunMetadata",
    "RunResult",
    "TimingStats",
)

Outcome = Literal["success", "partial", "failed", "cancelled"]


class AttemptRecord(BaseModel):
    """One failed attempt: which agent, what went wrong, when (seconds since the run started), how long.

    `traceback` is the attempt's formatted traceback (its innermost frames, at most 8,000 characters);
    for an HTTP error, `status_code`, `api_error_type` (the API's `error.type`, such as
    ``"rate_limit_error"``) and `request_id` (to quote to the API's support). Messages and
    tracebacks are scrubbed of API keys.
    """

    model_config = ConfigDict(frozen=True)

    number: int
    agent: str
    error_type: str
    message: str
    started: float
    duration: float
    retry_in: float | None = None
    traceback: str | None = None
    status_code: int | None = None
    api_error_type: str | None = None
    request_id: str | None = None


class ErrorRecord(BaseModel):
    """One task that did not succeed, with every attempt and a suggested remediation.

    `status_code`, `api_error_type` and `request_id` are those of the last failed attempt.
    """

    model_config = ConfigDict(frozen=True)

    task_id: str
    kind: str
    status: Literal["failed", "skipped", "cancelled"]
    error_type: str
    message: str
    attempts: list[AttemptRecord] = Field(default_factory=list)
    remediation: str
    critical: bool = False
    partial_output: Any = None
    status_code: int | None = None
    api_error_type: str | None = None
    request_id: str | None = None

    @field_serializer("partial_output", when_used="json")
    def _dump_partial_output(self, output: Any) -> Any:
        return jsonable(output)


class CancelRecord(BaseModel):
    """One `RunHandle.cancel(...)` of a run: when (seconds since the run started), why, what it
    selected, the tasks it cancelled (running or waiting) and the dependents it skipped."""

    model_config = ConfigDict(frozen=True)

    at: float
    reason: str
    selector: dict[str, Any]
    cancelled: list[str] = Field(default_factory=list)
    skipped: list[str] = Field(default_factory=list)


class TimingStats(BaseModel):
    """Seconds per task of one kind, from its first attempt's start to its end."""

    model_config = ConfigDict(frozen=True)

    count: int
    mean: float
    p50: float
    p95: float
    max: float


class RunMetadata(BaseModel):
    """The statistics of a run.

    `reason` says why a run did not succeed (or why it was stopped); `cancellations` lists each
    `RunHandle.cancel(...)` made during the run; `resumed` counts the tasks whose results a durable
    store kept from an earlier process running the same run id (0 for a fresh run).

    `input_complete` is False when the run ended (a run timeout, a budget, a stop) before the end
    of a streamed input; `input_unread` is how many of its items were never read: 0 when it was
    read to its end, None when the rest's length is unknown (a generator). Such a run is never
    ok, and the unread items it knows of count in `success_rate` as not succeeded.

    `tokens` and `cost` are what agents reported (`ctx.record_usage`; a Claude agent reports
    every answer's input, output, cache-write and cache-read tokens and its USD cost, failed
    attempts included); `usage_per_agent` and `usage_per_model` split them by agent name and by
    model id, each row holding the token counts and ``"cost"``.
    """

    model_config = ConfigDict(frozen=True)

    run_id: str
    started_at: datetime
    finished_at: datetime
    elapsed: float
    total: int
    counts: dict[str, int]
    counts_by_kind: dict[str, dict[str, int]]
    success_rate: float
    success_threshold: float
    attempts: int
    retries: int
    fallbacks: int
    agents_used: list[str]
    tasks_per_agent: dict[str, int]
    time_per_kind: dict[str, TimingStats]
    peak_concurrency: int
    defaulted: list[str] = Field(default_factory=list)
    tokens: dict[str, int] = Field(default_factory=dict)
    cost: float = 0.0
    usage_per_agent: dict[str, dict[str, float]] = Field(default_factory=dict)
    usage_per_model: dict[str, dict[str, float]] = Field(default_factory=dict)
    events_dropped: int = 0
    resumed: int = 0
    input_complete: bool = True
    input_unread: int | None = 0
    reason: str | None = None
    cancellations: list[CancelRecord] = Field(default_factory=list)

    def __str__(self) -> str:
        """A few lines for people: the run, its tasks by status, attempts and agents, and the
        spend or the reason when there is one (``print(result.metadata)``)."""
        lines = [
            f"run {self.run_id}: {self.total} tasks ({_counts(self.counts)}) "
            f"in {self.elapsed:.2f}s",
            f"attempts {self.attempts}, retries {self.retries}, fallbacks {self.fallbacks}; "
            f"peak concurrency {self.peak_concurrency}",
        ]
        if self.tasks_per_agent:
            per_agent = ", ".join(f"{name} {n}" for name, n in self.tasks_per_agent.items())
            lines.append(f"tasks per agent: {per_agent}")
        if self.resumed:
            lines.append(f"resumed: {self.resumed} tasks came back from the store")
        if self.cost or self.tokens:
            tokens = ", ".join(f"{n} {unit}" for unit, n in self.tokens.items())
            lines.append(f"spent: ${self.cost:.4f}" + (f", {tokens}" if tokens else ""))
        if self.reason:
            lines.append(f"reason: {self.reason}")
        return "\n".join(lines)


class RunResult(BaseModel):
    """What `Orchestrator.run` returns.

    `status` is "success" when every task succeeded, "partial" when the success rate meets the
    threshold and no critical task failed, "failed" otherwise, "cancelled" when the run was cancelled.
    `data` is the aggregate of the outputs (by default, outputs by task id in input order),
    `metadata` the statistics, `errors` one record per task that did not succeed.

    `print(result)` shows `summary()`: the status, the counts, the time, the errors by type and
    the first errors, one line each.
    """

    model_config = ConfigDict(frozen=True)

    status: Outcome
    data: Any
    metadata: RunMetadata
    errors: list[ErrorRecord] = Field(default_factory=list)

    @field_serializer("data", when_used="json")
    def _dump_data(self, data: Any) -> Any:
        return jsonable(data)

    @property
    def ok(self) -> bool:
        """True when the run met its goal: its status is "success" or "partial" (some tasks did
        not succeed, but the success rate met `success_threshold` and no critical task failed)."""
        return self.status in ("success", "partial")

    def error_for(self, task_id: str) -> ErrorRecord | None:
        """The error record of the task `task_id`, with every failed attempt and a remediation;
        None when that task succeeded (or the run has no task of that id)."""
        return next((e for e in self.errors if e.task_id == task_id), None)

    def summary(self, *, errors: int = 10) -> str:
        """How the run went, in a few lines: what `str(result)` and ``orchestra run`` print.

        The first line is the status, the tasks by status, the time and the attempts; then the
        reason a run did not succeed, the errors counted by type, and the first `errors` error
        records (task, kind, message).
        """
        m = self.metadata
        lines = [
            f"{self.status}: {m.total} tasks ({_counts(m.counts)}) in {m.elapsed:.2f}s; "
            f"{_n(m.attempts, 'attempt')}, {_n(m.retries, 'retry', 'retries')}, "
            f"{_n(m.fallbacks, 'fallback')}"
        ]
        if m.reason and self.status != "success":
            lines.append(f"reason: {m.reason}")
        if self.errors:
            by_type = Counter(e.error_type for e in self.errors).most_common()
            lines.append("errors: " + ", ".join(f"{n} {name}" for name, n in by_type))
        shown = self.errors[: max(errors, 0)]
        lines += [f"  {e.task_id} ({e.kind}): {e.message}" for e in shown]
        if len(self.errors) > len(shown):
            lines.append(f"  ... and {len(self.errors) - len(shown)} more")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _n(n: int, one: str, many: str = "") -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {status}" for status, n in sorted(counts.items()) if n) or "none"
