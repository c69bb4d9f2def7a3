"""The checks a task passes to enter a run's graph in memory, before anything of it is kept.

`Admission.check` (`orchestra._admission`) checks a task's own fields; these check it against the
run: its id is not taken, what it depends on is there, it closes no cycle, the groups it joins are
still open, and in a streamed run its id cannot be mistaken for one the run generated and forgot.
A batch is checked whole before any of it enters (`GraphChecks.batch`): a refused batch leaves the
graph as it was. Errors are `InputError`s naming the task and the field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._admission import reject_cycles
from .._exceptions import InputError
from .._task import TERMINAL, Task

if TYPE_CHECKING:
    from collections.abc import Collection, Sequence

    from .._admission import Admission
    from .._record import Record
    from ._graph import Graph

__all__ = ("GraphChecks",)


class GraphChecks:
    """The checks of the tasks that enter one run's graph (reads it, never changes it, but for
    the cycle check's cache in each `Group`)."""

    def __init__(self, graph: Graph, admission: Admission, compact: bool) -> None:
        self._graph = graph
        self._admission = admission
        self._compact = compact

    def batch(
        self,
        tasks: Sequence[Any],
        where: str,
        forward: bool,
        first_index: int,
        parent: Record | None,
        generated: Collection[int] = (),
    ) -> tuple[list[Task], set[int]]:
        """Check a batch (`where` and the indexes say where it came from, for the errors; with
        `forward`, a task may depend on a later one of the batch; `parent`: the task that spawned
        it). Returns the tasks to admit (without those admitted before, the same: idempotent),
        and which of them (by `id()`) were given no id. `generated`: tasks whose ids the caller
        generated as admission would (a resumed durable run generates them again, in order)."""
        graph = self._graph
        batch: list[Task] = []
        ids: dict[str, Task] = {}
        linked = False  # any dependency at all: only then can there be a cycle
        given = (
            {t.id for t in tasks if isinstance(t, Task) and type(t.id) is str}  # others: refused
            if len(tasks) > 1
            else ()
        )

        def taken(task_id: str) -> bool:
            return graph.taken(task_id) or task_id in given or task_id in ids

        check = self._admission.check
        compact = self._compact
        auto = self._admission.auto  # (the batch's own generated ids step around its given ones)
        unnamed = set(generated)
        for i, task in enumerate(tasks, first_index):
            if getattr(task, "id", 0) is None:
                unnamed.add(id(task))
            check(task, where, i, taken)
            if task.depends_on or task.depends_on_tags:
                linked = True
            task_id = task.id
            if task_id in ids:
                raise InputError(f"duplicate task id {task_id!r}", task_id=task_id, field="id")
            if graph.taken(task_id):
                if parent is None and self._same(task):
                    continue  # admitted before, identical: idempotent
                raise InputError(f"duplicate task id {task_id!r}", task_id=task_id, field="id")
            if compact and "#" in task_id and id(task) not in unnamed:
                self._refuse_lookalike(task_id, auto)
            if not forward and task.depends_on:
                self._known_deps(
                    task, ids, " (a streamed or spawned task may only depend on tasks before it)"
                )
            ids[task_id] = task
            batch.append(task)
        for task in batch:
            if forward and task.depends_on:
                self._known_deps(task, ids, "")
            if parent is not None:
                for tag in task.tags:
                    group = graph.groups.get(tag)
                    if group is not None and group.closed:
                        raise InputError(
                            f"task {task.id!r} joins group {tag!r}, which is closed: its waiters "
                            "have started",
                            task_id=task.id,
                            field="tags",
                        )
        if forward and linked and len(batch) > 1:
            reject_cycles(batch, ids)
        if not forward:
            self._reject_group_cycles(batch)
        return batch, unnamed

    def one(self, task: Any, index: int, named: bool) -> bool:
        """`batch` for one item of a streamed input (`named`: its id was given); False when the
        same task was admitted before (nothing to do)."""
        graph = self._graph
        self._admission.check(task, "input item", index, graph.taken)
        if graph.taken(task.id):
            if self._same(task):
                return False
            raise InputError(f"duplicate task id {task.id!r}", task_id=task.id, field="id")
        if named and self._compact and "#" in task.id:
            self._refuse_lookalike(task.id, self._admission.auto)
        if task.depends_on:
            self._known_deps(task, (), " (a streamed task may only depend on tasks before it)")
            if task.tags:
                self._reject_group_cycles((task,))
        return True

    def spawn(self, task: Task, parent: Record, pending: dict[str, Task]) -> None:
        """Check a task an attempt of `parent` spawns (`pending`: its earlier spawns, by id); a
        task spawned without an id is given one."""
        graph = self._graph
        if getattr(task, "id", 0) is None and isinstance(getattr(task, "kind", None), str):
            # Named after its parent (`<parent id>/<kind>#<n>`, n counting the attempt's spawns):
            # the same in every run and on a retry, whatever order attempts end in, and the same
            # on a worker process, which cannot draw from the run's `<kind>#<n>` counter.
            n = len(pending) + 1
            while (given := f"{parent.id}/{task.kind}#{n}") in pending or graph.taken(given):
                n += 1
            task.id = given
        self._admission.check(
            task,
            f"task spawned by {parent.id!r}",
            None,
            lambda i: graph.taken(i) or i in pending,
        )
        if graph.taken(task.id) or task.id in pending:
            raise InputError(
                f"task {parent.id!r} spawns duplicate task id {task.id!r}",
                task_id=task.id,
                field="id",
            )
        if self._compact and "#" in task.id:
            self._refuse_lookalike(task.id, self._admission.auto)
        for dep in task.depends_on:
            if not graph.taken(dep) and dep not in pending:
                raise InputError(
                    f"task {task.id!r} (spawned by {parent.id!r}) depends on unknown task {dep!r}",
                    task_id=task.id,
                    field="depends_on",
                )
        for tag in task.tags:
            group = graph.groups.get(tag)
            if group is not None and group.closed:
                raise InputError(
                    f"task {parent.id!r} spawns {task.id!r} into group {tag!r}, which is closed",
                    task_id=task.id,
                    field="tags",
                )

    def _same(self, task: Task) -> bool:
        """Whether an admitted task with `task`'s id is the same task (idempotent re-admission)."""
        record = self._graph.records.get(task.id)
        if record is None:
            return False  # compacted: its task is gone; an id reused in one run is a duplicate
        old = record.task
        return old is task or (
            old.kind == task.kind
            and old.payload == task.payload
            and list(old.depends_on) == list(task.depends_on)
            and list(old.tags) == list(task.tags)
            and list(old.depends_on_tags) == list(task.depends_on_tags)
        )

    def _refuse_lookalike(self, task_id: str, auto: int) -> None:
        """Refuse a given id with a "#", not held by a compacting run, that may be one the run
        generated and forgot: a streamed run forgets a generated id whole once its task succeeds
        (memory stays flat however long the stream), so it cannot tell ``<kind>#<n>``, n up to
        `auto` (the last number generated before this input), from one of its own. Admitted, it
        would be a second task under that id, in the results and in a durable store's rows."""
        kind, _, n = task_id.rpartition("#")
        if (
            kind in self._admission.kinds
            and n.isascii()
            and n.isdigit()
            and n[0] != "0"
            and int(n) <= auto
        ):
            raise InputError(
                f"task id {task_id!r} may be a duplicate: this streamed run names a task given no "
                f"id '<kind>#<n>' (n up to {auto} so far), and forgets that id once the task "
                "succeeds, so it cannot tell. Give your ids another form, or every task an id",
                task_id=task_id,
                field="id",
            )

    def _known_deps(self, task: Task, ids: Any, hint: str) -> None:
        taken = self._graph.taken
        for dep in task.depends_on:
            if not taken(dep) and dep not in ids:
                raise InputError(
                    f"task {task.id!r} depends on unknown task {dep!r}{hint}",
                    task_id=task.id,
                    field="depends_on",
                )

    def _reject_group_cycles(self, batch: Sequence[Task]) -> None:
        """A streamed or spawned member of a group must not depend (transitively, or through a
        task that follows the holder of its key) on a task that waits for that group, admitted
        before it or in its batch. Each record is visited once per group over the whole run."""
        if not any(task.tags and task.depends_on for task in batch):
            return
        new: dict[str, Task] = {}
        new_waiters: dict[str, set[str]] = {}  # tag -> the tasks of the batch waiting for it
        if len(batch) > 1:
            for task in batch:
                new[task.id] = task
                for tag in task.depends_on_tags:
                    new_waiters.setdefault(tag, set()).add(task.id)
        graph = self._graph
        records, keys = graph.records, graph.keys
        for task in batch:
            if not task.tags or not task.depends_on:
                continue
            for tag in task.tags:
                group = graph.groups.get(tag)
                waiters = new_waiters.get(tag, set())
                if group is not None and group.waiters:
                    waiters = waiters | {w.id for w in group.waiters}
                if not waiters:
                    continue
                checked = set() if group is None else group.checked
                if checked is None:
                    checked = group.checked = set()  # type: ignore[union-attr]
                stack = list(task.depends_on)
                seen: set[str] = set()
                follows: dict[str, str] = {}  # a key's holder -> a follower that led to it
                while stack:
                    dep_id = stack.pop()
                    if dep_id in checked or dep_id in seen:
                        continue  # known clean
                    if dep_id in waiters:
                        how = (
                            f"{dep_id!r}, which waits for that group"
                            if dep_id not in follows
                            else f"{follows[dep_id]!r}, the same work (key) as {dep_id!r}, which "
                            "waits for that group"
                        )
                        raise InputError(
                            f"dependency cycle: task {task.id!r} joins group {tag!r} but depends "
                            f"on {how}",
                            task_id=task.id,
                            field="tags",
                        )
                    dep = records.get(dep_id)
                    if dep is None:
                        upstream = new.get(dep_id)
                        if upstream is not None:  # of this batch (not cached: it may be refused)
                            seen.add(dep_id)
                            stack.extend(upstream.depends_on)
                        continue  # or compacted: it waited for nothing open
                    checked.add(dep_id)
                    stack.extend(dep.task.depends_on)
                    key = dep.task.key
                    if key is not None and dep.state not in TERMINAL:
                        holder = keys.get(key, dep_id)
                        if holder != dep_id:  # it follows the task that holds its key
                            follows.setdefault(holder, dep_id)
                            stack.append(holder)
