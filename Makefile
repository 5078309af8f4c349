# `make test` and `make demo` work on a fresh machine with only Python 3.11 and the package index.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DIR ?= demo_job/$(shell date +%Y%m%d-%H%M%S)
PYTEST_ARGS ?=
# Test processes (pytest-xdist); each holds 8 simulated CPU devices and its own compiles (~1-3 GB).
TEST_WORKERS ?= 2

.PHONY: install test demo bench lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python setup.cfg pyproject.toml constraints.txt
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev,seqio,hf]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/python -m paxlite.demo --work_dir=build/demo --job_log_dir=$(DEMO_DIR)

# The rules of the house: style (ruff), one-way imports (import-linter contracts in pyproject.toml),
# and the shell scripts users launch (shellcheck; -x follows the scripts' `source common.sh`).
lint: $(STAMP)
	$(BIN)/ruff check paxlite tests benchmarks
	$(BIN)/lint-imports
	$(BIN)/shellcheck -x scripts_gpu/*.sh slurm/*.sub benchmarks/gpu/*.sh

bench: $(STAMP)
	$(BIN)/python benchmarks/cpu_step.py

clean:
	rm -rf $(VENV) demo_job build .pytest_cache
