"""The test sessions' allocator: `make test` preloads the jemalloc it unpacked into the venv
(Makefile, JEMALLOC), which cuts the suite's CPU time by about a tenth (docs/performance.md)."""

import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_test_session_of_the_makefile_preloads_the_venvs_jemalloc():
    """Each target that runs pytest names the venv's jemalloc in LD_PRELOAD (`make -n` prints the
    commands without running them)."""
    jemalloc = os.path.join(REPO, ".venv", "jemalloc", "libjemalloc.so.2")
    for target in ("test-cpu-session", "test-gpu-compile-session", "test-quick"):
        printed = subprocess.run(["make", "-n", "--no-print-directory", target], cwd=REPO,
                                 capture_output=True, text=True, check=True).stdout
        sessions = [line for line in printed.splitlines() if "-m pytest" in line]
        assert sessions, (target, printed)
        for line in sessions:
            assert "LD_PRELOAD=" in line and jemalloc in line, (target, line)


def test_a_preloaded_jemalloc_is_mapped_into_the_test_process():
    """The loader ignores a preload it cannot open (a wrong path, a library for another system)
    and the suite then runs with glibc's allocator, only slower: named in LD_PRELOAD (as `make`
    names it where it found one) means mapped, and not named means not mapped."""
    named = "libjemalloc" in os.environ.get("LD_PRELOAD", "")
    with open("/proc/self/maps") as f:
        mapped = "libjemalloc.so.2" in f.read()
    assert named == mapped, os.environ.get("LD_PRELOAD", "")
