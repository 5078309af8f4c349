"""Test set-up: eight fake CPU devices so that sharding is exercised on every test run, and one
persistent compilation cache for the whole test session.

The cache: many tests start `python -m paxlite.main` (and the launcher, the scripts, the docs'
commands) on the same tiny models, and each such process used to compile its step from nothing.
The controlling pytest process makes one temporary directory per session and exports it as JAX's
own ``JAX_COMPILATION_CACHE_DIR`` before xdist starts its workers, so the workers, every process
they start (which inherit the environment) and paxlite's runs (``job.compilation_cache`` uses that
variable when COMPILATION_CACHE_DIR is not set) share it: a step is compiled once per session.
Tests that check the cache itself set their own directory or remove the variable. The directory
is removed when the session ends.
"""

import os
import shutil
import tempfile

# Must happen before JAX is imported anywhere.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_SESSION_CACHE_VAR = "PAXLITE_TEST_SESSION_CACHE"  # set by the controlling process, read by workers
if _SESSION_CACHE_VAR not in os.environ:  # the controlling process (or a run without xdist)
    os.environ[_SESSION_CACHE_VAR] = tempfile.mkdtemp(prefix="paxlite-tests-jax-cache-")
    _OWNED_CACHE = os.environ[_SESSION_CACHE_VAR]
else:
    _OWNED_CACHE = None
SESSION_COMPILATION_CACHE = os.environ[_SESSION_CACHE_VAR]
os.environ["JAX_COMPILATION_CACHE_DIR"] = SESSION_COMPILATION_CACHE

import jax
import pytest

# In the test processes themselves: every compile that takes a moment is kept, so the same step
# built by another test (or the other worker) is read back instead of compiled again.
jax.config.update("jax_compilation_cache_dir", SESSION_COMPILATION_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.3)


def pytest_unconfigure(config):
    if _OWNED_CACHE is not None and not hasattr(config, "workerinput"):
        shutil.rmtree(_OWNED_CACHE, ignore_errors=True)


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices("gpu"))
    except RuntimeError:
        return False


def _expected_cost(item) -> int:
    """0 for tests marked slow (tens of seconds each), 1 for multi-process ones, 2 for the rest."""
    return 0 if "slow" in item.keywords else 1 if "multiprocess" in item.keywords else 2


def pytest_collection_modifyitems(config, items):
    # The long tests first (a stable sort keeps each file's order otherwise): xdist hands the first
    # items out round-robin, so the long ones are split over the workers and the short ones fill in
    # at the end, instead of one worker finishing a long test alone while the other idles.
    items.sort(key=_expected_cost)
    if os.environ.get("JAX_PLATFORMS", "") == "cpu" or not _has_gpu():
        skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU; none on this machine")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
