# make demo : fresh virtualenv -> torch 2.13.0 (CPU) -> dipaco and the demo's corpus -> the whole pipeline on BBC News
# make test : the same, plus the dev stack (pytest, Ray, the serving and eval clients...), then the test suite
# make lint : ruff, mypy and import-linter (the dev stack)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DIPACO := $(VENV)/bin/dipaco
CONFIG ?= configs/demo.yaml
RUN_DIR ?= runs/demo
# torch threads of the demo's jobs: on 2 cores a second thread shortened the wall time by less than it added CPU
# time (docs/results.md, "The demo"); `make demo DEMO_THREADS=2` for the shorter wall time
DEMO_THREADS ?= 1

.PHONY: install demo test lint clean-demo

# Two stamps: the demo installs only what it runs (dipaco and the BBC corpus); test and lint add the dev stack.
# --no-compile: pip would compile every module of torch, transformers, pandas... to bytecode, where the demo imports
# a fraction of them, which Python compiles (and caches) at their first import (docs/results.md, "The demo"). The test
# suite starts hundreds of interpreters, and some setups forbid writing bytecode at import
# (PYTHONDONTWRITEBYTECODE), so `make install` compiles the whole venv once; compileall's failures are those of a
# few files for other Python versions, which pip skips as well.
$(VENV)/.demo-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile torch==2.13.0
	$(PY) -m pip install --quiet --no-compile -e ".[demo]"
	touch $@

$(VENV)/.installed: $(VENV)/.demo-installed
	$(PY) -m pip install --quiet -e ".[dev,demo,bench]"
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.demo-installed
	@echo "== demo run directory: $(RUN_DIR) (starts fresh) =="
	rm -rf $(RUN_DIR)
	OMP_NUM_THREADS=$(DEMO_THREADS) $(DIPACO) pipeline --config $(CONFIG) run.dir=$(RUN_DIR) --baseline

# -rs lists every skipped test with its reason. .ci/run sets DIPACO_REQUIRE_E2E=1, which turns a
# skipped end-to-end test into a failure (tests/e2e_guard.py). The suite runs in 2 pytest-xdist workers, a
# test file each at a time (module fixtures run once), one torch thread each (tests/conftest.py): most of
# its time is single-threaded (imports, subprocess start-up), so 2 workers on 2 cores took 644 s where one
# took 905 s. `python -m pytest -n 0` runs it in one process. --max-worker-restart=0: a worker that dies fails
# the run at once, naming its test; restarted, pytest-xdist 3.8's loadfile scheduler could wait forever for it.
# --durations=15 ends the output with the slowest tests: CI's 20 minutes are spent there first.
# pyproject.toml's `timeout` (pytest-timeout) fails a test that hangs, with its traceback, and the run goes on.
test: install
	$(PY) -m pytest -q -rs -n 2 --dist loadfile --max-worker-restart=0 --durations=15

# ruff (lint, import order), mypy (types), import-linter (the layers in pyproject.toml, lazy imports included)
lint: install
	$(VENV)/bin/ruff check dipaco routing bench scripts tests
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

clean-demo:
	rm -rf $(RUN_DIR)

# The one-command GPU check of issue 35 (scripts/gpu_check.py --help): throughput, the CUDA code paths and a
# quality mini-regime within 700 s (two device calls: docs/notes/2026-11-27-gpu-check.md). CPU dry run: make gpu-check GPU_CHECK_ARGS="--device cpu --tiny".
# No `install` prerequisite: on a GPU machine without the venv, make gpu-check PY=python3.
.PHONY: gpu-check
gpu-check:
	$(PY) scripts/gpu_check.py --out runs/gpu_check $(GPU_CHECK_ARGS)
