"""Batch jobs: JSONL lines checked once into tasks, results out as JSON lines."""

from __future__ import annotations

import io
import json

import pytest

from orchestra import Context, InputError, Orchestrator, Task, agent
from orchestra._cli._batch import Batch, read_batch, read_jsonl, tasks_of


@agent(kinds=["echo"])
async def echo(task: Task, ctx: Context) -> dict[str, object]:
    return {"payload": task.payload, "deps": dict(ctx.deps)}


class TestTasksOf:
    def test_every_field_of_a_task_is_read(self) -> None:
        line = {
            "kind": "echo",
            "payload": {"text": "x"},
            "id": "b",
            "priority": 3,
            "depends_on": ["a"],
            "depends_on_tags": ["g"],
            "tags": ["t"],
            "key": "k",
            "timeout": 2.5,
            "critical": True,
            "metadata": {"source": "crm"},
        }
        [task] = tasks_of([(1, line)])
        assert (task.kind, task.payload, task.id, task.priority) == ("echo", {"text": "x"}, "b", 3)
        assert (list(task.depends_on), list(task.depends_on_tags), list(task.tags)) == (
            ["a"],
            ["g"],
            ["t"],
        )
        assert (task.key, task.timeout, task.critical, task.metadata) == (
            "k",
            2.5,
            True,
            {"source": "crm"},
        )

    def test_a_bad_field_names_its_line_and_field(self) -> None:
        lines = read_jsonl(io.StringIO('{"kind": "echo"}\n\n{"kind": "echo", "timeout": -1}\n'))
        with pytest.raises(
            InputError, match=r"input, line 3: timeout: Input should be greater"
        ) as info:
            tasks_of(lines)
        assert info.value.field == "timeout"

    @pytest.mark.parametrize(
        ("text", "line"),
        [
            ('{"kind": "echo"}\n{"kind": "echo", "timeout": -1}\n{not json\n', "line 2: timeout"),
            ('{"kind": "echo"}\n{not json\n{"kind": "echo", "timeout": -1}\n', "line 2: not JSON"),
        ],
    )
    def test_the_first_bad_line_is_named_whatever_is_wrong_with_it(
        self, text: str, line: str
    ) -> None:
        with pytest.raises(InputError, match=f"input, {line}"):
            read_batch(Orchestrator(agents=[echo]), io.StringIO(text))


class TestBatch:
    async def test_dependencies_across_lines_and_one_json_line_per_result(self) -> None:
        lines = read_jsonl(
            io.StringIO(
                '{"kind": "echo", "payload": 1, "id": "a"}\n'
                '{"kind": "echo", "payload": 2, "id": "b", "depends_on": ["a"]}\n'
            )
        )
        out = io.StringIO()
        batch = Batch(Orchestrator(agents=[echo]), lines)
        result = await batch.run(out)
        assert result.status == "success"
        records = [json.loads(line) for line in out.getvalue().splitlines()]
        assert [r["task_id"] for r in records] == ["a", "b"]  # b waited for a
        assert records[1]["output"] == {"payload": 2, "deps": {"a": {"payload": 1, "deps": {}}}}
        assert batch.written == 2
