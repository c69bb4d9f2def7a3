"""Circuit breakers: per agent, for outages and not for bugs; open on a rate of health failures over
a time window (each task once), half-open after the cool-down with ONE probe, close when it ends
without an outage, re-open for a longer cool-down when it fails. While open, tasks go straight to
the next agent of their chain; a task with nowhere else to go spends an attempt on each failed
probe. The cool-downs run in fake time."""

from __future__ import annotations

import io
import itertools
import math
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from pydantic import BaseModel
from rich.console import Console

from orchestra import (
    AttemptTimeout,
    BreakerPolicy,
    ConfigError,
    Context,
    PermanentError,
    RateLimited,
    RetryableError,
    RetryPolicy,
    Task,
    VerificationError,
    agent,
)
from orchestra._breaker import Breaker, is_outage
from orchestra._core._routing import Router
from orchestra._faults import SimulatedAPIError
from orchestra.events import AttemptFailed, BreakerChanged, FallbackUsed
from orchestra.status import RunStatus, render_status
from orchestra.testing import FakeClock, Recorder, ScriptedAgent, scripted, simulate_agent_failure
from tests.helpers import not_garbage, trips_after

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence

    from orchestra import Orchestrator, RunResult

pytestmark = pytest.mark.usefixtures("clock")


def status_of(orch: Orchestrator, name: str) -> dict[str, Any]:
    return next(a for a in orch.agents_status() if a["name"] == name)


def transitions(rec: Recorder, agent: str) -> list[tuple[str, str]]:
    return [(e.previous, e.state) for e in rec.of(BreakerChanged) if e.agent == agent]


def ids(agent: ScriptedAgent) -> list[str]:
    return [c.task_id for c in agent.calls]


class Timeline:
    """A streamed input that yields tasks at given virtual times (seconds since it started)."""

    def __init__(self, clock: FakeClock, orch: Orchestrator) -> None:
        self.clock = clock
        self.orch = orch
        self.snapshots: dict[float, dict[str, dict[str, Any]]] = {}

    async def play(self, schedule: Sequence[tuple[float, Sequence[str]]]) -> AsyncIterator[Task]:
        t0 = self.clock.time()
        for at, names in schedule:
            await anyio.sleep(max(0.0, at - (self.clock.time() - t0)))
            self.snapshots[at] = {a["name"]: a for a in self.orch.agents_status()}
            for name in names:
                yield Task("k", name, id=name)


def chain_of_two(
    make_orchestrator: Callable[..., Orchestrator],
    primary_script: Sequence[str],
    **options: Any,
) -> tuple[Orchestrator, ScriptedAgent, ScriptedAgent, Recorder]:
    primary = scripted("primary", ["k"], script=primary_script, latency=1)
    backup = scripted("backup", ["k"], latency=1)
    options.setdefault("breaker", trips_after(2, cooldown=30))
    orch = make_orchestrator(
        agents=[primary, backup],
        fallbacks={"k": ["primary", "backup"]},
        retry=RetryPolicy(max_attempts=1),
        **options,
    )
    rec = Recorder()
    orch.subscribe(rec)
    return orch, primary, backup, rec


class TestOpening:
    async def test_opens_after_n_consecutive_failures_and_skips_the_agent(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        orch, primary, backup, rec = chain_of_two(make_orchestrator, ["error", "error"])
        timeline = Timeline(clock, orch)
        result = await orch.run(tasks=timeline.play([(0, ["a1", "a2"]), (5, ["b1"])]))
        assert result.status == "success"
        assert ids(primary) == ["a1", "a2"]  # b1 never reached the open agent
        assert sorted(ids(backup)) == ["a1", "a2", "b1"]
        assert transitions(rec, "primary") == [("closed", "open")]
        skipped = [e for e in rec.of(FallbackUsed) if e.task_id == "b1"]
        assert [(e.from_agent, e.to_agent) for e in skipped] == [("primary", "backup")]
        assert "breaker" in skipped[0].reason
        assert rec.results()["b1"].agent == "backup"
        assert rec.results()["b1"].attempts == 1  # no attempt was spent on the open agent
        seen = timeline.snapshots[5]["primary"]
        assert (seen["status"], seen["breaker"]) == ("open", "open")
        assert timeline.snapshots[5]["backup"]["breaker"] == "closed"

    async def test_a_success_in_the_window_keeps_a_rate_of_one_from_being_reached(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        flaky = scripted("flaky", ["k"], script=["error", "error", "ok", "error", "error", "ok"])
        orch = make_orchestrator(
            agents=[flaky],
            concurrency=1,
            retry=RetryPolicy(max_attempts=1),
            breaker=trips_after(3),
        )
        rec = Recorder()
        orch.subscribe(rec, BreakerChanged)
        await orch.run(tasks=[make_task("k") for _ in range(6)])
        assert len(flaky.calls) == 6
        assert rec.of(BreakerChanged) == []
        assert status_of(orch, "flaky")["breaker"] == "closed"

    async def test_a_failing_agent_shows_as_failing_before_it_opens(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        flaky = scripted("flaky", ["k"], script=["error"])
        orch = make_orchestrator(
            agents=[flaky], retry=RetryPolicy(max_attempts=1), breaker=trips_after(3)
        )
        async with orch:
            await orch.run(tasks=[make_task("k")])
            status = status_of(orch, "flaky")
        assert (status["status"], status["breaker"]) == ("failing", "closed")
        assert status["failures"] == 1
        assert "ConnectionError" in status["last_error"]

    async def test_breakers_are_per_agent(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        broken = scripted("broken", ["a"], then="error")
        healthy = scripted("healthy", ["b"])
        orch = make_orchestrator(
            agents=[broken, healthy],
            concurrency=1,
            retry=RetryPolicy(max_attempts=1),
            breaker=trips_after(2),
        )
        rec = Recorder()
        orch.subscribe(rec, BreakerChanged)
        async with orch:
            await orch.run(tasks=[make_task("a") for _ in range(3)] + [make_task("b")])
            states = {a["name"]: a["breaker"] for a in orch.agents_status()}
        assert states == {"broken": "open", "healthy": "closed"}
        # "broken" opened, let its probe through after the cool-down (half open), and opened
        # again when the probe failed; "healthy" never changed.
        assert [(e.agent, e.state) for e in rec.of(BreakerChanged)] == [
            ("broken", "open"),
            ("broken", "half_open"),
            ("broken", "open"),
        ]

    async def test_opens_on_a_failure_rate_over_the_window(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        # ok, error, ok, error: 2 of the 3 calls since the first failure failed -> open (never
        # 2 in a row).
        orch, primary, _, rec = chain_of_two(
            make_orchestrator,
            ["ok", "error", "ok", "error"],
            concurrency=1,
            breaker=BreakerPolicy(min_calls=3, failure_rate=0.5, window=3600),
        )
        result = await orch.run(tasks=[make_task("k", id=f"t{i}") for i in range(1, 6)])
        assert result.status == "success"
        assert transitions(rec, "primary") == [("closed", "open")]
        assert ids(primary) == ["t1", "t2", "t3", "t4"]  # t5 went straight to the backup
        assert rec.results()["t5"].agent == "backup"

    async def test_failure_rate_counts_every_success_in_the_window(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        # One failure in four: the rate never reaches 50 % over any 4 consecutive attempts.
        script = ["error", "ok", "ok", "ok", "error", "ok", "ok", "ok", "error", "ok"]
        orch, primary, _, rec = chain_of_two(
            make_orchestrator,
            script,
            concurrency=1,
            breaker=BreakerPolicy(min_calls=3, failure_rate=0.5, window=3600),
        )
        await orch.run(tasks=[make_task("k") for _ in range(len(script))])
        assert transitions(rec, "primary") == []
        assert len(primary.calls) == len(script)

    def test_failure_rate_waits_for_the_fewest_calls(self) -> None:
        breaker = Breaker(BreakerPolicy(min_calls=4, failure_rate=0.5, window=3600))
        assert breaker.on_failure(0.0, "t1", successes=0) is None
        assert breaker.on_failure(1.0, "t2", successes=0) is None  # 2 of 2 failed: too few
        assert breaker.on_failure(2.0, "t3", successes=1) == "open"  # 3 of 4 failed


class TestHalfOpen:
    async def test_one_probe_after_the_cooldown_closes_on_success(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        # Opened at t=1 (a1, a2 fail after 1 s). At t=30.9 it is still open; at t=31.1 the
        # cool-down is over: d1 is the one probe, d2 (same instant) goes to the backup.
        orch, primary, backup, rec = chain_of_two(make_orchestrator, ["error", "error"])
        timeline = Timeline(clock, orch)
        schedule = [
            (0, ["a1", "a2"]),
            (30.9, ["c1"]),
            (31.1, ["d1", "d2"]),
            (31.5, []),
            (40, ["e1", "e2"]),
        ]
        result = await orch.run(tasks=timeline.play(schedule))
        assert result.status == "success"
        assert ids(primary) == ["a1", "a2", "d1", "e1", "e2"]
        assert sorted(ids(backup)) == ["a1", "a2", "c1", "d2"]
        assert transitions(rec, "primary") == [
            ("closed", "open"),
            ("open", "half_open"),
            ("half_open", "closed"),
        ]
        at = [e.at for e in rec.of(BreakerChanged)]
        assert [a - at[0] for a in at] == pytest.approx([0, 30.1, 31.1])  # open at t=1
        assert timeline.snapshots[30.9]["primary"]["breaker"] == "open"
        assert timeline.snapshots[31.5]["primary"]["breaker"] == "half_open"
        assert timeline.snapshots[40]["primary"]["breaker"] == "closed"
        assert status_of(orch, "primary")["status"] == "idle"

    @pytest.mark.timeout(20)  # the hang was real: time stood still, a virtual deadline never came
    async def test_a_task_waiting_for_the_reopening_is_sent_then(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        # A failure at this instant opens the breaker until 559893.2372771676 + 0.1, a float that
        # is less than 0.1 after it once rounded: the retry waiting for the reopening was woken,
        # found the breaker closed to it, and was set to be woken at the same instant, forever.
        clock._now = 559893.2372771676  # the virtual clock starts where the loop's real one is
        only = scripted("only", ["work"], fail_first=1)
        orch = make_orchestrator(
            agents=[only],
            retry=RetryPolicy(max_attempts=2, base=0.01, cap=0.01, jitter="none"),
            breaker=trips_after(1, cooldown=0.1),
        )
        result = await orch.run(tasks=[Task("work", {}, id="t")])
        assert result.status == "success"
        assert len(only.calls) == 2
        assert clock.now() == pytest.approx(559893.2372771676 + 0.1)

    async def test_a_late_success_from_before_the_opening_does_not_skip_the_cooldown(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        # a1-a3 fail at t=1 and open the breaker; a4, sent before that, succeeds at t=2. Only a
        # probe after the cool-down may close it: b1 at t=10 still goes to the backup.
        orch, primary, backup, rec = chain_of_two(
            make_orchestrator,
            ["error", "error", "error", "slow"],  # "slow": twice the latency, then ok
            breaker=trips_after(3, cooldown=30),
        )
        timeline = Timeline(clock, orch)
        result = await orch.run(tasks=timeline.play([(0, ["a1", "a2", "a3", "a4"]), (10, ["b1"])]))
        assert result.status == "success"
        assert rec.results()["a4"].agent == "primary"
        assert timeline.snapshots[10]["primary"]["breaker"] == "open"
        assert ids(primary) == ["a1", "a2", "a3", "a4"]
        assert "b1" in ids(backup)
        assert transitions(rec, "primary") == [("closed", "open")]

    async def test_a_call_from_before_the_opening_that_ends_during_the_probe_decides_nothing(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        # The service is down for its first second. t0-t4 fail at t=0.1 and open the breaker;
        # "slow", sent at t=0, fails at t=1.3, while t0 is the probe (t=1.1 to 1.6, which
        # succeeds). Taken for the probe's verdict, slow's failure reopened the breaker, charged
        # t1-t4 their last attempt (CircuitOpen) and dropped t0's success: four tasks lost to an
        # outage shorter than their retry budget.
        t0 = clock.time()

        @agent(kinds=["k"], name="svc", retry=RetryPolicy(max_attempts=2, base=0.1, jitter="none"))
        async def svc(task: Task, ctx: Context) -> str:
            if task.id == "slow":
                await anyio.sleep(1.3)
                raise ConnectionError("slow to fail")
            if clock.time() - t0 < 1.0:
                await anyio.sleep(0.1)
                raise ConnectionError("down")
            await anyio.sleep(0.5)
            return "up"

        orch = make_orchestrator(
            agents=[svc], breaker=BreakerPolicy(min_calls=3, window=10, cooldown=1)
        )
        rec = Recorder()
        orch.subscribe(rec, BreakerChanged)
        with anyio.fail_after(60):
            result = await orch.run(tasks=[Task("k", id=i) for i in ("slow", "t0", "t1", "t2")])
        assert [e.task_id for e in result.errors] == ["slow"]  # its own two attempts
        assert transitions(rec, "svc")[:3] == [
            ("closed", "open"),
            ("open", "half_open"),
            ("half_open", "closed"),
        ]
        assert rec.of(BreakerChanged)[2].at - t0 == pytest.approx(1.6)  # t0's success closed it

    def test_only_the_probe_closes_or_reopens_a_half_open_breaker(self) -> None:
        breaker = Breaker(trips_after(1, cooldown=30))
        assert breaker.on_failure(10.0, "t", 0) == "open"
        assert breaker.on_dispatch(40.0) == "half_open"
        assert breaker.on_failure(41.0, "sent-before", 0) is None
        assert breaker.on_success(probe=False) is None
        assert breaker.state == "half_open"
        assert not breaker.available(41.0)  # the probe is still out
        assert breaker.on_failure(42.0, "probe", 0, probe=True) == "open"

    async def test_a_failed_probe_reopens_for_another_cooldown(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        # Opened at t=1; probe d1 at t=31.1 fails at t=32.1 -> open again until t=62.1.
        orch, primary, backup, rec = chain_of_two(make_orchestrator, ["error"] * 3)
        timeline = Timeline(clock, orch)
        schedule = [(0, ["a1", "a2"]), (31.1, ["d1"]), (62, ["f1"]), (62.2, ["g1"])]
        result = await orch.run(tasks=timeline.play(schedule))
        assert result.status == "success"
        assert ids(primary) == ["a1", "a2", "d1", "g1"]
        assert sorted(ids(backup)) == ["a1", "a2", "d1", "f1"]
        assert rec.results()["d1"].agent == "backup"  # the failed probe fell back
        assert transitions(rec, "primary") == [
            ("closed", "open"),
            ("open", "half_open"),
            ("half_open", "open"),
            ("open", "half_open"),
            ("half_open", "closed"),
        ]

    async def test_a_probe_cut_short_by_its_tasks_deadline_does_not_close_the_breaker(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        # The service hangs; the probe's task ends at its own timeout, before any answer.
        # Taken for "the service answered", it closed the breaker and let every task through.
        svc = scripted("svc", ["k"], script=["error"], then="hang")
        orch = make_orchestrator(
            agents=[svc], retry=RetryPolicy(max_attempts=1), breaker=trips_after(1, cooldown=1)
        )
        rec = Recorder()
        orch.subscribe(rec, BreakerChanged)
        async with orch:
            await orch.run(tasks=[Task("k", id="opens")])
            with anyio.fail_after(60):
                result = await orch.run(tasks=[Task("k", id="probe", timeout=3)])
            assert status_of(orch, "svc")["breaker"] == "half_open"  # the next call probes
        assert result.error_for("probe") is not None
        assert transitions(rec, "svc") == [("closed", "open"), ("open", "half_open")]

    async def test_a_probe_cancelled_without_a_verdict_lets_another_probe_through(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
        clock: FakeClock,
    ) -> None:
        # Run 1 ends (run timeout) while its probe hangs: no verdict. Run 2 may probe again.
        orch, primary, _, _ = chain_of_two(
            make_orchestrator, ["error", "error", "hang"], timeouts={"run": 40}
        )
        timeline = Timeline(clock, orch)
        async with orch:
            first = await orch.run(tasks=timeline.play([(0, ["a1", "a2"]), (31.1, ["d1"])]))
            assert status_of(orch, "primary")["breaker"] == "half_open"
            second = await orch.run(tasks=[make_task("k", id="e1")])
        assert first.error_for("d1") is not None
        assert ids(primary) == ["a1", "a2", "d1", "e1"]
        assert second.status == "success"
        assert status_of(orch, "primary")["breaker"] == "closed"


class TestAcrossRuns:
    async def test_an_open_breaker_holds_for_the_next_run_until_the_cooldown(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        orch, primary, backup, _ = chain_of_two(make_orchestrator, ["error", "error"])
        async with orch:
            await orch.run(tasks=[make_task("k"), make_task("k")])
            second = await orch.run(tasks=[make_task("k", id="later")])
            await anyio.sleep(30)
            third = await orch.run(tasks=[make_task("k", id="probe")])
        assert second.status == third.status == "success"
        assert ids(primary)[-1] == "probe"
        assert "later" not in ids(primary)
        assert "later" in ids(backup)

    async def test_every_breaker_open_makes_the_task_wait_for_the_first_probe(
        self,
        clock: FakeClock,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
    ) -> None:
        a = scripted("a", ["k"], script=["error"], then="ok")
        b = scripted("b", ["k"], script=["error"], then="ok")
        orch = make_orchestrator(
            agents=[a, b],
            fallbacks={"k": ["a", "b"]},
            retry=RetryPolicy(max_attempts=1),
            breaker=trips_after(1, cooldown=30),
        )
        async with orch:
            first = await orch.run(tasks=[make_task("k", id="first")])
            t0 = clock.time()
            result: RunResult = await orch.run(tasks=[make_task("k", id="waits")])
        # Both breakers opened on the first run; the task neither failed nor called anyone
        # until the cool-down was over, then it was the probe that closed `a` again.
        assert first.status == "failed"
        assert result.status == "success"
        assert [c.task_id for c in a.calls] == ["first", "waits"]
        assert a.calls[-1].started - t0 == pytest.approx(30)
        assert [s["breaker"] for s in orch.agents_status()] == ["closed", "open"]

    async def test_a_task_waiting_for_a_probe_still_ends_at_its_deadline(
        self,
        clock: FakeClock,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
    ) -> None:
        a = scripted("a", ["k"], then="error")
        orch = make_orchestrator(
            agents=[a],
            retry=RetryPolicy(max_attempts=1),
            breaker=trips_after(1, cooldown=30),
        )
        async with orch:
            await orch.run(tasks=[make_task("k")])
            result: RunResult = await orch.run(tasks=[make_task("k", id="late", timeout=5)])
        record = result.error_for("late")
        assert record is not None
        assert record.error_type == "TaskTimeout"
        assert record.attempts == []
        assert len(a.calls) == 1
        assert result.metadata.elapsed == pytest.approx(5)

    async def test_every_breaker_open_still_closes_with_the_default_after_the_probe(
        self,
        clock: FakeClock,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
    ) -> None:
        a = scripted("a", ["k"], then="error")
        orch = make_orchestrator(
            agents=[a],
            retry=RetryPolicy(max_attempts=1),
            breaker=trips_after(1, cooldown=30),
            defaults={"k": "cached"},
        )
        async with orch:
            await orch.run(tasks=[make_task("k")])
            result = await orch.run(tasks=[make_task("k", id="x")])
        assert result.status == "success"
        assert result.data == {"x": "cached"}
        assert result.metadata.defaulted == ["x"]
        assert len(a.calls) == 2  # the probe failed: the chain ended, the default closed it


class TestHealth:
    async def test_none_turns_breakers_off(
        self,
        clock: FakeClock,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
    ) -> None:
        a = scripted("a", ["k"], then="error")
        orch = make_orchestrator(agents=[a], breaker=None, retry=RetryPolicy(max_attempts=2))
        rec = Recorder()
        orch.subscribe(rec, BreakerChanged)
        async with orch:
            result = await orch.run(tasks=[make_task("k") for _ in range(10)])
        assert result.metadata.counts["failed"] == 10
        assert len(a.calls) == 20  # every task had its two attempts: nothing was cut short
        assert rec.of(BreakerChanged) == []
        assert orch.agents_status()[0]["breaker"] == "closed"

    async def test_permanent_errors_never_open_the_breaker(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        a = scripted("a", ["k"], then="permanent")
        orch = make_orchestrator(agents=[a], breaker=trips_after(2))
        rec = Recorder()
        orch.subscribe(rec, BreakerChanged)
        async with orch:
            result = await orch.run(tasks=[make_task("k") for _ in range(10)])
        assert result.metadata.counts["failed"] == 10
        assert len(a.calls) == 10  # every task had its own (unretried) attempt
        assert rec.of(BreakerChanged) == []

    async def test_a_probe_refused_by_the_safety_check_lets_the_next_one_through(
        self,
        clock: FakeClock,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
    ) -> None:
        a = scripted("a", ["k"], script=["error"], then="ok")
        orch = make_orchestrator(
            agents=[a],
            retry=RetryPolicy(max_attempts=1),
            breaker=trips_after(1, cooldown=10),
            safety=lambda task: task.payload != "refused",
        )
        async with orch:
            first = await orch.run(tasks=[make_task("k", "x", id="opens")])
            # Both wait for the probe; the first in line is refused before any call, which must
            # not leave the breaker half open with nobody probing: the other one probes.
            result = await orch.run(
                tasks=[make_task("k", "refused", id="no"), make_task("k", "fine", id="yes")]
            )
        assert first.status == "failed"
        assert {e.task_id: e.error_type for e in result.errors} == {"no": "Rejected"}
        assert [c.task_id for c in a.calls] == ["opens", "yes"]
        assert orch.agents_status()[0]["breaker"] == "closed"

    async def test_a_probe_rejected_by_the_verifier_reports_back(
        self,
        clock: FakeClock,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
    ) -> None:
        a = scripted("a", ["k"], script=["error", "garbage"], then="ok")
        orch = make_orchestrator(
            agents=[a],
            retry=RetryPolicy(max_attempts=3, base=0.1),
            breaker=trips_after(1, cooldown=10),
            verify={"k": not_garbage},
        )
        async with orch:
            result = await orch.run(tasks=[make_task("k", id="x")])
        # error (opens) → probe after the cool-down returns garbage (rejected: the agent
        # answered, so the breaker closes) → the retry succeeds.
        assert result.status == "success"
        assert [c.outcome for c in a.calls] == ["error", "garbage", "ok"]
        assert orch.agents_status()[0]["breaker"] == "closed"


class TestPolicy:
    @pytest.mark.parametrize(
        "options",
        [
            {"min_calls": 0},
            {"cooldown": -1},
            {"failure_rate": 0},
            {"failure_rate": 1.5},
            {"window": 0},
        ],
    )
    def test_absurd_policies_are_refused(self, options: dict[str, Any]) -> None:
        with pytest.raises(ConfigError, match="BreakerPolicy"):
            BreakerPolicy(**options)

    @pytest.mark.parametrize(
        ("opened", "cooldown"), [(559893.2372771676, 0.1), (10.0, 30.0), (0.1, 0.2)]
    )
    def test_it_is_available_at_the_time_it_says_it_reopens(
        self, opened: float, cooldown: float
    ) -> None:
        # 559893.2372771676 + 0.1 rounds so that subtracting the opening time again gives less
        # than 0.1: "available" and "reopens at" computed apart disagreed there (a task woken
        # for the reopening found it still closed to it, and was woken again at once: a hang).
        breaker = Breaker(trips_after(1, cooldown=cooldown))
        breaker.on_failure(opened, "t", 0)
        at = opened + breaker.reopens_in(opened)
        assert at == breaker.reopens_at
        assert breaker.available(at)
        assert not breaker.available(math.nextafter(at, 0.0))

    def test_half_open_admits_a_single_probe(self) -> None:
        breaker = Breaker(trips_after(1, cooldown=30))
        assert breaker.on_failure(10.0, "t", 0) == "open"
        assert not breaker.available(39.9)
        assert breaker.reopens_in(39.9) == pytest.approx(0.1)
        assert breaker.available(40.0)
        assert breaker.on_dispatch(40.0) == "half_open"
        assert not breaker.available(40.0)  # the probe is out: nobody else
        assert breaker.on_success(probe=True) == "closed"
        assert breaker.available(40.0)


class TestScale:
    async def test_tasks_waiting_for_an_open_breaker_are_not_routed_again_at_every_attempt(
        self,
        clock: FakeClock,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        # Every task fails its first attempt and succeeds its retry, so the breaker opens, lets a
        # probe through, reopens, ... while the others wait in the agent's lane. Routing every
        # waiting task again at each attempt's end was O(n) per attempt: O(n^2) over the run (a
        # CPU-bound minute for 25,000 tasks). Counted: routes per task, bounded whatever n is.
        # (A task waiting for a probe spends an attempt on each failed one: four leave room.)
        routes = 0
        route = Router.route

        def counted(self: Router, record: Any, token: int) -> Any:
            nonlocal routes
            routes += 1
            return route(self, record, token)

        monkeypatch.setattr(Router, "route", counted)

        @agent(kinds=["k"], retry=RetryPolicy(max_attempts=4, base=1, jitter="none"))
        async def flaky(task: Task, ctx: Context) -> int:
            if ctx.attempt == 1:
                raise ConnectionError("first attempt")
            return 1

        n = 400
        orch = make_orchestrator(
            agents=[flaky], concurrency=20, breaker=trips_after(5, cooldown=30)
        )
        async with orch:
            result = await orch.run(tasks=[make_task("k") for _ in range(n)])
        assert result.status == "success"
        assert routes <= 4 * n


def http_error(status: int, message: str) -> SimulatedAPIError:
    body = {"type": "error", "error": {"type": "simulated", "message": message}}
    return SimulatedAPIError(message, status_code=status, headers={}, body=body)


class TestOutagesNotBugs:
    @pytest.mark.parametrize(
        "exc",
        [
            ConnectionError("refused"),
            TimeoutError(),
            AttemptTimeout("attempt timeout after 1s"),
            RetryableError("the service says: later"),
            http_error(500, "internal error"),
            http_error(503, "unavailable"),
            http_error(529, "overloaded"),
        ],
        ids=type,
    )
    def test_what_says_the_service_is_unwell_is_an_outage(self, exc: BaseException) -> None:
        assert is_outage(exc, BreakerPolicy())

    @pytest.mark.parametrize(
        "exc",
        [
            ValueError("bad payload"),
            KeyError("clause"),
            TypeError("NoneType"),
            RuntimeError("assertion in the agent"),
            PermanentError("no"),
            RateLimited("slow down", retry_after=1),
            VerificationError("wrong", output=1),
            http_error(400, "bad request"),
            http_error(429, "rate limited"),
        ],
        ids=type,
    )
    def test_what_the_agent_itself_fails_at_is_not(self, exc: BaseException) -> None:
        assert not is_outage(exc, BreakerPolicy())

    def test_a_type_the_policy_lists_is_an_outage(self) -> None:
        class Down(Exception):
            pass

        assert not is_outage(Down(), BreakerPolicy())
        assert is_outage(Down(), BreakerPolicy(outages=(Down,)))

    async def test_a_few_buggy_payloads_cost_those_payloads_not_the_run(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        # 400 tasks of 50 ms, 11 of which hit a bug: with the default breaker and retry policy,
        # the run takes what it takes without them plus their retries' backoff (<= 0.5 + 1 s).
        buggy = {f"t{i}" for i in range(0, 400, 37)}

        @agent(kinds=["k"], concurrency=50)
        async def work(task: Task, ctx: Context) -> str:
            await anyio.sleep(0.05)
            if task.id in buggy:
                raise ValueError(f"cannot parse {task.id}")
            return task.id

        orch = make_orchestrator(agents=[work])
        rec = Recorder()
        orch.subscribe(rec, BreakerChanged)
        result = await orch.run(tasks=[Task("k", i, id=f"t{i}") for i in range(400)])
        assert len(buggy) == 11
        assert result.metadata.counts["succeeded"] == 389
        assert {e.task_id for e in result.errors} == buggy
        assert all(len(e.attempts) == 3 for e in result.errors)  # retried as before
        assert rec.of(BreakerChanged) == []
        assert result.metadata.elapsed <= 2 * (400 / 50 * 0.05) + 1.5 + 0.1

    async def test_a_kind_whose_agent_always_raises_a_bug_ends_in_seconds(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        broken = scripted("broken", ["k"], then="bug")
        orch = make_orchestrator(agents=[broken])
        result = await orch.run(tasks=[make_task("k") for _ in range(40)])
        assert result.status == "failed"
        assert len(broken.calls) == 40 * 3  # each task its three attempts, nobody waited
        assert result.metadata.elapsed < 2.0  # the backoff of two retries: <= 0.5 + 1 s
        assert orch.agents_status()[0]["breaker"] == "closed"

    async def test_a_task_retrying_an_outage_counts_once(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        # One task's ten connection errors are one task failing, not ten: the breaker needs
        # `min_calls` distinct tasks before it judges.
        down = scripted("down", ["k"], then="error")
        orch = make_orchestrator(
            agents=[down], retry=RetryPolicy(max_attempts=10, base=0.01), breaker=BreakerPolicy()
        )
        rec = Recorder()
        orch.subscribe(rec, BreakerChanged)
        result = await orch.run(tasks=[make_task("k", id="alone")])
        assert result.status == "failed"
        assert len(down.calls) == 10
        assert rec.of(BreakerChanged) == []

    @pytest.mark.parametrize("raised", [KeyError("verdict"), ConnectionError("judge is down")])
    async def test_a_verifier_that_raises_is_never_the_agents_failure(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
        raised: Exception,
    ) -> None:
        echo = scripted("echo", ["k"])

        def judge(task: Task, output: Any) -> bool:
            raise raised

        orch = make_orchestrator(
            agents=[echo],
            retry=RetryPolicy(max_attempts=2, base=0.01),
            breaker=trips_after(1),
            verify={"k": judge},
        )
        rec = Recorder()
        orch.subscribe(rec, BreakerChanged)
        result = await orch.run(tasks=[make_task("k") for _ in range(10)])
        assert result.status == "failed"
        assert len(echo.calls) == 20  # every task its two attempts: the agent never failed
        assert {e.error_type for e in result.errors} == {type(raised).__name__}
        assert rec.of(BreakerChanged) == []

    async def test_the_output_models_failure_is_never_the_agents(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        class Out(BaseModel):
            value: int

        @agent(kinds=["k"], output=Out)
        async def wrong(task: Task, ctx: Context) -> dict[str, str]:
            return {"value": "not a number"}

        orch = make_orchestrator(agents=[wrong], breaker=trips_after(1))
        result = await orch.run(tasks=[make_task("k") for _ in range(5)])
        assert result.status == "failed"
        assert orch.agents_status()[0]["breaker"] == "closed"


class TestCooldown:
    def test_grows_while_probes_fail_up_to_the_maximum_and_resets_on_close(self) -> None:
        breaker = Breaker(BreakerPolicy(min_calls=1, cooldown=1, max_cooldown=5))
        assert breaker.on_failure(0.0, "t", 0) == "open"
        seen = []
        now = 0.0
        for _ in range(5):
            now = breaker.reopens_at
            seen.append(breaker.reopens_at - breaker.opened_at)
            assert breaker.on_dispatch(now) == "half_open"
            assert breaker.on_failure(now, "probe", 0, probe=True) == "open"
        assert seen == [1, 2, 4, 5, 5]
        now = breaker.reopens_at
        breaker.on_dispatch(now)
        assert breaker.on_success(probe=True) == "closed"
        assert breaker.on_failure(now, "t", 0) == "open"
        assert breaker.reopens_at - now == 1  # from the start again

    def test_the_default_starts_near_a_second_and_stops_at_thirty(self) -> None:
        policy = BreakerPolicy()
        assert (policy.cooldown, policy.longest) == (1.0, 30.0)
        assert BreakerPolicy(cooldown=60).longest == 60  # a longer first one is the ceiling
        with pytest.raises(ConfigError, match="max_cooldown"):
            BreakerPolicy(cooldown=10, max_cooldown=5)

    def test_failures_that_left_the_window_do_not_count(self) -> None:
        breaker = Breaker(BreakerPolicy(min_calls=3, failure_rate=1.0, window=10))
        assert breaker.on_failure(0.0, "a", 0) is None
        assert breaker.on_failure(5.0, "b", 0) is None
        assert breaker.on_failure(10.5, "c", 0) is None  # "a" left the window: 2 of 2
        assert breaker.health_failures == 2
        assert breaker.on_failure(11.0, "d", 0) == "open"

    def test_successes_since_the_first_failure_lower_the_rate(self) -> None:
        breaker = Breaker(BreakerPolicy(min_calls=4, failure_rate=0.5, window=10))
        assert breaker.on_failure(0.0, "a", successes=100) is None
        assert breaker.on_failure(1.0, "b", successes=103) is None  # 2 of 5
        assert breaker.on_failure(2.0, "c", successes=103) == "open"  # 3 of 6


class TestWaitingForAProbe:
    async def test_an_agent_down_for_a_few_seconds_loses_nothing(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        # Down for 3 s from the start, the default policies: the breaker opens, probes at 1 s,
        # 3 s (and closes): no task runs out of attempts while it waits.
        service = scripted("service", ["k"], latency=0.1)
        orch = make_orchestrator(agents=[service], concurrency=10)
        rec = Recorder()
        orch.subscribe(rec, BreakerChanged)
        async with orch:
            simulate_agent_failure(orch, "service", mode="error", duration=3)
            result = await orch.run(tasks=[Task("k", i) for i in range(100)])
        assert result.status == "success"
        assert ("closed", "open") in transitions(rec, "service")
        assert transitions(rec, "service")[-1] == ("half_open", "closed")
        failed_calls = [c for c in service.calls if c.outcome != "ok"]
        assert len(failed_calls) <= 20  # what was in flight when it opened, and the probes
        assert result.metadata.elapsed < 10

    async def test_an_agent_down_for_good_fails_its_tasks_after_a_few_probes(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        down = scripted("down", ["k"], then="error", latency=0.1)
        orch = make_orchestrator(agents=[down], concurrency=10)
        rec = Recorder()
        orch.subscribe(rec, BreakerChanged)
        result = await orch.run(tasks=[Task("k", i) for i in range(200)])
        assert result.status == "failed"
        assert result.metadata.counts["failed"] == 200
        # The calls: the first tasks in flight and their retries, then one probe per cool-down.
        probes = [e for e in rec.of(BreakerChanged) if e.state == "half_open"]
        assert len(probes) <= 4
        assert len(down.calls) <= 10 * 3 + len(probes)
        # Each task that waited spent an attempt on each failed probe, and failed with it.
        waited = [e for e in result.errors if e.error_type == "CircuitOpen"]
        assert len(waited) >= 150
        for record in waited:
            assert len(record.attempts) == 3
            last = record.attempts[-1]
            assert last.error_type == "CircuitOpen"
            assert last.agent == "down"
            assert "the probe failed with ConnectionError" in last.message
            assert "3 attempts failed" in record.message
        assert result.metadata.elapsed < 1 + 2 + 4 + 1
        # The attempts add up: each failed probe's charge is an attempt of the task's (and a
        # retry when one is left), but not a call of the agent's.
        recorded = sum(len(e.attempts) for e in result.errors)
        assert result.metadata.attempts == recorded
        assert result.metadata.retries == recorded - 200
        assert orch.agents_status()[0]["attempts"] == len(down.calls)

    async def test_a_task_that_can_go_elsewhere_is_not_charged_for_a_probe(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        down = scripted("down", ["k"], then="error", latency=0.1)
        backup = scripted("backup", ["k"], latency=0.1)
        orch = make_orchestrator(
            agents=[down, backup], fallbacks={"k": ["down", "backup"]}, concurrency=10
        )
        rec = Recorder()
        orch.subscribe(rec, AttemptFailed)
        result = await orch.run(tasks=[Task("k", i) for i in range(100)])
        assert result.status == "success"
        assert rec.of(AttemptFailed)  # "down" did fail them, and they went on to the backup
        assert all(e.error_type == "ConnectionError" for e in rec.of(AttemptFailed))


class TestLanes:
    @pytest.mark.timeout(20)
    async def test_a_task_waiting_for_an_open_breaker_does_not_block_its_kind(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        # a1's breaker is open; t fails for good on a0, so it may only go to a1 now, while u1
        # and u2 wait in the kind's lane for a0. t waits for a1's probe on a timer; w, streamed
        # later, runs on idle a0 at once. (t sat at the head of the kind's lane, with no timer
        # and no probe, and w waited behind it: the run never ended.)
        @agent(kinds=["k"], name="a0", concurrency=1)
        async def a0(task: Task, ctx: Context) -> str:
            await anyio.sleep(0.02)
            if task.id == "t":
                raise PermanentError("a0 cannot do t")
            return "a0"

        a1 = scripted("a1", ["k", "x"], script=["error"], output="a1", concurrency=1)
        orch = make_orchestrator(
            agents=[a0, a1],
            concurrency=8,
            retry=RetryPolicy(max_attempts=1),
            breaker=trips_after(1, cooldown=0.2),
        )

        async def source() -> AsyncIterator[Task]:
            for name in ("t", "u1", "u2"):
                yield Task("k", id=name)
            await anyio.sleep(0.5)
            yield Task("k", id="w")

        async with orch:
            await orch.run(tasks=[Task("x", id="opens-a1")])
            assert status_of(orch, "a1")["breaker"] == "open"
            t0 = clock.time()
            result = await orch.run(tasks=source())
        assert result.status == "success"
        assert result.data["t"] == "a1"  # its probe, once the cool-down was over
        assert ids(a1)[:2] == ["opens-a1", "t"]
        assert clock.time() - t0 < 1.0


class TestAttemptsPerAgent:
    async def test_a_task_that_comes_back_to_an_agent_goes_on_with_its_attempts_there(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        # Two agents that always fail, two attempts each, breakers that open at once: the task
        # left each for the other's open breaker and came back with a fresh budget, forever.
        a0 = scripted("a0", ["k"], then="error", latency=0.01)
        a1 = scripted("a1", ["k"], then="error", latency=0.01)
        orch = make_orchestrator(
            agents=[a0, a1],
            retry=RetryPolicy(max_attempts=2, base=0.005, jitter="none"),
            breaker=trips_after(1, cooldown=0.01),
        )
        rec = Recorder()
        orch.subscribe(rec)
        with anyio.fail_after(60):
            result = await orch.run(tasks=[Task("k", id="t")])
        assert result.status == "failed"
        record = result.error_for("t")
        assert record is not None
        assert len(a0.calls) + len(a1.calls) == 4
        assert sorted(a.agent for a in record.attempts) == ["a0", "a0", "a1", "a1"]
        # Every change of agent is reported as a fallback.
        agents = [a.agent for a in record.attempts]
        changes = sum(1 for x, y in itertools.pairwise(agents) if x != y)
        moves = [e for e in rec.of(FallbackUsed) if e.to_agent is not None]
        assert len(moves) >= changes

    async def test_a_task_that_waits_for_another_agents_probe_is_reported_as_moved(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        # b's breaker opens first (run 1), then t's first attempt opens a's. Bound for a, t
        # waits for b's probe, which comes first, then for a's: each probe is its next attempt,
        # on the other agent, and each such change of agent is a fallback, told as one.
        a = scripted("a", ["k"], then="error", latency=0.5)
        b = scripted("b", ["k", "y"], then="error", latency=0.1)
        orch = make_orchestrator(
            agents=[a, b],
            retry=RetryPolicy(max_attempts=3, base=0.1, jitter="none"),
            retry_per_kind={"y": RetryPolicy(max_attempts=1)},
            breaker=trips_after(1, cooldown=5),
        )
        rec = Recorder()
        orch.subscribe(rec, FallbackUsed)
        async with orch:
            await orch.run(tasks=[Task("y", id="opens-b")])
            with anyio.fail_after(60):
                result = await orch.run(tasks=[Task("k", id="t")])
        record = result.error_for("t")
        assert record is not None
        agents = [a.agent for a in record.attempts]
        assert agents == ["a", "b", "a", "b", "a", "b"]
        moves = [(e.from_agent, e.to_agent) for e in rec.of(FallbackUsed) if e.task_id == "t"]
        assert moves[:-1] == list(itertools.pairwise(agents))
        assert moves[-1] == ("b", None)  # the chain's end


class TestFallbackReports:
    async def test_to_agent_names_the_agent_the_task_goes_to_without_a_chain(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        # t fails for good on a while u still runs on b and c is idle: the event says c, the
        # rotation (back at a, used up, then b) sends t to b.
        a = scripted("a", ["k"], then="permanent", latency=0.5)
        b = scripted("b", ["k"], latency=2)
        c = scripted("c", ["k"], latency=0.1)
        orch = make_orchestrator(agents=[a, b, c])
        rec = Recorder()
        orch.subscribe(rec)
        with anyio.fail_after(60):
            await orch.run(tasks=[Task("k", id=i) for i in ("t", "u", "v")])
        [moved] = [e for e in rec.of(FallbackUsed) if e.task_id == "t"]
        assert moved.to_agent == rec.results()["t"].agent


class TestPausedRuns:
    async def test_a_paused_run_spends_no_attempt_on_another_runs_failed_probe(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        down = scripted("down", ["k"], then="error", latency=0.1)
        orch = make_orchestrator(agents=[down], concurrency=5)
        async with orch:
            with anyio.fail_after(600):
                other = orch.start(tasks=[Task("k", i, id=f"a{i}") for i in range(10)])
                paused = orch.start(tasks=[Task("k", i, id=f"b{i}") for i in range(10)])
                await anyio.sleep(0.5)
                paused.pause()
                before = paused.status().attempts + paused.status().retries
                await other  # its probes fail while `paused` is paused
                after = paused.status().attempts + paused.status().retries
                paused.resume()  # its waiting tasks go on: they wait for the next probe
                result = await paused
        assert after == before
        assert result.metadata.counts["failed"] == 10  # down for good: each after its attempts


class TestVisibility:
    async def test_status_says_which_breaker_is_open_and_when_it_probes(
        self, make_orchestrator: Callable[..., Orchestrator], clock: FakeClock
    ) -> None:
        down = scripted("down", ["k"], then="error", latency=0.1)
        orch = make_orchestrator(agents=[down], concurrency=5)
        seen: list[RunStatus] = []
        async with orch:
            handle = orch.start(tasks=[Task("k", i) for i in range(20)])
            await anyio.sleep(0.5)
            seen.append(handle.status())
            agents = orch.agents_status()
            await handle
        status = seen[0]
        assert agents[0]["breaker"] == "open"
        assert 0 < agents[0]["next_probe_in"] <= 1.0
        (shown,) = status.agents
        assert shown.state == "open"
        assert shown.next_probe_in == pytest.approx(agents[0]["next_probe_in"])
        assert status.eta is None  # it cannot know: not 00:00
        console = Console(record=True, file=io.StringIO(), width=120)
        console.print(render_status(status))
        assert "probe in" in console.export_text()
