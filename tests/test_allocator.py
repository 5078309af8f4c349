"""The test sessions' allocator: `make test` preloads the jemalloc it unpacked into the venv
(Makefile, JEMALLOC), which cuts the suite's CPU time by about a tenth (docs/performance.md)."""

import os

import pytest


def test_the_test_processes_allocate_with_jemalloc_where_make_found_it():
    """`make test` preloads the jemalloc it unpacked into the venv (Makefile, JEMALLOC): the loader
    must really map it into the test processes, or the suite silently runs slower."""
    preload = os.environ.get("LD_PRELOAD", "")
    if "libjemalloc" not in preload:
        pytest.skip("not started by make with jemalloc (no libjemalloc2 from apt-get download)")
    with open("/proc/self/maps") as f:
        assert "libjemalloc.so.2" in f.read(), preload
