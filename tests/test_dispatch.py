"""Dispatch: global and per-agent limits, the fixed pool of runners, executors, the registry's choice."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import pytest

from orchestra import Context, Orchestrator, RetryPolicy, Task, agent
from orchestra.testing import FakeClock, Probe, scripted
from tests.helpers import tasks_of

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable


@agent(kinds=["cpu"], executor="process", concurrency=1)
def square_in_process(task: Task) -> list[int]:
    """Runs in a worker process: must be importable, hence at module top."""
    return [os.getpid(), int(task.payload) ** 2]


class TestGlobalLimit:
    @pytest.mark.parametrize("limit", [1, 3, 8])
    async def test_reached_and_never_exceeded(
        self, limit: int, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        probe = Probe()
        agents = [
            scripted(name, ["work"], latency=1.0, jitter=0.5, seed=i, probe=probe)
            for i, name in enumerate(("a", "b", "c"))
        ]
        orch = make_orchestrator(agents=agents, concurrency=limit)
        result = await orch.run(tasks=tasks_of(40))
        assert result.status == "success"
        assert probe.peak == limit
        assert result.metadata.peak_concurrency == limit

    async def test_holds_under_errors_and_retries(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        probe = Probe()
        agents = [
            scripted(n, ["work"], latency=0.5, jitter=0.4, failure_rate=0.5, seed=i, probe=probe)
            for i, n in enumerate(("a", "b"))
        ]
        orch = make_orchestrator(
            agents=agents,
            concurrency=4,
            retry=RetryPolicy(max_attempts=6, base=0.1, cap=1.0),
            success_threshold=0.0,
        )
        result = await orch.run(tasks=tasks_of(60))
        assert result.metadata.retries > 0
        assert probe.peak == 4
        assert probe.current == 0

    async def test_is_shared_by_concurrent_runs(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        probe = Probe()
        worker = scripted("w", ["work"], latency=1.0, jitter=0.3, seed=5, probe=probe)
        results: list[str] = []
        async with make_orchestrator(agents=[worker], concurrency=3) as orch:

            async def one(prefix: str) -> None:
                result = await orch.run(tasks=tasks_of(12, prefix=prefix))
                results.append(result.status)

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, "x")
                tg.start_soon(one, "y")
        assert results == ["success", "success"]
        assert probe.peak == 3


class TestPerAgentLimit:
    async def test_each_agent_keeps_its_own_limit(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        probe = Probe()
        two = scripted("two", ["a"], latency=1.0, jitter=0.5, seed=1, probe=probe, concurrency=2)
        three = scripted(
            "three", ["b"], latency=1.0, jitter=0.5, seed=2, probe=probe, concurrency=3
        )
        orch = make_orchestrator(agents=[two, three], concurrency=50)
        result = await orch.run(tasks=[*tasks_of(20, "a", "a"), *tasks_of(20, "b", "b")])
        assert result.status == "success"
        assert two.max_in_flight == 2
        assert three.max_in_flight == 3
        assert probe.peak_by_agent == {"two": 2, "three": 3}
        assert probe.peak == 5

    async def test_holds_under_errors(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        flaky = scripted(
            "flaky", ["work"], latency=0.3, jitter=0.2, failure_rate=0.6, seed=9, concurrency=2
        )
        orch = make_orchestrator(
            agents=[flaky],
            concurrency=20,
            retry=RetryPolicy(max_attempts=8, base=0.05, cap=0.2),
            success_threshold=0.0,
        )
        result = await orch.run(tasks=tasks_of(30))
        assert result.metadata.retries > 0
        assert flaky.max_in_flight == 2
        assert flaky.in_flight == 0

    async def test_holds_across_concurrent_runs(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        one = scripted("one", ["work"], latency=1.0, concurrency=1)
        orch = make_orchestrator(agents=[one], concurrency=10)

        async def run(prefix: str) -> None:
            await orch.run(tasks=tasks_of(3, prefix=prefix))

        # A deadlock shows as the virtual deadline passing, not as a hung test.
        async with orch:
            with anyio.fail_after(1000.0):
                async with anyio.create_task_group() as tg:
                    for prefix in "xyz":
                        tg.start_soon(run, prefix)
        assert one.max_in_flight == 1
        assert len(one.calls) == 9

    async def test_hold_after_a_cancelled_run(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        probe = Probe()
        slow = scripted("slow", ["work"], latency=10.0, probe=probe, concurrency=2)
        async with make_orchestrator(agents=[slow], concurrency=3) as orch:
            with anyio.move_on_after(5.0):
                await orch.run(tasks=tasks_of(6, prefix="x"))
            assert probe.current == 0
            assert [s["in_flight"] for s in orch.agents_status()] == [0]
            result = await orch.run(tasks=tasks_of(6, prefix="y"))
        assert result.status == "success"
        assert slow.max_in_flight == 2  # neither lost nor gained a slot to the cancelled run
        assert probe.peak == 2


class TestRunnerPool:
    async def test_a_large_run_uses_a_fixed_pool_of_runners(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        samples: list[int] = []

        @agent(kinds=["work"])
        async def sample(task: Task, ctx: Context) -> None:
            samples.append(len(asyncio.all_tasks()))
            await asyncio.sleep(0)

        baseline = len(asyncio.all_tasks())
        orch = make_orchestrator(agents=[sample], concurrency=10)
        result = await orch.run(tasks=[Task("work", i) for i in range(10_000)])
        assert result.metadata.counts["succeeded"] == 10_000
        assert len(samples) == 10_000
        assert max(samples) <= baseline + 10 + 3

    async def test_a_streamed_input_is_run_by_the_same_runners_whatever_its_pace(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        # Tasks arriving one at a time, each done before the next comes (a worker's claims come
        # so, in bursts): the runners wait for the input, not one new runner per task.
        @agent(kinds=["work"])
        async def sample(task: Task, ctx: Context) -> None:
            return None

        async def tasks() -> AsyncIterator[Task]:
            for i in range(200):
                await asyncio.sleep(0)
                await asyncio.sleep(0)
                yield Task("work", i)

        loop = asyncio.get_running_loop()
        factory = loop.get_task_factory()
        started = 0

        def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
            nonlocal started
            started += 1
            if factory is None:
                return asyncio.Task(coro, loop=loop, **kwargs)
            return factory(loop, coro, **kwargs)

        orch = make_orchestrator(agents=[sample], concurrency=10)
        loop.set_task_factory(counting)
        try:
            result = await orch.run(tasks=tasks())
        finally:
            loop.set_task_factory(factory)
        assert result.metadata.counts["succeeded"] == 200
        assert started <= 10 + 10  # the runners, and the run's own few tasks

    async def test_a_burst_that_wakes_parked_runners_starts_every_task_it_has_room_for(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        # Parked runners are woken one at a time, each waking the next as it takes a task: a
        # burst of tasks whose agent waits must still have them all running at once.
        running = 0
        go = asyncio.Event()

        @agent(kinds=["quick"])
        async def quick(task: Task, ctx: Context) -> None:
            return None

        @agent(kinds=["slow"])
        async def slow(task: Task, ctx: Context) -> None:
            nonlocal running
            running += 1
            await go.wait()

        async def tasks() -> AsyncIterator[Task]:
            for i in range(20):  # runners started, then parked when these are done
                yield Task("quick", i)
            for _ in range(5):
                await asyncio.sleep(0)
            for i in range(30):  # one burst, in one step of the input
                yield Task("slow", i)

        orch = make_orchestrator(agents=[quick, slow], concurrency=40)
        async with anyio.create_task_group() as tg:
            results: list[Any] = []

            async def run() -> None:
                results.append(await orch.run(tasks=tasks()))

            tg.start_soon(run)
            with anyio.fail_after(10):
                while running < 30:
                    await asyncio.sleep(0.001)
            go.set()
        assert results[0].metadata.counts["succeeded"] == 50


class TestContexts:
    """A runner hands its next attempt the last one's context only when nobody kept it."""

    async def test_a_context_nobody_kept_serves_the_next_attempt(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        seen: list[tuple[int, str, str, int]] = []

        @agent(kinds=["work"])
        async def look(task: Task, ctx: Context) -> None:
            seen.append((id(ctx), ctx.task.id, task.id, ctx.attempt))

        orch = make_orchestrator(agents=[look], concurrency=1)
        await orch.run(tasks=[Task("work") for _ in range(50)])
        assert len({ident for ident, *_ in seen}) == 1  # one runner, one context
        assert all(ctx_task == task and attempt == 1 for _, ctx_task, task, attempt in seen)

    async def test_a_context_an_agent_keeps_is_never_handed_to_another_attempt(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        kept: list[tuple[Context, str, int]] = []
        later: list[Task] = []

        @agent(kinds=["work"])
        async def keep(task: Task, ctx: Context) -> int:
            if task.payload % 2:
                kept.append((ctx, task.id, ctx.attempt))  # kept past the attempt's end
            later.append(ctx.task)
            return int(task.payload)

        orch = make_orchestrator(agents=[keep], concurrency=2)
        result = await orch.run(tasks=[Task("work", i) for i in range(200)])
        assert result.status == "success"
        assert len(kept) == 100
        assert len({id(ctx) for ctx, _, _ in kept}) == 100
        assert all(ctx.task.id == task_id and ctx.attempt == n for ctx, task_id, n in kept)
        assert [t.payload for t in later] == list(range(200))


class TestExecutors:
    async def test_a_thread_agent_runs_off_the_loop(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        flag = threading.Event()

        @agent(kinds=["blocking"], executor="thread")
        def wait_for_flag(task: Task) -> list[Any]:
            # Blocks its thread until the async agent, on the loop, sets the flag: it could not
            # if this function blocked the loop.
            return [threading.get_ident(), flag.wait(timeout=5)]

        @agent(kinds=["async"])
        async def set_flag(task: Task, ctx: Context) -> None:
            await anyio.sleep(0.01)
            flag.set()

        orch = make_orchestrator(agents=[wait_for_flag, set_flag], concurrency=4)
        result = await orch.run(tasks=[Task("blocking", None, id="b"), Task("async", None, id="s")])
        assert result.status == "success"
        ident, was_set = result.data["b"]
        assert ident != threading.get_ident()
        assert was_set is True

    @pytest.mark.subprocess
    async def test_a_process_agent_runs_in_another_process(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        orch = make_orchestrator(agents=[square_in_process], concurrency=4)
        result = await orch.run(tasks=[Task("cpu", n, id=f"n{n}") for n in range(4)])
        assert result.status == "success", result.errors
        assert {k: v[1] for k, v in result.data.items()} == {"n0": 0, "n1": 1, "n2": 4, "n3": 9}
        assert all(pid != os.getpid() for pid, _ in result.data.values())

    async def test_thread_agents_keep_their_limit(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        lock = threading.Lock()
        state = {"now": 0, "peak": 0}
        # Calls meet in pairs: the limit of 2 must be reached (or the barrier breaks and the
        # attempt fails), and a third call at once would show in the peak.
        pair = threading.Barrier(2, timeout=5)

        @agent(kinds=["blocking"], executor="thread", concurrency=2)
        def busy(task: Task) -> None:
            with lock:
                state["now"] += 1
                state["peak"] = max(state["peak"], state["now"])
            pair.wait()
            time.sleep(0.001)
            with lock:
                state["now"] -= 1

        result = await make_orchestrator(agents=[busy], concurrency=8).run(
            tasks=tasks_of(12, "blocking")
        )
        assert result.status == "success"
        assert state["peak"] == 2


class TestRegistry:
    async def test_agents_of_a_kind_share_the_work(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        a = scripted("a", ["work"], latency=1.0, concurrency=1)
        b = scripted("b", ["work"], latency=1.0, concurrency=1)
        result = await make_orchestrator(agents=[a, b], concurrency=10).run(tasks=tasks_of(10))
        assert result.metadata.tasks_per_agent == {"a": 5, "b": 5}
        assert sorted(result.metadata.agents_used) == ["a", "b"]
        assert result.metadata.elapsed == pytest.approx(5.0)

    async def test_the_least_loaded_agent_gets_the_task(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        first = scripted("first", ["work"], latency=100.0, concurrency=4)
        second = scripted("second", ["work"], latency=1.0, concurrency=4)
        orch = make_orchestrator(agents=[first, second], concurrency=20)
        async with orch, anyio.create_task_group() as tg:
            tg.start_soon(lambda: orch.run(tasks=[Task("work", id="long")]))
            while not first.calls and not second.calls:
                await anyio.lowlevel.checkpoint()
            busy = first if first.calls else second
            other = second if busy is first else first
            # `busy` has one of its four slots in use, `other` none: the next task goes there.
            result = await orch.run(tasks=[Task("work", id="short")])
            assert result.metadata.tasks_per_agent == {other.name: 1}
            assert [c.task_id for c in other.calls] == ["short"]
            tg.cancel_scope.cancel()

    async def test_agents_status_reports_load_and_counters(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        release = anyio.Event()
        started = anyio.Event()

        @agent(kinds=["work"], concurrency=3)
        async def holder(task: Task, ctx: Context) -> None:
            started.set()
            await release.wait()

        failing = scripted("failing", ["other"], then="permanent")
        orch = make_orchestrator(agents=[holder, failing], success_threshold=0.0)
        during: list[dict[str, Any]] = []
        async with orch, anyio.create_task_group() as tg:
            tg.start_soon(lambda: orch.run(tasks=[Task("work", id="h"), Task("other", id="f")]))
            await started.wait()
            while not failing.calls:
                await anyio.lowlevel.checkpoint()
            await anyio.lowlevel.checkpoint()
            during = orch.agents_status()
            release.set()
        after = {s["name"]: s for s in orch.agents_status()}
        now = {s["name"]: s for s in during}
        assert set(now) == {"holder", "failing"}
        assert now["holder"]["status"] == "busy"
        assert now["holder"]["in_flight"] == 1
        assert now["holder"]["limit"] == 3
        assert now["holder"]["kinds"] == ["work"]
        assert after["holder"]["status"] == "idle"
        assert after["holder"]["in_flight"] == 0
        assert after["holder"]["attempts"] == 1
        assert after["holder"]["succeeded"] == 1
        assert after["failing"]["failures"] == 1
        assert after["failing"]["succeeded"] == 0
        assert after["failing"]["limit"] is None
        assert "PermanentError" in str(after["failing"]["last_error"])
