"""The Store: where a run's tasks live, and the one place where their state changes.

Every task transition goes through a `RunStore`; the dispatcher only chooses (which task, which
agent, retry or fall back) and tells the store what it chose. The in-memory store
(`orchestra.stores.MemoryStore`, the default) is synchronous and allocation-light, because it sits on
the hot path; a durable store (SQLite) implements the same protocol, so there is one run loop
for both.

A task's life in a store::

    pending ─▶ ready ─▶ claimed ─▶ running ─▶ succeeded | failed | cancelled | skipped
                 ▲          │           │
                 └──────────┴─ retry_wait (due at a time) ◀─┘   (fail with `retry_at`)

- **Leases and fencing.** `claim` hands out the best ready task with a fresh lease token
  (`record.token`). Every later write about that attempt (`start`, `fail`, `settle`) carries the
  token and is refused (returns False) once the task was re-leased, handed back by an accepted
  `fail`, or ended, so a worker that wakes late never overwrites a newer attempt. The in-memory store has one owner and no expiry, so its
  leases never expire; the token check still holds.
- **Time.** A store reads the run's clock (`clock`, the event loop's: virtual under a
  `FakeClock`) and takes every time (a retry's due time, a task's deadline) on it. What must
  survive a process is never kept as a loop time: a durable store converts at its boundary
  (`Clock.to_wall` when it writes a due time, deadline or lease, `Clock.to_loop` when it reads
  one), and the in-memory store, which survives nothing, keeps loop times as they are. (Taking wall
  time on the hot path instead would cost a conversion per transition and, at epoch magnitudes,
  round away the sub-microsecond order that makes a seeded run replay exactly.)
- **One step.** `settle` ends a task together with what its attempt spawned and the dependents and
  groups it makes ready (or skips): the store tells its `Listener` about each task that became
  ready or terminal, in order.
- **Agents by name.** A task's next agent (`record.target`) is an agent's name or None (any agent of
  its kind).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, Protocol

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable, Sequence

    from .._admission import Admission
    from .._task import Attempt, Task, TaskResult

__all__ = ("KEEP", "Listener", "RunStore", "Selector", "Store", "StoredTask")

KEEP: Final[Any] = object()
"""`fail(..., next_agent=KEEP)`: the task stays with the agent it has."""


class StoredTask(Protocol):
    """What a store hands the dispatcher for one task (the in-memory store's record is one)."""

    task: Task
    id: str
    kind: str
    priority: int
    state: str
    token: int
    target: str | None  # the agent it goes to next, or None: any agent of its kind
    tried: list[str] | None  # agents whose attempts it used up
    attempts: int  # every attempt so far, on every agent
    agent_tries: int  # attempts on its current agent (with none: failures before a reopen)
    deadline: float | None
    feedback: list[str] | None
    failures: list[Attempt] | None
    output: Any
    cancelling: str | None  # why its running attempt is being cancelled


class Listener(Protocol):
    """What the run hears from its store (called synchronously, inside the store's step)."""

    @property
    def quiet(self) -> list[Any] | None:
        """Where a store may put a plain success (ended by `succeed`, readying nothing) instead
        of calling `finished`, while it is not None — except the success that leaves nothing
        unfinished, which is always heard. The run sets it when all it does with such a success
        is count it later (the in-memory store's no-op task costs a call less); a store that
        must see each end itself (a durable one) may ignore it."""

    def ready(self, record: Any) -> None:
        """A task became ready (admitted with nothing to wait for, dependencies met, retry due)."""

    def ready_all(self, records: Sequence[Any]) -> None:
        """`ready` for a batch admitted at once (in order): one call instead of one per task."""

    def finished(self, record: Any) -> None:
        """A task became terminal; `record` is its `TaskResult`."""

    def wake(self) -> None:
        """A task the store held back (ready before, heard then) can be claimed now."""

    def stop(self, reason: str) -> None:
        """The store cannot go on (its file failed): end the run now; the store's `close` then
        raises what went wrong."""

    def hold(self, held: bool) -> None:
        """The store's writes are behind the run (True: a durable store's writer thread): start
        no new attempt until it says they caught up (False). Attempts running go on."""


class Selector:
    """Which tasks a `cancel` means: every field given must match (none given: every task).

    Args:
        task_ids: these ids.
        kind: tasks of this kind.
        tag: tasks carrying this tag.
        agent: tasks whose current (or running) agent is this one, and the ids in `held`.
        priority: an inclusive range ``(low, high)`` of priorities.
        held: with `agent`, the claimed tasks waiting for room at that agent (in its lane): bound
            to it although it never ran them. The run fills it in (`Selector.holding`).
    """

    __slots__ = ("agent", "held", "kind", "priority", "tag", "task_ids")

    def __init__(
        self,
        *,
        task_ids: Iterable[str] | None = None,
        kind: str | None = None,
        tag: str | None = None,
        agent: str | None = None,
        priority: tuple[int, int] | None = None,
        held: Iterable[str] = (),
    ) -> None:
        self.task_ids = None if task_ids is None else frozenset(task_ids)
        self.kind = kind
        self.tag = tag
        self.agent = agent
        self.priority = priority
        self.held = frozenset(held)

    def holding(self, held: Iterable[str]) -> Selector:
        """This selector, its `agent` also matching the tasks `held` for it."""
        return Selector(
            task_ids=self.task_ids,
            kind=self.kind,
            tag=self.tag,
            agent=self.agent,
            priority=self.priority,
            held=held,
        )

    def matches(self, record: StoredTask, running_agent: str | None = None) -> bool:
        if self.task_ids is not None and record.id not in self.task_ids:
            return False
        if self.kind is not None and record.kind != self.kind:
            return False
        if self.tag is not None and self.tag not in record.task.tags:
            return False
        if (
            self.agent is not None
            and self.agent not in (record.target, running_agent)
            and record.id not in self.held
        ):
            return False
        if self.priority is not None:
            low, high = self.priority
            if not low <= record.priority <= high:
                return False
        return True


class RunStore(Protocol):
    """The tasks of one run and every transition of their state."""

    run_id: str

    @property
    def unfinished(self) -> int:
        """Admitted tasks not yet terminal."""

    @property
    def pending(self) -> int:
        """Admitted tasks waiting for dependencies or groups (never ready yet)."""

    @property
    def resumed(self) -> int:
        """Tasks that had ended in an earlier process (a durable store's resumed run)."""

    # -- admission
    def admit_one(self, task: Any, index: int) -> None:
        """`admit` for one item of a streamed input."""

    def admit(
        self,
        tasks: Sequence[Any],
        *,
        where: str,
        forward: bool,
        first_index: int = 0,
    ) -> int:
        """Check and admit a batch, all or nothing; returns how many tasks are new. Idempotent by id
        (a task already admitted, identical, is not admitted again) and by `key`. With `forward`,
        tasks may depend on later tasks of the same batch (a whole list); else only on tasks
        admitted before (a streamed input)."""

    def close_input(self) -> None:
        """No more input will come: groups whose members are all done can close."""

    def backpressure(self) -> Awaitable[None] | None:
        """What a streamed input waits for before more is admitted (a durable store whose writes
        are behind the run), or None: admit now."""

    def check_spawn(self, task: Task, parent: Any, pending: dict[str, Task]) -> None:
        """Check a task an attempt spawns (admitted later, by `settle`); raises `InputError`."""

    # -- dispatch
    def claim(self) -> Any:
        """The best ready task, leased under a fresh token (None when nothing is ready)."""

    def heartbeat(self, record: Any, token: int) -> bool:
        """The lease holder is alive: extend its lease. False when the lease went stale (re-leased,
        handed back, ended, or cancelled: `record.cancelling`), so the holder stops."""

    def start(self, record: Any, token: int, agent: str) -> bool:
        """The claimed task's attempt starts now on `agent` (which becomes its target): count it."""

    def fail(
        self,
        record: Any,
        token: int,
        attempt: Attempt,
        *,
        retry_at: float | None = None,
        next_agent: str | None = KEEP,
    ) -> bool:
        """Record a failed attempt and the next step: ready again at `retry_at`, on the
        same agent or, with `next_agent`, on that one (None: any agent of the kind not used up);
        the agent that failed is then used up for this task. Refused with a stale token."""

    def note(self, record: Any, token: int, feedback: str, *, partial: Any = KEEP) -> bool:
        """What went wrong in the current attempt, for the next one (`ctx.feedback`); with
        `partial`, the rejected output kept if the task fails in the end."""

    def settle(
        self,
        record: Any,
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
        """End a task (with the tasks its attempt spawned, and the dependents and groups this makes
        ready or skips), as one step; `attempt` is the failed attempt that ended it, if one did.
        Refused (False) with a stale token or an ended task. A store that persists outputs raises
        `InvalidOutput` for a success whose output it cannot keep, before any change: the
        attempt that returned it fails (the memory store keeps every output as it is)."""

    def succeed(self, record: Any, token: int, output: Any, agent: str) -> bool:
        """`settle(record, token, "succeeded", output, agent=agent)`: the common end of an attempt
        (nothing spawned), in the one call the hot path makes per task. Same refusals."""

    def cancel(self, selector: Selector, reason: str, error_type: str = "Cancelled") -> list[Any]:
        """Cancel the matching unfinished tasks that are not running (their dependents are
        skipped); the running ones are flagged (`record.cancelling`) and returned, for their owner
        to cancel."""

    def due(self, now: float) -> list[Any]:
        """Make the retries due by `now` ready; return the unfinished tasks whose
        deadline passed, for the dispatcher to end (a default value or a failure)."""

    def next_due(self) -> float | None:
        """The time of the next retry or deadline, if any."""

    # -- reading
    def deps_of(self, record: Any) -> dict[str, Any]: ...
    def results(self) -> Iterable[TaskResult]:
        """The results of the tasks the store still holds (to rebuild or count the aggregate)."""

    def state_of(self, task_id: str) -> str | None: ...
    def reprioritize(self, task_id: str, priority: int, *, claimed: bool = False) -> bool:
        """Give a task that has not started another priority; False if it is not waiting. With
        `claimed`, a claimed task too: the caller holds it waiting (for an agent's slot) and puts
        it in its new place there."""

    # -- the end
    def close(self) -> None:
        """The run is over (however it ended): a durable store writes down what it still holds and
        returns once it is durable; raises `StoreError` if it cannot."""


class Store(Protocol):
    """Where runs keep their tasks: `open_run` gives one run's `RunStore`."""

    def open_run(
        self,
        run_id: str,
        *,
        admission: Admission,
        listener: Listener,
        clock: Callable[[], float],
        task_timeout: float | None,
        compact: bool,
    ) -> RunStore: ...
