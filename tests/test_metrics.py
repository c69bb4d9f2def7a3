"""Prometheus metrics, read back from a real `CollectorRegistry`: exact counters and histograms by
kind, agent and outcome, live gauges at scrape time, the exporter, and the extra's import error.
In fake time, so durations are exact."""

from __future__ import annotations

import importlib
import sys
import urllib.request
from functools import partial
from typing import TYPE_CHECKING

import anyio
import pytest
from prometheus_client import CollectorRegistry

from orchestra import ConfigError, Context, Orchestrator, Task, agent
from orchestra.metrics import PrometheusMetrics
from orchestra.testing import scripted
from tests.helpers import trips_after
from tests.test_instruments import scenario, scenario_tasks

if TYPE_CHECKING:
    from collections.abc import Callable

pytestmark = pytest.mark.usefixtures("clock")


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> PrometheusMetrics:
    return PrometheusMetrics(registry=registry)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


class TestCounters:
    async def test_attempts_retries_fallbacks_and_tasks_by_label(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        metrics: PrometheusMetrics,
        registry: CollectorRegistry,
    ) -> None:
        result = await scenario(make_orchestrator, metrics).run(tasks=scenario_tasks())
        attempts = "orchestra_attempts_total"
        assert value(registry, attempts, kind="research", agent="sonnet", outcome="failed") == 2
        assert value(registry, attempts, kind="research", agent="haiku", outcome="succeeded") == 1
        assert value(registry, attempts, kind="flaky", agent="flaky", outcome="failed") == 1
        assert value(registry, attempts, kind="flaky", agent="flaky", outcome="succeeded") == 1
        assert value(registry, attempts, kind="doomed", agent="doomed", outcome="failed") == 1
        errors = "orchestra_attempt_errors_total"
        assert value(registry, errors, kind="doomed", agent="doomed", error_type="PermanentError")
        assert value(registry, errors, kind="research", agent="sonnet", error_type="ConnectionError") == 2  # fmt: skip
        assert value(registry, "orchestra_retries_total", kind="research", agent="sonnet") == 1
        assert value(registry, "orchestra_retries_total", kind="flaky", agent="flaky") == 1
        assert value(registry, "orchestra_fallbacks_total", kind="research", from_agent="sonnet", to_agent="haiku") == 1  # fmt: skip
        tasks = "orchestra_tasks_total"
        assert value(registry, tasks, kind="research", agent="haiku", status="succeeded") == 1
        assert value(registry, tasks, kind="doomed", agent="doomed", status="failed") == 1
        assert value(registry, "orchestra_runs_total", status="partial") == 1
        total = sum(
            s.value
            for m in registry.collect()
            if m.name == "orchestra_attempts"
            for s in m.samples
            if s.name == "orchestra_attempts_total"
        )
        assert total == result.metadata.attempts

    async def test_durations_in_seconds(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        metrics: PrometheusMetrics,
        registry: CollectorRegistry,
    ) -> None:
        await scenario(make_orchestrator, metrics).run(tasks=scenario_tasks())
        duration = "orchestra_attempt_duration_seconds"
        labels = {"kind": "research", "agent": "sonnet", "outcome": "failed"}
        assert value(registry, f"{duration}_count", **labels) == 2
        assert value(registry, f"{duration}_sum", **labels) == pytest.approx(2.0)
        assert value(registry, f"{duration}_bucket", le="0.5", **labels) == 0
        assert value(registry, f"{duration}_bucket", le="1.0", **labels) == 2
        # research: 1 s, a 1 s wait, 1 s, then 1 s on haiku: 4 s from its first attempt.
        task = "orchestra_task_duration_seconds"
        assert value(registry, f"{task}_sum", kind="research", status="succeeded") == pytest.approx(4.0)  # fmt: skip
        assert value(registry, "orchestra_run_duration_seconds_sum", status="partial") == pytest.approx(4.0)  # fmt: skip

    async def test_usage_units_the_agents_recorded(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        metrics: PrometheusMetrics,
        registry: CollectorRegistry,
    ) -> None:
        @agent(kinds=["ask"])
        async def claude(task: Task, ctx: Context) -> str:
            ctx.record_usage(input_tokens=100, output_tokens=20)
            return "answer"

        orch = make_orchestrator(agents=[claude], instruments=[metrics])
        await orch.run(tasks=[Task("ask"), Task("ask")])
        usage = "orchestra_agent_usage_total"
        assert value(registry, usage, kind="ask", agent="claude", unit="input_tokens") == 200
        assert value(registry, usage, kind="ask", agent="claude", unit="output_tokens") == 40

    async def test_one_object_sums_several_orchestrators(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        metrics: PrometheusMetrics,
        registry: CollectorRegistry,
    ) -> None:
        for _ in range(2):
            orch = make_orchestrator(agents=[scripted("a", ["work"])], instruments=[metrics])
            await orch.run(tasks=[Task("work")])
        assert value(registry, "orchestra_runs_total", status="success") == 2


class TestGauges:
    async def test_in_flight_queue_and_runs_read_while_the_run_goes_on(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        metrics: PrometheusMetrics,
        registry: CollectorRegistry,
    ) -> None:
        gate = anyio.Event()

        @agent(kinds=["work"], concurrency=3)
        async def held(task: Task, ctx: Context) -> None:
            await gate.wait()

        orch = make_orchestrator(agents=[held], instruments=[metrics])
        seen: dict[str, float | None] = {}
        tasks = [Task("work", id=f"w{i}") for i in range(10)]
        tasks.append(Task("work", id="after", depends_on=["w0"]))
        async with orch, anyio.create_task_group() as tg:
            tg.start_soon(partial(orch.run, tasks=tasks))
            await anyio.sleep(1)
            for name in (
                "orchestra_runs_active",
                "orchestra_queue_depth",
                "orchestra_tasks_waiting",
                "orchestra_tasks_unfinished",
            ):
                seen[name] = value(registry, name)
            seen["in_flight"] = value(registry, "orchestra_attempts_in_flight", agent="held")
            gate.set()
        assert seen == {
            "orchestra_runs_active": 1,
            "orchestra_queue_depth": 7,
            "orchestra_tasks_waiting": 1,
            "orchestra_tasks_unfinished": 11,
            "in_flight": 3,
        }
        assert value(registry, "orchestra_runs_active") == 0
        assert value(registry, "orchestra_attempts_in_flight", agent="held") == 0

    async def test_breaker_state_one_series_per_state(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        metrics: PrometheusMetrics,
        registry: CollectorRegistry,
    ) -> None:
        orch = make_orchestrator(
            agents=[scripted("down", ["work"], then="error"), scripted("up", ["work"])],
            breaker=trips_after(1, cooldown=60),
            instruments=[metrics],
        )
        assert value(registry, "orchestra_breaker_state", agent="down", state="closed") == 1
        await orch.run(tasks=[Task("work", id="w")])
        state = "orchestra_breaker_state"
        assert value(registry, state, agent="down", state="open") == 1
        assert value(registry, state, agent="down", state="closed") == 0
        assert value(registry, state, agent="up", state="closed") == 1


class TestRegistry:
    def test_the_same_names_twice_in_one_registry_is_a_config_error(
        self, metrics: PrometheusMetrics, registry: CollectorRegistry
    ) -> None:
        with pytest.raises(ConfigError, match="already in this registry"):
            PrometheusMetrics(registry=registry)
        metrics.unregister()
        again = PrometheusMetrics(registry=registry)  # free again, and nothing half-registered
        assert again.registry is registry

    def test_another_namespace_lives_beside(
        self, metrics: PrometheusMetrics, registry: CollectorRegistry
    ) -> None:
        PrometheusMetrics(registry=registry, namespace="batch")
        assert value(registry, "batch_runs_active") == 0

    @pytest.mark.parametrize(
        ("name", "value"),
        [
            ("registry", "default"),
            ("namespace", 3),
            ("namespace", ""),
            ("buckets", "0.1"),
            ("buckets", [0.1, "1"]),
            ("buckets", [0.1, float("nan")]),
            ("buckets", [1, 1, 2]),  # two `le="1.0"` lines in every scrape
        ],
        ids=repr,
    )
    def test_a_wrong_option_is_a_config_error(self, name: str, value: object) -> None:
        with pytest.raises(ConfigError, match=name) as info:
            PrometheusMetrics(**{"registry": CollectorRegistry(), name: value})  # type: ignore[arg-type]
        assert repr(value) in str(info.value)

    def test_the_default_registry(self) -> None:
        from prometheus_client import REGISTRY

        metrics = PrometheusMetrics()
        try:
            assert REGISTRY.get_sample_value("orchestra_runs_active") == 0
        finally:
            metrics.unregister()
        assert REGISTRY.get_sample_value("orchestra_runs_active") is None


class TestExport:
    async def test_serve_over_http(
        self, make_orchestrator: Callable[..., Orchestrator], metrics: PrometheusMetrics
    ) -> None:
        await make_orchestrator(agents=[scripted("a", ["work"])], instruments=[metrics]).run(
            tasks=[Task("work")]
        )
        server, thread = metrics.serve(0)
        try:
            url = f"http://127.0.0.1:{server.server_port}/metrics"

            def fetch() -> str:
                with urllib.request.urlopen(url, timeout=10) as response:
                    return str(response.read().decode())

            with anyio.fail_after(30):
                body = await anyio.to_thread.run_sync(fetch)
        finally:
            server.shutdown()
            server.server_close()
            thread.join()
        assert 'orchestra_attempts_total{agent="a",kind="work",outcome="succeeded"} 1.0' in body

    def test_exposition_for_your_own_app(self, metrics: PrometheusMetrics) -> None:
        text = metrics.exposition().decode()
        assert "# TYPE orchestra_attempts_total counter" in text
        assert "# TYPE orchestra_attempt_duration_seconds histogram" in text
        assert "orchestra_queue_depth 0.0" in text


class TestMissingExtra:
    def test_import_is_an_import_error_naming_the_extra(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setitem(sys.modules, "prometheus_client", None)
        monkeypatch.delitem(sys.modules, "orchestra.metrics")
        with pytest.raises(ModuleNotFoundError) as info:
            importlib.import_module("orchestra.metrics")
        assert "pip install 'orchestra-runtime[metrics]'" in str(info.value)
        assert info.value.name == "prometheus_client"
        assert not isinstance(info.value, ConfigError)
