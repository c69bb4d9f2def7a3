"""``orchestra tokens`` (made, listed, revoked in the store's file) and ``orchestra serve`` (a
real process: it serves the API on its port and stops gracefully on SIGTERM, its live run
stopped and kept)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from typing import TYPE_CHECKING

import httpx
import pytest
from typer.testing import CliRunner, Result

from orchestra._cli._app import app
from tests.helpers import spawn
from tests.service_kit import free_port

if TYPE_CHECKING:
    from pathlib import Path


def _cli(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), prog_name="orchestra")


class TestTokens:
    def test_create_prints_the_token_once_and_keeps_only_its_hash(self, tmp_path: Path) -> None:
        db = str(tmp_path / "t.db")
        made = _cli("tokens", "create", "--role", "control", "--name", "ops", "--db", db)
        assert made.exit_code == 0, made.output
        token = made.stdout.strip().splitlines()[0]
        assert token.startswith("orch_")
        assert len(token) == len("orch_") + 43  # 256 bits, URL-safe base64
        with sqlite3.connect(db) as conn:
            (kept,) = conn.execute("SELECT hash FROM tokens").fetchone()
        conn.close()
        assert token not in kept
        listed = _cli("tokens", "list", "--db", db, "--jsonl")
        (row,) = [json.loads(line) for line in listed.stdout.splitlines()]
        assert (row["name"], row["role"], row["revoked"]) == ("ops", "control", None)
        assert token not in listed.stdout

    def test_revoke_by_name_marks_it_revoked_and_an_unknown_one_is_a_usage_error(
        self, tmp_path: Path
    ) -> None:
        db = str(tmp_path / "t.db")
        _cli("tokens", "create", "--role", "read", "--name", "ci", "--db", db)
        revoked = _cli("tokens", "revoke", "ci", "--db", db)
        assert revoked.exit_code == 0
        (row,) = [json.loads(x) for x in _cli("tokens", "list", "--db", db, "--jsonl").stdout.split("\n") if x]  # fmt: skip
        assert row["revoked"] is not None
        unknown = _cli("tokens", "revoke", "nobody", "--db", db)
        assert unknown.exit_code == 2
        assert "nobody" in unknown.output

    def test_an_unknown_role_is_a_usage_error_naming_the_roles(self, tmp_path: Path) -> None:
        made = _cli("tokens", "create", "--role", "boss", "--db", str(tmp_path / "t.db"))
        assert made.exit_code == 2
        assert "submit, read, control, worker, admin" in made.output


_AGENTS = """
    import asyncio
    from orchestra import agent

    @agent(kinds=["echo"])
    async def echo(task, ctx):
        return task.payload

    @agent(kinds=["sleep"])
    async def sleep(task, ctx):
        await asyncio.sleep(600)

    registry = [echo, sleep]
"""


@pytest.mark.subprocess
class TestServe:
    def test_serves_runs_and_stops_gracefully_on_sigterm(self, tmp_path: Path) -> None:
        (tmp_path / "jobs.py").write_text(textwrap.dedent(_AGENTS))
        db = str(tmp_path / "orchestra.db")
        token = _cli("tokens", "create", "--role", "admin", "--db", db).stdout.split()[0]
        port = free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
        process = spawn(
            [sys.executable, "-m", "orchestra", "serve", "--agents", "jobs:registry",
             "--db", db, "--port", str(port), "--grace", "1"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        auth = {"Authorization": f"Bearer {token}"}
        deadline = time.monotonic() + 30
        with httpx.Client(base_url=url, timeout=10) as client:
            while True:
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert process.poll() is None, process.communicate()
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.05)
            assert client.get("/api/runs").status_code == 401
            done = client.post("/api/runs", json={"tasks": [{"kind": "echo", "payload": 7}]},
                               headers=auth)  # fmt: skip
            assert done.status_code == 202
            live = client.post(
                "/api/runs", json={"tasks": [{"kind": "sleep"}], "run_id": "long"}, headers=auth
            )
            assert live.status_code == 202
            assert client.get("/api/runs/long", headers=auth).json()["live"] is True
            # The metrics extra is installed here: the orchestrator serve built collects.
            metrics = client.get("/metrics", headers=auth)
            assert metrics.status_code == 200
            assert "orchestra_attempts_total" in metrics.text
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
        # uvicorn shuts down gracefully, then ends the process with the signal it caught.
        assert process.returncode == -signal.SIGTERM, err
        assert "Application shutdown complete" in err
        # The sleeping task was cancelled within the grace (it sleeps for ten minutes), and the
        # run is kept open in the file, to resume: the same run id submitted again.
        with sqlite3.connect(db) as conn:
            (state,) = conn.execute("SELECT state FROM runs WHERE id = 'long'").fetchone()
            (owner,) = conn.execute("SELECT owner FROM runs WHERE id = 'long'").fetchone()
        conn.close()
        assert (state, owner) == ("open", None)

    def test_without_the_service_extra_it_says_what_to_install(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if it were not installed
        answer = _cli("serve", "--agents", "jobs:registry")
        assert answer.exit_code == 2
        assert "pip install 'orchestra-runtime[service]'" in answer.output

    def test_create_app_without_the_extra_says_what_to_install(self) -> None:
        code = (
            "import sys\n"
            "sys.modules['fastapi'] = None  # as if it were not installed\n"
            "import orchestra.service\n"
            "try:\n"
            "    orchestra.service.create_app(None)\n"
            "except ModuleNotFoundError as exc:\n"
            "    print(exc)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        assert "pip install 'orchestra-runtime[service]'" in done.stdout

    def test_importing_orchestra_imports_no_fastapi(self) -> None:
        code = "import sys, orchestra, orchestra.service; print('fastapi' in sys.modules)"
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        assert done.stdout.strip() == "False"

    def test_without_agents_it_is_a_usage_error(self) -> None:
        answer = _cli("serve")
        assert answer.exit_code == 2
        assert "--agents" in answer.output
