"""The README's fault-kit example is a test: it runs here exactly as printed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parent.parent / "README.md"


def fault_kit_example() -> str:
    text = README.read_text()
    section = text[text.index("## Testing with the fault kit") :]
    return section.split("```python", 1)[1].split("```", 1)[0]


class TestReadme:
    def test_the_fault_kit_example_passes(self) -> None:
        namespace: dict[str, Any] = {}
        exec(compile(fault_kit_example(), str(README), "exec"), namespace)
        tests = [v for k, v in namespace.items() if k.startswith("test_") and callable(v)]
        assert len(tests) == 1
        asyncio.run(tests[0]())
