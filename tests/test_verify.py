"""Verifiers, declared output models and the safety check.

A failed check is a retryable failure whose feedback reaches the next attempt in `ctx.feedback`; an
agent's `output=` model rejects garbage the same way; `safety=` refuses a task before dispatch
(permanent, not retried, error_type "Rejected")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pydantic
import pytest

from orchestra import ConfigError, Context, RetryPolicy, Task, Verdict, agent
from orchestra.events import AttemptStarted, RetryScheduled
from orchestra.testing import GARBAGE, Recorder, scripted
from tests.helpers import run_recorded

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from orchestra import Agent, Orchestrator

pytestmark = pytest.mark.usefixtures("clock")


class Summary(pydantic.BaseModel):
    title: str
    words: int


class Writer:
    """An agent that writes draft n on attempt n and remembers the feedback it was given."""

    def __init__(self, name: str = "writer", kinds: Sequence[str] = ("summarize",)) -> None:
        self.name = name
        self.kinds = tuple(kinds)
        self.feedback_seen: list[list[str]] = []
        self.calls: list[str] = []

    async def __call__(self, task: Task, ctx: Context) -> dict[str, Any]:
        self.calls.append(task.id or "")
        self.feedback_seen.append(list(ctx.feedback))
        return {"task": task.id, "draft": ctx.attempt}


def drafts_from(n: int) -> Callable[[Task, Any], bool]:
    """A sync verifier accepting drafts n and later."""

    def check(task: Task, output: Any) -> bool:
        return bool(output["draft"] >= n)

    return check


class TestVerifier:
    async def test_a_failed_check_is_retried(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        writer = Writer()
        orch = make_orchestrator(
            agents=[writer], verify={"summarize": drafts_from(2)}, retry=RetryPolicy(base=0.1)
        )
        result, done, rec = await run_recorded(orch, [make_task("summarize", id="s")])
        assert result.status == "success"
        assert result.data == {"s": {"task": "s", "draft": 2}}
        assert done["s"].attempts == 2
        failures = done["s"].failures
        assert failures is not None
        assert [a.error_type for a in failures] == ["VerificationError"]
        assert len(rec.of(RetryScheduled)) == 1

    async def test_feedback_reaches_the_next_attempt(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        async def check(task: Task, output: Any) -> Verdict:
            if output["draft"] == 1:
                return Verdict(False, "cite a source")
            if output["draft"] == 2:
                return Verdict.fail("too long: 300 words max")
            return Verdict.ok()

        writer = Writer()
        orch = make_orchestrator(
            agents=[writer], verify={"summarize": check}, retry=RetryPolicy(base=0.1)
        )
        result, _, _ = await run_recorded(orch, [make_task("summarize")])
        assert result.status == "success"
        assert writer.feedback_seen == [
            [],
            ["cite a source"],
            ["cite a source", "too long: 300 words max"],
        ]

    @pytest.mark.parametrize("verdict", [True, None, Verdict(True), Verdict.ok()])
    async def test_passing_verdicts(
        self,
        make_orchestrator: Callable[..., Orchestrator],
        make_task: Callable[..., Task],
        verdict: Any,
    ) -> None:
        writer = Writer()
        orch = make_orchestrator(agents=[writer], verify={"summarize": lambda t, o: verdict})
        result, _, _ = await run_recorded(orch, [make_task("summarize")])
        assert result.status == "success"
        assert len(writer.calls) == 1

    async def test_the_next_agent_of_the_chain_gets_the_feedback_too(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        sloppy = Writer("sloppy")
        careful = Writer("careful")

        def check(task: Task, output: Any) -> Verdict:
            return Verdict(output["draft"] >= 3, f"draft {output['draft']} is vague")

        orch = make_orchestrator(
            agents=[sloppy, careful],
            fallbacks={"summarize": ["sloppy", "careful"]},
            verify={"summarize": check},
            retry=RetryPolicy(max_attempts=2, base=0.1),
        )
        result, done, _ = await run_recorded(orch, [make_task("summarize", id="s")])
        assert result.status == "success"
        assert done["s"].agent == "careful"
        assert careful.feedback_seen == [["draft 1 is vague", "draft 2 is vague"]]

    async def test_an_always_rejected_task_fails_and_keeps_its_last_output(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        writer = Writer()
        orch = make_orchestrator(
            agents=[writer],
            verify={"summarize": lambda t, o: Verdict(False, "no")},
            retry=RetryPolicy(max_attempts=3, base=0.1),
        )
        result, _, _ = await run_recorded(orch, [make_task("summarize", id="s")])
        assert result.status == "failed"
        assert len(writer.calls) == 3
        record = result.error_for("s")
        assert record is not None
        assert record.error_type == "VerificationError"
        assert record.partial_output == {"task": "s", "draft": 3}
        assert "verif" in record.remediation.lower()

    async def test_a_verifier_judges_only_its_kind(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        writer = Writer(kinds=["summarize", "draft"])
        orch = make_orchestrator(agents=[writer], verify={"summarize": drafts_from(2)})
        result, done, _ = await run_recorded(
            orch, [make_task("summarize", id="s"), make_task("draft", id="d")]
        )
        assert result.status == "success"
        assert (done["s"].attempts, done["d"].attempts) == (2, 1)

    def test_a_verifier_for_an_unserved_kind_is_refused(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        with pytest.raises(ConfigError, match="summarise"):
            make_orchestrator(agents=[Writer()], verify={"summarise": drafts_from(1)})


def summarizer(outputs: Sequence[Any]) -> Agent:
    """An agent declaring `output=Summary` that returns `outputs` in turn (the last one after)."""
    queue = list(outputs)
    seen: list[list[str]] = []

    @agent(kinds=["summarize"], output=Summary)
    async def summarize(task: Task, ctx: Context) -> Any:
        seen.append(list(ctx.feedback))
        return queue.pop(0) if len(queue) > 1 else queue[0]

    summarize.fn.seen = seen  # type: ignore[attr-defined]
    return summarize


class TestOutputModel:
    async def test_garbage_is_rejected_and_retried(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        good = {"title": "Q3", "words": 120}
        summarize = summarizer([GARBAGE, {"title": "Q3"}, good])
        orch = make_orchestrator(agents=[summarize], retry=RetryPolicy(base=0.1))
        result, done, _ = await run_recorded(orch, [make_task("summarize", id="s")])
        assert result.status == "success"
        assert result.data["s"] == Summary(title="Q3", words=120)
        failures = done["s"].failures
        assert failures is not None
        assert [a.error_type for a in failures] == ["VerificationError", "VerificationError"]
        seen: list[list[str]] = summarize.fn.seen  # type: ignore[attr-defined]
        assert seen[0] == []
        assert "Summary" in seen[1][0]  # the next attempt learns what was wrong
        assert "words" in seen[2][1]

    async def test_persistent_garbage_fails_with_the_garbage_kept(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        summarize = summarizer([{"wrong": "shape"}])
        orch = make_orchestrator(agents=[summarize], retry=RetryPolicy(max_attempts=2, base=0.1))
        result, _, _ = await run_recorded(orch, [make_task("summarize", id="s")])
        assert result.status == "failed"
        record = result.error_for("s")
        assert record is not None
        assert record.error_type == "VerificationError"
        assert record.partial_output == {"wrong": "shape"}

    async def test_the_verifier_sees_the_validated_model(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        judged: list[Any] = []

        def check(task: Task, output: Any) -> bool:
            judged.append(output)
            return True

        summarize = summarizer([{"title": "Q3", "words": "120"}])
        orch = make_orchestrator(agents=[summarize], verify={"summarize": check})
        result, _, _ = await run_recorded(orch, [make_task("summarize")])
        assert result.status == "success"
        assert judged == [Summary(title="Q3", words=120)]


class TestSafety:
    async def test_a_refused_task_is_never_dispatched_nor_retried(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        first = scripted("first", ["k"])
        second = scripted("second", ["k"])

        def safety(task: Task) -> Verdict:
            if "ssn" in task.payload:
                return Verdict(False, "contains PII")
            return Verdict.ok()

        orch = make_orchestrator(
            agents=[first, second],
            fallbacks={"k": ["first", "second"]},
            safety=safety,
            retry=RetryPolicy(max_attempts=5),
        )
        result, done, rec = await run_recorded(
            orch,
            [make_task("k", "ssn 123-45-6789", id="bad"), make_task("k", "weather", id="ok")],
        )
        assert [c.task_id for c in first.calls] == ["ok"]
        assert second.calls == []  # no fallback either
        assert rec.of(RetryScheduled) == []
        assert done["bad"].status == "failed"
        assert done["bad"].error_type == "Rejected"
        record = result.error_for("bad")
        assert record is not None
        assert record.error_type == "Rejected"
        assert "contains PII" in record.message
        assert "safety" in record.remediation.lower()
        assert done["ok"].ok

    async def test_a_refused_task_never_counts_as_an_attempt_on_an_agent(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        # "before dispatch": no agent was called, so none shows an attempt, a start event or a
        # failure in its status.
        worker = scripted("worker", ["k"])
        orch = make_orchestrator(agents=[worker], safety=lambda task: False)
        rec = Recorder()
        orch.subscribe(rec, AttemptStarted)
        async with orch:
            result = await orch.run(tasks=[make_task("k", id="t")])
            status = orch.agents_status()[0]
        assert result.status == "failed"
        assert rec.of(AttemptStarted) == []
        assert (status["attempts"], status["failures"]) == (0, 0)
        assert result.metadata.attempts == 0

    async def test_an_async_check_returning_false(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        async def safety(task: Task) -> bool:
            return bool(task.payload != "forbidden")

        worker = scripted("worker", ["k"])
        orch = make_orchestrator(agents=[worker], safety=safety)
        result, done, _ = await run_recorded(
            orch, [make_task("k", "forbidden", id="no"), make_task("k", "fine", id="yes")]
        )
        assert result.metadata.counts["failed"] == 1
        assert done["no"].error_type == "Rejected"
        assert [c.task_id for c in worker.calls] == ["yes"]

    async def test_the_check_runs_once_per_task_whatever_its_retries(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        checked: list[str] = []

        def safety(task: Task) -> bool:
            checked.append(task.id or "")
            return True

        flaky = scripted("flaky", ["k"], fail_first=2)
        orch = make_orchestrator(agents=[flaky], safety=safety, retry=RetryPolicy(base=0.1))
        result, _, _ = await run_recorded(orch, [make_task("k", id="t")])
        assert result.status == "success"
        assert len(flaky.calls) == 3
        assert checked == ["t"]

    async def test_a_check_that_raises_never_lets_the_task_through_unchecked(
        self, make_orchestrator: Callable[..., Orchestrator], make_task: Callable[..., Task]
    ) -> None:
        # A moderation service that is down must not turn into "approved" on the retry.
        def safety(task: Task) -> bool:
            raise ConnectionError("moderation service unreachable")

        worker = scripted("worker", ["k"])
        orch = make_orchestrator(agents=[worker], safety=safety, retry=RetryPolicy(base=0.1))
        result, _, _ = await run_recorded(orch, [make_task("k", "ssn 123-45-6789", id="t")])
        assert worker.calls == []
        assert result.status == "failed"
