"""`Orchestrator`: the public face. Configuration is checked here, once; runs happen in `_run`."""

from __future__ import annotations

import asyncio
import copy
import inspect
import time
import uuid
from collections.abc import (
    AsyncIterable,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)
from typing import TYPE_CHECKING, Any, TypeVar

from .._admission import check_new_priority
from .._aggregate import Aggregator, Discard, aggregator_of
from .._breaker import BreakerPolicy
from .._budget import BudgetPolicy
from .._concurrency import Capacity, Concurrency, as_concurrency
from .._config import (
    check_callable,
    check_instance,
    check_int,
    check_json,
    check_mapping,
    check_names,
    check_number,
    check_sequence,
    shown,
)
from .._events import Event, EventBus
from .._exceptions import ConfigError, InputError
from .._failure import cancel_pending
from .._faults import Faults
from .._log import get_logger
from .._registry import Registry
from .._retry import RetryPolicy, Timeouts
from .._task import TERMINAL, Task
from ..stores import MemoryStore, SQLiteStore
from ..stores._worker import Worker, WorkReport, backend_of
from ._handle import ResultStream, RunHandle
from ._instruments import Instrument, Instruments, has_hooks
from ._lifecycle import Lifecycle
from ._run import Run
from ._runconfig import RunConfig

if TYPE_CHECKING:
    from types import TracebackType

    from .._agent import AgentLike
    from .._clock import FakeClock
    from .._result import RunResult
    from .._verify import Check
    from ..stores._postgres._store import PostgresStore
    from ..stores._protocol import Store

__all__ = ("LocalRuns", "Orchestrator")

log = get_logger("orchestra")

T = TypeVar("T")

Decomposer = Callable[[Any], Any]
_DEFAULT_BREAKER = BreakerPolicy()


class Orchestrator:
    """Runs tasks on agents in parallel, safely, and folds their results into one `RunResult`.

    Args:
        agents: the agents (see `@agent`); each serves one or more kinds.
        concurrency: the most attempts running at once, across the orchestrator's runs: an int
            (private to this orchestrator), or a `Concurrency` object to share one budget with
            the other orchestrators it is given to.
        decomposer: turns `run(input)` into tasks: a function returning a list or an iterable, a
            generator, an async generator (streamed), or an async function (an LLM planner).
        retry: the default `RetryPolicy`; `retry_per_kind` overrides it per kind, an agent's own
            `retry=` overrides both.
        fallbacks: per kind, the ordered chain of agent names to try.
        defaults: per kind, a value that closes the chain: a task whose every agent failed succeeds
            with it (listed in `metadata.defaulted`).
        breaker: the circuit breaker policy of every agent (default `BreakerPolicy()`: half of
            the tasks that called it in 10 s, at least five, failed with an outage — never a bug
            of its own — open it for 1 s, doubled per failed probe up to 30 s); None turns
            breakers off.
        timeouts: `Timeouts(attempt=, task=, run=)` or a mapping with those keys, in seconds.
        success_threshold: the success rate at or above which a run with failures is "partial".
        verify: per kind, a check of each attempt's output (see `Verdict`).
        safety: a check of each task before its first attempt; a refusal fails it, unretried.
        aggregate: how outputs fold into `data` (default `Collect()`; a mapping kind → aggregator).
        window: backpressure on a streamed input: the most unfinished tasks admitted at once.
            Only when none of them can progress (all wait for dependencies or groups that need
            more of the input) is more input let in beyond it.
        seed: seeds the backoff jitter, for reproducible schedules.
        clock: a `FakeClock` to run in virtual time (tests).
        on_threshold_missed: ``fn(result, failed_tasks)`` (sync or async) called when a run misses
            its success threshold; it may return a new `RunResult` (say, after re-running the
            failed tasks) that replaces the result.
        drain_timeout: at exit, how long subscribers may take to receive the events still
            buffered for them; what is left then is dropped (and counted), so a slow subscriber
            never holds up the exit for long.
        store: where runs keep their tasks (default `MemoryStore()`; see `orchestra.stores`).
        instruments: metrics and tracing hooks called in line by every run (see `Instrument`,
            `orchestra.metrics.PrometheusMetrics`, `orchestra.tracing.OpenTelemetryTracing`);
            none by default, and then they cost nothing.
        max_cost, max_tokens: each run's budget, in USD and in tokens of every kind, of what
            agents report (`ctx.record_usage`): an attempt starts only if the spend, the
            reservations in flight and its own fit (see `orchestra._budget`); when none can, the
            run ends "partial" or "failed" with the reason (see `metadata.reason`).
    """

    def __init__(
        self,
        *,
        agents: Sequence[AgentLike],
        concurrency: int | Concurrency = 100,
        decomposer: Decomposer | None = None,
        retry: RetryPolicy | None = None,
        retry_per_kind: Mapping[str, RetryPolicy] | None = None,
        fallbacks: Mapping[str, Sequence[str]] | None = None,
        defaults: Mapping[str, Any] | None = None,
        breaker: BreakerPolicy | None = _DEFAULT_BREAKER,
        timeouts: Timeouts | Mapping[str, float | None] | None = None,
        success_threshold: float = 0.8,
        verify: Mapping[str, Check] | None = None,
        safety: Callable[[Task], Any] | None = None,
        aggregate: Aggregator | Mapping[str, Aggregator] | None = None,
        window: int | None = None,
        seed: int | None = None,
        clock: FakeClock | None = None,
        on_threshold_missed: Callable[..., Any] | None = None,
        drain_timeout: float = 5.0,
        store: Store | None = None,
        instruments: Sequence[Instrument] | None = None,
        max_cost: float | None = None,
        max_tokens: int | None = None,
    ) -> None:
        # Every option is checked here, once, so a wrong type or value is a ConfigError naming it
        # now, never a TypeError in the middle of a run.
        check_sequence("agents", agents)
        if not isinstance(concurrency, Concurrency):
            check_int("concurrency", concurrency)
        check_callable("decomposer", decomposer)
        check_instance("retry", retry, RetryPolicy)
        check_mapping("retry_per_kind", retry_per_kind)
        for kind, policy in (retry_per_kind or {}).items():
            check_instance(f"retry_per_kind[{kind!r}]", policy, RetryPolicy, optional=False)
        check_mapping("fallbacks", fallbacks)
        for kind, names in (fallbacks or {}).items():
            check_names(f"fallbacks[{kind!r}]", names)
        check_mapping("defaults", defaults)
        for kind, value in (defaults or {}).items():
            check_json(f"defaults[{kind!r}]", value)
        check_instance("breaker", breaker, BreakerPolicy)
        check_number("success_threshold", success_threshold, maximum=1.0)
        check_mapping("verify", verify)
        for kind, check in (verify or {}).items():
            check_callable(f"verify[{kind!r}]", check, optional=False)
        check_callable("safety", safety)
        check_int("window", window, optional=True)
        check_int("seed", seed, minimum=None, optional=True)
        if clock is not None and not callable(getattr(clock, "install", None)):
            raise ConfigError(
                f"clock must be an orchestra.testing.FakeClock or None, got {shown(clock)}"
            )
        check_callable("on_threshold_missed", on_threshold_missed)
        check_number("drain_timeout", drain_timeout)
        if store is not None:
            _check_store(store)
        if instruments is not None:
            check_sequence("instruments", instruments)
            for i, instrument in enumerate(instruments):
                if not has_hooks(instrument):
                    raise ConfigError(
                        f"instruments[{i}] must be an orchestra.Instrument (an object with "
                        f"on_attempt_end, on_task_end, ... hooks), got {instrument!r}"
                    )
                if any(other is instrument for other in instruments[:i]):
                    # It would hear every hook twice: its counters would count double.
                    raise ConfigError(
                        f"instruments[{i}] is instruments[{instruments.index(instrument)}] again "
                        f"({instrument!r}): give each instrument once"
                    )
        aggregator = aggregator_of(aggregate)
        self.registry = Registry(agents, breaker, fallbacks)
        kinds = set(self.registry.by_kind)
        for name, mapping in (
            ("retry_per_kind", retry_per_kind),
            ("defaults", defaults),
            ("verify", verify),
            ("aggregate", aggregate if isinstance(aggregate, Mapping) else None),
        ):
            unknown = set(mapping or ()) - kinds
            if unknown:
                raise ConfigError(f"{name} names kinds no agent serves: {sorted(unknown)}")
        self.decomposer = decomposer
        self.clock = clock
        self._bus = EventBus()
        self._bus.on_change = self._listeners_changed
        self._capacity = Capacity(as_concurrency(concurrency, "concurrency"))
        self.faults = Faults(changed=self._listeners_changed, live_state=self._unfinished_state)
        """The simulated failures of its agents (see `orchestra.testing.simulate_agent_failure`)."""
        self._config = RunConfig(
            registry=self.registry,
            capacity=self._capacity,
            bus=self._bus,
            store=store if store is not None else MemoryStore(),
            retry=retry or RetryPolicy(),
            retry_per_kind=dict(retry_per_kind or {}),
            timeouts=Timeouts.of(timeouts),
            defaults=dict(defaults or {}),
            verify=dict(verify or {}),
            safety=safety,
            success_threshold=success_threshold,
            window=window or max(10_000, 10 * self._capacity.limit),
            faults=self.faults,
            aggregate=aggregator,
            seed=seed,
            on_threshold_missed=on_threshold_missed,
            instruments=Instruments.of(instruments),
            budget=BudgetPolicy.of(max_cost=max_cost, max_tokens=max_tokens),
        )
        if self._config.instruments is not None:
            self._config.instruments.attach(self)
        self._runs: list[Run] = []
        self._starting = 0  # handles whose run is not in `_runs` yet (its input is being made)
        self._lifecycle = Lifecycle(self._bus, clock, drain_timeout, self._busy)

    @property
    def concurrency(self) -> int:
        return self._capacity.limit

    @property
    def instruments(self) -> tuple[Instrument, ...]:
        """The instruments it was given (`instruments=`), in order (a service finds its metrics
        among them)."""
        found = self._config.instruments
        return () if found is None else found.instruments  # type: ignore[return-value]

    @property
    def store(self) -> Store:
        """Where its runs keep their tasks (`MemoryStore()` unless given; see `orchestra.stores`).

        Settable while no run goes on: the runs started after keep their tasks in the new store
        (as ``orchestra run --db FILE`` does with the orchestrator its factory made)."""
        store: Store = self._config.store
        return store

    @store.setter
    def store(self, store: Store) -> None:
        _check_store(store)
        if self._runs or self._starting:
            raise ConfigError(
                "store can be changed only while no run goes on: set it before starting runs"
            )
        self._config.store = store

    # -- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> Orchestrator:
        _check_asyncio("async with Orchestrator(...)")
        await self._lifecycle.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return await self._lifecycle.__aexit__(exc_type, exc, tb)

    # -- runs ------------------------------------------------------------------------------------

    async def run(
        self,
        input: Any = None,
        *,
        tasks: Iterable[Task] | AsyncIterable[Task] | None = None,
        run_id: str | None = None,
    ) -> RunResult:
        """Run `input` through the decomposer (or `tasks` as given) and return the `RunResult`.

        Bad input raises `InputError` before any agent is called (for a streamed input: when the bad
        task arrives, cancelling what runs). Cancelling the caller cancels every attempt.
        """
        _check_asyncio("run()")
        _check_run_id(run_id)  # before any work: a wrong one would fail the finished run's result
        if self._lifecycle.in_async_with:
            return await self._run(input, tasks, run_id)
        return await self._lifecycle.around(lambda: self._run(input, tasks, run_id))

    async def _run(self, input: Any, tasks: Any, run_id: str | None) -> RunResult:
        source, planned = await self._source(input, tasks)
        return await self._execute(source, run_id, planned=planned)

    def stream(
        self,
        input: Any = None,
        *,
        tasks: Iterable[Task] | AsyncIterable[Task] | None = None,
        run_id: str | None = None,
    ) -> ResultStream:
        """Run like `run`, yielding each `TaskResult` as it finishes: ``async for r in orch.stream(x)``.

        Needs ``async with Orchestrator(...)``. After the loop, `.result` holds the `RunResult`.
        Leaving the loop early stops the run (``async with orch.stream(x) as results:`` makes that
        immediate; otherwise it happens when the stream is closed or the orchestrator exits), and
        `.result` is then its `RunResult`, status "cancelled", with what finished before.
        """
        if self._lifecycle.tg is None:
            raise ConfigError("stream() needs `async with Orchestrator(...) as orch:` around it")
        _check_run_id(run_id)

        def start() -> RunHandle:  # when the stream is first read
            if self._lifecycle.tg is None:
                raise ConfigError(
                    "stream() needs `async with Orchestrator(...) as orch:` around it"
                )
            return self._launch(input, tasks, run_id, self._config)

        return ResultStream(start=start)

    def start(
        self,
        input: Any = None,
        *,
        tasks: Iterable[Task] | AsyncIterable[Task] | None = None,
        run_id: str | None = None,
    ) -> RunHandle:
        """Start a run like `run` does, in the background, and return its `RunHandle` at once:
        pause, resume, cancel some tasks, reprioritize, read results as they come, stop it
        gracefully, or ``await handle`` for the `RunResult`.

        Needs ``async with Orchestrator(...)``; leaving that block waits for the run to end.
        `run_id` names the run (by default a fresh one): with a durable store, starting the same
        run id again is how a stopped or crashed run will resume from its checkpoint.
        """
        if self._lifecycle.tg is None:
            raise ConfigError("start() needs `async with Orchestrator(...) as orch:` around it")
        _check_run_id(run_id)
        return self._launch(input, tasks, run_id, self._config)

    def _launch(self, input: Any, tasks: Any, run_id: str | None, config: RunConfig) -> RunHandle:
        """`start` with `config`."""
        tg = self._lifecycle.tg
        assert tg is not None
        handle = RunHandle(run_id or uuid.uuid4().hex[:12], self._capacity.limit)
        self._starting += 1
        registered = False

        def on_run(run: Run) -> None:
            nonlocal registered
            registered = True
            self._starting -= 1
            handle._attach(run)

        async def body() -> RunResult:
            try:
                source, planned = await self._source(input, tasks)
                return await self._execute(source, handle.run_id, on_run, planned, config)
            finally:
                if not registered:
                    self._starting -= 1
                    self._lifecycle.maybe_idle()

        tg.start_soon(handle._drive, body)
        return handle

    async def _source(
        self, input: Any, tasks: Any
    ) -> tuple[Iterable[Task] | AsyncIterable[Task], dict[str, float] | None]:
        """The run's tasks, and what the decomposer spent making them (a planner that reports
        its spend, as `ClaudePlanner.spent` does: the run's metadata and budget count it)."""
        planned: dict[str, float] | None = None
        if tasks is not None:
            if input is not None:
                raise ConfigError("give run() an input or tasks=, not both")
            source = tasks
        elif self.decomposer is not None:
            before = _spent(self.decomposer)
            source = self.decomposer(input)
            if inspect.isawaitable(source):
                source = await source
            after = _spent(self.decomposer)
            if before is not None and after is not None:
                planned = {
                    k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)
                }
        elif input is not None:
            source = input  # an iterable of tasks, without a decomposer
        else:
            raise ConfigError("run() needs an input (with a decomposer) or tasks=")
        if isinstance(source, Task):
            source = [source]
        if not isinstance(source, Iterable | AsyncIterable) or isinstance(
            source, str | bytes | Mapping
        ):
            raise InputError(
                f"the decomposer must return tasks (a list, an iterable or an async iterable), got {type(source).__name__}"
            )
        return source, planned

    async def _execute(
        self,
        source: Iterable[Task] | AsyncIterable[Task],
        run_id: str | None,
        on_run: Callable[[Run], None] | None = None,
        planned: dict[str, float] | None = None,
        config: RunConfig | None = None,
    ) -> RunResult:
        """Run `source` to its end; when the run misses its threshold, `on_threshold_missed` may
        replace the result. The orchestrator keeps nothing of a finished run."""
        run = Run(config or self._config, run_id or uuid.uuid4().hex[:12])
        if planned:  # what the decomposer spent is the run's (its metadata, its budget)
            cost = planned.pop("cost", 0.0)
            tokens = {unit: int(n) for unit, n in planned.items()}
            name = getattr(self.decomposer, "name", None)
            model = getattr(self.decomposer, "model", None)
            run.report.usage(cost, tokens, name if isinstance(name, str) else None,
                             model if isinstance(model, str) else None)  # fmt: skip
        if on_run is not None:
            on_run(run)
        self._runs.append(run)
        try:
            result = await run.execute(source)
            if self._bus.active:
                await self._bus.synced()
        finally:
            self._runs.remove(run)
            self._lifecycle.maybe_idle()
        return await self._threshold_hook(result, [r.task for r in run.report.not_ok])

    async def work(
        self,
        store: SQLiteStore | PostgresStore | None = None,
        *,
        run_id: str | None = None,
        kinds: Sequence[str] | None = None,
        poll: float | None = None,
    ) -> WorkReport:
        """Work as a worker process for the runs other processes keep in a shared store (a
        `SQLiteStore` file, a `PostgresStore` database): claim ready tasks of `kinds` (default:
        every kind this orchestrator's agents serve) under a lease, run them with this
        orchestrator's agents, limits, retries and fallbacks, and write back what they came to.
        With `run_id`, serve that run only and return once it is over; without, serve every run
        of the store until cancelled (a cancel hands back the tasks not started). `poll`: seconds
        between looks at the store when nothing woke the worker (default: 0.1 on SQLite, the
        PostgresStore's `poll` on PostgreSQL, where LISTEN/NOTIFY wakes it at once). `store`
        defaults to this orchestrator's. See "Durable runs and workers" in the documentation.

        Raises:
            ConfigError: no SQLite or PostgreSQL store, or kinds no agent here serves.
        """
        _check_asyncio("work()")
        store = store if store is not None else self._config.store
        backend = backend_of(store)
        every = backend.poll if poll is None else poll

        def job() -> Awaitable[WorkReport]:
            return Worker(LocalRuns(self), backend, run_id, kinds, every).run()

        if self._lifecycle.in_async_with:
            return await job()
        return await self._lifecycle.around(job)

    def _busy(self) -> bool:
        """Whether a run of it is starting or going on (its lifecycle closes only after)."""
        return bool(self._runs or self._starting)

    async def _threshold_hook(self, result: RunResult, failed: list[Task]) -> RunResult:
        hook = self._config.on_threshold_missed
        if (
            hook is None
            or result.status != "failed"
            or (
                result.metadata.success_rate >= result.metadata.success_threshold
                and result.metadata.input_complete  # else unread input missed it
            )
        ):
            return result
        try:
            replacement = hook(result, failed)
            if inspect.isawaitable(replacement):
                replacement = await replacement
        except (Exception, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError) and cancel_pending():
                raise  # the caller's cancel, not the hook's failure
            log.error("on_threshold_missed raised; keeping the result", exc_info=True)
            return result
        return replacement if replacement is not None else result

    # -- events and control ------------------------------------------------------------------------

    def subscribe(
        self,
        fn: Callable[[Any], Awaitable[None] | None],
        *types: type[Event],
        buffer: int = 10_000,
    ) -> Callable[[], None]:
        """Call `fn(event)` (sync or async) for every event (or only those of `types`).

        Delivery is from a bounded buffer of `buffer` events; when it is full, events are dropped
        and counted in `metadata.events_dropped`, so a slow subscriber never slows the run. What
        `fn` raises is logged and ignored. Returns a function that unsubscribes.
        """
        check_callable("subscribe: fn", fn, optional=False)
        for kind in types:
            if not (isinstance(kind, type) and issubclass(kind, Event)):
                raise ConfigError(
                    f"subscribe: types must be event classes (orchestra.TaskFinished, ...), "
                    f"got {shown(kind)}"
                )
        check_int("subscribe: buffer", buffer)
        return self._bus.subscribe(fn, types, buffer)

    def reprioritize(self, task_id: str, priority: int) -> bool:
        """Change the priority of a task that has not started; True if it was found waiting."""
        check_new_priority(task_id, priority)
        for run in self._runs:
            state = run.store.state_of(task_id)
            if state is None or state in TERMINAL:
                continue
            return run.control.reprioritize(task_id, priority)
        return False

    def agents_status(self) -> list[dict[str, Any]]:
        """Every agent's status (idle / busy / failing / open), breaker (and when an open one
        lets its next probe through: `next_probe_in` seconds), load and counters."""
        try:
            now = asyncio.get_running_loop().time()  # the clock breakers run on (a FakeClock's)
        except RuntimeError:
            now = time.monotonic()  # an event loop's own clock, outside one
        return self.registry.snapshot(now)

    def _unfinished_state(self, task_id: str) -> str | None:
        """The state of `task_id` in a run still going, if it is unfinished there."""
        for run in self._runs:
            state = run.store.state_of(task_id)
            if state is not None and state not in TERMINAL:
                return state
        return None

    def _listeners_changed(self) -> None:
        """A subscriber or a simulated fault came or went: each run decides again whether a
        task's end needs more than a count (`Run.listeners_changed`)."""
        for run in self._runs:
            run.listeners_changed()


def _check_asyncio(what: str) -> None:
    """`ConfigError` unless an asyncio event loop runs this: the runtime is written on anyio but
    relies on asyncio (its loop's clock and call_at, its tasks), so another anyio backend
    (trio) is refused here, before anything starts, rather than failing inside."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise ConfigError(
            f"{what} needs an asyncio event loop: orchestra runs on asyncio only "
            "(asyncio.run(...), or anyio.run(..., backend='asyncio')); trio and other "
            "event loops are not supported"
        ) from None


class LocalRuns:
    """The orchestrator a worker works for, as the worker sees it (`stores._worker.Owner`): its
    agents, its global limit, and its runs started on a store of the worker's (`WorkerStore`)
    rather than its own. The orchestrator's own `start` always runs on its configured store."""

    __slots__ = ("_orch",)

    def __init__(self, orch: Orchestrator) -> None:
        self._orch = orch

    @property
    def registry(self) -> Registry:
        return self._orch.registry

    @property
    def concurrency(self) -> int:
        return self._orch.concurrency

    def start(self, tasks: AsyncIterable[Task], run_id: str, store: Store) -> RunHandle:
        """`Orchestrator.start` of `tasks` on `store`, with everything else of its configuration."""
        orch = self._orch
        config = copy.copy(orch._config)
        config.store = store
        # Its results go to the shared store as they end; an aggregate of them, the records of
        # the tasks that did not succeed or of its cancels (hand-backs) would keep every output
        # and every failure of a worker that runs for days (the coordinator's run builds the
        # result).
        config.aggregate = Discard()
        config.keeps_history = False
        return orch._launch(None, tasks, run_id, config)


def _check_store(store: Any) -> None:
    """`ConfigError` unless `store` is a store: else an AttributeError when the first run opens
    (a path is the usual slip)."""
    if not callable(getattr(store, "open_run", None)):
        raise ConfigError(
            f"store must be a store (MemoryStore(), SQLiteStore(path), ...) or None, "
            f"got {shown(store)}"
        )


def _check_run_id(run_id: Any) -> None:
    """`run_id` is a non-empty str or None. An empty one would silently become a fresh id (so a
    durable run would never resume), another type would fail `RunMetadata` once the run is over."""
    if run_id is not None and (type(run_id) is not str or not run_id):
        raise ConfigError(f"run_id must be a non-empty str or None, got {run_id!r}")


def _spent(decomposer: Any) -> dict[str, float] | None:
    """What a decomposer reports it spent so far (`spent`: tokens by field and ``"cost"``)."""
    spent = getattr(decomposer, "spent", None)
    if not isinstance(spent, Mapping):
        return None
    return {k: v for k, v in spent.items() if isinstance(v, int | float)}
