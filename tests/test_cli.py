"""The `orchestra` command."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from orchestra.cli import main
from tests.helpers import REPO, run_python

if TYPE_CHECKING:
    from pathlib import Path


class TestCommand:
    def test_needs_a_command(self, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit) as exit_:
            main([])
        assert exit_.value.code == 2
        assert "demo" in capsys.readouterr().err

    def test_bench_passes_its_arguments_to_the_suite(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        with pytest.raises(SystemExit) as exit_:
            main(["bench", "--help"])
        assert exit_.value.code == 0
        assert "--smoke" in capsys.readouterr().out

    def test_outside_a_checkout_it_says_so(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr("orchestra.cli.__file__", str(tmp_path / "orchestra" / "cli.py"))
        assert main(["demo"]) == 2
        assert "checkout" in capsys.readouterr().err

    def test_demo_runs_the_quickstart(self) -> None:
        done = run_python("-m", "orchestra.cli", "demo", cwd=REPO, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "speed-up:" in done.stdout
