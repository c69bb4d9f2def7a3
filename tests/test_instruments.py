"""Instruments: the in-line hooks behind metrics and tracing. Every hook in the order things
happen, exact counts, the agent's context, a cancelled run, nothing built when there are none, and
an instrument that raises never breaking a run. In fake time."""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from orchestra import ConfigError, Context, Orchestrator, RetryPolicy, Task, TaskResult, agent
from orchestra.events import AttemptInfo, Instrument, RunInfo
from orchestra.testing import scripted

if TYPE_CHECKING:
    from collections.abc import Callable

    from tests.helpers import LogLines

pytestmark = pytest.mark.usefixtures("clock")


class Log(Instrument):
    """Every hook call, as a tuple, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def on_run_start(self, run: RunInfo) -> None:
        self.calls.append(("run_start", run.run_id))

    def on_attempt_start(self, attempt: AttemptInfo) -> None:
        self.calls.append(("attempt_start", attempt.task.id, attempt.agent, attempt.number))

    def on_attempt_end(self, attempt: AttemptInfo) -> None:
        self.calls.append(
            (
                "attempt_end",
                attempt.task.id,
                attempt.agent,
                attempt.number,
                attempt.outcome,
                attempt.error_type,
                attempt.duration,
            )
        )

    def on_retry(self, run: RunInfo, task: Task, agent: str, attempt: int, delay: float) -> None:
        self.calls.append(("retry", task.id, agent, attempt, delay))

    def on_fallback(
        self, run: RunInfo, task: Task, from_agent: str, to_agent: str | None, reason: str
    ) -> None:
        self.calls.append(("fallback", task.id, from_agent, to_agent))

    def on_task_end(self, run: RunInfo, result: TaskResult) -> None:
        self.calls.append(("task_end", result.task_id, result.status))

    def on_run_end(self, run: RunInfo, status: str, elapsed: float) -> None:
        self.calls.append(("run_end", status, elapsed))

    def of(self, task_id: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if len(c) > 1 and c[1] == task_id]


def scenario(make_orchestrator: Callable[..., Orchestrator], *instruments: Any) -> Orchestrator:
    """A retry then a fallback (research), a retry then success (flaky), a permanent failure
    (doomed); every call takes 1 s of fake time, retries wait 1 s."""
    return make_orchestrator(
        agents=[
            scripted("sonnet", ["research"], then="error", latency=1),
            scripted("haiku", ["research"], latency=1),
            scripted("flaky", ["flaky"], script=["error"], latency=1),
            scripted("doomed", ["doomed"], then="permanent", latency=1),
        ],
        fallbacks={"research": ["sonnet", "haiku"]},
        retry=RetryPolicy(max_attempts=2, base=1, jitter="none"),
        success_threshold=0.5,
        instruments=list(instruments),
    )


def scenario_tasks() -> list[Task]:
    return [Task("research", id="r"), Task("flaky", id="f"), Task("doomed", id="d")]


class TestHooks:
    async def test_every_step_in_order_with_its_outcome(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        log = Log()
        result = await scenario(make_orchestrator, log).run(tasks=scenario_tasks())
        assert result.status == "partial"
        assert log.calls[0] == ("run_start", result.metadata.run_id)
        assert log.calls[-1] == ("run_end", "partial", result.metadata.elapsed)
        assert log.of("r") == [
            ("attempt_start", "r", "sonnet", 1),
            ("attempt_end", "r", "sonnet", 1, "failed", "ConnectionError", 1.0),
            ("retry", "r", "sonnet", 1, 1.0),
            ("attempt_start", "r", "sonnet", 2),
            ("attempt_end", "r", "sonnet", 2, "failed", "ConnectionError", 1.0),
            ("fallback", "r", "sonnet", "haiku"),
            ("attempt_start", "r", "haiku", 3),
            ("attempt_end", "r", "haiku", 3, "succeeded", None, 1.0),
            ("task_end", "r", "succeeded"),
        ]
        assert log.of("f")[-3:] == [
            ("attempt_start", "f", "flaky", 2),
            ("attempt_end", "f", "flaky", 2, "succeeded", None, 1.0),
            ("task_end", "f", "succeeded"),
        ]
        assert log.of("d") == [
            ("attempt_start", "d", "doomed", 1),
            ("attempt_end", "d", "doomed", 1, "failed", "PermanentError", 1.0),
            ("fallback", "d", "doomed", None),  # the chain ran out
            ("task_end", "d", "failed"),
        ]

    async def test_attempts_counted_exactly_as_the_result_counts_them(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        log = Log()
        result = await scenario(make_orchestrator, log).run(tasks=scenario_tasks())
        names = [c[0] for c in log.calls]
        assert names.count("attempt_start") == names.count("attempt_end")
        assert names.count("attempt_end") == result.metadata.attempts == 6
        assert names.count("retry") == result.metadata.retries == 2
        assert names.count("task_end") == result.metadata.total == 3

    async def test_several_instruments_all_hear_everything(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        first, second = Log(), Log()
        await scenario(make_orchestrator, first, second).run(tasks=scenario_tasks())
        assert first.calls == second.calls
        assert first.calls

    async def test_a_task_that_never_ran_still_ends_once(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        log = Log()
        orch = make_orchestrator(
            agents=[scripted("doomed", ["doomed"], then="permanent"), scripted("ok", ["after"])],
            instruments=[log],
        )
        await orch.run(tasks=[Task("doomed", id="d"), Task("after", id="a", depends_on=["d"])])
        assert log.of("a") == [("task_end", "a", "skipped")]


class TestAgentContext:
    async def test_what_a_start_hook_sets_in_the_context_is_the_agents(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        current: contextvars.ContextVar[str | None] = contextvars.ContextVar("cur", default=None)
        seen: dict[str, str | None] = {}

        class Tags(Instrument):
            def on_attempt_start(self, attempt: AttemptInfo) -> None:
                attempt.state = {self: current.set(f"{attempt.task.id}/{attempt.number}")}

            def on_attempt_end(self, attempt: AttemptInfo) -> None:
                assert attempt.state is not None
                current.reset(attempt.state[self])

        @agent(kinds=["work"])
        async def work(task: Task, ctx: Context) -> None:
            seen[task.id] = current.get()
            await anyio.sleep(1)

        orch = make_orchestrator(agents=[work], concurrency=2, instruments=[Tags()])
        await orch.run(tasks=[Task("work", id=i) for i in "abc"])
        assert seen == {"a": "a/1", "b": "b/1", "c": "c/1"}
        assert current.get() is None  # nothing leaked into the caller's context


class TestCancellation:
    async def test_a_cancelled_run_ends_its_attempts_tasks_and_run(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        log = Log()
        orch = make_orchestrator(agents=[scripted("slow", ["work"], latency=10)], instruments=[log])
        with anyio.move_on_after(5):
            await orch.run(tasks=[Task("work", id="w")])
        assert log.of("w") == [
            ("attempt_start", "w", "slow", 1),
            ("attempt_end", "w", "slow", 1, "cancelled", None, 5.0),
            ("task_end", "w", "cancelled"),
        ]
        assert log.calls[-1] == ("run_end", "cancelled", 5.0)

    async def test_a_stopped_run_and_a_cancelled_task_end_once_each(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        log = Log()
        orch = make_orchestrator(agents=[scripted("slow", ["work"], latency=10)], instruments=[log])
        async with orch:
            handle = orch.start(tasks=[Task("work", id="a"), Task("work", id="b")])
            await anyio.sleep(1)
            handle.cancel(task_id="a")
            result = await handle.stop(grace=0)
        assert result.status == "cancelled"
        assert [c[0] for c in log.calls].count("run_start") == 1
        assert [c for c in log.calls if c[0] == "run_end"] == [("run_end", "cancelled", 1.0)]
        assert [c for c in log.calls if c[0] == "task_end"] == [
            ("task_end", "a", "cancelled"),
            ("task_end", "b", "cancelled"),
        ]
        assert [c[4] for c in log.calls if c[0] == "attempt_end"] == ["cancelled", "cancelled"]

    async def test_a_task_deadline_is_a_failed_attempt(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        log = Log()
        orch = make_orchestrator(agents=[scripted("slow", ["work"], latency=10)], instruments=[log])
        await orch.run(tasks=[Task("work", id="w", timeout=3)])
        assert log.of("w")[1] == ("attempt_end", "w", "slow", 1, "failed", "TaskTimeout", 3.0)
        assert log.of("w")[-1] == ("task_end", "w", "failed")


class TestRaisingInstrument:
    async def test_never_breaks_a_run_and_is_logged_once_per_hook(
        self, make_orchestrator: Callable[..., Orchestrator], logs: LogLines
    ) -> None:
        class Broken(Log):
            def __getattribute__(self, name: str) -> Any:
                method = object.__getattribute__(self, name)
                if not name.startswith("on_"):
                    return method

                def hook(*args: Any) -> None:
                    method(*args)
                    raise RuntimeError(f"{name} is broken")

                hook.__name__ = name
                return hook

        broken, log = Broken(), Log()
        result = await scenario(make_orchestrator, broken, log).run(tasks=scenario_tasks())
        assert result.status == "partial"
        assert broken.calls == log.calls  # every hook was still called, each time
        warned = [e["hook"] for e in logs.entries if e["event"].startswith("instrument raised")]
        assert sorted(warned) == sorted(
            [
                "on_run_start",
                "on_attempt_start",
                "on_attempt_end",
                "on_retry",
                "on_fallback",
                "on_task_end",
                "on_run_end",
            ]
        )


class TestOff:
    async def test_no_instrument_builds_nothing_per_attempt(
        self, make_orchestrator: Callable[..., Orchestrator], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        def refuse(*args: Any) -> None:
            raise AssertionError("an AttemptInfo was built without instruments")

        monkeypatch.setattr("orchestra._core._attempt.AttemptInfo", refuse)
        result = await scenario(make_orchestrator).run(tasks=scenario_tasks())
        assert result.metadata.attempts == 6

    def test_an_object_without_hooks_is_refused(self) -> None:
        with pytest.raises(ConfigError, match=r"instruments\[0\]"):
            Orchestrator(agents=[scripted("a", ["work"])], instruments=[object()])  # type: ignore[list-item]

    def test_the_same_instrument_twice_is_refused(self) -> None:
        # Was accepted: it heard every hook twice, and a Prometheus counter counted double.
        log = Log()
        with pytest.raises(ConfigError, match=r"instruments\[2\] is instruments\[0\] again"):
            Orchestrator(agents=[scripted("a", ["work"])], instruments=[log, Log(), log])

    def test_a_base_instrument_overriding_nothing_is_refused(self) -> None:
        with pytest.raises(ConfigError, match=r"instruments\[1\]"):
            Orchestrator(agents=[scripted("a", ["work"])], instruments=[Log(), Instrument()])
