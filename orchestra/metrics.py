"""Prometheus metrics for orchestra (the `metrics` extra: prometheus-client).

```python
from orchestra.metrics import PrometheusMetrics

metrics = PrometheusMetrics()            # the default registry; or registry=CollectorRegistry()
metrics.serve(9464)                      # /metrics on 127.0.0.1:9464 (a daemon thread)
async with Orchestrator(agents=[...], instruments=[metrics]) as orch:
    await orch.run(tasks)
```

Counters and histograms are counted in line by the run's hooks (see `orchestra.events.Instrument`), so
they are exact: `orchestra_attempts_total` sums to `metadata.attempts`. Gauges (attempts in flight,
queue depth, breaker state) are not updated at all: they are read from the live runs and agents
when Prometheus scrapes, so they cost nothing between scrapes.

Written by hand, on purpose: the counts are plain dicts of numbers that one collector turns into
prometheus_client's metric families at scrape time. prometheus_client's own `Counter` and
`Histogram` take a lock per update and check their labels at every `.labels()`; with them a no-op
task cost 15 µs more (measured, `benchmarks`, scenario 6), against about 2 µs this way. The price:
one PrometheusMetrics is written from one thread (one event loop), as an orchestrator is.

Labels are bounded by the program, never by the data: kind, agent, outcome or status, error type
(an exception's class name), usage unit. Task and run ids are not labels (they would be a new
series per task); find them in traces (`orchestra.tracing`).
"""

from __future__ import annotations

import math
import weakref
from bisect import bisect_left
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from ._core._instruments import Instrument, last_agent
from ._exceptions import ConfigError
from ._extras import missing_extra

try:
    from prometheus_client import REGISTRY, generate_latest, start_http_server
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
    from prometheus_client.utils import floatToGoString
except ImportError as exc:  # pragma: no cover - exercised by a test that hides the package
    raise missing_extra("orchestra.metrics", "metrics", exc) from exc

if TYPE_CHECKING:
    from collections.abc import Iterator
    from threading import Thread
    from wsgiref.simple_server import WSGIServer

    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

    from ._core._instruments import AttemptInfo, RunInfo
    from ._core._orchestrator import Orchestrator
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


class _Counter:
    """One counter's values by label values."""

    __slots__ = ("doc", "labels", "name", "values")

    def __init__(self, name: str, doc: str, labels: Sequence[str]) -> None:
        self.name = name
        self.doc = doc
        self.labels = tuple(labels)
        self.values: dict[tuple[str, ...], float] = {}

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for key, n in tuple(self.values.items()):
            family.add_metric(key, n)
        return family


class _Histogram:
    """One histogram's bucket counts (not cumulated: that is done at scrape time) and sum, by
    label values: ``[n in bucket 0, ..., n in +Inf, sum]``."""

    __slots__ = ("bounds", "doc", "labels", "les", "name", "series")

    def __init__(
        self, name: str, doc: str, labels: Sequence[str], buckets: Sequence[float]
    ) -> None:
        self.name = name
        self.doc = doc
        self.labels = tuple(labels)
        self.bounds = sorted(b for b in buckets if b != float("inf"))
        self.les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        self.series: dict[tuple[str, ...], list[float]] = {}

    def observe(self, key: tuple[str, ...], value: float) -> None:
        counts = self.series.get(key)
        if counts is None:
            counts = self.series[key] = [0] * (len(self.bounds) + 2)
        counts[bisect_left(self.bounds, value)] += 1  # the first bucket with value <= le
        counts[-1] += value

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for key, counts in tuple(self.series.items()):
            counts = list(counts)
            cumulated = []
            total = 0.0
            for le, n in zip(self.les, counts[:-1], strict=True):
                total += n
                cumulated.append((le, total))
            family.add_metric(key, cumulated, sum_value=counts[-1])
        return family


class PrometheusMetrics(Instrument):
    """Prometheus counters, histograms and live gauges of the orchestrators it is given to.

    One object per registry (the metric names can be registered once in a registry); give the
    same object to several orchestrators to sum them (in one thread: see the module's docstring).

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
        # Checked here: a wrong registry failed with an AttributeError, wrong buckets with a
        # ValueError, or silently with duplicate or NaN `le` lines in every scrape.
        if registry is not None and not callable(getattr(registry, "register", None)):
            raise ConfigError(
                f"PrometheusMetrics: registry must be a prometheus_client CollectorRegistry or "
                f"None, got {registry!r}"
            )
        if not isinstance(namespace, str) or not namespace:
            raise ConfigError(
                f"PrometheusMetrics: namespace must be a non-empty str, got {namespace!r}"
            )
        if (
            isinstance(buckets, str | bytes)
            or not isinstance(buckets, Sequence)
            or not all(
                type(b) is not bool and isinstance(b, int | float) and not math.isnan(b)
                for b in buckets
            )
            or len(set(buckets)) != len(buckets)
        ):
            raise ConfigError(
                f"PrometheusMetrics: buckets must be a list of distinct numbers, got {buckets!r}"
            )
        self.registry = registry if registry is not None else REGISTRY
        self.namespace = namespace
        ns = namespace
        self._attempts = _Counter(
            f"{ns}_attempts", "Agent calls, by kind, agent and outcome (succeeded, failed, cancelled).",
            ("kind", "agent", "outcome"),
        )  # fmt: skip
        self._attempt_duration = _Histogram(
            f"{ns}_attempt_duration_seconds", "Duration of agent calls (with their checks), by outcome.",
            ("kind", "agent", "outcome"), buckets,
        )  # fmt: skip
        self._attempt_errors = _Counter(
            f"{ns}_attempt_errors", "Failed agent calls, by kind, agent and error type.",
            ("kind", "agent", "error_type"),
        )  # fmt: skip
        self._retries = _Counter(
            f"{ns}_retries", "Retries scheduled on the same agent, by kind and agent.",
            ("kind", "agent"),
        )  # fmt: skip
        self._fallbacks = _Counter(
            f"{ns}_fallbacks", "Tasks moved to the next agent of their chain.",
            ("kind", "from_agent", "to_agent"),
        )  # fmt: skip
        self._tasks = _Counter(
            f"{ns}_tasks", "Tasks ended, by kind, last agent tried (empty if none ran) and status.",
            ("kind", "agent", "status"),
        )  # fmt: skip
        self._task_duration = _Histogram(
            f"{ns}_task_duration_seconds", "From a task's first attempt to its end, by kind and status.",
            ("kind", "status"), buckets,
        )  # fmt: skip
        self._usage = _Counter(
            f"{ns}_agent_usage", "Units agents recorded with ctx.record_usage (tokens), by unit.",
            ("kind", "agent", "unit"),
        )  # fmt: skip
        self._runs_total = _Counter(f"{ns}_runs", "Runs ended, by status.", ("status",))
        self._run_duration = _Histogram(
            f"{ns}_run_duration_seconds", "Duration of runs, by status.", ("status",), buckets
        )
        self._orchestrators: weakref.WeakSet[Orchestrator] = weakref.WeakSet()
        self._runs: set[RunInfo] = set()
        self._collector = _Collector(self)
        try:
            self.registry.register(self._collector)
        except ValueError as exc:
            raise ConfigError(
                f"PrometheusMetrics: {exc}; metrics named {namespace}_* are already in this "
                "registry: give every orchestrator the same PrometheusMetrics object, or pass "
                "registry=CollectorRegistry() (or another namespace=)"
            ) from None

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
        self.registry.unregister(self._collector)

    # -- hooks -------------------------------------------------------------------------------------

    def on_attach(self, orchestrator: Orchestrator) -> None:
        self._orchestrators.add(orchestrator)

    def on_run_start(self, run: RunInfo) -> None:
        self._runs.add(run)

    def on_run_end(self, run: RunInfo, status: str, elapsed: float) -> None:
        self._runs.discard(run)
        key = (status,)
        values = self._runs_total.values
        values[key] = values.get(key, 0) + 1
        self._run_duration.observe(key, elapsed)

    def on_attempt_end(self, attempt: AttemptInfo) -> None:
        key = (attempt.kind, attempt.agent, attempt.outcome or "")
        values = self._attempts.values
        values[key] = values.get(key, 0) + 1
        self._attempt_duration.observe(key, attempt.ended - attempt.started)
        if attempt.error_type is not None:
            _add(self._attempt_errors, (attempt.kind, attempt.agent, attempt.error_type))
        usage = attempt.usage
        if usage:
            for unit, n in usage.items():
                _add(self._usage, (attempt.kind, attempt.agent, unit), n)

    def on_retry(self, run: RunInfo, task: Task, agent: str, attempt: int, delay: float) -> None:
        _add(self._retries, (task.kind, agent))

    def on_fallback(
        self, run: RunInfo, task: Task, from_agent: str, to_agent: str | None, reason: str
    ) -> None:
        if to_agent is not None:  # None: the chain ran out, which the task's status tells
            _add(self._fallbacks, (task.kind, from_agent, to_agent))

    def on_task_end(self, run: RunInfo, result: TaskResult) -> None:
        status = str(result.status)
        kind = result.kind
        key = (kind, last_agent(result), status)
        values = self._tasks.values
        values[key] = values.get(key, 0) + 1
        if result.started is not None:
            self._task_duration.observe((kind, status), max(0.0, result.finished - result.started))

    # -- scraping ----------------------------------------------------------------------------------

    def _counted(self) -> Iterator[Metric]:
        for counter in (
            self._attempts, self._attempt_errors, self._retries, self._fallbacks, self._tasks,
            self._usage, self._runs_total,
        ):  # fmt: skip
            yield counter.family()
        for histogram in (self._attempt_duration, self._task_duration, self._run_duration):
            yield histogram.family()


def _add(counter: _Counter, key: tuple[str, ...], n: float = 1) -> None:
    values = counter.values
    values[key] = values.get(key, 0) + n


class _Collector:
    """Every metric, read when Prometheus scrapes (in the exporter's thread: the counts' dicts
    are copied first, and the gauges are reads of plain ints and strs)."""

    def __init__(self, owner: PrometheusMetrics) -> None:
        self._owner = owner
        self._ns = owner.namespace

    def describe(self) -> list[Metric]:
        # The names and types, for the registry's clash check (nothing live yet).
        return [*self._owner._counted(), *self._gauges((), ())]

    def collect(self) -> Iterator[Metric]:
        owner = self._owner
        yield from owner._counted()
        yield from self._gauges(list(owner._orchestrators), tuple(owner._runs))

    def _gauges(
        self, orchestrators: Sequence[Orchestrator], runs: Sequence[RunInfo]
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
