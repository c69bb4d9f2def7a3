"""The SQLite store: runs kept in a database file, so that a run survives its process.

`SQLiteStore` is the file: its settings, its one writer thread, the runs this object has open, and
what a user reads of it. Each run is a `SQLiteRun` (`_run.py`): a memory run written behind to
the file. The rest, by concept:

- `_window.py`: what a run changed, written once a window; backpressure on the writer
- `_rows.py`: a task's record as a row, and back; what a row cannot hold, refused
- `stores/_resume.py` (shared with PostgreSQL): a run taken back from its rows, its input matched
- `_keys.py`: idempotency keys claimed, waited for and reused through the file
- `_share.py`: a run shared with worker processes, the coordinator's side
- `_writer.py`: the one connection and the thread that uses it
- `_writes.py`, `_leases.py`, `_admin.py`: the SQL of a run, of the claims
  shared with worker processes (`_worker.py`), and of the reads behind ``orchestra runs``
- `_schema.py`: the tables and their migrations
"""

from __future__ import annotations

import os
import time
import uuid
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._config import finite
from ..._exceptions import ConfigError, InputError
from . import _admin as admin
from ._run import SQLiteRun
from ._writer import Writer

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from concurrent.futures import Future

    from ..._admission import Admission
    from .._protocol import Listener

__all__ = ("SQLiteStore",)


class SQLiteStore:
    """Keeps runs in a SQLite database file: a run survives its process and resumes by run id.

    Args:
        path: the database file (created, with its schema, when missing).
        window: seconds between commits; a killed process loses at most the results of the
            window being gathered and of the two (at most) waiting for the writer thread, whose
            backlog holds the run back (their tasks run again on resume).
        key_lease: seconds after which an idempotency key claimed by a store that stopped
            committing (a killed process) is taken over by another submitter of the key.
        lease: seconds a worker process's claim of a task lasts without being renewed (its
            heartbeat renews it every `lease` / 3): a worker killed or paused longer loses its
            tasks, which run again elsewhere with the attempt counted; and seconds after which a
            coordinator that stopped beating (another host's; on this host a dead pid is seen at
            once) no longer holds its run against a second coordinator.
        busy_timeout: seconds a write waits for another process's lock on the file (SQLite's
            busy timeout) before it fails with `StoreError` ("another process holds it locked").
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        window: float = 0.05,
        key_lease: float = 30.0,
        lease: float = 30.0,
        busy_timeout: float = 10.0,
    ) -> None:
        if not isinstance(path, str | os.PathLike) or path == "":
            # pathlib would raise a TypeError, or take "" for the current directory.
            raise ConfigError(f"SQLiteStore path must be a file path (str or Path), got {path!r}")
        for name, value in (
            ("window", window),
            ("key_lease", key_lease),
            ("lease", lease),
            ("busy_timeout", busy_timeout),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{name} must be a number of seconds, got {value!r}")
            if not finite(value) or not value > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        if key_lease <= window:
            raise ConfigError(
                f"key_lease ({key_lease}) must be longer than window ({window}): a live claim "
                "is refreshed once a window"
            )
        if lease <= 3 * window:
            raise ConfigError(
                f"lease ({lease}) must be longer than three windows ({3 * window}): a lease is "
                "renewed a few times before it can expire"
            )
        self.path = Path(path)
        self.window = float(window)
        self.key_lease = float(key_lease)
        self.lease = float(lease)
        self.owner = uuid.uuid4().hex  # whose claims of idempotency keys are this store's
        self.busy_timeout = float(busy_timeout)
        self._writer = Writer(self.path, self.busy_timeout)
        self._closer = weakref.finalize(self, self._writer.stop)
        # Successes of keyed tasks not committed yet, across this store's runs: key -> (output
        # JSON, agent). A key's stored result is found here first, then in the file.
        self.unwritten_keys: dict[str, tuple[str, str | None]] = {}
        # This store's runs by id while they are open: the file cannot tell two of them apart
        # (one name, `leases.identity(owner)`), so a second one of a run id is refused here.
        self.open_runs: weakref.WeakValueDictionary[str, SQLiteRun] = weakref.WeakValueDictionary()

    def __repr__(self) -> str:
        return f"SQLiteStore({str(self.path)!r})"

    # -- the writer thread -----------------------------------------------------------------------

    def submit(self, job: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run `job(conn, *args)` in the writer thread; its `sqlite3` errors become `StoreError`."""
        return self._writer.submit(job, args)

    def call(self, job: Callable[..., Any], *args: Any) -> Any:
        """`submit` and wait for the answer."""
        return self.submit(job, *args).result()

    def close(self) -> None:
        """Close the database (the store closes itself when it is garbage collected, too)."""
        self._closer()

    # -- the Store protocol ----------------------------------------------------------------------

    def open_run(
        self,
        run_id: str,
        *,
        admission: Admission,
        listener: Listener,
        clock: Callable[[], float],
        task_timeout: float | None,
        compact: bool,
    ) -> SQLiteRun:
        return SQLiteRun(self, run_id, admission, listener, clock, task_timeout, compact)

    # -- reading ---------------------------------------------------------------------------------

    def runs(self) -> list[dict[str, Any]]:
        """Every run in the file, oldest first, with its task counts by state."""
        return self.call(admin.runs)  # type: ignore[no-any-return]

    def latest_runs(
        self, limit: int, *, after: str | None = None, state: str | None = None
    ) -> list[dict[str, Any]]:
        """The newest runs of the file first, at most `limit`, as `runs` gives them: with
        `after` (a run's id: the last of the page before), those listed after it; with `state`
        (``open``, ``closed``), of that state only. A page costs the same however many runs the
        file holds.

        Raises:
            InputError: `after` names no run of the file.
        """
        return self.call(admin.latest, limit, after, state)  # type: ignore[no-any-return]

    def run_info(self, run_id: str, *, counts: bool = True) -> dict[str, Any] | None:
        """One run of the file as `runs` gives it (its task counts by state), or None when the
        file has no such run: for a reader that follows one run (the service's event stream).
        Without `counts`, no ``counts`` (they scan the run's tasks)."""
        return self.call(admin.run, run_id, counts)  # type: ignore[no-any-return]

    def events(
        self, run_id: str, task_id: str | None = None, *, since: float | None = None
    ) -> list[dict[str, Any]]:
        """The journal of a run (of one task, with `task_id`), in order: dicts with `seq` (None for
        an event read from the task's row), `run_id`, `task_id`, `at` (wall time), `event`
        (``admitted``, ``ready``, ``started``, ``attempt_failed``, ``retried``, or the end:
        ``succeeded``, ``failed``, ``skipped``, ``cancelled``), `agent`, `attempt`, `detail`. With `since` (wall
        time), the events from then on only (a reader that follows the journal asks for what is
        new).

        Raises:
            InputError: the file has no such run, or the run no such task.
        """
        return self.call(admin.events, run_id, task_id, since)  # type: ignore[no-any-return]

    def workers(self) -> list[dict[str, Any]]:
        """The worker processes of the file (`Orchestrator.work`, ``orchestra worker``), oldest
        first: `owner` (``host:pid:id``), `host`, `pid`, `run_id` (the one run it serves, or
        None), `kinds` (None: every kind it has agents for), `started` and `heartbeat` (wall
        time), `live` (its heartbeat is younger than `lease`), `claimed`, `completed`, and
        `holding` (tasks it holds now). A worker that stopped cleanly is not listed."""
        return self.call(admin.workers, time.time(), self.lease)  # type: ignore[no-any-return]

    def dead_letters(self, run_id: str) -> list[dict[str, Any]]:
        """The tasks of a run that failed for good, each with every attempt (`attempts_list`, with
        its traceback) and the agent of the last (`agent`); `InputError` if the file has no such
        run."""
        return self.call(admin.dead, run_id)  # type: ignore[no-any-return]

    def retry(self, run_id: str, task_ids: Iterable[str] | None = None) -> list[str]:
        """Make the failed tasks of a run (or those of `task_ids`) runnable again: the next
        ``orch.run(..., run_id=run_id)`` on this file runs them, their attempts kept (the count,
        and every failed one among the dead letters' history), the chain of agents from its
        start. The run's skipped tasks are reopened too (skipped again if what they wait for still
        failed). Returns the ids of the failed tasks reopened.

        Raises:
            InputError: no such run, or a task of `task_ids` that is not a failed task of it.
        """
        if isinstance(task_ids, str):
            raise InputError(
                "task_ids must be a collection of ids, not one string", field="task_ids"
            )
        ids = None if task_ids is None else [str(i) for i in task_ids]
        return self.call(admin.retry, run_id, ids, time.time())  # type: ignore[no-any-return]
