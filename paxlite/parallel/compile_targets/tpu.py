"""TPU slices as compile targets on a machine without one: the TPU compiler (libtpu), deviceless.

libtpu, the TPU runtime and compiler JAX loads for TPUs (`pip install 'jax[tpu]'`), can describe a
slice that is not there: `jax.experimental.topologies.get_topology_desc(topology_name="v5e:2x4",
platform="tpu")` gives its chips as compile-only devices, on a CPU-only machine, in a process whose
JAX runs on the CPU (`JAX_PLATFORMS=cpu`). A mesh over them compiles with the TPU's own pipeline
(SPMD partitioning, fusion, Mosaic for Pallas kernels, memory-space assignment, buffer assignment),
and `memory_analysis()` is the chip's. This module is the only place that knows libtpu: which
package provides it, how a slice is asked for, the environment a compile-only process needs, and
how to read its out-of-memory refusal.

The TPU compiler refuses a program that does not fit the chip's HBM (RESOURCE_EXHAUSTED,
"CompileTimeHbmOom: ... the total memory required for HLO temporaries (X G) exceeds available HBM
(Y G)"), where XLA's GPU compiler compiles it and lets the run fail. `hbm_oom` reads both figures
out of that message (the required total covers arguments, outputs and temporaries: checked against
`memory_analysis` with libtpu 0.0.50.1), so a plan that does not fit still has its peak, to 0.01
GiB. A larger limit cannot be asked for (`--xla_tpu_max_hbm_size_mib` only lowers it).

All of a slice's chips are given to one process (`chips_per_host_bounds` = the whole slice): a TPU
slice is one ICI domain whatever its hosts, and paxlite's mesh puts ICI axes within a process.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from typing import Any

from paxlite.parallel.compile_targets.target import CompileUnavailableError, TpuSlice

LIBTPU_MODULE = "libtpu"
MAKE_TARGET = "make tpu-compile"  # installs it apart from the venv, in .venv/tpu_compile

# The environment of a process that loads libtpu only to compile (JAX on the CPU platform), set
# where unset by the planner's processes and the tpu_compile tests. libtpu takes a machine-wide
# lock file (/tmp/libtpu_lockfile) when it loads, meant for the one process that drives the TPU:
# without ALLOW_MULTIPLE_LIBTPU_LOAD a second planner (or a planner beside the tests) fails with
# "Internal error when accessing libtpu multi-process lockfile". The other three keep libtpu from
# printing three warnings (no accelerator type, no worker hostnames, no host bounds) on a machine
# that is no TPU VM; the slice asked for is the same with and without them.
COMPILE_ONLY_ENV = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_SKIP_MDS_QUERY": "1",
                    "TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1"}

_OOM = re.compile(r"CompileTimeHbmOom.*?required for HLO temporaries \(([\d.]+)([KMGT])\).*?"
                  r"available HBM \(([\d.]+)([KMGT])\)")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


class TpuCompileUnavailableError(CompileUnavailableError):
    """The TPU compiler cannot run in this process (libtpu missing, or no slice could be made)."""


def libtpu_installed() -> bool:
    return importlib.util.find_spec(LIBTPU_MODULE) is not None


def install_hint() -> str:
    import jax

    return (f"pip install 'jax[tpu]=={jax.__version__}' (in a paxlite checkout: {MAKE_TARGET}, "
            "then PYTHONPATH=.venv/tpu_compile)")


def libtpu_problem() -> str | None:
    """Why this process cannot compile for a TPU (one line), or None when it can."""
    if libtpu_installed():
        return None
    return ("compiling for a TPU without one needs libtpu (the TPU compiler, no TPU needed, "
            f"~640 MB): {install_hint()}")


@functools.cache
def _slice_devices(tpu: TpuSlice) -> tuple[Any, ...]:
    from jax.experimental import topologies

    bounds = (*tpu.shape, 1)[:3]  # one process holds the whole slice (module docstring)
    description = topologies.get_topology_desc(
        topology_name=tpu.topology, platform="tpu",
        chip_config_name="megacore" if tpu.chip.megacore else "default",
        chips_per_host_bounds=bounds)
    return tuple(description.devices)


def tpu_devices(tpu: TpuSlice) -> list[Any]:
    """The chips of `tpu` as compile-only devices (one per chip; nothing runs on them).

    A missing libtpu, or a slice libtpu will not make, is one TpuCompileUnavailableError."""
    problem = libtpu_problem()
    if problem:
        raise TpuCompileUnavailableError(problem)
    try:
        devices = list(_slice_devices(tpu))
    except (RuntimeError, ValueError) as error:  # libtpu's own message, on the one line
        text = " ".join(str(error).split())[:300]
        raise TpuCompileUnavailableError(
            f"libtpu gave no {tpu.topology} slice ({text}); the TPU compiler needs JAX started "
            "on the CPU platform (JAX_PLATFORMS=cpu, set before JAX is imported)") from None
    if len(devices) != tpu.chips:  # one device per chip, megacore or not
        raise RuntimeError(f"libtpu made {len(devices)} devices of {tpu.topology}, expected "
                           f"{tpu.chips}")
    return devices


def hbm_oom(error: BaseException) -> tuple[int, int] | None:
    """(bytes the program needs, bytes the chip has) from the TPU compiler's refusal of a program
    that does not fit its HBM; None for any other error."""
    match = _OOM.search(" ".join(str(error).split()))
    if match is None:
        return None
    needed, needed_unit, available, available_unit = match.groups()
    return (round(float(needed) * _UNITS[needed_unit]),
            round(float(available) * _UNITS[available_unit]))
