"""Cancellation ends a run cleanly: the caller's cancel, the run timeout or a stream left early end
every unfinished task as cancelled, exactly once, seen by `TaskFinished`, `RunFinished` and the
stream; no attempt starts after it, whatever the agents do with the `CancelledError`; a stray
`CancelledError` from user code is that code's failure; a thread abandoned by its timeout keeps its
agent's slot until it really ends; one caller's cancel never touches another caller's run; and one
task cancelled through its handle frees its worker for the next."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from orchestra import (
    Context,
    Orchestrator,
    Reduce,
    RetryableError,
    RetryPolicy,
    RunResult,
    Task,
    TaskResult,
    agent,
)
from orchestra._core._attempt import Attempts
from orchestra.events import AttemptStarted, RunFinished, RunStarted, TaskFinished
from orchestra.testing import FakeClock, Recorder, scripted
from tests.helpers import assert_no_leaks, fake_clock, live_tasks, tasks_of

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

pytestmark = pytest.mark.usefixtures("no_leaks")


# -- agents that misbehave when cancelled -------------------------------------------------------


class Stubborn:
    """Hangs; what it does when cancelled depends on `mode`:

    - "plain": lets the cancellation through;
    - "swallow-once": swallows the first `CancelledError` and goes on waiting;
    - "swallow-and-return": swallows it and returns an output as if it had finished;
    - "raise-in-finally": its `finally` raises a `RuntimeError` over the cancellation.
    """

    def __init__(self, mode: str, name: str = "stubborn", kinds: tuple[str, ...] = ("hang",)):
        self.mode = mode
        self.name = name
        self.kinds = kinds
        self.concurrency = 1
        self.started: list[str] = []

    async def __call__(self, task: Task, ctx: Context) -> Any:
        self.started.append(task.id)
        if self.mode == "raise-in-finally":
            try:
                await anyio.sleep_forever()
            finally:
                raise RuntimeError("cleanup failed")
        try:
            await anyio.sleep_forever()
        except asyncio.CancelledError:
            if self.mode == "plain":
                raise
            if self.mode == "swallow-and-return":
                return "finished anyway"
        await anyio.sleep_forever()  # "swallow-once": back to waiting
        return None


MODES = ("plain", "swallow-once", "swallow-and-return", "raise-in-finally")


def scenario(mode: str, **options: Any) -> tuple[Orchestrator, list[Task], Stubborn, Any]:
    """At t=5 (the cancel): "done" succeeded at t=1, "running" hangs on the stubborn agent, "queued"
    waits for that agent's only slot, "retrying" waits 100 s for its retry, "child" waits for
    "running". A backup agent is the stubborn one's fallback: it must never be called."""
    stubborn = Stubborn(mode)
    backup = scripted("backup", ["hang"])
    quick = scripted("quick", ["quick"], latency=1.0)
    flaky = scripted("flaky", ["flaky"], then="error", latency=0.1)
    orch = Orchestrator(
        agents=[stubborn, backup, quick, flaky],
        fallbacks={"hang": ["stubborn", "backup"]},
        retry=RetryPolicy(max_attempts=3, base=100.0, cap=100.0, jitter="none"),
        seed=1,
        **options,
    )
    tasks = [
        Task("quick", 0, id="done"),
        Task("hang", 1, id="running"),
        Task("hang", 2, id="queued"),
        Task("flaky", 3, id="retrying"),
        Task("quick", 4, id="child", depends_on=["running"]),
    ]
    return orch, tasks, stubborn, backup


UNFINISHED = ("running", "queued", "retrying", "child")


def assert_ended_once(rec: Recorder, tasks: list[Task]) -> dict[str, TaskResult]:
    """Every task has exactly one `TaskFinished`; the results by id."""
    finished = sorted(e.result.task_id for e in rec.of(TaskFinished))
    assert finished == sorted(t.id for t in tasks)
    return rec.results()


def assert_cancelled_cleanly(
    rec: Recorder, tasks: list[Task], cancelled_at: float, backup: Any, status: str = "cancelled"
) -> None:
    done = assert_ended_once(rec, tasks)
    assert done["done"].status == "succeeded"
    assert {t: done[t].status for t in UNFINISHED} == dict.fromkeys(UNFINISHED, "cancelled")
    assert [e.status for e in rec.of(RunFinished)] == [status]
    t0 = rec.of(RunStarted)[0].at
    late = [e for e in rec.of(AttemptStarted) if e.at - t0 >= cancelled_at]
    assert late == []  # no attempt started after the cancel
    assert backup.calls == []


async def timed_out(orch: Orchestrator, tasks: list[Task], stubborn: Stubborn) -> RunResult:
    """Run the scenario to its 5 s run timeout: one task done, the four others cancelled."""
    async with orch:
        with anyio.fail_after(1000):
            result = await orch.run(tasks=tasks)
    assert result.status == "failed"
    assert result.metadata.counts == {"succeeded": 1, "failed": 0, "skipped": 0, "cancelled": 4}
    assert stubborn.started == ["running"]
    return result


# -- the three ways a run is cut short -----------------------------------------------------------


class TestCallerCancel:
    @pytest.mark.parametrize("mode", MODES)
    async def test_move_on_after(self, clock: FakeClock, mode: str) -> None:
        orch, tasks, stubborn, backup = scenario(mode)
        rec = Recorder()
        orch.subscribe(rec)
        async with orch:
            with anyio.fail_after(1000), anyio.move_on_after(5.0) as scope:
                await orch.run(tasks=tasks)
            assert scope.cancelled_caught
            assert [s["in_flight"] for s in orch.agents_status()] == [0, 0, 0, 0]
        assert stubborn.started == ["running"]
        assert_cancelled_cleanly(rec, tasks, 5.0, backup)

    @pytest.mark.parametrize("mode", MODES)
    async def test_task_cancel(self, clock: FakeClock, mode: str) -> None:
        orch, tasks, stubborn, backup = scenario(mode)
        rec = Recorder()
        orch.subscribe(rec)
        async with orch:
            runner = asyncio.ensure_future(orch.run(tasks=tasks))
            await anyio.sleep(5.0)
            runner.cancel()
            with anyio.fail_after(1000), pytest.raises(asyncio.CancelledError):
                await runner  # a CancelledError, not an ExceptionGroup of what the agents did
        assert stubborn.started == ["running"]
        assert_cancelled_cleanly(rec, tasks, 5.0, backup)


class TestRunTimeout:
    @pytest.mark.parametrize("mode", MODES)
    async def test_every_unfinished_task_is_cancelled(self, clock: FakeClock, mode: str) -> None:
        orch, tasks, stubborn, backup = scenario(mode, timeouts={"run": 5.0})
        rec = Recorder()
        orch.subscribe(rec)
        await timed_out(orch, tasks, stubborn)
        assert_cancelled_cleanly(rec, tasks, 5.0, backup, status="failed")

    @pytest.mark.parametrize("mode", MODES)
    async def test_with_no_subscriber_the_inline_attempt_is_cancelled_too(
        self, clock: FakeClock, mode: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # No subscriber, no verifier, no timeout: every attempt is the plain one (see
        # `orchestra._core._attempt`), which must end the same way the full one does.
        async def not_here(*args: Any) -> None:
            raise AssertionError("the attempt was the full one, not the plain one")

        monkeypatch.setattr(Attempts, "run", not_here)
        orch, tasks, stubborn, backup = scenario(mode, timeouts={"run": 5.0})
        result = await timed_out(orch, tasks, stubborn)
        assert result.metadata.reason == "run timeout after 5.0s"
        assert backup.calls == []
        # done, running, retrying's first: none after the cancel
        assert result.metadata.attempts == 3

    async def test_a_streamed_run_cut_short_is_never_success(self, clock: FakeClock) -> None:
        # Everything admitted so far succeeded; the input had more to give.
        async def endless() -> AsyncIterator[Task]:
            n = 0
            while True:
                yield Task("work", n, id=f"s{n}")
                n += 1
                await anyio.sleep(1.0)

        quick = scripted("quick", ["work"], latency=0.1)
        rec = Recorder()
        async with Orchestrator(agents=[quick], timeouts={"run": 5.5}) as orch:
            orch.subscribe(rec)
            with anyio.fail_after(1000):
                result = await orch.run(tasks=endless())
        assert result.metadata.counts["succeeded"] == 6
        assert result.status == "failed"  # the unread input: never ok (tests/test_timeouts.py)
        assert not result.metadata.input_complete
        assert result.metadata.reason is not None
        assert "run timeout" in result.metadata.reason
        assert [e.status for e in rec.of(RunFinished)] == ["failed"]

    async def test_an_endless_plain_iterable_is_cut_too(self, clock: FakeClock) -> None:
        def endless() -> Any:
            n = 0
            while True:
                yield Task("work", n, id=f"s{n}")
                n += 1

        slow = scripted("slow", ["work"], latency=10.0)
        orch = Orchestrator(agents=[slow], concurrency=2, window=4, timeouts={"run": 5.0})
        async with orch:
            with anyio.fail_after(1000):
                result = await orch.run(tasks=endless())
        assert result.status == "failed"
        assert result.metadata.counts["cancelled"] == 4
        assert result.metadata.counts["succeeded"] == 0

    async def test_the_stream_sees_every_cancelled_task(self, clock: FakeClock) -> None:
        orch, tasks, _, backup = scenario("swallow-once", timeouts={"run": 5.0})
        rec = Recorder()
        orch.subscribe(rec)
        got: list[tuple[str, str]] = []
        async with orch:
            with anyio.fail_after(1000):
                async with orch.stream(tasks=tasks) as results:
                    got.extend([(r.task_id, r.status) async for r in results])
        assert sorted(got) == sorted(
            [("done", "succeeded"), *((t, "cancelled") for t in UNFINISHED)]
        )
        assert results.result is not None
        assert results.result.status == "failed"
        assert_cancelled_cleanly(rec, tasks, 5.0, backup, status="failed")


class TestStreamLeftEarly:
    @pytest.mark.parametrize("mode", MODES)
    async def test_every_unfinished_task_is_cancelled(self, clock: FakeClock, mode: str) -> None:
        orch, tasks, _, backup = scenario(mode)
        rec = Recorder()
        orch.subscribe(rec)
        got: list[str] = []
        async with orch:
            with anyio.fail_after(1000):
                async with orch.stream(tasks=tasks) as results:
                    async for item in results:
                        got.append(item.task_id)
                        await anyio.sleep(4.0)  # the reader dawdles, then leaves at t=5
                        break
        assert got == ["done"]
        assert_cancelled_cleanly(rec, tasks, 5.0, backup)


# -- stray CancelledErrors from user code --------------------------------------------------------


def stray() -> BaseException:
    return asyncio.CancelledError("raised by user code, not by a cancellation")


class TestStrayCancelledError:
    async def test_from_an_agent_fails_the_attempt(self, clock: FakeClock) -> None:
        calls: list[int] = []

        @agent(kinds=["work"])
        async def odd(task: Task, ctx: Context) -> int:
            calls.append(ctx.attempt)
            if ctx.attempt == 1:
                raise stray()
            return 1

        rec = Recorder()
        async with Orchestrator(agents=[odd], retry=RetryPolicy(base=0.1)) as orch:
            orch.subscribe(rec)
            with anyio.fail_after(1000):
                result = await orch.run(tasks=tasks_of(1))
        assert result.status == "success"
        assert calls == [1, 2]
        assert [e.status for e in rec.of(RunFinished)] == ["success"]

    async def test_from_a_verifier_fails_the_attempt(self, clock: FakeClock) -> None:
        verdicts = iter([stray(), None])

        def check(task: Task, output: Any) -> None:
            verdict = next(verdicts)
            if verdict is not None:
                raise verdict

        worker = scripted("worker", ["work"])
        async with Orchestrator(
            agents=[worker], verify={"work": check}, retry=RetryPolicy(base=0.1)
        ) as orch:
            with anyio.fail_after(1000):
                result = await orch.run(tasks=tasks_of(1))
        assert result.status == "success"
        assert len(worker.calls) == 2

    async def test_from_the_safety_check_refuses_the_task(self, clock: FakeClock) -> None:
        async def safety(task: Task) -> bool:
            if task.payload == 0:
                raise stray()
            return True

        worker = scripted("worker", ["work"])
        rec = Recorder()
        async with Orchestrator(agents=[worker], safety=safety) as orch:
            orch.subscribe(rec)
            with anyio.fail_after(1000):
                result = await orch.run(tasks=tasks_of(2))
        done = assert_ended_once(rec, tasks_of(2))
        assert done["t0"].status == "failed"
        assert done["t0"].error is not None
        assert "CancelledError" in done["t0"].error
        assert done["t1"].status == "succeeded"
        assert [c.task_id for c in worker.calls] == ["t1"]
        assert result.metadata.counts["failed"] == 1

    @pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
    async def test_from_a_subscriber_is_its_failure(self, clock: FakeClock, is_async: bool) -> None:
        seen: list[str] = []

        def record(event: Any) -> None:
            seen.append(type(event).__name__)
            if isinstance(event, TaskFinished):
                raise stray()

        async def arecord(event: Any) -> None:
            record(event)

        async with Orchestrator(agents=[scripted("w", ["work"], latency=1.0)]) as orch:
            orch.subscribe(arecord if is_async else record, TaskFinished, RunFinished)
            with anyio.fail_after(1000):
                result = await orch.run(tasks=tasks_of(3))
        assert result.status == "success"
        assert seen == ["TaskFinished"] * 3 + ["RunFinished"]  # it kept receiving
        assert orch._bus.errors == 3

    async def test_from_an_aggregator_loses_only_the_data(self, clock: FakeClock) -> None:
        def reducer(acc: Any, result: TaskResult) -> Any:
            raise stray()

        async with Orchestrator(
            agents=[scripted("w", ["work"])], aggregate=Reduce(reducer, initial=0)
        ) as orch:
            with anyio.fail_after(1000):
                result = await orch.run(tasks=tasks_of(2))
        assert result.metadata.counts["succeeded"] == 2
        assert result.data is None
        assert result.metadata.reason is not None
        assert "CancelledError" in result.metadata.reason

    async def test_from_the_threshold_hook_keeps_the_result(self, clock: FakeClock) -> None:
        def hook(result: RunResult, failed: list[Task]) -> RunResult:
            raise stray()

        down = scripted("down", ["work"], then="permanent")
        async with Orchestrator(agents=[down], on_threshold_missed=hook) as orch:
            with anyio.fail_after(1000):
                result = await orch.run(tasks=tasks_of(2))
        assert result.status == "failed"


# -- thread agents -------------------------------------------------------------------------------


class Threads:
    """Sync work in threads that end only when released; counts how many run at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.peak = 0
        self.release = threading.Event()
        self.started: list[int] = []

    def work(self, task: Task) -> int:
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
            self.started.append(task.payload)
        try:
            if task.payload == 0:
                self.release.wait(10)  # the first call outlives its attempt timeout
            return int(task.payload)
        finally:
            with self.lock:
                self.running -= 1


async def wait_until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    with anyio.fail_after(seconds):
        while not condition():
            await anyio.sleep(0.005)


class TestThreadAgents:
    async def test_a_timed_out_thread_keeps_its_slot_until_it_ends(self) -> None:
        threads = Threads()
        worker = agent(
            threads.work, kinds=["work"], name="worker", executor="thread", concurrency=1
        )
        orch = Orchestrator(
            agents=[worker], timeouts={"attempt": 0.05}, retry=RetryPolicy(max_attempts=1)
        )
        async with orch:
            runner = asyncio.ensure_future(orch.run(tasks=tasks_of(3)))
            await anyio.sleep(0.3)  # t0 timed out long ago; its thread still runs
            assert threads.started == [0]
            assert orch.agents_status()[0]["in_flight"] == 1
            threads.release.set()
            with anyio.fail_after(5):
                result = await runner
        assert threads.peak == 1
        assert sorted(threads.started) == [0, 1, 2]
        assert result.metadata.counts == {"succeeded": 2, "failed": 1, "skipped": 0, "cancelled": 0}
        assert orch.agents_status()[0]["in_flight"] == 0

    async def test_an_agent_that_starts_its_own_thread_keeps_its_slot_with_keep_slot(self) -> None:
        """`ctx.keep_slot()`: a plain async agent whose work runs in a thread of its own (which
        the attempt's timeout abandons, not stops) holds its slot until the thread ends, as the
        ready-made thread agents do."""
        threads = Threads()

        @agent(kinds=["work"], name="worker", concurrency=1)
        async def worker(task: Task, ctx: Context) -> int:
            release = ctx.keep_slot()

            def run() -> int:
                try:
                    return threads.work(task)
                finally:
                    release()

            return await asyncio.to_thread(run)

        orch = Orchestrator(
            agents=[worker], timeouts={"attempt": 0.05}, retry=RetryPolicy(max_attempts=1)
        )
        async with orch:
            runner = asyncio.ensure_future(orch.run(tasks=tasks_of(3)))
            await anyio.sleep(0.3)  # t0 timed out long ago; its thread still runs
            assert threads.started == [0]
            assert orch.agents_status()[0]["in_flight"] == 1
            threads.release.set()
            with anyio.fail_after(5):
                result = await runner
            await wait_until(lambda: orch.agents_status()[0]["in_flight"] == 0)
        assert threads.peak == 1
        assert sorted(threads.started) == [0, 1, 2]
        assert result.metadata.counts == {"succeeded": 2, "failed": 1, "skipped": 0, "cancelled": 0}

    async def test_a_thread_abandoned_by_a_cancelled_run_holds_the_next_run(self) -> None:
        threads = Threads()
        worker = agent(
            threads.work, kinds=["work"], name="worker", executor="thread", concurrency=1
        )
        async with Orchestrator(agents=[worker]) as orch:
            with anyio.move_on_after(0.1):
                await orch.run(tasks=tasks_of(1))
            assert orch.agents_status()[0]["in_flight"] == 1  # its thread still runs
            later = asyncio.ensure_future(orch.run(tasks=[Task("work", 7, id="later")]))
            await anyio.sleep(0.2)
            assert threads.started == [0]  # the next run waits for the slot
            threads.release.set()
            with anyio.fail_after(5):
                result = await later
            await wait_until(lambda: orch.agents_status()[0]["in_flight"] == 0)
        assert result.status == "success"
        assert threads.peak == 1
        assert threads.started == [0, 7]


# -- one caller's cancel and another's run --------------------------------------------------------


class TestConcurrentRuns:
    @pytest.mark.parametrize("mode", MODES)
    async def test_cancelling_one_run_leaves_the_other_alone(
        self, clock: FakeClock, mode: str
    ) -> None:
        stubborn = Stubborn(mode, kinds=("hang",))
        shared = scripted("shared", ["work"], latency=1.0, concurrency=2)
        rec = Recorder()
        async with Orchestrator(agents=[stubborn, shared], concurrency=3) as orch:
            orch.subscribe(rec)

            async def doomed() -> None:
                await orch.run(tasks=[*tasks_of(1, "hang", "h"), *tasks_of(4, prefix="a")])

            async def survivor() -> RunResult:
                return await orch.run(tasks=tasks_of(6, prefix="b"))

            first = asyncio.ensure_future(doomed())
            await anyio.sleep(0.5)
            second = asyncio.ensure_future(survivor())
            await anyio.sleep(1.0)
            first.cancel()
            with anyio.fail_after(1000):
                with pytest.raises(asyncio.CancelledError):
                    await first
                result = await second
        assert result.status == "success"
        assert result.metadata.counts["succeeded"] == 6
        assert shared.max_in_flight == 2
        statuses = sorted(e.status for e in rec.of(RunFinished))
        assert statuses == ["cancelled", "success"]

    async def test_without_async_with_the_first_caller_may_cancel(self, clock: FakeClock) -> None:
        # Both callers share the lifecycle the first one opened; the first one leaves early.
        shared = scripted("shared", ["work"], latency=1.0, concurrency=2)
        orch = Orchestrator(agents=[Stubborn("swallow-once"), shared], concurrency=3)
        first = asyncio.ensure_future(
            orch.run(tasks=[*tasks_of(1, "hang", "h"), *tasks_of(4, prefix="a")])
        )
        await anyio.sleep(0.5)
        second = asyncio.ensure_future(orch.run(tasks=tasks_of(6, prefix="b")))
        await anyio.sleep(1.0)
        first.cancel()
        with anyio.fail_after(1000):
            with pytest.raises(asyncio.CancelledError):
                await first
            result = await second
        assert result.status == "success"
        assert shared.max_in_flight == 2

    async def test_without_async_with_a_caller_returns_when_its_own_run_ends(
        self, clock: FakeClock
    ) -> None:
        # The lifecycle both runs use is held by a task of its own, not by the first caller: that
        # one returns when its run ends (it waited for the second caller's run, and a deadline
        # there left it with the lifecycle's task group half closed).
        quick = scripted("quick", ["work"], latency=1.0)
        slow = scripted("slow", ["slow"], latency=10.0)
        orch = Orchestrator(agents=[quick, slow], concurrency=3)
        orch.subscribe(Recorder())  # a delivery task in the lifecycle's task group
        before = live_tasks()
        returned: list[float] = []

        async def first() -> None:
            with anyio.move_on_after(2.0) as scope:
                await orch.run(tasks=tasks_of(1, prefix="a"))  # its own run ends at 1 s
            assert not scope.cancelled_caught
            returned.append(anyio.current_time())

        start = anyio.current_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await anyio.sleep(0.5)
            result = await orch.run(tasks=tasks_of(2, "slow", prefix="b"))
        assert returned == [start + 1.0]
        assert result.status == "success"
        await assert_no_leaks(before)
        # The orchestrator is whole again: a later run opens its own lifecycle.
        assert (await orch.run(tasks=tasks_of(1, prefix="c"))).status == "success"

    async def test_without_async_with_one_callers_cancel_leaves_the_others_events_whole(
        self, clock: FakeClock
    ) -> None:
        # The first caller opened the lifecycle; cancelled mid-run, it closed the event bus under
        # the second caller's run, whose subscribers never heard its end.
        orch = Orchestrator(agents=[scripted("w", ["work"], latency=1.0)])
        recorder = Recorder()
        orch.subscribe(recorder)
        before = live_tasks()
        results: dict[str, RunResult] = {}

        async def second() -> None:
            results["b"] = await orch.run(tasks=tasks_of(1, prefix="b"), run_id="b")

        async with anyio.create_task_group() as tg:
            with anyio.move_on_after(0.5):
                tg.start_soon(second)
                await orch.run(tasks=tasks_of(1, prefix="a"), run_id="a")
        assert results["b"].status == "success"
        ends = {event.run_id: event.status for event in recorder.of(RunFinished)}
        assert ends == {"a": "cancelled", "b": "success"}
        assert {e.result.task_id for e in recorder.of(TaskFinished) if e.run_id == "b"} == {"b0"}
        await assert_no_leaks(before)

    async def test_without_async_with_the_last_caller_may_cancel(self, clock: FakeClock) -> None:
        shared = scripted("shared", ["work"], latency=1.0, concurrency=2)
        orch = Orchestrator(agents=[Stubborn("swallow-once"), shared], concurrency=3)
        first = asyncio.ensure_future(orch.run(tasks=tasks_of(6, prefix="a")))
        await anyio.sleep(0.5)
        second = asyncio.ensure_future(
            orch.run(tasks=[*tasks_of(1, "hang", "h"), *tasks_of(4, prefix="b")])
        )
        await anyio.sleep(10.0)  # the first run's tasks are done; it waits for the second's end
        second.cancel()
        with anyio.fail_after(1000):
            with pytest.raises(asyncio.CancelledError):
                await second
            result = await first
        assert result.status == "success"

    @pytest.mark.parametrize("seed", range(6))
    async def test_runs_at_once_on_one_orchestrator_keep_the_limits_and_each_others_work(
        self, seed: int
    ) -> None:
        """Three runs at once on one orchestrator (the global limit and the agents shared), with
        retries, an agent limited below the global one, and one caller that cancels its run: the
        limits hold at every moment, the other runs end with every task succeeded, and every slot is
        given back."""
        rng = random.Random(seed)
        now = {"global": 0, "slow": 0}
        peak = {"global": 0, "slow": 0}
        failed_once: set[str] = set()

        def enter(name: str) -> None:
            now[name] += 1
            now["global"] += name != "global"
            for key in {name, "global"}:
                peak[key] = max(peak[key], now[key])

        def leave(name: str) -> None:
            now[name] -= 1
            now["global"] -= name != "global"

        @agent(kinds=["fast"], name="fast")
        async def fast(task: Task, ctx: Context) -> Any:
            now["global"] += 1
            peak["global"] = max(peak["global"], now["global"])
            try:
                await anyio.sleep(task.payload)
            finally:
                now["global"] -= 1
            return task.id

        @agent(kinds=["slow"], name="slow", concurrency=2)
        async def slow(task: Task, ctx: Context) -> Any:
            enter("slow")
            try:
                await anyio.sleep(task.payload * 3)
            finally:
                leave("slow")
            if task.id not in failed_once and rng.random() < 0.3:
                failed_once.add(task.id)
                raise RetryableError("once")
            return task.id

        def tasks(run: int) -> list[Task]:
            return [
                Task(rng.choice(["fast", "slow"]), rng.random() / 10, id=f"r{run}-{i}")
                for i in range(40)
            ]

        async with fake_clock():
            orch = Orchestrator(
                agents=[fast, slow],
                concurrency=3,
                retry=RetryPolicy(max_attempts=3, base=0.01),
                seed=seed,
            )
            results: dict[int, Any] = {}

            async def one(run: int) -> None:
                results[run] = await orch.run(tasks=tasks(run))

            async with orch, anyio.create_task_group() as tg:
                for run in range(3):
                    tg.start_soon(one, run)
                victim = anyio.CancelScope()

                async def cancelled() -> None:
                    with victim:
                        await one(3)

                tg.start_soon(cancelled)
                await anyio.sleep(rng.random())
                victim.cancel()
            assert peak["global"] <= 3
            assert peak["slow"] <= 2
            assert sorted(results) == [0, 1, 2]
            for run in range(3):
                assert results[run].status == "success", results[run].errors
                assert len(results[run].data) == 40
            assert orch._config.capacity.limiter.in_use == 0
            assert now == {"global": 0, "slow": 0}


class TestPlainRunCancelled:
    async def test_subscribers_still_hear_how_it_ended(self, clock: FakeClock) -> None:
        # No `async with`: the cancelled call's own lifecycle ends with it, and still delivers
        # what it buffered for subscribers, `RunFinished` included.
        orch = Orchestrator(agents=[scripted("slow", ["work"], latency=100.0)])
        rec = Recorder()
        orch.subscribe(rec)
        with anyio.move_on_after(1.0):
            await orch.run(tasks=tasks_of(3))
        assert [e.status for e in rec.of(RunFinished)] == ["cancelled"]
        finished = rec.of(TaskFinished)
        assert sorted(e.result.task_id for e in finished) == ["t0", "t1", "t2"]
        assert {e.result.status for e in finished} == {"cancelled"}


class TestThreadAgentsAndTheBreaker:
    @pytest.mark.timeout(60)
    async def test_attempt_timeouts_of_thread_agents_cost_a_few_probes_not_minutes(self) -> None:
        # Real time: a thread agent's call sleeps in its thread, which a FakeClock cannot skip.
        # Each call overruns its 0.05 s timeout: health failures, so the breaker opens, and the
        # run ends after a few probes (a 1 s, then 2 s cool-down) — it waited out 30 s
        # cool-downs, one probe at a time, for minutes.
        calls = 0

        def slow(task: Task) -> int:
            nonlocal calls
            calls += 1
            time.sleep(0.3)
            return 1

        cpu = agent(slow, kinds=["cpu"], executor="thread", concurrency=2, timeout=0.05)
        async with Orchestrator(
            agents=[cpu], concurrency=2, retry=RetryPolicy(max_attempts=2, base=0)
        ) as orch:
            with anyio.fail_after(30):
                result = await orch.run(tasks=[Task("cpu", i) for i in range(8)])
        assert result.status == "failed"
        assert calls <= 8 * 2
        assert {e.error_type for e in result.errors} <= {"AttemptTimeout", "CircuitOpen"}


# -- one running task cancelled through its handle ----------------------------------------------


async def cancel_a_then_run_b(orch: Orchestrator, a_under_way: anyio.Event) -> None:
    """Start tasks a and b on `orch` (one worker), cancel a alone once `a_under_way` is set: the
    run must go on to b (within 5 s: a hang is the defect) and end with a cancelled, b done."""
    handle = orch.start(tasks=[Task("work", 1, id="a"), Task("work", 2, id="b")])
    await a_under_way.wait()
    handle.cancel(task_id="a")
    with anyio.fail_after(5):
        result = await handle
    assert result.data == {"b": "b"}
    assert [e.task_id for e in result.errors] == ["a"]


class TestOneTaskCancelled:
    """`handle.cancel(task_id=...)` of one running task: it ends cancelled, and the worker that ran
    it goes on with the run's next task, whatever the agent or the safety check does meanwhile."""

    @pytest.mark.parametrize("inline", [True, False])
    async def test_a_cancelled_attempt_whose_agent_swallows_it_does_not_lose_its_worker(
        self, inline: bool
    ) -> None:
        """`handle.cancel` of one running task whose agent swallows the `CancelledError` and returns:
        the task ends cancelled, and its worker goes on with the next task (the run's only worker:
        the rest of the run must not hang)."""
        started = anyio.Event()

        @agent(kinds=["work"])
        async def stubborn(task: Task, ctx: Context) -> Any:
            if task.id == "a":
                started.set()
                try:
                    await anyio.sleep(10)
                except asyncio.CancelledError:
                    return "swallowed"
            return task.id

        # An attempt timeout makes the attempt the full one (`Attempts.run`), not the plain one.
        timeouts = None if inline else {"attempt": 60}
        async with Orchestrator(agents=[stubborn], concurrency=1, timeouts=timeouts) as orch:
            await cancel_a_then_run_b(orch, started)
            # a's output came after its cancel: the store refused it, and it is not a success
            (status,) = orch.agents_status()
        assert (status["attempts"], status["succeeded"]) == (2, 1)

    async def test_a_task_cancelled_during_its_safety_check_does_not_lose_its_worker(self) -> None:
        """`handle.cancel` of a task whose (async) safety check is under way: the task ends
        cancelled and the run's only worker goes on with the next task."""
        checking = anyio.Event()

        async def safety(task: Task) -> bool:
            if task.id == "a":
                checking.set()
                await anyio.sleep(10)
            return True

        @agent(kinds=["work"])
        async def worker(task: Task, ctx: Context) -> Any:
            return task.id

        async with Orchestrator(agents=[worker], concurrency=1, safety=safety) as orch:
            await cancel_a_then_run_b(orch, checking)

    async def test_a_cancelled_attempt_whose_agent_swallows_it_once_is_cancelled_again(
        self,
    ) -> None:
        """`handle.cancel` of a running task whose agent swallows the first `CancelledError` and
        goes on waiting: as for the run's own cancel (and as a cancel scope would), the attempt is
        cancelled again, so its worker and slots are free for the next task at once, not when the
        abandoned agent call ends by itself (here 100 s later)."""
        started = anyio.Event()
        when: dict[str, float] = {}

        @agent(kinds=["work"])
        async def stubborn(task: Task, ctx: Context) -> Any:
            when[task.id] = anyio.current_time()
            if task.id == "a":
                started.set()
                with contextlib.suppress(asyncio.CancelledError):
                    await anyio.sleep(100)
                await anyio.sleep(100)  # swallowed once: back to waiting
            return task.id

        async with fake_clock(), Orchestrator(agents=[stubborn], concurrency=1) as orch:
            handle = orch.start(tasks=[Task("work", 1, id="a"), Task("work", 2, id="b")])
            await started.wait()
            await anyio.sleep(1)
            handle.cancel(task_id="a")
            result = await handle
        assert result.data == {"b": "b"}
        assert when["b"] - when["a"] < 2
