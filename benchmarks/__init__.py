"""orchestra's benchmark suite: ``python -m benchmarks`` (full) or ``python -m benchmarks --smoke`` (CI).

Modules, each importing only those listed before it: `spec` (what one run is), `variants` (the
workloads), `child` (runs one spec in a fresh process), `scenarios` (the plan), `machine`,
`report` (medians, targets, markdown, plots), and `__main__` (the runner).
"""
