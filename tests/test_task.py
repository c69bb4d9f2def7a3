"""Tasks, generated ids, typed payloads and task results."""

from __future__ import annotations

import enum
import re
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from pydantic import BaseModel

from orchestra import (
    Context,
    InputError,
    Orchestrator,
    RetryPolicy,
    Task,
    TaskResult,
    agent,
)
from orchestra.testing import FakeClock, scripted

if TYPE_CHECKING:
    from collections.abc import Callable


class Clause(BaseModel):
    text: str
    weight: int = 1


def echo(kind: str = "work") -> Any:
    @agent(kinds=[kind], name=f"echo-{kind}")
    async def echo_agent(task: Task, ctx: Context) -> Any:
        return task.payload

    return echo_agent


class TestTaskConstruction:
    def test_defaults(self) -> None:
        task = Task("research")
        assert task.kind == "research"
        assert task.payload is None
        assert task.priority == 0
        assert tuple(task.depends_on) == ()
        assert tuple(task.depends_on_tags) == ()
        assert tuple(task.tags) == ()
        assert task.key is None
        assert task.timeout is None
        assert task.critical is False
        assert task.metadata is None
        assert task.id is None  # given at admission (typed `str`: last, as mypy knows no better)

    def test_every_field_is_kept(self) -> None:
        task = Task(
            "summarize",
            {"text": "x"},
            id="s1",
            priority=-2,
            depends_on=["a"],
            depends_on_tags=["g"],
            tags=["h"],
            key="k-1",
            timeout=2.5,
            critical=True,
            metadata={"source": "upload"},
        )
        assert (task.kind, task.payload, task.id, task.priority) == (
            "summarize",
            {"text": "x"},
            "s1",
            -2,
        )
        assert list(task.depends_on) == ["a"]
        assert list(task.depends_on_tags) == ["g"]
        assert list(task.tags) == ["h"]
        assert (task.key, task.timeout, task.critical) == ("k-1", 2.5, True)
        assert task.metadata == {"source": "upload"}

    def test_options_are_keyword_only(self) -> None:
        with pytest.raises(TypeError):
            Task("work", None, "an-id")  # type: ignore[call-arg]

    def test_repr_names_id_kind_and_priority(self) -> None:
        text = repr(Task("work", 1, id="t9", priority=3))
        assert "t9" in text
        assert "work" in text
        assert "3" in text

    async def test_agent_receives_the_task_with_its_metadata_untouched(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        seen: list[Task] = []

        @agent(kinds=["work"])
        async def look(task: Task, ctx: Context) -> None:
            seen.append(task)

        meta = {"trace": [1, 2]}
        task = Task("work", "p", id="only", metadata=meta, key="idem-1")
        result = await make_orchestrator(agents=[look]).run(tasks=[task])
        assert result.status == "success"
        assert seen == [task]
        assert seen[0].metadata is meta
        assert meta == {"trace": [1, 2]}
        assert seen[0].key == "idem-1"


class TestStrEnumKinds:
    @pytest.mark.parametrize("named", [True, False], ids=["named", "plain"])
    async def test_a_str_enum_kind_is_its_string(
        self, named: bool, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        # `@agent(kinds=[Kind.WORK])` took it; a task of that kind was refused: "no agent serves
        # kind <Kind.WORK: 'work'> (kinds served: work)".
        class Kind(enum.StrEnum):
            WORK = "work"

        result = await make_orchestrator(agents=[echo(Kind.WORK)]).run(
            tasks=[Task(Kind.WORK, 1, id="a" if named else None)]
        )
        assert result.data == {"a" if named else "work#1": 1}
        assert result.metadata.counts_by_kind == {"work": {"succeeded": 1}}
        assert all(type(k) is str for k in result.metadata.counts_by_kind)


class TestGeneratedIds:
    async def test_ids_are_kind_hash_number_in_admission_order(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        tasks = [Task("work", i) for i in range(5)]
        result = await make_orchestrator(agents=[echo()]).run(tasks=tasks)
        ids = [t.id for t in tasks]
        assert all(isinstance(i, str) and re.fullmatch(r"work#\d+", i) for i in ids)
        numbers = [int(str(i).split("#")[1]) for i in ids]
        assert numbers == sorted(numbers)
        assert len(set(ids)) == 5
        assert list(result.data) == ids
        assert list(result.data.values()) == [0, 1, 2, 3, 4]

    async def test_each_kind_gets_its_own_prefix(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        tasks = [Task("a", 1), Task("b", 2), Task("a", 3)]
        await make_orchestrator(agents=[echo("a"), echo("b")]).run(tasks=tasks)
        assert [str(t.id).split("#")[0] for t in tasks] == ["a", "b", "a"]
        assert len({t.id for t in tasks}) == 3

    async def test_given_ids_are_kept(self, make_orchestrator: Callable[..., Orchestrator]) -> None:
        tasks = [Task("work", 1, id="mine"), Task("work", 2)]
        result = await make_orchestrator(agents=[echo()]).run(tasks=tasks)
        assert tasks[0].id == "mine"
        assert set(result.data) == {"mine", tasks[1].id}

    async def test_a_generated_id_never_collides_with_a_given_one(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        # The user named a task "work#1"; the anonymous task must get another id, not fail the run
        # with a duplicate id the user never wrote.
        tasks = [Task("work", "named", id="work#1"), Task("work", "anonymous")]
        result = await make_orchestrator(agents=[echo()]).run(tasks=tasks)
        assert result.status == "success"
        assert tasks[1].id != "work#1"
        assert sorted(result.data.values()) == ["anonymous", "named"]


class TestTypedPayloads:
    async def test_payload_is_converted_to_the_declared_model(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        received: list[Any] = []

        @agent(kinds=["clause"], input=Clause)
        async def read(task: Task, ctx: Context) -> int:
            received.append(task.payload)
            payload: Clause = task.payload
            return len(payload.text) * payload.weight

        result = await make_orchestrator(agents=[read]).run(
            tasks=[Task("clause", {"text": "abc", "weight": 2}, id="c1")]
        )
        assert result.data == {"c1": 6}
        assert received == [Clause(text="abc", weight=2)]
        assert isinstance(received[0], Clause)

    async def test_a_model_instance_is_accepted_as_is(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        @agent(kinds=["clause"], input=Clause)
        async def read(task: Task, ctx: Context) -> str:
            payload: Clause = task.payload
            return payload.text

        result = await make_orchestrator(agents=[read]).run(
            tasks=[Task("clause", Clause(text="t"), id="c1")]
        )
        assert result.data == {"c1": "t"}

    @pytest.mark.parametrize(
        ("payload", "field"),
        [
            ({"weight": 1}, "payload.text"),
            ({"text": "ok", "weight": "heavy"}, "payload.weight"),
        ],
    )
    async def test_bad_payload_raises_input_error_naming_task_and_field_before_any_work(
        self, make_orchestrator: Callable[..., Orchestrator], payload: Any, field: str
    ) -> None:
        calls: list[str] = []

        @agent(kinds=["clause"], input=Clause)
        async def read(task: Task, ctx: Context) -> None:
            calls.append(str(task.id))

        tasks = [Task("clause", {"text": "fine"}, id="good"), Task("clause", payload, id="bad-7")]
        with pytest.raises(InputError) as info:
            await make_orchestrator(agents=[read]).run(tasks=tasks)
        assert info.value.task_id == "bad-7"
        assert info.value.field == field
        assert "bad-7" in str(info.value)
        assert field.split(".")[-1] in str(info.value)
        assert calls == []

    async def test_spawned_payloads_are_validated_too(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        @agent(kinds=["clause"], input=Clause)
        async def read(task: Task, ctx: Context) -> str:
            payload: Clause = task.payload
            return payload.text

        @agent(kinds=["split"])
        async def split(task: Task, ctx: Context) -> None:
            ctx.spawn(Task("clause", {"weight": 3}, id="spawned-bad"))

        orch = make_orchestrator(agents=[read, split])
        result = await orch.run(tasks=[Task("split", None, id="s")])
        assert result.status == "failed"
        error = result.error_for("s")
        assert error is not None
        assert error.error_type == "InputError"
        assert "spawned-bad" in error.message
        assert "text" in error.message
        assert result.error_for("spawned-bad") is None  # never admitted


class TestTaskResult:
    async def test_a_succeeded_result_has_every_field(self, clock: FakeClock) -> None:
        @agent(kinds=["work"], name="w")
        async def worker(task: Task, ctx: Context) -> int:
            await anyio.sleep(0.5)
            return int(task.payload) * 2

        results: list[TaskResult] = []
        orch = Orchestrator(agents=[worker])
        async with orch, orch.stream(tasks=[Task("work", 21, id="x")]) as stream:
            async for item in stream:
                results.append(item)
        [res] = results
        assert res.task_id == "x"
        assert res.kind == "work"
        assert res.status == "succeeded"
        assert res.ok
        assert res.output == 42
        assert res.agent == "w"
        assert res.attempts == 1
        assert not res.failures
        assert res.started is not None
        assert res.finished - res.started == pytest.approx(0.5)
        assert res.duration == pytest.approx(0.5)

    async def test_a_failed_result_lists_its_failed_attempts(self, clock: FakeClock) -> None:
        worker = scripted("w", ["work"], then="error", latency=0.1)
        results: list[TaskResult] = []
        async with (
            Orchestrator(
                agents=[worker], retry=RetryPolicy(max_attempts=2, base=0.0), seed=3
            ) as orch,
            orch.stream(tasks=[Task("work", None, id="x")]) as stream,
        ):
            async for item in stream:
                results.append(item)
        [res] = results
        assert res.status == "failed"
        assert not res.ok
        assert res.output is None
        assert res.attempts == 2
        assert res.failures is not None
        assert [f.number for f in res.failures] == [1, 2]
        assert {f.agent for f in res.failures} == {"w"}
        assert {f.error_type for f in res.failures} == {"ConnectionError"}

    async def test_a_skipped_task_never_started(self, clock: FakeClock) -> None:
        worker = scripted("w", ["work"], script=["permanent"])
        results: dict[str, TaskResult] = {}
        async with Orchestrator(agents=[worker]) as orch:
            tasks = [Task("work", None, id="a"), Task("work", None, id="b", depends_on=["a"])]
            async with orch.stream(tasks=tasks) as stream:
                async for item in stream:
                    results[item.task_id] = item
        assert results["a"].status == "failed"
        assert results["b"].status == "skipped"
        assert results["b"].started is None
        assert results["b"].duration is None
        assert results["b"].attempts == 0
