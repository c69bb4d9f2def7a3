"""The structured answer of a run: `RunResult` with status, data, metadata and errors.

Pydantic models, built once per run (never on the hot path), so a result round-trips through JSON:
`RunResult.model_validate_json(result.model_dump_json()) == result` when its outputs are JSON values.
Outputs (`data`, `partial_output`) are the agents' own objects, kept as returned; the JSON dump writes
what JSON cannot hold of them (an object, an array, an iterator) as its repr, and never reads an
iterator (`orchestra._output.jsonable`).
"""

from __future__ import annotations

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


class RunResult(BaseModel):
    """What `Orchestrator.run` returns.

    `status` is "success" when every task succeeded, "partial" when the success rate meets the
    threshold and no critical task failed, "failed" otherwise, "cancelled" when the run was cancelled.
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
        """True for "success" and "partial"."""
        return self.status in ("success", "partial")

    def error_for(self, task_id: str) -> ErrorRecord | None:
        """The error record of `task_id`, if it did not succeed."""
        return next((e for e in self.errors if e.task_id == task_id), None)
