"""Partial success: the run's status from its success rate, threshold and critical tasks; dependents
of failed tasks skipped with the reason; `on_threshold_missed`; partial outputs of failed tasks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from orchestra import (
    ConfigError,
    Context,
    Orchestrator,
    PermanentError,
    RetryPolicy,
    RunResult,
    Task,
    TaskResult,
    Verdict,
    agent,
)
from orchestra.events import TaskFinished
from orchestra.testing import scripted

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from orchestra import Agent

pytestmark = pytest.mark.usefixtures("clock")


def judge(name: str = "judge", kinds: Sequence[str] = ("k",)) -> Agent:
    """An agent that fails (permanently) the tasks whose payload is "fail"."""

    async def run(task: Task, ctx: Context) -> Any:
        if task.payload == "fail":
            raise PermanentError(f"cannot handle {task.id}")
        return f"done {task.id}"

    return agent(run, kinds=kinds, name=name)


def batch(make_task: Callable[..., Task], ok: int, failing: int, **fields: Any) -> list[Task]:
    return [make_task("k", "ok") for _ in range(ok)] + [
        make_task("k", "fail", **fields) for _ in range(failing)
    ]


class TestStatus:
    async def test_success_when_every_task_succeeded(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        result = await make_orchestrator(agents=[judge()]).run(tasks=batch(make_task, 10, 0))
        assert result.status == "success"
        assert result.ok
        assert result.errors == []
        assert result.metadata.success_rate == 1.0
        assert result.metadata.reason is None

    @pytest.mark.parametrize(("ok", "failing"), [(9, 1), (8, 2)], ids=["90%", "exactly-80%"])
    async def test_partial_at_or_above_the_threshold(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
        ok: int,
        failing: int,
    ) -> None:
        orch = make_orchestrator(agents=[judge()], success_threshold=0.8)
        result = await orch.run(tasks=batch(make_task, ok, failing))
        assert result.status == "partial"
        assert result.ok
        assert len(result.errors) == failing
        assert len(result.data) == ok
        assert result.metadata.success_rate == pytest.approx(ok / 10)

    async def test_failed_below_the_threshold(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        orch = make_orchestrator(agents=[judge()], success_threshold=0.8)
        result = await orch.run(tasks=batch(make_task, 7, 3))
        assert result.status == "failed"
        assert not result.ok
        assert result.metadata.reason is not None
        assert "threshold" in result.metadata.reason
        assert len(result.data) == 7  # what succeeded is still there

    async def test_a_failed_critical_task_fails_the_run_whatever_the_rate(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        orch = make_orchestrator(agents=[judge()], success_threshold=0.5)
        tasks = [*batch(make_task, 19, 0), make_task("k", "fail", id="key", critical=True)]
        result = await orch.run(tasks=tasks)
        assert result.metadata.success_rate == pytest.approx(0.95)
        assert result.status == "failed"
        assert result.metadata.reason is not None
        assert "critical" in result.metadata.reason
        record = result.error_for("key")
        assert record is not None
        assert record.critical

    async def test_a_succeeded_critical_task_leaves_the_run_partial(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        orch = make_orchestrator(agents=[judge()])
        tasks = [make_task("k", "ok", critical=True), *batch(make_task, 8, 1)]
        result = await orch.run(tasks=tasks)
        assert result.status == "partial"

    @pytest.mark.parametrize("threshold", [-0.1, 1.5])
    def test_a_threshold_outside_0_1_is_refused(
        self, make_orchestrator: Callable[..., Orchestrator], threshold: float
    ) -> None:
        with pytest.raises(ConfigError, match="success_threshold"):
            make_orchestrator(agents=[judge()], success_threshold=threshold)


class TestSkippedDependents:
    async def test_dependents_of_a_failed_task_are_skipped_with_the_reason(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        called: list[str] = []

        @agent(kinds=["k"])
        async def worker(task: Task, ctx: Context) -> str:
            called.append(task.id or "")
            if task.payload == "fail":
                raise PermanentError("broken input")
            return "ok"

        orch = make_orchestrator(agents=[worker])
        finished: list[TaskResult] = []
        orch.subscribe(lambda e: finished.append(e.result), TaskFinished)
        result = await orch.run(
            tasks=[
                make_task("k", "fail", id="A"),
                make_task("k", id="B", depends_on=["A"]),
                make_task("k", id="C", depends_on=["B"]),
                make_task("k", id="D"),
            ]
        )
        assert sorted(called) == ["A", "D"]
        by_id = {r.task_id: r for r in finished}
        assert [by_id[t].status for t in "ABCD"] == ["failed", "skipped", "skipped", "succeeded"]
        assert by_id["B"].error_type == "DependencyFailed"
        b, c = result.error_for("B"), result.error_for("C")
        assert b is not None
        assert c is not None
        assert (b.status, c.status) == ("skipped", "skipped")
        assert "'A'" in b.message
        assert "'A'" in c.message or "'B'" in c.message
        assert "A" in b.remediation or "depend" in b.remediation.lower()
        assert result.metadata.counts == {"succeeded": 1, "failed": 1, "skipped": 2, "cancelled": 0}
        assert result.status == "failed"  # skipped tasks count as not succeeded

    async def test_dependents_of_a_defaulted_task_run(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        broken = scripted("broken", ["fetch"], then="permanent")
        reader = scripted("reader", ["read"])
        orch = make_orchestrator(agents=[broken, reader], defaults={"fetch": "cached"})
        result = await orch.run(
            tasks=[make_task("fetch", id="f"), make_task("read", id="r", depends_on=["f"])]
        )
        assert result.status == "success"
        assert [c.task_id for c in reader.calls] == ["r"]


class TestThresholdHook:
    async def test_the_hook_may_replace_the_result_after_rerunning_failed_tasks(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        healthy = judge("healthy", ["k"])
        seen: list[tuple[RunResult, list[str]]] = []

        async def rerun(result: RunResult, failed: list[Task]) -> RunResult:
            seen.append((result, sorted(t.id or "" for t in failed)))
            again = await Orchestrator(agents=[scripted("fresh", ["k"])]).run(tasks=failed)
            return result.model_copy(
                update={
                    "status": again.status,
                    "data": {**result.data, **again.data},
                    "errors": again.errors,
                }
            )

        orch = make_orchestrator(agents=[healthy], on_threshold_missed=rerun)
        tasks = [make_task("k", "ok", id=f"ok{i}") for i in range(5)] + [
            make_task("k", "fail", id=f"bad{i}") for i in range(5)
        ]
        final = await orch.run(tasks=tasks)
        ((partial, failed_ids),) = seen
        assert partial.status == "failed"  # the hook saw the original, partial result
        assert len(partial.data) == 5
        assert failed_ids == [f"bad{i}" for i in range(5)]
        assert final.status == "success"
        assert sorted(final.data) == sorted(t.id or "" for t in tasks)
        assert final.errors == []

    async def test_a_sync_hook_returning_a_result(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        calls: list[int] = []

        def hook(result: RunResult, failed: list[Task]) -> RunResult:
            calls.append(len(failed))
            return result.model_copy(update={"data": "replaced"})

        orch = make_orchestrator(agents=[judge()], on_threshold_missed=hook)
        result = await orch.run(tasks=batch(make_task, 1, 3))
        assert calls == [3]
        assert result.data == "replaced"

    @pytest.mark.parametrize("outcome", ["none", "raises"])
    async def test_a_hook_that_returns_nothing_or_raises_keeps_the_result(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
        outcome: str,
    ) -> None:
        calls: list[str] = []

        def hook(result: RunResult, failed: list[Task]) -> None:
            calls.append(result.status)
            if outcome == "raises":
                raise RuntimeError("hook failed")

        orch = make_orchestrator(agents=[judge()], on_threshold_missed=hook)
        result = await orch.run(tasks=batch(make_task, 1, 3))
        assert calls == ["failed"]
        assert result.status == "failed"
        assert len(result.errors) == 3

    async def test_the_hook_is_not_called_when_the_threshold_is_met(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        calls: list[RunResult] = []
        orch = make_orchestrator(agents=[judge()], on_threshold_missed=lambda r, f: calls.append(r))
        async with orch:
            assert (await orch.run(tasks=batch(make_task, 10, 0))).status == "success"
            assert (await orch.run(tasks=batch(make_task, 9, 1))).status == "partial"
        assert calls == []


class TestPartialOutputs:
    async def test_a_failed_tasks_last_rejected_output_is_kept(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        @agent(kinds=["summarize"])
        async def summarize(task: Task, ctx: Context) -> dict[str, Any]:
            return {"id": task.id, "draft": ctx.attempt, "text": "..." * ctx.attempt}

        def check(task: Task, output: Any) -> Verdict:
            return Verdict(task.payload != "hard", "not good enough")

        orch = make_orchestrator(
            agents=[summarize],
            verify={"summarize": check},
            retry=RetryPolicy(max_attempts=3, base=0.1),
        )
        tasks = [make_task("summarize", id=f"s{i}") for i in range(9)]
        tasks.append(make_task("summarize", "hard", id="hard"))
        result = await orch.run(tasks=tasks)
        assert result.status == "partial"
        record = result.error_for("hard")
        assert record is not None
        assert record.partial_output == {"id": "hard", "draft": 3, "text": "........."}
        assert "hard" not in result.data

    async def test_a_task_that_only_raised_has_no_partial_output(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        orch = make_orchestrator(agents=[judge()])
        result = await orch.run(tasks=[make_task("k", "fail", id="x")])
        record = result.error_for("x")
        assert record is not None
        assert record.partial_output is None

    async def test_the_result_round_trips_through_json_with_partial_outputs(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        @agent(kinds=["k"])
        async def writer(task: Task, ctx: Context) -> dict[str, int]:
            return {"n": ctx.attempt}

        orch = make_orchestrator(
            agents=[writer],
            verify={"k": lambda t, o: t.id != "x"},
            retry=RetryPolicy(max_attempts=2, base=0.1),
        )
        result = await orch.run(tasks=[make_task("k", id="x"), make_task("k", id="y")])
        assert RunResult.model_validate_json(result.model_dump_json()) == result
