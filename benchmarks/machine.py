"""What the numbers were measured on: CPU, cores, memory, OS, Python and library versions."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

LIBRARIES = ("orchestra", "anyio", "aiometer", "langgraph", "uvloop", "structlog", "pydantic")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        import psutil

        total: int = psutil.virtual_memory().total
        return total
    except ImportError:
        return None


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _git_revision(root: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _source_digest(root: Path) -> str | None:
    """A digest of orchestra's sources, naming the code measured even when it is not committed."""
    files = sorted((root / "orchestra").rglob("*.py"))
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def machine_info(root: Path) -> dict[str, Any]:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": affinity,
        "memory_bytes": _memory_bytes(),
        "platform": platform.platform(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "executable": sys.executable,
        "libraries": {name: _version(name) for name in LIBRARIES},
        "git_revision": _git_revision(root),
        "orchestra_source_sha256": _source_digest(root),
    }
