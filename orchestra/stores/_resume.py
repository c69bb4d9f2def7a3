"""A durable run resumed: the rows an earlier process left, taken back into the run's memory run.

Both durable stores resume this way (SQLite's `_sqlite/_run.py`, PostgreSQL's coordinator,
`_postgres/_run.py`); each reads its own rows (`Reader`). Opening a run id the store knows loads
its rows: ended tasks come back
as they ended (outputs as JSON values), the others wait again (claimed or running ones lost their
worker and run again, their attempts counted; a retry waiting for its due time is ready at once; a
task's timeout starts again). The run hears the ended ones (`finished`) when the input is admitted
again, so the aggregate and the report are those of an uninterrupted run. Re-admitted input is
matched by id (generated ids are generated again in the same order): the same task takes its place
(the agent gets the caller's payload object again), a different one is refused with `InputError`.
A streamed PostgreSQL run whose tasks stand alone reads its ended rows ahead of that input, a chunk
at a time, instead of all at once (`Resume`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Protocol

from pydantic_core import PydanticSerializationError, to_json

from .._exceptions import InputError
from .._task import TERMINAL, Task

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from .._admission import Admission
    from .._record import Record
    from .._task import Attempt
    from ._memory import MemoryRun
    from ._protocol import Listener

__all__ = ("Reader", "Remote", "Resume")


class Reader(Protocol):
    """How a store's rows become records (`_sqlite/_rows.py`, `_postgres/_rows.py`)."""

    def failures(self, attempt_rows: list[Any]) -> dict[str, list[Attempt]]:
        """The failed attempts of the stored tasks, by task id, in order."""
        ...

    def record(
        self, row: Any, stored: dict[str, tuple[Record, str]], failures: dict[str, list[Attempt]]
    ) -> Record:
        """The record of a task row (`stored`: id -> (record, payload JSON), filled in)."""
        ...

    def took_key(self, row: Any) -> bool:
        """Whether the row's task took its key over at admission (`MemoryRun.took_key`)."""
        ...


class Remote(Protocol):
    """What other processes hold or completed of a resumed run (SQLite's `Sharing`)."""

    def resume(self, records: Sequence[Record], rows: Sequence[Any]) -> int: ...


class Resume:
    """What an earlier process left of one run, and the input admitted again matched against it.

    Read whole (`loaded` every row), or, for a streamed run whose tasks stand alone (no
    dependency, group, key or spawn: `ahead` given), its unfinished tasks at once and its ended
    ones a chunk at a time as the input comes again: a chunk is read when the input reaches the
    index of the last row read, its tasks heard as ended and kept as the run keeps a task that
    ended in it (a succeeded one compacted away), each stored row let go of once its input item
    came again. What the run holds stays a chunk, not the run, and it starts at once."""

    __slots__ = (
        "_admission", "_ahead", "_frontier", "_lazy", "_listener", "_loaded", "_memory", "_next",
        "_rows", "ended",
        "run_id", "stored",
    )  # fmt: skip

    def __init__(
        self,
        run_id: str,
        admission: Admission,
        rows: Reader,
        loaded: tuple[list[Any], list[Any]] | None,
        ahead: Callable[[], tuple[list[Any], list[Any], int | None]] | None = None,
    ) -> None:
        self.run_id = run_id
        self._admission = admission
        self._rows = rows
        self._loaded = loaded  # (task rows, attempt rows) until they are taken back; None: none
        # The next chunk of the ended tasks' rows in input order: (task rows, their failed
        # attempts' rows, the index of the last row, or None once no row is left). None: every
        # row was in `loaded`, or all of them are read.
        self._ahead = ahead
        self._lazy = ahead is not None
        self._frontier = -1  # the index of the last row `ahead` gave: every one before is read
        self._next = 0  # the index of the next input item
        self._memory: MemoryRun | None = None
        self._listener: Listener | None = None
        self.ended = 0  # the stored tasks that had ended, heard so far
        # The tasks the file held, once taken back: id -> (record, payload JSON). Read ahead,
        # an ended task's entry goes once its input item came again.
        self.stored: dict[str, tuple[Record, str]] = {}

    def take_back(self, memory: MemoryRun, listener: Listener, sharing: Remote) -> int:
        """Take back what the earlier process left (once, when the input starts coming, as the run
        is ready to hear it): the records restored in `memory`, the ended ones heard by
        `listener`, what worker processes hold or completed handed to `sharing`. Returns how many
        tasks came back ended (0 after the first call, or for a new run)."""
        if self._loaded is None:
            return 0
        rows, attempt_rows = self._loaded
        self._loaded = None
        self._memory = memory
        self._listener = listener
        failures = self._rows.failures(attempt_rows)
        stored: dict[str, tuple[Record, str]] = {}
        records = [self._rows.record(row, stored, failures) for row in rows]
        self.stored = stored
        admission = self._admission
        for record in records:
            if record.state not in TERMINAL and record.kind in admission.kinds:
                admission.check(record.task, "stored task", None, lambda _: False)  # its model
        took_keys = [
            record.id for record, row in zip(records, rows, strict=True) if self._rows.took_key(row)
        ]
        memory.restore(records, took_keys)
        ended = [r for r in records if r.state in TERMINAL]
        for record in ended:
            listener.finished(record)
        self.ended += len(ended)
        return len(ended) + sharing.resume(records, rows)

    def read_up_to(self, last: float) -> None:
        """Read the stored ended tasks ahead (`ahead`) until every one with an index up to
        `last` is read (`math.inf`: all of them): each heard as ended, kept as the run keeps a
        task that ended in it (`MemoryRun.restore_ended`). Before input with those indices is
        matched: a stored task must be known when its item comes again."""
        ahead = self._ahead
        memory = self._memory
        listener = self._listener
        if ahead is None or memory is None or listener is None:
            return
        rows = self._rows
        stored = self.stored
        while self._frontier <= last:
            chunk, attempt_rows, frontier = ahead()
            if frontier is None:
                self._ahead = None  # read out: the run may end as the last of them is heard
            failures = rows.failures(attempt_rows)
            records = [rows.record(row, stored, failures) for row in chunk]
            memory.restore_ended(records)
            self.ended += len(records)
            for record in records:
                listener.finished(record)
            if frontier is None:
                return
            self._frontier = frontier

    def wants(self, margin: int) -> bool:
        """Whether the next chunk read ahead is due: the input is within `margin` items of the
        last row read (the store may read it while the input waits, not as it is admitted)."""
        return (
            self._ahead is not None
            and self._memory is not None
            and self._frontier < self._next + margin
        )

    def _let_go(self, tasks: Sequence[Any]) -> None:
        """Read ahead, the stored ended tasks whose input items came again are not looked up
        any more (an item comes once, and generated ids only grow): their entries go."""
        if not self._lazy:
            return
        stored = self.stored
        for task in tasks:
            task_id = getattr(task, "id", None)
            if not isinstance(task_id, str):
                continue
            found = stored.get(task_id)
            if found is not None and found[0].state in TERMINAL:
                del stored[task_id]

    def knows(self, task_id: str) -> bool:
        """Whether the file held `task_id` (its row is written: not a new task)."""
        return task_id in self.stored

    def gone(self, task: Any, memory: MemoryRun) -> bool:
        """A stored task (the same, `match` checked) that succeeded in this process before the
        streamed input gave it again, and that the run has forgotten since (compacted): it is
        not admitted again (the memory run would take it for a second task with its id)."""
        return (
            isinstance(task, Task) and task.id in self.stored and memory.record_of(task.id) is None
        )

    def admit(
        self,
        memory: MemoryRun,
        tasks: Sequence[Any],
        *,
        where: str,
        forward: bool,
        first_index: int,
    ) -> tuple[int, list[tuple[int, int]]]:
        """Admit input into `memory`, matched against what the store kept (`match`), around
        the stored tasks done and forgotten since (`gone`). Returns how many tasks are new, and
        the stretches of `tasks` admitted, as (start, stop) slices: the whole input unless some
        were gone (a store writes each stretch from its own first index)."""
        generated: set[int] = set()
        gone: list[int] = []
        self.read_up_to(first_index + len(tasks) - 1)
        self._next = max(self._next, first_index + len(tasks))
        if self.stored:
            generated = self.match(tasks, first_index)
            gone = [i for i, task in enumerate(tasks) if self.gone(task, memory)]
            self._let_go(tasks)
        if not gone:
            added = memory.admit(
                tasks, where=where, forward=forward, first_index=first_index, generated=generated
            )
            return added, [(0, len(tasks))] if tasks else []
        # Admitted around the tasks that are gone, a stretch at a time. Only a streamed input's
        # chunk has such tasks (a whole list is never compacted), and it may only depend
        # backwards, so the stretches are independent.
        added = start = 0
        stretches = []
        for stop in [*gone, len(tasks)]:
            if start < stop:
                added += memory.admit(
                    tasks[start:stop],
                    where=where,
                    forward=forward,
                    first_index=first_index + start,
                    generated=generated,
                )
                stretches.append((start, stop))
            start = stop + 1
        return added, stretches

    def admit_one(self, memory: MemoryRun, task: Any, index: int) -> bool:
        """`admit` for one item of a streamed input; False when it is gone (not admitted)."""
        generated = False
        self.read_up_to(index)
        self._next = max(self._next, index + 1)
        if self.stored:
            generated = bool(self.match((task,), index))
            gone = self.gone(task, memory)
            self._let_go((task,))
            if gone:
                return False
        memory.admit_one(task, index, generated=generated)
        return True

    def match(self, tasks: Sequence[Any], first: int) -> set[int]:
        """Input admitted again on resume: the stored task with its id (generated ids are
        generated again, in the same order) must be the same task; it takes the caller's object.
        Returns the tasks (by `id()`) whose ids it generated: the memory run takes them as
        generated, not given (the rows say so, for the next resume to generate them again)."""
        stored = self.stored
        admission = self._admission
        generated: set[int] = set()
        for i, task in enumerate(tasks, first):
            if not isinstance(task, Task):
                continue
            given: str | None = task.id  # typed `str`: None until admission generates one
            if given is None:
                auto = admission.auto
                while True:
                    auto += 1
                    found = stored.get(f"{task.kind}#{auto}")
                    if found is None or not found[0].named:
                        break
                # The id admission would generate (a new task's too: given here, so that the
                # next one of the batch is generated after it, as in the first run).
                admission.auto = auto
                task.id = f"{task.kind}#{auto}"
                generated.add(id(task))
                if found is None:
                    continue
            else:
                found = stored.get(task.id)
                if found is None:
                    continue
                if not found[0].named:  # generated for a task given no id: its own is matched
                    raise InputError(
                        f"duplicate task id {task.id!r} (input item {i}): run {self.run_id!r} "
                        "generated it for an earlier task given no id",
                        task_id=task.id,
                        field="id",
                    )
            record, payload = found
            old = record.task
            if old is task:
                continue
            if (
                old.kind != task.kind
                or list(old.depends_on) != list(task.depends_on)
                or list(old.tags) != list(task.tags)
                or list(old.depends_on_tags) != list(task.depends_on_tags)
                or old.key != task.key
                or not _same_json(payload, task.payload)
            ):
                raise InputError(
                    f"task {task.id!r} (input item {i}) is not the task run {self.run_id!r} "
                    f"stored under that id: the input or the decomposer changed since the run "
                    "started. A resumed run must be given the same tasks (same ids, or the same "
                    "order when ids are generated); start a new run id for new work",
                    task_id=task.id,
                    field="payload",
                )
            record.task = task
        return generated


def _same_json(stored: str, payload: Any) -> bool:
    try:
        text = to_json(payload).decode()
    except PydanticSerializationError:
        return False
    return text == stored or json.loads(text) == json.loads(stored)
