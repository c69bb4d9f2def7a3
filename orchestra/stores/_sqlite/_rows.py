"""A task's rows in the SQLite store: its `Record` written as a row of `tasks` (and its failed
attempts as rows of `attempts`), read back on resume, and what a row cannot hold refused before
the task is admitted (`encode`).

`Rows` knows the two clocks (a record counts loop time, a row wall-clock time: loop time + offset,
or the memory run's zero `wall0` + the record's relative times) and the statement a row is for:
rows with the usual NULLs (no dependency, tag, key, retry, deadline, feedback or error) go through
the statements that bind fewer parameters (`_INSERT_LEAN`, `_UPDATE_LEAN` in `_writes`:
binding dominates an insert's cost).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pydantic_core import PydanticSerializationError, to_json

from ..._admission import PRIORITY_MAX, PRIORITY_MIN
from ..._exceptions import InputError
from ..._output import jsonable
from ..._record import Record
from ..._task import (
    CLAIMED,
    READY,
    STATE_OF,
    TERMINAL,
    Attempt,
    Task,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ("STATES", "Rows", "encode")

STATES: dict[str, str] = {**STATE_OF}
STATES["done"] = CLAIMED  # completed by a worker: the coordinator settles it when it resumes


class Rows:
    """Builds one run's rows from its records, and its records from their rows."""

    __slots__ = ("offset", "outputs", "run_id", "seq", "wall0")

    def __init__(
        self, run_id: str, wall0: float, offset: float, outputs: dict[str, str], seq: int = 0
    ) -> None:
        self.run_id = run_id
        self.wall0 = wall0  # wall time of the memory run's zero
        self.offset = offset  # loop time + offset = wall time
        self.outputs = outputs  # id -> its output's JSON, taken when its row is built
        self.seq = seq  # the last admission number written

    def new_row(
        self,
        record: Record,
        payload: str,
        admitted: float,
        held: bool = False,
        took_key: bool = False,
    ) -> tuple[bool, tuple[Any, ...]]:
        """The row inserting a new task, and whether it is one for `_INSERT_LEAN` (`held`: see
        `state_row`; `took_key`: see `MemoryRun.took_key`)."""
        task = record.task
        self.seq += 1
        parent = record.parent
        lean, state = self.state_row(record, held)
        head = (
            self.run_id,
            record.id,
            self.seq,
            record.index,
            int(record.named),
            task.kind,
            payload,
            admitted + self.offset,
        )
        state = state[:-2]  # without the WHERE of an update
        if (
            lean
            and parent is None
            and not task.depends_on
            and not task.depends_on_tags
            and not task.tags
            and task.key is None
            and task.timeout is None
            and not task.critical
            and task.metadata is None
        ):
            return True, head + state
        if lean:  # the full row's state: the lean one with its NULLs put back
            p, st, at, tries, target, token, started, finished, output, agent = state
            state = (p, st, at, tries, target, None, None, token, None, None, started, finished,
                     output, agent, None, None, 0)  # fmt: skip
        return False, (
            *head,
            None if parent is None else parent.id,
            _json_list(task.depends_on),
            _json_list(task.depends_on_tags),
            _json_list(task.tags),
            task.key,
            int(took_key),
            task.timeout,
            int(bool(task.critical)),
            None if task.metadata is None else to_json(task.metadata, fallback=repr).decode(),
            *state,
        )

    def state_row(self, record: Record, held: bool = False) -> tuple[bool, tuple[Any, ...]]:
        """The row updating a task's state, and whether it is one for `_UPDATE_LEAN` (no retry,
        deadline, feedback or error to write). `held`: a ready task this process holds back
        (waiting for its key's result) is written claimed, so that no worker process claims it."""
        offset = self.offset
        state = CLAIMED if held and record.state is READY else record.state
        t_start = record.t_start
        if state in TERMINAL:
            finished = self.wall0 + record.finished
            output = self.outputs.pop(record.id, None)
            agent, error, error_type, defaulted = (
                record.agent,
                record.error,
                record.error_type,
                int(record.defaulted),
            )
        else:
            finished = None
            agent = error = error_type = output = None
            defaulted = 0
        if output is None and record.output is not None:  # a partial output kept on failure
            output = to_json(jsonable(record.output)).decode()
        due = record.due
        deadline = record.deadline
        tried = record.tried
        feedback = record.feedback
        if (
            due is None
            and deadline is None
            and tried is None
            and feedback is None
            and error is None
            and error_type is None
            and not defaulted
        ):
            return True, (
                record.priority,
                state,
                record.attempts,
                record.agent_tries,
                record.target,
                record.token,
                None if t_start is None else t_start + offset,
                finished,
                output,
                agent,
                self.run_id,
                record.id,
            )
        return False, (
            record.priority,
            state,
            record.attempts,
            record.agent_tries,
            record.target,
            None if tried is None else json.dumps(tried),
            None if feedback is None else json.dumps(feedback),
            record.token,
            None if due is None else due + offset,
            None if deadline is None else deadline + offset,
            None if t_start is None else t_start + offset,
            finished,
            output,
            agent,
            error,
            error_type,
            defaulted,
            self.run_id,
            record.id,
        )

    def shared_row(self, record: Record, held: bool = False) -> tuple[Any, ...]:
        """The row updating a task's state in a run workers claim from (`_UPDATE_SHARED`)."""
        lean, row = self.state_row(record, held)
        if lean:
            p, st, at, tries, target, token, started, finished, output, agent, run, task = row
            row = (p, st, at, tries, target, None, None, token, None, None, started, finished,
                   output, agent, None, None, 0, run, task)  # fmt: skip
        return (*row, int(record.state in TERMINAL))

    def attempt_row(self, task_id: str, a: Attempt) -> tuple[Any, ...]:
        return (
            self.run_id,
            task_id,
            a.number,
            a.agent,
            a.error_type,
            a.message,
            self.wall0 + a.started,
            a.duration,
            a.retry_in,
            a.traceback,
            a.status_code,
            a.api_error_type,
            a.request_id,
        )

    def failures(self, attempt_rows: list[Any]) -> dict[str, list[Attempt]]:
        """The failed attempts of the stored tasks, by task id, in order."""
        failures: dict[str, list[Attempt]] = {}
        for a in attempt_rows:
            failures.setdefault(a[0], []).append(
                Attempt(
                    number=a[1],
                    agent=a[2],
                    error_type=a[3],
                    message=a[4],
                    started=(a[5] or self.wall0) - self.wall0,
                    duration=a[6] or 0.0,
                    retry_in=a[7],
                    traceback=a[8],
                    status_code=a[9],
                    api_error_type=a[10],
                    request_id=a[11],
                )
            )
        return failures

    def took_key(self, row: Any) -> bool:
        return bool(row[32])

    def record(
        self, row: Any, stored: dict[str, tuple[Record, str]], failures: dict[str, list[Attempt]]
    ) -> Record:
        (task_id, parent, idx, named, kind, payload, depends_on, depends_on_tags, tags, key,
         timeout, critical, metadata, priority, state, attempts, agent_tries, target, tried,
         feedback, token, started, finished, output, agent, error, error_type, defaulted) = row[:28]  # fmt: skip
        task = Task(
            kind,
            json.loads(payload),
            id=task_id,
            priority=priority,
            depends_on=_list(depends_on),
            depends_on_tags=_list(depends_on_tags),
            tags=_list(tags),
            key=key,
            timeout=timeout,
            critical=bool(critical),
            metadata=None if metadata is None else json.loads(metadata),
        )
        record = Record(task, idx, None if parent is None else stored[parent][0], bool(named))
        record.state = state = STATES[state]  # the interned constant: states compare by `is`
        record.attempts = attempts
        record.agent_tries = agent_tries
        record.target = target
        record.tried = None if tried is None else json.loads(tried)
        record.feedback = None if feedback is None else json.loads(feedback)
        record.token = token
        record.failures = failures.get(task_id)
        if started is not None:
            record.t_start = started - self.offset
        if output is not None:
            record.output = json.loads(output)
        if state in TERMINAL:
            record.status = state  # type: ignore[assignment]
            record.agent = agent
            record.started = None if started is None else started - self.wall0
            record.finished = finished - self.wall0
            record.error = error
            record.error_type = error_type
            record.defaulted = bool(defaulted)
        stored[task_id] = (record, payload)
        return record


def _list(text: str | None) -> list[str]:
    return [] if text is None else json.loads(text)


def _json_list(value: Any) -> str | None:
    return json.dumps(list(value)) if value else None


def encode(tasks: Sequence[Any], where: str, first: int | None, store: object) -> list[Any]:
    """Each task's payload and its JSON (None for what admission refuses anyway), before anything
    is admitted: what a row cannot hold refuses the batch, naming the task and the field (`store`
    names the store in the message)."""
    out: list[Any] = []
    for i, task in enumerate(tasks):
        if not isinstance(task, Task):
            out.append(None)
            continue
        try:
            out.append((task.payload, to_json(task.payload).decode()))
        except PydanticSerializationError as exc:
            raise InputError(
                f"task {_named(task, where, first, i)}: payload cannot be stored as JSON "
                f"by {store!r}: {exc}",
                task_id=task.id,
                field="payload",
            ) from exc
        # What the memory run takes but a row cannot hold would fail the store's first
        # write, after agents ran: refused here, with the task and the field.
        priority = task.priority
        if type(priority) is int and not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            raise InputError(
                f"task {_named(task, where, first, i)}: priority {priority} does not fit "
                f"the 64-bit integer {store!r} keeps it in",
                task_id=task.id,
                field="priority",
            )
        if task.metadata is not None:
            try:  # as `new_row` writes it: what JSON cannot hold is shown by its repr
                to_json(task.metadata, fallback=repr)
            except PydanticSerializationError as exc:  # text that is not UTF-8
                raise InputError(
                    f"task {_named(task, where, first, i)}: metadata cannot be stored as "
                    f"JSON by {store!r}: {exc}",
                    task_id=task.id,
                    field="metadata",
                ) from exc
        for field in ("id", "key"):
            value = getattr(task, field)
            if type(value) is str and not value.isascii() and not _utf8(value):
                raise InputError(
                    f"task {_named(task, where, first, i)}: {field} {value!r} is not valid "
                    f"UTF-8 text (a lone surrogate?), which {store!r} cannot store",
                    task_id=task.id,
                    field=field,
                )
    return out


def _named(task: Task, where: str, first: int | None, i: int) -> str:
    """How an error names a task: its id, or where it came from when it has none yet."""
    given: str | None = task.id  # typed `str`: None until admission generates one
    if given is not None:
        return repr(given)
    return where if first is None else f"{where}[{first + i}]"


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
