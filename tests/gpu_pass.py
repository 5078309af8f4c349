"""Every `gpu`-marked test, on the GPU, in one pytest process.

The second pass of `make test` and the first part of benchmarks/gpu/run.sh.

    python tests/gpu_pass.py [--timeout_s=SECONDS] [PYTEST_ARGS...]

The CPU pass of `make test` runs with JAX_PLATFORMS=cpu (eight simulated devices for the sharding
tests), so its `gpu` tests are skipped there; here they run with JAX_PLATFORMS=cuda,cpu (the GPU the
default backend, the CPU still there for the tests that compare with it) and without the CPU-only
compile flags of tests/xla_test_flags.py. Without an NVIDIA GPU (`nvidia-smi -L` lists none) this
says so and exits 0.

GPU_TEST_FILES is every test file with a `gpu` test (tests/test_gpu_pass.py checks that none is
missing), most telling first: on a lent GPU with minutes to spare, a timeout cuts the least telling
off.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GPU_TEST_FILES = (
    # one training run on the GPU against the same run on the CPU: losses and every trained
    # parameter
    "tests/test_gpu.py",
    # cuDNN and Pallas-Triton flash attention against XLA's, forward and gradients; the kernel is in
    # the HLO
    "tests/models/test_attention_gpu.py",
    # USE_FP8's matmuls are FP8 GEMMs in the compiled step, not a BF16 GEMM with casts around it
    "tests/models/test_fp8_gpu.py",
    # Transformer Engine's layer computes paxlite's (skipped where TE is not installed)
    "tests/models/test_te_layer.py",
)
GPU_PLATFORMS = "cuda,cpu"


def has_gpu() -> bool:
    """Whether the NVIDIA driver lists a GPU (asked without starting JAX)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        listed = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listed.returncode == 0 and any(
        line.startswith("GPU ") for line in listed.stdout.splitlines()
    )


def pytest_command(extra: list[str]) -> list[str]:
    # -p no:cacheprovider: the GPU image's checkout may be read-only
    return [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "gpu",
        "-p",
        "no:cacheprovider",
        *GPU_TEST_FILES,
        *extra,
    ]


def environment(base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    env["JAX_PLATFORMS"] = GPU_PLATFORMS
    # tests/conftest.py: keep the given order, no CPU-only compile flags
    env["PAXLITE_TEST_GPU_PASS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeout_s", type=float, default=None,
                        help="stop the tests after this many seconds (exit 124)")
    args, extra = parser.parse_known_args(argv)
    if not has_gpu():
        print(
            "GPU tests: no NVIDIA GPU here (nvidia-smi lists none); the CPU pass skipped them",
            flush=True,
        )
        return 0
    command = pytest_command(extra)
    print("GPU tests: " + " ".join(command[1:]), flush=True)
    try:
        return subprocess.run(
            command,
            env=environment(dict(os.environ)),
            cwd=REPO,
            timeout=args.timeout_s,
            check=False,
        ).returncode
    except subprocess.TimeoutExpired:
        print(
            f"GPU tests: stopped at the {args.timeout_s:g} s timeout; the files after the last "
            "result did not run",
            flush=True,
        )
        return 124


if __name__ == "__main__":
    sys.exit(main())
