"""Tasks, their results and their attempts: plain slotted objects, cheap to build.

A `Task` is built for every subtask of a run, so it is a slotted class with a plain `__init__`, not a
pydantic model (building a model costs ~2 µs; this costs a fraction of that). Its fields are validated
once, when the run admits the task (`orchestra._admission`, in the store), and never again on the hot path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, Literal

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = ("Attempt", "Task", "TaskResult", "TaskStatus")

TaskStatus = Literal["succeeded", "failed", "cancelled", "skipped"]

# Task life: pending → ready → claimed → running → succeeded, with running → retry_wait → ready, and
# the terminal states succeeded, failed, cancelled, skipped. A claimed task is leased to a dispatcher
# that has not started its attempt yet (it waits for room at its agent). The strings are interned,
# so `is` compares them.
PENDING: Final = "pending"
READY: Final = "ready"
CLAIMED: Final = "claimed"
RUNNING: Final = "running"
RETRY_WAIT: Final = "retry_wait"
SUCCEEDED: Final = "succeeded"
FAILED: Final = "failed"
CANCELLED: Final = "cancelled"
SKIPPED: Final = "skipped"
TERMINAL: Final = frozenset((SUCCEEDED, FAILED, CANCELLED, SKIPPED))
STATE_OF: Final = {
    s: s
    for s in (PENDING, READY, CLAIMED, RUNNING, RETRY_WAIT, SUCCEEDED, FAILED, CANCELLED, SKIPPED)
}
"""A state read back from a database, as the interned constant (`STATE_OF[row_state]`)."""

_EMPTY: tuple[str, ...] = ()


class Task:
    """One typed subtask of a run.

    Args:
        kind: the routing key; an agent that serves this kind handles the task.
        payload: the agent's input. Validated against the agent's declared `input` model, if any.
        id: unique within a run; generated as ``"<kind>#<n>"`` from the admission order when absent
            (``"<parent id>/<kind>#<n>"`` for a task an attempt spawns, n counting its spawns).
        priority: smaller runs first; FIFO among equal priorities.
        depends_on: ids of tasks that must succeed before this one starts; their outputs are in `ctx.deps`.
        depends_on_tags: groups this task waits for: every task carrying the tag must have succeeded
            and no more can appear (see the README's "Dependencies").
        tags: free labels; a tag also names a group that other tasks may wait for.
        key: idempotency key, used by durable stores to make re-submission safe.
        timeout: seconds for the whole task (every attempt and wait together), from ready to done.
        critical: a failed critical task fails the run, whatever the success threshold.
        metadata: free data carried along, never read by the runtime.
    """

    __slots__ = (
        "critical",
        "depends_on",
        "depends_on_tags",
        "id",
        "key",
        "kind",
        "metadata",
        "payload",
        "priority",
        "tags",
        "timeout",
    )

    def __init__(
        self,
        kind: str,
        payload: Any = None,
        *,
        id: str | None = None,
        priority: int = 0,
        depends_on: Sequence[str] = _EMPTY,
        depends_on_tags: Sequence[str] = _EMPTY,
        tags: Sequence[str] = _EMPTY,
        key: str | None = None,
        timeout: float | None = None,
        critical: bool = False,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        self.kind = kind
        self.payload = payload
        # Typed `str`: an agent always sees an id (one is generated at admission when absent).
        self.id: str = id  # type: ignore[assignment]
        self.priority = priority
        self.depends_on = depends_on
        self.depends_on_tags = depends_on_tags
        self.tags = tags
        self.key = key
        self.timeout = timeout
        self.critical = critical
        self.metadata = metadata

    def __repr__(self) -> str:
        return f"Task(id={self.id!r}, kind={self.kind!r}, priority={self.priority})"


class Attempt:
    """One failed call of one agent on one task: what the error record lists, attempt by attempt.

    `traceback`, `status_code`, `api_error_type` and `request_id` are those of the attempt's
    `orchestra._failure.Failure` (bounded, scrubbed of secrets); None when they do not apply.
    """

    __slots__ = (
        "agent",
        "api_error_type",
        "duration",
        "error_type",
        "message",
        "number",
        "request_id",
        "retry_in",
        "started",
        "status_code",
        "traceback",
    )

    def __init__(
        self,
        *,
        number: int,
        agent: str,
        error_type: str,
        message: str,
        started: float,
        duration: float,
        retry_in: float | None = None,
        traceback: str | None = None,
        status_code: int | None = None,
        api_error_type: str | None = None,
        request_id: str | None = None,
    ) -> None:
        self.number = number
        self.agent = agent
        self.error_type = error_type
        self.message = message
        self.started = started
        self.duration = duration
        self.retry_in = retry_in
        self.traceback = traceback
        self.status_code = status_code
        self.api_error_type = api_error_type
        self.request_id = request_id

    def __repr__(self) -> str:
        return (
            f"Attempt(#{self.number} on {self.agent!r}: {self.error_type}: {self.message!r}, "
            f"{self.duration:.3f}s)"
        )


class TaskResult:
    """The outcome of one task, streamed by `Orchestrator.stream` and folded by the aggregator.

    `started` and `finished` are seconds since the run started; `attempts` counts every call of an agent,
    `failures` lists the failed ones.
    """

    __slots__ = (
        "agent",
        "attempts",
        "defaulted",
        "error",
        "error_type",
        "failures",
        "finished",
        "kind",
        "output",
        "seq",
        "started",
        "status",
        "task",
        "task_id",
    )

    def __init__(
        self,
        task: Task,
        seq: int,
        status: TaskStatus,
        output: Any,
        agent: str | None,
        attempts: int,
        failures: list[Attempt] | None,
        started: float | None,
        finished: float,
        error: str | None = None,
        defaulted: bool = False,
        error_type: str | None = None,
    ) -> None:
        self.task = task
        self.task_id = task.id
        self.kind = task.kind
        self.seq = seq
        self.status = status
        self.output = output
        self.agent = agent
        self.attempts = attempts
        self.failures = failures
        self.started = started
        self.finished = finished
        self.error = error
        self.error_type = error_type
        self.defaulted = defaulted

    @property
    def position(self) -> tuple[int, ...]:
        """Where the task stands in the run's input order: ``(i,)`` for the i-th input task,
        the spawner's position plus the spawn index for a spawned task. Independent of timing,
        so aggregators sort by it."""
        return (self.seq,)

    @property
    def order(self) -> tuple[int, ...]:
        """A key that sorts results in input order (`position`, or a cheaper equivalent)."""
        return self.position

    @property
    def ok(self) -> bool:
        """True when the task succeeded (with a default value or not)."""
        return self.status == SUCCEEDED

    @property
    def duration(self) -> float | None:
        """Seconds from the first attempt's start to the end, or None when it never ran."""
        return None if self.started is None else self.finished - self.started

    def __repr__(self) -> str:
        return f"TaskResult(task_id={self.task_id!r}, status={self.status!r}, agent={self.agent!r})"
