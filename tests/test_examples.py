"""The examples run end to end, as a user would run them."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

import pytest

from tests.helpers import REPO, run_python

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.subprocess


class TestQuickstart:
    def test_runs_and_shows_a_speed_up(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("ANTHROPIC_API_KEY", None)  # it must need no key
        done = run_python(str(REPO / "examples" / "quickstart.py"), cwd=REPO, env=env, timeout=90)
        assert done.returncode == 0, done.stderr[-3000:]
        match = re.search(r"speed-up:\s*([0-9]+(?:\.[0-9]+)?)x", done.stdout)
        assert match is not None, done.stdout[-3000:]
        assert float(match.group(1)) >= 2.0
        assert "Traceback" not in done.stderr


class TestLiveView:
    def test_runs_with_plain_lines_and_saves_the_screenshot(self, tmp_path: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        svg = tmp_path / "view.svg"
        done = run_python(
            str(REPO / "examples" / "live_view.py"),
            "--svg",
            str(svg),
            cwd=REPO,
            env=env,
            timeout=90,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert "status: partial" in done.stdout
        lines = [line for line in done.stderr.splitlines() if line.startswith("run ")]
        assert lines
        assert "100.0% 300/300" in lines[-1]
        text = svg.read_text()
        assert text.startswith("<svg")
        assert "agents" in text


class TestContracts:
    def test_runs_without_a_key_against_the_fake_api(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("ANTHROPIC_API_KEY", None)
        done = run_python(str(REPO / "examples" / "contracts.py"), cwd=REPO, env=env, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "ANTHROPIC_API_KEY is not set" in done.stderr
        assert "Traceback" not in done.stderr
        out = done.stdout
        assert "status: success" in out, out[-3000:]
        # The reviewer sent the first drafts back; the final summaries cite every high clause.
        retries = re.search(r"retries: (\d+)", out)
        assert retries is not None
        assert int(retries.group(1)) >= 2
        assert "lease-0, lease-1" in out
        assert re.search(r"total: \$0\.\d{4}", out)


class TestWorkers:
    def test_two_worker_processes_share_the_run(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        done = run_python(str(REPO / "examples" / "workers.py"), cwd=REPO, env=env, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "status: success, 60 tasks succeeded" in done.stdout
        counts = [int(n) for n in re.findall(r"worker \d+: (\d+) tasks", done.stdout)]
        assert len(counts) == 2  # both workers ran tasks
        assert all(n > 0 for n in counts)
        assert "workers: 0, 0" in done.stdout
        assert "Traceback" not in done.stderr
