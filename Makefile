# spectune developer targets.  `make setup` once, then `make test` / `make lint`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup test test-fast lint format typecheck conformance demo server dist clean

setup: $(BIN)/spectune

$(BIN)/spectune: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch first (for GPSampler), so pip never pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0 || $(BIN)/pip install -q --index-url https://download.pytorch.org/whl/cpu torch
	$(BIN)/pip install -q -e '.[server,gp,sim,dev]'
	touch $@

# Three pytest processes (pytest-xdist) on the two-core machines CI runs on: most tests wait on
# subprocesses, servers and the database, so more processes than cores fill those waits (the
# whole suite, idle, one run after the other on one clone: 842 s with two, 798 s with three);
# each test stays whole in one process (worksteal moves whole tests), and every fixture it needs
# is its own (fresh databases, free ports, marked processes).
test: setup
	TZ=UTC $(BIN)/python -m pytest -q -n 3 --dist worksteal

test-fast: setup
	TZ=UTC $(BIN)/python -m pytest -q -n 3 --dist worksteal -m "not slow"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy optimizer api workers spectune spectune_protocol spectune_sim

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

typecheck: setup
	$(BIN)/mypy optimizer api workers spectune spectune_protocol spectune_sim

# spectune's flags, defaults and adaptive schema against the source of every SGLang wheel listed in
# workers/launcher/supported.py (downloaded once into ~/.cache/spectune/sglang-wheels; keep that
# folder in CI's cache).  tests/test_conformance.py runs the same check inside `make test`.
conformance: setup
	$(BIN)/python -m spectune.conformance

demo: setup
	TZ=UTC $(BIN)/spectune demo

server: setup
	$(BIN)/spectune db upgrade && TZ=UTC $(BIN)/spectune server

# The wheel the API host and GPU hosts install (README "Running a real deployment"): spectune is
# not published on PyPI, so hosts install this file or a checkout, never the bare name.
dist:
	rm -rf dist build
	$(PY) -m pip wheel -q --no-deps -w dist .
	rm -rf build

clean:
	rm -rf dist build $(VENV) .mypy_cache .ruff_cache .pytest_cache spectune-demo *.egg-info
