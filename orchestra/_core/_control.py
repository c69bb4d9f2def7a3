"""`Control`: what a run handle does to a run while it goes on: cancel by selector, reprioritize.

A cancel is one step: the store ends the waiting tasks it selects and skips their dependents at
once, flags the running ones, which end here too (`end_flagged`), and the dispatcher cancels their
attempts. A priority change reorders a task where it waits: the store's queue, or an agent's lane.

Control made before the run had its tasks (a handle's calls while the decomposer still works) is
*standing*: applied to what is admitted at once and, while a streamed input is still arriving, to
each task as it is admitted (`admitted`, called by the run's input).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from .._result import CancelRecord
from .._task import CANCELLED, CLAIMED, RUNNING, Attempt
from ..stores._protocol import Selector

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._record import Record
    from .._task import Task
    from ..stores._protocol import RunStore
    from ._dispatch import Dispatcher
    from ._report import Report

__all__ = ("Control", "Owner")


class Owner(Protocol):
    """What the control asks of its run: its store, dispatcher and report, when it started, and
    whether its input is all in."""

    store: RunStore
    dispatcher: Dispatcher
    report: Report
    t0: float

    @property
    def input_complete(self) -> bool: ...


class Control:
    """A run handle's control of one run (see the module's docstring)."""

    __slots__ = ("_priorities", "_run", "_standing", "ending", "standing")

    def __init__(self, run: Owner) -> None:
        self._run = run
        # While a `cancel` runs: every task that ends (the run's listener appends them).
        self.ending: list[Record] | None = None
        # Cancels and priorities made before the run had its tasks, for the tasks of a streamed
        # input still to be admitted; `standing` says whether there are any.
        self._standing: list[tuple[Selector, str, dict[str, Any], CancelRecord, bool]] = []
        self._priorities: dict[str, int] = {}
        self.standing = False

    def cancel(
        self, selector: Selector, reason: str, described: dict[str, Any], *, quiet: bool = False
    ) -> CancelRecord:
        """Cancel the unfinished tasks `selector` matches, as one step: waiting ones end at once,
        running ones end now too and their attempts are cancelled through the dispatcher; their
        dependents are skipped. Returns (and records in the report) what ended."""
        run = self._run
        store = run.store
        dispatcher = run.dispatcher
        if selector.agent is not None:
            # The tasks waiting for room at the agent are bound to it: those in its lane, and the
            # ready ones it is the first choice for, wherever they wait (the store's queue, or
            # set aside by a durable store for a worker: which one depends on the run's limit
            # and the store, never on what the user meant).
            router = dispatcher.router
            agent = selector.agent
            selector = selector.holding(router.held_for(agent), router.leads(agent))
        ended = self.ending = []
        try:
            flagged = store.cancel(selector, reason, "Cancelled")
            for record in flagged:  # ended here: the cancel is done when this call returns
                self.end_flagged(record, reason, "Cancelled")
        finally:
            self.ending = None
        if flagged:
            dispatcher.cancel_attempts(flagged)
        cancelled = [r.id for r in ended if r.status == CANCELLED]
        skipped = [r.id for r in ended if r.status != CANCELLED]
        record = CancelRecord(
            at=dispatcher.now() - run.t0,
            reason=reason,
            selector=described,
            cancelled=cancelled,
            skipped=skipped,
        )
        # quiet: the caller files it (`admitted`)
        if (cancelled or skipped) and not quiet and run.report.keeps_history:
            run.report.cancellations.append(record)
        return record

    def end_flagged(self, record: Record, reason: str, error_type: str) -> None:
        """End a claimed or running task a cancel flagged, here: what its attempt still does
        (returns, raises) is refused by the store from now on. A running one ends on the agent
        it ran on ("the last one tried": a metrics label, `orchestra run`'s line), the attempt
        the cancel cut short listed last in its attempts (its error record lists every one)."""
        run = self._run
        cut = None
        if record.state == RUNNING and record.target is not None:
            start = getattr(record, "t_retry", None) if record.attempts > 1 else record.t_start
            now = run.dispatcher.now()
            if start is None:
                start = now
            cut = Attempt(
                number=record.attempts,
                agent=record.target,
                error_type=error_type,
                message=reason,
                started=start - run.t0,
                duration=max(0.0, now - start),
            )
        run.store.settle(
            record,
            record.token,
            CANCELLED,
            agent=None if cut is None else cut.agent,
            error=reason,
            error_type=error_type,
            attempt=cut,
        )

    def reprioritize(self, task_id: str, priority: int) -> bool:
        """Give a task that has not started another priority: in the store's queue, or where it
        waits for an agent's slot (claimed, in a lane). False if it does not wait."""
        store = self._run.store
        if store.reprioritize(task_id, priority):
            return True
        if store.state_of(task_id) is not CLAIMED:  # running, ended or unknown: no lane to search
            return False
        router = self._run.dispatcher.router
        lane = router.holding(task_id)  # O(tasks in lanes)
        if lane is None or not store.reprioritize(task_id, priority, claimed=True):
            return False
        router.moved(lane, task_id)
        return True

    # -- standing control: made before the run had its tasks ---------------------------------------

    def cancel_standing(self, selector: Selector, reason: str, described: dict[str, Any]) -> None:
        """A cancel made before the run had its tasks (a run handle's, deferred): applied now to
        what is admitted, and, while a streamed input is still arriving, to each task admitted
        later, as it is admitted. What it ends is one `CancelRecord`."""
        done = self.cancel(selector, reason, described)
        if not self._run.input_complete:
            filed = bool(done.cancelled or done.skipped)  # in the report already
            self._standing.append((selector, reason, described, done, filed))
            self.standing = True

    def reprioritize_standing(self, task_id: str, priority: int) -> None:
        """A `reprioritize` made before the run had its tasks: applied now, or when the task is
        admitted (a streamed input still arriving)."""
        if not self.reprioritize(task_id, priority) and not self._run.input_complete:
            self._priorities[task_id] = priority
            self.standing = True

    def admitted(self, tasks: Sequence[Task]) -> None:
        """Apply the standing cancels and priorities to tasks of a streamed input just admitted."""
        priorities = self._priorities
        if priorities:
            store = self._run.store
            for task in tasks:
                priority = priorities.pop(task.id, None)
                if priority is not None:
                    store.reprioritize(task.id, priority)
        standing = self._standing
        for i, (selector, reason, described, done, filed) in enumerate(standing):
            ids = [task.id for task in tasks]
            if selector.task_ids is not None:
                ids = [task_id for task_id in ids if task_id in selector.task_ids]
            if not ids:
                continue
            among = Selector(
                task_ids=ids,
                kind=selector.kind,
                tag=selector.tag,
                agent=selector.agent,
                priority=selector.priority,
            )
            more = self.cancel(among, reason, described, quiet=True)
            if not (more.cancelled or more.skipped):
                continue
            # The cancel's record grows in place as the input arrives (nobody else sees it before
            # the run ends): a new record per admitted task would copy every id so far, O(n^2)
            # over a streamed input.
            done.cancelled.extend(more.cancelled)
            done.skipped.extend(more.skipped)
            if not filed:
                self._run.report.cancellations.append(done)
                standing[i] = (selector, reason, described, done, True)
        self.standing = bool(standing or priorities)

    def input_closed(self) -> None:
        """The input is all in: no task is left for the standing control to meet."""
        self._standing.clear()
        self._priorities.clear()
        self.standing = False
