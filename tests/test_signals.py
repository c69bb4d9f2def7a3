"""`run_main` on a real subprocess with real signals: the first SIGINT or SIGTERM stops the run
gracefully and the partial result is printed; a second SIGINT cancels what still runs at once;
never a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import IO, Any

import pytest

from orchestra import ConfigError, Orchestrator, run_main
from tests.helpers import REPO, spawn

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

JOB = REPO / "tests" / "signal_job.py"


def start(seconds: float, grace: float) -> subprocess.Popen[str]:
    return spawn(
        [sys.executable, str(JOB), str(seconds), str(grace)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def wait_for(stream: IO[str], text: str, seen: list[str], timeout: float = 30.0) -> None:
    """Read `stream` line by line (kept in `seen`) until one contains `text`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return
    pytest.fail(f"{text!r} never came on stderr; got: {''.join(seen)}")


def finish(proc: subprocess.Popen[str], seen: list[str]) -> tuple[dict[str, Any], str]:
    out, err = proc.communicate(timeout=30)
    stderr = "".join(seen) + err
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    return json.loads(out), stderr


@pytest.mark.subprocess
class TestFirstSignal:
    @pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
    def test_stops_gracefully_and_prints_the_partial_result(self, sig: signal.Signals) -> None:
        proc = start(seconds=1.0, grace=30)
        seen: list[str] = []
        assert proc.stderr is not None
        wait_for(proc.stderr, "started t1", seen)
        os.kill(proc.pid, sig)
        result, stderr = finish(proc, seen)
        assert result["status"] == "cancelled"
        assert result["metadata"]["reason"] == f"stopped by {sig.name}"
        # The two running attempts finished within the grace; the four waiting ones never ran.
        assert result["metadata"]["counts"]["succeeded"] == 2
        assert {e["task_id"]: e["error_type"] for e in result["errors"]} == {
            f"t{i}": "Stopped" for i in range(2, 6)
        }
        assert "started t2" not in stderr
        assert "stopping the run gracefully" in stderr


@pytest.mark.subprocess
class TestSecondSignal:
    def test_cancels_at_once_and_still_prints_the_result(self) -> None:
        proc = start(seconds=60, grace=60)
        seen: list[str] = []
        assert proc.stderr is not None
        wait_for(proc.stderr, "started t1", seen)
        began = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        wait_for(proc.stderr, "stopping the run gracefully", seen)
        os.kill(proc.pid, signal.SIGINT)
        result, stderr = finish(proc, seen)
        assert time.monotonic() - began < 20  # not the 60 s grace, nor the 60 s tasks
        assert result["status"] == "cancelled"
        assert result["metadata"]["counts"]["cancelled"] == 6
        assert "cancelling the run now" in stderr


class TestArguments:
    def test_a_bad_grace_is_a_config_error(self) -> None:
        with pytest.raises(ConfigError, match="grace"):
            run_main(Orchestrator(agents=[]), tasks=[], grace=-1)

    def test_something_that_is_not_an_orchestrator_is_a_config_error(self) -> None:
        # A TypeError from inside the run ("does not support the asynchronous context manager").
        with pytest.raises(ConfigError, match="runs an Orchestrator, got 3"):
            run_main(3, tasks=[])  # type: ignore[arg-type]

    async def test_inside_a_running_event_loop_it_says_what_to_do(self) -> None:
        # anyio.run's RuntimeError ("Already running asyncio in this thread") was all it said.
        with pytest.raises(ConfigError, match=r"await orch\.run"):
            run_main(Orchestrator(agents=[]), tasks=[])
