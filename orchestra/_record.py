"""The task record: a task's state in a run, which every store and the dispatcher share.

One `Record` per task, doubling as the task's `TaskResult` once it ends: one object per task instead
of two is what keeps admission at a few hundred nanoseconds and the garbage collector quiet (the
public face, `TaskResult`, is the same object; only the fields of a result are public).
"""

from __future__ import annotations

from ._task import PENDING, Task, TaskResult

__all__ = ("Record", "tries_on")


def tries_on(record: Record, agent: str, since: int = 0) -> int:
    """The attempts `record` made on `agent` so far (from its failure number `since`: a reopened
    task starts its chain again): `max_attempts` holds per task and agent over every visit, so a
    task that comes back to an agent it left (for an open breaker, say) goes on with the attempts
    it had there. O(attempts), once per change of agent."""
    failures = record.failures
    if failures is None:
        return 0
    return sum(1 for a in (failures[since:] if since else failures) if a.agent == agent)


class Record(TaskResult):
    """A task's state in a run; once the task has ended, it is its `TaskResult`.

    Until then `state`, `target`, `token` and `t_start` say where it is; the `TaskResult` fields
    (`status`, `agent`, `started`, `finished`, ...) are filled in when it ends.
    """

    __slots__ = (
        "agent_tries",
        "cancelling",
        "deadline",
        "dependents",
        "due",
        "feedback",
        "id",
        "index",
        "named",
        "parent",
        "priority",
        "qseq",
        "rank",
        "state",
        "t_retry",
        "t_start",
        "target",
        "token",
        "tried",
        "waiting",
    )

    t_retry: float  # when its current attempt started, from its second on (unset before)

    def __init__(self, task: Task, index: int, parent: Record | None, named: bool = True) -> None:
        self.task = task
        self.named = named  # its id was given (not generated): later input may refer to it
        self.index = index  # in the input, or among the spawner's spawns
        self.parent = parent
        self.id = self.task_id = task.id
        self.kind = task.kind
        self.priority = task.priority
        self.seq = index
        self.qseq = -1
        self.rank = -1  # its place in input order once `results()` has counted it (spawns only)
        self.state: str = PENDING
        self.status = PENDING  # type: ignore[assignment]  # the terminal status once ended
        self.waiting = 0
        self.dependents: list[Record] | None = None
        self.target: str | None = None
        self.tried: list[str] | None = None
        self.agent_tries = 0
        self.attempts = 0
        self.token = 0
        self.failures = None
        self.feedback: list[str] | None = None
        self.t_start: float | None = None
        self.deadline: float | None = None
        self.due: float | None = None
        self.cancelling: str | None = None
        self.output = None
        # agent, started, finished, error, error_type and defaulted are set when the task ends.

    @property
    def order(self) -> tuple[int, ...]:
        if self.rank >= 0:
            return (self.rank,)
        return (self.index,) if self.parent is None else self.position

    @property
    def position(self) -> tuple[int, ...]:
        if self.parent is None:
            return (self.index,)
        path = [self.index]
        record: Record | None = self.parent
        while record is not None:
            path.append(record.index)
            record = record.parent
        return tuple(reversed(path))

    def __repr__(self) -> str:  # what a caller sees of it is a `TaskResult`
        agent = getattr(self, "agent", None)  # set when the task ends
        return f"TaskResult(task_id={self.id!r}, status={self.state!r}, agent={agent!r})"
