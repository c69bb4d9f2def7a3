"""The task graph of a run in memory: its records by id, and what waits for what.

A record waits for its dependencies (`depends_on`), for the groups it waits for (`depends_on_tags`)
and, when another task of the run holds its idempotency key, for that task: it *follows* it (the
same work, run once). `Graph.wire` counts what each new record waits for and registers it there;
`Graph.release` frees what waited for a record that ended. The graph never changes a task's state
itself: its run (`Owner`, the `MemoryRun` that holds it) makes a record ready, or ends one, when the
graph says so. The checks a task passes before it enters are `orchestra.stores._graph_checks`.

Groups: every tag names a group. A task with `depends_on_tags=["g"]` waits until the group `g` is
closed: every member (task carrying the tag) succeeded and no more members can appear — the input is
exhausted and the task whose id is `g` (its usual spawner), if there is one, has ended. A member
that fails skips the waiters at once, as a failed dependency does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, Protocol

from .._record import Record
from .._task import (
    CANCELLED,
    FAILED,
    PENDING,
    READY,
    SKIPPED,
    SUCCEEDED,
    TERMINAL,
    Task,
)

if TYPE_CHECKING:
    from collections.abc import Collection, Iterator, Sequence

    from .._admission import Admission
    from ._protocol import Selector

__all__ = ("Graph", "Group", "Owner")


class Owner(Protocol):
    """What the graph asks of its run: make a record ready, or end one (a follower, with the
    result of the task whose key it follows)."""

    def ready(self, record: Record) -> None: ...
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
    ) -> None: ...


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
        # cycle check of a new member (`GraphChecks`) visits each record once per group, not once
        # per member.
        self.checked: set[str] | None = None


class Graph:
    """The records of one run by id, with their dependency edges, groups and idempotency keys.

    Attributes:
        records: every record the run holds, by id, in admission order (a streamed run forgets
            a succeeded one: see `release`).
        groups: every group by tag.
        keys: each idempotency key, and the id of the task that holds it (runs it).
    """

    def __init__(self, admission: Admission, owner: Owner, compact: bool) -> None:
        self.records: dict[str, Record] = {}
        self.groups: dict[str, Group] = {}
        self.keys: dict[str, str] = {}
        self._admission = admission
        self._ready = owner.ready
        self._end_one = owner.end_one
        self._compact = compact
        self._input_done = False
        # A streamed run forgets a succeeded task but its output (`release`): id -> output. A
        # dict of ids to plain outputs is not even tracked by the garbage collector.
        self._compacted: dict[str, Any] = {}
        # Tasks with a key another task of the run holds, by that task's id: the same work, run
        # once. They end with its result, or one of them takes the key if it does not succeed.
        self._followers: dict[str, list[Record]] = {}
        # The agent of a key's holder that succeeded and was compacted (its output is kept): a
        # task with the key admitted later ends with both, as with a holder still held.
        self._key_agents: dict[str, str | None] = {}
        # Tasks that took their key over at admission from a task of the run that holds it
        # (`_follow`): which task holds a key then depends on the order tasks came in, which
        # `restore` cannot see, so a durable store keeps this and gives it back.
        self._took_keys: set[str] = set()
        # Some id admitted outside `admit_plain` has a "#": a generated id ("<kind>#<n>") may
        # clash with it, so `admit_plain` looks each one up (two dict lookups a task, else none).
        self._lookalike = False
        self._spawned = False  # some task spawned others: `results()` ranks them
        # Some record of a whole-list run has no `rank` yet: `results()` ranks them all. A first
        # batch admitted by `admit_plain` is ranked as it is built (its index is its rank).
        self._unranked = False

    # -- what is there ---------------------------------------------------------------------------

    def taken(self, task_id: str) -> bool:
        """Whether a task of the run has this id (held, or compacted away after succeeding)."""
        return task_id in self.records or task_id in self._compacted

    # -- new records -----------------------------------------------------------------------------

    def admit_plain(self, tasks: Sequence[Any], first_index: int) -> list[Record] | None:
        """The common batch in one pass: tasks with nothing but a kind, a payload and a priority
        (no id, dependency, group, key, timeout, critical flag or payload model). Such a task
        needs only a generated id and a record, so the general checks (a call and a dozen
        branches per task) are skipped. Returns the new records, marked ready (they wait for
        nothing); None, with nothing changed, when some task needs the general path."""
        admission = self._admission
        if admission.has_models:
            return None
        kinds = admission.kinds
        auto = admission.auto
        records = self.records
        compacted = self._compacted
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
                if lookalike and (task_id in records or task_id in compacted):
                    break  # a given id of an earlier batch looks generated: the general path
                task.id = task_id
                record = records[task_id] = Record(task, index, None, False)
                record.state = READY  # made ready as a batch (`MemoryRun._ready_all`)
                if rank:
                    record.rank = index
                append(record)
                index += 1
            else:
                admission.auto = auto
                if not rank:
                    self._unranked = True
                return new
        except Exception:  # a field's truth value raised (a numpy array's does): the general
            pass  # path refuses it, naming the task and the field
        for record in new:  # undo: the general path sees the batch as it was given
            record.task.id = None  # type: ignore[assignment]
            del records[record.id]
        return None

    def insert(
        self, batch: list[Task], first_index: int, parent: Record | None, generated: Collection[int]
    ) -> list[Record]:
        """Records for a checked batch (`GraphChecks.batch`), pending until `wire` counts what they
        wait for. `generated`: the tasks (by `id()`) whose ids were generated, not given."""
        records = self.records
        keys = self.keys
        new = []
        for index, task in enumerate(batch, first_index):
            record = Record(task, index, parent, not generated or id(task) not in generated)
            records[record.id] = record
            if "#" in record.id:
                self._lookalike = True
            if task.key is not None:
                keys.setdefault(task.key, record.id)  # the first task with a key holds it
            new.append(record)
        self._unranked = True
        if parent is not None and new:
            self._spawned = True
        return new

    def insert_one(self, task: Task, index: int, named: bool) -> Record:
        """`insert` for one checked item of a streamed input."""
        record = Record(task, index, None, named)
        self.records[record.id] = record
        if "#" in record.id:
            self._lookalike = True
        if task.key is not None:
            self.keys.setdefault(task.key, record.id)
        return record

    # -- what waits for what ---------------------------------------------------------------------

    def wire(
        self, records: Sequence[Record]
    ) -> tuple[list[tuple[Record, str]], list[tuple[Record, tuple[Any, str | None]]]]:
        """Count what each of `records` (new, pending) waits for and register it there. Returns
        what must end at once: the records to skip (something they wait for failed already), with
        why, and the followers of a key whose holder succeeded already, with its (output, agent).
        The rest is ready once its `waiting` is 0."""
        skipped = []
        keyed = []
        keys = self.keys
        for record in records:
            task = record.task
            if task.depends_on or task.tags or task.depends_on_tags or task.key is not None:
                reason = self._wire(record)
                if reason is not None:
                    skipped.append((record, reason))
                elif task.key is not None and keys[task.key] != record.id:
                    keyed.append(record)
        # Followed once the whole batch is wired: whether the holder waits for a follower (through
        # a task or a group of the batch) is known only then (`_follow`).
        reused = []
        for record in keyed:
            result = self._follow(record)
            if result is not None:
                reused.append((record, result))
        return skipped, reused

    def _wire(self, record: Record) -> str | None:
        """Count what `record` waits for and register it with what it waits on. Returns why it must
        be skipped, if something it waits for has already failed."""
        task = record.task
        records = self.records
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
        groups = self.groups
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
        holder_id = self.keys[key]
        holder = self.records.get(holder_id)
        if holder is None:  # forgotten: compacted once it succeeded (its output is kept)
            if holder_id in self._compacted:
                return self._compacted[holder_id], self._key_agents.get(key)
            self.keys[key] = record.id  # (a worker's run forgets ended tasks whole)
            self._took_keys.add(record.id)
            return None
        if holder.state is SUCCEEDED:
            return holder.output, holder.agent
        if holder.state in TERMINAL:  # it failed, or was cancelled or skipped: this one runs
            self.keys[key] = record.id
            self._took_keys.add(record.id)
            return None
        if holder.state is PENDING and self._waits_for(holder, record):
            # The holder waits (through its dependencies or groups) for this task: were this one
            # to wait for it, neither would ever run. This one holds the key; the holder (and its
            # followers) follow it, and end with its output.
            self.keys[key] = record.id
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
        records, groups, keys = self.records, self.groups, self.keys
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

    # -- what an end frees -----------------------------------------------------------------------

    def release(self, record: Record, status: str, cascade: list[tuple[Record, str]]) -> None:
        """`record` has just ended with `status` (its run heard it): make ready what waited only
        for it, or put what can no longer run on `cascade` (to skip, with why); hand its key to a
        follower or end the followers with its success; close the groups it completes; and, in a
        streamed run, forget it once it succeeded."""
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
        groups = self.groups
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
            del self.records[record.id]
            key = record.task.key
            if record.named or dependents or key is not None:
                self._compacted[record.id] = record.output
            if key is not None and self.keys.get(key) == record.id:
                self._key_agents[key] = record.agent

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
        self.keys[record.task.key] = heir.id  # type: ignore[index]
        if len(live) > 1:
            self._followers[heir.id] = live[1:]
            if heir.dependents is None:
                heir.dependents = []
        heir.waiting -= 1
        if heir.waiting == 0 and heir.state is PENDING:
            self._ready(heir)

    def close_input(self) -> None:
        """No more input will come: the groups whose members are all done close."""
        self._input_done = True
        for tag, group in list(self.groups.items()):
            self._maybe_close(tag, group)

    def _closable(self, tag: str, group: Group) -> bool:
        """Whether no more members of `tag` can appear and every member is done."""
        if group.closed or group.open or not self._input_done:
            return False
        owner = self.records.get(tag)
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

    # -- a durable store's records, taken back ---------------------------------------------------

    def restore(self, records: Sequence[Record], took_keys: Collection[str]) -> list[Record]:
        """Take back the records a durable store kept, in admission order (a spawner before its
        spawns): ended ones as they ended, the others pending again. Returns those, for `wire`.
        `took_keys`: the ids of the tasks that took their key over at admission (`took_key`)."""
        groups = self.groups
        took = self._took_keys
        took.update(took_keys)
        live = []
        self._unranked = True
        for record in records:
            self.records[record.id] = record
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
                holder = self.records.get(self.keys.get(task.key, ""))
                if (
                    holder is None
                    or holder is record
                    or holder.state in _LOST
                    or (record.id in took and record.state not in _LOST)
                ):
                    self.keys[task.key] = record.id
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
        return live

    def restore_ended(self, records: Sequence[Record]) -> None:
        """`restore` for records that ended, then kept as `release` keeps a task that ends in a
        streamed run: a succeeded one with no group or key forgotten, its output kept when
        later input may name it (its id was given)."""
        self.restore(records, ())
        if not self._compact:
            return
        compacted = self._compacted
        for record in records:
            task = record.task
            if record.state is SUCCEEDED and not task.tags and task.key is None:
                del self.records[record.id]
                if record.named:
                    compacted[record.id] = record.output

    # -- a worker's run: nothing kept of an ended task -------------------------------------------

    def forget(self, task_id: str) -> None:
        """Drop what the run keeps of `task_id` if it ended (its record, or its output)."""
        record = self.records.get(task_id)
        if record is not None and record.state in TERMINAL:
            del self.records[task_id]
        self._compacted.pop(task_id, None)

    def forget_key(self, key: str) -> None:
        """Whatever task held `key` here, the next one admitted with it holds it."""
        self.keys.pop(key, None)

    # -- reading ---------------------------------------------------------------------------------

    def record_of(self, task_id: str) -> Record | None:
        """The record of `task_id`, if the run holds it (not compacted away)."""
        return self.records.get(task_id)

    def state_of(self, task_id: str) -> str | None:
        record = self.records.get(task_id)
        if record is not None:
            return record.state
        return SUCCEEDED if task_id in self._compacted else None

    def deps_of(self, record: Record) -> dict[str, Any]:
        """The outputs of what `record` waited for: its dependencies and its groups' members."""
        task = record.task
        deps = {d: self._output_of(d) for d in task.depends_on}
        for tag in task.depends_on_tags:
            group = self.groups.get(tag)
            if group is not None:
                for member in group.members:
                    deps[member.id] = member.output
        return deps

    def _output_of(self, task_id: str) -> Any:
        record = self.records.get(task_id)
        return self._compacted.get(task_id) if record is None else record.output

    def holds_key(self, record: Record) -> bool:
        """Whether `record` holds its key in this run (it runs; the others with it follow)."""
        key = record.task.key
        return key is not None and self.keys.get(key) == record.id

    def took_key(self, record: Record) -> bool:
        """Whether `record` took its key over at its admission from another task of the run (the
        one that held it waited for it, or had ended without succeeding): what `restore` needs to
        give the key back to the task that held it."""
        return record.id in self._took_keys

    def candidates(self, selector: Selector) -> list[Record]:
        """The unfinished records `selector` may match, in input order: looked up by id or by
        group where it names them, else all of them."""
        if selector.task_ids is not None:  # named: looked up, not searched for
            found = (self.records.get(task_id) for task_id in selector.task_ids)
            candidates = [r for r in found if r is not None and r.state not in TERMINAL]
            candidates.sort(key=_position)  # in input order, as a search finds them
            return candidates
        if selector.tag is not None:  # a group's members: its index, not a search
            group = self.groups.get(selector.tag)
            members = () if group is None else group.members
            return [r for r in members if r.state not in TERMINAL]
        return [r for r in self.records.values() if r.state not in TERMINAL]

    def results(self) -> Iterator[Record]:
        """The records not compacted away (every one of a whole-list run), in input order: a
        spawned task right after its spawner. With spawns, each record is given its `rank` in
        that order, so sorting by it costs nothing however deep the spawns go (a position is as
        long as its depth)."""
        if not self._spawned:
            records = self.records
            if not self._compact and self._unranked:  # a whole-list run: admission order is
                for rank, record in enumerate(records.values()):  # input order
                    record.rank = rank
                self._unranked = False
            return iter(records.values())
        children: dict[int, list[Record]] = {}
        roots: list[Record] = []
        for record in self.records.values():  # admission order: spawns in spawn order
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


_LOST: Final = frozenset((FAILED, CANCELLED, SKIPPED))


def _position(record: Record) -> tuple[int, ...]:
    return record.position
