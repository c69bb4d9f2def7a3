"""The JSON of the service's requests and answers, as pydantic models: checked once at the
boundary, and published in the OpenAPI document as they are."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .._spec import JsonValue, TaskSpec

__all__ = (
    "CancelRequest",
    "Cancelled",
    "Control",
    "DeadLetter",
    "ErrorBody",
    "Health",
    "JournalEvent",
    "Reopened",
    "ReprioritizeRequest",
    "Reprioritized",
    "RetryRequest",
    "RunAccepted",
    "RunId",
    "RunList",
    "RunSummary",
    "StatusOut",
    "StopRequest",
    "SubmitRun",
    "TaskAccepted",
    "TaskDetail",
    "TaskOutcome",
)

# A run id travels in URLs (/api/runs/{id}): letters, digits and ._:- only, so that it never
# needs escaping and never reads as a path.
RunId = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$")]


class _In(BaseModel):
    # A misspelt field is refused, not ignored: `{"grace ": 5}` must not stop a run at once.
    model_config = ConfigDict(extra="forbid")


class ErrorBody(BaseModel):
    """Every refusal's body: `error` a short code for programs, `message` what is wrong and what
    to do, `field` the field at fault when one is."""

    error: str
    message: str
    field: str | None = None


class Health(BaseModel):
    status: Literal["ok", "ready"]


class SubmitRun(_In):
    """A run to start: its `tasks` (the shapes ``orchestra run`` reads, one object each), or an
    `input` for the orchestrator's decomposer; `run_id` to name it (a fresh one by default)."""

    tasks: list[TaskSpec] | None = Field(default=None, min_length=1)
    input: JsonValue = None
    run_id: RunId | None = None

    @model_validator(mode="after")
    def _one_source(self) -> SubmitRun:
        if (self.tasks is None) == (self.input is None):
            raise ValueError("give exactly one of tasks (a list of tasks) and input")
        return self


class StatusOut(BaseModel):
    """A live run's `RunStatus` (``handle.status().to_dict()``): see "Watching a run"."""

    # A field the status gains later is passed on, not dropped.
    model_config = ConfigDict(extra="allow")

    run_id: str
    state: str
    elapsed: float
    total: int
    completed: int = Field(description="tasks ended, in any terminal state")
    active: int = Field(description="attempts running now")
    progress: float = Field(description="percent of total completed")
    counts: dict[str, int]
    input_complete: bool
    throughput: float = Field(description="tasks ended per second over the last window")
    window: float
    eta: float | None
    error_rate: float
    recent_error_rate: float
    attempts: int
    retries: int
    fallbacks: int
    concurrency: int
    utilisation: float
    queue_by_priority: dict[str, int]
    kinds: list[dict[str, Any]]
    agents: list[dict[str, Any]]
    bottleneck: dict[str, Any] | None
    errors: list[dict[str, Any]] = Field(
        description="the last failed tasks, oldest first: task_id, kind, agent, error_type, "
        "message, at (seconds into the run) and remediation (what to do about it)"
    )
    cost: float = Field(description="USD spent so far")
    tokens: dict[str, int] = Field(description="tokens spent so far, by kind of token")
    max_cost: float | None = Field(default=None, description="the run's budget in USD, if any")
    max_tokens: int | None = Field(
        default=None, description="the run's budget in tokens of every kind together, if any"
    )


class RunAccepted(BaseModel):
    """A run started (or, for an id or idempotency key seen before, the run it started)."""

    run_id: str
    created: bool = Field(description="False when the same request had started it already.")


class RunSummary(BaseModel):
    """A run as its store keeps it, and whether this service runs it now."""

    id: str
    state: str = Field(description="open (not finished, or reopened by a retry) or closed")
    created: float | None = None
    updated: float | None = None
    counts: dict[str, int] = Field(description="its tasks by state")
    live: bool = Field(description="this service runs it now (it can be controlled here)")
    paused: bool = Field(
        default=False,
        description="paused, where it runs: here, or (PostgreSQL replicas) by the replica that runs it",
    )
    held_by: str | None = Field(
        default=None, description="the process that runs it now, when one does"
    )


class RunList(BaseModel):
    """A page of runs, newest first."""

    runs: list[RunSummary]
    next_cursor: str | None = Field(
        default=None,
        description="give it as `cursor` for the next page (older runs); null: no more",
    )


class Control(BaseModel):
    """A run after pause or resume."""

    run_id: str
    paused: bool


class CancelRequest(_In):
    """Which unfinished tasks to cancel: those that match every selector given (at least one)."""

    task_id: str | list[str] | None = None
    kind: str | None = None
    tag: str | None = None
    agent: str | None = None
    priority: tuple[int, int] | None = Field(default=None, description="[low, high], both included")
    reason: str | None = None

    @model_validator(mode="after")
    def _some_selector(self) -> CancelRequest:
        if all(v is None for v in (self.task_id, self.kind, self.tag, self.agent, self.priority)):
            raise ValueError("give at least one of task_id, kind, tag, agent and priority")
        return self


class Cancelled(BaseModel):
    reason: str
    cancelled: list[str]
    skipped: list[str]
    deferred: bool = Field(description="the run had no tasks yet: the cancel applies to them")


class ReprioritizeRequest(_In):
    task_id: str
    priority: int


class Reprioritized(BaseModel):
    changed: bool = Field(description="False when the task does not wait any more")


class StopRequest(_In):
    grace: float | None = Field(
        default=10.0,
        ge=0,
        allow_inf_nan=False,
        description="seconds the running attempts may take to finish; null: as long as they take",
    )
    reason: str | None = None


class JournalEvent(BaseModel):
    """One event of a run's journal, as its store tells it."""

    seq: int | None = Field(
        description="the row's number; null for an event read from a task's row"
    )
    run_id: str
    task_id: str | None
    at: float = Field(description="wall time, seconds since the epoch")
    event: str
    agent: str | None = None
    attempt: int | None = None
    detail: str | None = None


class TaskDetail(BaseModel):
    """One task of a run: its state as its journal ends, and every event of it."""

    run_id: str
    task_id: str
    state: str
    attempts: int
    agent: str | None = Field(
        description="the agent of its last attempt (of its success, or the one it failed on); "
        "null before its first"
    )
    events: list[JournalEvent]


class DeadLetter(BaseModel):
    """A task that failed for good, with every failed attempt."""

    model_config = ConfigDict(extra="allow")

    run_id: str
    task_id: str
    kind: str
    payload: Any = None
    attempts: int
    agent: str | None = None
    error_type: str | None = None
    error: str | None = None
    finished: float | None = None
    attempts_list: list[dict[str, Any]]


class RetryRequest(_In):
    task_ids: list[str] | None = Field(
        default=None, min_length=1, description="the failed tasks to retry; null: all of them"
    )


class Reopened(BaseModel):
    reopened: list[str]


class TaskAccepted(BaseModel):
    task_id: str
    run_id: str


class TaskOutcome(BaseModel):
    """A task submitted alone (``POST /tasks``): running until it ends, then its result."""

    task_id: str
    run_id: str
    status: str = Field(description="running, or its end: succeeded, failed, cancelled, ...")
    output: Any = None
    error_type: str | None = None
    error: str | None = None
