"""The run's result as people read it: `print(result)` and `print(result.metadata)` are a few short
lines, the same summary ``orchestra run`` prints; `ok` and `error_for` answer the usual questions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from orchestra import Context, RetryPolicy, Task, agent

if TYPE_CHECKING:
    from collections.abc import Callable

    from orchestra import Orchestrator, RunResult
    from orchestra.testing import FakeClock


@agent(kinds=["double"])
async def double(task: Task, ctx: Context) -> int:
    if task.payload < 0:
        raise ValueError(f"negative: {task.payload}")
    if task.payload == 0:
        raise KeyError("zero")
    return int(task.payload) * 2


async def run_of(
    make_orchestrator: Callable[..., Orchestrator], payloads: list[int], **options: Any
) -> RunResult:
    options.setdefault("retry", RetryPolicy(max_attempts=2, base=0.5, jitter="none"))
    async with make_orchestrator(agents=[double], concurrency=2, **options) as orch:
        return await orch.run(tasks=[Task("double", p, id=f"t{p}") for p in payloads], run_id="r1")


class TestPrintingAResult:
    async def test_a_successful_run_is_one_line(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        result = await run_of(make_orchestrator, [1, 2, 3])
        assert str(result) == (
            "success: 3 tasks (3 succeeded) in 0.00s; 3 attempts, 0 retries, 0 fallbacks"
        )

    async def test_a_failed_run_says_why_counts_its_errors_by_type_and_lists_them(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        result = await run_of(make_orchestrator, [1, -1, -2, 0])
        assert str(result).splitlines() == [
            "failed: 4 tasks (3 failed, 1 succeeded) in 0.50s; 7 attempts, 3 retries, 0 fallbacks",
            "reason: success rate 0.250 is below the threshold 0.8",
            "errors: 2 ValueError, 1 KeyError",
            "  t-1 (double): ValueError: negative: -1 (2 attempts failed)",
            "  t-2 (double): ValueError: negative: -2 (2 attempts failed)",
            "  t0 (double): KeyError: 'zero' (2 attempts failed)",
        ]

    async def test_only_the_first_errors_are_listed_and_the_rest_counted(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        result = await run_of(make_orchestrator, [-1, -2, -3, -4])
        lines = result.summary(errors=1).splitlines()
        assert lines[2:] == [
            "errors: 4 ValueError",
            "  t-1 (double): ValueError: negative: -1 (2 attempts failed)",
            "  ... and 3 more",
        ]

    async def test_the_metadata_prints_as_a_few_short_lines(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        result = await run_of(make_orchestrator, [1, 2, -1])
        assert str(result.metadata).splitlines() == [
            "run r1: 3 tasks (1 failed, 2 succeeded) in 0.50s",
            "attempts 4, retries 1, fallbacks 0; peak concurrency 1",
            "tasks per agent: double 2",
            "reason: success rate 0.667 is below the threshold 0.8",
        ]
        assert len(repr(result.metadata)) > 500, "the repr stays the whole model"

    async def test_the_metadata_shows_the_spend_when_agents_recorded_one(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        @agent(kinds=["ask"])
        async def ask(task: Task, ctx: Context) -> str:
            ctx.record_usage(input_tokens=100, output_tokens=20, cost=0.0012)
            return "ok"

        async with make_orchestrator(agents=[ask]) as orch:
            result = await orch.run(tasks=[Task("ask", None), Task("ask", None)])
        assert "spent: $0.0024, 200 input_tokens, 40 output_tokens" in str(result.metadata)


class TestAskingAResult:
    async def test_ok_holds_for_a_partial_run_and_not_for_a_failed_one(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        partial = await run_of(make_orchestrator, [1, 2, 3, 4, -1], success_threshold=0.8)
        failed = await run_of(make_orchestrator, [1, -1], success_threshold=0.8)
        assert (partial.status, partial.ok) == ("partial", True)
        assert (failed.status, failed.ok) == ("failed", False)

    async def test_error_for_gives_a_failed_tasks_record_and_none_for_a_success(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        result = await run_of(make_orchestrator, [1, -1])
        record = result.error_for("t-1")
        assert record is not None
        assert (record.error_type, len(record.attempts)) == ("ValueError", 2)
        assert result.error_for("t1") is None
