"""The JSON of the workers' routes (``/api/workers``), as pydantic models both ends share: the
service's routes (`orchestra._service._work`) read and answer them, the worker's backend
(`._worker`) writes and reads them. One definition, checked once at each boundary.

They live here, below the service, because the worker's side must not import the service (nor
FastAPI): a worker machine installs httpx and pydantic only. Lease times are not here: the store
keeps them on its own clock (the service's, or the database's); the times a worker sends (its
attempts' starts) count from `CompleteRequest.wall0`, which the worker moves onto the service's
clock by the difference it measured when it said hello.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..._result import AttemptRecord

__all__ = (
    "MAX_BATCH",
    "MAX_WAIT",
    "NAME_PATTERN",
    "ClaimRequest",
    "Claimed",
    "ClaimedTask",
    "Closed",
    "CompleteRequest",
    "Completed",
    "End",
    "FailedAttempt",
    "Heartbeat",
    "HeartbeatRequest",
    "Hello",
    "Lease",
    "Note",
    "Present",
    "Presented",
    "ReleaseRequest",
    "Released",
    "Spawn",
    "TaskRef",
    "WaitRequest",
    "Waited",
    "token_of",
    "worker_name",
)

MAX_BATCH: Final = 10_000
"""The most tasks one claim, heartbeat, completion or release may name."""

MAX_WAIT: Final = 60.0
"""The longest a wake-up request waits, in seconds."""

RunId = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$")]
Kind = Annotated[str, Field(min_length=1, max_length=200)]
Id = Annotated[str, Field(min_length=1, max_length=1000)]


class _In(BaseModel):
    # A misspelt field is refused, not ignored.
    model_config = ConfigDict(extra="forbid")


class Hello(BaseModel):
    """What a worker learns before it starts: its token's id (its name in the store carries it),
    the store's lease and poll, and the service's clock."""

    token_id: str
    lease: float = Field(description="Seconds a claim lasts unrenewed.")
    poll: float = Field(description="Seconds a wake-up request waits when nothing wakes it.")
    now: float = Field(description="The service's wall clock (epoch seconds).")


class Present(_In):
    """The worker's presence: the run it serves (None: every run) and its kinds."""

    run_id: RunId | None = None
    kinds: list[Kind] = Field(min_length=1, max_length=1000)


class Presented(BaseModel):
    name: str
    lease: float
    poll: float


class ClaimRequest(_In):
    """Claim up to `room` ready tasks, of each kind at most its room in `rooms`."""

    run_id: RunId | None = None
    rooms: dict[Kind, Annotated[int, Field(ge=1, le=MAX_BATCH)]] = Field(min_length=1)
    room: int = Field(ge=1, le=MAX_BATCH)


class ClaimedTask(BaseModel):
    """A claimed task: what rebuilds its `Task`, its lease's fencing token, and its
    dependencies' outputs. `payload`, `metadata` and the outputs are the JSON text the store
    keeps (passed on as they are)."""

    run_id: str
    id: str
    token: int
    kind: str
    payload: str
    priority: int
    timeout: float | None
    critical: bool
    metadata: str | None
    attempts: int
    deps: dict[str, str | None]


class Claimed(BaseModel):
    tasks: list[ClaimedTask]
    maybe_over: bool = Field(description="The run may be over: ask /closed.")


class Closed(BaseModel):
    closed: bool


class WaitRequest(_In):
    poll: float = Field(gt=0, le=MAX_WAIT)


class Waited(BaseModel):
    waited: float = Field(description="Seconds the request waited.")


class TaskRef(BaseModel):
    run_id: str
    id: str


class Lease(_In):
    """A held task, by its run, its id and its lease's fencing token."""

    run_id: Id
    id: Id
    token: int


class HeartbeatRequest(_In):
    held: list[Lease] = Field(max_length=MAX_BATCH)


class Heartbeat(BaseModel):
    lost: list[TaskRef] = Field(description="The tasks of `held` no longer held.")


class FailedAttempt(AttemptRecord):
    """A failed attempt (`orchestra.Attempt`), with the fields of the result's `AttemptRecord`;
    `started` counts from the request's `wall0`."""

    # A misspelt field is refused, not ignored; a number is counted from 1.
    model_config = ConfigDict(extra="forbid")

    number: int = Field(ge=1)


class Spawn(_In):
    """A task an attempt spawned (`_worker_run.spawn_data`): `named_here`, its id is the worker's
    guess and the store names it again."""

    kind: Kind
    payload: Any = None
    id: Id
    named_here: bool = False
    priority: int = 0
    depends_on: list[str] = []
    depends_on_tags: list[str] = []
    tags: list[str] = []
    key: str | None = None
    timeout: float | None = None
    critical: bool = False
    metadata: dict[str, Any] | None = None


class End(_In):
    """How a held task ended (its `TaskResult`, the output as the JSON text the store keeps),
    with its failed attempts not written yet and what its attempt spawned."""

    lease: Lease
    kind: Kind
    status: Literal["succeeded", "failed", "cancelled", "skipped"]
    output: str | None = None
    agent: str | None = None
    error: str | None = None
    error_type: str | None = None
    defaulted: bool = False
    attempts: int = Field(ge=0)
    started: float | None = None
    failures: list[FailedAttempt] = []
    spawned: list[Spawn] | None = None


class Note(_In):
    """A failed attempt of a held task that goes on (a retry), written as it fails."""

    lease: Lease
    attempt: FailedAttempt


class CompleteRequest(_In):
    wall0: float = Field(description="The service-clock time the worker's times count from.")
    kinds: list[Kind] = Field(
        default=[], description="The kinds the worker serves: its spawns are checked against them."
    )
    ends: list[End] = Field(max_length=MAX_BATCH)
    notes: list[Note] = Field(default=[], max_length=MAX_BATCH)


class Completed(BaseModel):
    accepted: list[bool] = Field(description="For each end, whether the store took it.")


class ReleaseRequest(_In):
    held: list[Lease] | None = Field(
        default=None, max_length=MAX_BATCH, description="None: every claim the worker holds."
    )


class Released(BaseModel):
    released: int


# -- a remote worker's name in the store -----------------------------------------------------------

NAME_PATTERN: Final = r"^[A-Za-z0-9._-]{1,253}:[0-9]{1,10}:[A-Za-z0-9]{1,64}\.[A-Za-z0-9_-]{1,64}$"
"""``host:pid:token.suffix``: the worker's host and pid (as a worker on the database names
itself), then the id of the token it works with, then its own suffix."""


def worker_name(host: str, pid: int, token_id: str, suffix: str) -> str:
    """The name a worker of token `token_id` has in the store: bound to its token, so that the
    service lets only that token's requests act for it (`token_of`)."""
    host = "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "-" for c in host)
    return f"{host[:253] or 'host'}:{pid}:{token_id}.{suffix}"


def token_of(name: str) -> str:
    """The id of the token `name` (from `worker_name`) is bound to."""
    return name.split(":", 2)[2].partition(".")[0]
