"""`orchestra._cli._console.watch`: a run with the live view, its results written, steered by keys."""

from __future__ import annotations

import io
import os
from typing import TYPE_CHECKING

import anyio
import pytest
from rich.console import Console

from orchestra import Context, InputError, Orchestrator, Task, TaskResult, agent
from orchestra._cli._console import watch

if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import IO


@agent(kinds=["work"], concurrency=2)
async def work(task: Task, ctx: Context) -> int:
    await anyio.sleep(task.payload)
    return 1


def plain() -> Console:
    return Console(record=True, file=io.StringIO(), width=120, force_terminal=False)


@pytest.fixture
def keyboard() -> Iterator[tuple[IO[str], int]]:
    """A pipe standing in for the terminal: (what `watch` reads, the fd the test types into)."""
    read, typed = os.pipe()
    with os.fdopen(read, "r") as keys:
        yield keys, typed
    os.close(typed)


class TestWatch:
    async def test_results_are_written_and_the_view_ends_with_the_run(self) -> None:
        written: list[TaskResult] = []
        console = plain()
        orch = Orchestrator(agents=[work])
        result = await watch(
            orch, tasks=[Task("work", 0.01) for _ in range(4)], write=written.append,
            console=console,
        )  # fmt: skip
        assert result.status == "success"
        assert sorted(r.task_id for r in written) == sorted(result.data)
        assert "100.0% 4/4" in console.export_text().splitlines()[-1]

    async def test_a_bad_input_raises_as_it_is(self) -> None:
        with pytest.raises(InputError, match="no agent serves kind"):
            await watch(Orchestrator(agents=[work]), tasks=[Task("nokind")], console=plain())


class TestKeys:
    async def test_p_pauses_r_resumes(self, keyboard: tuple[IO[str], int]) -> None:
        keys, typed = keyboard
        orch = Orchestrator(agents=[work])
        seen: list[int] = []

        def count(result: TaskResult) -> None:
            seen.append(1)

        async def type_keys() -> None:
            os.write(typed, b"p")
            await anyio.sleep(0.3)  # paused: the two running finish, nothing starts
            seen.append(-len(seen))  # a marker: how many had ended while paused
            os.write(typed, b"r")

        async with anyio.create_task_group() as tg:
            tg.start_soon(type_keys)
            result = await watch(
                orch, tasks=[Task("work", 0.05) for _ in range(6)], write=count, console=plain(),
                keys=keys,
            )  # fmt: skip
        assert result.status == "success"
        assert result.metadata.total == 6
        marker = next(v for v in seen if v <= 0)
        assert -marker == 2  # only the two that were running when "p" came ended while paused

    async def test_s_stops_gracefully_and_c_cancels(self, keyboard: tuple[IO[str], int]) -> None:
        keys, typed = keyboard
        orch = Orchestrator(agents=[work])

        async def type_keys() -> None:
            await anyio.sleep(0.1)
            os.write(typed, b"s")  # graceful: the running get `grace` (60 s) ...
            await anyio.sleep(0.2)
            os.write(typed, b"c")  # ... until "c" cancels them at once

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(type_keys)
                result = await watch(
                    orch, tasks=[Task("work", 30) for _ in range(3)], console=plain(), keys=keys,
                    grace=60,
                )  # fmt: skip
        assert result.status == "cancelled"  # within 10 s: "c" cut the 60 s grace short
        assert result.metadata.reason == "stopped from the keyboard"  # the first stop's
        assert result.metadata.counts["cancelled"] == 3

    async def test_other_keys_do_nothing(self, keyboard: tuple[IO[str], int]) -> None:
        keys, typed = keyboard
        os.write(typed, b"xyz\n")
        result = await watch(
            Orchestrator(agents=[work]), tasks=[Task("work", 0.05)], console=plain(), keys=keys
        )
        assert result.status == "success"
