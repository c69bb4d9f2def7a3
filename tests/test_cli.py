"""The `orchestra` command, through typer's runner and as a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
import uuid
from typing import TYPE_CHECKING

import pytest
from typer.testing import CliRunner

import orchestra
from orchestra._cli._app import _how_to_bench, _missing_bench_group, app
from orchestra.stores import SQLiteStore
from tests.helpers import REPO, run_python, spawn

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

    from typer.testing import Result

# `python -m orchestra` in a subprocess imports this checkout's package (not the one the
# environment was installed from: a worktree shares its main checkout's .venv).
THIS_CHECKOUT = {**os.environ, "PYTHONPATH": str(REPO)}

JOB = """
import asyncio
from orchestra import Orchestrator, RetryPolicy, Task, Context, Timeouts, agent

@agent(kinds=["double"])
async def double(task: Task, ctx: Context) -> int:
    if task.payload < 0:
        raise ValueError(f"negative: {task.payload}")
    await asyncio.sleep(task.payload / 1000)
    return task.payload * 2

def build(**options) -> Orchestrator:
    return Orchestrator(agents=[double], retry=RetryPolicy(max_attempts=1), **options)

def partial() -> Orchestrator:
    return build(success_threshold=0.5)

def hurried() -> Orchestrator:
    return build(timeouts=Timeouts(run=0.2))

def split(numbers):
    for n in numbers:
        yield Task("double", n, id=f"n{n}")

def decomposed() -> Orchestrator:
    return build(decomposer=split)

instance = build()
not_one = 42

def a_string() -> str:
    return "nope"

async def a_coroutine() -> Orchestrator:
    return build()

KEY = "sk-ant-api03-" + "Zq9" * 10

def leaky() -> Orchestrator:
    raise RuntimeError("cannot create client: " + KEY)

def refuse(items):
    raise RuntimeError("upstream said: invalid x-api-key " + KEY)

def leaky_decomposer() -> Orchestrator:
    return build(decomposer=refuse)

import os

@agent(kinds=["flaky"])
async def flaky(task: Task, ctx: Context) -> int:
    if not os.path.exists("healed"):
        raise ValueError("not yet")
    return task.payload

def with_flaky() -> Orchestrator:
    return Orchestrator(agents=[double, flaky], retry=RetryPolicy(max_attempts=1))
"""
KEY = "sk-ant-api03-" + "Zq9" * 10  # as the job module builds it


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The name of a fresh job module in the current directory (a new name for each test)."""
    name = f"job_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(JOB)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_orchestrator adds the directory
    yield name
    sys.modules.pop(name, None)


@pytest.fixture
def jsonl(tmp_path: Path) -> Callable[..., Path]:
    def write(*lines: object, name: str = "input.jsonl") -> Path:
        path = tmp_path / name
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        return path

    return write


def invoke(*args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(app, list(args), input=input, prog_name="orchestra")


def lines_of(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines()]


class TestVersionAndHelp:
    def test_version(self) -> None:
        result = invoke("--version")
        assert result.exit_code == 0
        assert result.stdout == f"orchestra {orchestra.__version__}\n"

    def test_the_version_is_the_packages(self) -> None:
        from importlib.metadata import version

        assert version("orchestra-runtime") == orchestra.__version__

    @pytest.mark.parametrize("command", [[], ["demo"], ["run"]])
    def test_help_everywhere(self, command: list[str]) -> None:
        result = invoke(*command, "--help")
        assert result.exit_code == 0, result.output
        assert "Usage: orchestra" in result.stdout

    def test_help_paragraphs_are_reflowed_to_the_width(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """At 80 columns (CI, a pipe) the docstring's own line breaks were kept inside the wrapping:
        'first one at a time,' ended a line of its own, half as wide as the others."""
        monkeypatch.setenv("COLUMNS", "80")
        text = invoke("demo", "--help").stdout
        lines = [line.strip() for line in text.splitlines()]
        first = next(i for i, line in enumerate(lines) if line.startswith("Contracts"))
        assert all(len(line) > 60 for line in lines[first : first + 2]), text

    def test_no_command_is_a_usage_error_that_lists_the_commands(self) -> None:
        result = invoke()
        assert result.exit_code == 2
        assert all(name in result.output for name in ("demo", "run", "bench"))

    def test_an_unknown_command_is_a_usage_error(self) -> None:
        assert invoke("frobnicate").exit_code == 2

    @pytest.mark.subprocess
    def test_python_dash_m_orchestra(self) -> None:
        done = run_python("-m", "orchestra", "--version", cwd=REPO, timeout=60)
        assert (done.returncode, done.stdout) == (0, f"orchestra {orchestra.__version__}\n")

    @pytest.mark.subprocess
    def test_without_the_cli_extra_it_says_which_to_install(self) -> None:
        code = (
            "import sys; sys.modules['typer'] = None; from orchestra.__main__ import main; main()"
        )
        done = run_python("-c", code, cwd=REPO, timeout=60)
        assert done.returncode == 2
        assert "pip install 'orchestra-runtime[cli]'" in done.stderr
        assert "Traceback" not in done.stderr


class TestRun:
    def test_success_writes_every_result_and_exits_0(
        self, job: str, jsonl: Callable[..., Path], tmp_path: Path
    ) -> None:
        source = jsonl(
            {"kind": "double", "payload": 1, "id": "a"}, {"kind": "double", "payload": 2}
        )
        out = tmp_path / "results.jsonl"
        result = invoke("run", f"{job}:build", str(source), "-o", str(out))
        assert result.exit_code == 0, result.output
        records = sorted(lines_of(out.read_text()), key=lambda r: str(r["task_id"]))
        assert [(r["task_id"], r["status"], r["output"]) for r in records] == [
            ("a", "succeeded", 2),
            ("double#1", "succeeded", 4),
        ]
        assert result.stdout == ""
        *progress, summary = result.stderr.splitlines()
        assert summary.startswith("success: 2 tasks (2 succeeded)")
        assert all(line.startswith("run ") for line in progress)  # the live view, plain

    def test_results_go_to_stdout_without_o_and_the_summary_to_stderr(
        self, job: str, jsonl: Callable[..., Path]
    ) -> None:
        source = jsonl({"kind": "double", "payload": 3, "id": "x"})
        result = invoke("run", f"{job}:build", str(source))
        assert result.exit_code == 0
        [record] = lines_of(result.stdout)
        assert (record["task_id"], record["output"], record["agent"]) == ("x", 6, "double")
        assert "success" in result.stderr

    def test_stdin_as_input(self, job: str) -> None:
        result = invoke("run", f"{job}:instance", "-", input='{"kind": "double", "payload": 5}\n')
        assert result.exit_code == 0, result.output
        assert lines_of(result.stdout)[0]["output"] == 10

    def test_partial_exits_3_and_names_the_failed_task(
        self, job: str, jsonl: Callable[..., Path]
    ) -> None:
        source = jsonl(*({"kind": "double", "payload": n, "id": f"t{n}"} for n in (1, 2, -3)))
        result = invoke("run", f"{job}:partial", str(source))
        assert result.exit_code == 3, result.output
        failed = [r for r in lines_of(result.stdout) if r["status"] == "failed"]
        assert [(r["task_id"], r["error_type"]) for r in failed] == [("t-3", "ValueError")]
        assert failed[0]["agent"] == "double"  # the last agent tried
        assert "t-3 (double): ValueError: negative: -3" in result.stderr

    def test_failed_exits_1(self, job: str, jsonl: Callable[..., Path]) -> None:
        result = invoke("run", f"{job}:build", str(jsonl({"kind": "double", "payload": -1})))
        assert result.exit_code == 1
        assert any(line.startswith("failed:") for line in result.stderr.splitlines())

    def test_a_run_timeout_keeps_what_finished(self, job: str, jsonl: Callable[..., Path]) -> None:
        source = jsonl(
            {"kind": "double", "payload": 1, "id": "quick"},
            {"kind": "double", "payload": 60_000, "id": "slow"},
        )
        result = invoke("run", f"{job}:hurried", str(source))
        assert result.exit_code == 1, result.output
        statuses = {r["task_id"]: r["status"] for r in lines_of(result.stdout)}
        assert statuses == {"quick": "succeeded", "slow": "cancelled"}
        assert "slow (double): run timeout after 0.2s" in result.stderr

    def test_with_a_decomposer_the_lines_are_its_input(
        self, job: str, jsonl: Callable[..., Path]
    ) -> None:
        result = invoke("run", f"{job}:decomposed", str(jsonl(4, 7)))
        assert result.exit_code == 0, result.output
        outputs = {r["task_id"]: r["output"] for r in lines_of(result.stdout)}
        assert outputs == {"n4": 8, "n7": 14}

    def test_a_script_path_as_the_module(self, job: str, jsonl: Callable[..., Path]) -> None:
        result = invoke("run", f"{job}.py:build", str(jsonl({"kind": "double", "payload": 1})))
        assert result.exit_code == 0, result.output


class TestDurableRun:
    def test_a_failed_run_is_retried_by_running_the_command_again_with_its_run_id(
        self, job: str, jsonl: Callable[..., Path], tmp_path: Path
    ) -> None:
        source = jsonl(
            {"kind": "double", "payload": 1, "id": "ok"}, {"kind": "flaky", "payload": 2, "id": "f"}
        )
        db = tmp_path / "runs.db"
        command = ("run", f"{job}:with_flaky", str(source), "--db", str(db), "--run-id", "r1")
        first = invoke(*command)
        assert first.exit_code == 1, first.output
        assert "run r1 is kept in" in first.stderr
        assert f"orchestra runs retry r1 --db {db}" in first.stderr

        retried = invoke("runs", "retry", "r1", "--db", str(db))
        assert retried.exit_code == 0, retried.output
        assert f"--db {db} --run-id r1" in retried.stdout.replace("\n", "")

        (tmp_path / "healed").touch()
        again = invoke(*command)
        assert again.exit_code == 0, again.output
        records = {r["task_id"]: r for r in lines_of(again.stdout)}
        assert records["f"]["status"] == "succeeded"
        assert records["f"]["attempts"] == 2  # the failed attempt of the first run is kept
        store = SQLiteStore(db)
        events = [e["event"] for e in store.events("r1", "ok")]
        store.close()
        assert events.count("started") == 1  # what succeeded was not run again

    def test_without_a_run_id_the_fresh_one_is_printed(
        self, job: str, jsonl: Callable[..., Path], tmp_path: Path
    ) -> None:
        source = jsonl({"kind": "double", "payload": 1, "id": "ok"})
        db = tmp_path / "runs.db"
        result = invoke("run", f"{job}:build", str(source), "--db", str(db))
        assert result.exit_code == 0, result.output
        store = SQLiteStore(db)
        [run] = store.runs()
        store.close()
        assert f"run {run['id']} is kept in {db}" in result.stderr

    def test_an_empty_run_id_is_a_usage_error(
        self, job: str, jsonl: Callable[..., Path], tmp_path: Path
    ) -> None:
        source = jsonl({"kind": "double", "payload": 1})
        result = invoke(
            "run", f"{job}:build", str(source), "--db", str(tmp_path / "r.db"), "--run-id", ""
        )
        assert result.exit_code == 2, result.output
        assert "run_id" in result.stderr


class TestRunUsageErrors:
    @pytest.mark.parametrize(
        ("target", "message"),
        [
            ("{job}", "expected module:factory"),
            ("no_such_module_here:build", "cannot import 'no_such_module_here'"),
            ("{job}:nothing", "has no attribute 'nothing'"),
            ("{job}:not_one", "is a int, not an Orchestrator"),
            ("{job}:a_string", "returned a str, not an Orchestrator"),
            ("{job}:a_coroutine", "not a coroutine"),
            ("missing.py:build", "no such file: missing.py"),
            # Shown as typed, not read as rich markup (a MarkupError traceback before).
            ("missing[/x].py:build", "no such file: missing[/x].py"),
            # A path without .py, a bad name: no traceback of pkgutil's ValueError.
            ("jobs/contracts:build", "cannot import 'jobs/contracts': not a dotted module name"),
            ("{job}:build()", "'build()' in "),
        ],
    )
    def test_a_factory_that_does_not_load(
        self, job: str, jsonl: Callable[..., Path], target: str, message: str
    ) -> None:
        result = invoke("run", target.format(job=job), str(jsonl({"kind": "double"})))
        assert result.exit_code == 2
        assert message in result.stderr
        assert "Traceback" not in result.output

    @pytest.mark.subprocess
    @pytest.mark.parametrize(
        ("source", "where"),
        [
            ("def broken():\n    raise RuntimeError('factory exploded')\n", "in broken"),
            ("raise RuntimeError('factory exploded')\nbroken = None\n", "in <module>"),
        ],
        ids=["the factory raises", "the module raises"],
    )
    def test_a_factory_or_module_that_raises_is_a_usage_error_with_its_traceback(
        self, tmp_path: Path, jsonl: Callable[..., Path], source: str, where: str
    ) -> None:
        (tmp_path / "exploding_job.py").write_text(source)
        process = subprocess.run(
            [sys.executable, "-m", "orchestra", "run", "exploding_job:broken", "-"],
            input=json.dumps({"kind": "double"}) + "\n",
            cwd=tmp_path,
            env=THIS_CHECKOUT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert process.returncode == 2, process.stderr
        assert process.stdout == ""
        # The user's own code failed: its traceback, then what did not load and why.
        assert "Traceback (most recent call last)" in process.stderr
        assert where in process.stderr
        assert (
            "orchestra: exploding_job:broken did not load: RuntimeError: factory exploded"
            in process.stderr
        )

    def test_a_factory_that_raises_a_key_shows_it_scrubbed(
        self, job: str, jsonl: Callable[..., Path]
    ) -> None:
        result = invoke("run", f"{job}:leaky", str(jsonl({"kind": "double"})))
        assert result.exit_code == 2
        assert "Traceback (most recent call last)" in result.stderr
        assert "in leaky" in result.stderr
        assert f"{job}:leaky did not load: RuntimeError: cannot create client: [redacted]" in (
            result.stderr
        )
        assert KEY not in result.output

    @pytest.mark.parametrize(
        ("lines", "message"),
        [
            ('{"kind": "double"}\n{"kind": "double", "prio": 1}\n', "line 2: prio: Extra inputs"),
            ('{"kind": "double"}\n\n[1, 2]\n', "line 3: not a task"),
            ('{"kind": "double", "priority": "high"}\n', "line 1: priority: Input should be"),
            ('{"kind": "double"\n', "line 1: not JSON"),
            ('{"kind": "triple"}\n', "no agent serves kind 'triple'"),
            ('{"kind": "double", "id": "a"}\n{"kind": "double", "id": "a"}\n', "'a'"),
        ],
    )
    def test_a_bad_input_line_is_named_and_nothing_runs(
        self, job: str, lines: str, message: str
    ) -> None:
        result = invoke("run", f"{job}:build", "-", input=lines)
        assert result.exit_code == 2, result.output
        assert message in result.stderr
        assert result.stdout == ""  # no task ran

    @pytest.mark.parametrize("where", ["file", "stdin"])
    def test_an_input_that_is_not_utf8_is_named_by_its_line(
        self, job: str, tmp_path: Path, where: str
    ) -> None:
        data = '{"kind": "double", "payload": 1}\n{"kind": "double", "id": "na\xefve"}\n'
        path = tmp_path / "latin1.jsonl"
        path.write_bytes(data.encode("latin-1"))
        if where == "file":
            result = invoke("run", f"{job}:build", str(path))
        else:
            result = CliRunner().invoke(
                app, ["run", f"{job}:build", "-"], input=path.read_bytes(), prog_name="orchestra"
            )
        assert result.exit_code == 2, result.output
        assert "line 2: not UTF-8" in result.stderr
        assert "Traceback" not in result.output
        assert result.stdout == ""  # no task ran

    def test_a_missing_input_file(self, job: str) -> None:
        result = invoke("run", f"{job}:build", "nowhere.jsonl")
        assert result.exit_code == 2
        assert "cannot read nowhere.jsonl" in result.stderr

    def test_a_missing_argument(self) -> None:
        result = invoke("run", "x:y")
        assert result.exit_code == 2
        assert "Missing argument" in result.output


@pytest.mark.subprocess
class TestUnexpectedErrors:
    def test_a_decomposer_that_raises_exits_1_with_its_traceback_scrubbed(
        self, job: str, jsonl: Callable[..., Path], tmp_path: Path
    ) -> None:
        process = subprocess.run(
            [sys.executable, "-m", "orchestra", "run", f"{job}:leaky_decomposer", str(jsonl(1))],
            cwd=tmp_path,
            env=THIS_CHECKOUT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert process.returncode == 1, process.stderr
        assert "Traceback (most recent call last)" in process.stderr
        assert "in refuse" in process.stderr
        assert (
            "orchestra: RuntimeError: upstream said: invalid x-api-key [redacted]\n"
            in process.stderr
        )
        assert "Zq9" * 5 not in process.stdout + process.stderr


@pytest.mark.subprocess
class TestInterrupt:
    def test_ctrl_c_stops_gracefully_keeps_the_results_and_exits_130(
        self, job: str, jsonl: Callable[..., Path], tmp_path: Path
    ) -> None:
        source = jsonl(
            {"kind": "double", "payload": 1, "id": "quick"},
            {"kind": "double", "payload": 60_000, "id": "slow"},
        )
        out = tmp_path / "out.jsonl"
        command = [
            sys.executable,
            "-m",
            "orchestra",
            "run",
            f"{job}:build",
            str(source),
            "-o",
            str(out),
            "--grace",
            "30",
        ]
        process = subprocess.Popen(
            command, cwd=tmp_path, env=THIS_CHECKOUT, stderr=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + 30
        while not (out.exists() and out.stat().st_size > 0) and time.monotonic() < deadline:
            time.sleep(0.05)  # "quick" is written: "slow" is running
        process.send_signal(signal.SIGINT)  # a graceful stop: "slow" may take 30 s ...
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)  # ... a second Ctrl-C cancels it at once
        _, stderr = process.communicate(timeout=20)
        assert process.returncode == 130, stderr
        assert "2 task results written to" in stderr
        assert "Traceback" not in stderr
        records = {r["task_id"]: r["status"] for r in lines_of(out.read_text())}
        assert records == {"quick": "succeeded", "slow": "cancelled"}


@pytest.mark.subprocess
class TestKeys:
    @pytest.mark.skipif(sys.platform == "win32", reason="a pseudo-terminal")
    def test_in_a_terminal_p_pauses_and_c_cancels(
        self, job: str, jsonl: Callable[..., Path], tmp_path: Path
    ) -> None:
        import pty

        source = jsonl(
            {"kind": "double", "payload": 1, "id": "quick"},
            {"kind": "double", "payload": 60_000, "id": "slow"},
        )
        out = tmp_path / "out.jsonl"
        command = [sys.executable, "-m", "orchestra", "run", f"{job}:build", str(source), "-o"]
        master, terminal = pty.openpty()  # stdin is a terminal: keys steer the run
        process = subprocess.Popen(
            [*command, str(out)],
            cwd=tmp_path,
            env=THIS_CHECKOUT,
            stdin=terminal,
            stderr=subprocess.PIPE,
            text=True,
        )
        os.close(terminal)
        try:
            deadline = time.monotonic() + 30
            while not (out.exists() and out.stat().st_size > 0) and time.monotonic() < deadline:
                time.sleep(0.05)  # "quick" is written: "slow" is running
            os.write(master, b"p")
            time.sleep(0.3)
            os.write(master, b"c")  # cancel now (no grace)
            _, stderr = process.communicate(timeout=20)
        finally:
            os.close(master)
        assert process.returncode == 130, stderr
        assert "keys: p pause" in stderr
        assert "cancelled" in stderr
        records = {r["task_id"]: r["status"] for r in lines_of(out.read_text())}
        assert records == {"quick": "succeeded", "slow": "cancelled"}


@pytest.mark.subprocess
class TestDemo:
    def test_demo_runs_the_bundled_quickstart(self, tmp_path: Path) -> None:
        done = run_python("-m", "orchestra", "demo", cwd=tmp_path, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "speed-up:" in done.stdout
        # The live view, plain (stderr is not a terminal here): nothing else.
        assert all(line.startswith("run ") for line in done.stderr.splitlines()), done.stderr

    @pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
    @pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
    def test_a_signal_ends_the_demo_and_exits_130(
        self, tmp_path: Path, sig: signal.Signals
    ) -> None:
        # Was: the first run stopped, then the demo went on with its second run and exited 0.
        process = spawn(
            [sys.executable, "-m", "orchestra", "demo"],
            cwd=tmp_path,
            env=THIS_CHECKOUT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        catching(process.pid, signal.SIGTERM)  # the first run's signal receiver is open
        process.send_signal(sig)
        stdout, stderr = process.communicate(timeout=60)
        assert process.returncode == 130, stderr
        assert "sequential (concurrency 1): cancelled" in stdout
        assert "parallel" not in stdout
        assert "interrupted" in stderr
        assert "Traceback" not in stderr


def catching(pid: int, sig: signal.Signals, timeout: float = 30.0) -> None:
    """Wait until process `pid` has a handler for `sig` (its SigCgt mask in /proc)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:") and int(line.split()[1], 16) >> (sig - 1) & 1:
                    return
        time.sleep(0.02)
    pytest.fail(f"process {pid} never caught {sig.name}")


class TestBench:
    def test_in_a_checkout_the_arguments_go_to_the_suite(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.chdir(REPO)
        monkeypatch.setattr(sys, "argv", list(sys.argv))
        monkeypatch.setattr(sys, "path", list(sys.path))
        # The peers are the bench group's, which the tests' environment leaves out; --help needs
        # none of them.
        monkeypatch.setattr("orchestra._cli._app._missing_bench_group", lambda root: [])
        result = invoke("bench", "--help")
        assert result.exit_code == 0, result.output
        assert "--smoke" in result.stdout

    def test_from_another_directory_the_packages_own_checkout_is_found(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from pathlib import Path

        from orchestra._cli._app import _checkout

        monkeypatch.chdir(tmp_path)
        assert _checkout() == Path(orchestra.__file__).resolve().parents[1]

    def test_outside_a_checkout_it_says_how_to_get_one(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(
            "orchestra._cli._app.__file__", str(tmp_path / "orchestra" / "_cli" / "_app.py")
        )
        result = invoke("bench", "--smoke")
        assert result.exit_code == 2
        assert "No checkout here" in result.stderr
        assert "make bench" in result.stderr
        help_ = invoke("bench", "--help")
        assert help_.exit_code == 0
        assert "Usage: orchestra bench" in help_.stdout

    def test_the_bench_group_is_read_from_the_checkouts_pyproject(self, tmp_path: Path) -> None:
        (tmp_path / "pyproject.toml").write_text(
            '[dependency-groups]\nbench = ["anyio>=4", "no-such-peer-installed>=1"]\n'
        )
        assert _missing_bench_group(tmp_path) == ["no-such-peer-installed"]
        text = _how_to_bench(tmp_path, ["aiometer", "langgraph"])
        assert "missing: aiometer, langgraph" in text
        assert "uv sync --group bench" in text

    def test_the_benchmark_peers_are_a_dependency_group_not_a_published_extra(self) -> None:
        with (REPO / "pyproject.toml").open("rb") as file:
            project = tomllib.load(file)
        assert "bench" not in project["project"]["optional-dependencies"]
        peers = project["dependency-groups"]["bench"]
        assert any(peer.startswith("aiometer") for peer in peers)
