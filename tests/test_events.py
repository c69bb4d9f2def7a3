"""Typed events to subscribers (who can neither break nor stall a run), and structured logs."""

from __future__ import annotations

import gc
import logging
import warnings
from collections import Counter
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import pytest

from orchestra import Context, Orchestrator, RetryPolicy, Task, agent
from orchestra.events import (
    AttemptFailed,
    AttemptStarted,
    AttemptSucceeded,
    BreakerChanged,
    Event,
    FallbackUsed,
    RetryScheduled,
    RunFinished,
    RunStarted,
    TaskFinished,
    TaskReady,
)
from orchestra.testing import FakeClock, scripted
from tests.helpers import tasks_of, trips_after

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from tests.helpers import LogLines


def of_task(events: list[Event], task_id: str) -> list[str]:
    names = []
    for e in events:
        tid = e.result.task_id if isinstance(e, TaskFinished) else getattr(e, "task_id", None)
        if tid == task_id:
            names.append(type(e).__name__)
    return names


class TestEventStream:
    async def test_a_run_tells_its_whole_story_in_order(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        events: list[Event] = []
        worker = scripted("w", ["work"], latency=1.0)
        orch = make_orchestrator(agents=[worker], concurrency=2)
        orch.subscribe(events.append)
        result = await orch.run(tasks=tasks_of(3))
        assert isinstance(events[0], RunStarted)
        assert isinstance(events[-1], RunFinished)
        assert events[-1].status == "success"
        assert {e.run_id for e in events} == {result.metadata.run_id}
        for i in range(3):
            assert of_task(events, f"t{i}") == [
                "TaskReady",
                "AttemptStarted",
                "AttemptSucceeded",
                "TaskFinished",
            ]
        times = [e.at for e in events]
        assert times == sorted(times)
        started = [e for e in events if isinstance(e, AttemptStarted)]
        assert {(e.agent, e.attempt, e.kind) for e in started} == {("w", 1, "work")}
        ready = [e for e in events if isinstance(e, TaskReady)]
        assert [e.priority for e in ready] == [0, 0, 0]
        done = [e for e in events if isinstance(e, AttemptSucceeded)]
        assert [e.duration for e in done] == pytest.approx([1.0, 1.0, 1.0])
        finished = [e for e in events if isinstance(e, TaskFinished)]
        assert {e.result.status for e in finished} == {"succeeded"}

    async def test_failures_retries_and_fallbacks_are_told(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        events: list[Event] = []
        flaky = scripted("flaky", ["work"], script=["error", "permanent"], latency=0.5)
        backup = scripted("backup", ["work"], latency=0.5)
        orch = make_orchestrator(
            agents=[flaky, backup],
            fallbacks={"work": ["flaky", "backup"]},
            retry=RetryPolicy(max_attempts=3, base=1.0),
            breaker=trips_after(2, cooldown=100.0),
        )
        orch.subscribe(events.append)
        result = await orch.run(tasks=[Task("work", None, id="x")])
        assert result.status == "success"
        assert of_task(events, "x") == [
            "TaskReady",
            "AttemptStarted",
            "AttemptFailed",
            "RetryScheduled",
            "TaskReady",
            "AttemptStarted",
            "AttemptFailed",
            "FallbackUsed",
            "TaskReady",
            "AttemptStarted",
            "AttemptSucceeded",
            "TaskFinished",
        ]
        failed = [e for e in events if isinstance(e, AttemptFailed)]
        assert [(e.agent, e.attempt, e.error_type, e.retryable) for e in failed] == [
            ("flaky", 1, "ConnectionError", True),
            ("flaky", 2, "PermanentError", False),
        ]
        [retry] = [e for e in events if isinstance(e, RetryScheduled)]
        assert (retry.agent, retry.attempt) == ("flaky", 1)
        assert 0.0 <= retry.delay <= 1.0
        [fallback] = [e for e in events if isinstance(e, FallbackUsed)]
        assert (fallback.from_agent, fallback.to_agent) == ("flaky", "backup")
        # A permanent error says nothing about the agent's health: only the connection error
        # counted, one short of `failures=2`, so the breaker never opened.
        assert [e for e in events if isinstance(e, BreakerChanged)] == []

    async def test_concurrent_runs_without_async_with_each_deliver_every_event(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        # The first run() to finish must not stop the delivery of the other run's events.
        got: list[str] = []

        @agent(kinds=["work"])
        async def timed(task: Task, ctx: Context) -> None:
            await anyio.sleep(float(task.payload))

        orch = make_orchestrator(agents=[timed])
        orch.subscribe(lambda e: got.append(e.result.task_id), TaskFinished)

        async def run(prefix: str, seconds: float) -> None:
            await orch.run(tasks=[Task("work", seconds, id=f"{prefix}{i}") for i in range(3)])

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "short", 1.0)
            tg.start_soon(run, "long", 5.0)
        assert sorted(got) == [f"{p}{i}" for p in ("long", "short") for i in range(3)]

    async def test_subscribing_to_types(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        got: list[Event] = []
        orch = make_orchestrator(agents=[scripted("w", ["work"])])
        orch.subscribe(got.append, TaskFinished, RunFinished)
        await orch.run(tasks=tasks_of(4))
        assert Counter(type(e).__name__ for e in got) == {"TaskFinished": 4, "RunFinished": 1}

    async def test_an_async_subscriber(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        got: list[str] = []

        async def record(event: Event) -> None:
            await anyio.sleep(0.01)
            got.append(type(event).__name__)

        orch = make_orchestrator(agents=[scripted("w", ["work"], latency=1.0)])
        orch.subscribe(record, TaskFinished)
        await orch.run(tasks=tasks_of(3))
        assert got == ["TaskFinished"] * 3

    async def test_unsubscribe(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        got: list[Event] = []
        orch = make_orchestrator(agents=[scripted("w", ["work"])])
        unsubscribe = orch.subscribe(got.append, RunFinished)
        await orch.run(tasks=tasks_of(1))
        unsubscribe()
        await orch.run(tasks=tasks_of(1))
        assert len(got) == 1

    async def test_a_subscriber_that_comes_and_goes_mid_run_hears_the_tasks_in_between(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        finished: list[str] = []
        unsubscribe: list[Callable[[], None]] = []

        @agent(kinds=["work"])
        async def work(task: Task, ctx: Context) -> int:
            n = int(task.payload)
            if n == 100:  # from here on, every end is heard (the run's common path included)
                unsubscribe.append(
                    orch.subscribe(lambda e: finished.append(e.result.task_id), TaskFinished)
                )
            elif n == 200:
                unsubscribe.pop()()
            await anyio.lowlevel.checkpoint()
            return n

        orch = make_orchestrator(agents=[work], concurrency=1)
        result = await orch.run(tasks=[Task("work", i, id=f"t{i}") for i in range(300)])
        assert result.status == "success"
        assert len(result.data) == 300
        heard = {int(i[1:]) for i in finished}
        assert set(range(100, 200)) <= heard <= set(range(100, 201))


class TestSubscribersCannotHurtTheRun:
    async def test_a_subscriber_that_raises(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        calls: list[Event] = []
        good: list[Event] = []

        def explode(event: Event) -> None:
            calls.append(event)
            raise RuntimeError("subscriber bug")

        async def explode_async(event: Event) -> None:
            raise ValueError("async subscriber bug")

        orch = make_orchestrator(agents=[scripted("w", ["work"], latency=0.1)])
        orch.subscribe(explode)
        orch.subscribe(explode_async)
        orch.subscribe(good.append)
        result = await orch.run(tasks=tasks_of(5))
        assert result.status == "success"
        assert len(result.data) == 5
        assert len(calls) == len(good)  # kept, and called for every event
        assert isinstance(good[-1], RunFinished)

    async def test_a_slow_subscriber_neither_stalls_the_run_nor_loses_others_events(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        slow_got: list[Event] = []
        fast_got: list[Event] = []

        async def slow(event: Event) -> None:
            await anyio.sleep(1000.0)
            slow_got.append(event)

        worker = scripted("w", ["work"], latency=1.0)
        async with make_orchestrator(agents=[worker], concurrency=20) as orch:
            orch.subscribe(slow, buffer=2)
            orch.subscribe(fast_got.append)
            t0 = anyio.current_time()
            result = await orch.run(tasks=tasks_of(20))
            took = anyio.current_time() - t0
        assert result.status == "success"
        assert took < 1000.0  # the run did not wait for the subscriber
        assert result.metadata.events_dropped > 0
        assert len(slow_got) < len(fast_got)
        assert Counter(type(e).__name__ for e in fast_got)["TaskFinished"] == 20

    async def test_a_slow_subscriber_does_not_hold_up_run_without_async_with(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        # run() without `async with` enters and leaves the orchestrator itself: leaving must not
        # wait for a slow subscriber to work through its backlog (here, 1000 s per event).
        async def slow(event: Event) -> None:
            await anyio.sleep(1000.0)

        orch = make_orchestrator(agents=[scripted("w", ["work"], latency=1.0)], concurrency=20)
        orch.subscribe(slow)
        t0 = anyio.current_time()
        result = await orch.run(tasks=tasks_of(20))
        took = anyio.current_time() - t0
        assert result.status == "success"
        assert took < 1000.0

    async def test_events_dropped_is_counted_per_run(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        async def slow(event: Event) -> None:
            await anyio.sleep(1000.0)

        orch = make_orchestrator(agents=[scripted("w", ["work"])])
        unsubscribe = orch.subscribe(slow, buffer=1)
        first = await orch.run(tasks=tasks_of(10))
        unsubscribe()
        second = await orch.run(tasks=tasks_of(10))
        assert first.metadata.events_dropped > 0
        assert second.metadata.events_dropped == 0

    async def test_no_subscriber_no_drops(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        result = await make_orchestrator(agents=[scripted("w", ["work"])]).run(tasks=tasks_of(50))
        assert result.metadata.events_dropped == 0

    def test_a_buffer_below_one_is_refused(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        from orchestra import ConfigError

        orch = make_orchestrator(agents=[scripted("w", ["work"])])
        with pytest.raises(ConfigError):
            orch.subscribe(print, buffer=0)

    @pytest.mark.parametrize(
        ("args", "options", "shown"),
        [
            ((print, "TaskFinished"), {}, "'TaskFinished'"),  # a name, not the class
            ((print, int), {}, "<class 'int'>"),
            ((3,), {}, "3"),
            ((print,), {"buffer": 2.5}, "2.5"),
            ((print,), {"buffer": True}, "True"),
            ((print,), {"buffer": "10"}, "'10'"),
        ],
        ids=["type-name", "not-an-event", "fn", "buffer-float", "buffer-bool", "buffer-str"],
    )
    def test_wrong_arguments_are_config_errors(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        args: tuple[Any, ...],
        options: dict[str, Any],
        shown: str,
    ) -> None:
        # They raised AttributeError or ValueError (some only when the orchestrator started), or
        # were taken (fn=3 failed on every event, buffer=True was a buffer of 1).
        from orchestra import ConfigError

        orch = make_orchestrator(agents=[scripted("w", ["work"])])
        with pytest.raises(ConfigError) as info:
            orch.subscribe(*args, **options)
        assert shown in str(info.value)


class TestResourceHygiene:
    @pytest.mark.parametrize("with_block", [False, True])
    async def test_subscribing_leaves_no_unclosed_stream_behind(
        self, with_block: bool, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        got: list[Event] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            orch = make_orchestrator(agents=[scripted("w", ["work"])])
            orch.subscribe(got.append)
            if with_block:
                async with orch:
                    await orch.run(tasks=tasks_of(2))
            else:
                await orch.run(tasks=tasks_of(2))
            del orch
            gc.collect()
        assert got
        assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []


def per_task(entries: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [e for e in entries if e.get("task_id") is not None]


class TestLogging:
    async def test_per_task_lines_at_debug(
        self, make_orchestrator: Callable[..., Orchestrator], logs: LogLines
    ) -> None:
        result = await make_orchestrator(agents=[scripted("w", ["work"])]).run(tasks=tasks_of(3))
        entries = logs.entries
        lines = per_task(entries)
        assert {e["task_id"] for e in lines} == {"t0", "t1", "t2"}
        assert {e["log_level"] for e in lines} == {"debug"}
        run_lines = [e for e in entries if e.get("run_id") == result.metadata.run_id]
        assert run_lines

    async def test_no_per_task_lines_above_debug(
        self, make_orchestrator: Callable[..., Orchestrator], logs: LogLines
    ) -> None:
        logs.level(logging.INFO)
        result = await make_orchestrator(agents=[scripted("w", ["work"])]).run(tasks=tasks_of(3))
        entries = logs.entries
        assert per_task(entries) == []
        assert entries  # the run's own lines, one at its start and one at its end
        assert len(entries) <= 2
        assert {e["run_id"] for e in entries} == {result.metadata.run_id}

    async def test_nothing_on_stdout_when_logging_is_not_configured(
        self, make_orchestrator: Callable[..., Orchestrator], capsys: pytest.CaptureFixture[str]
    ) -> None:
        await make_orchestrator(agents=[scripted("w", ["work"])]).run(
            tasks=[Task("work", i, id=f"task-{i}") for i in range(5)]
        )
        assert capsys.readouterr() == ("", "")  # not even logging's last resort on stderr
