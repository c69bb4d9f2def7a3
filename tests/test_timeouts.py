"""Timeouts: per attempt (cancels the agent call, retryable), per task (every attempt and wait
together, no fallback), per run (the run ends with what finished). All in fake time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import pytest

from orchestra import ConfigError, Context, RetryPolicy, Task, Timeouts, agent
from orchestra.events import AttemptFailed, TaskFinished
from orchestra.testing import scripted
from tests.helpers import NEVER_OPENS, run_recorded

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from orchestra import Orchestrator

pytestmark = pytest.mark.usefixtures("clock")

NO_BREAKER = NEVER_OPENS


class TestAttemptTimeout:
    async def test_a_hanging_call_is_cancelled_and_retried(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        hanger = scripted("hanger", ["k"], script=["hang", "ok"])
        orch = make_orchestrator(
            agents=[hanger],
            timeouts={"attempt": 5},
            retry=RetryPolicy(max_attempts=2, base=1, jitter="none"),
        )
        result, done, rec = await run_recorded(orch, [make_task("k", id="t")])
        assert result.status == "success"
        assert result.metadata.elapsed == pytest.approx(6)  # 5 s cut + 1 s backoff
        first = hanger.calls[0]
        assert first.ended is not None  # the call was really cancelled: its finally ran
        assert first.ended - first.started == pytest.approx(5)
        failures = done["t"].failures
        assert failures is not None
        (timed_out,) = failures
        assert (timed_out.error_type, timed_out.agent) == ("AttemptTimeout", "hanger")
        assert timed_out.started == pytest.approx(0)
        assert timed_out.duration == pytest.approx(5)
        (event,) = rec.of(AttemptFailed)
        assert event.retryable

    async def test_a_slow_agent_is_cut_at_every_attempt(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        slow = scripted("slow", ["k"], latency=10)
        orch = make_orchestrator(
            agents=[slow],
            timeouts=Timeouts(attempt=3),
            retry=RetryPolicy(max_attempts=2, base=1, jitter="none"),
        )
        result, _, _ = await run_recorded(orch, [make_task("k", id="t")])
        assert result.status == "failed"
        record = result.error_for("t")
        assert record is not None
        assert record.error_type == "AttemptTimeout"
        assert [(a.started, a.duration) for a in record.attempts] == [
            pytest.approx((0, 3)),
            pytest.approx((4, 3)),
        ]
        assert "timeout" in record.remediation.lower()

    async def test_an_agents_own_timeout_wins_over_the_runs(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        @agent(kinds=["k"], timeout=2)
        async def impatient(task: Task, ctx: Context) -> str:
            if ctx.attempt == 1:
                await hang()
            return "ok"

        orch = make_orchestrator(
            agents=[impatient],
            timeouts={"attempt": 60},
            retry=RetryPolicy(max_attempts=2, base=1, jitter="none"),
        )
        result, done, _ = await run_recorded(orch, [make_task("k", id="t")])
        assert result.status == "success"
        failures = done["t"].failures
        assert failures is not None
        assert failures[0].duration == pytest.approx(2)

    async def test_waiting_for_a_slot_is_not_part_of_the_attempt(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        # Three 4 s calls one at a time under a 5 s attempt timeout: the third waits 8 s for
        # the slot and still has its whole 5 s.
        worker = scripted("worker", ["k"], latency=4)
        orch = make_orchestrator(agents=[worker], concurrency=1, timeouts={"attempt": 5})
        result, done, _ = await run_recorded(orch, [make_task("k") for _ in range(3)])
        assert result.status == "success"
        assert result.metadata.attempts == 3
        assert sorted(r.finished for r in done.values()) == pytest.approx([4, 8, 12])

    async def test_waiting_for_an_agents_own_limit_is_not_part_of_the_attempt(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        worker = scripted("worker", ["k"], latency=4, concurrency=1)
        orch = make_orchestrator(agents=[worker], concurrency=10, timeouts={"attempt": 5})
        result, _, _ = await run_recorded(orch, [make_task("k") for _ in range(3)])
        assert result.status == "success"
        assert result.metadata.attempts == 3
        assert result.metadata.elapsed == pytest.approx(12)


async def hang() -> None:
    await anyio.sleep_forever()


class TestTaskTimeout:
    async def test_covers_every_attempt_and_backoff_together(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        # Attempts 0-4 and 4.5-8.5 time out; the third starts at 9.5 and is cut at 10.
        hanger = scripted("hanger", ["k"], then="hang")
        orch = make_orchestrator(
            agents=[hanger],
            timeouts={"attempt": 4},
            retry=RetryPolicy(max_attempts=10, base=0.5, jitter="none"),
            breaker=NO_BREAKER,
        )
        result, done, _ = await run_recorded(orch, [make_task("k", id="t", timeout=10)])
        assert result.status == "failed"
        assert done["t"].finished == pytest.approx(10)
        assert len(hanger.calls) == 3
        record = result.error_for("t")
        assert record is not None
        assert record.error_type == "TaskTimeout"
        assert [a.error_type for a in record.attempts] == [
            "AttemptTimeout",
            "AttemptTimeout",
            "TaskTimeout",
        ]
        assert record.attempts[-1].duration == pytest.approx(0.5)

    async def test_the_runs_task_timeout_applies_to_every_task(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        hanger = scripted("hanger", ["k"], then="hang")
        orch = make_orchestrator(agents=[hanger], timeouts={"task": 7})
        result, done, _ = await run_recorded(orch, [make_task("k", id="a"), make_task("k", id="b")])
        assert result.status == "failed"
        assert {r.error_type for r in result.errors} == {"TaskTimeout"}
        assert [done["a"].finished, done["b"].finished] == pytest.approx([7, 7])

    async def test_a_tasks_own_timeout_wins_over_the_runs(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        hanger = scripted("hanger", ["k"], then="hang")
        orch = make_orchestrator(agents=[hanger], timeouts={"task": 100})
        _, done, _ = await run_recorded(orch, [make_task("k", id="t", timeout=3)])
        assert done["t"].error_type == "TaskTimeout"
        assert done["t"].finished == pytest.approx(3)

    async def test_a_task_timeout_does_not_fall_back(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        hanger = scripted("hanger", ["k"], then="hang")
        spare = scripted("spare", ["k"])
        orch = make_orchestrator(agents=[hanger, spare], fallbacks={"k": ["hanger", "spare"]})
        result, _, _ = await run_recorded(orch, [make_task("k", id="t", timeout=10)])
        assert result.status == "failed"
        assert spare.calls == []
        record = result.error_for("t")
        assert record is not None
        assert record.error_type == "TaskTimeout"
        assert "timeout" in record.remediation.lower()

    async def test_the_clock_starts_when_the_task_is_ready(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        slow = scripted("slow", ["slow"], latency=100)
        quick = scripted("quick", ["quick"], latency=5)
        orch = make_orchestrator(agents=[slow, quick])
        result, done, _ = await run_recorded(
            orch,
            [
                make_task("slow", id="first"),
                make_task("quick", id="then", depends_on=["first"], timeout=10),
            ],
        )
        assert result.status == "success"
        assert done["then"].finished == pytest.approx(105)

    async def test_a_task_waiting_for_a_slot_times_out_at_its_deadline(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        # "everything from ready to terminal": B's 10 s pass while A holds the only slot.
        worker = scripted("worker", ["k"], latency=100)
        orch = make_orchestrator(agents=[worker], concurrency=1)
        _, done, _ = await run_recorded(
            orch, [make_task("k", id="A"), make_task("k", id="B", timeout=10)]
        )
        assert done["B"].status == "failed"
        assert done["B"].error_type == "TaskTimeout"
        assert [c.task_id for c in worker.calls] == ["A"]
        assert done["B"].finished == pytest.approx(10)  # not when the slot freed, at t=100

    async def test_a_retry_past_the_deadline_fails_the_task_without_waiting(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        limited = scripted("limited", ["k"], script=["rate_limit"], retry_after=60, latency=1)
        orch = make_orchestrator(agents=[limited], retry=RetryPolicy(max_attempts=3))
        result, done, _ = await run_recorded(orch, [make_task("k", id="t", timeout=10)])
        assert result.status == "failed"
        assert done["t"].error_type == "TaskTimeout"
        assert len(limited.calls) == 1
        assert done["t"].finished == pytest.approx(1)  # no point waiting 9 s for nothing

    async def test_a_retry_that_cannot_fit_the_deadline_moves_to_the_next_agent(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        # The primary asks for 60 s; the task has 10 s. The fallback chain exists for this: the
        # next agent gets the task now rather than the task timing out before its deadline.
        limited = scripted("limited", ["k"], script=["rate_limit"], retry_after=60, latency=1)
        spare = scripted("spare", ["k"], latency=1)
        orch = make_orchestrator(
            agents=[limited, spare],
            fallbacks={"k": ["limited", "spare"]},
            retry=RetryPolicy(max_attempts=3),
        )
        result, done, _ = await run_recorded(orch, [make_task("k", id="t", timeout=10)])
        assert result.status == "success"
        assert done["t"].agent == "spare"
        assert done["t"].finished == pytest.approx(2)


class TestChecksUnderTheTaskTimeout:
    """A verifier and a safety check are part of the task: its deadline bounds them too."""

    async def test_a_hanging_async_verifier_is_cut_at_the_task_deadline(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        async def verifier(task: Task, output: Any) -> bool:
            await anyio.sleep_forever()  # an LLM judge that never answers
            return True

        worker = scripted("worker", ["k"], latency=1)
        orch = make_orchestrator(agents=[worker], verify={"k": verifier})
        with anyio.fail_after(1000):  # fake time: turns a hang into a clean failure
            _, done, _ = await run_recorded(orch, [make_task("k", id="t", timeout=10)])
        assert done["t"].status == "failed"
        assert done["t"].error_type == "TaskTimeout"
        assert done["t"].finished == pytest.approx(10)

    async def test_a_hanging_safety_check_is_cut_at_the_task_deadline(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        async def safety(task: Task) -> bool:
            await anyio.sleep_forever()  # a moderation service that never answers
            return True

        worker = scripted("worker", ["k"])
        orch = make_orchestrator(agents=[worker], safety=safety)
        with anyio.fail_after(1000):
            _, done, _ = await run_recorded(orch, [make_task("k", id="t", timeout=10)])
        assert worker.calls == []
        assert done["t"].status == "failed"
        assert done["t"].finished == pytest.approx(10)


class TestRunTimeout:
    @pytest.mark.usefixtures("no_leaks")
    async def test_the_run_ends_with_what_finished(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        quick = scripted("quick", ["quick"], latency=1)
        stuck = scripted("stuck", ["stuck"], then="hang")
        orch = make_orchestrator(agents=[quick, stuck], timeouts={"run": 10})
        tasks = [make_task("quick") for _ in range(8)] + [
            make_task("stuck", id="s1"),
            make_task("stuck", id="s2"),
        ]
        result, done, _ = await run_recorded(orch, tasks)
        assert result.metadata.elapsed == pytest.approx(10)
        assert result.status == "partial"  # 8 of 10 >= 0.8, nothing critical: the usual rules
        assert result.metadata.counts["succeeded"] == 8
        assert result.metadata.counts["cancelled"] == 2
        assert {e.task_id: e.status for e in result.errors} == {
            "s1": "cancelled",
            "s2": "cancelled",
        }
        assert result.metadata.reason is not None
        assert "run timeout" in result.metadata.reason
        assert [c.ended is not None and c.ended - c.started for c in stuck.calls] == pytest.approx(
            [10, 10]
        )  # both calls were cancelled at the run timeout
        assert len(done) == 10

    async def test_the_status_follows_the_rules_when_too_little_finished(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        quick = scripted("quick", ["quick"], latency=1)
        stuck = scripted("stuck", ["stuck"], then="hang")
        orch = make_orchestrator(agents=[quick, stuck], timeouts={"run": 10})
        tasks = [make_task("quick") for _ in range(6)] + [make_task("stuck") for _ in range(4)]
        result, _, _ = await run_recorded(orch, tasks)
        assert result.status == "failed"
        assert result.metadata.success_rate == pytest.approx(0.6)

    @pytest.mark.usefixtures("no_leaks")
    async def test_queued_retrying_and_dependent_tasks_are_reported_once(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        # At t=10: "busy" runs (from t=1), "queued" waits for the one slot, "retrying" waits 100 s
        # for its retry, "child" waits for "busy". Each ends exactly once, none as succeeded.
        worker = scripted("worker", ["k"], latency=3)
        limited = scripted("limited", ["r"], then="rate_limit", retry_after=100, latency=1)
        slow = scripted("slow", ["slow"], latency=1000)
        orch = make_orchestrator(
            agents=[worker, limited, slow], concurrency=1, timeouts={"run": 10}
        )
        tasks = [
            make_task("r", id="retrying", priority=0),
            make_task("slow", id="busy", priority=1),
            make_task("k", id="queued", priority=2),
            make_task("k", id="child", depends_on=["busy"], priority=0),
        ]
        result, done, rec = await run_recorded(orch, tasks)
        finished = [e.result.task_id for e in rec.of(TaskFinished)]
        assert sorted(finished) == ["busy", "child", "queued", "retrying"]
        assert {t: r.status for t, r in done.items() if t != "child"} == {
            "busy": "cancelled",
            "queued": "cancelled",
            "retrying": "cancelled",
        }
        assert done["child"].status in ("cancelled", "skipped")
        assert result.status == "failed"
        assert result.metadata.elapsed == pytest.approx(10)

    async def test_a_critical_task_cut_by_the_run_timeout_fails_the_run(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        quick = scripted("quick", ["quick"], latency=1)
        stuck = scripted("stuck", ["stuck"], then="hang")
        orch = make_orchestrator(agents=[quick, stuck], timeouts={"run": 10})
        tasks = [make_task("quick") for _ in range(9)] + [make_task("stuck", critical=True)]
        result, _, _ = await run_recorded(orch, tasks)
        assert result.status == "failed"


class TestRunTimeoutBeforeTheInputEnds:
    """A run timeout that fires while a streamed input still has items: the unread input counts
    against the run, which is never ok, and the metadata says how much was left."""

    @staticmethod
    async def planner(n: int) -> AsyncIterator[Task]:
        for i in range(n):
            yield Task("q", id=f"q{i}")
            await anyio.sleep(5)  # one item every 5 s: 3 read when the run times out at 12 s

    @pytest.mark.parametrize("threshold", [0.2, 0.8, 1.0])
    async def test_an_async_generator_left_unread_fails_the_run_and_misses_the_threshold(
        self, make_orchestrator: Callable[..., Orchestrator], threshold: float
    ) -> None:
        missed: list[int] = []
        orch = make_orchestrator(
            agents=[scripted("quick", ["q"])],
            timeouts={"run": 12},
            success_threshold=threshold,
            on_threshold_missed=lambda result, failed: missed.append(len(failed)),
        )
        result = await orch.run(tasks=self.planner(10))
        meta = result.metadata
        assert meta.counts["succeeded"] == 3  # every task that was read succeeded
        assert result.status == "failed"
        assert not result.ok
        assert not meta.input_complete
        assert meta.input_unread is None  # a generator: how many were left is unknown
        assert meta.reason == (
            "run timeout after 12s, before the end of the input (an unknown number of items unread)"
        )
        assert missed == [0]

    async def test_an_iterator_of_known_length_counts_its_unread_items(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        gate = anyio.Event()  # never set: every task waits, so the window stays full

        @agent(kinds=["q"])
        async def waits(task: Task, ctx: Context) -> Any:
            if task.id != "q0":
                await gate.wait()
            return 1

        orch = make_orchestrator(
            agents=[waits], timeouts={"run": 12}, window=4, success_threshold=0.1
        )
        result = await orch.run(tasks=iter([Task("q", id=f"q{i}") for i in range(10)]))
        meta = result.metadata
        assert result.status == "failed"
        assert not meta.input_complete
        assert meta.input_unread == 5  # 5 admitted (the window's 4, and 1 more as q0 ended)
        assert meta.success_rate == pytest.approx(1 / 10)  # the unread count as not succeeded
        assert meta.reason == "run timeout after 12s, before the end of the input (5 items unread)"

    async def test_an_input_read_to_its_end_says_so(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        orch = make_orchestrator(agents=[scripted("quick", ["q"])], timeouts={"run": 60})
        result = await orch.run(tasks=self.planner(3))
        assert result.status == "success"
        assert result.metadata.input_complete
        assert result.metadata.input_unread == 0


class TestConfiguration:
    @pytest.mark.parametrize(
        "value",
        [{"attempt": 0}, {"task": -1}, {"run": "soon"}, {"atempt": 5}],
        ids=["zero", "negative", "not-a-number", "unknown-key"],
    )
    def test_absurd_timeouts_are_refused(
        self, make_orchestrator: Callable[..., Orchestrator], value: dict[str, Any]
    ) -> None:
        with pytest.raises(ConfigError):
            make_orchestrator(agents=[scripted("a", ["k"])], timeouts=value)

    def test_a_mapping_and_a_timeouts_are_the_same(self) -> None:
        assert Timeouts.of({"attempt": 60, "task": 300, "run": 3600}) == Timeouts(60, 300, 3600)
        assert Timeouts.of(None) == Timeouts()
