"""Every `tpu`-marked test, on the TPU, in one pytest process.

The first part of benchmarks/tpu/run.sh (and the TPU counterpart of tests/gpu_pass.py).

    python tests/tpu_pass.py [--timeout_s=SECONDS] [PYTEST_ARGS...]

The CPU pass of `make test` runs with JAX_PLATFORMS=cpu, so its `tpu` tests are skipped there; here
they run with JAX_PLATFORMS=tpu,cpu (the chip the default backend, the CPU still there for the
tests that compare with it), without the CPU-only compile flags of tests/xla_test_flags.py and
without the test fork server. One process: only one program at a time can hold a TPU (a second
one fails on libtpu's lock file), and opening the chip costs 6-15 s a program. Without a TPU
(no /dev/accel* or /dev/vfio device, and no TPU_ACCELERATOR_TYPE) this says so and exits 0.

TPU_MEMORY_FILE and TPU_TEST_FILES are every test file with a `tpu` test (tests/test_tpu_pass.py
checks that none is missing); the memory file first, in a process of its own, then the others most
telling first: on a lent chip with minutes to spare, a timeout cuts the least telling off.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time
from collections.abc import Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TPU_TEST_FILES = (
    # a training run on the chip against the same run on the CPU (losses and every parameter);
    # checkpoints between the two backends bit for bit; generate and lm_eval equal to the CPU's
    "tests/test_tpu.py",
    # XLA's attention and the splash kernel against float64 attention, forward and gradients, on
    # the chip; the kernel is in the compiled program
    "tests/models/test_attention_tpu.py",
)
# First, in a pytest process of its own: the allocator's peak counts all the process ever held.
TPU_MEMORY_FILE = "tests/test_tpu_memory.py"
TPU_PLATFORMS = "tpu,cpu"


def has_tpu(*, devices: str = "/dev", environ: dict[str, str] | None = None) -> bool:
    """Whether this host has a TPU, asked without starting JAX (which would hold the chip): a TPU
    VM exposes its chips as /dev/accel* (v4, v5p) or through VFIO (/dev/vfio/N: v5e, v6e), and its
    runtime environment names the accelerator type."""
    environ = os.environ if environ is None else environ
    accel = glob.glob(os.path.join(devices, "accel*"))
    # /dev/vfio/vfio is VFIO's control device; the numbered entries are the bound chips' groups
    vfio = [path for path in glob.glob(os.path.join(devices, "vfio", "*"))
            if os.path.basename(path) != "vfio"]
    return bool(accel) or (bool(vfio) and "TPU_ACCELERATOR_TYPE" in environ)


def pytest_command(files: Sequence[str], extra: list[str]) -> list[str]:
    # -p no:cacheprovider: the TPU host's checkout may be read-only; -p no:xdist: one process
    return [sys.executable, "-m", "pytest", "-q", "-m", "tpu", "-p", "no:cacheprovider",
            "-p", "no:xdist", *files, *extra]


def environment(base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    env["JAX_PLATFORMS"] = TPU_PLATFORMS
    # tests/conftest.py: the given order, no CPU-only compile flags, no fork server
    env["PAXLITE_TEST_TPU_PASS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), REPO) if p)
    return env


def main(argv: list[str] | None = None, *, devices: str = "/dev",
         environ: dict[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeout_s", type=float, default=None,
                        help="stop the tests after this many seconds (exit 124)")
    args, extra = parser.parse_known_args(argv)
    if not has_tpu(devices=devices, environ=environ):
        print("TPU tests: no TPU here (no /dev/accel* or /dev/vfio chip); the CPU pass skipped "
              "them", flush=True)
        return 0
    deadline = None if args.timeout_s is None else time.monotonic() + args.timeout_s
    status = 0
    for files in ((TPU_MEMORY_FILE,), TPU_TEST_FILES):  # one process each, one after the other
        command = pytest_command(files, extra)
        print("TPU tests: " + " ".join(command[1:]), flush=True)
        left = None if deadline is None else max(1.0, deadline - time.monotonic())
        try:
            done = subprocess.run(command, env=environment(dict(os.environ)), cwd=REPO,
                                  timeout=left, check=False)
        except subprocess.TimeoutExpired:
            print(f"TPU tests: stopped at the {args.timeout_s:g} s timeout; the files after the "
                  "last result did not run", flush=True)
            return 124
        status = status or done.returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
