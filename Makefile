# spectune developer targets.  `make setup` once, then `make test` / `make lint`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo-setup torch-cpu test test-fast lint format typecheck conformance demo server dist clean

# Three installs, each a stamp in the venv (the `spectune` script alone cannot tell them apart):
#   demo-setup: `.[server,sim]`, what `make demo` runs on: no torch, nothing for CUDA;
#   torch-cpu:  torch for the `gp` sampler, as a CPU build (the local `+cpu` wheel or PyTorch's
#               CPU index); never the default index's Linux build, which is the CUDA one and pulls
#               cuDNN, NCCL, cuBLAS and Triton (several GB);
#   setup:      both, and the `gp` and `dev` extras: what `make test` and `make lint` need.
# README "Install" lists what each downloads (sizes measured there).
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
VENV_STAMP := $(VENV)/.spectune-venv
DEMO_STAMP := $(VENV)/.spectune-demo
TORCH_STAMP := $(VENV)/.spectune-torch-cpu
DEV_STAMP := $(VENV)/.spectune-dev

setup: $(DEV_STAMP)
demo-setup: $(DEMO_STAMP)
torch-cpu: $(TORCH_STAMP)

$(VENV_STAMP):
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	touch $@

$(DEMO_STAMP): pyproject.toml $(VENV_STAMP)
	$(BIN)/pip install -q -e '.[server,sim]'
	touch $@

# The `+cpu` local version exists only as a CPU build, so no index can answer it with CUDA; off
# Linux the plain version is the CPU build (PyTorch publishes CUDA builds for Linux and Windows
# only, and `+cpu` for both).  The configured indexes and find-links are asked first (a machine
# with the `+cpu` wheel on disk installs it offline); PyTorch's CPU index only when they lack it.
$(TORCH_STAMP): $(VENV_STAMP)
	case "$$(uname -s)" in \
	  Linux|MINGW*|MSYS*|CYGWIN*) $(BIN)/pip install -q 'torch==$(TORCH_VERSION)+cpu' 2>/dev/null \
	    || $(BIN)/pip install -q --extra-index-url $(TORCH_CPU_INDEX) 'torch==$(TORCH_VERSION)+cpu' ;; \
	  *) $(BIN)/pip install -q 'torch==$(TORCH_VERSION)' ;; \
	esac
	touch $@

$(DEV_STAMP): pyproject.toml $(TORCH_STAMP)
	$(BIN)/pip install -q -e '.[server,gp,sim,dev]'
	touch $@

# Three pytest processes (pytest-xdist) on the two-core machines CI runs on: most tests wait on
# subprocesses, servers and the database, so more processes than cores fill those waits (the
# whole suite, idle, one run after the other on one clone: 842 s with two, 798 s with three);
# each test stays whole in one process (worksteal moves whole tests), and every fixture it needs
# is its own (fresh databases, free ports, marked processes).
test: setup
	TZ=UTC $(BIN)/python -m pytest -q -n 3 --dist worksteal --durations=25

test-fast: setup
	TZ=UTC $(BIN)/python -m pytest -q -n 3 --dist worksteal -m "not slow"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy optimizer api workers spectune spectune_protocol spectune_sim
	$(BIN)/mypy -p benchmarks  # a namespace package: checked by name, not by path

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

typecheck: setup
	$(BIN)/mypy optimizer api workers spectune spectune_protocol spectune_sim
	$(BIN)/mypy -p benchmarks  # a namespace package: checked by name, not by path

# spectune's flags, defaults and adaptive schema against the source of every SGLang wheel listed in
# workers/launcher/supported.py (downloaded once into ~/.cache/spectune/sglang-wheels; keep that
# folder in CI's cache).  tests/spectune/test_conformance.py runs the same check inside `make test`.
conformance: setup
	$(BIN)/python -m spectune.conformance

demo: demo-setup
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
