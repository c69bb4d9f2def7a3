# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# uv is bootstrapped into .tools/ with the machine's python3 when it is not on PATH.
PYTHON ?= python3
UV := $(shell command -v uv 2>/dev/null || echo .tools/bin/uv)

.PHONY: demo test test-3.13 lint docs bench bench-smoke sync clean chromium screenshot

$(UV):
	$(PYTHON) -m venv .tools
	.tools/bin/pip install --quiet --disable-pip-version-check uv

# What the tests and linters need (the dev group, the claude, cli and service extras); not the benchmark
# peers, which `make bench` adds (the bench dependency group).
.venv/.synced: pyproject.toml uv.lock | $(UV)
	$(UV) sync --locked --extra claude --extra cli --extra service --quiet
	@touch $@

sync: .venv/.synced

# Always run (no stamp): `make sync` removes the group again, and uv does nothing when in sync.
BENCH_SYNC = $(UV) sync --locked --group bench --extra claude --extra cli --extra service --quiet

# The demo needs the package and its `cli` extra only: no test tools, no benchmark peers.
demo: | $(UV)
	$(UV) run --locked --no-dev --extra cli python -m orchestra demo

# The whole suite, in-process and `subprocess`-marked tests alike, over pytest-xdist workers: two per
# core, as the tests wait more than they compute (real processes, leases, real-time sleeps); with
# worksteal, a worker that runs out takes tests from one still holding long ones. Every test keeps
# its files, ports and processes to itself, so any two may run side by side.
PYTEST_WORKERS ?= $(shell $(PYTHON) -c 'import os; print(2 * (os.cpu_count() or 1))')
PYTEST_PARALLEL = -n $(PYTEST_WORKERS) --dist worksteal

test: sync chromium
	$(UV) run --no-sync pytest $(PYTEST_PARALLEL) --cov --cov-report=term

# The dashboard's browser tests drive Debian's `chromium` (Playwright's own browser download cannot
# reach its host from every machine): installed when it is missing and apt-get can (as root).
# Elsewhere those tests skip, saying how to install it; under CI=true they fail instead.
CHROMIUM ?= /usr/bin/chromium

chromium:
	@if [ ! -x "$(CHROMIUM)" ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "chromium: installing Debian's chromium for the dashboard's browser tests"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
			|| echo "chromium: apt-get could not install it: the dashboard's browser tests will say so"; \
	fi

# The suite again on CPython 3.13 when this machine has one (pyenv's): the package says >= 3.11,
# and 3.13 reports leaks 3.11 keeps quiet (an unclosed sqlite3 connection, a process not reaped).
# Without one it says so and passes: `make test` (3.11) is the suite every machine runs. The
# PostgreSQL tests (half the suite's time) run once, under 3.11: what 3.13 tells apart (leaks,
# processes not reaped, asyncio's changes) the SQLite, process and engine tests exercise too,
# and CI's whole run stays within its budget.
PYTHON313 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.13*/bin/python3.13))

test-3.13: chromium | $(UV)
	@if [ -z "$(PYTHON313)" ]; then echo "test-3.13: no CPython 3.13 on this machine: skipped"; exit 0; fi; \
	UV_PROJECT_ENVIRONMENT=.venv-3.13 $(UV) sync --locked --python "$(PYTHON313)" --extra claude --extra cli --extra service --quiet && \
	UV_PROJECT_ENVIRONMENT=.venv-3.13 $(UV) run --no-sync pytest $(PYTEST_PARALLEL) -q -m "not postgres"

# The docs' dashboard screenshot (docs/images/dashboard.png), taken again by its browser test.
screenshot: sync chromium
	ORCHESTRA_UPDATE_SCREENSHOT=1 $(UV) run --no-sync pytest -q tests/test_service_dashboard.py -k screenshot

lint: sync
	$(UV) run --no-sync ruff check .
	$(UV) run --no-sync ruff format --check .
	$(UV) run --no-sync mypy
	$(UV) run --no-sync lint-imports --no-cache
	$(UV) run --no-sync codespell orchestra tests examples benchmarks docs README.md CONTRIBUTING.md CHANGELOG.md

# The documentation site, strict (a broken link or a docstring the API reference cannot read
# fails it), into site/. Its own environment, .venv-docs, with the docs dependency group alone:
# mkdocstrings reads the package's source, it does not import it.
docs: | $(UV)
	UV_PROJECT_ENVIRONMENT=.venv-docs $(UV) sync --locked --only-group docs --quiet
	NO_MKDOCS_2_WARNING=1 .venv-docs/bin/mkdocs build --strict --quiet

bench: | $(UV)
	$(BENCH_SYNC)
	$(UV) run --no-sync python -m benchmarks

bench-smoke: | $(UV)
	$(BENCH_SYNC)
	$(UV) run --no-sync python -m benchmarks --smoke

clean:
	rm -rf .venv .venv-3.13 .venv-docs site .tools .pytest_cache .mypy_cache .ruff_cache
