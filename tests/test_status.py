"""The status of a live run (`orchestra._core._status.snapshot`): every field on small runs in fake time."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import pytest

from orchestra import Concurrency, Context, Orchestrator, Rate, RetryPolicy, Task, agent
from orchestra._core._run import Run
from orchestra._core._status import snapshot
from orchestra.testing import scripted
from tests.helpers import trips_after

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence

    from orchestra import RunResult
    from orchestra.status import RunStatus
    from orchestra.testing import FakeClock

pytestmark = pytest.mark.usefixtures("clock")


async def live_run(orch: Orchestrator) -> Run:
    """The orchestrator's run once it has started (handles will give it; tests reach in)."""
    while not orch._runs or not hasattr(orch._runs[0], "dispatcher"):
        await anyio.lowlevel.checkpoint()
    return orch._runs[0]


async def watch(
    orch: Orchestrator, tasks: Any, at: Sequence[float]
) -> tuple[RunResult, list[RunStatus], Run]:
    """Run `tasks`, taking a snapshot at each virtual time in `at` (seconds after the start)."""
    seen: list[RunStatus] = []
    holder: list[Run] = []

    async def watcher() -> None:
        run = await live_run(orch)
        holder.append(run)
        start = anyio.current_time()
        for t in at:
            await anyio.sleep(start + t - anyio.current_time())
            seen.append(snapshot(run))

    result: list[RunResult] = []

    async def runner() -> None:
        result.append(await orch.run(tasks=tasks))

    async with anyio.create_task_group() as tg:
        tg.start_soon(watcher)
        tg.start_soon(runner)
    return result[0], seen, holder[0]


def sleeper(name: str, kinds: list[str], *, concurrency: int | Concurrency | None = None) -> Any:
    """An agent that takes `task.payload` seconds (or 1 s when the payload is not a number)."""

    @agent(kinds=kinds, name=name, concurrency=concurrency)
    async def fn(task: Task, ctx: Context) -> Any:
        await anyio.sleep(task.payload if isinstance(task.payload, int | float) else 1.0)
        return task.payload

    return fn


class TestCounts:
    async def test_a_run_not_started_yet_is_starting(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        async with make_orchestrator(agents=[sleeper("a", ["work"])]) as orch:
            status = snapshot(Run(orch._config, "r1"))
        assert status.state == "starting"
        assert (status.total, status.completed, status.eta) == (0, 0, None)

    async def test_counts_by_state_mid_run(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        orch = make_orchestrator(agents=[sleeper("a", ["work"], concurrency=2)], concurrency=4)
        tasks = [Task("work", 1.0, id=f"t{i}") for i in range(10)]
        _, (early, later), _ = await watch(orch, tasks, at=[0.5, 2.5])
        assert early.counts["running"] == 2
        assert early.counts["queued"] + early.counts["waiting"] == 8
        assert early.counts["succeeded"] == 0
        assert later.counts["succeeded"] == 4
        assert later.counts["running"] == 2
        assert (later.total, later.completed, later.active) == (10, 4, 2)
        assert later.progress == pytest.approx(40.0)
        assert later.elapsed == pytest.approx(2.5)
        assert later.state == "running"
        assert later.input_complete

    async def test_pending_counts_tasks_waiting_for_dependencies(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        orch = make_orchestrator(agents=[sleeper("a", ["work"])])
        tasks = [
            Task("work", 2.0, id="a"),
            Task("work", 1.0, id="b", depends_on=["a"]),
            Task("work", 1.0, id="c", depends_on=["b"]),
        ]
        _, (status,), _ = await watch(orch, tasks, at=[1.0])
        assert status.counts["pending"] == 2
        assert status.counts["running"] == 1

    async def test_retrying_counts_tasks_between_attempts(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        flaky = scripted("flaky", ["work"], script=["error"], latency=1.0)
        orch = make_orchestrator(
            agents=[flaky], retry=RetryPolicy(max_attempts=3, base=10, cap=10, jitter="none")
        )
        _, (status,), _ = await watch(orch, [Task("work", 0, id="x")], at=[3.0])
        assert status.counts["retrying"] == 1
        assert status.counts["running"] == 0
        assert (status.attempts, status.retries) == (1, 1)

    async def test_failed_and_skipped_tasks_and_the_recent_errors(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        bad = scripted("bad", ["bad"], then="permanent", latency=1.0)
        orch = make_orchestrator(agents=[bad, sleeper("good", ["work"])])
        tasks = [
            Task("bad", 0, id="a"),
            Task("work", 1.0, id="b", depends_on=["a"]),
            Task("work", 1.0, id="c"),
        ]
        _, (status,), _ = await watch(orch, tasks, at=[5.0])
        assert status.counts["failed"] == 1
        assert status.counts["skipped"] == 1
        assert status.counts["succeeded"] == 1
        assert status.error_rate == pytest.approx(0.5)
        (error,) = status.errors
        assert (error.task_id, error.kind, error.agent) == ("a", "bad", "bad")
        assert error.error_type == "PermanentError"
        assert error.at == pytest.approx(1.0)

    async def test_a_finished_run_keeps_its_elapsed_time(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        orch = make_orchestrator(agents=[sleeper("a", ["work"])])
        result, _, run = await watch(orch, [Task("work", 3.0, id="x")], at=[1.0])
        await anyio.sleep(50)
        status = snapshot(run)
        assert status.state == "finished"
        assert status.elapsed == pytest.approx(result.metadata.elapsed)
        assert (status.progress, status.eta, status.bottleneck) == (100.0, 0.0, None)

    @pytest.mark.parametrize("end", ["cancel", "stop"])
    async def test_cancelled_waiting_tasks_leave_the_queue_and_lanes_counts(
        self, make_orchestrator: Callable[..., Orchestrator], end: str
    ) -> None:
        # 3 run at the agent's limit, 5 wait in its lane, 6 queue behind the global limit of 8
        # (the agent's lane counts against it): the cancel ends the 11 waiting ones.
        orch = make_orchestrator(agents=[sleeper("a", ["work"], concurrency=3)], concurrency=8)
        async with orch:
            handle = orch.start(tasks=[Task("work", 1.0, id=f"t{i}") for i in range(14)])
            await anyio.sleep(0.5)
            waiting = [f"t{i}" for i in range(3, 14)]
            if end == "cancel":
                handle.cancel(task_id=waiting)
                mid = handle.status()
                assert mid.counts == {
                    **dict.fromkeys(mid.counts, 0),
                    "running": 3,
                    "cancelled": 11,
                }
                await handle
            else:
                await handle.stop(grace=0)
            status = handle.status()
        assert status.state == "finished"
        assert status.total == status.completed == 14
        ended = ("succeeded", "failed", "skipped", "cancelled")
        assert sum(status.counts[state] for state in ended) == 14
        assert all(n == 0 for state, n in status.counts.items() if state not in ended)
        assert status.queue_by_priority == {}
        assert status.bottleneck is None
        assert all(a.waiting == 0 for a in status.agents)

    async def test_to_dict_is_json_and_holds_the_seeds_fields(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        orch = make_orchestrator(agents=[sleeper("a", ["work"], concurrency=1)])
        tasks = [Task("work", 1.0, id=f"t{i}", priority=i % 2) for i in range(4)]
        _, (status,), _ = await watch(orch, tasks, at=[2.5])
        data = json.loads(json.dumps(status.to_dict()))
        assert {"progress": 50.0, "active": 1, "completed": 2}.items() <= data.items()
        assert data["agents"][0]["name"] == "a"
        assert data["kinds"][0]["kind"] == "work"


class TestPace:
    async def test_throughput_over_the_window_on_a_steady_run(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        orch = make_orchestrator(agents=[sleeper("a", ["work"], concurrency=5)])
        tasks = [Task("work", 1.0) for _ in range(200)]
        _, (early, steady), _ = await watch(orch, tasks, at=[0.5, 20.5])
        assert early.throughput == 0.0
        assert steady.throughput == pytest.approx(5.0, rel=0.1)
        assert steady.window == pytest.approx(9.5)

    async def test_recent_error_rate_follows_the_window(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        # 10 tasks fail at 1 s; 100 succeed 5 a second for 20 s: the run's rate counts all,
        # the window's only its last 10 s.
        bad = scripted("bad", ["bad"], then="permanent", latency=1.0, concurrency=10)
        orch = make_orchestrator(
            agents=[bad, sleeper("good", ["work"], concurrency=5)], concurrency=20
        )
        tasks = [Task("bad", 0) for _ in range(10)] + [Task("work", 1.0) for _ in range(100)]
        _, (mid, late), _ = await watch(orch, tasks, at=[2.5, 14.5])
        assert mid.completed == 20
        assert mid.recent_error_rate == pytest.approx(10 / 20)
        assert late.completed == 80
        assert late.error_rate == pytest.approx(10 / 80)
        assert late.recent_error_rate == 0.0

    async def test_mean_and_p95_duration_per_kind(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        orch = make_orchestrator(agents=[sleeper("a", ["work", "other"])], concurrency=50)
        tasks = [Task("work", float(s)) for s in range(1, 21)] + [Task("other", 3.0)]
        _, (status,), _ = await watch(orch, tasks, at=[30.0])
        work, other = sorted(status.kinds, key=lambda k: k.kind, reverse=True)
        assert work.kind == "work"
        assert work.mean == pytest.approx(10.5)
        assert work.p95 == pytest.approx(19.0)  # nearest rank: the 19th of 20
        assert other.mean == pytest.approx(3.0)
        assert other.p95 == pytest.approx(3.0)

    async def test_spend_comes_from_record_usage(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        @agent(kinds=["work"])
        async def paid(task: Task, ctx: Context) -> None:
            ctx.record_usage(cost=0.25, input_tokens=100, output_tokens=10)

        orch = make_orchestrator(agents=[paid])
        _, (status,), _ = await watch(orch, [Task("work", i) for i in range(4)], at=[0.0])
        result = await orch.run(tasks=[Task("work", 9)])  # a second run: its own meter
        assert result.metadata.cost == pytest.approx(0.25)
        assert status.cost == pytest.approx(1.0)
        assert dict(status.tokens) == {"input_tokens": 400, "output_tokens": 40}


class TestEta:
    async def test_eta_converges_on_a_steady_two_kind_workload(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        # fast: 40 x 1 s, 2 at a time (done at 20 s); slow: 40 x 4 s, 2 at a time (done at 80 s).
        orch = make_orchestrator(
            agents=[
                sleeper("fast", ["fast"], concurrency=2),
                sleeper("slow", ["slow"], concurrency=2),
            ],
            concurrency=4,
        )
        tasks = [Task("fast", 1.0) for _ in range(40)] + [Task("slow", 4.0) for _ in range(40)]
        times = [10.5, 20.5, 30.5, 40.5, 50.5, 60.5, 70.5]
        result, seen, _ = await watch(orch, tasks, at=times)
        end = result.metadata.elapsed
        assert end == pytest.approx(80.0)
        for t, status in zip(times, seen, strict=True):
            assert status.eta is not None
            assert status.eta == pytest.approx(end - t, abs=4.0), t  # within one slow task
        # A naive average (every task left at the run's mean duration over the global limit)
        # would say ~ 36 s at 20.5 s; the per-kind estimate knows the slow kind is what is left.
        assert seen[1].eta == pytest.approx(60, abs=4.0)
        assert seen[1].bottleneck is not None
        assert seen[1].bottleneck.agent == "slow"

    async def test_a_kind_with_nothing_ended_counts_its_work_once(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        # "a" (8 x 1 s) runs first, 2 at a time; "b" (4 x 1 s) waits behind it: done at 6 s. At
        # 2.5 s, "b" has no mean of its own (the run's, 1 s, stands in): 4 s of work left for
        # each kind over a limit of 2 is 4 s (3.5 s really: two attempts are half done).
        orch = make_orchestrator(
            agents=[sleeper("a", ["a"], concurrency=2), sleeper("b", ["b"], concurrency=2)],
            concurrency=2,
        )
        tasks = [Task("a", 1.0) for _ in range(8)] + [Task("b", 1.0, priority=1) for _ in range(4)]
        result, (status,), _ = await watch(orch, tasks, at=[2.5])
        assert result.metadata.elapsed == pytest.approx(6.0)
        kinds = {k.kind: k for k in status.kinds}
        assert kinds["b"].mean is None
        assert kinds["b"].eta == pytest.approx(2.0)
        assert status.eta == pytest.approx(4.0)

    async def test_no_eta_before_any_task_ended(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        orch = make_orchestrator(agents=[sleeper("a", ["work"])])
        _, (status,), _ = await watch(orch, [Task("work", 5.0)], at=[1.0])
        assert status.eta is None
        (kind,) = status.kinds
        assert (kind.mean, kind.p95, kind.eta, kind.remaining) == (None, None, None, 1)

    async def test_spawned_tasks_count_in_the_remaining_work(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        @agent(kinds=["split"])
        async def split(task: Task, ctx: Context) -> None:
            for _ in range(6):
                ctx.spawn(Task("leaf", 2.0))

        orch = make_orchestrator(
            agents=[split, sleeper("leafer", ["leaf"], concurrency=2)], concurrency=10
        )
        _, (status,), _ = await watch(orch, [Task("split", None)], at=[2.5])
        leaf = next(k for k in status.kinds if k.kind == "leaf")
        assert (leaf.total, leaf.remaining, leaf.parallelism) == (6, 4, 2)
        assert status.total == 7
        assert leaf.eta == pytest.approx(4 * 2.0 / 2)

    async def test_a_shared_concurrency_is_the_agents_parallelism(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        # The agent's limit is a `Concurrency(2)` it could share with others: the kind's ETA
        # spreads its work over 2, not over the run's 10, and the agent's status says 2.
        orch = make_orchestrator(
            agents=[sleeper("a", ["work"], concurrency=Concurrency(2))], concurrency=10
        )
        _, (status,), _ = await watch(orch, [Task("work", 2.0) for _ in range(6)], at=[2.5])
        (kind,) = status.kinds
        assert (kind.remaining, kind.parallelism) == (4, 2)
        assert kind.eta == pytest.approx(4 * 2.0 / 2)
        (agent_status,) = status.agents
        assert agent_status.limit == 2

    async def test_a_streamed_input_says_it_is_still_arriving(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        async def source() -> AsyncIterator[Task]:
            for i in range(5):
                yield Task("work", 1.0, id=f"s{i}")
                await anyio.sleep(2)

        orch = make_orchestrator(agents=[sleeper("a", ["work"])])
        _, (mid, end), _ = await watch(orch, source(), at=[2.5, 20.0])
        assert not mid.input_complete
        assert (mid.total, mid.completed) == (2, 1)
        assert end.input_complete
        assert (end.total, end.completed) == (5, 5)


class TestAgentsAndQueue:
    async def test_agent_load_utilisation_and_state(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        orch = make_orchestrator(
            agents=[sleeper("busy", ["work"], concurrency=4), sleeper("idle", ["other"])],
            concurrency=8,
        )
        _, (status,), _ = await watch(orch, [Task("work", 5.0) for _ in range(6)], at=[1.0])
        busy, idle = status.agents
        assert (busy.name, busy.state, busy.in_flight, busy.limit) == ("busy", "busy", 4, 4)
        assert busy.utilisation == pytest.approx(1.0)
        assert busy.waiting == 2
        assert (idle.state, idle.in_flight, idle.limit) == ("idle", 0, None)
        assert idle.utilisation == 0.0
        assert status.utilisation == pytest.approx(4 / 8)
        assert status.bottleneck is not None
        assert (status.bottleneck.reason, status.bottleneck.agent) == ("agent limit", "busy")
        assert status.bottleneck.waiting == 2

    async def test_an_open_breaker_shows_and_is_the_bottleneck(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        down = scripted("down", ["work"], then="error", latency=0.5)
        orch = make_orchestrator(
            agents=[down],
            breaker=trips_after(2, cooldown=60),
            retry=RetryPolicy(max_attempts=5, base=0.1, cap=0.1),
            timeouts={"task": 100},
        )
        _, (status,), _ = await watch(orch, [Task("work", i) for i in range(3)], at=[10.0])
        (agent_status,) = status.agents
        assert agent_status.state == "open"
        assert agent_status.failures >= 2
        assert agent_status.last_error is not None
        assert status.bottleneck is not None
        assert status.bottleneck.reason == "breaker open"
        assert "down" in status.bottleneck.describe()

    async def test_a_retry_after_pause_shows_and_is_the_bottleneck(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        # A 429 with Retry-After 5 at t=0.1 holds the agent's rate limit to t=5.1: at t=1 its
        # status says so, and the tasks waiting for it name the rate limit.
        limited = scripted("limited", ["work"], script=["rate_limit"], retry_after=5, latency=0.1)
        limited.limits = [Rate(100, per=1)]  # type: ignore[attr-defined]
        orch = make_orchestrator(agents=[limited], concurrency=1)
        result, (status,), _ = await watch(orch, [Task("work", i) for i in range(3)], at=[1.0])
        (agent_status,) = status.agents
        assert agent_status.paused_for == pytest.approx(4.1)
        assert status.bottleneck is not None
        assert (status.bottleneck.reason, status.bottleneck.agent) == ("rate limit", "limited")
        assert result.status == "success"

    async def test_queue_depth_by_priority_and_the_global_limit_as_bottleneck(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        orch = make_orchestrator(agents=[sleeper("a", ["work"])], concurrency=1)
        tasks = [Task("work", 1.0, priority=p) for p in (0, 1, 1, 2, 2, 2)]
        _, (status,), _ = await watch(orch, tasks, at=[0.5])
        assert dict(status.queue_by_priority) == {1: 2, 2: 3}
        assert status.counts["queued"] == 5
        assert status.bottleneck is not None
        assert status.bottleneck.reason == "concurrency"
        assert status.bottleneck.waiting == 5

    async def test_the_slowest_kind_is_the_bottleneck_when_nothing_waits(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        orch = make_orchestrator(
            agents=[sleeper("a", ["quick"]), sleeper("b", ["long"])], concurrency=10
        )
        tasks = [Task("quick", 1.0), Task("quick", 1.0), Task("long", 5.0), Task("long", 5.0)]
        _, (status,), _ = await watch(orch, tasks, at=[2.0])
        assert status.bottleneck is not None
        assert (status.bottleneck.reason, status.bottleneck.kind) == ("slowest kind", "long")
