"""Prometheus metrics for orchestra (the `metrics` extra: prometheus-client).

```python
from orchestra.metrics import PrometheusMetrics

metrics = PrometheusMetrics()            # the default registry; or registry=CollectorRegistry()
metrics.serve(9464)                      # /metrics on 127.0.0.1:9464 (a daemon thread)
async with Orchestrator(agents=[...], instruments=[metrics]) as orch:
    await orch.run(tasks)
```

Counters and histograms are updated in line by the run's hooks (see `orchestra.Instrument`), so
they are exact: `orchestra_attempts_total` sums to `metadata.attempts`. Gauges (attempts in flight,
queue depth, breaker state) are not updated at all: a collector reads them from the live runs and
agents when Prometheus scrapes, so they cost nothing between scrapes.

Labels are bounded by the program, never by the data: kind, agent, outcome or status, error type
(an exception's class name), usage unit. Task and run ids are not labels (they would be a new
series per task); find them in traces (`orchestra.tracing`).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Final

from ._exceptions import ConfigError
from ._instruments import Instrument, last_agent

try:
    from prometheus_client import REGISTRY, Counter, Histogram, generate_latest, start_http_server
    from prometheus_client.core import GaugeMetricFamily
except ImportError:  # pragma: no cover - exercised by a test that hides the package
    raise ConfigError(
        "orchestra.metrics needs prometheus-client: install the `metrics` extra "
        "(pip install prometheus-client)"
    ) from None

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence
    from threading import Thread
    from wsgiref.simple_server import WSGIServer

    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

    from ._instruments import AttemptInfo, RunInfo
    from ._orchestrator import Orchestrator
    from ._task import Task, TaskResult

__all__ = ("DURATION_BUCKETS", "PrometheusMetrics")

DURATION_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    float("inf"),
)  # fmt: skip
"""From a cached or CPU-bound call (milliseconds) to a long LLM generation (minutes)."""

_BREAKER_STATES: Final = ("closed", "half_open", "open")  # from best to worst


def _worse(state: str, than: str) -> bool:
    rank = _BREAKER_STATES.index
    return rank(state) > rank(than) if state in _BREAKER_STATES else False


class PrometheusMetrics(Instrument):
    """Prometheus counters, histograms and live gauges of the orchestrators it is given to.

    One object per registry (the metric names can be registered once in a registry); give the
    same object to several orchestrators to sum them.

    Args:
        registry: where the metrics are registered: prometheus_client's default `REGISTRY`
            (what `start_http_server` serves by default), or your own `CollectorRegistry`.
        namespace: the prefix of every metric name.
        buckets: the histograms' buckets, in seconds.
    """

    def __init__(
        self,
        *,
        registry: CollectorRegistry | None = None,
        namespace: str = "orchestra",
        buckets: Sequence[float] = DURATION_BUCKETS,
    ) -> None:
        self.registry = registry if registry is not None else REGISTRY
        self.namespace = namespace
        ns = namespace
        # Built unregistered, then registered together: a clash registers none of them.
        self.attempts = Counter(
            "attempts", "Agent calls, by kind, agent and outcome (succeeded, failed, cancelled).",
            ["kind", "agent", "outcome"], namespace=ns, registry=None,
        )  # fmt: skip
        self.attempt_duration = Histogram(
            "attempt_duration_seconds", "Duration of agent calls (with their checks), by outcome.",
            ["kind", "agent", "outcome"], namespace=ns, registry=None, buckets=buckets,
        )  # fmt: skip
        self.attempt_errors = Counter(
            "attempt_errors", "Failed agent calls, by kind, agent and error type.",
            ["kind", "agent", "error_type"], namespace=ns, registry=None,
        )  # fmt: skip
        self.retries = Counter(
            "retries", "Retries scheduled on the same agent, by kind and agent.",
            ["kind", "agent"], namespace=ns, registry=None,
        )  # fmt: skip
        self.fallbacks = Counter(
            "fallbacks", "Tasks moved to the next agent of their chain.",
            ["kind", "from_agent", "to_agent"], namespace=ns, registry=None,
        )  # fmt: skip
        self.tasks = Counter(
            "tasks", "Tasks ended, by kind, last agent tried (empty if none ran) and status.",
            ["kind", "agent", "status"], namespace=ns, registry=None,
        )  # fmt: skip
        self.task_duration = Histogram(
            "task_duration_seconds", "From a task's first attempt to its end, by kind and status.",
            ["kind", "status"], namespace=ns, registry=None, buckets=buckets,
        )  # fmt: skip
        self.usage = Counter(
            "agent_usage", "Units agents recorded with ctx.record_usage (tokens), by unit.",
            ["kind", "agent", "unit"], namespace=ns, registry=None,
        )  # fmt: skip
        self.runs = Counter(
            "runs", "Runs ended, by status.", ["status"], namespace=ns, registry=None
        )
        self.run_duration = Histogram(
            "run_duration_seconds", "Duration of runs, by status.",
            ["status"], namespace=ns, registry=None, buckets=buckets,
        )  # fmt: skip
        self._live = _LiveCollector(self)
        collectors = (
            self.attempts, self.attempt_duration, self.attempt_errors, self.retries,
            self.fallbacks, self.tasks, self.task_duration, self.usage, self.runs,
            self.run_duration, self._live,
        )  # fmt: skip
        done: list[Any] = []
        try:
            for collector in collectors:
                self.registry.register(collector)
                done.append(collector)
        except ValueError as exc:
            for collector in done:
                self.registry.unregister(collector)
            raise ConfigError(
                f"PrometheusMetrics: {exc}; metrics named {namespace}_* are already in this "
                "registry: give every orchestrator the same PrometheusMetrics object, or pass "
                "registry=CollectorRegistry() (or another namespace=)"
            ) from None
        self._collectors = collectors
        self._orchestrators: weakref.WeakSet[Orchestrator] = weakref.WeakSet()
        self._runs: set[RunInfo] = set()
        # Label children by label values: `.labels(...)` costs a lock and a dict lookup with
        # argument checks every time (~1 µs); a plain dict of children, a fraction of that.
        self._attempt_children: dict[tuple[str, str, str], tuple[Any, Any]] = {}

    # -- exporting ---------------------------------------------------------------------------------

    def serve(self, port: int, addr: str = "127.0.0.1") -> tuple[WSGIServer, Thread]:
        """Serve this registry on ``http://addr:port/metrics`` from a daemon thread
        (prometheus_client's `start_http_server`). `addr="0.0.0.0"` to be scraped from other
        machines. Returns the server and its thread (``server.shutdown()`` stops it)."""
        return start_http_server(port, addr, registry=self.registry)

    def exposition(self) -> bytes:
        """This registry in Prometheus' text format, to serve from your own web app (with the
        content type `prometheus_client.CONTENT_TYPE_LATEST`)."""
        return generate_latest(self.registry)

    def unregister(self) -> None:
        """Take these metrics out of their registry (a test, or a process that builds a new one)."""
        for collector in self._collectors:
            self.registry.unregister(collector)

    # -- hooks -------------------------------------------------------------------------------------

    def on_attach(self, orchestrator: Orchestrator) -> None:
        self._orchestrators.add(orchestrator)

    def on_run_start(self, run: RunInfo) -> None:
        self._runs.add(run)

    def on_run_end(self, run: RunInfo, status: str, elapsed: float) -> None:
        self._runs.discard(run)
        self.runs.labels(status).inc()
        self.run_duration.labels(status).observe(elapsed)

    def on_attempt_end(self, attempt: AttemptInfo) -> None:
        key = (attempt.kind, attempt.agent, attempt.outcome or "")
        children = self._attempt_children.get(key)
        if children is None:
            children = self._attempt_children[key] = (
                self.attempts.labels(*key),
                self.attempt_duration.labels(*key),
            )
        children[0].inc()
        children[1].observe(attempt.ended - attempt.started)
        if attempt.error_type is not None:
            self.attempt_errors.labels(attempt.kind, attempt.agent, attempt.error_type).inc()
        usage = attempt.usage
        if usage:
            for unit, n in usage.items():
                self.usage.labels(attempt.kind, attempt.agent, unit).inc(n)

    def on_retry(self, run: RunInfo, task: Task, agent: str, attempt: int, delay: float) -> None:
        self.retries.labels(task.kind, agent).inc()

    def on_fallback(
        self, run: RunInfo, task: Task, from_agent: str, to_agent: str | None, reason: str
    ) -> None:
        if to_agent is not None:  # None: the chain ran out, which the task's status tells
            self.fallbacks.labels(task.kind, from_agent, to_agent).inc()

    def on_task_end(self, run: RunInfo, result: TaskResult) -> None:
        status = str(result.status)
        self.tasks.labels(result.kind, last_agent(result), status).inc()
        if result.started is not None:
            self.task_duration.labels(result.kind, status).observe(
                max(0.0, result.finished - result.started)
            )


class _LiveCollector:
    """The gauges, read from the live runs and agents when Prometheus scrapes (in the exporter's
    thread: every read is of a plain int or str, and the sets are copied first)."""

    def __init__(self, owner: PrometheusMetrics) -> None:
        self._owner = owner
        self._ns = owner.namespace

    def describe(self) -> list[Metric]:
        return list(self._families())  # nothing live yet: the names and types, for clash checks

    def collect(self) -> Iterator[Metric]:
        owner = self._owner
        yield from self._families(list(owner._orchestrators), tuple(owner._runs))

    def _families(
        self, orchestrators: Sequence[Orchestrator] = (), runs: Sequence[RunInfo] = ()
    ) -> Iterator[Metric]:
        ns = self._ns
        in_flight = GaugeMetricFamily(
            f"{ns}_attempts_in_flight", "Agent calls running now, by agent.", labels=["agent"]
        )
        breaker = GaugeMetricFamily(
            f"{ns}_breaker_state",
            "Circuit breaker state by agent: 1 for the current state (closed, open, half_open).",
            labels=["agent", "state"],
        )
        # Agents of the same name in several orchestrators are summed (in flight) and shown
        # in their worst breaker state.
        loads: dict[str, int] = {}
        states: dict[str, str] = {}
        for orchestrator in orchestrators:
            for name, slot in tuple(orchestrator.registry.slots.items()):
                loads[name] = loads.get(name, 0) + slot.in_flight
                state = slot.breaker.state
                seen = states.get(name)
                if seen is None or _worse(state, seen):
                    states[name] = state
        for name, n in loads.items():
            in_flight.add_metric([name], n)
            for state in _BREAKER_STATES:
                breaker.add_metric([name, state], 1.0 if states[name] == state else 0.0)
        yield in_flight
        yield breaker
        yield GaugeMetricFamily(f"{ns}_runs_active", "Runs going on now.", value=len(runs))
        yield GaugeMetricFamily(
            f"{ns}_queue_depth",
            "Tasks ready, or due later (a retry, a rate limit, an open breaker), that no attempt "
            "runs yet: the backlog.",
            value=sum(run.queued for run in runs),
        )
        yield GaugeMetricFamily(
            f"{ns}_tasks_waiting",
            "Tasks waiting for their dependencies.",
            value=sum(run.waiting for run in runs),
        )
        yield GaugeMetricFamily(
            f"{ns}_tasks_unfinished",
            "Admitted tasks not yet terminal.",
            value=sum(run.unfinished for run in runs),
        )
