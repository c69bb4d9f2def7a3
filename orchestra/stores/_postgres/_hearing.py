"""What a coordinator hears from the database, played into its run's mirror (`_run.py`).

- **Ends written elsewhere** (`take_in`): a worker's completion, a lease lost too often, heard
  from the feed (`_follow.heard`), are played into the mirror as if they had happened in this
  process (the task claimed there, ended with the database's outcome, its failed attempts and its
  spawns taken in, with what the database decided for their keys), so that the run's report,
  events, results and aggregate see every end once.
- **Keys another run holds** (`answered`, `keys_due`, `key_heard`): the database's answers for the
  keys of the run's tasks, admitted or spawned (`_keyed.admit_keys`, `ask_again`,
  `spawn_answers`): a stored result ends the task in the mirror as the database ended it
  (unexecuted); a key held elsewhere is waited for, until its finish is heard on the keys'
  channel or its holder's lease runs out (`_keys.Waiting`), then asked for again.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from ..._exceptions import InputError, StoreError
from ..._output import json_value
from ..._task import CLAIMED, RUNNING, SUCCEEDED, TERMINAL, Task
from . import _keys as keys
from ._rows import STATES, Rows

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable, Sequence

    from ..._record import Record
    from .._memory import MemoryRun
    from . import _follow as follow
    from . import _leases as leases
    from ._listen import Wakeup

__all__ = ("Hearing",)


class Hearing:
    """What one coordinator's run hears from the database (module docstring)."""

    def __init__(
        self,
        run_id: str,
        memory: MemoryRun,
        held: dict[str, leases.Claimed],
        rows: Rows,
        loop: asyncio.AbstractEventLoop | None,
        wakeup: Wakeup,
        keep_error: Callable[[BaseException], None],
    ) -> None:
        self.run_id = run_id
        self._memory = memory
        self._held = held  # the run's: the tasks it holds under a lease of the database
        self._rows = rows  # the run's reader of rows: its clocks
        self._loop = loop
        self._wakeup = wakeup
        self._keep_error = keep_error
        # Keys another run holds, waited for, and the tasks held back for each.
        self._waiting = keys.Waiting()
        self._key_tasks: dict[str, list[str]] = {}

    def next_look(self) -> float:
        """When the first hold waited for runs out, on the run's clock (``inf``: none)."""
        return self._waiting.next_look()

    def reconnected(self) -> None:
        """The listener listens again: what was announced meanwhile is lost, ask for every key."""
        self._waiting.hear_all()
        self._wakeup.set()

    def take_in(self, heard: follow.Heard) -> None:
        """Play the ends written elsewhere into the mirror, as if they had happened here."""
        memory = self._memory
        record_of = memory.by_id.get
        held = self._held
        offset = self._rows.offset
        # Successes with nothing more to take in (no failed attempt, no spawn, no default), the
        # ends a worker writes most: taken in by the batch (`MemoryRun.succeeded_elsewhere`), in
        # the order heard, any other end played in between, in its place.
        plain: list[tuple[Record, Any, str | None]] = []
        for row in heard.ends:
            record = record_of(row[0])
            if record is None or record.state in TERMINAL:
                continue  # ended here meanwhile (a cancel, a deadline): the mirror's is final
            if (
                row[1] == "succeeded" and row[4] is None and row[5] is None and not row[8]
                and not row[10] and not row[11]
            ):  # fmt: skip
                if held:  # (a task of this process's own agents: most are a worker's)
                    held.pop(row[0], None)
                record.attempts = row[6]
                started = row[7]
                if started is not None and record.t_start is None:
                    record.t_start = started - offset
                output = row[2]
                # (an agent that returns nothing, the common side-effect task: its JSON 'null'
                # known without a parser's call)
                value = None if output is None or output == "null" else json_value(output)
                plain.append((record, value, row[3]))
                continue
            if plain:
                memory.succeeded_elsewhere(plain)
                plain = []
            self._take_one(record, row, heard)
        if plain:
            memory.succeeded_elsewhere(plain)

    def _take_one(self, record: Record, row: Any, heard: follow.Heard) -> None:
        """Play one end into the mirror: its failed attempts, its spawns, its outcome."""
        memory = self._memory
        (task_id, state, output, agent, error, error_type, attempts, started, defaulted, *_) = row
        if self._held.pop(task_id, None) is not None or record.state in (CLAIMED, RUNNING):
            token = record.token  # ours once; another process ended it since
        else:
            token = memory.take(record)
        record.attempts = attempts
        more = heard.failures.get(task_id)
        if more:
            known = {a.number for a in record.failures or ()}
            new = [a for a in map(self._rows.attempt, more) if a.number not in known]
            record.failures = sorted([*(record.failures or ()), *new], key=lambda a: a.number)
        if started is not None and record.t_start is None:
            record.t_start = started - self._rows.offset
        value = None if output is None else json_value(output)
        children = [_task(spawn) for spawn in heard.spawned.get(task_id, ())]
        try:
            memory.settle(
                record, token, STATES[state], value, spawned=children, agent=agent,
                error=error, error_type=error_type, defaulted=defaulted,
            )  # fmt: skip
        except InputError as exc:  # the database took them: the mirror must too
            self._keep_error(
                StoreError(f"run {self.run_id!r}: the tasks {task_id!r} spawned: {exc}")
            )
        if heard.answers and children:
            # What the completion decided for the spawns' keys, played in before any later
            # end (one of what a reused spawn readied, say) is.
            self.answered({
                child.id: heard.answers[child.id]
                for child in children if child.id in heard.answers
            })  # fmt: skip

    def answered(self, answers: dict[str, keys.Answer]) -> None:
        """What the database answered for the keys of the run's tasks: a stored result ends the
        task here as it ended there (unexecuted); a key held elsewhere is waited for."""
        if not answers:
            return
        memory = self._memory
        for task_id, answer in answers.items():
            if isinstance(answer, keys.Stored):
                record = memory.record_of(task_id)
                if record is None or record.state in TERMINAL:
                    continue
                token = record.token if record.state in (CLAIMED, RUNNING) else memory.take(record)
                self._held.pop(task_id, None)
                memory.settle(
                    record, token, SUCCEEDED, json_value(answer.output), agent=answer.agent
                )
            elif isinstance(answer, keys.Held):
                record = memory.record_of(task_id)
                if record is not None and record.task.key is not None:
                    self.wait_key(record.task.key, task_id, answer.left)

    def wait_key(self, key: str, task_id: str, left: float) -> None:
        now = self._loop.time() if self._loop is not None else time.monotonic()
        self._waiting.wait(key, keys.Held("", "", "", left), now)
        self._key_tasks.setdefault(key, []).append(task_id)

    def keys_due(self) -> list[tuple[str, str]]:
        """The held-back tasks whose keys are to be asked for again now, as (key, task id)."""
        if not self._key_tasks:
            return []
        now = self._loop.time() if self._loop is not None else time.monotonic()
        return [
            (key, task_id)
            for key in self._waiting.due(now)
            for task_id in self._key_tasks.pop(key, ())
        ]

    def key_heard(self, channel: str, payload: str) -> None:
        now = self._loop.time() if self._loop is not None else time.monotonic()
        if self._waiting.heard(channel, payload, now):
            self._wakeup.set()


def _task(row: Sequence[Any]) -> Task:
    """A task as its row holds it (a spawned one, heard with its spawner's end: `Heard`)."""
    (task_id, kind, payload, priority, depends_on, depends_on_tags, tags, key, timeout,
     critical, metadata) = row  # fmt: skip
    return Task(
        kind, json.loads(payload), id=task_id, priority=priority, depends_on=depends_on or (),
        depends_on_tags=depends_on_tags or (), tags=tags or (), key=key, timeout=timeout,
        critical=critical, metadata=None if metadata is None else json.loads(metadata),
    )  # fmt: skip
