"""Fallback chains (each agent with its own attempts, defaults closing the chain, the error record of
every attempt) and the failure hooks: typed event subscriptions for every step. In fake time."""

from __future__ import annotations

import gc
import warnings
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from orchestra import ConfigError, Orchestrator, RetryPolicy, Task
from orchestra.events import (
    AttemptFailed,
    AttemptStarted,
    AttemptSucceeded,
    Event,
    FallbackUsed,
    RetryScheduled,
    RunFinished,
    RunStarted,
    TaskFinished,
    TaskReady,
)
from orchestra.testing import Recorder, ScriptedAgent, scripted
from tests.helpers import run_recorded, trips_after

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence


pytestmark = pytest.mark.usefixtures("clock")


def research_chain(
    make_orchestrator: Callable[..., Orchestrator],
    *,
    sonnet: Sequence[str] = (),
    haiku: Sequence[str] = (),
    sonnet_then: str = "error",
    haiku_then: str = "error",
    **options: Any,
) -> tuple[Orchestrator, ScriptedAgent, ScriptedAgent, ScriptedAgent]:
    s = scripted("sonnet", ["research"], script=sonnet, then=sonnet_then, latency=1)
    h = scripted("haiku", ["research"], script=haiku, then=haiku_then, latency=1)
    c = scripted("cached_answers", ["cache"], latency=1)
    options.setdefault("retry", RetryPolicy(max_attempts=2, base=1, jitter="none"))
    orch = make_orchestrator(
        agents=[c, h, s],  # registration order is not the chain's order
        fallbacks={"research": ["sonnet", "haiku", "cached_answers"]},
        **options,
    )
    return orch, s, h, c


class TestChain:
    async def test_each_agent_in_turn_with_its_own_attempts(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        orch, sonnet, haiku, cached = research_chain(make_orchestrator)
        result, done, rec = await run_recorded(orch, [make_task("research", id="q")])
        assert result.status == "success"
        assert (len(sonnet.calls), len(haiku.calls), len(cached.calls)) == (2, 2, 1)
        task = done["q"]
        assert task.agent == "cached_answers"
        assert task.attempts == 5
        assert task.finished == pytest.approx(7)  # 1 + 1 + 1 | 1 + 1 + 1 | 1
        assert task.failures is not None
        assert [(a.number, a.agent, a.error_type) for a in task.failures] == [
            (1, "sonnet", "ConnectionError"),
            (2, "sonnet", "ConnectionError"),
            (3, "haiku", "ConnectionError"),
            (4, "haiku", "ConnectionError"),
        ]
        assert [a.started for a in task.failures] == pytest.approx([0, 2, 3, 5])
        assert [a.duration for a in task.failures] == pytest.approx([1, 1, 1, 1])
        assert all("sonnet" in a.message or "haiku" in a.message for a in task.failures)
        hops = [(e.from_agent, e.to_agent, e.reason) for e in rec.of(FallbackUsed)]
        assert hops == [
            ("sonnet", "haiku", "2 attempts failed"),
            ("haiku", "cached_answers", "2 attempts failed"),
        ]
        assert result.metadata.fallbacks == 2
        assert result.metadata.tasks_per_agent == {"cached_answers": 1}

    async def test_a_permanent_failure_moves_on_at_once(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        orch, sonnet, haiku, cached = research_chain(
            make_orchestrator, sonnet_then="permanent", haiku_then="ok"
        )
        result, done, rec = await run_recorded(orch, [make_task("research", id="q")])
        assert result.status == "success"
        assert (len(sonnet.calls), len(haiku.calls), len(cached.calls)) == (1, 1, 0)
        assert done["q"].agent == "haiku"
        assert done["q"].finished == pytest.approx(2)
        assert rec.of(RetryScheduled) == []
        (hop,) = rec.of(FallbackUsed)
        assert (hop.from_agent, hop.to_agent, hop.reason) == ("sonnet", "haiku", "permanent error")

    async def test_an_exhausted_chain_records_every_attempt(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        s = scripted("sonnet", ["research"], then="server_error", latency=1)
        h = scripted("haiku", ["research"], then="permanent", latency=2)
        orch = make_orchestrator(
            agents=[s, h],
            fallbacks={"research": ["sonnet", "haiku"]},
            retry=RetryPolicy(max_attempts=3, base=1, jitter="none"),
        )
        result, _, rec = await run_recorded(orch, [make_task("research", id="q")])
        assert result.status == "failed"
        record = result.error_for("q")
        assert record is not None
        assert record.status == "failed"
        assert [(a.number, a.agent, a.error_type) for a in record.attempts] == [
            (1, "sonnet", "APIStatusError"),
            (2, "sonnet", "APIStatusError"),
            (3, "sonnet", "APIStatusError"),
            (4, "haiku", "PermanentError"),
        ]
        assert [a.started for a in record.attempts] == pytest.approx([0, 2, 5, 6])
        assert [a.duration for a in record.attempts] == pytest.approx([1, 1, 1, 2])
        assert [a.retry_in for a in record.attempts] == [1.0, 2.0, None, None]
        assert "internal error" in record.attempts[0].message
        assert record.error_type == "PermanentError"  # what ended it
        assert "haiku" in record.message
        assert rec.of(FallbackUsed)[-1].to_agent is None  # the chain ran out

    async def test_an_exhausted_chain_counts_every_attempt_of_the_task(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        # One attempt each on two agents: the error says two attempts failed, on both, and
        # does not advise a fallback the task already had.
        s = scripted("sonnet", ["research"], then="error", latency=1)
        h = scripted("haiku", ["research"], then="error", latency=1)
        orch = make_orchestrator(
            agents=[s, h],
            fallbacks={"research": ["sonnet", "haiku"]},
            retry=RetryPolicy(max_attempts=1),
        )
        result, _, rec = await run_recorded(orch, [make_task("research", id="q")])
        record = result.error_for("q")
        assert record is not None
        assert [a.agent for a in record.attempts] == ["sonnet", "haiku"]
        assert record.message.endswith("(2 attempts failed on sonnet, haiku)")
        assert "fallback" not in record.remediation.lower()
        hops = [(e.from_agent, e.to_agent, e.reason) for e in rec.of(FallbackUsed)]
        assert hops == [
            ("sonnet", "haiku", "1 attempt failed"),
            ("haiku", None, "1 attempt failed"),
        ]

    async def test_an_agent_without_a_fallback_is_advised_one(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        alone = scripted("alone", ["research"], then="error", latency=1)
        orch = make_orchestrator(agents=[alone], retry=RetryPolicy(max_attempts=2, base=1))
        result, _, _ = await run_recorded(orch, [make_task("research", id="q")])
        record = result.error_for("q")
        assert record is not None
        assert record.message.endswith("(2 attempts failed)")
        assert "add a fallback agent" in record.remediation.lower()

    async def test_a_default_closes_the_chain(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        s = scripted("sonnet", ["research"], then="error")
        orch = make_orchestrator(
            agents=[s],
            retry=RetryPolicy(max_attempts=2, base=1),
            defaults={"research": {"answer": "unknown"}},
        )
        result, done, _ = await run_recorded(
            orch, [make_task("research", id="q"), make_task("research", id="r")]
        )
        assert result.status == "success"
        assert result.data == {"q": {"answer": "unknown"}, "r": {"answer": "unknown"}}
        assert sorted(result.metadata.defaulted) == ["q", "r"]
        assert result.errors == []
        task = done["q"]
        assert task.ok
        assert task.defaulted
        assert task.agent is None
        assert task.failures is not None
        assert [a.agent for a in task.failures] == ["sonnet", "sonnet"]

    async def test_a_default_is_only_used_when_the_chain_fails(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        s = scripted("sonnet", ["research"], fail_first=1)
        orch = make_orchestrator(
            agents=[s], retry=RetryPolicy(max_attempts=2), defaults={"research": "stale"}
        )
        result, done, _ = await run_recorded(orch, [make_task("research", id="q")])
        assert result.metadata.defaulted == []
        assert not done["q"].defaulted
        assert done["q"].agent == "sonnet"
        assert result.data == {"q": {"agent": "sonnet", "task": "q"}}

    async def test_agents_of_a_kind_without_a_chain_are_each_others_fallbacks(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        broken = scripted("broken", ["k"], then="error", latency=1)
        working = scripted("working", ["k"], latency=1)
        orch = make_orchestrator(agents=[broken, working], retry=RetryPolicy(max_attempts=2))
        result, done, _ = await run_recorded(orch, [make_task("k", id=f"t{i}") for i in range(6)])
        assert result.status == "success"
        assert {r.agent for r in done.values()} == {"working"}
        assert broken.calls  # it got its share of the load first
        for task_id, task in done.items():
            agents = [a.agent for a in task.failures or []]
            assert agents in ([], ["broken", "broken"]), task_id  # 2 attempts, then the other

    async def test_when_every_agent_of_a_kind_fails_each_had_its_attempts(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        a = scripted("a", ["k"], then="error")
        b = scripted("b", ["k"], then="error")
        orch = make_orchestrator(agents=[a, b], retry=RetryPolicy(max_attempts=3, base=0.1))
        result, _, _ = await run_recorded(orch, [make_task("k", id="t")])
        record = result.error_for("t")
        assert record is not None
        agents = [x.agent for x in record.attempts]
        assert sorted(agents) == ["a", "a", "a", "b", "b", "b"]
        assert agents[:3] == [agents[0]] * 3  # one agent at a time

    async def test_a_chain_may_end_on_an_agent_of_another_kind(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        orch, _, _, cached = research_chain(make_orchestrator)
        result, _, _ = await run_recorded(
            orch, [make_task("research", id="q"), make_task("cache", id="c")]
        )
        assert result.status == "success"
        assert {c.task_id for c in cached.calls} == {"q", "c"}

    async def test_the_fallback_event_names_the_agent_that_gets_the_task(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        # No chain: a, b, c serve "k". b's breaker is open (it failed a task of kind "x"), so
        # when a gives up, c gets the task, and FallbackUsed must say so.
        a = scripted("a", ["k"], then="error")
        b = scripted("b", ["k", "x"], script=["error"])
        c = scripted("c", ["k"])
        orch = make_orchestrator(
            agents=[a, b, c],
            retry=RetryPolicy(max_attempts=1),
            breaker=trips_after(1, cooldown=60),
        )
        rec = Recorder()
        orch.subscribe(rec, FallbackUsed)
        async with orch:
            await orch.run(tasks=[make_task("x")])
            result = await orch.run(tasks=[make_task("k", id="t")])
        assert result.status == "success"
        assert [x.task_id for x in c.calls] == ["t"]
        hops = [(e.from_agent, e.to_agent) for e in rec.of(FallbackUsed) if e.task_id == "t"]
        assert hops == [("a", "c")]

    def test_an_unknown_agent_in_a_chain_is_refused(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        with pytest.raises(ConfigError, match="opus"):
            make_orchestrator(
                agents=[scripted("sonnet", ["research"])],
                fallbacks={"research": ["sonnet", "opus"]},
            )

    def test_an_empty_chain_is_refused(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        with pytest.raises(ConfigError, match="research"):
            make_orchestrator(agents=[scripted("sonnet", ["research"])], fallbacks={"research": []})


class TestHooks:
    """before/after attempt, on retry, on fallback, on task done: typed event subscriptions."""

    async def test_every_step_of_a_task_is_an_event_in_order(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        a = scripted("a", ["k"], then="error", latency=1)
        b = scripted("b", ["k"], latency=1)
        orch = make_orchestrator(
            agents=[a, b],
            fallbacks={"k": ["a", "b"]},
            retry=RetryPolicy(max_attempts=2, base=1, jitter="none"),
        )
        result, _, rec = await run_recorded(orch, [make_task("k", id="t")])
        assert isinstance(rec.events[-1], RunFinished)
        steps = [
            (type(e).__name__, getattr(e, "agent", None), getattr(e, "attempt", None))
            for e in rec.events
            if not isinstance(e, RunStarted | RunFinished | TaskReady)
        ]
        assert steps == [
            ("AttemptStarted", "a", 1),
            ("AttemptFailed", "a", 1),
            ("RetryScheduled", "a", 1),
            ("AttemptStarted", "a", 2),
            ("AttemptFailed", "a", 2),
            ("FallbackUsed", None, None),
            ("AttemptStarted", "b", 3),
            ("AttemptSucceeded", "b", 3),
            ("TaskFinished", None, None),
        ]
        assert len(rec.of(TaskReady)) == 3  # admitted, after the backoff, after the fallback
        (started,) = rec.of(RunStarted)
        assert [e.at for e in rec.of(AttemptStarted)] == pytest.approx(
            [started.at + t for t in (0, 2, 3)]
        )
        (succeeded,) = rec.of(AttemptSucceeded)
        assert succeeded.duration == pytest.approx(1)
        assert all(e.run_id == result.metadata.run_id for e in rec.events)

    async def test_a_runs_events_open_with_run_started(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        # A subscriber sets up its per-run state on RunStarted; the run's TaskReady events come
        # after it, not before.
        orch = make_orchestrator(agents=[scripted("worker", ["k"])])
        _, _, rec = await run_recorded(orch, [make_task("k"), make_task("k")])
        assert [type(e).__name__ for e in rec.events[:3]] == [
            "RunStarted",
            "TaskReady",
            "TaskReady",
        ]

    async def test_a_typed_subscription_gets_only_its_types(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        flaky = scripted("flaky", ["k"], fail_first=1)
        orch = make_orchestrator(agents=[flaky], retry=RetryPolicy(base=0.1))
        rec = Recorder()
        orch.subscribe(rec, RetryScheduled, TaskFinished)
        await orch.run(tasks=[make_task("k"), make_task("k")])
        assert sorted(type(e).__name__ for e in rec.events) == [
            "RetryScheduled",
            "TaskFinished",
            "TaskFinished",
        ]

    async def test_async_subscribers_see_every_event(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        seen: list[str] = []

        async def slow_hook(event: Event) -> None:
            await anyio.sleep(0.5)
            seen.append(type(event).__name__)

        flaky = scripted("flaky", ["k"], fail_first=1, latency=1)
        orch = make_orchestrator(agents=[flaky], retry=RetryPolicy(base=0.1))
        orch.subscribe(slow_hook, AttemptStarted, AttemptFailed, TaskFinished)
        result = await orch.run(tasks=[make_task("k")])
        assert result.status == "success"
        assert seen == ["AttemptStarted", "AttemptFailed", "AttemptStarted", "TaskFinished"]
        assert result.metadata.events_dropped == 0

    async def test_a_raising_hook_does_not_break_the_run(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        calls: list[Event] = []

        def broken_hook(event: Event) -> None:
            calls.append(event)
            raise RuntimeError("hook bug")

        flaky = scripted("flaky", ["k"], fail_first=1)
        orch = make_orchestrator(agents=[flaky], retry=RetryPolicy(base=0.1))
        orch.subscribe(broken_hook, AttemptFailed, FallbackUsed, TaskFinished)
        result = await orch.run(tasks=[make_task("k") for _ in range(3)])
        assert result.status == "success"
        assert len(calls) == 4  # one failure, three tasks done: the hook kept being called

    async def test_unsubscribing_stops_delivery(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        worker = scripted("worker", ["k"])
        orch = make_orchestrator(agents=[worker])
        rec = Recorder()
        unsubscribe = orch.subscribe(rec, TaskFinished)
        async with orch:
            await orch.run(tasks=[make_task("k")])
            unsubscribe()
            await orch.run(tasks=[make_task("k")])
        assert len(rec.of(TaskFinished)) == 1

    async def test_subscribing_leaves_no_unclosed_buffers(
        self, make_task: Callable[..., Task]
    ) -> None:
        # Each subscriber's buffer is closed when the orchestrator exits: no ResourceWarning (an
        # error under this suite's filterwarnings) when it is collected.
        orch = Orchestrator(agents=[scripted("worker", ["k"])])
        orch.subscribe(Recorder(), TaskFinished)
        await orch.run(tasks=[make_task("k")])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del orch
            gc.collect()
        leaked = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        assert leaked == []
