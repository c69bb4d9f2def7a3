"""OpenTelemetry tracing, exported by the SDK's `InMemorySpanExporter`: a span per run, task and
attempt, nested, the agent's own spans under its attempt's, statuses and `error.type` on failures,
retry and fallback events, a cancelled run, secrets kept out, and the extra's import error."""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from orchestra import ConfigError, Context, Orchestrator, Task, agent
from orchestra.testing import scripted
from orchestra.tracing import OpenTelemetryTracing
from tests.test_instruments import scenario, scenario_tasks

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from opentelemetry.sdk.trace import ReadableSpan

pytestmark = pytest.mark.usefixtures("clock")


class Spans:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracing = OpenTelemetryTracing(tracer_provider=self.provider)

    @property
    def all(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.all if s.name == name]

    def one(self, name: str, **attributes: Any) -> ReadableSpan:
        found = [
            s
            for s in self.named(name)
            if all((s.attributes or {}).get(k) == v for k, v in attributes.items())
        ]
        assert len(found) == 1, (name, attributes, found)
        return found[0]

    def children(self, parent: ReadableSpan) -> list[ReadableSpan]:
        return [s for s in self.all if s.parent is not None and s.parent.span_id == _id(parent)]


def _id(span: ReadableSpan) -> int:
    assert span.context is not None
    return int(span.context.span_id)


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def seconds(span: ReadableSpan) -> float:
    assert span.start_time is not None
    assert span.end_time is not None
    return (span.end_time - span.start_time) / 1e9


@pytest.fixture
def spans() -> Iterator[Spans]:
    found = Spans()
    yield found
    found.provider.shutdown()


class TestNesting:
    async def test_run_task_attempt_and_the_agents_own_span(
        self, make_orchestrator: Callable[..., Orchestrator], spans: Spans
    ) -> None:
        inner = spans.provider.get_tracer("agent code")

        @agent(kinds=["work"])
        async def work(task: Task, ctx: Context) -> str:
            with inner.start_as_current_span("http call"):
                await anyio.sleep(2)
            return "done"

        outer = spans.provider.get_tracer("app")
        with outer.start_as_current_span("job"):
            await make_orchestrator(agents=[work], instruments=[spans.tracing]).run(
                tasks=[Task("work", id="a"), Task("work", id="b")]
            )
        job = spans.one("job")
        run = spans.one("orchestra run")
        assert run.parent is not None
        assert run.parent.span_id == _id(job)
        tasks = spans.children(run)
        assert sorted(attrs(t)["orchestra.task.id"] for t in tasks) == ["a", "b"]
        for task in tasks:
            assert task.name == "task work"
            [attempt] = spans.children(task)
            assert attempt.name == "attempt work"
            assert attrs(attempt)["orchestra.attempt.number"] == 1
            [http] = spans.children(attempt)
            assert http.name == "http call"
            assert seconds(attempt) == pytest.approx(2.0)  # fake time, mapped to epoch
        assert {s.context.trace_id for s in spans.all if s.context} == {job.context.trace_id}
        assert trace.get_current_span() is trace.INVALID_SPAN  # nothing left attached

    async def test_retries_and_fallbacks_are_events_of_the_task(
        self, make_orchestrator: Callable[..., Orchestrator], spans: Spans
    ) -> None:
        await scenario(make_orchestrator, spans.tracing).run(tasks=scenario_tasks())
        research = spans.one("task research")
        assert [a.name for a in sorted(spans.children(research), key=lambda s: s.start_time or 0)] == [
            "attempt sonnet",
            "attempt sonnet",
            "attempt haiku",
        ]  # fmt: skip
        events = [(e.name, dict(e.attributes or {})) for e in research.events]
        assert events == [
            (
                "retry",
                {
                    "orchestra.agent.name": "sonnet",
                    "orchestra.attempt.number": 1,
                    "orchestra.retry.delay": 1.0,
                },
            ),
            (
                "fallback",
                {
                    "orchestra.fallback.from": "sonnet",
                    "orchestra.fallback.to": "haiku",
                    "orchestra.fallback.reason": "2 attempts failed",
                },
            ),
        ]
        assert research.status.status_code is StatusCode.UNSET
        assert attrs(research)["orchestra.task.status"] == "succeeded"
        assert attrs(research)["orchestra.task.attempts"] == 3
        assert seconds(research) == pytest.approx(4.0)


class TestStatuses:
    async def test_failures_are_errors_with_their_type(
        self, make_orchestrator: Callable[..., Orchestrator], spans: Spans
    ) -> None:
        await scenario(make_orchestrator, spans.tracing).run(tasks=scenario_tasks())
        failed = spans.one("attempt sonnet", **{"orchestra.attempt.number": 1})
        assert failed.status.status_code is StatusCode.ERROR
        assert attrs(failed)["error.type"] == "ConnectionError"
        assert [e.name for e in failed.events] == ["exception"]
        ok = spans.one("attempt haiku")
        assert ok.status.status_code is StatusCode.UNSET
        assert "error.type" not in attrs(ok)
        doomed = spans.one("task doomed")
        assert doomed.status.status_code is StatusCode.ERROR
        assert attrs(doomed)["error.type"] == "PermanentError"
        assert attrs(doomed)["orchestra.agent.name"] == "doomed"
        run = spans.one("orchestra run")
        assert attrs(run)["orchestra.run.status"] == "partial"
        assert run.status.status_code is StatusCode.UNSET

    async def test_a_failed_run_is_an_error(
        self, make_orchestrator: Callable[..., Orchestrator], spans: Spans
    ) -> None:
        orch = make_orchestrator(
            agents=[scripted("doomed", ["work"], then="permanent")], instruments=[spans.tracing]
        )
        await orch.run(tasks=[Task("work")])
        run = spans.one("orchestra run")
        assert run.status.status_code is StatusCode.ERROR
        assert attrs(run)["error.type"] == "run_failed"

    async def test_secrets_stay_out_of_exception_events(
        self, make_orchestrator: Callable[..., Orchestrator], spans: Spans
    ) -> None:
        @agent(kinds=["work"])
        async def leaky(task: Task, ctx: Context) -> None:
            raise ValueError("bad request with api_key=sk-ant-api03-abcdefghijklmnopqrstuvwxyz")

        await make_orchestrator(agents=[leaky], instruments=[spans.tracing]).run(
            tasks=[Task("work")]
        )
        for span in spans.all:
            for event in span.events:
                assert "abcdefghijklmnop" not in str(dict(event.attributes or {}))
            assert "abcdefghijklmnop" not in (span.status.description or "")

    async def test_a_skipped_task_is_an_instant_span(
        self, make_orchestrator: Callable[..., Orchestrator], spans: Spans
    ) -> None:
        orch = make_orchestrator(
            agents=[scripted("doomed", ["doomed"], then="permanent"), scripted("ok", ["after"])],
            instruments=[spans.tracing],
        )
        await orch.run(tasks=[Task("doomed", id="d"), Task("after", id="a", depends_on=["d"])])
        skipped = spans.one("task after")
        assert attrs(skipped)["orchestra.task.status"] == "skipped"
        assert spans.children(skipped) == []
        assert skipped.parent is not None
        assert skipped.parent.span_id == _id(spans.one("orchestra run"))


class TestCancellation:
    async def test_every_span_ends_and_none_is_an_error(
        self, make_orchestrator: Callable[..., Orchestrator], spans: Spans
    ) -> None:
        orch = make_orchestrator(
            agents=[scripted("slow", ["work"], latency=10)], instruments=[spans.tracing]
        )
        with anyio.move_on_after(5):
            await orch.run(tasks=[Task("work", id="w")])
        assert sorted(s.name for s in spans.all) == ["attempt slow", "orchestra run", "task work"]
        attempt = spans.one("attempt slow")
        assert attrs(attempt)["orchestra.attempt.outcome"] == "cancelled"
        assert seconds(attempt) == pytest.approx(5.0)
        assert attrs(spans.one("task work"))["orchestra.task.status"] == "cancelled"
        assert attrs(spans.one("orchestra run"))["orchestra.run.status"] == "cancelled"
        assert all(s.status.status_code is StatusCode.UNSET for s in spans.all)
        assert trace.get_current_span() is trace.INVALID_SPAN


class TestGenAI:
    async def test_only_an_llm_agent_is_an_invoke_agent_operation(
        self, make_orchestrator: Callable[..., Orchestrator], spans: Spans
    ) -> None:
        class Claude:
            name = "claude"
            kinds = ("ask",)
            model = "claude-sonnet-4-5"

            async def __call__(self, task: Task, ctx: Context) -> str:
                ctx.record_usage(input_tokens=120, output_tokens=30)
                return "answer"

        orch = make_orchestrator(
            agents=[Claude(), scripted("plain", ["work"])], instruments=[spans.tracing]
        )
        await orch.run(tasks=[Task("ask"), Task("work")])
        llm = spans.one("invoke_agent claude")
        assert {k: v for k, v in attrs(llm).items() if k.startswith("gen_ai.")} == {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": "claude",
            "gen_ai.request.model": "claude-sonnet-4-5",
            "gen_ai.usage.input_tokens": 120,
            "gen_ai.usage.output_tokens": 30,
        }
        plain = spans.one("attempt plain")
        assert not [k for k in attrs(plain) if k.startswith("gen_ai.")]


class TestConfiguration:
    @pytest.mark.parametrize("provider", [3, "global"], ids=repr)
    def test_a_tracer_provider_that_is_not_one_is_a_config_error(self, provider: Any) -> None:
        with pytest.raises(ConfigError, match="tracer_provider") as info:
            OpenTelemetryTracing(tracer_provider=provider)
        assert repr(provider) in str(info.value)


class TestMissingExtra:
    def test_import_is_an_import_error_naming_the_extra(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setitem(sys.modules, "opentelemetry", None)
        monkeypatch.delitem(sys.modules, "orchestra.tracing")
        with pytest.raises(ModuleNotFoundError) as info:
            importlib.import_module("orchestra.tracing")
        assert "pip install 'orchestra-runtime[otel]'" in str(info.value)
        assert info.value.name == "opentelemetry"
        assert not isinstance(info.value, ConfigError)
