"""Wake-ups of parked runners: a ready task with room always starts, whatever wakes it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from hypothesis import example, given, settings
from hypothesis import strategies as st

from orchestra import Agent, Concurrency, Context, Orchestrator, Rate, Task, agent

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from orchestra.testing import FakeClock


class TestSlotsFreedForAnotherRun:
    async def test_every_slot_another_run_frees_at_once_starts_a_parked_task(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        # Run x fills the shared global limit; run y's runners find it full and park. x's
        # attempts all end in one turn of the loop: each freed slot must start one of y's tasks,
        # though y's first woken runner has not run yet when the others are freed.
        limit = 4
        x_running = 0
        x_go = asyncio.Event()
        y_running = 0
        y_all = asyncio.Event()

        @agent(kinds=["x"])
        async def xa(task: Task, ctx: Context) -> None:
            nonlocal x_running
            x_running += 1
            await x_go.wait()

        @agent(kinds=["y"])
        async def ya(task: Task, ctx: Context) -> None:
            nonlocal y_running
            y_running += 1
            if y_running == limit:
                y_all.set()
            await y_all.wait()  # each y task ends only once all of them ran at once

        statuses: list[str] = []
        async with make_orchestrator(agents=[xa, ya], concurrency=limit) as orch:

            async def one(kind: str) -> None:
                result = await orch.run(tasks=[Task(kind, i) for i in range(limit)])
                statuses.append(result.status)

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, "x")
                with anyio.fail_after(5):
                    while x_running < limit:
                        await asyncio.sleep(0)
                tg.start_soon(one, "y")
                for _ in range(20):  # y's runners start, find no room and park
                    await asyncio.sleep(0)
                assert y_running == 0
                x_go.set()
                with anyio.fail_after(5):
                    await y_all.wait()
        assert statuses == ["success", "success"]


# -- every task ends, and at every quiet moment as many run as the limits allow ------------------

_SETTLE = 200  # turns of the loop after each step: every wake-up chain has run its course


@dataclass
class _Call:
    kind: int
    id: str
    done: asyncio.Future[None]


@st.composite
def _scenarios(draw: st.DrawFn) -> tuple[int, list[int], int | None, int, list[tuple[Any, ...]]]:
    kinds = draw(st.integers(1, 4))
    runs = draw(st.integers(1, 2))
    limits = draw(st.lists(st.integers(1, 4), min_size=kinds, max_size=kinds))
    shared = draw(st.one_of(st.none(), st.integers(1, 4))) if kinds >= 2 else None
    step = st.one_of(
        st.tuples(
            st.just("burst"),
            st.integers(0, runs - 1),
            st.lists(st.integers(0, kinds - 1), min_size=1, max_size=12),
        ),
        st.tuples(
            st.just("dependents"),
            st.integers(0, runs - 1),
            st.lists(st.integers(0, kinds - 1), max_size=8),
        ),
        st.tuples(st.just("release"), st.integers(1, 12)),
        st.tuples(st.just("pause")),
        st.tuples(st.just("resume")),
    )
    steps = draw(st.lists(step, min_size=1, max_size=12))
    return draw(st.integers(1, 8)), limits, shared, runs, steps


class TestEveryReadyTaskWithRoomStarts:
    @settings(max_examples=60, deadline=None)
    @given(scenario=_scenarios())
    # Two runners parked, then a burst of three: the third needs a runner started, not woken.
    @example(
        scenario=(4, [4], None, 1, [("burst", 0, [0, 0]), ("release", 2), ("burst", 0, [0] * 3)])
    )
    # Run 1 fills the limit, run 0 waits; run 1's calls all end in one turn of the loop.
    @example(
        scenario=(2, [2], None, 2, [("burst", 1, [0, 0]), ("burst", 0, [0, 0]), ("release", 2)])
    )
    async def test_at_every_quiet_moment_as_many_run_as_the_limits_allow(
        self, scenario: tuple[int, list[int], int | None, int, list[tuple[Any, ...]]]
    ) -> None:
        # One or two streamed runs (sharing the global limit and the agents) of one agent per kind, each with its own limit (kinds 0 and 1 maybe
        # under a shared one too), fed in bursts (plain tasks, or dependents of a running task,
        # readied in one batch when it ends), its calls released a few at once, paused and
        # resumed. After each step, once the loop is quiet, the running calls are exactly what
        # the global, agent and shared limits allow of the ready tasks.
        concurrency, limits, shared, runs, steps = scenario
        together = Concurrency(shared) if shared is not None else None
        running: list[_Call] = []
        ended: set[str] = set()
        admitted: dict[str, tuple[int, str | None]] = {}  # id -> (kind, the task it waits for)

        def make(k: int) -> Agent:
            async def call(task: Task, ctx: Context) -> None:
                entry = _Call(k, task.id, asyncio.get_running_loop().create_future())
                running.append(entry)
                try:
                    await entry.done
                finally:
                    running.remove(entry)
                    ended.add(task.id)

            extra = [together] if together is not None and k < 2 else []
            return agent(call, kinds=[f"k{k}"], name=f"a{k}", concurrency=limits[k], limits=extra)

        feeds: list[asyncio.Queue[list[Task] | None]] = [asyncio.Queue() for _ in range(runs)]

        async def tasks(feed: asyncio.Queue[list[Task] | None]) -> AsyncIterator[Task]:
            while (burst := await feed.get()) is not None:
                for task in burst:  # one burst in one step of the input
                    yield task

        def allowed() -> int:
            ready = [0] * len(limits)
            for tid, (k, dep) in admitted.items():
                if tid not in ended and (dep is None or dep in ended):
                    ready[k] += 1
            each = [min(limits[k], ready[k]) for k in range(len(limits))]
            if shared is not None:
                return min(concurrency, min(shared, each[0] + each[1]) + sum(each[2:]))
            return min(concurrency, sum(each))

        async def settle() -> None:
            for _ in range(_SETTLE):
                await asyncio.sleep(0)

        count = 0
        paused = False
        orch = Orchestrator(agents=[make(k) for k in range(len(limits))], concurrency=concurrency)
        async with orch:
            handles = [orch.start(tasks=tasks(feed)) for feed in feeds]
            handle = handles[0]  # the one paused and resumed
            for step in steps:
                if step[0] in ("burst", "dependents"):
                    dep = None
                    r = step[1]
                    if step[0] == "dependents":
                        theirs = [c.id for c in running if c.id.startswith(f"r{r}")]
                        if not theirs:
                            continue
                        dep = theirs[0]
                    burst = []
                    for k in step[2]:
                        tid = f"r{r}t{count}"
                        count += 1
                        admitted[tid] = (k, dep)
                        burst.append(Task(f"k{k}", None, id=tid, depends_on=[dep] if dep else []))
                    feeds[r].put_nowait(burst)
                elif step[0] == "release":
                    for entry in running[: step[1]]:  # all in one turn of the loop
                        entry.done.set_result(None)
                elif step[0] == "pause":
                    handle.pause()
                    paused = True
                else:
                    handle.resume()
                    paused = False
                await settle()
                if not paused:
                    assert len(running) == allowed(), (step, [c.id for c in running])
            handle.resume()
            for feed in feeds:
                feed.put_nowait(None)
            with anyio.fail_after(10):
                while not all(h.done for h in handles):
                    for entry in list(running):
                        if not entry.done.done():
                            entry.done.set_result(None)
                    await asyncio.sleep(0)
            results = [await h for h in handles]
        assert sum(r.metadata.counts["succeeded"] for r in results) == len(admitted)


class TestLanesThatOpenTogether:
    async def test_tasks_of_two_rate_limited_agents_due_at_once_both_start(
        self, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        # One task each goes at once; the second of each waits in its agent's lane for the
        # same refill. Then both must start together: each ends only once both run.
        running: list[str] = []
        both = asyncio.Event()

        async def call(task: Task, ctx: Context) -> None:
            running.append(task.id)
            if task.payload:
                if sum(1 for t in running if t.endswith("2")) == 2:
                    both.set()
                await both.wait()

        a = agent(call, kinds=["a"], name="a", limits=[Rate(1, per=1)])
        b = agent(call, kinds=["b"], name="b", limits=[Rate(1, per=1)])
        tasks = [Task("a", 0, id="a1"), Task("b", 0, id="b1")]
        tasks += [Task("a", 1, id="a2"), Task("b", 1, id="b2")]
        orch = make_orchestrator(agents=[a, b], concurrency=4)
        with anyio.fail_after(30):
            result = await orch.run(tasks=tasks)
        assert result.metadata.counts["succeeded"] == 4
