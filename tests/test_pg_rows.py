"""Rows of the PostgreSQL store read back into values (no server needed)."""

from __future__ import annotations

import json

import pytest

from orchestra.stores._postgres._rows import parsed


class TestAnOutputsJsonText:
    @pytest.mark.parametrize(
        "text",
        [
            "null", "5", "-0", "1.0", "1e400", "0.1", "123456789012345678901234567890",
            '"h\\u00e9llo \\ud83d\\ude00"', '{"a": 1, "b": [1.5e-7, true], "a": 2}',
            '"\\ud800"',  # a lone surrogate's escape: PostgreSQL's json keeps it
            "[" * 300 + "]" * 300,  # deeper than pydantic-core's parser goes
        ],
        ids=[
            "null", "int", "minus zero", "float", "overflow", "tenth", "big int", "escapes",
            "repeated key", "lone surrogate", "deep",
        ],
    )  # fmt: skip
    def test_is_read_as_json_reads_it(self, text: str) -> None:
        value, expected = parsed(text), json.loads(text)
        assert value == expected
        assert repr(value) == repr(expected)  # (the same types: 1.0 stays a float)
