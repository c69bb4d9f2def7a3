"""The task graph of one run: admission and its checks, dependencies, groups (tag barriers).

This is the in-memory store's state: every admitted task has a `Node` here, keyed by id, until the
run ends. Admission checks every task before it enters (`InputError` names the task and the field),
and a batch enters whole or not at all, so bad input never leaves half a run behind.

Groups: every tag names a group. A task with `depends_on_tags=["g"]` waits until the group `g` is
closed: every member (task carrying the tag) succeeded and no more members can appear — the input is
exhausted and the task whose id is `g` (its usual spawner), if there is one, has ended. A member
that fails skips the waiters at once, as a failed dependency does.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._exceptions import InputError
from ._task import PENDING, SUCCEEDED, TERMINAL, Task, TaskResult

if TYPE_CHECKING:
    from pydantic import BaseModel

    from ._registry import AgentSlot

__all__ = ("Graph", "Group", "Node")


class Node(TaskResult):
    """A task's state in a run; once the task is terminal, the node is its `TaskResult`.

    One object per task, not two: the hot path allocates as little as it can (every allocation also
    feeds the garbage collector). The `TaskResult` fields (`status`, `agent`, `started`, `finished`,
    ...) are set when the task settles; until then `state`, `slot` and `t_start` say where it is.
    """

    __slots__ = (
        "agent_tries",
        "chain_pos",
        "deadline",
        "dependents",
        "feedback",
        "id",
        "index",
        "parent",
        "priority",
        "qseq",
        "slot",
        "state",
        "t_start",
        "tried",
        "waiting",
    )

    def __init__(self, task: Task, seq: int, index: int, parent: Node | None) -> None:
        self.task = task
        self.index = index  # in the input, or among the spawner's spawns
        self.parent = parent
        task_id = task.id
        self.id = self.task_id = task_id
        self.kind = task.kind
        self.priority = task.priority
        self.seq = seq
        self.qseq = -1
        self.state: str = PENDING
        self.status = PENDING  # type: ignore[assignment]  # the terminal status once settled
        self.waiting = 0
        self.dependents: list[Node] | None = None
        self.slot: AgentSlot | None = None
        self.chain_pos = 0
        self.tried: list[AgentSlot] | None = None
        self.agent_tries = 0
        self.attempts = 0
        self.failures = None
        self.feedback: list[str] | None = None
        self.t_start: float | None = None
        self.deadline: float | None = None
        self.output = None
        # agent, started, finished, error, error_type and defaulted are set when the task settles.

    @property
    def position(self) -> tuple[int, ...]:
        if self.parent is None:
            return (self.index,)
        path = [self.index]
        node: Node | None = self.parent
        while node is not None:
            path.append(node.index)
            node = node.parent
        return tuple(reversed(path))

    def __repr__(self) -> str:
        return f"Node({self.id!r}, {self.state})"


class Group:
    """The tasks carrying one tag, and the tasks waiting for all of them."""

    __slots__ = ("closed", "failed", "members", "open", "waiters")

    def __init__(self) -> None:
        self.members: list[Node] = []
        self.open = 0  # members not yet terminal
        self.waiters: list[Node] = []
        self.closed = False
        self.failed: str | None = None  # why the group can no longer succeed


def _strings(task_id: str, field: str, value: Any) -> Sequence[str]:
    if isinstance(value, str) or not isinstance(value, Sequence | set | frozenset):
        raise InputError(
            f"task {task_id!r}: {field} must be a list of strings, got {value!r}",
            task_id=task_id,
            field=field,
        )
    for item in value:
        if not isinstance(item, str):
            raise InputError(
                f"task {task_id!r}: {field} must hold strings, got {item!r}",
                task_id=task_id,
                field=field,
            )
    return value  # type: ignore[return-value]


class Graph:
    """Nodes by id, dependency edges and groups. Knows nothing of agents' calls or of time."""

    __slots__ = ("_auto", "_inputs", "_kinds", "groups", "nodes", "seq", "settled", "source_done")

    def __init__(
        self,
        kinds: Mapping[str, Sequence[AgentSlot]],
    ) -> None:
        self.nodes: dict[str, Node] = {}
        # A streamed run forgets a succeeded task but its output (`compact`): id -> output. A dict
        # of ids to plain outputs is not even tracked by the garbage collector.
        self.settled: dict[str, Any] = {}
        self.groups: dict[str, Group] = {}
        self.seq = 0
        self._auto = 0
        self.source_done = False
        self._kinds = kinds
        # The input model of each kind, when its agents declare one: payloads are validated at admission.
        self._inputs: dict[str, list[type[BaseModel]]] = {}
        for kind, slots in kinds.items():
            models = list(dict.fromkeys(s.input for s in slots if s.input is not None))
            if models:
                self._inputs[kind] = models

    # -- admission -------------------------------------------------------------------------------

    def check(
        self,
        task: Any,
        where: str,
        index: int | None = None,
        taken: Container[str] = (),
    ) -> Task:
        """Check one task's own fields (not its references); give it an id if it has none.

        `where` (and `index`) say where the task came from, for the error message only."""
        if not isinstance(task, Task):
            where = where if index is None else f"{where}[{index}]"
            raise InputError(f"{where} is {type(task).__name__} {task!r}, not a Task")
        kind = task.kind
        task_id: str | None = task.id
        if task_id is None:  # generated: never one that is, or will be in this batch, given
            self._auto += 1
            task_id = f"{kind}#{self._auto}"
            while task_id in self.nodes or task_id in self.settled or task_id in taken:
                self._auto += 1
                task_id = f"{kind}#{self._auto}"
            task.id = task_id
        elif not isinstance(task_id, str) or not task_id:
            where = where if index is None else f"{where}[{index}]"
            raise InputError(
                f"{where}: task id must be a non-empty string, got {task_id!r}", field="id"
            )
        if not isinstance(kind, str) or kind not in self._kinds or not self._kinds[kind]:
            known = ", ".join(sorted(k for k, v in self._kinds.items() if v)) or "none"
            raise InputError(
                f"task {task_id!r}: no agent serves kind {kind!r} (kinds served: {known})",
                task_id=task_id,
                field="kind",
            )
        if type(task.priority) is not int:
            raise InputError(
                f"task {task_id!r}: priority must be an int, got {task.priority!r}",
                task_id=task_id,
                field="priority",
            )
        timeout = task.timeout
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0
        ):
            raise InputError(
                f"task {task_id!r}: timeout must be a positive number of seconds, got {timeout!r}",
                task_id=task_id,
                field="timeout",
            )
        if task.depends_on:
            _strings(task_id, "depends_on", task.depends_on)
            if task_id in task.depends_on:
                raise InputError(
                    f"task {task_id!r} depends on itself", task_id=task_id, field="depends_on"
                )
        if task.tags:
            _strings(task_id, "tags", task.tags)
        if task.depends_on_tags:
            _strings(task_id, "depends_on_tags", task.depends_on_tags)
            for tag in task.depends_on_tags:
                if tag in task.tags:
                    raise InputError(
                        f"task {task_id!r} carries tag {tag!r} and waits for group {tag!r}: it would wait for itself",
                        task_id=task_id,
                        field="depends_on_tags",
                    )
        models = self._inputs.get(kind)
        if models is not None:
            self._validate_payload(task, models)
        return task

    def _validate_payload(self, task: Task, models: list[type[BaseModel]]) -> None:
        from pydantic import ValidationError

        payload = task.payload
        for model in models:
            if isinstance(payload, model):
                continue
            try:
                validated = model.model_validate(payload)
            except ValidationError as exc:
                first = exc.errors()[0]
                field = ".".join(str(p) for p in first["loc"]) or "payload"
                raise InputError(
                    f"task {task.id!r}: payload fails {model.__name__} at {field!r}: {first['msg']}",
                    task_id=task.id,
                    field=f"payload.{field}" if first["loc"] else "payload",
                ) from exc
            if len(models) == 1:
                task.payload = validated  # agents of this kind receive the typed model

    def admit(
        self,
        tasks: Iterable[Any],
        *,
        where: str,
        forward: bool,
        closed_groups_ok: bool = True,
        first_index: int = 0,
        parent: Node | None = None,
    ) -> tuple[list[Node], list[tuple[Node, str]]]:
        """Check and insert a batch, all or nothing.

        Returns the new nodes in admission order, and those among them to skip at once (a dependency
        already failed), each with the reason.

        With `forward`, tasks may depend on tasks later in the same batch (a list given whole); else
        only on tasks admitted before (a streamed input, a spawn).
        """
        batch: list[Task] = []
        ids: dict[str, Task] = {}
        nodes = self.nodes
        linked = False  # any dependency at all: only then can there be a cycle
        if not isinstance(tasks, list | tuple):
            tasks = list(tasks)
        given = (
            {t.id for t in tasks if isinstance(t, Task) and t.id is not None}
            if len(tasks) > 1
            else ()
        )
        for i, task in enumerate(tasks, first_index):
            self.check(task, where, i, given)
            if task.depends_on or task.depends_on_tags:
                linked = True
            if task.id in nodes or task.id in ids or task.id in self.settled:
                raise InputError(f"duplicate task id {task.id!r}", task_id=task.id, field="id")
            if not forward and task.depends_on:
                self._known_deps(
                    task, ids, " (a streamed or spawned task may only depend on tasks before it)"
                )
            ids[task.id] = task
            batch.append(task)
        for task in batch:
            if forward and task.depends_on:
                self._known_deps(task, ids, "")
            for tag in task.tags:
                group = self.groups.get(tag)
                if group is not None and group.closed and not closed_groups_ok:
                    raise InputError(
                        f"task {task.id!r} joins group {tag!r}, which is closed: its waiters have started",
                        task_id=task.id,
                        field="tags",
                    )
        if forward and linked and len(batch) > 1:
            self._reject_cycles(batch, ids)
        new = []
        for index, task in enumerate(batch, first_index):
            self.seq += 1
            node = Node(task, self.seq, index, parent)
            nodes[node.id] = node
            new.append(node)
        skipped = []
        for node in new:
            task = node.task
            if task.depends_on or task.tags or task.depends_on_tags:
                reason = self._wire(node)
                if reason is not None:
                    skipped.append((node, reason))
        return new, skipped

    def admit_one(self, task: Any, index: int) -> tuple[Node, str | None]:
        """`admit` for one item of a streamed input: the same checks, without a batch's bookkeeping.
        Returns the node and, if it must be skipped at once, why."""
        self.check(task, "input item", index)
        nodes = self.nodes
        if task.id in nodes or task.id in self.settled:
            raise InputError(f"duplicate task id {task.id!r}", task_id=task.id, field="id")
        if task.depends_on:
            self._known_deps(task, {}, " (a streamed task may only depend on tasks before it)")
        self.seq += 1
        node = Node(task, self.seq, index, None)
        nodes[node.id] = node
        if task.depends_on or task.tags or task.depends_on_tags:
            return node, self._wire(node)
        return node, None

    def _known_deps(self, task: Task, ids: Mapping[str, Task], hint: str) -> None:
        for dep in task.depends_on:
            if dep not in self.nodes and dep not in ids and dep not in self.settled:
                raise InputError(
                    f"task {task.id!r} depends on unknown task {dep!r}{hint}",
                    task_id=task.id,
                    field="depends_on",
                )

    def _reject_cycles(self, batch: list[Task], ids: Mapping[str, Task]) -> None:
        """Kahn's algorithm over the batch's edges (dependencies and group memberships)."""
        members: dict[str, list[str]] = {}
        for task in batch:
            for tag in task.tags:
                members.setdefault(tag, []).append(task.id)
        edges: dict[str, list[str]] = {}
        indegree = dict.fromkeys(ids, 0)
        for task in batch:
            before = [d for d in task.depends_on if d in ids]
            for tag in task.depends_on_tags:
                before.extend(members.get(tag, ()))
            for dep in before:
                edges.setdefault(dep, []).append(task.id)
                indegree[task.id] += 1
        ready = [t for t, n in indegree.items() if n == 0]
        while ready:
            for nxt in edges.get(ready.pop(), ()):
                indegree[nxt] -= 1
                if indegree[nxt] == 0:
                    ready.append(nxt)
        stuck = sorted(t for t, n in indegree.items() if n > 0)
        if stuck:
            raise InputError(
                f"dependency cycle among tasks {stuck}", task_id=stuck[0], field="depends_on"
            )

    def _wire(self, node: Node) -> str | None:
        """Count what `node` waits for and register it with what it waits on.

        Returns why it must be skipped, if something it waits for has already failed."""
        task = node.task
        nodes = self.nodes
        skip_reason: str | None = None
        for dep_id in task.depends_on:
            dep = nodes.get(dep_id)
            if dep is None or dep.state is SUCCEEDED:  # not a node: compacted, so succeeded
                continue
            if dep.state in TERMINAL:
                skip_reason = f"dependency {dep_id!r} {dep.state}"
                continue
            node.waiting += 1
            if dep.dependents is None:
                dep.dependents = [node]
            else:
                dep.dependents.append(node)
        for tag in task.tags:
            group = self.groups.get(tag)
            if group is None:
                group = self.groups[tag] = Group()
            self._check_group_cycle(node, tag, group)
            group.members.append(node)
            group.open += 1
        for tag in task.depends_on_tags:
            group = self.groups.get(tag)
            if group is None:
                group = self.groups[tag] = Group()
            if group.failed is not None:
                skip_reason = group.failed
            elif not (group.closed or self.closable(tag, group)):
                group.waiters.append(node)
                node.waiting += 1
        return skip_reason

    def _check_group_cycle(self, member: Node, tag: str, group: Group) -> None:
        """A new member must not depend (transitively) on a task that waits for its own group."""
        if not group.waiters or not (member.task.depends_on or member.task.depends_on_tags):
            return
        waiters = {id(w) for w in group.waiters}
        seen: set[int] = set()
        stack = [member]
        while stack:
            node = stack.pop()
            for dep_id in node.task.depends_on:
                dep = self.nodes.get(dep_id)
                if dep is None or id(dep) in seen:
                    continue  # unknown or compacted: waits for nothing
                if id(dep) in waiters:
                    raise InputError(
                        f"dependency cycle: task {member.id!r} joins group {tag!r} but depends on "
                        f"{dep_id!r}, which waits for that group",
                        task_id=member.id,
                        field="tags",
                    )
                seen.add(id(dep))
                stack.append(dep)

    # -- reading ---------------------------------------------------------------------------------

    def deps_of(self, node: Node) -> dict[str, Any]:
        task = node.task
        deps = {d: self.output_of(d) for d in task.depends_on}
        for tag in task.depends_on_tags:
            group = self.groups.get(tag)
            if group is not None:
                for member in group.members:
                    deps[member.id] = member.output
        return deps

    def closable(self, tag: str, group: Group) -> bool:
        """Whether no more members of `tag` can appear and every member is done."""
        if group.closed or group.open or not self.source_done:
            return False
        owner = self.nodes.get(tag)
        return owner is None or owner.state in TERMINAL

    def output_of(self, task_id: str) -> Any:
        node = self.nodes.get(task_id)
        return self.settled.get(task_id) if node is None else node.output

    def state_of(self, task_id: str) -> str | None:
        """The state of a task (None when unknown)."""
        node = self.nodes.get(task_id)
        if node is not None:
            return node.state
        return SUCCEEDED if task_id in self.settled else None

    def known(self, task_id: str) -> bool:
        return task_id in self.nodes or task_id in self.settled

    def live(self) -> Iterator[Node]:
        """The nodes not compacted away."""
        return iter(self.nodes.values())

    def unfinished(self) -> list[Node]:
        return [n for n in self.live() if n.state not in TERMINAL]

    def compact(self, node: Node) -> None:
        """Forget a succeeded node but its output (streamed runs: bounded memory)."""
        del self.nodes[node.id]
        self.settled[node.id] = node.output
