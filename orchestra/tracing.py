"""OpenTelemetry tracing for orchestra (the `otel` extra: opentelemetry-api).

```python
from orchestra.tracing import OpenTelemetryTracing

async with Orchestrator(agents=[...], instruments=[OpenTelemetryTracing()]) as orch:
    await orch.run(tasks)          # spans go to the global TracerProvider your app configured
```

A span per run, per task and per attempt, nested: ``orchestra run`` (a child of whatever span is
current where `run()` is called) > ``task {kind}`` (from its first attempt to its end) >
``attempt {agent}`` (one agent call, with its checks). The attempt's span is the *current* span
while the agent runs, in the agent's own task: spans its code makes (an httpx or anthropic
instrumentation, or the agent's own `tracer.start_as_current_span`) nest under it.

Failures set the span status to ERROR with `error.type` (the exception's class name, or the task's
error type) and an `exception` event whose message and stack trace are scrubbed of secrets as
`RunResult.errors` are. Retries and fallbacks are events on the task's span. `gen_ai.*` attributes
are set only where they fit: on the attempt of an agent that declares a `model` (an LLM agent),
as the GenAI conventions' `invoke_agent` operation, with the tokens it recorded through
`ctx.record_usage`. Payloads and outputs are never recorded.

Times are the run's clock mapped to epoch time, so under a `FakeClock` the spans show virtual time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from ._core._instruments import CANCELLED, FAILED, Instrument, last_agent
from ._exceptions import ConfigError
from ._extras import missing_extra
from ._failure import describe

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, Status, StatusCode
except ImportError as exc:  # pragma: no cover - exercised by a test that hides the package
    # An SDK (opentelemetry-sdk) is the application's choice, to export the spans.
    raise missing_extra("orchestra.tracing", "otel", exc) from exc

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer, TracerProvider

    from ._core._instruments import AttemptInfo, RunInfo
    from ._core._orchestrator import Orchestrator
    from ._task import Task, TaskResult

__all__ = ("OpenTelemetryTracing",)

_SCOPE: Final = "orchestra"
_SUCCESS_STATUSES: Final = frozenset(("success", "partial"))


class _RunSpans:
    """A run's span and the spans of its tasks that have begun and not ended."""

    __slots__ = ("span", "tasks")

    def __init__(self, span: Span) -> None:
        self.span = span
        self.tasks: dict[str, Span] = {}


class OpenTelemetryTracing(Instrument):
    """Spans for runs, tasks and attempts (see the module's docstring).

    Args:
        tracer_provider: where spans go (default: the global one, `trace.set_tracer_provider`).
    """

    def __init__(self, *, tracer_provider: TracerProvider | None = None) -> None:
        from ._version import __version__

        if tracer_provider is not None and not callable(
            getattr(tracer_provider, "get_tracer", None)
        ):
            # Else an AttributeError from inside opentelemetry's get_tracer.
            raise ConfigError(
                "OpenTelemetryTracing: tracer_provider must be an opentelemetry TracerProvider "
                f"or None, got {tracer_provider!r}"
            )
        self.tracer: Tracer = trace.get_tracer(_SCOPE, __version__, tracer_provider=tracer_provider)
        self._runs: dict[RunInfo, _RunSpans] = {}
        self._models: dict[str, str] = {}  # agent name -> model, for agents that declare one

    # -- hooks -------------------------------------------------------------------------------------

    def on_attach(self, orchestrator: Orchestrator) -> None:
        for name, slot in orchestrator.registry.slots.items():
            model = getattr(slot.agent, "model", None)
            if isinstance(model, str):
                self._models[name] = model

    def on_run_start(self, run: RunInfo) -> None:
        span = self.tracer.start_span(
            "orchestra run",
            kind=SpanKind.INTERNAL,
            start_time=_ns(run, run.started),
            attributes={"orchestra.run.id": run.run_id},
        )
        self._runs[run] = _RunSpans(span)

    def on_run_end(self, run: RunInfo, status: str, elapsed: float) -> None:
        spans = self._runs.pop(run, None)
        if spans is None:
            return
        end = _ns(run, run.now())
        for task_span in spans.tasks.values():  # tasks the run left unfinished (an input error)
            task_span.set_attribute("orchestra.task.status", "unfinished")
            task_span.end(end_time=end)
        span = spans.span
        span.set_attribute("orchestra.run.status", status)
        if status not in _SUCCESS_STATUSES and status != CANCELLED:
            span.set_attribute("error.type", f"run_{status}")
            span.set_status(Status(StatusCode.ERROR, f"the run ended {status}"))
        span.end(end_time=end)

    def on_attempt_start(self, attempt: AttemptInfo) -> None:
        run = attempt.run
        task_span = self._task_span(run, attempt.task, attempt.started)
        if task_span is None:
            return
        agent = attempt.agent
        # The run's and the task's ids and kind are on their spans, this one's ancestors: the SDK
        # pays per attribute (about a microsecond each), so they are not repeated here.
        attributes: dict[str, Any] = {
            "orchestra.agent.name": agent,
            "orchestra.attempt.number": attempt.number,
        }
        model = self._models.get(agent)
        if model is not None:
            # An LLM agent: the attempt is the GenAI conventions' `invoke_agent` operation (the
            # model calls inside it are the client instrumentation's own spans).
            name = f"invoke_agent {agent}"
            attributes["gen_ai.operation.name"] = "invoke_agent"
            attributes["gen_ai.agent.name"] = agent
            attributes["gen_ai.request.model"] = model
        else:
            name = f"attempt {agent}"
        span = self.tracer.start_span(
            name,
            context=trace.set_span_in_context(task_span),
            kind=SpanKind.INTERNAL,
            start_time=_ns(run, attempt.started),
            attributes=attributes,
        )
        # The current span for the agent's own code: this runs in the dispatcher's runner (an
        # asyncio task) whose context is its own copy, and `on_attempt_end` detaches it in the same task.
        token = otel_context.attach(trace.set_span_in_context(span))
        if attempt.state is None:
            attempt.state = {}
        attempt.state[self] = (span, token)

    def on_attempt_end(self, attempt: AttemptInfo) -> None:
        state = attempt.state.pop(self, None) if attempt.state is not None else None
        if state is None:
            return
        span, token = state
        try:
            outcome = attempt.outcome
            span.set_attribute("orchestra.attempt.outcome", outcome or "")
            if outcome == FAILED and attempt.error is not None:
                failure = describe(attempt.error)  # scrubbed of secrets, bounded
                span.set_attribute("error.type", failure.error_type)
                if failure.status_code is not None:
                    span.set_attribute("http.response.status_code", failure.status_code)
                exception: dict[str, Any] = {
                    "exception.type": failure.error_type,
                    "exception.message": failure.message,
                }
                if failure.traceback:
                    exception["exception.stacktrace"] = failure.traceback
                span.add_event("exception", exception, timestamp=_ns(attempt.run, attempt.ended))
                span.set_status(
                    Status(StatusCode.ERROR, f"{failure.error_type}: {failure.message}")
                )
            usage = attempt.usage
            if usage and attempt.agent in self._models:
                for unit in ("input_tokens", "output_tokens"):
                    if unit in usage:
                        span.set_attribute(f"gen_ai.usage.{unit}", usage[unit])
            span.end(end_time=_ns(attempt.run, attempt.ended))
        finally:
            otel_context.detach(token)

    def on_retry(self, run: RunInfo, task: Task, agent: str, attempt: int, delay: float) -> None:
        now = run.now()
        span = self._task_span(run, task, now)
        if span is not None:
            span.add_event(
                "retry",
                {
                    "orchestra.agent.name": agent,
                    "orchestra.attempt.number": attempt,
                    "orchestra.retry.delay": delay,
                },
                timestamp=_ns(run, now),
            )

    def on_fallback(
        self, run: RunInfo, task: Task, from_agent: str, to_agent: str | None, reason: str
    ) -> None:
        now = run.now()
        span = self._task_span(run, task, now)
        if span is not None:
            span.add_event(
                "fallback",
                {
                    "orchestra.fallback.from": from_agent,
                    "orchestra.fallback.to": to_agent or "",
                    "orchestra.fallback.reason": reason,
                },
                timestamp=_ns(run, now),
            )

    def on_task_end(self, run: RunInfo, result: TaskResult) -> None:
        spans = self._runs.get(run)
        if spans is None:
            return
        now = run.now()
        span = spans.tasks.pop(result.task_id, None)
        if span is None:  # it never had an attempt (skipped, cancelled, refused): an instant
            span = self._start_task_span(run, spans, result.task, now)
            del spans.tasks[result.task_id]
        status = str(result.status)
        span.set_attribute("orchestra.task.status", status)
        span.set_attribute("orchestra.task.attempts", result.attempts)
        agent = last_agent(result)
        if agent:
            span.set_attribute("orchestra.agent.name", agent)
        if result.defaulted:
            span.set_attribute("orchestra.task.defaulted", True)
        if status == FAILED:
            error_type = result.error_type or "Failed"
            span.set_attribute("error.type", error_type)
            span.set_status(Status(StatusCode.ERROR, result.error or error_type))
        elif status != "succeeded" and result.error_type is not None:
            span.set_attribute("orchestra.task.reason", result.error or result.error_type)
        span.end(end_time=_ns(run, now))

    # -- spans -------------------------------------------------------------------------------------

    def _task_span(self, run: RunInfo, task: Task, now: float) -> Span | None:
        spans = self._runs.get(run)
        if spans is None:
            return None
        span = spans.tasks.get(task.id)
        if span is None:
            span = self._start_task_span(run, spans, task, now)
        return span

    def _start_task_span(self, run: RunInfo, spans: _RunSpans, task: Task, now: float) -> Span:
        span = self.tracer.start_span(
            f"task {task.kind}",
            context=trace.set_span_in_context(spans.span),
            kind=SpanKind.INTERNAL,
            start_time=_ns(run, now),
            attributes={
                "orchestra.task.id": task.id,
                "orchestra.task.kind": task.kind,
                "orchestra.task.priority": task.priority,
            },
        )
        spans.tasks[task.id] = span
        return span


def _ns(run: RunInfo, t: float) -> int:
    """Epoch nanoseconds (what OpenTelemetry takes) for the run clock's `t`."""
    return int(run.to_wall(t) * 1e9)
