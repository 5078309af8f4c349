"""Compile targets: what the planner compiles a train step for, with the compiler of each.

- `cpu`: XLA's CPU compiler on this process's (fake) CPU devices.
- `h100`, `h200`, `a100`: XLA's GPU compiler for compile-only GPUs of that model (JAX's CUDA
  plugin, no GPU needed: gpu.py).
- A TPU slice (`v5e-8`, `v5p-512`, `v6e-256`, `v4-8`, or a topology such as `v5e:2x4`): the TPU
  compiler for its compile-only chips (libtpu, no TPU needed: tpu.py).

target.py parses `--target` once into a `CompileTarget`; chips.py holds every accelerator fact
(peaks, memory, slice shapes) that the targets and MFU (paxlite/train/flops.py) read;
platform.py tells the models which platform a step is being built for. Nothing here imports JAX
until a device is asked for.
"""

from __future__ import annotations

from typing import Any

from paxlite.parallel.compile_targets.chips import (
    PEAKS,
    TPU_CHIPS,
    GpuSpec,
    Peaks,
    TpuChip,
    TpuGeneration,
    peaks_for_device_kind,
)
from paxlite.parallel.compile_targets.gpu import (
    GpuCompileUnavailableError,
    GpuTopology,
    compiler_options,
    gpu_devices,
    plugin_installed,
    plugin_problem,
    preset_compiler_options,
    target_config_text,
)
from paxlite.parallel.compile_targets.platform import compile_platform, spec_for_device_kind
from paxlite.parallel.compile_targets.target import (
    GPU_SPECS,
    CompileTarget,
    CompileUnavailableError,
    TargetKind,
    TpuSlice,
    valid_forms,
)
from paxlite.parallel.compile_targets.tpu import (
    TpuCompileUnavailableError,
    hbm_oom,
    libtpu_problem,
    tpu_devices,
)

__all__ = ["GPU_SPECS", "PEAKS", "TPU_CHIPS", "CompileTarget", "CompileUnavailableError",
           "GpuCompileUnavailableError", "GpuSpec", "GpuTopology", "Peaks", "TargetKind",
           "TpuChip", "TpuCompileUnavailableError", "TpuGeneration", "TpuSlice",
           "compile_platform", "compiler_options", "compiler_problem", "gpu_devices", "hbm_oom",
           "libtpu_problem", "peaks_for_device_kind", "plugin_installed", "plugin_problem",
           "preset_compiler_options", "spec_for_device_kind", "target_config_text",
           "target_devices", "tpu_devices", "valid_forms"]


def compiler_problem(target: CompileTarget) -> str | None:
    """Why this process cannot compile for `target` (one line: what to install), or None."""
    if target.is_gpu:
        return plugin_problem()
    if target.is_tpu:
        return libtpu_problem()
    return None


def unavailable_error(target: CompileTarget, problem: str) -> CompileUnavailableError:
    return (TpuCompileUnavailableError if target.is_tpu else GpuCompileUnavailableError)(problem)


def target_devices(target: CompileTarget, *, hosts: int, num_devices: int) -> list[Any]:
    """Compile-only devices of a GPU or TPU target: `num_devices` GPUs on `hosts` hosts (the run's
    nodes), or the TPU slice's chips (one process; `num_devices` must be its chips)."""
    if target.tpu is not None:
        if num_devices != target.tpu.chips:
            raise ValueError(f"--devices={num_devices} but --target={target} has "
                             f"{target.tpu.chips} chips")
        return tpu_devices(target.tpu)
    if target.is_gpu:
        return gpu_devices(target, GpuTopology(hosts=hosts, gpus_per_host=num_devices // hosts))
    raise ValueError("the cpu target's devices are this process's (jax.devices())")
