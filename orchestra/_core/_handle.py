"""`RunHandle`: a run that goes on in the background, steered while it runs; `ResultStream`: its
results as they finish.

``handle = orch.start(input)`` starts a run in the orchestrator's task group and returns at once;
the handle pauses and resumes it, cancels some of its tasks, changes priorities, streams its
results (`handle.results()`, a `ResultStream`; `orch.stream(input)` is a run read that way), stops
it gracefully, and is awaited for its `RunResult`. It holds no state of the run
itself: every change goes through the run (and so through its store), which is what lets a durable
store give the same control over a run another process started.

Every control call is safe at any moment and idempotent: before the run has its tasks (the
decomposer still runs) a pause, a cancel or a priority change is kept and applied the moment the
tasks are admitted, before any attempt starts; after the end it does nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import anyio

from .._admission import check_new_priority
from .._config import finite
from .._exceptions import InputError, RunError
from ..stores._protocol import Selector
from ._report import Report
from ._status import snapshot, starting

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Generator

    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

    from .._result import RunResult
    from .._task import TaskResult
    from ._run import Run
    from ._status import RunStatus

__all__ = ("Cancellation", "ResultStream", "RunHandle")


@dataclass(frozen=True, slots=True)
class Cancellation:
    """What one `RunHandle.cancel(...)` did.

    `cancelled` are the tasks it ended (running attempts are cancelled through their own cancel
    scopes; waiting tasks are removed), `skipped` the dependents that can no longer run, each
    ended as skipped with the reason. `deferred` is True when the run had no tasks yet: the cancel
    is applied when they arrive, and what it did then is in the result's
    `metadata.cancellations`.
    """

    reason: str
    cancelled: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    deferred: bool = False

    def __bool__(self) -> bool:
        """True when the cancel ended (or, deferred, may end) some task."""
        return self.deferred or bool(self.cancelled or self.skipped)


class RunHandle:
    """A run going on in its orchestrator's task group (see `Orchestrator.start`).

    ``await handle`` gives the `RunResult` (or raises what the run raised: an `InputError` for a
    bad input); `done` says whether it is over and `result` holds it then.

    Control: `pause()` / `resume()`; `cancel(...)` by task id, kind, tag, agent or priority range;
    `reprioritize(task_id, priority)`; `stop(grace)`, a graceful end that returns the partial
    result. A stopped run ends with status "cancelled", `metadata.reason` says why, and each task
    it did not finish has an error record ("Stopped"); each cancel is listed in
    `metadata.cancellations`.

    Restart from a checkpoint: a run is known by its `run_id`, and the handle keeps nothing the
    store does not. With a durable store, ``orch.start(input, run_id=same)`` after a stop or a
    crash is meant to pick the run up where it stood (the succeeded tasks are not run again);
    the in-memory store forgets a run when it ends, so there a new start runs it all again.
    """

    def __init__(self, run_id: str, concurrency: int = 0) -> None:
        self.run_id = run_id
        self._concurrency = concurrency
        self._last: RunStatus | None = None  # the run's last status, once it is over
        self._run: Run | None = None
        self._open = False  # the run has its store and its admitted input
        self._paused = False
        self._pending: list[Callable[[Run], object]] = []  # control calls made before `_open`
        self._stop_reason: str | None = None
        self._wake: anyio.Event | None = None  # a stop waits: no attempt runs any more, or over
        self._over = anyio.Event()
        self._admitted = anyio.Event()  # `_opened`, or the run is over
        self._scope = anyio.CancelScope()  # the driver's: a stop before the run has its tasks
        self._result: RunResult | None = None
        self._error: BaseException | None = None
        self._send: MemoryObjectSendStream[TaskResult] | None = None
        self._results: ResultStream | None = None
        self._t0 = datetime.now(UTC)

    def __repr__(self) -> str:
        state = "done" if self.done else "paused" if self._paused else "running"
        return f"<RunHandle {self.run_id!r} {state}>"

    # -- what the orchestrator calls -------------------------------------------------------------

    async def _drive(self, body: Callable[[], Awaitable[RunResult]]) -> None:
        """Run `body` (the orchestrator's run of this handle's input) and keep how it ended."""
        try:
            with self._scope:
                self._result = await body()
            if self._scope.cancelled_caught and self._result is None:
                # Stopped before the run had its tasks (the decomposer was still at work).
                self._result = _nothing_ran(self.run_id, self._t0, self._stop_reason)
        except Exception as exc:
            self._error = exc
        except BaseException:
            self._error = RunError(
                f"run {self.run_id!r} was cancelled with its orchestrator (its `async with` "
                "ended before the run did)"
            )
            raise
        finally:
            if self._send is not None:
                self._send.close()
            if self._run is not None:
                self._last = snapshot(self._run)
            self._run = None
            self._over.set()
            self._admitted.set()
            self._signal()

    def _attach(self, run: Run) -> None:
        self._run = run
        run.on_open = self._opened
        if self._send is not None:
            run.attach_results(self._send)

    def _opened(self) -> None:
        run = self._run
        assert run is not None
        self._open = True
        dispatcher = run.dispatcher
        dispatcher.on_drained = self._signal
        if self._paused:
            dispatcher.pause()
        pending, self._pending = self._pending, []
        for call in pending:
            call(run)
        if self._stop_reason is not None:
            run.stop(self._stop_reason)
        self._admitted.set()
        self._signal()

    # -- state -----------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """Whether the run is over."""
        return self._over.is_set()

    @property
    def result(self) -> RunResult | None:
        """The `RunResult` once the run is over (None before, or if it raised)."""
        return self._result

    @property
    def paused(self) -> bool:
        """Whether the run is paused (`pause()` without a `resume()` since)."""
        return self._paused

    def status(self) -> RunStatus:
        """The run's `RunStatus` now: counts, progress, throughput, ETA, agents, queue,
        bottleneck (see "Watching a run"). Cheap enough to poll often; its last one once over."""
        run = self._run
        if run is not None:
            return snapshot(run)
        if self._last is not None:
            return self._last
        return starting(self.run_id, self._concurrency)

    async def admitted(self) -> None:
        """Wait until the run has admitted its input (for a streamed input, its first part), so
        that a bad input is known: raises what the run raised (an `InputError` naming the task and
        the field) when it ended before. A service answers a submission once it returns."""
        await self._admitted.wait()
        if self._error is not None:
            raise self._error

    def __await__(self) -> Generator[Any, None, RunResult]:
        return self._wait().__await__()

    async def _wait(self) -> RunResult:
        await self._over.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    # -- control ---------------------------------------------------------------------------------

    def pause(self) -> None:
        """Start no new attempt; the running ones finish (and may schedule retries).

        Time goes on while paused: retry timers come due (the task then waits for `resume`), task
        deadlines and the run timeout keep counting.
        """
        if self.done or self._paused:
            return
        self._paused = True
        if self._open and self._run is not None:
            self._run.dispatcher.pause()

    def resume(self) -> None:
        """Start attempts again after `pause()`. Does nothing on a run that is being stopped."""
        if self.done or not self._paused:
            return
        self._paused = False
        if self._open and self._run is not None and self._stop_reason is None:
            self._run.dispatcher.resume()

    def cancel(
        self,
        *,
        task_id: str | Iterable[str] | None = None,
        kind: str | None = None,
        tag: str | None = None,
        agent: str | None = None,
        priority: tuple[int, int] | None = None,
        reason: str | None = None,
    ) -> Cancellation:
        """Cancel the unfinished tasks that match every selector given (at least one).

        Running attempts are cancelled through their own cancel scopes (the run goes on with
        the next task), waiting tasks are removed, and the dependents of all of them are skipped
        with the reason. `agent` selects the tasks running on that agent, waiting for room at it
        (its lane) or bound to it by a retry or a fallback chain. Returns what it did; the run
        goes on with the rest (a run whose every task was cancelled ends "failed", not
        "cancelled": only `stop()` cancels the run itself).
        """
        selector, described = _selector(task_id, kind, tag, agent, priority)
        if reason is None:
            reason = (
                "cancelled by RunHandle.cancel("
                + ", ".join(f"{k}={v!r}" for k, v in described.items())
                + ")"
            )
        elif not isinstance(reason, str):
            raise InputError(f"reason must be a str, got {reason!r}", field="reason")
        if self.done:
            return Cancellation(reason)
        if not self._open or self._run is None:
            self._pending.append(
                lambda run: run.control.cancel_standing(selector, reason, described)
            )
            return Cancellation(reason, deferred=True)
        done = self._run.control.cancel(selector, reason, described)
        return Cancellation(reason, tuple(done.cancelled), tuple(done.skipped))

    def reprioritize(self, task_id: str, priority: int) -> bool:
        """Change the priority of a task that waits (in the queue, or for its agent's slot);
        True if it did. Before the run has its tasks the change is kept for them (True); after
        the end, False."""
        if not isinstance(task_id, str):
            raise InputError(f"task_id must be a str, got {task_id!r}", field="task_id")
        check_new_priority(task_id, priority)
        if self.done:
            return False
        if not self._open or self._run is None:
            self._pending.append(lambda run: run.control.reprioritize_standing(task_id, priority))
            return True
        return self._run.control.reprioritize(task_id, priority)

    def results(self) -> ResultStream:
        """The `TaskResult`s of the tasks that finish from now on: ``async for r in
        handle.results()``. Call it right after `start` to see every one.

        Only a handle asked for its results gets them (a run nobody reads keeps none), and unread
        results count against the run's `window`, so a slow reader slows a streamed input's
        admission instead of buffering a million results. Every call returns the same iterator;
        closing it stops the reading, not the run.
        """
        if self._results is None:
            return ResultStream(self)  # it opens itself on this handle (`_open_results`)
        return self._results

    def _open_results(self, stream: ResultStream) -> MemoryObjectReceiveStream[TaskResult]:
        """`stream` is this run's reader from now on: the receiving end of its `TaskResult`s."""
        self._results = stream
        # Unbounded as a stream (the run must never wait for its reader), bounded as a run: unread
        # results count against the run's window, so a slow reader slows admission instead of
        # the run buffering its results.
        send, receive = anyio.create_memory_object_stream["TaskResult"](math.inf)
        if self.done:
            send.close()
        else:
            self._send = send
            if self._run is not None:
                self._run.attach_results(send)
        return receive

    async def stop(self, grace: float | None = None, *, reason: str | None = None) -> RunResult:
        """End the run gracefully and return its `RunResult` (status "cancelled").

        No new attempt starts; the running ones get `grace` seconds to finish (None: as long as
        they take), then the rest is cancelled: running attempts through their cancel scopes,
        waiting tasks ended as cancelled ("Stopped", with `reason`). ``stop(grace=0)`` cancels at
        once. A second `stop` with a shorter grace shortens the wait; on a run that is over, it
        returns the result as it is.
        """
        if grace is not None and (
            isinstance(grace, bool)
            or not isinstance(grace, int | float)
            or not grace >= 0  # NaN too
            or (grace != math.inf and not finite(grace))  # inf waits forever; 10**400 fails
        ):
            raise InputError(f"grace must be a number >= 0 or None, got {grace!r}", field="grace")
        if not self.done:
            if self._stop_reason is None:
                self._stop_reason = reason or (
                    "stopped" if grace is None else f"stopped (grace {grace:g}s)"
                )
            run = self._run
            if self._open and run is not None:
                run.stopping = True
                run.dispatcher.pause()
            with anyio.move_on_after(math.inf if grace is None else grace):
                await self._until_settled()
            self._end_now()
        return await self._wait()

    def _signal(self) -> None:
        wake, self._wake = self._wake, None
        if wake is not None:
            wake.set()

    async def _until_settled(self) -> None:
        """Until no attempt runs (the run is paused) or the run is over."""
        while not self.done:
            run = self._run
            if self._open and run is not None and not run.dispatcher.running:
                return
            if self._wake is None:
                self._wake = anyio.Event()
            await self._wake.wait()

    def _stop_now(self, reason: str) -> None:
        """End the run at once with `reason` (or, without tasks yet, its driver)."""
        if self.done:
            return
        if self._stop_reason is None:
            self._stop_reason = reason
        self._end_now()

    def _end_now(self) -> None:
        """The grace period is over: end the run (or, without tasks yet, its driver)."""
        if self.done:
            return
        if self._open and self._run is not None:
            self._run.stop(self._stop_reason or "stopped")
        else:
            self._scope.cancel()


class ResultStream:
    """The `TaskResult`s of a run as they finish: ``async for r in orch.stream(x)``, or
    ``handle.results()``; `result` is the run's `RunResult` once it is over.

    A stream from `orch.stream(...)` owns its run: the run starts when the stream is first read
    (a stream closed before that never starts it), closing the stream before its end stops the
    run, and what the run raised (an `InputError`) is raised at the end of the loop. A handle's
    stream only reads: closing it stops the reading, the run goes on, and the handle has the
    error.
    """

    def __init__(
        self, handle: RunHandle | None = None, start: Callable[[], RunHandle] | None = None
    ) -> None:
        self._handle = handle
        self._start = start  # `orch.stream(...)`'s: starts the run this stream owns
        self._receive = handle._open_results(self) if handle is not None else None
        self._closed = False

    @property
    def result(self) -> RunResult | None:
        """The run's `RunResult` once it is over (None before, if it raised, or if it never
        started)."""
        return None if self._handle is None else self._handle.result

    def __aiter__(self) -> ResultStream:
        return self

    def __del__(self) -> None:
        # A reader that goes away unfinished closes its end: the run then drops its results
        # instead of buffering them for nobody.
        if self._receive is not None:
            self._receive.close()

    async def __anext__(self) -> TaskResult:
        handle = self._handle
        if handle is None:
            if self._closed or self._start is None:  # closed before it was read: never starts
                raise StopAsyncIteration
            handle = self._handle = self._start()
            self._receive = handle._open_results(self)
        assert self._receive is not None  # opened with the handle
        try:
            result = await self._receive.receive()
        except anyio.EndOfStream:
            self._receive.close()
            if self._start is not None:  # its own run: what it raised is the reader's
                await handle._over.wait()
                if handle._error is not None:
                    raise handle._error from None
            raise StopAsyncIteration from None
        except anyio.ClosedResourceError:  # read again after its end, or after aclose()
            raise StopAsyncIteration from None
        run = handle._run
        if run is not None:
            run.input.room_freed()  # room in the window: the input may go on
        return result

    def ready(self) -> list[TaskResult]:
        """The results that are here already, taken without waiting (an empty list when none
        is, or the stream is not open yet): after one ``async for`` step, a reader that takes a
        burst of ends at once wakes once for it, not once a result (each wait is a turn of the
        loop)."""
        receive = self._receive
        if receive is None:
            return []
        taken: list[TaskResult] = []
        while True:
            try:
                taken.append(receive.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break  # the stream's end is for `__anext__` to report
        run = None if self._handle is None else self._handle._run
        if taken and run is not None:
            run.input.room_freed()  # room in the window: the input may go on
        return taken

    async def aclose(self) -> None:
        """Stop reading. A stream of `orch.stream(...)` also stops its run if it is still going
        (what runs is cancelled, what waits ends cancelled) and waits for it to end: `result` is
        then its `RunResult`, status "cancelled"."""
        self._closed = True
        handle = self._handle
        if handle is None or self._receive is None:
            return
        if self._start is not None:
            handle._stop_now("the stream was closed before its end")
            await handle._over.wait()
        self._receive.close()

    async def __aenter__(self) -> ResultStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _selector(
    task_id: str | Iterable[str] | None,
    kind: str | None,
    tag: str | None,
    agent: str | None,
    priority: tuple[int, int] | None,
) -> tuple[Selector, dict[str, Any]]:
    """The `Selector` of a cancel, and its description for the record; `InputError` when no
    selector is given or one is of the wrong type."""
    described: dict[str, Any] = {}
    ids: list[str] | None = None
    if task_id is not None:
        ids = [task_id] if isinstance(task_id, str) else _ids(task_id)
        described["task_id"] = ids[0] if isinstance(task_id, str) else ids
    for name, value in (("kind", kind), ("tag", tag), ("agent", agent)):
        if value is not None:
            if not isinstance(value, str):
                raise InputError(f"{name} must be a str, got {value!r}", field=name)
            described[name] = value
    if priority is not None:
        if (
            not isinstance(priority, tuple)
            or len(priority) != 2
            or any(type(p) is not int for p in priority)
            or priority[0] > priority[1]
        ):
            raise InputError(
                f"priority must be a range (low, high) of ints with low <= high, got {priority!r}",
                field="priority",
            )
        described["priority"] = list(priority)
    if not described:
        raise InputError(
            "cancel() needs at least one of task_id=, kind=, tag=, agent=, priority= "
            "(to end the whole run, use stop())"
        )
    selector = Selector(task_ids=ids, kind=kind, tag=tag, agent=agent, priority=priority)
    return selector, described


def _ids(task_ids: object) -> list[str]:
    if not isinstance(task_ids, Iterable) or isinstance(task_ids, bytes | bytearray):
        raise InputError(
            f"task_id must be a str or an iterable of str, got {task_ids!r}", field="task_id"
        )
    ids = list(task_ids)
    for one in ids:
        if not isinstance(one, str):
            raise InputError(f"task ids must be str, got {one!r}", field="task_id")
    return ids


def _nothing_ran(run_id: str, wall0: datetime, reason: str | None) -> RunResult:
    """The result of a run stopped before it had any task."""
    report = Report()
    report.cancelled = True
    report.reason = reason or "stopped"
    elapsed = (datetime.now(UTC) - wall0).total_seconds()
    return report.result(
        run_id=run_id,
        wall0=wall0,
        elapsed=elapsed,
        threshold=1.0,
        data=None,
        events_dropped=0,
    )
