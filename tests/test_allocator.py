"""The test sessions' allocator: `make test` preloads the jemalloc it unpacked into the venv
(Makefile, JEMALLOC), which cuts the suite's CPU time by about a tenth (docs/performance.md)."""

import os
import re
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The targets whose recipes run pytest (test-gpu-compile-session runs the gpu_compile and
# tpu_compile ones as sub-makes).
PYTEST_TARGETS = ("test-cpu-session", "test-gpu-compile-tests", "test-tpu-compile-session",
                  "test-quick")


def _recipe(makefile: str, target: str) -> str:
    match = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert match, f"no {target} target in the Makefile"
    return match[1]


def test_every_test_session_of_the_makefile_preloads_the_venvs_jemalloc():
    """Each target that runs pytest names the venv's jemalloc in LD_PRELOAD (`make -n` prints the
    commands without running them: only a line naming $(MAKE) would run, hence the first check,
    without which this test ran the gpu_compile, tpu_compile and Python 3.11 sessions inside the
    CPU session)."""
    with open(os.path.join(REPO, "Makefile")) as f:
        makefile = f.read()
    jemalloc = os.path.join(REPO, ".venv", "jemalloc", "libjemalloc.so.2")
    for target in PYTEST_TARGETS:
        assert "$(MAKE)" not in _recipe(makefile, target), (
            f"{target}'s recipe names $(MAKE): `make -n {target}` would run that line")
        printed = subprocess.run(["make", "-n", "--no-print-directory", target], cwd=REPO,
                                 capture_output=True, text=True, check=True).stdout
        sessions = [line for line in printed.splitlines() if "-m pytest" in line]
        assert sessions, (target, printed)
        for line in sessions:
            assert "LD_PRELOAD=" in line and jemalloc in line, (target, line)
    session = _recipe(makefile, "test-gpu-compile-session")
    assert "test-gpu-compile-tests" in session and "test-tpu-compile-session" in session


def test_a_preloaded_jemalloc_is_mapped_into_the_test_process():
    """The loader ignores a preload it cannot open (a wrong path, a library for another system)
    and the suite then runs with glibc's allocator, only slower: named in LD_PRELOAD (as `make`
    names it where it found one) means mapped, and not named means not mapped."""
    named = "libjemalloc" in os.environ.get("LD_PRELOAD", "")
    with open("/proc/self/maps") as f:
        mapped = "libjemalloc.so.2" in f.read()
    assert named == mapped, os.environ.get("LD_PRELOAD", "")
