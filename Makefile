# Two commands a new user runs: `make train` and `make test`. Both start with
# `make setup`, which is idempotent: a second run only checks and returns.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
STAMP := $(VENV)/.setup-stamp
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
# Debian's Chromium: the report test opens report.html in it, headless.
CHROMIUM := /usr/bin/chromium
# The real cluster tools tests/cluster/ runs against (Debian bookworm: Slurm 22.05,
# Open MPI 4.1, MPICH 4.0). The tests start and stop the daemons themselves.
CLUSTER_PKGS := slurmctld slurmd slurm-client munge openmpi-bin mpich iproute2 util-linux
CLUSTER_STAMP := /usr/sbin/slurmctld /usr/bin/mpirun.openmpi /usr/bin/mpiexec.mpich /usr/sbin/ip
# torch.compile's CPU code generator (inductor) builds C++ with the system compiler:
# the --compile tests run it.
CXX_BIN := /usr/bin/g++
TRAIN_ARGS ?=

.PHONY: setup train test lint typecheck layers docs unit clean peers-venv peers

setup: $(STAMP) $(FMNIST) $(CHROMIUM) $(CLUSTER_STAMP) $(CXX_BIN)

# torch first and pinned: it takes the local CPU wheel, so resolving the
# package's `torch` range afterwards installs nothing more (no CUDA wheels).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

# The real Fashion-MNIST from Debian (IDX gz files in /usr/share/datasets).
$(FMNIST):
	@if ! dpkg -s dataset-fashion-mnist >/dev/null 2>&1; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends dataset-fashion-mnist; \
	fi

# The report's browser test: a real headless Chromium (Debian's package, no download of
# a browser build by a test tool).
$(CHROMIUM):
	@if ! dpkg -s chromium >/dev/null 2>&1; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends chromium fonts-liberation; \
	fi

# Installed only where one is missing; a second `make setup` does not call apt-get.
$(CLUSTER_STAMP):
	@missing=""; for p in $(CLUSTER_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing; \
	fi

$(CXX_BIN):
	@if ! dpkg -s g++ >/dev/null 2>&1; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends g++; \
	fi

train: setup
	$(VENV)/bin/scaletrain train $(TRAIN_ARGS)

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks examples docs/hooks
	$(VENV)/bin/ruff format --check src tests benchmarks examples docs/hooks

typecheck: setup
	$(VENV)/bin/mypy

# The import layering in pyproject.toml ([tool.importlinter]).
layers: setup
	$(VENV)/bin/lint-imports

# The documentation site (mkdocs.yml, docs/) into site/. --strict: a broken link or
# anchor, a page left out of the nav, an API name that no longer resolves or a CLI
# reference that cannot be rendered fails the build. It needs no network.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# Two pytest workers (pytest-xdist), each test file on one of them (--dist loadfile: a
# module's shared runs are trained once), in the order tests/conftest.py sorts them,
# longest first (--no-loadscope-reorder: xdist would put the files of most tests
# first). A multi-process test spends much of its time starting processes and waiting
# on them (rendezvous, timeouts, signals), so one file at a time leaves a 2-core box's
# second core idle; more workers than cores would stretch the timing tests. PYTEST_WORKERS=0 runs the tests in this process, one at a time.
# pytest exits 5 when it collects no test: that is a failure for CI here, never a
# silent pass, so it is reported as such.
PYTEST_WORKERS ?= 2
test: lint typecheck layers docs
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder --durations=15; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The peers benchmark's optional contenders (Accelerate, Lightning Fabric) in their own
# venv beside the project's, never a dependency of scaletrain. The constraints file holds
# torch at the project's version, so pip resolves them against it and adds no other torch.
PEERS_VENV := benchmarks/.venv-peers
PEERS_STAMP := $(PEERS_VENV)/.setup-stamp
peers-venv: $(PEERS_STAMP)
$(PEERS_STAMP): benchmarks/contenders/requirements-peers.txt Makefile | $(STAMP)
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	echo "torch==$(TORCH_VERSION)" > $(PEERS_VENV)/constraints.txt
	$(PEERS_VENV)/bin/python -m pip install --quiet "torch==$(TORCH_VERSION)" numpy
	$(PEERS_VENV)/bin/python -m pip install --quiet -c $(PEERS_VENV)/constraints.txt \
		-r benchmarks/contenders/requirements-peers.txt
	touch $(PEERS_STAMP)

# The side-by-side comparison with the peers (benchmarks/RESULTS.md; ~25 min as is).
PEERS_ARGS ?=
peers: setup
	OMP_NUM_THREADS=1 $(PY) benchmarks/peers.py $(PEERS_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
