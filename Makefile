# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# uv is bootstrapped into .tools/ with the machine's python3 when it is not on PATH.
PYTHON ?= python3
UV := $(shell command -v uv 2>/dev/null || echo .tools/bin/uv)

.PHONY: demo test lint bench bench-smoke sync clean

$(UV):
	$(PYTHON) -m venv .tools
	.tools/bin/pip install --quiet --disable-pip-version-check uv

.venv/.synced: pyproject.toml uv.lock | $(UV)
	$(UV) sync --locked --extra bench --extra claude --extra cli --quiet
	@touch $@

sync: .venv/.synced

# The demo needs the package and its `cli` extra only: no test tools, no benchmark peers.
demo: | $(UV)
	$(UV) run --locked --no-dev --extra cli python -m orchestra demo

test: sync
	$(UV) run --no-sync pytest --cov --cov-report=term

lint: sync
	$(UV) run --no-sync ruff check .
	$(UV) run --no-sync ruff format --check .
	$(UV) run --no-sync mypy
	$(UV) run --no-sync codespell orchestra tests examples benchmarks README.md

bench: sync
	$(UV) run --no-sync python -m benchmarks

bench-smoke: sync
	$(UV) run --no-sync python -m benchmarks --smoke

clean:
	rm -rf .venv .tools .pytest_cache .mypy_cache .ruff_cache
