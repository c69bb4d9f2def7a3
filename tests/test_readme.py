"""The README's examples are tests: they run here exactly as printed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_python

README = Path(__file__).resolve().parent.parent / "README.md"


def section(title: str) -> str:
    text = README.read_text()
    return text[text.index(f"## {title}") :].split("\n## ", 1)[0]


def block(text: str, language: str) -> str:
    return text.split(f"```{language}\n", 1)[1].split("```", 1)[0]


class TestReadme:
    @pytest.mark.subprocess
    def test_the_quick_start_runs_as_printed(self, tmp_path: Path) -> None:
        text = README.read_text()
        (tmp_path / "quickstart.py").write_text(block(text, "python"))
        done = run_python(str(tmp_path / "quickstart.py"), cwd=tmp_path, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = done.stdout.splitlines()
        assert "success" in lines
        assert "{'c1': 2, 'c1/c0': {'clause': 'pay within 30 days', 'risk': 'low'}" in done.stdout

    @pytest.mark.subprocess
    def test_the_control_and_durable_snippets_run_on_the_quick_starts_definitions(
        self, tmp_path: Path
    ) -> None:
        """What a reader does: the quick start's agents, decomposer and contracts, then a later
        section's snippet (in an async function, its `agents=[...]` filled in)."""
        definitions = block(README.read_text(), "python").split("async def main", 1)[0]
        control = block(section("Controlling a run"), "python")
        durable = block(section("Durable runs (SQLite)"), "python").replace(
            "agents=[...]", "agents=[splitter, researcher, writer]"
        )
        checks = {
            "control": "    print(handle.done, result.status)\n",
            "durable": "    print(result.status, result.metadata.resumed)\n",
        }
        for name, snippet in (("control", control), ("durable", durable)):
            body = "".join(f"    {line}\n" for line in snippet.splitlines())
            script = tmp_path / f"{name}.py"
            script.write_text(
                f"{definitions}async def main() -> None:\n{body}{checks[name]}asyncio.run(main())\n"
            )
            done = run_python(str(script), cwd=tmp_path, timeout=120)
            assert done.returncode == 0, done.stderr[-3000:]
            last = done.stdout.splitlines()[-1]
            # The control snippet cancels the summaries (the run fails); the durable one resumes
            # a finished run: all 7 tasks come back from the file.
            assert last == {"control": "True failed", "durable": "success 7"}[name], done.stdout

    def test_the_fault_kit_example_passes(self) -> None:
        namespace: dict[str, Any] = {}
        code = block(section("Testing with the fault kit"), "python")
        exec(compile(code, str(README), "exec"), namespace)
        tests = [v for k, v in namespace.items() if k.startswith("test_") and callable(v)]
        assert len(tests) == 1
        asyncio.run(tests[0]())

    @pytest.mark.subprocess
    def test_the_fault_kit_example_passes_under_pytest_as_configured_there(
        self, tmp_path: Path
    ) -> None:
        """With only the configuration the README gives (pytest-asyncio, auto mode)."""
        text = section("Testing with the fault kit")
        assert "pytest-asyncio" in text
        (tmp_path / "pyproject.toml").write_text(block(text, "toml"))
        (tmp_path / "test_example.py").write_text(block(text, "python"))
        done = run_python("-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=tmp_path, timeout=120)
        assert done.returncode == 0, done.stdout[-3000:]
        assert "1 passed" in done.stdout

    def test_the_logging_examples_run(self, capsys: pytest.CaptureFixture[str]) -> None:
        import logging

        import orchestra

        root = logging.getLogger("orchestra")
        saved = (list(root.handlers), root.level, root.propagate)
        agent_logger = logging.getLogger("orchestra.agent")
        try:
            for code in section("Logging").split("```python\n")[1:]:
                code = code.split("```", 1)[0].replace("logging.basicConfig(", "dict(")
                exec(compile(code, str(README), "exec"), {"orchestra": orchestra})
        finally:
            root.handlers[:], root.level, root.propagate = saved[0], saved[1], saved[2]
            agent_logger.disabled = False
        assert capsys.readouterr().out == ""
