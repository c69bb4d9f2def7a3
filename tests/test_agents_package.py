"""`orchestra.agents`: ready-made agents, importable next to a top-level package named `agents`."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import pytest

from orchestra import Orchestrator, RetryPolicy, Task
from tests.helpers import REPO, run_python

if TYPE_CHECKING:
    from pathlib import Path

    from orchestra.testing import FakeClock


def digits_sum(task: Task) -> int:
    """A CPU-bound function for `cpu_agent`: importable, so a worker process can run it."""
    return sum(int(c) for c in str(task.payload))


@pytest.fixture
def other_agents_package(tmp_path: Path) -> Path:
    """A throwaway top-level `agents` package, as the OpenAI Agents SDK installs."""
    package = tmp_path / "agents"
    package.mkdir()
    (package / "__init__.py").write_text('WHO = "someone else\'s agents"\n')
    (package / "run.py").write_text("def runner() -> str:\n    return 'theirs'\n")
    return tmp_path


class TestNoShadowing:
    def test_both_import_side_by_side(
        self, other_agents_package: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        saved = {k: v for k, v in sys.modules.items() if k == "agents" or k.startswith("agents.")}
        for name in saved:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.syspath_prepend(str(other_agents_package))
        try:
            import agents  # type: ignore[import-not-found]
            import agents.run  # type: ignore[import-not-found]

            import orchestra.agents

            assert agents.WHO == "someone else's agents"
            assert agents.run.runner() == "theirs"
            assert orchestra.agents is not agents
            assert orchestra.agents.__name__ == "orchestra.agents"
            assert callable(orchestra.agents.simulated)
            assert callable(orchestra.agents.cpu_agent)
        finally:
            for name in [k for k in sys.modules if k == "agents" or k.startswith("agents.")]:
                del sys.modules[name]
            sys.modules.update(saved)

    @pytest.mark.subprocess
    @pytest.mark.parametrize(
        "order",
        ["import agents, orchestra.agents", "import orchestra.agents, agents"],
    )
    def test_both_import_in_a_fresh_interpreter(
        self, order: str, other_agents_package: Path
    ) -> None:
        code = (
            f"{order}\n"
            "from orchestra.agents import simulated, cpu_agent\n"
            'assert agents.WHO == "someone else\'s agents", agents\n'
            "assert orchestra.agents.__name__ == 'orchestra.agents'\n"
            "assert agents.__file__ != orchestra.agents.__file__\n"
            "print('ok')\n"
        )
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(other_agents_package), str(REPO)]),
        }
        done = run_python("-c", code, cwd=other_agents_package, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "ok"


class TestSimulated:
    async def test_simulated_agents_take_virtual_time(self, clock: FakeClock) -> None:
        from orchestra.agents import simulated

        worker = simulated("sim", ["work"], latency=2.0, jitter=0.0, seed=1)
        result = await Orchestrator(agents=[worker], concurrency=5).run(
            tasks=[Task("work", i, id=f"t{i}") for i in range(10)]
        )
        assert result.status == "success"
        assert result.metadata.elapsed == pytest.approx(4.0)
        assert result.data["t3"] == {"agent": "sim", "task": "t3"}

    async def test_simulated_agents_with_an_output(self, clock: FakeClock) -> None:
        from orchestra.agents import simulated

        worker = simulated("sim", ["work"], latency=0.1, output=lambda t: t.payload + 1, seed=1)
        result = await Orchestrator(agents=[worker]).run(tasks=[Task("work", 1, id="x")])
        assert result.status == "success", result.errors
        assert result.data == {"x": 2}

    async def test_simulated_failures_are_retried(self, clock: FakeClock) -> None:
        from orchestra.agents import simulated

        worker = simulated("sim", ["work"], latency=0.1, failure_rate=0.3, seed=4)
        orch = Orchestrator(agents=[worker], retry=RetryPolicy(max_attempts=10, base=0.01), seed=1)
        result = await orch.run(tasks=[Task("work", i, id=f"t{i}") for i in range(20)])
        assert result.status == "success"
        assert result.metadata.retries > 0


class TestCpuAgent:
    @pytest.mark.parametrize(
        "executor", ["thread", pytest.param("process", marks=pytest.mark.subprocess)]
    )
    async def test_runs_a_plain_function(self, executor: str) -> None:
        from orchestra.agents import cpu_agent

        summer = cpu_agent(digits_sum, kinds=["digits"], executor=executor, concurrency=1)  # type: ignore[arg-type]
        assert summer.name == "digits_sum"
        result = await Orchestrator(agents=[summer]).run(
            tasks=[Task("digits", n, id=str(n)) for n in (123, 99, 7)]
        )
        assert result.data == {"123": 6, "99": 18, "7": 7}
