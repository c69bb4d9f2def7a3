"""The examples run end to end, as a user would run them."""

from __future__ import annotations

import os
import re

from tests.helpers import REPO, run_python


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
