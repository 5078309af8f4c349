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

import gc
import json
import os
import shutil
import sys
import tempfile

from tests.fork_server import DISABLE_VAR as FORK_DISABLE_VAR
from tests.fork_server import FORK_DIR_VAR, GC_THRESHOLDS, stop_servers, write_client
from tests.fork_server import OWNER_VAR as FORK_OWNER_VAR
from tests.xla_test_flags import COMPILE_FLAGS, GPU_COMPILE_FLAGS

# Must happen before JAX is imported anywhere. The compile flags: see tests/xla_test_flags.py (not
# in the GPU pass, tests/gpu_pass.py, whose GPU kernels compile as in a run). A flag
# already set (by the developer, or by the controlling process for an xdist worker) is kept as it
# is.
GPU_PASS = os.environ.get("PAXLITE_TEST_GPU_PASS") == "1"
# tests/tpu_pass.py: the `tpu` tests on the chip, in this one process (only one program can hold
# the chip: no fork server, no subprocess that opens it), compiled as in a run.
TPU_PASS = os.environ.get("PAXLITE_TEST_TPU_PASS") == "1"
if TPU_PASS:
    os.environ[FORK_DISABLE_VAR] = "1"
_flags = os.environ.get("XLA_FLAGS", "").split()
_TEST_FLAGS = () if GPU_PASS or TPU_PASS else (COMPILE_FLAGS, *GPU_COMPILE_FLAGS.split())
for _flag in _TEST_FLAGS + ("--xla_force_host_platform_device_count=8",):
    if not any(f.split("=")[0] == _flag.split("=")[0] for f in _flags):
        _flags.append(_flag)
os.environ["XLA_FLAGS"] = " ".join(_flags)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_SESSION_CACHE_VAR = "PAXLITE_TEST_SESSION_CACHE"  # set by the controlling process, read by workers
if _SESSION_CACHE_VAR not in os.environ:  # the controlling process (or a run without xdist)
    os.environ[_SESSION_CACHE_VAR] = tempfile.mkdtemp(prefix="paxlite-tests-jax-cache-")
    _OWNED_CACHE = os.environ[_SESSION_CACHE_VAR]
else:
    _OWNED_CACHE = None
SESSION_COMPILATION_CACHE = os.environ[_SESSION_CACHE_VAR]
os.environ["JAX_COMPILATION_CACHE_DIR"] = SESSION_COMPILATION_CACHE

# The fork server (tests/fork_server.py): `python` on PATH is its client for the whole session, so
# the paxlite commands the tests start (the docs' commands, the launch scripts, the two-process
# runs) are forked from a process that has JAX, Flax, Orbax and paxlite imported already.
if FORK_DIR_VAR not in os.environ and os.environ.get(FORK_DISABLE_VAR) != "1":
    os.environ[FORK_DIR_VAR] = tempfile.mkdtemp(prefix="paxlite-tests-fork-")
    os.environ[FORK_OWNER_VAR] = str(os.getpid())
    _OWNED_FORK_DIR = os.environ[FORK_DIR_VAR]
    _client = write_client(_OWNED_FORK_DIR, sys.executable)
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(_client), os.environ.get("PATH", "")])
else:
    _OWNED_FORK_DIR = None

import jax
import pytest

# In the test processes themselves: every compile is kept (as paxlite's runs keep theirs), so the
# same program built by another test (or the other worker) is read back instead of compiled again;
# that includes the small programs Orbax compiles for each checkpoint save (test_loop.py and
# test_preemption.py together: 125.3 -> 120.3 CPU-s against a threshold of 0.3 s, 2026-12-05).
jax.config.update("jax_compilation_cache_dir", SESSION_COMPILATION_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

# Fewer collections (tests/fork_server.py says why), and none of them walks what is imported.
gc.set_threshold(*GC_THRESHOLDS)


def pytest_collection_finish(session):
    """Everything imported so far (JAX, the models, every collected test module) lives until the
    process ends: frozen, the collector never walks it again (pytest_collection_modifyitems has run
    by now)."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    if _OWNED_CACHE is not None and not hasattr(config, "workerinput"):
        shutil.rmtree(_OWNED_CACHE, ignore_errors=True)
    if _OWNED_FORK_DIR is not None and not hasattr(config, "workerinput"):
        stop_servers(_OWNED_FORK_DIR)
        shutil.rmtree(_OWNED_FORK_DIR, ignore_errors=True)


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices("gpu"))
    except RuntimeError:
        return False


def _has_tpu() -> bool:
    try:
        return any(d.platform == "tpu" for d in jax.devices("tpu"))
    except RuntimeError:
        return False


# Seconds each test took (setup, call and teardown) in the last recorded run on 2 cores, written by
# `make test-durations` (pytest --record-durations, which updates the entries of the files it
# runs). Tests missing from it (new ones) count as 0 s.
DURATIONS_FILE = os.path.join(os.path.dirname(__file__), "durations.json")
# A test measured above this is `slow` (left out of `make test-quick`) even without its own marker;
# the ones of tens of seconds carry @pytest.mark.slow in their file, with the reason. 1.5 s, not 2:
# at 2 a fresh clone's `make test-quick` took 146 to 182 s against its 180 s limit (2026-12-06).
QUICK_LIMIT_S = 1.5


def pytest_addoption(parser):
    parser.addoption("--record-durations", metavar="PATH", default=None,
                     help="record each test's seconds (setup + call + teardown) in PATH, a JSON "
                          "file updated with the tests run (tests/durations.json orders the suite "
                          "and marks the slow tests)")


def _recorded_durations() -> dict[str, float]:
    try:
        with open(DURATIONS_FILE) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def pytest_collection_modifyitems(config, items):
    # Longest file first (the longest-processing-time rule over files). The Makefile runs xdist with
    # --dist loadfile: a file's tests stay on one worker, so its module-scoped fixtures (a trained
    # job, the GPU benchmark's twelve runs) are built once, and each worker takes the next file when
    # it is free, so the long files are spread over the workers and the short ones fill in at the
    # end. Within a file the order is the file's own. Unmeasured tests marked slow or multiprocess
    # count as 30 s.
    if os.environ.get("JAX_PLATFORMS", "") == "cpu" or not _has_gpu():
        reason = ("needs an NVIDIA GPU: `make test` runs the gpu tests in a second pass on a "
                  "machine with one (tests/gpu_pass.py)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))
    if os.environ.get("JAX_PLATFORMS", "") == "cpu" or not _has_tpu():
        reason = ("needs a TPU: tests/tpu_pass.py runs the tpu tests on a machine with one "
                  "(benchmarks/tpu/run.sh)")
        for item in items:
            if "tpu" in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))
    _mark_gpu_compile(items)
    if GPU_PASS or TPU_PASS:
        return  # tests/gpu_pass.py gives the files most telling first: a timeout cuts the rest
    durations = _recorded_durations()
    slow = pytest.mark.slow(reason=f"measured over {QUICK_LIMIT_S:g} s on 2 cores "
                                   "(tests/durations.json)")
    def file_of(item) -> str:
        return item.nodeid.split("::")[0]

    file_seconds: dict[str, float] = {}
    for item in items:
        seconds = durations.get(item.nodeid)
        if seconds is None and ("slow" in item.keywords or "multiprocess" in item.keywords):
            seconds = 30.0
        file_seconds[file_of(item)] = file_seconds.get(file_of(item), 0.0) + (seconds or 0.0)
    # stable: a file keeps its order
    items.sort(key=lambda item: (-file_seconds[file_of(item)], file_of(item)))
    for item in items:
        if durations.get(item.nodeid, 0.0) > QUICK_LIMIT_S and "slow" not in item.keywords:
            item.add_marker(slow)
    # A fixture built once for several tests is paid by the first of them, so leaving that test out
    # would only move the cost to the next one: a test that shares a class-, module-, package- or
    # session-scoped fixture of the test files with a slow test is slow too.
    shared_by_slow = {fixture for item in items if "slow" in item.keywords
                      for fixture in _shared_fixtures(item)}
    shared = pytest.mark.slow(reason="shares a fixture with a slow test, which builds it")
    for item in items:
        if "slow" not in item.keywords and shared_by_slow.intersection(_shared_fixtures(item)):
            item.add_marker(shared)


# `gpu_compile` tests compile for H100/H200 with JAX's CUDA plugin
# (paxlite/parallel/compile_targets/gpu.py), which `make test` installs apart from the venv
# (.venv/gpu_compile, on PYTHONPATH in its own pytest session: see the Makefile). Elsewhere they are
# skipped, unless PAXLITE_REQUIRE_GPU_COMPILE=1 (that session sets it) makes a missing plugin an
# error instead.
REQUIRE_GPU_COMPILE = os.environ.get("PAXLITE_REQUIRE_GPU_COMPILE") == "1"


def _mark_gpu_compile(items) -> None:
    from paxlite.parallel.compile_targets import plugin_problem

    problem = plugin_problem() if any("gpu_compile" in item.keywords for item in items) else None
    if problem is None:
        return
    if REQUIRE_GPU_COMPILE:
        raise pytest.UsageError(f"PAXLITE_REQUIRE_GPU_COMPILE=1 but {problem}")
    skip = pytest.mark.skip(reason=f"gpu_compile: {problem} (make test installs it in "
                                   ".venv/gpu_compile)")
    for item in items:
        if "gpu_compile" in item.keywords:
            item.add_marker(skip)


def _shared_fixtures(item) -> set:
    """The fixtures of the test files (not pytest's own, such as tmp_path_factory) that `item` uses
    and that are built once for several tests (class, module, package or session scope)."""
    info = getattr(item, "_fixtureinfo", None)
    here = os.path.dirname(os.path.abspath(__file__))
    found = set()
    for defs in (info.name2fixturedefs.values() if info is not None else ()):
        for fixture_def in defs:
            code = getattr(fixture_def.func, "__code__", None)
            if (fixture_def.scope != "function" and code is not None
                    and os.path.abspath(code.co_filename).startswith(here)):
                found.add(fixture_def)
    return found


class _DurationRecorder:
    """Sums each test's phases as the reports arrive (in the controlling process under xdist) and
    writes them at the end of the session, rounded to 0.1 s, sorted by name.

    The file is updated, not replaced: the tests this session ran get their new entries, and the
    other entries are kept, but for those of test files that no longer exist. So a few files
    re-measured (`pytest FILES --record-durations=tests/durations.json`) and the gpu_compile
    session (a session of its own: see the Makefile) each add their part. A skipped test is not
    measured: it keeps its entry (the gpu_compile tests are skipped in a session without the
    plugin). An entry of a test renamed within its file stays behind unused: only the collected
    tests are looked up."""

    def __init__(self, path: str, *, rootdir: str):
        self.path, self.rootdir, self.seconds, self.skipped = path, rootdir, {}, set()

    def pytest_runtest_logreport(self, report):
        if report.skipped:
            self.skipped.add(report.nodeid)
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session):
        measured = {k: v for k, v in self.seconds.items() if k not in self.skipped}
        try:
            with open(self.path) as f:
                recorded = json.load(f)
        except FileNotFoundError:
            recorded = {}
        kept = {k: v for k, v in recorded.items()
                if os.path.exists(os.path.join(self.rootdir, k.split("::")[0]))}
        with open(self.path, "w") as f:
            json.dump({k: round(v, 1) for k, v in sorted({**kept, **measured}.items())}, f,
                      indent=0)
            f.write("\n")


def pytest_configure(config):
    # xdist's --dist loadscope/loadfile hands out files by their number of tests, most first, unless
    # told not to: that would undo the longest-first order of pytest_collection_modifyitems and
    # leave a long file with few tests (the GPU benchmark's, the docs' commands) for the end, with
    # the other worker idle while it runs.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    path = config.getoption("--record-durations")
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_DurationRecorder(path, rootdir=str(config.rootpath)),
                                      "paxlite-duration-recorder")
