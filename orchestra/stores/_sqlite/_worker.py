"""A worker process's side of a SQLite file: what `orchestra.stores._worker.Worker` asks of the
store it works for (its `Backend`), as calls of `_leases` in the file's writer thread.

The file keeps no clock of its own: lease expiries are the worker's ``time.time()`` (the file is on
one machine, whose processes share a clock), and the file's workers table is the worker's
registration, renewed with its leases (`_leases.beat`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

import anyio
from pydantic_core import to_json

from .._worker_run import ending, spawn_data
from . import _leases as leases

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Mapping, Sequence

    from ..._admission import Admission
    from ..._task import Attempt, Task, TaskResult
    from .._worker_run import Claim
    from ._leases import Claimed
    from ._store import SQLiteStore

__all__ = ("SQLiteWorkerBackend",)


class SQLiteWorkerBackend:
    """The claims, heartbeats and completions of a worker on `store`'s file."""

    def __init__(self, store: SQLiteStore) -> None:
        self.store = store
        self.lease = store.lease
        # A look at the file costs no write lock (`_leases.claim` reads first): often, as nothing
        # wakes an idle worker.
        self.poll = 0.1

    def name(self, suffix: str) -> str:
        return leases.identity(suffix)

    async def _call(self, job: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self.store.submit(job, *args))

    @contextlib.asynccontextmanager
    async def present(
        self, name: str, run_id: str | None, kinds: Sequence[str]
    ) -> AsyncIterator[None]:
        # Shielded: the row commits in the writer thread even when a cancel lands before the
        # answer is back, and only the `finally` takes it out again.
        with anyio.CancelScope(shield=True):
            await self._call(leases.register, name, run_id, kinds, time.time())
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await self._call(leases.unregister, name)

    async def claim(
        self, name: str, run_id: str | None, rooms: Mapping[str, int], room: int
    ) -> tuple[list[Claimed], bool]:
        batch, runs = await self._call(
            leases.claim, name, run_id, rooms, room, time.time(), self.lease
        )
        return batch, run_id is not None and run_id not in runs

    async def closed(self, run_id: str) -> bool:
        return bool(await self._call(_closed, run_id))

    async def wait(self, poll: float) -> None:
        await anyio.sleep(poll)

    async def heartbeat(self, name: str, held: Sequence[Claim]) -> set[tuple[str, str]]:
        kept, _ = await self._call(leases.beat, name, time.time(), self.lease)
        return {(c.run_id, c.id) for c in held if (c.run_id, c.id, c.token) not in kept}

    async def complete(
        self,
        name: str,
        wall0: float,
        ends: Sequence[tuple[Claim, TaskResult, Sequence[Attempt], Any]],
        notes: Sequence[tuple[Claim, Attempt]],
        admission: Admission | None,
    ) -> list[bool]:
        rows = [_end_row(wall0, claimed, result, spawned) for claimed, result, _, spawned in ends]
        attempts = [[_attempt_row(wall0, c, a) for a in failures] for c, _, failures, _ in ends]
        noted = [(c.run_id, c.id, c.token, _attempt_row(wall0, c, a)) for c, a in notes]
        accepted: list[bool] = await self._call(
            leases.complete, name, time.time(), rows, attempts, noted
        )
        return accepted

    async def release(self, name: str, held: Sequence[Claim] | None) -> int:
        which = None if held is None else [(c.run_id, c.id, c.token) for c in held]
        released: int = await self._call(leases.release, name, which)
        return released


def _attempt_row(wall0: float, claimed: Claim, a: Attempt) -> tuple[Any, ...]:
    return (claimed.run_id, claimed.id, a.number, a.agent, a.error_type, a.message,
            wall0 + a.started, a.duration, a.retry_in, a.traceback, a.status_code,
            a.api_error_type, a.request_id)  # fmt: skip


def _end_row(
    wall0: float,
    claimed: Claim,
    result: TaskResult,
    spawned: tuple[list[Task], set[str]] | None,
) -> tuple[Any, ...]:
    tasks, named_here = spawned if spawned is not None else (None, set())
    status, output, error, error_type, kept = ending(result, tasks)
    started = None if result.started is None else wall0 + result.started
    data = None if not kept else [spawn_data(t, t.id in named_here) for t in kept]
    return (
        status,
        output,
        result.agent,
        error,
        error_type,
        int(result.defaulted),
        result.attempts,
        started,
        time.time(),
        # Metadata is free data: what JSON cannot say is kept as its repr, as a coordinator
        # stores it (the payloads were checked at the spawn).
        None if not data else to_json(data, fallback=repr).decode(),
        claimed.run_id,
        claimed.id,
        claimed.token,
    )


def _closed(conn: Any, run_id: str) -> bool:
    row = conn.execute("SELECT state FROM runs WHERE id = ?", (run_id,)).fetchone()
    return row is not None and row[0] == "closed"
