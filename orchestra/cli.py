"""The `orchestra` command: `orchestra demo` and `orchestra bench` (from a checkout)."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

__all__ = ("main",)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `orchestra` command."""
    parser = argparse.ArgumentParser(prog="orchestra", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="run examples/quickstart.py (no API key needed)")
    # Everything after `bench` (--help included) goes to `python -m benchmarks`.
    commands.add_parser("bench", help="run the benchmark suite (benchmarks/)", add_help=False)
    options, rest = parser.parse_known_args(argv)
    if rest and options.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    root = _checkout()
    if root is None:
        print("orchestra: demo and bench run from a checkout of the repository", file=sys.stderr)
        return 2
    sys.path.insert(0, str(root))
    if options.command == "demo":
        runpy.run_path(str(root / "examples" / "quickstart.py"), run_name="__main__")
        return 0
    sys.argv = ["benchmarks", *rest]
    runpy.run_module("benchmarks", run_name="__main__", alter_sys=True)
    return 0


def _checkout() -> Path | None:
    for candidate in (Path.cwd(), Path(__file__).resolve().parent.parent):
        if (candidate / "benchmarks").is_dir() and (candidate / "examples").is_dir():
            return candidate
    return None


if __name__ == "__main__":
    raise SystemExit(main())
