"""The store of a worker process's local run: a memory run with three differences.

A worker (`orchestra.stores._worker`) runs the tasks it claims from a shared store (a SQLite file,
a PostgreSQL database) as an ordinary run of its orchestrator, whose store is a `WorkerRun`: it
holds a `MemoryRun` and passes every transition to it, but for three differences, each said where
it is: a claimed task's dependencies' outputs come from the shared store, what an attempt spawns
is written with its end instead of running here, and an ended task is forgotten (a worker runs for
days). What it tells its worker (an end, a failed attempt, spawns to write) goes through `Host`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from pydantic_core import PydanticSerializationError, to_json

from .._exceptions import InputError, InvalidOutput
from .._output import json_value, jsonable, stored_json
from .._task import FAILED, PENDING, READY, SUCCEEDED, TERMINAL, Task, TaskResult
from ._memory import MemoryRun
from ._protocol import KEEP

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from .._admission import Admission
    from .._record import Record
    from .._task import Attempt
    from ._protocol import Listener

__all__ = ("Claim", "Host", "WorkerRun", "WorkerStore", "ending", "spawn_data", "task_of")

_UNSTARTED = frozenset((None, PENDING, READY))  # a held task's state before its run takes it up


class Claim(Protocol):
    """A task as a worker claimed it from its shared store (each store's ``Claimed``): what
    rebuilds its `Task`, its lease's token, and its dependencies' outputs (JSON text by id)."""

    @property
    def run_id(self) -> str: ...
    @property
    def id(self) -> str: ...
    @property
    def token(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def payload(self) -> str: ...
    @property
    def priority(self) -> int: ...
    @property
    def timeout(self) -> float | None: ...
    @property
    def critical(self) -> bool | int: ...
    @property
    def metadata(self) -> str | None: ...
    @property
    def attempts(self) -> int: ...
    @property
    def deps(self) -> dict[str, str | None]: ...


class Host(Protocol):
    """What a worker's local run asks of its worker: the claim under which it holds a task, and
    where the shared store's writes go."""

    # The wall time of the local run's zero (its records' times count from it): set when it opens.
    wall0: float

    def claim_of(self, task_id: str) -> Claim | None: ...
    def opened(self, run: WorkerRun) -> None: ...
    def ended(self, result: TaskResult) -> None: ...
    def attempt_failed(self, claimed: Claim, attempt: Attempt) -> None: ...
    def spawns(self, task_id: str, spawned: list[Task], named_here: set[str]) -> None: ...


class WorkerStore:
    """The store of a worker's local run."""

    def __init__(self, host: Host) -> None:
        self.host = host

    def open_run(
        self,
        run_id: str,
        *,
        admission: Admission,
        listener: Listener,
        clock: Callable[[], float],
        task_timeout: float | None,
        compact: bool,
    ) -> WorkerRun:
        return WorkerRun(self.host, run_id, admission, listener, clock, task_timeout, compact)


class WorkerRun:
    """A worker's local run: a `MemoryRun`'s transitions, with the file's differences."""

    resumed = 0  # its tasks come from the file's claims, never from an earlier process

    def __init__(
        self,
        host: Host,
        run_id: str,
        admission: Admission,
        listener: Listener,
        clock: Callable[[], float],
        task_timeout: float | None,
        compact: bool,
    ) -> None:
        self.run_id = run_id
        self._host = host
        self._admission = admission
        # Not compacting, whatever the engine asks (`compact`: its input is streamed): `settle`
        # forgets every task that ended, and so the common success takes `MemoryRun.succeed`'s
        # one step, not the general end that compacts it first (its output kept by id, then
        # forgotten at once).
        self._memory = memory = MemoryRun(
            run_id, admission, _Heard(listener, host), clock, task_timeout, False
        )
        self._listener = listener
        host.wall0 = time.time()
        host.opened(self)
        # The ids this worker gave spawns of the running attempt of each task (by its id): the
        # coordinator names them again, as it names its own, since only it knows the run's ids.
        self._named_here: dict[str, set[str]] = {}
        # Unchanged from the memory run, bound once rather than wrapped.
        self.admit = memory.admit
        self.close_input = memory.close_input
        self.backpressure = memory.backpressure
        self.claim = memory.claim
        self.heartbeat = memory.heartbeat
        self.start = memory.start
        self.note = memory.note
        self.cancel = memory.cancel
        self.due = memory.due
        self.next_due = memory.next_due
        self.results = memory.results
        self.state_of = memory.state_of
        self.reprioritize = memory.reprioritize
        self.queue_depths = memory.queue_depths
        self.close = memory.close

    @property
    def admission(self) -> Admission:
        """The checks of the worker's run (its agents' kinds and payload models)."""
        return self._admission

    @property
    def unfinished(self) -> int:
        return self._memory.unfinished

    @property
    def pending(self) -> int:
        return self._memory.pending

    def room(self, kind: str, held: Iterable[str]) -> int:
        """How many more tasks of `kind` the worker's agents could start now (`Listener.room`,
        none to hold for a wait: a rate's refill, a breaker's probe), less the ones of `held`
        (the ids of the kind the worker holds) its run has not taken up yet (not admitted, or
        ready: neither running nor waiting for an agent). O(held)."""
        state_of = self._memory.state_of
        unstarted = sum(state_of(i) in _UNSTARTED for i in held)
        return self._listener.room(kind, hold=False) - unstarted

    def stalled(self, longer_than: float) -> list[str]:
        """The ids of the tasks that wait for an agent to recover or for its limits to refill for
        more than `longer_than` seconds (`Listener.stalled`)."""
        return self._listener.stalled(longer_than)

    # -- what differs: admission of a claimed task -----------------------------------------------

    def admit_one(self, task: Any, index: int, *, generated: bool = False) -> None:
        memory = self._memory
        claimed = self._host.claim_of(task.id)
        try:
            record = None
            if claimed is not None and not generated and _alone(task):
                # A claim, rebuilt from the shared store's row of it: checked when its
                # coordinator admitted it, but for its payload against this worker's agents.
                # (None when the run has a task of its id: the general case below.)
                record = memory.admit_checked(task, index)
            if record is None:
                # A task claimed again (its lease was lost here once, it came back): a record
                # of its end that `settle` did not forget (a cancel ends a waiting task
                # directly) must not make the new claim look admitted already.
                memory.forget(task.id)
                if task.key is not None:
                    # The coordinator handed this task out to run: it holds its key (the run's
                    # other tasks with the key follow it there), whatever this worker ran with
                    # that key before.
                    memory.forget_key(task.key)
                memory.admit_one(task, index, generated=generated)
                if claimed is not None:
                    record = memory.record_of(task.id)
        except InputError as exc:
            if claimed is None:
                raise
            # Its payload does not fit this worker's agents: the task fails (the coordinator
            # hears why), the worker goes on. Raised, it would end the worker's run, and the
            # task, handed back, would end the next worker's too.
            ended = TaskResult(task, index, FAILED, None, None, claimed.attempts, None, None, 0.0,
                               error=str(exc), error_type="InputError")  # fmt: skip
            self._host.ended(ended)
            return
        if record is not None and claimed is not None:
            record.attempts = claimed.attempts  # attempts made elsewhere count here too

    # -- what differs: failed attempts written as they fail --------------------------------------

    def fail(
        self,
        record: Record,
        token: int,
        attempt: Attempt,
        *,
        retry_at: float | None = None,
        next_agent: str | None = KEEP,
    ) -> bool:
        if not self._memory.fail(record, token, attempt, retry_at=retry_at, next_agent=next_agent):
            return False
        # Written now, not with the task's end: a lease lost before that end (the worker killed
        # or paused) would otherwise lose this attempt, and the next one, on another worker,
        # would be numbered as this one.
        claimed = self._host.claim_of(record.id)
        if claimed is not None:
            self._host.attempt_failed(claimed, attempt)
        return True

    # -- what differs: dependencies from the file, spawns to the coordinator ---------------------

    def deps_of(self, record: Record) -> dict[str, Any]:
        claimed = self._host.claim_of(record.id)
        if claimed is None:
            return {}
        return {i: None if text is None else json_value(text) for i, text in claimed.deps.items()}

    def check_spawn(self, task: Task, parent: Record, pending: dict[str, Task]) -> None:
        # The coordinator checks references (it knows the run's tasks); here: the task's own
        # fields and that its payload can be stored. A task spawned without an id is named after
        # its parent, as the coordinator names it (`GraphChecks.spawn`), but without the run's
        # ids: the coordinator names it again when it admits it (`_sqlite._share._name`).
        given: str | None = task.id  # typed `str`: None until an id is given it
        if not pending:  # the attempt's first spawn
            self._named_here.pop(parent.id, None)
        if given is None and isinstance(task.kind, str):
            n = len(pending) + 1
            while f"{parent.id}/{task.kind}#{n}" in pending:
                n += 1
            task.id = f"{parent.id}/{task.kind}#{n}"
            self._named_here.setdefault(parent.id, set()).add(task.id)
        self._admission.check(task, f"task spawned by {parent.id!r}", None, lambda i: i in pending)
        if task.id in pending:
            raise InputError(
                f"task {parent.id!r} spawns duplicate task id {task.id!r}",
                task_id=task.id,
                field="id",
            )
        try:
            to_json(task.payload)
        except PydanticSerializationError as exc:
            raise InputError(
                f"task {task.id!r} spawned by {parent.id!r}: payload cannot be stored as JSON: "
                f"{exc}",
                task_id=task.id,
                field="payload",
            ) from exc

    # -- what differs: an end kept as JSON, then forgotten ---------------------------------------

    def settle(
        self,
        record: Record,
        token: int,
        status: str,
        output: Any = None,
        *,
        spawned: Sequence[Task] = (),
        agent: str | None = None,
        error: str | None = None,
        error_type: str | None = None,
        defaulted: bool = False,
        attempt: Attempt | None = None,
    ) -> bool:
        live = record.token == token and record.state not in TERMINAL
        if status is SUCCEEDED and live:
            # The file keeps outputs as JSON: one it cannot keep fails the attempt here, on the
            # worker, so the task moves down its chain as on the coordinator (`SQLiteRun.settle`).
            stored_json(output, record.id, agent)
        named_here = self._named_here.pop(record.id, ())
        if spawned and live:
            self._host.spawns(record.id, list(spawned), set(named_here))
        ended = self._memory.settle(
            record, token, status, output, agent=agent, error=error, error_type=error_type,
            defaulted=defaulted, attempt=attempt,
        )  # fmt: skip
        if ended:  # heard by the run already: a worker keeps nothing of an ended task
            self._memory.forget(record.id)
        return ended

    def succeed(self, record: Record, token: int, output: Any, agent: str) -> bool:
        # `settle` for a success with no spawn (the engine's common end), to `MemoryRun.succeed`
        # straight: not through `settle`'s keywords and checks, twice.
        if record.token == token and record.state not in TERMINAL:
            stored_json(output, record.id, agent)  # (as `settle` checks it)
        if self._named_here:  # ids given to spawns of an earlier attempt of it
            self._named_here.pop(record.id, None)
        memory = self._memory
        ended = memory.succeed(record, token, output, agent)
        if ended:
            memory.forget(record.id)
        return ended


class _Heard:
    """The listener of a worker's memory run: the run's, but every end is heard by the worker
    too, in the step that ends the task (however it ends: settled, cancelled, stopped), rather
    than read back from a stream of the run's results a turn of the loop later, one at a time."""

    __slots__ = ("_host", "_listener", "hold", "quiet", "ready", "ready_all", "room", "stalled",
                 "stop", "wake")  # fmt: skip

    def __init__(self, listener: Listener, host: Host) -> None:
        self._listener = listener
        self._host = host
        self.quiet: list[Any] | None = None  # every end is heard: none only counted
        self.ready = listener.ready
        self.ready_all = listener.ready_all
        self.wake = listener.wake
        self.stop = listener.stop
        self.hold = listener.hold
        self.room = listener.room
        self.stalled = listener.stalled

    def finished(self, record: Any) -> None:
        self._listener.finished(record)
        self._host.ended(record)


def task_of(claimed: Claim) -> Task:
    """The `Task` a worker's run admits for a claim: rebuilt from the store's row of it."""
    metadata = claimed.metadata
    return Task(
        claimed.kind,
        json_value(claimed.payload),
        id=claimed.id,
        priority=claimed.priority,
        timeout=claimed.timeout,
        critical=bool(claimed.critical),
        metadata=None if metadata is None else json_value(metadata),
    )


def _alone(task: Task) -> bool:
    """Whether `task` waits for nothing and holds no key (what `MemoryRun.admit_checked` takes)."""
    return not (task.depends_on or task.tags or task.depends_on_tags or task.key is not None)


def ending(
    result: TaskResult, spawned: Sequence[Task] | None
) -> tuple[str, str | None, str | None, str | None, Sequence[Task] | None]:
    """How a held task's end is written: its state, its output as JSON text, its error and error
    type, and its spawns (dropped with an output that cannot be stored)."""
    status = result.status
    output = None
    error, error_type = result.error, result.error_type
    if status == SUCCEEDED:
        try:
            output = stored_json(result.output, result.task_id, result.agent)
        except InvalidOutput as exc:  # checked when it settled: this is a last resort
            return FAILED, None, str(exc), "InvalidOutput", None
    elif result.output is not None:  # a rejected output, kept for the record as JSON can
        output = to_json(jsonable(result.output)).decode()
    return status, output, error, error_type, spawned


def spawn_data(task: Task, named_here: bool) -> dict[str, Any]:
    """A task an attempt spawned on a worker, as JSON data for a coordinator that names it
    (`named_here`: the id is the worker's guess, the coordinator names it again)."""
    return {
        "kind": task.kind,
        "payload": task.payload,
        "id": task.id,
        "named_here": named_here,  # the id is the worker's guess: the coordinator names it
        "priority": task.priority,
        "depends_on": list(task.depends_on),
        "depends_on_tags": list(task.depends_on_tags),
        "tags": list(task.tags),
        "key": task.key,
        "timeout": task.timeout,
        "critical": task.critical,
        "metadata": task.metadata,
    }
