"""What a coordinator's run has not told the database yet, written behind it in order.

The run (`_run.py`) changes its mirror at once and queues the matching write here (`queue`): input
admitted, ends of its own tasks, failed attempts, tasks handed back to the queue, ends it decided,
priorities, the input's close. One writer task on the run's loop takes whatever queued while the
last batch was written and sends it as one job (`_jobs.apply`) to the store's database thread, so
that a burst of ends costs one round trip. Without a loop (a run driven by hand) each write is
made at once, blocking. A streamed input waits (`backpressure`) while more than `BACKLOG` of its
tasks are not written yet.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any, Final

from . import _jobs as jobs
from ._planner import Growth

if TYPE_CHECKING:
    from collections.abc import Callable
    from concurrent.futures import Future

    from ..._admission import Admission
    from ._coordinator import Lease
    from ._database import Database

__all__ = ("BACKLOG", "Behind")

BACKLOG: Final = 10_000
"""Input tasks written behind at most before a streamed input waits for the writer."""


class Behind:
    """The writes of one run not made yet, and the task that makes them (module docstring)."""

    def __init__(
        self,
        db: Database,
        run_id: str,
        lease: Lease,
        admission: Admission,
        loop: asyncio.AbstractEventLoop | None,
        applied: Callable[[jobs.Applied], None],
        failed: Callable[[BaseException], None],
    ) -> None:
        self._db = db
        self._job = (run_id, lease, admission, Growth())
        self._loop = loop
        self._applied = applied  # told what the database made of each batch
        self._failed = failed  # told when a batch failed: nothing more is written
        self._ops: list[tuple[str, Any]] = []
        self._backlog = 0  # input tasks among `_ops` and the batch being written
        self._drained: asyncio.Future[None] | None = None
        self._inflight: Future[Any] | None = None
        self._dirty = asyncio.Event() if loop is not None else None
        self._task = (
            None if loop is None else loop.create_task(self._write(), name=f"orchestra-pg:{run_id}")
        )
        self.stopped = False  # a batch failed: the rest is never written

    def queue(self, kind: str, op: Any) -> None:
        """Write `op` (a `_jobs.apply` operation of `kind`) after what is queued already."""
        self._ops.append((kind, op))
        if kind == "admit":
            self._backlog += len(op[0])
        if self._dirty is None:
            self.flush()
        else:
            self._dirty.set()

    def backpressure(self) -> asyncio.Future[None] | None:
        # A writer that stopped writes nothing more: its last future, resolved, would have the
        # input await it again and again, never yielding to the run that is failing.
        if self._backlog < BACKLOG or self._loop is None or self.stopped:
            return None
        if self._drained is None:
            self._drained = self._loop.create_future()
        return self._drained

    def flush(self) -> None:
        """Write what is queued now, blocking (a run driven by hand, or closing)."""
        ops, self._ops = self._ops, []
        if not ops or self.stopped:
            return
        try:
            done = self._db.call(jobs.apply, *self._job, ops)
        except BaseException as exc:
            self._stop(exc)
            return
        self._done(ops, done)

    def close(self) -> None:
        """Stop the writer task, wait for the batch it was writing, and write the rest."""
        if self._task is not None:
            self._task.cancel()
        inflight = self._inflight
        if inflight is not None:
            with contextlib.suppress(BaseException):  # its failure was reported already
                inflight.result()
        self.flush()

    async def _write(self) -> None:
        dirty = self._dirty
        assert dirty is not None
        while True:
            await dirty.wait()
            dirty.clear()
            ops, self._ops = self._ops, []
            if not ops:
                continue
            self._inflight = self._db.submit(jobs.apply, *self._job, ops)
            try:
                done = await asyncio.wrap_future(self._inflight)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                self._stop(exc)
                return
            self._done(ops, done)

    def _done(self, ops: list[tuple[str, Any]], done: jobs.Applied) -> None:
        self._backlog -= sum(len(op[0]) for kind, op in ops if kind == "admit")
        if self._backlog < BACKLOG and self._drained is not None:
            if not self._drained.done():
                self._drained.set_result(None)
            self._drained = None
        self._applied(done)

    def _stop(self, error: BaseException) -> None:
        self.stopped = True
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)  # (the run stops: its input waits no more)
        self._failed(error)
