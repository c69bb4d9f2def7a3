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
  `fail`, or ended, so a lease holder that wakes late never overwrites a newer attempt. The
  in-memory store has one owner and no expiry, so its leases never expire; the token check still
  holds.
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

from .._task import READY

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable, Sequence

    from .._admission import Admission
    from .._task import Attempt, Task, TaskResult

__all__ = ("KEEP", "Listener", "NoListener", "RunStore", "Selector", "Store", "StoredTask")

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

    def room(self, kind: str, *, hold: bool = True) -> int:
        """How many more tasks of `kind` the run's agents could start now (their free places
        under their own limits and the global one, less the tasks already waiting for them). A
        store that shares the run with other processes claims no more than that: the rest stays
        claimable by a process with room. With `hold`, it also counts a task to hold while an
        agent waits: for a rate to refill (one, when none waits yet) or for its breaker's probe
        (no bound: they wait for it, charged an attempt when it fails); the coordinator's claims,
        whose run such a task wakes. Without, only what can start now: a worker's, which looks
        again by itself."""

    def stalled(self, longer_than: float) -> list[str]:
        """The ids of the claimed tasks that wait for their agent to recover or for its limits to
        refill (a rate, a Retry-After pause) for more than `longer_than` seconds: a worker hands
        them back to its shared store, for a process that can start them sooner."""


class NoListener:
    """A listener that hears nothing: for a run store driven without a run around it (a scratch
    store that only checks tasks, a test that calls the transitions by hand). Its `room` has no
    bound: nothing of its own fills it."""

    quiet: list[Any] | None = None

    def ready(self, record: Any) -> None:
        pass

    def ready_all(self, records: Sequence[Any]) -> None:
        pass

    def finished(self, record: Any) -> None:
        pass

    def wake(self) -> None:
        pass

    def stop(self, reason: str) -> None:
        pass

    def hold(self, held: bool) -> None:
        pass

    def room(self, kind: str, *, hold: bool = True) -> int:
        return 1 << 30

    def stalled(self, longer_than: float) -> list[str]:
        return []


class Selector:
    """Which tasks a `cancel` means: every field given must match (none given: every task).

    Args:
        task_ids: these ids.
        kind: tasks of this kind.
        tag: tasks carrying this tag.
        agent: tasks bound to this agent: running on it, its next attempt's (a retry, a
            fallback: `target`), or, among those not bound yet, the ids in `held` and the ready
            ones of the kinds in `leads`.
        priority: an inclusive range ``(low, high)`` of priorities.
        held: with `agent`, the claimed tasks waiting for room at that agent (in its lane): bound
            to it although it never ran them. The run fills it in (`Selector.holding`).
        leads: with `agent`, the kinds whose tasks go to that agent first (its only agent, the
            head of its fallback chain): a ready task of one, bound to no agent yet, waits for
            room at it whether a runner has claimed it yet or not (or a durable store set it
            aside for a worker), so it matches too. The run fills it in (`Selector.holding`).
    """

    __slots__ = ("agent", "held", "kind", "leads", "priority", "tag", "task_ids")

    def __init__(
        self,
        *,
        task_ids: Iterable[str] | None = None,
        kind: str | None = None,
        tag: str | None = None,
        agent: str | None = None,
        priority: tuple[int, int] | None = None,
        held: Iterable[str] = (),
        leads: Iterable[str] = (),
    ) -> None:
        self.task_ids = None if task_ids is None else frozenset(task_ids)
        self.kind = kind
        self.tag = tag
        self.agent = agent
        self.priority = priority
        self.held = frozenset(held)
        self.leads = frozenset(leads)

    def holding(self, held: Iterable[str], leads: Iterable[str] = ()) -> Selector:
        """This selector, its `agent` also matching the tasks `held` for it and the ready tasks
        of the kinds it `leads`."""
        return Selector(
            task_ids=self.task_ids,
            kind=self.kind,
            tag=self.tag,
            agent=self.agent,
            priority=self.priority,
            held=held,
            leads=leads,
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
            and not (record.state == READY and record.target is None and record.kind in self.leads)
        ):
            return False
        if self.priority is not None:
            low, high = self.priority
            if not low <= record.priority <= high:
                return False
        return True


class RunStore(Protocol):
    """The tasks of one run, and every change of their state: what `Store.open_run` returns.

    The run calls it on the event loop's thread, synchronously (a method that must wait for I/O
    queues the write and says so through `backpressure` and `Listener.hold`); every change it
    makes is told to the run's `Listener` before the call returns. A task is handed around as
    the store's record of it (a `StoredTask`), which becomes the task's `TaskResult` when it ends.

    Every write about an attempt carries the lease token `claim` gave (`record.token`), and is
    refused (returns False, changes nothing) when the token is stale: the task was claimed
    again, handed back by `fail`, or ended.

    Attributes:
        run_id: the run's id.
    """

    run_id: str

    @property
    def unfinished(self) -> int:
        """Admitted tasks not yet terminal."""

    @property
    def pending(self) -> int:
        """Admitted tasks waiting for dependencies or groups (never ready yet)."""

    @property
    def resumed(self) -> int:
        """Tasks that had ended in an earlier process (a durable store's resumed run); 0 for a
        store that keeps nothing across processes."""

    # -- admission
    def admit(
        self,
        tasks: Sequence[Any],
        *,
        where: str,
        forward: bool,
        first_index: int = 0,
    ) -> int:
        """Check and admit a batch of tasks, all or nothing.

        Each task is checked with the run's `Admission` (its own fields; a task without an id
        is given one) and against the run (unique ids, known dependencies, no cycle, open
        groups); a task that waits for nothing is ready at once (`Listener.ready_all`).

        Args:
            tasks: the batch, in input order.
            where: where the batch came from, for the error messages ("tasks", "input item").
            forward: whether a task may depend on a later task of the batch (a whole list), or
                only on tasks admitted before it (a streamed input).
            first_index: the input index of the batch's first task.

        Returns:
            How many tasks are new: a task admitted before, identical, is not admitted again
                (idempotent by id); one whose `key` another task of the run holds follows it.

        Raises:
            InputError: a task is refused (naming it and the field); nothing was admitted.
        """

    def admit_one(self, task: Any, index: int) -> None:
        """`admit` for one item of a streamed input (it may only depend on tasks before it)."""

    def close_input(self) -> None:
        """No more input will come: a group whose members are all done can close."""

    def backpressure(self) -> Awaitable[None] | None:
        """What a streamed input waits for before more is admitted (a durable store whose writes
        are behind the run), or None: admit now."""

    def check_spawn(self, task: Task, parent: Any, pending: dict[str, Task]) -> None:
        """Check a task an attempt of `parent` spawns (`ctx.spawn`), before the attempt ends; it
        is admitted by `settle`. `pending`: the attempt's earlier spawns, by id. A task without
        an id is given one named after its parent (``<parent id>/<kind>#<n>``).

        Raises:
            InputError: the task is refused, naming it and the field.
        """

    # -- dispatch
    def claim(self) -> Any:
        """The best ready task (smallest priority, then first ready), leased to the caller under
        a fresh token; None when no task is ready."""

    def heartbeat(self, record: Any, token: int) -> bool:
        """The lease holder is alive: extend its lease. False when the lease went stale (claimed
        again, handed back, ended, or being cancelled: `record.cancelling`): the holder stops."""

    def start(self, record: Any, token: int, agent: str) -> bool:
        """The claimed task's attempt starts now on `agent`, which becomes its target: count the
        attempt (in all, and on that agent). False with a stale token."""

    def fail(
        self,
        record: Any,
        token: int,
        attempt: Attempt,
        *,
        retry_at: float | None = None,
        next_agent: str | None = KEEP,
    ) -> bool:
        """Record a failed attempt and the task's next step; the lease ends (a fresh token at the
        next `claim`).

        Args:
            record, token: the task, and the lease its attempt ran under.
            attempt: the failed attempt, kept in `record.failures`.
            retry_at: when the task is ready again (on the run's clock); None: at once.
            next_agent: the agent it goes to next (None: any agent of its kind that it has not
                used up), the failed agent then used up for this task; `KEEP`: the same agent.

        Returns:
            False, changing nothing, with a stale token or an ended task.
        """

    def note(self, record: Any, token: int, feedback: str, *, partial: Any = KEEP) -> bool:
        """What went wrong in the current attempt, for the next one (`ctx.feedback`); with
        `partial`, the rejected output kept if the task fails in the end. False with a stale
        token."""

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
        """End a task, in one step with what follows from it: the tasks its attempt spawned are
        admitted, its dependents and groups made ready (or skipped when it did not succeed), and
        the listener hears each change, causes before effects.

        Args:
            record, token: the task, and the lease its attempt ran under.
            status: its terminal status ("succeeded", "failed", "cancelled" or "skipped").
            output: what it returned (or a default, with `defaulted`).
            spawned: the tasks its attempt spawned (checked by `check_spawn`).
            agent: the agent that ended it, if one did.
            error, error_type: why it did not succeed.
            defaulted: the output is the kind's default value, not an agent's.
            attempt: the failed attempt that ended it, if one did.

        Returns:
            False, changing nothing, with a stale token or an ended task.

        Raises:
            InvalidOutput: a store that persists outputs cannot keep this one (before any
                change: the attempt that returned it fails). The memory store keeps every
                output as it is.
            InputError: a spawned task is refused (the task is left as it was).
        """

    def succeed(self, record: Any, token: int, output: Any, agent: str) -> bool:
        """`settle(record, token, "succeeded", output, agent=agent)`: the common end of an
        attempt, in the one call the hot path makes per task. Same refusals."""

    def cancel(self, selector: Selector, reason: str, error_type: str = "Cancelled") -> list[Any]:
        """Cancel the unfinished tasks `selector` matches: the ones not running end cancelled
        (with `reason` and `error_type`; their dependents are skipped); the running or claimed
        ones are flagged (`record.cancelling`) and returned, for their lease holder to cancel."""

    def due(self, now: float) -> list[Any]:
        """Make the retries due by `now` ready; return the unfinished tasks whose deadline
        passed by then, for the run to end (with a default value, or failed)."""

    def next_due(self) -> float | None:
        """The time of the next retry or deadline, if any (the run's timer sleeps until it)."""

    # -- reading
    def deps_of(self, record: Any) -> dict[str, Any]:
        """The outputs of what the task waited for, by task id: its dependencies and the members
        of the groups it waited for (`ctx.deps`)."""

    def results(self) -> Iterable[TaskResult]:
        """The records the store still holds, in input order (a spawned task right after its
        spawner): to rebuild or count the aggregate."""

    def state_of(self, task_id: str) -> str | None:
        """The task's state ("pending", "ready", "claimed", "running", "retry_wait" or a
        terminal status); None for an id the run does not have."""

    def reprioritize(self, task_id: str, priority: int, *, claimed: bool = False) -> bool:
        """Give a task that has not started another priority; False if it is not waiting. With
        `claimed`, a claimed task too: the caller holds it waiting (for an agent's slot) and puts
        it in its new place there."""

    # -- the end
    def close(self) -> None:
        """The run is over (however it ended): a durable store writes down what it still holds
        and returns once it is durable.

        Raises:
            StoreError: it could not.
        """


class Store(Protocol):
    """Where runs keep their tasks: `Orchestrator(store=...)`. `MemoryStore` (the default) and
    `SQLiteStore` ship with orchestra; a store of your own implements this and `RunStore`. The
    repository's contract tests (`tests/test_store_contract.py`) drive any store through the
    protocol: one line there adds yours.

    Optional: ``async def prepare_run(self, run_id: str) -> None``, awaited before `open_run`
    when a store defines it: a store whose run another process may hold waits there until it
    may open it (`PostgresStore` waits as a standby for the run's coordinator to let go)."""

    def open_run(
        self,
        run_id: str,
        *,
        admission: Admission,
        listener: Listener,
        clock: Callable[[], float],
        task_timeout: float | None,
        compact: bool,
    ) -> RunStore:
        """Open one run's store (a durable store resumes the run if it holds `run_id`).

        Args:
            run_id: the run's id.
            admission: the run's checks of a task's own fields (`Admission.check`), the kinds
                its agents serve and the payload models they declare.
            listener: the run, told of every task made ready or ended (`Listener`).
            clock: the run's clock (the event loop's time; virtual under a `FakeClock`): due
                times and deadlines are taken on it.
            task_timeout: the default per-task timeout, in seconds (None: none).
            compact: whether the run is streamed: a succeeded task may then be forgotten but
                its output (memory stays flat however long the input).
        """
