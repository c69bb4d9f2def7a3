"""The in-memory store: a run's tasks as plain objects in one process (the default store).

One `Record` per task (`orchestra._record`). `MemoryRun` holds the state machine of a run's tasks:
the ready queue, the timers (retries, deadlines) and every transition (claim, start, fail,
settle, cancel, ...), each a handful of attribute writes; nothing here awaits. What waits for what
(dependencies, groups, idempotency keys) is its `Graph` (`orchestra.stores._graph`), and the
checks a task passes to enter it are `GraphChecks` (`orchestra.stores._graph_checks`).
"""

from __future__ import annotations

from heapq import heappop, heappush
from typing import TYPE_CHECKING, Any

from .._gc import paused
from .._record import Record, tries_on
from .._task import (
    CANCELLED,
    CLAIMED,
    PENDING,
    READY,
    RETRY_WAIT,
    RUNNING,
    SKIPPED,
    SUCCEEDED,
    TERMINAL,
    Task,
)
from ._graph import Graph
from ._graph_checks import GraphChecks
from ._protocol import KEEP, Selector
from ._queue import ReadyQueue

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterator, Mapping, Sequence

    from .._admission import Admission
    from .._task import Attempt
    from ._protocol import Listener

__all__ = ("MemoryRun", "MemoryStore")


class MemoryStore:
    """Keeps every run's tasks in memory: fast, and gone with the process. The default store."""

    def open_run(
        self,
        run_id: str,
        *,
        admission: Admission,
        listener: Listener,
        clock: Callable[[], float],
        task_timeout: float | None,
        compact: bool,
    ) -> MemoryRun:
        return MemoryRun(run_id, admission, listener, clock, task_timeout, compact)

    def __repr__(self) -> str:
        return "MemoryStore()"


class MemoryRun:
    """One run's tasks in memory (the `RunStore` of `MemoryStore`): their states and every
    transition, over the run's `Graph`.

    Attributes:
        t0: the run's zero on its clock: a record's `started` and `finished` count from it.
    """

    resumed = 0  # nothing survives a process here: no task ever comes back from an earlier one

    def __init__(
        self,
        run_id: str,
        admission: Admission,
        listener: Listener,
        clock: Callable[[], float],
        task_timeout: float | None,
        compact: bool,
    ) -> None:
        self.run_id = run_id
        self.unfinished = 0  # admitted, not terminal
        self.pending = 0  # admitted, waiting for dependencies or groups (never ready yet)
        self._listener = listener
        self._now = clock
        self.t0 = clock()
        self._task_timeout = task_timeout
        self._compact = compact
        self._queue: ReadyQueue[Record] = ReadyQueue()
        # (time, seq, record): when a retry is due, when a task's deadline passes
        self._timers: list[tuple[float, int, Record]] = []
        self._timer_seq = 0
        # Tasks a durable store reopened (`SQLiteStore.retry`), with how many of their failures
        # came before: those do not count against an agent's attempts any more (`tries_on`).
        self._reopened: dict[Record, int] = {}
        self._cascade: list[tuple[Record, str]] = []  # what to skip next; empty between steps
        self._admission = admission
        graph = self._graph = Graph(admission, self, compact)
        self._checks = GraphChecks(graph, admission, compact)
        # Bound once, for the calls made per task: `succeed` asks whether the run has any group,
        # and `end_one` has the graph free what waited for the task.
        self._groups = graph.groups
        self._release = graph.release

    # -- admission -------------------------------------------------------------------------------

    def admit(
        self,
        tasks: Sequence[Any],
        *,
        where: str,
        forward: bool,
        first_index: int = 0,
        parent: Record | None = None,
        generated: Collection[int] = (),
    ) -> int:
        """`generated`: the tasks (by `id()`) whose ids the caller generated as admission would
        (a resumed durable run generates them again, in order): they are not given ids."""
        graph = self._graph
        # A whole-list run keeps its records to its end: they are frozen out of the GC's sight
        # (`orchestra._gc`). A streamed one forgets them as they end: its chunks are not frozen,
        # nor what the application allocated meanwhile (its garbage cycles stay collectable).
        with paused(len(tasks), keep=not self._compact):
            plain = None if parent is not None else graph.admit_plain(tasks, first_index)
            if plain is None:
                batch, unnamed = self._checks.batch(
                    tasks, where, forward, first_index, parent, generated
                )
                records = graph.insert(batch, first_index, parent, unnamed)
        if plain is not None:
            self.unfinished += len(plain)
            self._ready_all(plain)
            return len(plain)
        self.unfinished += len(records)
        self.pending += len(records)
        self._wire(records)
        return len(records)

    def admit_one(self, task: Any, index: int, *, generated: bool = False) -> None:
        """`admit` for one item of a streamed input: the same checks, without a batch's bookkeeping."""
        named = not generated and getattr(task, "id", None) is not None
        if not self._checks.one(task, index, named):
            return  # admitted before, the same task
        record = self._graph.insert_one(task, index, named)
        self.unfinished += 1
        self.pending += 1
        if task.depends_on or task.tags or task.depends_on_tags or task.key is not None:
            self._wire((record,))
        else:  # waits for nothing: the common streamed task, ready without the graph's wiring
            self.ready(record)

    def admit_checked(self, task: Task, index: int) -> Record | None:
        """`admit_one` for a task checked where it was first admitted, that waits for nothing (no
        dependency, group or key): a worker's claim, which its coordinator's run checked and its
        store kept as it was; only its payload meets this run's models (the worker's agents may
        declare their own). None, admitting nothing, when the run has a task of its id: then
        `admit_one` decides."""
        graph = self._graph
        if graph.taken(task.id):
            return None
        self._admission.check_payload(task)
        record = graph.insert_one(task, index, True)
        self.unfinished += 1
        self.pending += 1
        self.ready(record)
        return record

    def _wire(self, records: Sequence[Record]) -> None:
        """New pending records into the graph: end the ones that cannot run (something they wait
        for failed) or need not (their key's holder succeeded), ready the ones waiting for nothing."""
        skipped, reused = self._graph.wire(records)
        for record, reason in skipped:
            self._end(record, SKIPPED, None, None, reason, "DependencyFailed", False)
        for record, (output, agent) in reused:
            self._end(record, SUCCEEDED, output, agent, None, None, False)
        for record in records:
            if record.waiting == 0 and record.state is PENDING:
                self.ready(record)

    def _ready_all(self, records: list[Record]) -> None:
        """`ready` for a batch of new records that wait for nothing (marked ready already), in
        one step."""
        timeout = self._task_timeout
        if timeout is not None:
            deadline = self._now() + timeout
            timers = self._timers
            for record in records:
                record.deadline = deadline
                self._timer_seq += 1
                heappush(timers, (deadline, self._timer_seq, record))
        self._queue.push_all(records)
        self._listener.ready_all(records)

    def backpressure(self) -> None:
        """Nothing to wait for: memory keeps up."""

    def close_input(self) -> None:
        self._graph.close_input()

    def check_spawn(self, task: Task, parent: Record, pending: dict[str, Task]) -> None:
        self._checks.spawn(task, parent, pending)

    # -- dispatch --------------------------------------------------------------------------------

    def ready(self, record: Record) -> None:
        """`record` waits for nothing now (admitted so, its dependencies met, its retry due): into
        the ready queue, its deadline armed."""
        if record.state is PENDING:
            self.pending -= 1
        if record.deadline is None:
            timeout = record.task.timeout or self._task_timeout
            if timeout is not None:
                record.deadline = deadline = self._now() + timeout
                self._timer_seq += 1
                heappush(self._timers, (deadline, self._timer_seq, record))
        record.state = READY
        self._queue.push(record)
        self._listener.ready(record)

    def claim(self) -> Record | None:
        # `ReadyQueue.pop`'s common case, inline (a call is a tenth of a no-op task's dispatch):
        # the front entry of the best priority's bucket.
        queue = self._queue
        bucket = queue.front
        if bucket:
            record = bucket.popleft()
            if record.qseq >= 0:
                record.qseq = -1
                queue.size -= 1
                record.state = CLAIMED
                record.token += 1
                return record
        popped = queue.pop()
        if popped is not None:
            popped.state = CLAIMED
            popped.token += 1
        return popped

    def heartbeat(self, record: Record, token: int) -> bool:
        # One process, one owner: a lease never expires here; only its token can go stale.
        return (
            record.token == token
            and (record.state is CLAIMED or record.state is RUNNING)
            and record.cancelling is None
        )

    def start(self, record: Record, token: int, agent: str) -> bool:
        if record.token != token or record.state is not CLAIMED:
            return False
        if record.target != agent:
            record.target = agent
            record.agent_tries = (
                0
                if record.failures is None
                else tries_on(record, agent, self._reopened.get(record, 0))
            )
        record.state = RUNNING
        record.attempts += 1
        record.agent_tries += 1
        if record.t_start is None:
            record.t_start = self._now()
        else:  # a later attempt: when it started, for the record of it if a cancel cuts it short
            record.t_retry = self._now()  # (left unset until then: nothing to build per task)
        return True

    def fail(
        self,
        record: Record,
        token: int,
        attempt: Attempt,
        *,
        retry_at: float | None = None,
        next_agent: str | None = KEEP,
    ) -> bool:
        if record.token != token or record.state in TERMINAL:
            return False
        # The failed attempt's lease ends here: its holder's late or repeated writes are refused
        # (a second `fail` would queue the task twice). The next `claim` hands out a fresh token.
        record.token += 1
        failures = record.failures
        if failures is None:
            record.failures = [attempt]
        else:
            failures.append(attempt)
        if next_agent is not KEEP:  # the failed agent is used up for this task
            tried = record.tried
            if tried is None:
                record.tried = [attempt.agent]
            elif attempt.agent not in tried:
                tried.append(attempt.agent)
            record.target = next_agent
            record.agent_tries = (
                0
                if next_agent is None
                else tries_on(record, next_agent, self._reopened.get(record, 0))
            )
        if retry_at is not None:
            record.state = RETRY_WAIT
            record.due = retry_at
            self._timer_seq += 1
            heappush(self._timers, (retry_at, self._timer_seq, record))
        else:
            self.ready(record)
        return True

    def note(self, record: Record, token: int, feedback: str, *, partial: Any = KEEP) -> bool:
        if record.token != token or record.state in TERMINAL:
            return False
        if record.feedback is None:
            record.feedback = [feedback]
        else:
            record.feedback.append(feedback)
        if partial is not KEEP:
            record.output = partial
        return True

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
        state = record.state
        if record.token != token or state in TERMINAL:
            return False
        if spawned:  # first: refused spawns (`InputError`) leave the task as it was
            self.admit(
                spawned, where=f"tasks spawned by {record.id!r}", forward=False, parent=record
            )
        if attempt is not None:
            if record.failures is None:
                record.failures = [attempt]
            else:
                record.failures.append(attempt)
        if (
            status is SUCCEEDED
            and state is RUNNING
            and record.dependents is None
            and not spawned
            and not self._groups
            and not self._compact
            and error is None
            and error_type is None
            and not defaulted
        ):
            return self.succeed(record, token, output, agent)  # type: ignore[arg-type]
        self._end(record, status, output, agent, error, error_type, defaulted)
        return True

    def succeed(self, record: Record, token: int, output: Any, agent: str) -> bool:
        if (
            record.token == token
            and record.state is RUNNING
            and record.dependents is None
            and not self._groups
            and not self._compact
        ):
            # The common end, in one step: a success that readies nothing and is kept whole.
            # (`end_one` does the same and more; a call and a dozen branches cost more here than
            # the end itself.)
            t0 = self.t0
            record.state = record.status = SUCCEEDED
            record.output = output
            record.agent = agent
            t_start = record.t_start
            record.started = None if t_start is None else t_start - t0
            record.finished = self._now() - t0
            record.error = record.error_type = None
            record.defaulted = False
            self.unfinished -= 1
            quiet = self._listener.quiet
            if quiet is not None and self.unfinished:
                quiet.append(record)
            else:
                self._listener.finished(record)
            return True
        # Any other success: `settle`'s refusals and general end, without its other arguments.
        if record.token != token or record.state in TERMINAL:
            return False
        self._end(record, SUCCEEDED, output, agent, None, None, False)
        return True

    def _end(
        self,
        record: Record,
        status: str,
        output: Any,
        agent: str | None,
        error: str | None,
        error_type: str | None,
        defaulted: bool,
    ) -> None:
        """Put `record` in a terminal state, then skip what can no longer run because of it."""
        cascade = self._cascade
        while True:
            if record.state not in TERMINAL:
                self.end_one(record, status, output, agent, error, error_type, defaulted, cascade)
            if not cascade:
                return
            record, error = cascade.pop()
            status, output, agent, error_type, defaulted = (
                SKIPPED,
                None,
                None,
                "DependencyFailed",
                False,
            )

    def end_one(
        self,
        record: Record,
        status: str,
        output: Any,
        agent: str | None,
        error: str | None,
        error_type: str | None,
        defaulted: bool,
        cascade: list[tuple[Record, str]],
    ) -> None:
        """Put `record` in a terminal state and tell the listener; then the graph frees what
        waited for it, putting what can no longer run on `cascade` (`_end` skips those)."""
        if record.state is READY:
            self._queue.discard(record)
        elif record.state is PENDING:
            self.pending -= 1
        record.state = status
        end = self._now()
        t0 = self.t0
        record.status = status  # type: ignore[assignment]
        if status is SUCCEEDED:
            record.output = output
        record.agent = agent
        record.started = None if record.t_start is None else record.t_start - t0
        record.finished = end - t0
        record.error = error
        record.error_type = error_type
        record.defaulted = defaulted
        self.unfinished -= 1
        # Heard before what it readies or skips: a listener hears causes before effects.
        self._listener.finished(record)
        self._release(record, status, cascade)

    def cancel(
        self, selector: Selector, reason: str, error_type: str = "Cancelled"
    ) -> list[Record]:
        running = []
        candidates = self._graph.candidates(selector)
        for record in candidates:
            if record.state not in TERMINAL and selector.matches(record):
                if record.state is RUNNING or record.state is CLAIMED:
                    record.cancelling = reason
                    running.append(record)
                else:
                    self._end(record, CANCELLED, None, None, reason, error_type, False)
        return running

    def due(self, now: float) -> list[Record]:
        timers = self._timers
        expired = []
        while timers and timers[0][0] <= now:
            when, _, record = heappop(timers)
            if record.state in TERMINAL:
                continue
            if record.state is RETRY_WAIT and record.due == when:
                record.due = None
                self.ready(record)
            elif record.deadline == when:
                expired.append(record)
        return expired

    def next_due(self) -> float | None:
        timers = self._timers
        while timers:
            when, _, record = timers[0]
            if record.state not in TERMINAL and (record.due == when or record.deadline == when):
                return when
            heappop(timers)
        return None

    # -- reading ---------------------------------------------------------------------------------

    def deps_of(self, record: Record) -> dict[str, Any]:
        return self._graph.deps_of(record)

    def results(self) -> Iterator[Record]:
        return self._graph.results()

    def state_of(self, task_id: str) -> str | None:
        return self._graph.state_of(task_id)

    def queue_depths(self) -> dict[int, int]:
        """Ready tasks by priority (for the run's status): O(priority levels)."""
        return self._queue.depths()

    def reprioritize(self, task_id: str, priority: int, *, claimed: bool = False) -> bool:
        record = self._graph.record_of(task_id)
        if record is None or record.state in TERMINAL:
            return False
        if record.state is READY:
            self._queue.move(record, priority)
            return True
        if (
            record.state is PENDING
            or record.state is RETRY_WAIT
            or (claimed and record.state is CLAIMED)
        ):
            record.priority = priority
            return True
        return False

    def close(self) -> None:
        """The run is over: nothing to write down in memory."""

    # -- for a store that keeps its state here (SQLiteStore, a worker's run) ---------------------

    def record_of(self, task_id: str) -> Record | None:
        """The record of `task_id`, if the run holds it (not compacted away)."""
        return self._graph.record_of(task_id)

    @property
    def by_id(self) -> Mapping[str, Record]:
        """The records the run holds, by id (not compacted away): for a caller that looks up
        ids by the thousand (a coordinator hearing a batch of ends), one `get` each instead of
        `record_of`'s two calls. Read it, never change it."""
        return self._graph.records

    def records(self) -> Collection[Record]:
        """Every record the run holds (not compacted away), in admission order."""
        return self._graph.records.values()

    def holds_key(self, record: Record) -> bool:
        """Whether `record` holds its key in this run (it runs; the others with it follow)."""
        return self._graph.holds_key(record)

    def took_key(self, record: Record) -> bool:
        """Whether `record` took its key over at its admission from another task of the run (see
        `Graph.took_key`)."""
        return self._graph.took_key(record)

    def take(self, record: Record) -> int:
        """Claim this very task (a durable store's: a process that shares the run holds it);
        returns its new token."""
        if record.state is READY:
            self._queue.discard(record)
        elif record.state is PENDING:
            self.pending -= 1
        record.state = CLAIMED
        record.token += 1
        return record.token

    def succeeded_elsewhere(self, ended: Sequence[tuple[Record, Any, str | None]]) -> None:
        """Successes another process wrote (a durable store's worker held the tasks), as
        (record, output, agent), in the order they were written: each task taken (`take`) and
        ended as `settle` ends a success; one ended here meanwhile (a follower of a key ended
        with its holder's success, earlier in the batch) is left as it is. The end a coordinator
        hears most, a batch at a time: the common one, with nothing waiting for it, in a few
        writes (as `succeed`)."""
        queue = self._queue
        listener = self._listener
        # Where the run only counts a plain success (`Listener.quiet`), as `succeed` puts one:
        # a started one (the run counts those in a batch), all but the one that ends the run.
        quiet = listener.quiet
        t0 = self.t0
        finished = self._now() - t0  # (heard at once: one time for the batch)
        general = bool(self._groups) or self._compact
        for record, output, agent in ended:
            state = record.state
            if state in TERMINAL:
                continue
            record.token += 1
            if general or record.dependents is not None:
                self._end(record, SUCCEEDED, output, agent, None, None, False)
                continue
            if state is READY:
                queue.discard(record)
            elif state is PENDING:
                self.pending -= 1
            record.state = record.status = SUCCEEDED
            record.output = output
            record.agent = agent
            t_start = record.t_start
            record.finished = finished
            record.error = record.error_type = None
            record.defaulted = False
            self.unfinished -= 1
            if t_start is None:
                record.started = None
            else:
                record.started = t_start - t0
                if quiet is not None and self.unfinished:
                    quiet.append(record)
                    continue
            listener.finished(record)

    def forget(self, task_id: str) -> None:
        """Keep nothing of `task_id` if it ended (a worker's run: the file keeps it)."""
        self._graph.forget(task_id)

    def forget_key(self, key: str) -> None:
        """The next task admitted with `key` holds it, whatever task held it here before."""
        self._graph.forget_key(key)

    def restore(self, records: Sequence[Record], took_keys: Collection[str] = ()) -> None:
        """Take back the records a durable store kept, in admission order (a spawner before its
        spawns): ended ones as they ended, the others waiting again (a claimed or running one lost
        its process and runs again, its attempts counted) and ready at once when what they wait for
        is done. The listener hears the ones made ready, not the ended ones. `took_keys`: the ids
        of the tasks that took their key over at admission (`took_key`)."""
        for record in records:
            if record.target is None and record.agent_tries:
                # Reopened: a durable store keeps, in an agent_tries with no agent, how many
                # failures came before (see `tries_on`).
                self._reopened[record] = record.agent_tries
                record.agent_tries = 0
        live = self._graph.restore(records, took_keys)
        self.unfinished += len(live)
        self.pending += len(live)
        self._wire(live)

    def restore_ended(self, records: Sequence[Record]) -> None:
        """Take back stored records that ended (`restore`'s ended ones) as a streamed run keeps
        the tasks that end in it: a succeeded one compacted away (`Graph.restore_ended`)."""
        self._graph.restore_ended(records)
