# `make test` and `make demo` work on a fresh machine with only Python 3.12 and the package index.
# (JAX 0.11 and newer need Python >= 3.12; `make PYTHON=/path/to/python3.12` picks another interpreter.)
# The first Python 3.12 found: python3.12 on PATH (if it runs: a pyenv shim may refuse), then pyenv's.
PYTHON ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do \
	$$p -c '' 2>/dev/null && { echo $$p; break; }; done)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DIR ?= demo_job/$(shell date +%Y%m%d-%H%M%S)
PYTEST_ARGS ?=
# Test processes (pytest-xdist); each holds 8 simulated CPU devices and its own compiles (~1-3 GB).
TEST_WORKERS ?= 2
# The test sessions cache compiled Python in __pycache__ (gitignored) even where the shell sets
# PYTHONDONTWRITEBYTECODE (an empty value turns it off): the suite starts a few hundred Python
# processes, each of which would compile paxlite's sources again, and each xdist worker would
# rewrite every test module's assertions again (collection: 6.0 -> 2.8 CPU-s a worker).
# The test sessions (and every process they start) allocate with jemalloc where the machine's Debian
# archive has it (libjemalloc2, unpacked into the venv: no root, nothing installed system-wide):
# XLA's compiler, which is most of the suite's time, allocates and frees millions of small objects,
# and under glibc's allocator the same tests took 9-16% more CPU (docs/performance.md). Without it
# (no apt-get, no archive) the tests run as they are, slower, and `make` says so in one line.
# MALLOC_CONF (jemalloc's settings, unless set already): keep freed pages instead of returning them
# to the system after 10 s, which saved another ~5% of CPU for ~20% more resident memory.
JEMALLOC := $(VENV)/jemalloc/libjemalloc.so.2
TEST_PRELOAD := LD_PRELOAD="$$(test -f $(JEMALLOC) && echo $(abspath $(JEMALLOC)))$${LD_PRELOAD:+:$$LD_PRELOAD}" \
	MALLOC_CONF="$${MALLOC_CONF:-dirty_decay_ms:-1,muzzy_decay_ms:-1}"
PYTEST := $(TEST_PRELOAD) PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest

# XLA's GPU compiler for the gpu_compile tests (and `plan --target=h100` in this checkout): JAX's CUDA
# plugin and the CUDA libraries it compiles with, ~2.9 GB, kept out of the venv so that `make install`
# stays CPU-only and no other test process loads the plugin; only the gpu_compile session puts it on
# PYTHONPATH. GPU_COMPILE_PACKAGES are pinned in constraints.txt.
GPU_COMPILE := $(VENV)/gpu_compile
GPU_COMPILE_STAMP := $(GPU_COMPILE)/.installed
GPU_COMPILE_PACKAGES := jax-cuda12-plugin jax-cuda12-pjrt nvidia-cudnn-cu12 nvidia-cublas-cu12 \
	nvidia-cuda-nvcc-cu12 nvidia-nvjitlink-cu12 nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 \
	nvidia-cuda-cupti-cu12

# The TPU compiler for the tpu_compile tests (and `plan --target=v5e-8` in this checkout): libtpu (a 214 MB
# wheel, ~640 MB unpacked), kept out of the venv as the CUDA plugin is; only the tpu_compile session puts it
# on PYTHONPATH. Pinned in constraints.txt.
TPU_COMPILE := $(VENV)/tpu_compile
TPU_COMPILE_STAMP := $(TPU_COMPILE)/.installed

.PHONY: install gpu-compile tpu-compile test test-cpu-session test-gpu-compile-session test-gpu-compile-tests test-tpu-compile-session test-quick test-durations demo bench lint clean

$(BIN)/python:
	@test -n "$(PYTHON)" || { echo "no Python 3.12 found (python3.12, ~/.pyenv/versions/3.12*): install one, or make PYTHON=/path/to/python3.12"; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python setup.cfg pyproject.toml constraints.txt
	@$(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 12) and f"$(VENV) has Python {sys.version.split()[0]}; paxlite needs >= 3.12: run make clean, then make install")'
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev,seqio,hf,eval,wandb]'
	# torch's CUDA build (the only one PyPI has for Python 3.12) pulls in triton, whose import
	# segfaults once TensorFlow is loaded (both bundle LLVM); torch runs without it on CPU.
	$(BIN)/pip uninstall --yes --quiet triton
	touch $(STAMP)

install: $(STAMP)

$(JEMALLOC):
	@mkdir -p $(dir $@); tmp=$$(mktemp -d); \
	if (cd $$tmp && apt-get download libjemalloc2 >/dev/null 2>&1) \
		&& dpkg-deb -x $$tmp/libjemalloc2_*.deb $$tmp/root \
		&& cp $$tmp/root/usr/lib/*/libjemalloc.so.2 $@; then \
		echo "tests allocate with $$(basename $$tmp/libjemalloc2_*.deb) ($@)"; \
	else \
		echo "no libjemalloc2 from apt-get download here: the tests run with glibc's allocator (9-16% slower)"; \
	fi; rm -rf $$tmp

$(GPU_COMPILE_STAMP): $(STAMP) constraints.txt
	rm -rf $(GPU_COMPILE)
	$(BIN)/pip install --quiet --no-compile --no-deps --target $(GPU_COMPILE) -c constraints.txt $(GPU_COMPILE_PACKAGES)
	touch $@

gpu-compile: $(GPU_COMPILE_STAMP)

$(TPU_COMPILE_STAMP): $(STAMP) constraints.txt
	rm -rf $(TPU_COMPILE)
	$(BIN)/pip install --quiet --no-compile --no-deps --target $(TPU_COMPILE) -c constraints.txt libtpu
	touch $@

tpu-compile: $(TPU_COMPILE_STAMP)

# The whole suite, with the 30 slowest tests at the end of the log so the time budget stays visible
# (docs/performance.md has the figures). --dist loadfile: a file's tests run on one worker (its
# module fixtures are built once) and each worker takes the next file, longest first (tests/conftest.py).
# Beside it (make -j2), the gpu_compile tests (tests/gpu_compile/: programs compiled for H100/H200 by
# XLA's GPU compiler) in a session of their own with the plugin on PYTHONPATH, where a missing plugin is
# an error, not a skip: one process, which takes up the CPU time the first session leaves idle (its
# tests waiting on subprocesses, sleeps, its last files); its log follows the first session's.
# Then the gpu tests on the GPU, where there is one (tests/gpu_pass.py; without one it says so in a line).
# On a fresh machine the plugin's install (unpacking ~2.9 GB: one core for ~20 s) comes first in that
# second line of work.
GPU_COMPILE_LOG := build/gpu_compile_tests.log
TPU_COMPILE_LOG := build/tpu_compile_tests.log
test: $(STAMP) $(JEMALLOC)
	@rm -f $(GPU_COMPILE_LOG) $(TPU_COMPILE_LOG) $(PY311_LOG); status=0; \
		$(MAKE) --no-print-directory -j2 test-cpu-session test-gpu-compile-session || status=$$?; \
		echo "--- tests/gpu_compile (XLA's GPU compiler), beside the session above ---"; \
		cat $(GPU_COMPILE_LOG) 2>/dev/null || echo "(it did not start)"; \
		echo "--- tests/tpu_compile (the TPU compiler, libtpu), after tests/gpu_compile ---"; \
		cat $(TPU_COMPILE_LOG) 2>/dev/null || echo "(it did not start)"; \
		echo "--- make test-py311 (the oldest supported stack, installed), after tests/tpu_compile ---"; \
		cat $(PY311_LOG) 2>/dev/null || echo "(it did not start)"; exit $$status
	$(BIN)/python tests/gpu_pass.py
	$(BIN)/python tests/tpu_pass.py

# The gpu_compile session of `make test` (above): test-gpu-compile-tests, its output in $(GPU_COMPILE_LOG);
# then, in the same line of work, the tpu_compile session and make test-py311 (below), its output in
# $(PY311_LOG). The sessions run as sub-makes, each line of a pytest target holding no $(MAKE): `make -n`
# runs a line that names $(MAKE) instead of printing it (tests/test_allocator.py reads the pytest targets
# with `make -n`, which would otherwise run whole sessions inside the CPU session).
test-gpu-compile-session: $(GPU_COMPILE_STAMP) $(JEMALLOC)
	@status=0; \
	$(MAKE) --no-print-directory test-gpu-compile-tests || status=$$?; \
	$(MAKE) --no-print-directory test-tpu-compile-session || status=$$?; \
	$(MAKE) --no-print-directory test-py311 > $(PY311_LOG) 2>&1 || status=$$?; \
	exit $$status

# The gpu_compile tests alone (tests/gpu_compile: the plugin on PYTHONPATH, a missing plugin an error).
test-gpu-compile-tests: $(GPU_COMPILE_STAMP) $(JEMALLOC)
	@mkdir -p $(dir $(GPU_COMPILE_LOG))
	PYTHONPATH=$(abspath $(GPU_COMPILE)) PAXLITE_REQUIRE_GPU_COMPILE=1 $(PYTEST) -q -p no:xdist \
		--durations=10 tests/gpu_compile $(PYTEST_ARGS) > $(GPU_COMPILE_LOG) 2>&1

# The tpu_compile session (tests/tpu_compile: plans compiled by the TPU compiler, libtpu on PYTHONPATH,
# a missing libtpu an error), in the gpu_compile session's line of work; its output in $(TPU_COMPILE_LOG).
test-tpu-compile-session: $(TPU_COMPILE_STAMP) $(JEMALLOC)
	@mkdir -p $(dir $(TPU_COMPILE_LOG))
	PYTHONPATH=$(abspath $(TPU_COMPILE)) PAXLITE_REQUIRE_TPU_COMPILE=1 $(PYTEST) -q -p no:xdist \
		--durations=10 tests/tpu_compile $(PYTEST_ARGS) > $(TPU_COMPILE_LOG) 2>&1

# The first session of `make test`: every test but tests/gpu_compile and tests/tpu_compile, on CPU.
test-cpu-session: $(STAMP) $(JEMALLOC)
	$(PYTEST) -q -n $(TEST_WORKERS) --dist loadfile --durations=30 --ignore=tests/gpu_compile \
		--ignore=tests/tpu_compile $(PYTEST_ARGS)

# The inner loop: everything but the slow and multi-process tests (under 3 minutes on 2 cores).
# `slow`: marked in the test file, or measured over 1.5 s in tests/durations.json (tests/conftest.py).
test-quick: $(STAMP) $(JEMALLOC)
	$(PYTEST) -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not multiprocess" --durations=10 $(PYTEST_ARGS)

# The whole suite, recording each test's seconds in tests/durations.json (commit it): the suite runs
# longest first from it, and make test-quick leaves out what it measured as slow. The gpu_compile
# session records its own tests' seconds into the same file (--record-durations updates it).
test-durations: $(STAMP) $(GPU_COMPILE_STAMP) $(JEMALLOC)
	$(PYTEST) -q -n $(TEST_WORKERS) --dist loadfile --durations=30 --ignore=tests/gpu_compile \
		--record-durations=tests/durations.json $(PYTEST_ARGS)
	PYTHONPATH=$(abspath $(GPU_COMPILE)) PAXLITE_REQUIRE_GPU_COMPILE=1 $(PYTEST) -q -n $(TEST_WORKERS) \
		--dist loadfile --durations=10 tests/gpu_compile --record-durations=tests/durations.json $(PYTEST_ARGS)

# The oldest supported stack, installed as a user installs it: Python 3.11 with constraints-py311.txt
# (jax 0.10.2, the TPU image's versions) in a venv of its own, paxlite installed (not editable) from a
# copy of the checkout's sources, then tests/installed_check.py from a directory outside the checkout:
# the installed copy and versions, and TinySynthetic trained 3 steps on the CPU with a finite loss. The
# dependencies are installed once (again when setup.cfg, pyproject.toml or the constraints change);
# paxlite itself is reinstalled on every run, so the check sees the current code. `make test` runs it in
# its second line of work, after the gpu_compile and tpu_compile sessions; its log follows theirs.
# Measured on the 2-core machine under a load of 6-8 (2026-12-07): 2.0 min from nothing (venv, downloads,
# install, run; 47 CPU-s), 29 s a run after (the training 21 s of it).
# The first Python 3.11 found, as for PYTHON (one with ensurepip: a venv needs it).
PYTHON311 ?= $(shell for p in python3.11 $$HOME/.pyenv/versions/3.11*/bin/python3.11 /usr/bin/python3.11; do \
	$$p -c 'import ensurepip' 2>/dev/null && { echo $$p; break; }; done)
PY311 := $(VENV)/py311
PY311_STAMP := $(PY311)/.installed
PY311_LOG := build/py311_check.log
# The sources pip builds from: a copy, so that no build/ is left in the checkout (nor a stale file of it
# in the wheel).
PY311_SOURCES := src=$$(mktemp -d) && trap 'rm -rf $$src' EXIT && \
	cp -r paxlite setup.cfg pyproject.toml README.md $$src/
.PHONY: test-py311

$(PY311_STAMP): setup.cfg pyproject.toml constraints-py311.txt
	@test -n "$(PYTHON311)" || { echo "no Python 3.11 found (python3.11, ~/.pyenv/versions/3.11*, /usr/bin/python3.11): make test-py311 checks the oldest supported stack with it; install one, or make PYTHON311=/path/to/python3.11"; exit 2; }
	rm -rf $(PY311)
	$(PYTHON311) -m venv $(PY311)
	$(PY311)/bin/pip install --quiet --upgrade pip
	@$(PY311_SOURCES) && $(PY311)/bin/pip install --quiet -c constraints-py311.txt $$src
	touch $@

test-py311: $(PY311_STAMP)
	@$(PY311_SOURCES) && $(PY311)/bin/pip install --quiet --no-deps --force-reinstall $$src && \
		cd $$src/.. && $(abspath $(PY311))/bin/python $(abspath tests/installed_check.py) --python=3.11 \
			--constraints=$(abspath constraints-py311.txt) --checkout=$(CURDIR)

demo: $(STAMP)
	$(BIN)/python -m paxlite.demo --work_dir=build/demo --job_log_dir=$(DEMO_DIR)

# The rules of the house: style (ruff), one-way imports (import-linter contracts in pyproject.toml),
# the shell scripts users launch (shellcheck; -x follows the scripts' `source common.sh`), the container
# (hadolint: static, no Docker daemon) and the Kubernetes manifests (yamllint --strict with .yamllint's rules).
lint: $(STAMP)
	$(BIN)/ruff check paxlite tests benchmarks examples
	$(BIN)/lint-imports
	$(BIN)/shellcheck -x scripts_gpu/*.sh slurm/*.sub benchmarks/gpu/*.sh benchmarks/tpu/*.sh
	$(BIN)/hadolint docker/Dockerfile
	$(BIN)/yamllint --strict .yamllint k8s/

bench: $(STAMP)
	$(BIN)/python benchmarks/cpu_step.py

clean:
	rm -rf $(VENV) demo_job build .pytest_cache
