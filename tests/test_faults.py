"""The fault kit (`orchestra.testing`): scripted agents, `Probe`, and live faults through
`simulate_agent_failure(orch, ...)` with `recovery_status(orch)`. All in fake time."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import pytest

from orchestra import (
    ConfigError,
    Context,
    Orchestrator,
    PermanentError,
    RetryPolicy,
    RunResult,
    Task,
    agent,
)
from orchestra.events import AttemptFailed, RetryScheduled, RunFinished
from orchestra.testing import (
    GARBAGE,
    FakeClock,
    Probe,
    Recorder,
    RecoveryStatus,
    recovery_status,
    restore_agent,
    scripted,
    simulate_agent_failure,
)
from tests.helpers import not_garbage, run_recorded, trips_after

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

pytestmark = pytest.mark.usefixtures("clock")


class TestScriptedAgent:
    @pytest.mark.parametrize(
        "options",
        [
            {"script": ["slow"]},
            {"then": "slow"},
            {"failure_rate": 0.5, "failure_mode": "slow"},
            {"dies_after": 1, "die_mode": "slow"},
        ],
    )
    def test_slow_without_a_latency_is_refused(self, options: dict[str, Any]) -> None:
        # "slow" adds `latency` to a call: with none, the test it is written for would pass
        # without anything being slow.
        with pytest.raises(ConfigError, match="'slow' outcome needs a latency > 0"):
            scripted("a", ["k"], **options)
        assert scripted("a", ["k"], latency=0.5, **options).latency == 0.5
        scripted("a", ["k"], failure_mode="slow")  # never played: no failure rate

    async def test_fails_the_first_n_calls_and_records_each(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        flaky = scripted("flaky", ["k"], fail_first=2, latency=1.5)
        orch = make_orchestrator(
            agents=[flaky], retry=RetryPolicy(max_attempts=3, base=1, jitter="none")
        )
        result, _, _ = await run_recorded(orch, [make_task("k", id="t")])
        assert result.status == "success"
        assert flaky.outcomes() == ["error", "error", "ok"]
        assert [(c.task_id, c.attempt) for c in flaky.calls] == [("t", 1), ("t", 2), ("t", 3)]
        for call in flaky.calls:
            assert call.ended is not None
            assert call.ended - call.started == pytest.approx(1.5)
        assert result.data == {"t": {"agent": "flaky", "task": "t"}}

    async def test_a_script_then_a_steady_outcome(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        agent = scripted("a", ["k"], script=["ok", "server_error"], then="permanent")
        orch = make_orchestrator(agents=[agent], concurrency=1, retry=RetryPolicy(max_attempts=1))
        _, done, _ = await run_recorded(orch, [make_task("k", id=f"t{i}") for i in range(4)])
        assert agent.outcomes() == ["ok", "server_error", "permanent", "permanent"]
        assert [done[f"t{i}"].error_type for i in range(4)] == [
            None,
            "APIStatusError",
            "PermanentError",
            "PermanentError",
        ]

    async def test_hang_never_returns_until_a_timeout_cancels_it(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        stuck = scripted("stuck", ["k"], then="hang")
        orch = make_orchestrator(
            agents=[stuck], timeouts={"attempt": 30}, retry=RetryPolicy(max_attempts=1)
        )
        result, done, _ = await run_recorded(orch, [make_task("k", id="t")])
        assert done["t"].error_type == "AttemptTimeout"
        (call,) = stuck.calls
        assert call.ended is not None
        assert call.ended - call.started == pytest.approx(30)
        assert result.metadata.elapsed == pytest.approx(30)

    async def test_garbage_is_returned_as_is_and_caught_by_a_verifier(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        junk = scripted("junk", ["k"], then="garbage")
        unchecked = await make_orchestrator(agents=[junk]).run(tasks=[make_task("k", id="t")])
        assert unchecked.data == {"t": GARBAGE}  # nobody checked: the run took it

        junk = scripted("junk", ["k"], then="garbage")
        orch = make_orchestrator(
            agents=[junk], verify={"k": not_garbage}, retry=RetryPolicy(max_attempts=2, base=0.1)
        )
        checked = await orch.run(tasks=[make_task("k", id="t")])
        record = checked.error_for("t")
        assert record is not None
        assert record.error_type == "VerificationError"
        assert record.partial_output is GARBAGE

    async def test_a_seeded_failure_rate_is_reproducible(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        async def outcomes(seed: int) -> list[str]:
            agent = scripted("a", ["k"], failure_rate=0.3, failure_mode="overloaded", seed=seed)
            orch = make_orchestrator(
                agents=[agent], concurrency=1, retry=RetryPolicy(max_attempts=1)
            )
            await orch.run(tasks=[make_task("k") for _ in range(300)])
            return agent.outcomes()

        first = await outcomes(5)
        assert first == await outcomes(5)
        assert first != await outcomes(6)
        assert set(first) == {"ok", "overloaded"}
        assert 0.2 < first.count("overloaded") / len(first) < 0.4

    async def test_dies_after_n_calls_for_good(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        mortal = scripted("mortal", ["k"], dies_after=3, die_mode="permanent")
        spare = scripted("spare", ["k"])
        orch = make_orchestrator(
            agents=[mortal, spare], fallbacks={"k": ["mortal", "spare"]}, concurrency=1
        )
        result, done, _ = await run_recorded(orch, [make_task("k", id=f"t{i}") for i in range(6)])
        assert result.status == "success"
        assert mortal.outcomes() == ["ok"] * 3 + ["permanent"] * 3
        assert [done[f"t{i}"].agent for i in range(6)] == ["mortal"] * 3 + ["spare"] * 3

    async def test_latency_with_jitter_stays_in_its_range(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        agent = scripted("a", ["k"], latency=2, jitter=0.5, seed=3)
        orch = make_orchestrator(agents=[agent])
        await orch.run(tasks=[make_task("k") for _ in range(50)])
        durations = [c.ended - c.started for c in agent.calls if c.ended is not None]
        assert len(durations) == 50
        assert all(1.5 - 1e-9 <= d <= 2.5 + 1e-9 for d in durations)
        assert max(durations) - min(durations) > 0.5  # the jitter did vary them

    @pytest.mark.parametrize(
        ("output", "expected"),
        [({"answer": 42}, {"answer": 42}), (lambda task: task.payload * 2, 42)],
        ids=["value", "callable"],
    )
    async def test_a_custom_output(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
        output: Any,
        expected: Any,
    ) -> None:
        # `scripted(output=...)` is documented as the agent's output (or output(task)). The
        # registry must not mistake it for a declared pydantic `output` model.
        agent = scripted("a", ["k"], output=output)
        result = await make_orchestrator(agents=[agent]).run(tasks=[make_task("k", 21, id="t")])
        assert result.status == "success"
        assert result.data == {"t": expected}

    @pytest.mark.parametrize(
        "options",
        [{"script": ["explode"]}, {"then": "nope"}, {"failure_rate": 1.5}],
        ids=["script", "then", "failure-rate"],
    )
    def test_bad_scripts_are_refused(self, options: dict[str, Any]) -> None:
        with pytest.raises(ConfigError):
            scripted("a", ["k"], **options)

    @pytest.mark.parametrize(
        ("name", "value"),
        [
            ("kinds", "k"),  # it served "k" by luck; "work" served "w", "o", "r", "k"
            ("name", 3),
            ("latency", -1),
            ("latency", float("nan")),
            ("jitter", -0.5),
            ("failure_rate", "0.5"),
            ("fail_first", 1.5),
            ("dies_after", -1),
            ("retry_after", "soon"),
            ("seed", "abc"),
            ("concurrency", 0),
            ("timeout", 0),
            ("retry", 3),
            ("script", "error"),
        ],
        ids=repr,
    )
    def test_a_wrong_option_is_a_config_error_naming_it(self, name: str, value: Any) -> None:
        options: dict[str, Any] = {"name": "a", "kinds": ["k"], name: value}
        with pytest.raises(ConfigError) as info:
            scripted(**options)
        assert name in str(info.value), info.value
        assert repr(value) in str(info.value), info.value

    async def test_its_own_concurrency_limit_is_respected(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        agent = scripted("a", ["k"], latency=1, concurrency=2)
        orch = make_orchestrator(agents=[agent], concurrency=10)
        result = await orch.run(tasks=[make_task("k") for _ in range(10)])
        assert agent.max_in_flight == 2
        assert result.metadata.elapsed == pytest.approx(5)


class TestHang:
    @pytest.mark.timeout(30)
    async def test_a_hang_without_a_timeout_lets_virtual_time_stand_still(
        self, clock: FakeClock
    ) -> None:
        # Nothing but the hang is pending: the loop waits for real I/O (here, a thread's call
        # after 0.3 real seconds) instead of jumping a day of virtual time at every turn.
        stuck = scripted("stuck", ["k"], then="hang")
        loop = asyncio.get_running_loop()
        async with Orchestrator(agents=[stuck], retry=RetryPolicy(max_attempts=1)) as orch:
            handle = orch.start(tasks=[Task("k", None, id="t")])
            t0 = clock.now()
            stopping: list[asyncio.Task[object]] = []

            def later() -> None:
                time.sleep(0.3)
                loop.call_soon_threadsafe(lambda: stopping.append(loop.create_task(handle.stop(0))))

            threading.Thread(target=later, daemon=True).start()
            result = await handle
        assert result.status == "cancelled"
        assert clock.now() - t0 < 1


class TestProbe:
    async def test_counts_calls_at_once_across_agents(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        probe = Probe()
        a = scripted("a", ["x"], latency=1, probe=probe, concurrency=2)
        b = scripted("b", ["y"], latency=1.5, probe=probe)
        orch = make_orchestrator(agents=[a, b], concurrency=5)
        await orch.run(
            tasks=[make_task("x") for _ in range(10)] + [make_task("y") for _ in range(10)]
        )
        assert probe.peak == 5
        assert probe.peak_by_agent["a"] == 2
        assert probe.current == 0
        assert probe.by_agent == {"a": 0, "b": 0}

    async def test_tracks_your_own_agents_work(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        probe = Probe()

        @agent(kinds=["x"], name="mine", concurrency=3)
        async def mine(task: Task, ctx: Context) -> None:
            with probe.track("mine"):
                await anyio.sleep(1)
                if task.payload == "fail":
                    raise PermanentError("counted all the same")

        orch = make_orchestrator(agents=[mine], concurrency=10)
        tasks = [make_task("x") for _ in range(7)] + [make_task("x", payload="fail")]
        result = await orch.run(tasks=tasks)
        assert result.status == "partial"
        assert (probe.peak, probe.peak_by_agent, probe.current) == (3, {"mine": 3}, 0)


class TestRecorder:
    @pytest.mark.parametrize("latency", [0.0, 0.1])
    async def test_has_every_event_of_a_run_right_after_it_returns(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
        latency: float,
    ) -> None:
        # Read inside `async with`, between runs: the run's events reached the recorder before
        # `run()` returned (the last ones were still buffered for its delivery task).
        flaky = scripted("flaky", ["k"], fail_first=1, latency=latency)
        rec = Recorder()
        orch = make_orchestrator(agents=[flaky])
        orch.subscribe(rec)
        async with orch:
            for n in (1, 2):
                await orch.run(tasks=[make_task("k") for _ in range(5)])
                assert len(rec.results()) == 5 * n
                assert len(rec.delays()) == 1
                assert [type(e).__name__ for e in rec.events][-1] == "RunFinished"
                assert len(rec.of(RunFinished)) == n

    @pytest.mark.timeout(30)
    async def test_a_run_does_not_wait_for_the_events_of_another_run(self) -> None:
        # Another run on the orchestrator emits events without a pause until this one has
        # returned: waiting for the recorder's buffer to empty would wait for ever, and taking
        # one event per turn of the loop took seconds behind the other run's runners.
        this_one_returned = anyio.Event()

        @agent(kinds=["k"])
        async def quick(task: Task, ctx: Context) -> int:
            await anyio.lowlevel.checkpoint()
            return 1

        async def endless() -> AsyncIterator[Task]:
            while not this_one_returned.is_set():
                yield Task("k", None)

        rec = Recorder()
        async with Orchestrator(agents=[quick], concurrency=20) as orch:
            orch.subscribe(rec)
            async with anyio.create_task_group() as tg:
                other: list[RunResult] = []

                async def run_other() -> None:
                    other.append(await orch.run(tasks=endless()))

                tg.start_soon(run_other)
                while len(rec.events) < 1_000:  # the other run is under way (virtual time
                    await anyio.lowlevel.checkpoint()  # stands still while it is)
                result = await orch.run(tasks=[Task("k", None, id=f"mine{i}") for i in range(5)])
                this_one_returned.set()
        assert result.status == "success"
        assert {f"mine{i}" for i in range(5)} <= set(rec.results())
        assert other[0].status == "success"


class TestSimulatedFailure:
    @pytest.mark.parametrize(
        ("mode", "error_type"),
        [
            ("error", "ConnectionError"),
            ("rate_limit", "RateLimitError"),
            ("overloaded", "APIStatusError"),
            ("server_error", "APIStatusError"),
            ("permanent", "PermanentError"),
            ("hang", "AttemptTimeout"),
            ("garbage", "VerificationError"),
        ],
    )
    async def test_each_mode_fails_like_the_real_thing_and_falls_back(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
        mode: str,
        error_type: str,
    ) -> None:
        main = scripted("main", ["k"], latency=1)
        spare = scripted("spare", ["k"], latency=1)
        orch = make_orchestrator(
            agents=[main, spare],
            fallbacks={"k": ["main", "spare"]},
            retry=RetryPolicy(max_attempts=1),
            timeouts={"attempt": 10},
            verify={"k": not_garbage},
        )
        rec = Recorder()
        orch.subscribe(rec)
        async with orch:
            simulate_agent_failure(orch, "main", mode=mode)  # type: ignore[arg-type]
            result = await orch.run(tasks=[make_task("k", id="t")])
            status = recovery_status(orch)
        assert result.status == "success"
        assert main.calls == []  # the fault answered for it
        (failed,) = rec.of(AttemptFailed)
        assert (failed.agent, failed.error_type) == ("main", error_type)
        assert rec.results()["t"].agent == "spare"
        assert status == "recovered"

    async def test_a_rate_limit_carries_its_retry_after(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        main = scripted("main", ["k"])
        orch = make_orchestrator(agents=[main], retry=RetryPolicy(max_attempts=2, base=0.01))
        rec = Recorder()
        orch.subscribe(rec, RetryScheduled)
        async with orch:
            simulate_agent_failure(orch, "main", mode="rate_limit", retry_after=7, duration=5)
            result = await orch.run(tasks=[make_task("k")])
        assert result.status == "success"
        assert [e.delay for e in rec.of(RetryScheduled)] == [7.0]
        assert len(main.calls) == 1  # the retry at t=7 is past the 5 s fault

    async def test_slow_adds_latency(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        main = scripted("main", ["k"], latency=1)
        orch = make_orchestrator(agents=[main])
        async with orch:
            simulate_agent_failure(orch, "main", mode="slow", latency=4)
            result = await orch.run(tasks=[make_task("k")])
        assert result.status == "success"
        assert result.metadata.elapsed == pytest.approx(5)

    async def test_the_fault_ends_after_its_duration(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
        clock: FakeClock,
    ) -> None:
        main = scripted("main", ["k"], latency=1)
        orch = make_orchestrator(agents=[main], retry=RetryPolicy(max_attempts=1))
        async with orch:
            simulate_agent_failure(orch, "main", mode="error", duration=10)
            during = await orch.run(tasks=[make_task("k")])
            await anyio.sleep(10)
            after = await orch.run(tasks=[make_task("k")])
        assert during.status == "failed"
        assert after.status == "success"
        assert len(main.calls) == 1

    async def test_restore_ends_the_fault_now(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        main = scripted("main", ["k"])
        orch = make_orchestrator(agents=[main], retry=RetryPolicy(max_attempts=1))
        async with orch:
            simulate_agent_failure(orch, "main", mode="permanent")
            during = await orch.run(tasks=[make_task("k")])
            restore_agent(orch, "main")
            after = await orch.run(tasks=[make_task("k")])
        assert (during.status, after.status) == ("failed", "success")

    async def test_a_failure_mid_run_is_carried_by_the_fallback(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        main = scripted("main", ["k"], latency=1, concurrency=1)
        spare = scripted("spare", ["k"], latency=1, concurrency=1)
        orch = make_orchestrator(
            agents=[main, spare],
            retry=RetryPolicy(max_attempts=2, base=0.5),
            breaker=trips_after(3, cooldown=60),
        )
        tasks = [make_task("k", id=f"t{i}") for i in range(10)]
        async with orch:

            async def strike() -> None:
                await anyio.sleep(2.5)
                simulate_agent_failure(orch, "main", mode="error")

            async with anyio.create_task_group() as tg:
                tg.start_soon(strike)
                result = await orch.run(tasks=tasks)
            status = recovery_status(orch)
        assert result.status == "success"
        assert status == "recovered"
        assert isinstance(status, RecoveryStatus)
        assert isinstance(status, str)
        assert status.agents == ["main"]
        assert status.pending == status.failed == []
        assert "recovered" in status.describe()
        assert len(main.calls) == 3  # t=0, 1, 2; from t=3 on the fault answered

    async def test_recovery_failed_names_the_tasks_that_did_not_recover(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        main = scripted("main", ["k"])
        orch = make_orchestrator(agents=[main], retry=RetryPolicy(max_attempts=2, base=0.1))
        async with orch:
            simulate_agent_failure(orch, "main", mode="error")
            await orch.run(tasks=[make_task("k", id="lost")])
            status = recovery_status(orch)
        assert status == "failed"
        assert status.failed == ["lost"]
        assert "lost" in status.describe()

    async def test_recovery_is_degraded_while_hit_tasks_are_unfinished(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        main = scripted("main", ["k"])
        orch = make_orchestrator(
            agents=[main], retry=RetryPolicy(max_attempts=2, base=10, jitter="none")
        )
        seen: list[RecoveryStatus] = []
        async with orch:
            simulate_agent_failure(orch, "main", mode="error", duration=5)

            async def look() -> None:
                await anyio.sleep(3)  # the task waits for its retry at t=10
                seen.append(recovery_status(orch))

            async with anyio.create_task_group() as tg:
                tg.start_soon(look)
                result = await orch.run(tasks=[make_task("k", id="t")])
            final = recovery_status(orch)
        assert result.status == "success"
        assert seen == ["degraded"]
        assert seen[0].pending == ["t"]
        assert final == "recovered"

    async def test_a_second_failure_of_an_agent_keeps_what_the_first_one_hit(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        main = scripted("main", ["k"], latency=1)
        orch = make_orchestrator(agents=[main], retry=RetryPolicy(max_attempts=1), breaker=None)
        async with orch:
            simulate_agent_failure(orch, "main", mode="error", duration=1.5)

            async def again() -> None:
                await anyio.sleep(2)  # the first outage failed every task already
                simulate_agent_failure(orch, "main", mode="error", duration=0.5)

            async with anyio.create_task_group() as tg:
                tg.start_soon(again)
                result = await orch.run(tasks=[make_task("k", id=f"t{i}") for i in range(3)])
            status = recovery_status(orch)
        assert result.status == "failed"
        assert status == "failed"
        assert status.failed == ["t0", "t1", "t2"]

    async def test_no_fault_means_recovered(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        status = recovery_status(make_orchestrator(agents=[scripted("a", ["k"])]))
        assert status == "recovered"
        assert status.agents == []

    async def test_unknown_agents_and_modes_are_refused(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        orch = make_orchestrator(agents=[scripted("a", ["k"])])
        with pytest.raises(ConfigError, match="agent-9"):
            simulate_agent_failure(orch, "agent-9")
        with pytest.raises(ConfigError, match="meltdown"):
            simulate_agent_failure(orch, "a", mode="meltdown")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="agent-9"):
            restore_agent(orch, "agent-9")  # it did nothing, as if restored

    @pytest.mark.parametrize(
        ("name", "value"),
        [("duration", math.nan), ("duration", -1), ("latency", "1"), ("retry_after", -1)],
        ids=repr,
    )
    async def test_wrong_numbers_are_refused(
        self, make_orchestrator: Callable[..., Orchestrator], name: str, value: Any
    ) -> None:
        # They were taken: duration=nan never ended, latency="1" raised TypeError in a call.
        orch = make_orchestrator(agents=[scripted("a", ["k"])])
        with pytest.raises(ConfigError, match=name) as info:
            simulate_agent_failure(orch, "a", **{name: value})
        assert repr(value) in str(info.value)

    def test_outside_an_event_loop_it_says_so(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        orch = make_orchestrator(agents=[scripted("a", ["k"])])
        with pytest.raises(ConfigError, match="event loop"):
            simulate_agent_failure(orch, "a")
