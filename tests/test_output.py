"""Outputs are the agent's: a `RunResult` dumps whatever its outputs are (what JSON cannot hold as
its repr, an iterator unread), and a store that keeps outputs as JSON refuses what it cannot keep,
naming the type."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pydantic
import pytest

from orchestra import InvalidOutput, RunResult
from orchestra._output import json_value, jsonable, stored_json
from orchestra.result import RunMetadata


class Answer(pydantic.BaseModel):
    title: str


class Loose(pydantic.BaseModel):
    anything: Any


class BrokenRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def circular() -> list[Any]:
    items: list[Any] = []
    items.append(items)
    return items


def result_of(data: Any) -> RunResult:
    now = datetime.now(UTC)
    metadata = RunMetadata(
        run_id="r", started_at=now, finished_at=now, elapsed=0.0, total=1, counts={},
        counts_by_kind={}, success_rate=1.0, success_threshold=0.8, attempts=1, retries=0,
        fallbacks=0, agents_used=[], tasks_per_agent={}, time_per_kind={}, peak_concurrency=1,
    )  # fmt: skip
    return RunResult(status="success", data=data, metadata=metadata)


JSON: list[tuple[str, Any, Any]] = [
    ("str", "text", "text"),
    ("int", 3, 3),
    ("nan", float("nan"), None),
    ("None", None, None),
    ("dict", {"a": [1, 2, {"b": None}]}, {"a": [1, 2, {"b": None}]}),
    ("tuple-keys", {(1, 2): "x"}, {"1,2": "x"}),
    ("set", {1, 2}, [1, 2]),
    ("model", Answer(title="Q3"), {"title": "Q3"}),
    ("datetime", datetime(2024, 1, 1, tzinfo=UTC), "2024-01-01T00:00:00Z"),
    ("bytes", b"utf-8 text", "utf-8 text"),
]

NOT_JSON: list[tuple[str, Any, Any]] = [
    ("object", object(), "<object object at "),
    ("bad-bytes", b"\xff\xfe", "b'\\xff\\xfe'"),
    ("circular", circular(), ["[[...]]"]),
    ("frozenset-key", {frozenset(): 1}, {"frozenset()": 1}),
    ("model-with-object", Loose(anything=object()), {"anything": "<object object at "}),
    ("a-class", int, "<class 'int'>"),
    ("nested-object", {"ok": 1, "bad": [object()]}, {"ok": 1, "bad": ["<object object at "]}),
    ("map", map(str, [1]), "<map object at "),
    ("generator", (i for i in [1]), "<generator object "),
    ("nested-iterator", {"names": iter(["a"])}, {"names": "<list_iterator object at "}),
    ("broken-repr", BrokenRepr(), "<tests.test_output.BrokenRepr object (its repr failed)>"),
]


def like(dumped: Any, expected: Any) -> bool:
    """`dumped` equals `expected`, where a string in `expected` ending in "at " or "object " is
    the start of a repr with an address."""
    if isinstance(expected, str) and expected.endswith(("at ", "object ")):
        return isinstance(dumped, str) and dumped.startswith(expected)
    if isinstance(expected, dict):
        return dumped.keys() == expected.keys() and all(
            like(dumped[k], expected[k]) for k in dumped
        )
    if isinstance(expected, list):
        return len(dumped) == len(expected) and all(map(like, dumped, expected))
    return bool(dumped == expected)


class TestARunResultDumpsWhateverItsOutputsAre:
    @pytest.mark.parametrize(
        ("output", "expected"), [o[1:] for o in JSON], ids=[o[0] for o in JSON]
    )
    def test_a_json_value_is_written_as_pydantic_writes_it(
        self, output: Any, expected: Any
    ) -> None:
        assert json.loads(result_of({"t": output}).model_dump_json())["data"] == {"t": expected}

    @pytest.mark.parametrize(
        ("output", "expected"), [o[1:] for o in NOT_JSON], ids=[o[0] for o in NOT_JSON]
    )
    def test_what_json_cannot_hold_is_written_as_its_repr(self, output: Any, expected: Any) -> None:
        dumped = json.loads(result_of({"t": output}).model_dump_json())["data"]["t"]
        assert like(dumped, expected), dumped

    def test_an_iterator_is_never_read(self) -> None:
        names = map(str.upper, ["a", "b"])
        result = result_of({"t": {"names": names}})
        result.model_dump_json()
        result.model_dump_json()
        assert result.data["t"]["names"] is names
        assert list(names) == ["A", "B"]

    def test_the_outputs_themselves_are_left_as_they_are(self) -> None:
        data = {"t": [b"\xff", {"k": object()}]}
        before = repr(data)
        jsonable(data)
        assert repr(data) == before

    def test_json_values_still_round_trip(self) -> None:
        result = result_of({"t": {"a": [1, "x", None]}})
        assert RunResult.model_validate_json(result.model_dump_json()) == result


class TestAStoreKeepsOnlyWhatJsonHolds:
    @pytest.mark.parametrize(
        ("output", "expected"),
        [o[1:] for o in JSON if o[0] != "nan"],  # stored as NaN, which Python's JSON reads back
        ids=[o[0] for o in JSON if o[0] != "nan"],
    )
    def test_a_json_value_is_stored_as_pydantic_writes_it(self, output: Any, expected: Any) -> None:
        assert json.loads(stored_json(output, "t", "writer")) == expected

    @pytest.mark.parametrize("output", [o[1] for o in NOT_JSON], ids=[o[0] for o in NOT_JSON])
    def test_what_json_cannot_hold_is_refused_naming_the_task_agent_and_type(
        self, output: Any
    ) -> None:
        with pytest.raises(
            InvalidOutput,
            match=r"^task 't': agent 'writer' returned an? [\w.]+ that cannot be stored",
        ):
            stored_json(output, "t", "writer")

    def test_an_iterator_is_refused_unread_naming_it(self) -> None:
        names = map(str.upper, ["a"])
        with pytest.raises(
            InvalidOutput, match=r"returned a dict .*\(it holds a map: a map is an iterator"
        ):
            stored_json({"names": names}, "t", "writer")
        assert list(names) == ["A"]

    def test_a_dict_whose_keys_collide_as_json_keys_is_refused_naming_the_keys(self) -> None:
        # JSON object keys are strings: 1 and "1" would both become "1" and one value would be
        # lost without a word, on resume or in a worker's result.
        with pytest.raises(InvalidOutput, match=r"returned a dict .*keys 1 and '1'"):
            stored_json({"scores": {1: "a", "1": "b"}}, "t", "writer")
        assert json.loads(stored_json({1: "a", 2: "b"}, "t", "writer")) == {"1": "a", "2": "b"}


class TestStoredJsonReadsBackAsJsonLoadsReadsIt:
    @pytest.mark.parametrize(
        "text",
        [
            "null",
            "12345",
            "123456789012345678901234567890",
            "-0.0",
            "1E2",
            '"d\\u00e9j\\u00e0 vu"',
            '{"a": 1, "a": 2}',
            '[1, 2.0, "x", null, true, {"k": [false]}]',
            # a lone surrogate escape, which pydantic_core's parser refuses
            '"\\ud800"',
            '{"deep": ' + "[" * 300 + "]" * 300 + "}",
            "5", "-0", "1.0", "1e400", "0.1",
            '"h\\u00e9llo \\ud83d\\ude00"', '{"a": 1, "b": [1.5e-7, true], "a": 2}',
            "[" * 300 + "]" * 300,  # deeper than pydantic-core's parser goes
        ],
    )  # fmt: skip
    def test_the_value_and_its_types_are_json_loads_ones(self, text: str) -> None:
        value = json_value(text)
        assert value == json.loads(text)
        assert repr(value) == repr(json.loads(text))  # 1 and 1.0, -0.0 and 0.0 told apart

    def test_text_that_is_not_json_raises_a_value_error(self) -> None:
        with pytest.raises(ValueError):
            json_value("{'single': 'quotes'}")
