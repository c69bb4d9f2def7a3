"""The in-memory store: a run's tasks as plain objects in one process (the default store).

One `Record` per task (`orchestra._record`), keyed by id. Every transition is a handful of attribute writes; nothing here awaits.

Groups: every tag names a group. A task with `depends_on_tags=["g"]` waits until the group `g` is
closed: every member (task carrying the tag) succeeded and no more members can appear — the input is
exhausted and the task whose id is `g` (its usual spawner), if there is one, has ended. A member
that fails skips the waiters at once, as a failed dependency does.
"""

from __future__ import annotations

from heapq import heappop, heappush
from typing import TYPE_CHECKING, Any, Final

from .._admission import reject_cycles
from .._exceptions import InputError
from .._gc import paused
from .._record import Record, tries_on
from .._task import (
    CANCELLED,
    CLAIMED,
    FAILED,
    PENDING,
    READY,
    RETRY_WAIT,
    RUNNING,
    SKIPPED,
    SUCCEEDED,
    TERMINAL,
    Task,
)
from ._protocol import KEEP, Selector
from ._queue import ReadyQueue

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterator, Sequence

    from .._admission import Admission
    from .._task import Attempt
    from ._protocol import Listener

__all__ = ("MemoryStore",)


class Group:
    """The tasks carrying one tag, and the tasks waiting for all of them."""

    __slots__ = ("checked", "closed", "failed", "members", "open", "waiters")

    def __init__(self) -> None:
        self.members: list[Record] = []
        self.open = 0  # members not yet terminal
        self.waiters: list[Record] = []
        self.closed = False
        self.failed: str | None = None  # why the group can no longer succeed
        # Records known not to lead (through their dependencies) to a waiter of this group: the
        # cycle check of a new member visits each record once per group, not once per member.
        self.checked: set[str] | None = None


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
    """One run's tasks in memory (the `RunStore` of `MemoryStore`)."""

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
        self._admission = admission
        self._listener = listener
        self._now = clock
        self._t0 = clock()
        self._task_timeout = task_timeout
        self._records: dict[str, Record] = {}
        # A streamed run forgets a succeeded task but its output (`_compact`): id -> output. A dict
        # of ids to plain outputs is not even tracked by the garbage collector.
        self._settled: dict[str, Any] = {}
        self._keys: dict[str, str] = {}  # idempotency key -> the id of the task that holds it
        # Tasks with a key another task of the run holds, by that task's id: the same work, run
        # once. They end with its result, or one of them takes the key if it does not succeed.
        self._followers: dict[str, list[Record]] = {}
        # The agent of a key's holder that succeeded and was compacted (its output is `_settled`):
        # a task with the key admitted later ends with both, as with a holder still held.
        self._key_agents: dict[str, str | None] = {}
        # Tasks that took their key over at admission from a task of the run that holds it
        # (`_follow`): which task holds a key then depends on the order tasks came in, which
        # `restore` cannot see, so a durable store keeps this and gives it back.
        self._took_keys: set[str] = set()
        self._groups: dict[str, Group] = {}
        self._queue: ReadyQueue[Record] = ReadyQueue()
        self._timers: list[
            tuple[float, int, Record]
        ] = []  # (time, seq, record): retries, deadlines
        self._timer_seq = 0
        # Tasks a durable store reopened (`SQLiteStore.retry`), with how many of their failures
        # came before: those do not count against an agent's attempts any more (`tries_on`).
        self._reopened: dict[Record, int] = {}
        self._compact = compact
        self._input_done = False
        self._cascade: list[tuple[Record, str]] = []  # what to skip next; empty between steps
        self._generated: set[int] = set()
        # Some id admitted outside `_admit_plain` has a "#": a generated id ("<kind>#<n>") may
        # clash with it, so `_admit_plain` looks each one up (two dict lookups a task, else none).
        self._lookalike = False
        self._spawned = False  # some task spawned others: `results()` ranks them
        # Some record of a whole-list run has no `rank` yet: `results()` ranks them all. A first
        # batch admitted by `_admit_plain` is ranked as it is built (its index is its rank).
        self._unranked = False

    # -- admission -------------------------------------------------------------------------------

    def _taken(self, task_id: str) -> bool:
        return task_id in self._records or task_id in self._settled

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
        # A whole-list run keeps its records to its end: they are frozen out of the GC's sight
        # (`orchestra._gc`). A streamed one forgets them as they end: its chunks are not frozen,
        # nor what the application allocated meanwhile (its garbage cycles stay collectable).
        with paused(len(tasks), keep=not self._compact):
            plain = None if parent is not None else self._admit_plain(tasks, first_index)
            if plain is None:
                new = self._check_batch(tasks, where, forward, first_index, parent, generated)
                records = self._insert(new, first_index, parent)
        if plain is not None:
            self._ready_all(plain)
            return len(plain)
        self._wire_all(records)
        return len(records)

    def _admit_plain(self, tasks: Sequence[Any], first_index: int) -> list[Record] | None:
        """The common batch in one pass: tasks with nothing but a kind, a payload and a priority
        (no id, dependency, group, key, timeout, critical flag or payload model). Such a task
        needs only a generated id and a record, so the general checks (a call and a dozen
        branches per task) are skipped. None, with nothing changed, when some task needs the
        general path."""
        admission = self._admission
        if admission.has_models:
            return None
        kinds = admission.kinds
        auto = admission.auto
        records = self._records
        settled = self._settled
        lookalike = self._lookalike
        rank = not records and not self._compact  # the run's first batch: index = rank
        new: list[Record] = []
        append = new.append
        index = first_index
        try:  # free in CPython 3.11+ unless something raises
            for task in tasks:
                if type(task) is not Task:
                    break
                given: Any = task  # its fields are not checked yet: any values
                if (
                    given.id is not None
                    or type(given.priority) is not int
                    or given.timeout is not None
                    or given.key is not None
                    or given.depends_on
                    or given.tags
                    or given.depends_on_tags
                    or given.critical is not False  # a critical task, or a wrong value to refuse
                ):
                    break
                kind = given.kind
                if type(kind) is not str or kind not in kinds:
                    break
                auto += 1
                task_id = f"{kind}#{auto}"
                if lookalike and (task_id in records or task_id in settled):
                    break  # a given id of an earlier batch looks generated: the general path
                task.id = task_id
                record = records[task_id] = Record(task, index, None, False)
                record.state = READY  # made ready as a batch (`_ready_all`) if all are plain
                if rank:
                    record.rank = index
                append(record)
                index += 1
            else:
                admission.auto = auto
                self.unfinished += len(new)
                if not rank:
                    self._unranked = True
                return new
        except Exception:  # a field's truth value raised (a numpy array's does): the general
            pass  # path refuses it, naming the task and the field
        for record in new:  # undo: the general path sees the batch as it was given
            record.task.id = None  # type: ignore[assignment]
            del records[record.id]
        return None

    def _ready_all(self, records: list[Record]) -> None:
        """`_ready` for a batch of new records that wait for nothing (marked ready already), in
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

    def admit_one(self, task: Any, index: int, *, generated: bool = False) -> None:
        """`admit` for one item of a streamed input: the same checks, without a batch's bookkeeping."""
        admission = self._admission
        named = not generated and getattr(task, "id", None) is not None
        admission.check(task, "input item", index, self._taken)
        if self._taken(task.id):
            if self._same(task):
                return
            raise InputError(f"duplicate task id {task.id!r}", task_id=task.id, field="id")
        if named and self._compact and "#" in task.id:
            self._refuse_lookalike(task.id, admission.auto)
        if task.depends_on:
            self._known_deps(task, (), " (a streamed task may only depend on tasks before it)")
            if task.tags:
                self._reject_group_cycles((task,))
        record = Record(task, index, None, named)
        self._records[record.id] = record
        if "#" in record.id:
            self._lookalike = True
        if task.key is not None:
            self._keys.setdefault(task.key, record.id)
        self.unfinished += 1
        self.pending += 1
        self._wire_all((record,))

    def _same(self, task: Task) -> bool:
        """Whether an admitted task with `task`'s id is the same task (idempotent re-admission)."""
        record = self._records.get(task.id)
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

    def _check_batch(
        self,
        tasks: Sequence[Any],
        where: str,
        forward: bool,
        first_index: int,
        parent: Record | None,
        generated: Collection[int] = (),
    ) -> list[Task]:
        batch: list[Task] = []
        ids: dict[str, Task] = {}
        linked = False  # any dependency at all: only then can there be a cycle
        given = (
            {t.id for t in tasks if isinstance(t, Task) and type(t.id) is str}  # others: refused
            if len(tasks) > 1
            else ()
        )

        def taken(task_id: str) -> bool:
            return self._taken(task_id) or task_id in given or task_id in ids

        check = self._admission.check
        compact = self._compact
        auto = self._admission.auto  # (the batch's own generated ids step around its given ones)
        self._generated.clear()
        self._generated.update(generated)
        for i, task in enumerate(tasks, first_index):
            if getattr(task, "id", 0) is None:
                self._generated.add(id(task))
            check(task, where, i, taken)
            if task.depends_on or task.depends_on_tags:
                linked = True
            task_id = task.id
            if task_id in ids:
                raise InputError(f"duplicate task id {task_id!r}", task_id=task_id, field="id")
            if self._taken(task_id):
                if parent is None and self._same(task):
                    continue  # admitted before, identical: idempotent
                raise InputError(f"duplicate task id {task_id!r}", task_id=task_id, field="id")
            if compact and "#" in task_id and id(task) not in self._generated:
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
                    group = self._groups.get(tag)
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
        return batch

    def _insert(self, batch: list[Task], first_index: int, parent: Record | None) -> list[Record]:
        records = self._records
        keys = self._keys
        new = []
        generated = self._generated
        for index, task in enumerate(batch, first_index):
            record = Record(task, index, parent, not generated or id(task) not in generated)
            records[record.id] = record
            if "#" in record.id:
                self._lookalike = True
            if task.key is not None:
                keys.setdefault(task.key, record.id)  # the first task with a key holds it
            new.append(record)
        generated.clear()
        self.unfinished += len(new)
        self.pending += len(new)
        self._unranked = True
        return new

    def _known_deps(self, task: Task, ids: Any, hint: str) -> None:
        for dep in task.depends_on:
            if not self._taken(dep) and dep not in ids:
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
        records, keys = self._records, self._keys
        for task in batch:
            if not task.tags or not task.depends_on:
                continue
            for tag in task.tags:
                group = self._groups.get(tag)
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

    def _wire_all(self, records: Sequence[Record]) -> None:
        skipped = []
        keyed = []
        for record in records:
            task = record.task
            if task.depends_on or task.tags or task.depends_on_tags or task.key is not None:
                reason = self._wire(record)
                if reason is not None:
                    skipped.append((record, reason))
                elif task.key is not None and self._keys[task.key] != record.id:
                    keyed.append(record)
        # Followed once the whole batch is wired: whether the holder waits for a follower (through
        # a task or a group of the batch) is known only then (`_follow`).
        reused = []
        for record in keyed:
            result = self._follow(record)
            if result is not None:
                reused.append((record, result))
        for record, reason in skipped:
            self._end(record, SKIPPED, None, None, reason, "DependencyFailed", False)
        for record, (output, agent) in reused:
            self._end(record, SUCCEEDED, output, agent, None, None, False)
        for record in records:
            if record.waiting == 0 and record.state is PENDING:
                self._ready(record)

    def _wire(self, record: Record) -> str | None:
        """Count what `record` waits for and register it with what it waits on. Returns why it must
        be skipped, if something it waits for has already failed."""
        task = record.task
        records = self._records
        skip: str | None = None
        for dep_id in task.depends_on:
            dep = records.get(dep_id)
            if dep is None or dep.state is SUCCEEDED:  # not a record: compacted, so succeeded
                continue
            if dep.state in TERMINAL:
                skip = f"dependency {dep_id!r} {dep.state}"
                continue
            record.waiting += 1
            if dep.dependents is None:
                dep.dependents = [record]
            else:
                dep.dependents.append(record)
        groups = self._groups
        for tag in task.tags:
            group = groups.get(tag)
            if group is None:
                group = groups[tag] = Group()
            group.members.append(record)
            group.open += 1
        for tag in task.depends_on_tags:
            group = groups.get(tag)
            if group is None:
                group = groups[tag] = Group()
            if group.failed is not None:
                skip = group.failed
            elif not (group.closed or self._closable(tag, group)):
                group.waiters.append(record)
                record.waiting += 1
        return skip

    def _follow(self, record: Record) -> tuple[Any, str | None] | None:
        """`record` has a key another task of the run holds: it is the same work, run once. It
        waits for that task and ends with its result; if that task does not succeed, the first
        of its followers takes the key and runs (as a durable store's waiters do across runs).
        Returns the (output, agent) to end with now when the holder has succeeded already."""
        key: str = record.task.key  # type: ignore[assignment]
        holder_id = self._keys[key]
        holder = self._records.get(holder_id)
        if holder is None:  # forgotten: compacted once it succeeded (its output is kept)
            if holder_id in self._settled:
                return self._settled[holder_id], self._key_agents.get(key)
            self._keys[key] = record.id  # (a worker's run forgets ended tasks whole)
            self._took_keys.add(record.id)
            return None
        if holder.state is SUCCEEDED:
            return holder.output, holder.agent
        if holder.state in TERMINAL:  # it failed, or was cancelled or skipped: this one runs
            self._keys[key] = record.id
            self._took_keys.add(record.id)
            return None
        if holder.state is PENDING and self._waits_for(holder, record):
            # The holder waits (through its dependencies or groups) for this task: were this one
            # to wait for it, neither would ever run. This one holds the key; the holder (and its
            # followers) follow it, and end with its output.
            self._keys[key] = record.id
            self._took_keys.add(record.id)
            theirs = self._followers.pop(holder_id, None) or []
            self._followers[record.id] = [holder, *theirs]
            if record.dependents is None:
                record.dependents = []
            holder.waiting += 1
            return None
        followers = self._followers.get(holder_id)
        if followers is None:
            self._followers[holder_id] = [record]
            if holder.dependents is None:
                holder.dependents = []  # its end takes the general path, which hears followers
        else:
            followers.append(record)
        record.waiting += 1
        return None

    def _waits_for(self, waiter: Record, record: Record) -> bool:
        """Whether `waiter` waits, through its unfinished dependencies, the members of the groups
        it waits for and the holders of the keys it follows, for `record` (just wired). Free when
        nothing can wait for `record` (no dependent, no group): the common follower."""
        if record.dependents is None and not record.task.tags:
            return False
        records, groups, keys = self._records, self._groups, self._keys
        seen = {waiter.id}
        stack = [waiter]
        while stack:
            task = stack.pop().task
            above = [records.get(d) for d in task.depends_on]
            for tag in task.depends_on_tags:
                group = groups.get(tag)
                if group is not None and not group.closed:
                    above.extend(group.members)
            if task.key is not None and keys.get(task.key) != task.id:
                above.append(records.get(keys[task.key]))
            for dep in above:
                if dep is None or dep.state in TERMINAL or dep.id in seen:
                    continue
                if dep is record:
                    return True
                seen.add(dep.id)
                stack.append(dep)
        return False

    def _followed(
        self, record: Record, status: str, followers: list[Record], cascade: list[Any]
    ) -> None:
        """`record`, which held a key, ended: its followers end with its success, or the first of
        them takes the key (and runs once it waits for nothing else)."""
        if status is SUCCEEDED:
            for follower in followers:
                if follower.state not in TERMINAL:
                    self._end_one(
                        follower, SUCCEEDED, record.output, record.agent, None, None, False,
                        cascade,
                    )  # fmt: skip
            return
        live = [f for f in followers if f.state not in TERMINAL]
        if not live:
            return
        heir = live[0]
        self._keys[record.task.key] = heir.id  # type: ignore[index]
        if len(live) > 1:
            self._followers[heir.id] = live[1:]
            if heir.dependents is None:
                heir.dependents = []
        heir.waiting -= 1
        if heir.waiting == 0 and heir.state is PENDING:
            self._ready(heir)

    def backpressure(self) -> None:
        """Nothing to wait for: memory keeps up."""

    def close_input(self) -> None:
        self._input_done = True
        for tag, group in list(self._groups.items()):
            self._maybe_close(tag, group)

    def check_spawn(self, task: Task, parent: Record, pending: dict[str, Task]) -> None:
        if getattr(task, "id", 0) is None and isinstance(getattr(task, "kind", None), str):
            # Named after its parent (`<parent id>/<kind>#<n>`, n counting the attempt's spawns):
            # the same in every run and on a retry, whatever order attempts end in, and the same
            # on a worker process, which cannot draw from the run's `<kind>#<n>` counter.
            n = len(pending) + 1
            while (given := f"{parent.id}/{task.kind}#{n}") in pending or self._taken(given):
                n += 1
            task.id = given
        self._admission.check(
            task,
            f"task spawned by {parent.id!r}",
            None,
            lambda i: self._taken(i) or i in pending,
        )
        if self._taken(task.id) or task.id in pending:
            raise InputError(
                f"task {parent.id!r} spawns duplicate task id {task.id!r}",
                task_id=task.id,
                field="id",
            )
        if self._compact and "#" in task.id:
            self._refuse_lookalike(task.id, self._admission.auto)
        for dep in task.depends_on:
            if not self._taken(dep) and dep not in pending:
                raise InputError(
                    f"task {task.id!r} (spawned by {parent.id!r}) depends on unknown task {dep!r}",
                    task_id=task.id,
                    field="depends_on",
                )
        for tag in task.tags:
            group = self._groups.get(tag)
            if group is not None and group.closed:
                raise InputError(
                    f"task {parent.id!r} spawns {task.id!r} into group {tag!r}, which is closed",
                    task_id=task.id,
                    field="tags",
                )

    # -- dispatch --------------------------------------------------------------------------------

    def _ready(self, record: Record) -> None:
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
        # The failed attempt's lease ends here: its worker's late or repeated writes are refused
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
            self._ready(record)
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
            self._spawned = True
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
            # This class's own (an override of `succeed` may come back to `settle`).
            return MemoryRun.succeed(self, record, token, output, agent)  # type: ignore[arg-type]
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
            # (`_end_one` does the same and more; a call and a dozen branches cost more here than
            # the end itself.)
            t0 = self._t0
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
        return self.settle(record, token, SUCCEEDED, output, agent=agent)

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
                self._end_one(record, status, output, agent, error, error_type, defaulted, cascade)
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

    def _end_one(
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
        if record.state is READY:
            self._queue.discard(record)
        elif record.state is PENDING:
            self.pending -= 1
        record.state = status
        end = self._now()
        t0 = self._t0
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
        dependents = record.dependents
        if status is SUCCEEDED:
            if dependents:
                for dep in dependents:
                    dep.waiting -= 1
                    if dep.waiting == 0 and dep.state is PENDING:
                        self._ready(dep)
        elif dependents:
            reason = f"dependency {record.id!r} {status}"
            cascade.extend((dep, reason) for dep in dependents)
        record.dependents = None
        if self._followers:
            followers = self._followers.pop(record.id, None)
            if followers is not None:
                self._followed(record, status, followers, cascade)
        groups = self._groups
        if groups:
            for tag in record.task.tags:
                group = groups[tag]
                group.open -= 1
                if status is not SUCCEEDED and group.failed is None:
                    group.failed = f"group {tag!r} member {record.id!r} {status}"
                    cascade.extend((w, group.failed) for w in group.waiters if w.state is PENDING)
                self._maybe_close(tag, group)
            owned = groups.get(record.id)
            if owned is not None:
                self._maybe_close(record.id, owned)
        if self._compact and status is SUCCEEDED and not record.task.tags:
            # A streamed run forgets a succeeded task. Later input may still name it if its id
            # was given: its output stays (id -> output, untracked by the GC). A generated id
            # nobody waits for is forgotten whole, so memory stays flat however long the stream.
            del self._records[record.id]
            key = record.task.key
            if record.named or dependents or key is not None:
                self._settled[record.id] = record.output
            if key is not None and self._keys.get(key) == record.id:
                self._key_agents[key] = record.agent

    def _closable(self, tag: str, group: Group) -> bool:
        """Whether no more members of `tag` can appear and every member is done."""
        if group.closed or group.open or not self._input_done:
            return False
        owner = self._records.get(tag)
        return owner is None or owner.state in TERMINAL

    def _maybe_close(self, tag: str, group: Group) -> None:
        # Only a group that somebody waits for is closed (and then refuses new members); a waiter
        # that arrives later finds a closable group satisfied (`_wire`).
        if not group.waiters or not self._closable(tag, group):
            return
        group.closed = True
        group.checked = None
        if group.failed is not None:
            return  # the waiters were skipped when the group failed
        for waiter in group.waiters:
            waiter.waiting -= 1
            if waiter.waiting == 0 and waiter.state is PENDING:
                self._ready(waiter)

    def cancel(
        self, selector: Selector, reason: str, error_type: str = "Cancelled"
    ) -> list[Record]:
        running = []
        if selector.task_ids is not None:  # named: looked up, not searched for
            found = (self._records.get(task_id) for task_id in selector.task_ids)
            candidates = [r for r in found if r is not None and r.state not in TERMINAL]
            candidates.sort(key=_position)  # in input order, as a search finds them
        elif selector.tag is not None:  # a group's members: its index, not a search
            group = self._groups.get(selector.tag)
            members = () if group is None else group.members
            candidates = [r for r in members if r.state not in TERMINAL]
        else:
            candidates = [r for r in self._records.values() if r.state not in TERMINAL]
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
                self._ready(record)
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
        task = record.task
        deps = {d: self._output_of(d) for d in task.depends_on}
        for tag in task.depends_on_tags:
            group = self._groups.get(tag)
            if group is not None:
                for member in group.members:
                    deps[member.id] = member.output
        return deps

    def _output_of(self, task_id: str) -> Any:
        record = self._records.get(task_id)
        return self._settled.get(task_id) if record is None else record.output

    def results(self) -> Iterator[Record]:
        """The records not compacted away (every one of a whole-list run), in input order: a
        spawned task right after its spawner. With spawns, each record is given its `rank` in
        that order, so sorting by it costs nothing however deep the spawns go (a position is as
        long as its depth)."""
        if not self._spawned:
            records = self._records
            if not self._compact and self._unranked:  # a whole-list run: admission order is
                for rank, record in enumerate(records.values()):  # input order
                    record.rank = rank
                self._unranked = False
            return iter(records.values())
        children: dict[int, list[Record]] = {}
        roots: list[Record] = []
        for record in self._records.values():  # admission order: spawns in spawn order
            if record.parent is None:
                roots.append(record)
            else:
                children.setdefault(id(record.parent), []).append(record)
        ordered: list[Record] = []
        stack = roots[::-1]
        while stack:
            record = stack.pop()
            record.rank = len(ordered)
            ordered.append(record)
            below = children.get(id(record))
            if below:
                stack.extend(reversed(below))
        return iter(ordered)

    def state_of(self, task_id: str) -> str | None:
        record = self._records.get(task_id)
        if record is not None:
            return record.state
        return SUCCEEDED if task_id in self._settled else None

    def queue_depths(self) -> dict[int, int]:
        """Ready tasks by priority (for the run's status): O(priority levels)."""
        return self._queue.depths()

    def reprioritize(self, task_id: str, priority: int, *, claimed: bool = False) -> bool:
        record = self._records.get(task_id)
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

    # -- for a durable store that keeps its state here (orchestra.stores.SQLiteStore) ------------

    @property
    def t0(self) -> float:
        """The loop time the run counts from: its records' `started` and `finished` are after it."""
        return self._t0

    def records(self) -> Collection[Record]:
        """The records the run holds (not compacted away), in admission order."""
        return self._records.values()

    def ready(self, record: Record) -> None:
        """Make `record` ready (a durable store's: a task another process handed back unrun)."""
        self._ready(record)

    def holds_key(self, record: Record) -> bool:
        """Whether `record` holds its key in this run (it runs; the others with it follow)."""
        key = record.task.key
        return key is not None and self._keys.get(key) == record.id

    def took_key(self, record: Record) -> bool:
        """Whether `record` took its key over at its admission from another task of the run (the
        one that held it waited for it, or had ended without succeeding): what `restore` needs to
        give the key back to the task that held it."""
        return record.id in self._took_keys

    def record_of(self, task_id: str) -> Record | None:
        """The record of `task_id`, if the run holds it (not compacted away)."""
        return self._records.get(task_id)

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

    def restore(self, records: Sequence[Record], took_keys: Collection[str] = ()) -> None:
        """Take back the records a durable store kept, in admission order (a spawner before its
        spawns): ended ones as they ended, the others waiting again (a claimed or running one lost
        its worker and runs again, its attempts counted) and ready at once when what they wait for
        is done. The listener hears the ones made ready, not the ended ones. `took_keys`: the ids
        of the tasks that took their key over at admission (`took_key`)."""
        groups = self._groups
        self._took_keys.update(took_keys)
        live = []
        self._unranked = True
        for record in records:
            self._records[record.id] = record
            if record.target is None and record.agent_tries:
                # Reopened: a durable store keeps, in an agent_tries with no agent, how many
                # failures came before (see `tries_on`).
                self._reopened[record] = record.agent_tries
                record.agent_tries = 0
            if "#" in record.id:
                self._lookalike = True
            task = record.task
            if task.key is not None:
                # The first task with a key holds it, unless it ended without succeeding; a later
                # one that took it over at its admission holds it while it has not (the ones it
                # took it from follow it, and take it back in order if it fails, as they did).
                # By order alone the key would go back to a task that waits for its follower,
                # and another key's holder could then wait for its own follower, which would take
                # that key over and run out of turn.
                holder = self._records.get(self._keys.get(task.key, ""))
                if (
                    holder is None
                    or holder is record
                    or holder.state in _LOST
                    or (record.id in self._took_keys and record.state not in _LOST)
                ):
                    self._keys[task.key] = record.id
            if record.parent is not None:
                self._spawned = True
            if record.state in TERMINAL:
                for tag in task.tags:
                    group = groups.get(tag)
                    if group is None:
                        group = groups[tag] = Group()
                    group.members.append(record)
                    if record.state is not SUCCEEDED and group.failed is None:
                        group.failed = f"group {tag!r} member {record.id!r} {record.state}"
            else:
                record.state = PENDING
                live.append(record)
        self.unfinished += len(live)
        self.pending += len(live)
        self._wire_all(live)


_LOST: Final = frozenset((FAILED, CANCELLED, SKIPPED))


def _position(record: Record) -> tuple[int, ...]:
    return record.position
