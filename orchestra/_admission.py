"""Admission checks: what every store runs on a task before it enters a run.

These checks know nothing of where tasks are kept: a store calls `Admission.check` on each task of
a batch, asks it for a cycle check over the batch, and keeps (or refuses) the batch whole. Errors
are `InputError`s naming the task and the field, raised before any agent is called.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._config import finite, shown
from ._exceptions import InputError
from ._task import _EMPTY, Task

if TYPE_CHECKING:
    from pydantic import BaseModel

__all__ = ("PRIORITY_MAX", "PRIORITY_MIN", "Admission", "check_new_priority", "reject_cycles")

# The priorities every store can keep (a durable one holds them in a 64-bit integer column).
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1


class Admission:
    """The checks of one run: which kinds are served, which payload models apply, generated ids."""

    __slots__ = ("_inputs", "auto", "has_models", "kinds")

    def __init__(
        self, kinds: Sequence[str], inputs: Mapping[str, Sequence[type[BaseModel]]]
    ) -> None:
        self.kinds = frozenset(kinds)
        self._inputs = {k: list(v) for k, v in inputs.items() if v}
        self.has_models = bool(self._inputs)  # some kind validates its payloads
        self.auto = 0  # the number in the last generated id ("<kind>#<n>")

    def check(
        self,
        task: Any,
        where: str,
        index: int | None,
        taken: Callable[[str], bool],
    ) -> Task:
        """Check one task's own fields (not its references); give it an id if it has none.

        `taken(id)` says whether an id is in use (a generated id never collides with one). `where`
        and `index` say where the task came from, for the error message only."""
        if not isinstance(task, Task):
            where = where if index is None else f"{where}[{index}]"
            raise InputError(f"{where} is {type(task).__name__} {shown(task)}, not a Task")
        kind = task.kind
        if type(kind) is not str and isinstance(kind, str):
            # A str subclass (a StrEnum member, as `@agent(kinds=[Kind.RESEARCH])` takes): the
            # plain string it is, so ids, events and stores see "research".
            kind = task.kind = str.__str__(kind)
        task_id: Any = task.id
        if task_id is None:
            # A kind that is not a str is refused below, by this id: not formatted with its own
            # __str__, which may raise.
            prefix = kind if type(kind) is str else shown(kind)
            self.auto += 1
            task_id = f"{prefix}#{self.auto}"
            while taken(task_id):
                self.auto += 1
                task_id = f"{prefix}#{self.auto}"
            task.id = task_id
        elif type(task_id) is not str or not task_id:
            where = where if index is None else f"{where}[{index}]"
            raise InputError(
                f"{where}: task id must be a non-empty string, got {shown(task_id)}", field="id"
            )
        if type(kind) is not str or kind not in self.kinds:
            raise InputError(
                f"task {task_id!r}: no agent serves kind {shown(kind)} "
                f"(kinds served: {', '.join(sorted(self.kinds)) or 'none'})",
                task_id=task_id,
                field="kind",
            )
        if type(task.priority) is not int:
            raise InputError(
                f"task {task_id!r}: priority must be an int, got {shown(task.priority)}",
                task_id=task_id,
                field="priority",
            )
        timeout = task.timeout
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not finite(timeout)
            or not timeout > 0
        ):
            raise InputError(
                f"task {task_id!r}: timeout must be a positive number of seconds, got {shown(timeout)}",
                task_id=task_id,
                field="timeout",
            )
        # A falsy value (None, [], "") is none, made the empty tuple that the code after
        # admission iterates; a value whose truth is ambiguous (a numpy array's raises) is
        # something, which `_strings` then refuses.
        given: Any = task  # typed as sequences; any values until checked
        if given.depends_on is not _EMPTY and not _listed(given.depends_on):
            task.depends_on = _EMPTY
        if given.tags is not _EMPTY and not _listed(given.tags):
            task.tags = _EMPTY
        if given.depends_on_tags is not _EMPTY and not _listed(given.depends_on_tags):
            task.depends_on_tags = _EMPTY
        if task.depends_on is not _EMPTY:
            _strings(task_id, "depends_on", task.depends_on)
            if task_id in task.depends_on:
                raise InputError(
                    f"task {task_id!r} depends on itself", task_id=task_id, field="depends_on"
                )
        if task.tags is not _EMPTY:
            _strings(task_id, "tags", task.tags)
        if task.depends_on_tags is not _EMPTY:
            _strings(task_id, "depends_on_tags", task.depends_on_tags)
            for tag in task.depends_on_tags:
                if tag in task.tags:
                    raise InputError(
                        f"task {task_id!r} carries tag {tag!r} and waits for group {tag!r}: "
                        "it would wait for itself",
                        task_id=task_id,
                        field="depends_on_tags",
                    )
        if task.critical is not False and task.critical is not True:
            # A truthy "no" or 0/1 would pass for a flag; a durable store keeps only a bool.
            raise InputError(
                f"task {task_id!r}: critical must be True or False, got {shown(task.critical)}",
                task_id=task_id,
                field="critical",
            )
        if task.key is not None and (type(task.key) is not str or not task.key):
            raise InputError(
                f"task {task_id!r}: key must be a non-empty string, got {shown(task.key)}",
                task_id=task_id,
                field="key",
            )
        models = self._inputs.get(kind)
        if models is not None:
            _validate_payload(task, models)
        return task

    def check_payload(self, task: Task) -> None:
        """`check`'s last step alone: `task`'s payload against this run's models of its kind,
        for a task whose other fields were checked where it was first admitted."""
        models = self._inputs.get(task.kind)
        if models is not None:
            _validate_payload(task, models)


def check_new_priority(task_id: str, priority: Any) -> None:
    """A priority given to a task already in a run (`reprioritize`): an int that every store
    can keep, checked at the call (a durable store would fail its next write, and the run)."""
    if type(priority) is not int:
        raise InputError(
            f"priority must be an int, got {shown(priority)}", task_id=task_id, field="priority"
        )
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise InputError(
            f"priority {priority} for task {task_id!r} is out of the 64-bit range stores keep",
            task_id=task_id,
            field="priority",
        )


def _listed(value: Any) -> bool:
    """Whether a list field holds something: its truth value, or True when that raises."""
    try:
        return bool(value)
    except Exception:
        return True


def _strings(task_id: str, field: str, value: Any) -> None:
    if isinstance(value, str) or not isinstance(value, Sequence | set | frozenset):
        raise InputError(
            f"task {task_id!r}: {field} must be a list of strings, got {shown(value)}",
            task_id=task_id,
            field=field,
        )
    for item in value:
        if type(item) is not str:
            raise InputError(
                f"task {task_id!r}: {field} must hold strings, got {shown(item)}",
                task_id=task_id,
                field=field,
            )


def _validate_payload(task: Task, models: list[type[BaseModel]]) -> None:
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


def reject_cycles(batch: Sequence[Task], ids: Container[str]) -> None:
    """Kahn's algorithm over a batch's edges (dependencies and group memberships): linear in the
    batch's tasks and edges. Raises `InputError` naming the tasks on a cycle.

    A group of the batch is a node of its own (its members before it, its waiters after it), so
    `w` waiters of a group of `m` members are `m + w` edges, not `m * w`."""
    members: dict[str, list[str]] = {}
    for task in batch:
        for tag in task.tags:
            members.setdefault(tag, []).append(task.id)
    edges: dict[Hashable, list[Hashable]] = {}
    indegree: dict[Hashable, int] = {t.id: 0 for t in batch}
    for tag, ids_of in members.items():
        group = (tag,)  # a tuple: never a task id
        indegree[group] = len(ids_of)
        for member in ids_of:
            edges.setdefault(member, []).append(group)
    for task in batch:
        before: list[Hashable] = [d for d in task.depends_on if d in ids]
        before.extend((tag,) for tag in task.depends_on_tags if tag in members)
        for dep in before:
            edges.setdefault(dep, []).append(task.id)
            indegree[task.id] += 1
    ready = [t for t, n in indegree.items() if n == 0]
    while ready:
        for nxt in edges.get(ready.pop(), ()):
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                ready.append(nxt)
    stuck = sorted(t for t, n in indegree.items() if n > 0 and isinstance(t, str))
    if stuck:
        raise InputError(
            f"dependency cycle among tasks {stuck}", task_id=stuck[0], field="depends_on"
        )
