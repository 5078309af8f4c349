"""tests/tpu_compile: programs and plans compiled for TPU slices by the TPU compiler (libtpu), on
this CPU-only machine.

`make test` installs libtpu apart from the venv (`make tpu-compile`: .venv/tpu_compile) and runs
these tests in a pytest session of their own with it on PYTHONPATH and
PAXLITE_REQUIRE_TPU_COMPILE=1, which makes a missing libtpu an error. Elsewhere (the CPU session
leaves this directory out; a bare `pytest tests/tpu_compile` without libtpu) they are skipped with
the line that says how to install it. Where JAX runs on the CPU (every test session but the TPU
pass) libtpu is loaded as the planner loads it (tpu.COMPILE_ONLY_ENV): beside other processes that
loaded it (a planner's subprocess, another session), and without its start-up warnings.
"""

import os
import pathlib

import pytest

from paxlite.parallel.compile_targets import libtpu_problem
from paxlite.parallel.compile_targets.tpu import COMPILE_ONLY_ENV

REQUIRE_TPU_COMPILE = os.environ.get("PAXLITE_REQUIRE_TPU_COMPILE") == "1"
HERE = pathlib.Path(__file__).parent

if os.environ.get("JAX_PLATFORMS") == "cpu":  # set by tests/conftest.py; before libtpu loads
    for _name, _value in COMPILE_ONLY_ENV.items():
        os.environ.setdefault(_name, _value)


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if HERE in pathlib.Path(str(item.path)).parents]
    problem = libtpu_problem() if mine else None
    if problem is None:
        return
    if REQUIRE_TPU_COMPILE:
        raise pytest.UsageError(f"PAXLITE_REQUIRE_TPU_COMPILE=1 but {problem}")
    skip = pytest.mark.skip(reason=f"tpu_compile: {problem}")
    for item in mine:
        item.add_marker(skip)
