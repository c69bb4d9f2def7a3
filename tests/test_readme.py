"""The README's and docs/'s code blocks are tests: they run here exactly as printed.

Every ```python block is preceded by a comment that says how it is tested, invisible on the page:

- ``<!-- test: runs -->``: a script of its own, run in a fresh process;
- ``<!-- test: runs, printing the output below -->``: the same, and what it prints is the next
  ```text block (seconds aside: they vary from run to run);
- ``<!-- test: runs in main() after the whole run -->``: what a reader does with a later page's
  snippet: the agents, decomposer and contracts of concepts.md's whole run, then the snippet in an
  async function (its ``agents=[...]`` filled in with those agents);
- ``<!-- test: runs after the whole run -->``: the same at module level, with an `orch` built
  from them;
- ``<!-- test: runs under pytest, configured as above -->``: a test file, run by pytest with the
  ```toml block before it as its only configuration;
- ``<!-- test: compiled: why -->``: compiled only, because it needs what a test does not have
  (an API key, the reader's own agents).

Shell, JSON and text blocks are not run.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from tests.helpers import REPO, run_python

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]

BLOCK = re.compile(r"(?:<!-- test: (?P<how>.+?) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)```", re.S)
SECONDS = re.compile(r"in \d+\.\d\ds")


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    how: str | None
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> Iterator[Block]:
    text = page.read_text()
    for m in BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code"))
        yield Block(page, line, m.group("lang"), m.group("how"), m.group("code"))


def python_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.lang == "python"]


def whole_run() -> str:
    """concepts.md's whole run: its agents, decomposer and contracts (not its `main`)."""
    return snippet("concepts.md", "import asyncio").code.split("async def main", 1)[0]


def after_whole_run(block: Block) -> str:
    snippet = block.code.replace("agents=[...]", "agents=[splitter, researcher, writer]")
    if block.how == "runs after the whole run":
        orch = "orch = Orchestrator(agents=[splitter, researcher, writer], decomposer=decompose)\n"
        return f"{whole_run()}import orchestra\n{orch}{snippet}"
    body = "".join(f"    {line}\n" for line in snippet.splitlines())
    return f"{whole_run()}async def main() -> None:\n{body}\nasyncio.run(main())\n"


def run_script(code: str, tmp_path: Path, name: str) -> str:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    done = run_python(str(script), cwd=tmp_path, timeout=120)
    assert done.returncode == 0, f"{name}:\n{done.stderr[-3000:]}"
    return done.stdout


KNOWN = {
    "runs",
    "runs, printing the output below",
    "runs in main() after the whole run",
    "runs after the whole run",
    "runs under pytest, configured as above",
}


class TestEveryBlock:
    def test_every_python_block_says_how_it_is_tested(self) -> None:
        found = python_blocks()
        assert len(found) >= 15, [b.name for b in found]
        unmarked = [
            b.name
            for b in found
            if b.how is None or (b.how not in KNOWN and not b.how.startswith("compiled: "))
        ]
        assert not unmarked, f"python blocks with no test comment: {unmarked}"

    @pytest.mark.parametrize("block", python_blocks(), ids=lambda b: b.name)
    def test_the_block_compiles(self, block: Block) -> None:
        compile(block.code, block.name, "exec", flags=0x2000)  # PyCF_ALLOW_TOP_LEVEL_AWAIT

    @pytest.mark.subprocess
    @pytest.mark.parametrize(
        "block",
        [b for b in python_blocks() if b.how in ("runs", "runs, printing the output below")],
        ids=lambda b: b.name,
    )
    def test_the_script_runs(self, block: Block, tmp_path: Path) -> None:
        out = run_script(block.code, tmp_path, block.name)
        if block.how == "runs, printing the output below":
            text = block.page.read_text()[block.page.read_text().index(block.code) :]
            printed = text.split("```text\n", 1)[1].split("```", 1)[0]
            assert SECONDS.sub("in _s", out) == SECONDS.sub("in _s", printed), out

    @pytest.mark.subprocess
    @pytest.mark.parametrize(
        "block",
        [b for b in python_blocks() if b.how is not None and "after the whole run" in b.how],
        ids=lambda b: b.name,
    )
    def test_the_snippet_runs_on_the_whole_runs_definitions(
        self, block: Block, tmp_path: Path
    ) -> None:
        run_script(after_whole_run(block), tmp_path, block.name)


def snippet(page: str, start: str) -> Block:
    (found,) = [b for b in blocks(REPO / "docs" / page) if b.code.startswith(start)]
    return found


class TestWhatTheBlocksDo:
    @pytest.mark.subprocess
    def test_the_whole_run_succeeds_and_prints_its_data(self, tmp_path: Path) -> None:
        out = run_script(snippet("concepts.md", "import asyncio").code, tmp_path, "concepts.md")
        assert "success" in out.splitlines()
        assert "{'c1': 2, 'c1/c0': {'clause': 'pay within 30 days', 'risk': 'low'}" in out

    @pytest.mark.subprocess
    def test_the_control_and_durable_snippets_end_as_they_say(self, tmp_path: Path) -> None:
        checks = {
            "control.md": ("async with", "    print(handle.done, result.status)\n", "True failed"),
            "durable.md": (
                "from orchestra.stores",
                "    print(result.status, result.metadata.resumed)\n",
                "success 7",
            ),
        }
        for page, (start, check, expected) in checks.items():
            code = after_whole_run(snippet(page, start)).replace(
                "\nasyncio.run(main())", f"{check}asyncio.run(main())"
            )
            last = run_script(code, tmp_path, page).splitlines()[-1]
            # The control snippet cancels the summaries (the run fails); the durable one resumes
            # a finished run: all 7 tasks come back from the file.
            assert last == expected

    def test_the_fault_kit_example_passes(self) -> None:
        namespace: dict[str, Any] = {}
        code = snippet("testing.md", "import anyio").code
        exec(compile(code, "testing.md", "exec"), namespace)
        tests = [v for k, v in namespace.items() if k.startswith("test_") and callable(v)]
        assert len(tests) == 1
        asyncio.run(tests[0]())

    @pytest.mark.subprocess
    def test_the_fault_kit_example_passes_under_pytest_as_configured_there(
        self, tmp_path: Path
    ) -> None:
        """With only the configuration the page gives (pytest-asyncio, auto mode)."""
        page = REPO / "docs" / "testing.md"
        assert "pytest-asyncio" in page.read_text()
        (toml,) = [b.code for b in blocks(page) if b.lang == "toml"]
        (tmp_path / "pyproject.toml").write_text(toml)
        (tmp_path / "test_example.py").write_text(snippet("testing.md", "import anyio").code)
        done = run_python("-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=tmp_path, timeout=120)
        assert done.returncode == 0, done.stdout[-3000:]
        assert "1 passed" in done.stdout

    def test_the_logging_examples_print_nothing_to_stdout(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        import logging

        import orchestra

        root = logging.getLogger("orchestra")
        saved = (list(root.handlers), root.level, root.propagate)
        agent_logger = logging.getLogger("orchestra.agent")
        try:
            for start in ("import logging", "import orchestra"):
                code = snippet("observability.md", start).code
                code = code.replace("logging.basicConfig(", "dict(")
                exec(compile(code, "observability.md", "exec"), {"orchestra": orchestra})
        finally:
            root.handlers[:], root.level, root.propagate = saved[0], saved[1], saved[2]
            agent_logger.disabled = False
        assert capsys.readouterr().out == ""
