"""The built wheel, installed into a fresh virtual environment, works from outside the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import orchestra
from tests.helpers import REPO

pytestmark = pytest.mark.subprocess

# The dashboard's files, served from the installed package (`orchestra._service._dashboard`).
_DASHBOARD = ("index.html", "dashboard.js", "dashboard.css")


def uv() -> str:
    found = shutil.which("uv") or str(REPO / ".tools" / "bin" / "uv")
    if not Path(found).is_file():
        pytest.skip("uv is not installed (make sync installs it into .tools/)")
    return found


def run(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=180, check=False
    )


@pytest.mark.slow
class TestInstalledWheel:
    def test_version_demo_and_bench_from_outside_the_checkout(self, tmp_path: Path) -> None:
        built = run(
            uv(), "build", "--wheel", "--out-dir", str(tmp_path / "dist"), str(REPO), cwd=REPO
        )
        assert built.returncode == 0, built.stderr
        [wheel] = (tmp_path / "dist").glob("orchestra_runtime-*.whl")
        with zipfile.ZipFile(wheel) as built_wheel:
            shipped = set(built_wheel.namelist())
        dashboard = {f"orchestra/_service/static/{name}" for name in _DASHBOARD}
        assert dashboard <= shipped  # the service's page is package data
        venv = tmp_path / "venv"
        made = run(uv(), "venv", "--python", sys.executable, str(venv), cwd=tmp_path)
        assert made.returncode == 0, made.stderr
        python = venv / "bin" / "python"
        installed = run(
            uv(), "pip", "install", "--python", str(python), f"{wheel}[cli]", cwd=tmp_path
        )
        assert installed.returncode == 0, installed.stderr
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        away = tmp_path / "elsewhere"
        away.mkdir()
        command = str(venv / "bin" / "orchestra")

        version = run(command, "--version", cwd=away, env=env)
        assert (version.returncode, version.stdout) == (0, f"orchestra {orchestra.__version__}\n")

        where = run(
            str(python), "-c", "import orchestra; print(orchestra.__file__)", cwd=away, env=env
        )
        assert where.stdout.startswith(str(venv))  # the installed copy, not the checkout

        demo = run(command, "demo", cwd=away, env=env)
        assert demo.returncode == 0, demo.stderr
        assert "speed-up:" in demo.stdout

        help_ = run(command, "--help", cwd=away, env=env)
        assert help_.returncode == 0, help_.stderr
        assert "demo" in help_.stdout
        assert "bench" not in help_.stdout  # it works in a checkout only

        bench = run(command, "bench", cwd=away, env=env)
        assert bench.returncode == 2
        assert "No checkout here" in bench.stderr
        assert "Traceback" not in bench.stderr
