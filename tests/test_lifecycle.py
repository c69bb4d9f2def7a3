"""The orchestrator's lifecycle (`_core/_lifecycle.py`): `run()` with and without `async with`,
several tasks inside one `async with`, and errors from the body reaching the caller unwrapped."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import anyio
import pytest

from orchestra import ConfigError, InputError, Orchestrator, RunResult, Task
from tests.helpers import tasks_of
from tests.test_orchestrator import ok_agent

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable


class TestRunWithAndWithoutAsyncWith:
    async def test_run_without_async_with(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        orch = make_orchestrator(agents=[ok_agent()])
        first = await orch.run(tasks=tasks_of(2))
        second = await orch.run(tasks=tasks_of(3, prefix="u"))
        assert first.data == {"t0": 0, "t1": 1}
        assert second.data == {"u0": 0, "u1": 1, "u2": 2}
        assert first.metadata.run_id != second.metadata.run_id

    async def test_several_runs_inside_async_with(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        async with make_orchestrator(agents=[ok_agent()]) as orch:
            a = await orch.run(tasks=tasks_of(2))
            b = await orch.run(tasks=tasks_of(2), run_id="given-id")
        assert a.status == b.status == "success"
        assert b.metadata.run_id == "given-id"

    @pytest.mark.parametrize("streamed", [False, True])
    async def test_an_input_error_reaches_the_caller_unwrapped(
        self, streamed: bool, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        bad = [Task("work", 1, id="a"), Task("work", 2, id="a")]

        async def source() -> AsyncIterator[Task]:
            for task in bad:
                yield task

        caught: BaseException | None = None
        try:
            async with make_orchestrator(agents=[ok_agent()]) as orch:
                await orch.run(tasks=source() if streamed else bad)
        except BaseException as exc:
            caught = exc
        assert type(caught) is InputError
        assert "a" in str(caught)

    async def test_two_tasks_each_in_async_with_the_first_leaving_first(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        # The task group is the first task's: the second, leaving last, exited it from another
        # task and got anyio's RuntimeError instead of its result. Now the first one's exit
        # waits for the second to leave.
        orch = make_orchestrator(agents=[ok_agent()])
        first_in, second_in, first_leaving = anyio.Event(), anyio.Event(), anyio.Event()
        results: dict[str, RunResult] = {}
        before = asyncio.all_tasks()

        async def first() -> None:
            async with orch:
                first_in.set()
                await second_in.wait()
                results["first"] = await orch.run(tasks=tasks_of(2))
                first_leaving.set()

        async def second() -> None:
            async with orch:
                second_in.set()
                await first_leaving.wait()
                results["second"] = await orch.run(tasks=tasks_of(3, prefix="u"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await first_in.wait()
            tg.start_soon(second)
        assert results["first"].data == {"t0": 0, "t1": 1}
        assert results["second"].data == {"u0": 0, "u1": 1, "u2": 2}
        assert asyncio.all_tasks() - before == set()
        async with orch:  # and it can be entered again
            assert (await orch.run(tasks=tasks_of(1))).status == "success"

    async def test_an_exit_from_a_task_that_did_not_enter_is_a_config_error(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        orch = make_orchestrator(agents=[ok_agent()])
        async with orch:
            async with anyio.create_task_group() as tg:

                async def stray_exit() -> None:
                    with pytest.raises(ConfigError, match="did not enter it"):
                        await orch.__aexit__(None, None, None)

                tg.start_soon(stray_exit)
            assert (await orch.run(tasks=tasks_of(1))).status == "success"

    async def test_an_error_in_the_body_reaches_the_caller_unwrapped(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        async def body() -> None:
            async with make_orchestrator(agents=[ok_agent()]) as orch:
                await orch.run(tasks=tasks_of(1))
                raise KeyError("user code")

        with pytest.raises(KeyError):
            await body()
