"""The gpu_compile tests run in a pytest session of their own (`make test`'s second session, with
JAX's CUDA plugin on PYTHONPATH and tests/gpu_compile as its only path): a gpu_compile test written
anywhere else would be skipped by both sessions and never run."""

import os
import re

TESTS = os.path.dirname(os.path.abspath(__file__))
_MARK = re.compile(r"mark\.gpu_compile\b")


def test_every_gpu_compile_test_is_under_tests_gpu_compile():
    outside = []
    for root, _, files in os.walk(TESTS):
        if os.path.join(TESTS, "gpu_compile") in (root, os.path.dirname(root)):
            continue
        for name in files:
            path = os.path.join(root, name)
            if name.endswith(".py") and path != os.path.abspath(__file__):
                with open(path) as f:
                    if _MARK.search(f.read()):
                        outside.append(os.path.relpath(path, TESTS))
    assert outside == [], f"gpu_compile tests outside tests/gpu_compile/: {outside}"


def test_the_makefile_runs_tests_gpu_compile_with_the_plugin_required():
    with open(os.path.join(os.path.dirname(TESTS), "Makefile")) as f:
        makefile = f.read()
    assert "--ignore=tests/gpu_compile" in makefile
    # absolute: the docs' gpu_compile blocks run from a temporary directory
    assert re.search(r"PYTHONPATH=\$\(abspath \$\(GPU_COMPILE\)\) PAXLITE_REQUIRE_GPU_COMPILE=1 "
                     r".*(pytest|\$\(PYTEST\))",
                     makefile)
    assert re.search(r"--durations=10 tests/gpu_compile", makefile)
    assert re.search(r"^PYTEST := .*-m pytest$", makefile, re.MULTILINE)  # what $(PYTEST) runs
