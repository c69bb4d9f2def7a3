"""The live view (`orchestra.progress`, `orchestra.status.render_status`), rendered into recorded consoles."""

from __future__ import annotations

import io
import re
import sys
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import pytest
from rich.console import Console

import orchestra
from orchestra import ConfigError, Context, Orchestrator, Task, agent, progress
from orchestra._core._run import Run
from orchestra._core._status import snapshot
from orchestra.testing import FakeClock, scripted

if TYPE_CHECKING:
    from collections.abc import Callable

    from orchestra.status import RunStatus

pytestmark = pytest.mark.usefixtures("clock")


@agent(kinds=["work"], concurrency=2)
async def worker(task: Task, ctx: Context) -> int:
    await anyio.sleep(1.0)
    return 1


async def live_run(orch: Orchestrator) -> Run:
    while not orch._runs or not hasattr(orch._runs[0], "dispatcher"):
        await anyio.lowlevel.checkpoint()
    return orch._runs[0]


def recording(*, terminal: bool, width: int = 120) -> Console:
    return Console(record=True, file=io.StringIO(), width=width, force_terminal=terminal)


async def mid_run_status(orch: Orchestrator, tasks: list[Task], at: float) -> RunStatus:
    seen: list[RunStatus] = []

    async def look() -> None:
        run = await live_run(orch)
        await anyio.sleep(at)
        seen.append(snapshot(run))

    async with anyio.create_task_group() as tg:
        tg.start_soon(look)
        await orch.run(tasks=tasks)
    return seen[0]


class TestRender:
    async def test_the_view_has_the_bar_the_agents_and_the_errors(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        bad = scripted("bad", ["bad"], then="permanent", latency=0.5)
        orch = make_orchestrator(agents=[worker, bad])
        tasks = [Task("work", i) for i in range(10)] + [Task("bad", 0, id="doomed")]
        status = await mid_run_status(orch, tasks, at=2.5)
        console = recording(terminal=True)
        console.print(orchestra.status.render_status(status))
        text = console.export_text()
        assert "━" in text
        assert f"{status.progress:5.1f}%" in text
        assert f"{status.completed}/{status.total}" in text
        assert "eta 00:0" in text
        for column in ("agent", "state", "load", "util", "waiting", "failures"):
            assert column in text
        assert "worker" in text
        assert "2/2" in text  # the worker's load against its limit
        assert "recent errors" in text
        assert "doomed" in text
        assert "PermanentError" in text
        assert "PermanentError: PermanentError" not in text  # the type said once

    async def test_names_and_ids_are_shown_as_they_are_not_read_as_markup(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        # Was: a "[/b]" in an agent's name or a task id raised rich's MarkupError mid-run.
        bad = scripted("ag[/b]", ["k[/i]"], then="permanent", latency=0.5)
        orch = make_orchestrator(agents=[worker, bad])
        tasks = [Task("work", i) for i in range(4)] + [Task("k[/i]", 0, id="t[/x]")]
        status = await mid_run_status(orch, tasks, at=1.5)
        console = recording(terminal=True)
        console.print(orchestra.status.render_status(status))
        text = console.export_text()
        for shown in ("ag[/b]", "k[/i]", "t[/x]"):
            assert shown in text

    async def test_the_bar_grows_with_progress(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        orch = make_orchestrator(agents=[worker])
        early = await mid_run_status(orch, [Task("work", i) for i in range(10)], at=0.5)
        late = await mid_run_status(orch, [Task("work", i) for i in range(10)], at=4.5)

        def filled(status: RunStatus) -> int:
            """The green (done) part of the bar, in characters."""
            console = recording(terminal=True)
            console.print(orchestra.status.render_status(status))
            styled = console.export_text(styles=True)
            bar = next(line for line in styled.splitlines() if "%" in line and "━" in line)
            return sum(len(run) for run in re.findall(r"\x1b\[32m(━+)", bar))

        assert filled(early) == 0
        assert filled(late) == round(late.completed / late.total * 40)
        assert filled(late) > 0


class TestProgress:
    async def test_plain_lines_when_the_console_is_not_a_terminal(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        orch = make_orchestrator(agents=[worker])
        console = recording(terminal=False)
        final: list[RunStatus] = []

        async def show() -> None:
            run = await live_run(orch)
            final.append(await progress(lambda: snapshot(run), console=console, every=2.0))

        async with anyio.create_task_group() as tg:
            tg.start_soon(show)
            await orch.run(tasks=[Task("work", i) for i in range(10)])
        lines = console.export_text().splitlines()
        assert 3 <= len(lines) <= 5  # a 5 s run, a line every 2 s, and the last one
        assert all(line.startswith("run ") for line in lines)
        assert "\x1b" not in console.file.getvalue()  # type: ignore[attr-defined]
        assert "100.0% 10/10" in lines[-1]
        assert final[0].state == "finished"

    async def test_a_terminal_gets_the_live_view(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        orch = make_orchestrator(agents=[worker])
        console = recording(terminal=True)

        async def show() -> None:
            run = await live_run(orch)
            await progress(lambda: snapshot(run), console=console, refresh=0.5)

        async with anyio.create_task_group() as tg:
            tg.start_soon(show)
            await orch.run(tasks=[Task("work", i) for i in range(4)])
        text = console.export_text()
        assert "agents" in text
        assert "100.0%" in text

    async def test_a_handle_with_status_and_done_is_watched_until_done(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        orch = make_orchestrator(agents=[worker])
        polled: list[float] = []

        class Handle:  # the shape of the run handle `orch.start(...)` returns
            def __init__(self, run: Run) -> None:
                self.run = run

            def status(self) -> RunStatus:
                return snapshot(self.run)

            def done(self) -> bool:
                polled.append(anyio.current_time())
                return len(polled) > 3

        async def show() -> None:
            run = await live_run(orch)
            await progress(Handle(run), console=recording(terminal=False), every=0.1)

        async with anyio.create_task_group() as tg:
            tg.start_soon(show)
            await orch.run(tasks=[Task("work", i) for i in range(10)])
        assert len(polled) == 4

    async def test_a_run_handle_is_watched_until_its_run_ends(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        orch = make_orchestrator(agents=[worker])
        console = recording(terminal=False)
        async with orch:
            handle = orch.start(tasks=[Task("work", i) for i in range(10)])
            last = await progress(handle, console=console, every=2.0)
            result = await handle
        assert last.state == "finished"
        assert last.completed == 10 == result.metadata.total
        assert "100.0% 10/10" in console.export_text().splitlines()[-1]
        assert handle.status() == last  # a finished run keeps its last status

    @pytest.mark.parametrize("start", [1000.0, 1_000_000.1])
    async def test_a_line_every_every_seconds_whatever_the_clock_reads(
        self, clock: FakeClock, start: float
    ) -> None:
        # At 1_000_000.1, `t + 0.1` rounds down: measured as `now - printed >= every` after a
        # sleep of `every`, every other line was skipped.
        clock._now = start
        console = recording(terminal=False)
        await progress(_idle, console=console, every=0.1, until=anyio.sleep(1.05))
        assert len(console.export_text().splitlines()) == 11  # at 0.1, 0.2, ... 1.0, and the end

    async def test_until_an_awaitable_ends_the_view_and_its_error_is_raised(self) -> None:
        async def fails() -> None:
            await anyio.sleep(1)
            raise ValueError("boom")

        with pytest.raises(ValueError, match="boom"):
            await progress(_idle, console=recording(terminal=False), every=10, until=fails())

    async def test_until_a_task_that_finishes(self) -> None:
        async def quick() -> int:
            await anyio.sleep(3)
            return 1

        start = anyio.current_time()
        await progress(_idle, console=recording(terminal=False), every=10, until=quick())
        assert anyio.current_time() - start == pytest.approx(3.0)

    async def test_bad_arguments_are_config_errors(self) -> None:
        with pytest.raises(ConfigError, match="refresh"):
            await progress(_idle, refresh=0)
        with pytest.raises(ConfigError, match="status function or a run handle"):
            await progress(42)  # type: ignore[arg-type]

    async def test_without_rich_the_error_names_the_extra(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setitem(sys.modules, "rich", None)
        with pytest.raises(ModuleNotFoundError, match=r"pip install 'orchestra-runtime\[cli\]'"):
            orchestra.status.render_status(_idle())


def _idle() -> RunStatus:
    """A status that never finishes (for the `until=` tests): a run that has not started."""
    orch = Orchestrator(agents=[worker])
    return snapshot(Run(orch._config, "idle"))
