"""The attempt: the plain one and the full one end a task the same way."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from orchestra import Context, RetryPolicy, Task, agent
from orchestra._core._attempt import Attempts
from orchestra.testing import FakeClock, scripted
from tests.helpers import tasks_of

if TYPE_CHECKING:
    from collections.abc import Callable

    import pytest

    from orchestra import Orchestrator


async def outcome(
    make_orchestrator: Callable[..., Orchestrator], variant: str, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Any]:
    """A run of flaky agents, a dead one, retries and a spawn, every attempt made by `variant`;
    what it gave, but for the wall times, the run's id and the tracebacks."""
    with monkeypatch.context() as patch:
        if variant == "plain":

            async def not_here(*args: Any) -> None:
                raise AssertionError("an attempt was the full one")

            patch.setattr(Attempts, "run", not_here)
        else:  # every attempt the full one: `begin` says none is plain
            patch.setattr(Attempts, "begin", lambda *args: False)

        @agent(kinds=["parent"])
        async def parent(task: Task, ctx: Context) -> str:
            ctx.spawn(Task("work", f"{task.id}-child", id=f"{task.id}-child"))
            return "spawned"

        flaky = [
            scripted(name, ["work"], latency=0.5, jitter=0.4, failure_rate=0.4, seed=i)
            for i, name in enumerate(("a", "b"))
        ]
        down = scripted("down", ["dead"], then="error", latency=0.3)
        orch = make_orchestrator(
            agents=[parent, *flaky, down],
            concurrency=3,
            retry=RetryPolicy(max_attempts=3, base=0.2, cap=1.0),
            success_threshold=0.0,
        )
        tasks = [*tasks_of(30), *tasks_of(2, "dead", "d"), Task("parent", 0, id="p")]
        async with orch:
            result = await orch.run(tasks=tasks)
    dumped = result.model_dump(mode="json")
    for wall in ("run_id", "started_at", "finished_at"):
        del dumped["metadata"][wall]
    for error in dumped["errors"]:
        for attempt in error["attempts"]:
            del attempt["traceback"]  # its frames are the variant's own
    return dumped


class TestBothVariants:
    async def test_a_plain_and_a_full_attempt_end_every_task_the_same_way(
        self,
        clock: FakeClock,
        make_orchestrator: Callable[..., Orchestrator],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        plain = await outcome(make_orchestrator, "plain", monkeypatch)
        full = await outcome(make_orchestrator, "full", monkeypatch)
        # Failures, retries and a spawn happened: the endings that differ most were both taken.
        assert plain["metadata"]["retries"] > 0
        assert plain["errors"]
        assert plain["metadata"]["total"] == 34
        # The same statuses, outputs, attempts, error records (each attempt's start and
        # duration), timings and counts.
        assert plain == full
