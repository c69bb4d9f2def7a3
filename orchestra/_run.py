"""One run, top to bottom: admit the input, let the dispatcher work, settle every task once, report.

`Run.execute` is the whole story: check a whole input before anything starts (or stream it in with
backpressure), start the workers, wait until every admitted task is terminal (or the run timeout
passes), and build the `RunResult`. `_settle` is the one terminal transition: it counts the task,
folds it into the aggregate, readies or skips its dependents and groups, and streams the result.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterable, Iterable, Sequence
from datetime import UTC, datetime
from itertools import islice
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import structlog

from ._dispatch import Capacity, Dispatcher, RunConfig
from ._events import RunFinished, RunStarted, TaskFinished
from ._exceptions import InputError
from ._graph import Graph, Group, Node
from ._report import Report
from ._task import CANCELLED, PENDING, READY, SKIPPED, SUCCEEDED, TERMINAL, Task

if TYPE_CHECKING:
    from collections.abc import Mapping

    from anyio.streams.memory import MemoryObjectSendStream

    from ._aggregate import Accumulator
    from ._result import RunResult
    from ._task import TaskResult

__all__ = ("Capacity", "Node", "Run", "RunConfig")

log = structlog.get_logger("orchestra")

_GC_PAUSE_BATCH = 1_000  # admissions at least this large pause the cyclic GC (see `_admit`)
_CHUNK = 1_024  # a plain iterable input is admitted this many tasks at a time


class Run(Dispatcher):
    """The state of one run: its graph, its report, and the loop of `Dispatcher`."""

    def __init__(
        self,
        config: RunConfig,
        run_id: str,
        results: MemoryObjectSendStream[TaskResult] | None = None,
    ) -> None:
        super().__init__(config, run_id)
        self.graph = Graph(self.registry.by_kind)
        self.report = Report()
        self._results = results
        self._acc: Accumulator = config.aggregate.begin()
        self._window = config.window
        self._done = anyio.Event()
        self._window_free: anyio.Event | None = None
        self._input_error: Exception | None = None
        self._debug = _debug_enabled()
        self._cascade: list[tuple[Node, str]] = []
        self._compact = False  # a streamed run forgets succeeded tasks as it goes
        self._agg_error: str | None = None

    async def execute(self, source: Iterable[Task] | AsyncIterable[Task]) -> RunResult:
        self._time = asyncio.get_running_loop().time  # virtual under a FakeClock
        self.t0 = self._time()
        wall0 = datetime.now(UTC)
        whole = isinstance(source, list | tuple)
        self._compact = not whole
        dropped = self.bus.dropped
        if self.bus.active:
            self.bus.emit(RunStarted(self.t0, self.run_id))
        if whole:  # a whole input is checked before anything runs
            self._admit(source, where="tasks", forward=True)  # type: ignore[arg-type]
            self._input_done()
        capacity = self.config.capacity
        capacity.runs.append(self)
        timed_out = False
        with structlog.contextvars.bound_contextvars(run_id=self.run_id):
            log.info("run started", tasks=self._open if whole else "streamed")
            try:
                async with asyncio.TaskGroup() as pool:
                    self._start_workers(pool)
                    if not whole:
                        self._spawn(self._feed(source))
                    self._check_done()
                    with anyio.move_on_after(self.config.timeouts.run) as scope:
                        await self._done.wait()
                    timed_out = scope.cancelled_caught
                    self._cancel_all()  # parked workers, retry sleepers, the watcher, the feeder
            finally:
                capacity.runs.remove(self)
                if self._results is not None:
                    self._results.close()
            if self._input_error is not None:
                raise self._input_error
            if timed_out:
                self.report.reason = f"run timeout after {self.config.timeouts.run}s"
                for node in self.graph.unfinished():
                    self._settle(
                        node, CANCELLED, None, error=self.report.reason, error_type="RunTimeout"
                    )
            result = self._result(wall0, self.bus.dropped - dropped)
            log.info(
                "run finished", status=result.status, elapsed=round(result.metadata.elapsed, 6)
            )
        if self.bus.active:
            self.bus.emit(
                RunFinished(self._time(), self.run_id, result.status, result.metadata.elapsed)
            )
        return result

    def _result(self, wall0: datetime, dropped: int) -> RunResult:
        data = None
        if self._agg_error is None:
            try:
                data = self._acc.finish()
            except Exception as exc:  # a user's reducer must not lose the run's result
                self._aggregator_failed(exc)
        if self._agg_error is not None:
            self.report.reason = self._agg_error
        return self.report.result(
            self.graph.live(),
            run_id=self.run_id,
            wall0=wall0,
            elapsed=self._time() - self.t0,
            threshold=self.config.success_threshold,
            data=data,
            events_dropped=dropped,
        )

    # -- admission -------------------------------------------------------------------------------

    def _admit(
        self,
        tasks: Sequence[Any],
        *,
        where: str,
        forward: bool,
        closed_ok: bool = True,
        first_index: int = 0,
        parent: Node | None = None,
    ) -> None:
        # A large batch allocates a node per task, and all of them survive: left on, the cyclic
        # garbage collector would walk them again and again while they are built, which costs as
        # much as the admission itself. It is paused for this synchronous loop (only payload
        # validation runs user code here) and restored right after.
        pause = len(tasks) >= _GC_PAUSE_BATCH and gc.isenabled()
        if pause:
            gc.disable()
        try:
            new, skipped = self.graph.admit(
                tasks,
                where=where,
                forward=forward,
                closed_groups_ok=closed_ok,
                first_index=first_index,
                parent=parent,
            )
        finally:
            if pause:
                gc.enable()
        self._open += len(new)
        for node, reason in skipped:
            self._settle(node, SKIPPED, None, error=reason, error_type="DependencyFailed")
        for node in new:
            if node.waiting == 0 and node.state is PENDING:
                self._ready(node)

    def _admit_spawned(self, tasks: list[Task], parent: Node) -> None:
        self._admit(
            tasks,
            where=f"tasks spawned by {parent.id!r}",
            forward=False,
            closed_ok=False,
            parent=parent,
        )

    async def _feed(self, source: Iterable[Task] | AsyncIterable[Task]) -> None:
        """Admit a streamed input, with backpressure (at most `window` tasks unfinished, unless
        none can progress without more input: see `_wait_for_window`).

        What the input raises (an `InputError` for a bad task, or the source's own error) ends the
        run and reaches the caller as it is; the source is closed however the run ends."""
        pulled = 0
        try:
            if isinstance(source, AsyncIterable):
                async for task in source:  # each item admitted as soon as it arrives
                    if self._open >= self._window and self._active:
                        await self._wait_for_window()
                    node, skip = self.graph.admit_one(task, pulled)
                    pulled += 1
                    self._open += 1
                    if skip is not None:
                        self._settle(node, SKIPPED, None, error=skip, error_type="DependencyFailed")
                    elif not node.waiting:
                        self._ready(node)
            else:  # a plain iterable never waits: admit it in chunks, as the window allows
                iterator = iter(source)
                while True:
                    await self._wait_for_window()
                    chunk = list(islice(iterator, max(1, min(_CHUNK, self._window - self._open))))
                    if not chunk:
                        break
                    self._admit(chunk, where="input item", forward=False, first_index=pulled)
                    pulled += len(chunk)
                    await anyio.lowlevel.checkpoint()  # let the workers start on it
        except Exception as exc:
            self._input_error = exc
            self._finish()
            return
        finally:
            with anyio.CancelScope(shield=True):
                await _close(source)
        self._input_done()
        self._check_done()

    async def _wait_for_window(self) -> None:
        # Every unfinished task counts; but when none is ready or running (all wait for
        # dependencies or groups that only the rest of the input can complete), more input is
        # the only way forward, and it is let in.
        while self._open >= self._window and self._active:
            event = self._window_free = anyio.Event()
            await event.wait()

    def _input_done(self) -> None:
        self.graph.source_done = True
        for tag, group in self.graph.groups.items():
            self._maybe_close(tag, group)

    def check_spawn(self, task: Task, parent: Node, pending: list[Task]) -> None:
        """`ctx.spawn`: check a task now; it is admitted when the spawning attempt succeeds."""
        graph = self.graph
        graph.check(task, f"task spawned by {parent.id!r}")
        known = {p.id for p in pending}
        if graph.known(task.id) or task.id in known:
            raise InputError(
                f"task {parent.id!r} spawns duplicate task id {task.id!r}",
                task_id=task.id,
                field="id",
            )
        for dep in task.depends_on:
            if not graph.known(dep) and dep not in known:
                raise InputError(
                    f"task {task.id!r} (spawned by {parent.id!r}) depends on unknown task {dep!r}",
                    task_id=task.id,
                    field="depends_on",
                )
        for tag in task.tags:
            group = graph.groups.get(tag)
            if group is not None and group.closed:
                raise InputError(
                    f"task {parent.id!r} spawns {task.id!r} into group {tag!r}, which is closed",
                    task_id=task.id,
                    field="tags",
                )

    def deps_of(self, node: Node) -> dict[str, Any]:
        return self.graph.deps_of(node)

    def record_usage(self, cost: float, tokens: Mapping[str, int]) -> None:
        self.report.usage(cost, tokens)

    # -- the terminal transition -----------------------------------------------------------------

    def _settle(
        self,
        node: Node,
        status: str,
        output: Any,
        *,
        agent: str | None = None,
        error: str | None = None,
        error_type: str | None = None,
        defaulted: bool = False,
    ) -> None:
        """Put `node` in a terminal state, once, and skip what can no longer run because of it."""
        cascade = self._cascade  # what to skip next; empty between calls (one list per run)
        while True:
            if node.state not in TERMINAL:
                self._settle_one(node, status, output, agent, error, error_type, defaulted, cascade)
            if not cascade:
                return
            node, error = cascade.pop()
            status, output, agent, error_type, defaulted = (
                SKIPPED,
                None,
                None,
                "DependencyFailed",
                False,
            )

    def _settle_one(
        self,
        node: Node,
        status: str,
        output: Any,
        agent: str | None,
        error: str | None,
        error_type: str | None,
        defaulted: bool,
        cascade: list[tuple[Node, str]],
    ) -> None:
        state = node.state
        if state is READY:
            self.queue.discard(node)
        if state is not PENDING:
            self._active -= 1
        node.state = status
        end = self._time()
        t0 = self.t0
        # The node becomes its own TaskResult.
        node.status = status  # type: ignore[assignment]
        if status is SUCCEEDED:
            node.output = output
        node.agent = agent
        node.started = None if node.t_start is None else node.t_start - t0
        node.finished = end - t0
        node.error = error
        node.error_type = error_type
        node.defaulted = defaulted
        dependents = node.dependents
        if status is SUCCEEDED:
            if self._agg_error is None:
                try:
                    self._acc.add(node)
                except Exception as exc:
                    self._aggregator_failed(exc)
            if dependents:
                for dep in dependents:
                    dep.waiting -= 1
                    if dep.waiting == 0 and dep.state is PENDING:
                        self._ready(dep)
        elif dependents:
            reason = f"dependency {node.id!r} {status}"
            cascade.extend((dep, reason) for dep in dependents)
        node.dependents = None
        groups = self.graph.groups
        if groups:
            for tag in node.task.tags:
                group = groups[tag]
                group.open -= 1
                if status is not SUCCEEDED and group.failed is None:
                    group.failed = f"group {tag!r} member {node.id!r} {status}"
                    cascade.extend((w, group.failed) for w in group.waiters if w.state is PENDING)
                self._maybe_close(tag, group)
            owned = groups.get(node.id)
            if owned is not None:
                self._maybe_close(node.id, owned)
        if self._debug:
            log.debug("task finished", task_id=node.id, kind=node.kind, status=status, agent=agent)
        if self.bus.active and self.bus.wants(TaskFinished):
            self.bus.emit(TaskFinished(end, self.run_id, node))
        if self._results is not None:
            try:
                self._results.send_nowait(node)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._results = None  # the stream's reader went away; the run goes on
        if self._compact and status is SUCCEEDED and not node.task.tags:
            self.report.tally(node)
            self.graph.compact(node)
        self._open -= 1
        if self._window_free is not None and (self._open < self._window or not self._active):
            self._window_free.set()
            self._window_free = None
        if not self._open:
            self._check_done()

    def _aggregator_failed(self, exc: Exception) -> None:
        """A user's aggregator raised: the run goes on; `data` is None and `metadata.reason` says why."""
        log.error("aggregator raised; data will be None", exc_info=True)
        self._agg_error = f"aggregator raised {type(exc).__name__}: {exc}"

    def _maybe_close(self, tag: str, group: Group) -> None:
        # Only a group that somebody waits for is closed (and then refuses new members); a waiter
        # that arrives later finds a closable group satisfied (`Graph._wire`).
        if not group.waiters or not self.graph.closable(tag, group):
            return
        group.closed = True
        if group.failed is not None:
            return  # the waiters were skipped when the group failed
        for waiter in group.waiters:
            waiter.waiting -= 1
            if waiter.waiting == 0 and waiter.state is PENDING:
                self._ready(waiter)

    def _check_done(self) -> None:
        if not self._open and self.graph.source_done:
            self._finish()

    def _finish(self) -> None:
        self._done.set()
        self._stop_workers()


async def _close(source: object) -> None:
    aclose = getattr(source, "aclose", None)
    if aclose is not None:
        await aclose()
        return
    close = getattr(source, "close", None)
    if close is not None:
        close()


def _debug_enabled() -> bool:
    """Whether per-task DEBUG lines are wanted: only when the application configured structlog
    (its unconfigured default prints every level, which would be a line per task) and at DEBUG."""
    if not structlog.is_configured():
        return False
    logger = structlog.get_logger("orchestra").bind()
    probe = getattr(logger, "is_enabled_for", None)
    return bool(probe(10)) if probe is not None else True
