"""Run the benchmark suite: ``python -m benchmarks [--smoke] [--only ROWS] [--reps N] [--out DIR]``.

Every (scenario, variant, size) runs in its own fresh ``python -m benchmarks.child`` process.
Repetitions are the outer loop: each repetition runs every variant of a group once, in an order that
rotates from one repetition to the next, so the variants alternate. The raw records, the medians
and spreads, the machine and the target checks go to ``latest.json``; ``latest.md`` and the PNG
plots are drawn from it (``python -m benchmarks.report DIR`` redraws them).

``--only`` runs a subset: scenarios, ``scenario/variant`` or ``scenario/variant@loop`` selectors,
comma-separated or repeated, or the preset ``core-v2``; the report then holds those rows alone.
``--smoke`` runs every variant's code path at a tiny size, once, in well under two minutes; CI runs
it so the suite never rots. No timing is ever asserted: a run fails only when a child fails.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .child import MARKER
from .machine import machine_info
from .report import write_all
from .scenarios import (
    FULL,
    PRESETS,
    SCENARIOS,
    SMOKE,
    Case,
    Scenario,
    parse_selectors,
    plan,
    select,
)

PACKAGE_DIR = Path(__file__).resolve().parent
ROOT = PACKAGE_DIR.parent
RESULTS_DIR = PACKAGE_DIR / "results"
PARTIAL_DIR = RESULTS_DIR / "partial"


def run_child(case: Case, timeout: float) -> dict[str, Any]:
    """Run one case in a fresh interpreter and return its record (with ``error`` on failure)."""
    spec = case.spec
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.child", spec.to_json()],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"spec": json.loads(spec.to_json()), "error": f"timed out after {timeout:g} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARKER):
            record: dict[str, Any] = json.loads(line[len(MARKER) :])
            if "error" in record:
                record["stderr"] = proc.stderr[-2000:]
            return record
    return {
        "spec": json.loads(spec.to_json()),
        "error": f"child exited {proc.returncode} without a result",
        "stderr": proc.stderr[-2000:],
    }


def server_for(scenario: str) -> contextlib.AbstractContextManager[object]:
    """What a scenario's children share: scenario 12's one PostgreSQL server (13's too), its DSN
    in their environment."""
    if scenario in ("postgres", "service"):
        from .postgres import shared_server

        return shared_server()
    return contextlib.nullcontext()


def run_scenario(
    scenario: Scenario, reps: int, timeout: float, started: float, records: list[dict[str, Any]]
) -> int:
    """Every case of `scenario`, `reps` times, variants alternating; the records appended to
    `records`; how many failed."""
    failures = 0
    for rep in range(reps):
        for group in scenario.groups:
            shift = rep % len(group)
            for case in group[shift:] + group[:shift]:
                if case.max_reps is not None and rep >= case.max_reps:
                    continue
                record = run_child(case, timeout)
                record["rep"] = rep
                records.append(record)
                elapsed = time.perf_counter() - started
                if "error" in record:
                    failures += 1
                    print(f"  FAILED {case.spec.label()}: {record['error']}", flush=True)
                    if record.get("stderr"):
                        print("    " + record["stderr"].strip().replace("\n", "\n    "))
                else:
                    print(
                        f"  [{elapsed:6.0f} s] rep {rep + 1}/{reps} {case.spec.label()}: "
                        f"{record['wall_s']:.4f} s, peak RSS {record['peak_rss_kb'] / 1024:.0f} MiB",
                        flush=True,
                    )
    return failures


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition (CI)")
    parser.add_argument(
        "--scenario",
        action="append",
        choices=SCENARIOS,
        metavar="NAME",
        help=f"run only this scenario (repeatable): {', '.join(SCENARIOS)}",
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="ROWS",
        help="run only these rows: comma-separated scenario, scenario/variant or "
        f"scenario/variant@loop selectors, or a preset ({', '.join(PRESETS)}); repeatable",
    )
    parser.add_argument("--reps", type=int, help="repetitions (default 5, smoke 1)")
    parser.add_argument(
        "--out",
        type=Path,
        help="results directory (default benchmarks/results; with --smoke a temporary directory)",
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds before a child is killed"
    )
    args = parser.parse_args(argv)
    if args.reps is not None and args.reps < 1:
        parser.error("--reps must be at least 1")
    try:
        args.selectors = parse_selectors(args.only or [])
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    reps = args.reps or sizes.reps
    timeout = args.timeout or (120.0 if args.smoke else 900.0)
    partial = bool(args.scenario or args.selectors)
    if args.out is not None:
        out = args.out
    elif args.smoke:
        out = Path(tempfile.mkdtemp(prefix="orchestra-bench-smoke-"))
    elif partial:
        out = PARTIAL_DIR  # a subset never overwrites the full run's results or the README
    else:
        out = RESULTS_DIR
    selected = args.scenario or list(SCENARIOS)
    scenarios = [s for s in plan(sizes) if s.name in selected]
    if args.selectors:
        try:
            scenarios = select(scenarios, args.selectors)
        except ValueError as exc:
            print(f"python -m benchmarks: --only: {exc}", file=sys.stderr)
            return 2

    started = time.perf_counter()
    records: list[dict[str, Any]] = []
    failures = 0
    for scenario in scenarios:
        print(f"== {scenario.title}", flush=True)
        with server_for(scenario.name):
            failures += run_scenario(scenario, reps, timeout, started, records)

    results: dict[str, Any] = {
        "generated": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "smoke": args.smoke,
        "only": [*(args.scenario or []), *(args.only or [])],
        "reps": reps,
        "scenarios": [{"name": s.name, "title": s.title} for s in scenarios],
        "duration_s": time.perf_counter() - started,
        "machine": machine_info(ROOT),
        "runs": records,
    }
    full_run = out.resolve() == RESULTS_DIR and not (args.smoke or partial)
    readme = PACKAGE_DIR / "README.md" if full_run else None
    paths = write_all(results, out, plots_wanted=not args.no_plots, readme=readme)
    print(f"\n{len(records)} runs in {results['duration_s']:.0f} s, {failures} failed")
    for path in paths:
        print(f"wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
