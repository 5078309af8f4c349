"""NVIDIA GPUs as compile targets on a machine without one: XLA's real GPU compiler, deviceless.

JAX's CUDA plugin can describe a GPU cluster that is not there (a PJRT *topology description*: one
GPU model's device description and a `<slices>x<hosts>x<gpus per host>` layout). Its devices build a
`jax.sharding.Mesh` like real ones, and `jit(f).lower(...).compile()` on that mesh runs XLA's whole
GPU pipeline (SPMD partitioning, fusion, the cuDNN / cuBLASLt rewrites, buffer assignment, PTX to
cubin) on the CPU. The result cannot run here, but its optimized HLO names every kernel the GPU
would launch and its memory analysis is the GPU's own. The planner (`plan --target=h100`) and the
`gpu_compile` tests use this; nothing here touches the process's real backends.

This module is the only place that knows the plugin: which package provides it, the environment it
needs (a process that asks JAX for the `cuda` platform without a GPU fails in the plugin's `cuInit`;
with `JAX_PLATFORMS=cpu` the plugin still registers its topology factory), how a GPU model is
described to it, and how a run's XLA flags become per-compile options.

The device descriptions are the published facts of each part (SM count, memory, caches, clocks,
bandwidth: chips.py's GpuSpec); the fields XLA plans with are those of its `GpuTargetConfigProto`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import re
from collections.abc import Sequence
from typing import Any

from paxlite.errors import UserError
from paxlite.parallel.compile_targets.target import CompileTarget, CompileUnavailableError

# The plugin JAX loads for CUDA 12 GPUs (`pip install 'jax[cuda12]'` brings it and the CUDA, cuDNN
# and ptxas wheels it compiles with).
PLUGIN_MODULE = "jax_plugins.xla_cuda12"
CUDNN_DISTRIBUTION = "nvidia-cudnn-cu12"
CUDA_RUNTIME_DISTRIBUTION = "nvidia-cuda-runtime-cu12"
# What XLA is told of cuDNN when its wheel's version cannot be read (the oldest the plugin accepts).
FALLBACK_CUDNN_VERSION = "9.10.0"
# What XLA is told of CUDA when the runtime wheel's version cannot be read (the plugin's build).
FALLBACK_CUDA_VERSION = "12.9.0"
DEFAULT_GPUS_PER_HOST = 8


class GpuCompileUnavailableError(CompileUnavailableError):
    """The GPU compiler cannot run in this process (plugin missing, or JAX started for a GPU)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuTopology:
    """`slices` x `hosts` (per slice) x `gpus_per_host`: the plugin's topology string."""

    slices: int = 1
    hosts: int = 1
    gpus_per_host: int = DEFAULT_GPUS_PER_HOST

    def __post_init__(self) -> None:
        for name in ("slices", "hosts", "gpus_per_host"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"GPU topology {name}={value!r}: expected a positive integer")

    @property
    def num_devices(self) -> int:
        return self.slices * self.hosts * self.gpus_per_host

    def __str__(self) -> str:
        return f"{self.slices}x{self.hosts}x{self.gpus_per_host}"

    @classmethod
    def parse(cls, text: str) -> GpuTopology:
        """'1x32x8' (slices x hosts x GPUs per host)."""
        match = re.fullmatch(r"\s*(\d+)x(\d+)x(\d+)\s*", str(text))
        if not match:
            raise UserError(f"GPU topology {text!r}: expected <slices>x<hosts>x<gpus per host>, "
                            "e.g. 1x32x8 for 256 GPUs on 32 hosts")
        slices, hosts, gpus = (int(g) for g in match.groups())
        return cls(slices=slices, hosts=hosts, gpus_per_host=gpus)

    @classmethod
    def for_devices(cls, num_devices: int, *,
                    gpus_per_host: int = DEFAULT_GPUS_PER_HOST) -> GpuTopology:
        """`num_devices` GPUs, `gpus_per_host` to a host (fewer: one host with them all)."""
        if num_devices <= gpus_per_host:
            return cls(hosts=1, gpus_per_host=num_devices)
        if num_devices % gpus_per_host:
            raise UserError(f"--devices={num_devices} is not a whole number of hosts of "
                            f"{gpus_per_host} GPUs; pass a multiple of {gpus_per_host}")
        return cls(hosts=num_devices // gpus_per_host, gpus_per_host=gpus_per_host)


def cudnn_version() -> str:
    """The cuDNN the plugin compiles with (its wheel's version, major.minor.patch)."""
    try:
        version = importlib.metadata.version(CUDNN_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return FALLBACK_CUDNN_VERSION
    return ".".join(version.split(".")[:3])


def cuda_version() -> str:
    """The CUDA runtime the plugin runs with (its wheel's major.minor, as cudaRuntimeGetVersion
    reports it: major.minor.0)."""
    try:
        version = importlib.metadata.version(CUDA_RUNTIME_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return FALLBACK_CUDA_VERSION
    major, minor = version.split(".")[:2]
    return f"{major}.{minor}.0"


def target_config_text(target: CompileTarget) -> str:
    """The `stream_executor.GpuTargetConfigProto` (text format) describing one `target` GPU.

    The per-block and per-thread limits are those of every NVIDIA part since Volta. The CUDA
    versions matter: XLA's GEMM rewriter reads `runtime_version` and, below CUDA 12, silently keeps
    FP8 dots out of cuBLASLt's FP8 GEMM (a description without it reads as 0.0.0); the driver is
    taken to be the runtime's own (the oldest that runs it)."""
    cuda = cuda_version()
    spec = target.spec
    major, minor = spec.compute_capability
    extension = "ACCELERATED_FEATURES" if major >= 9 else "NONE"  # sm_90a: wgmma, TMA
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {spec.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {spec.sm_count}
  fpus_per_core: {spec.fp32_units_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {spec.memory_bandwidth_bytes_per_s}
  l2_cache_size: {spec.l2_cache_bytes}
  clock_rate_ghz: {spec.sm_clock_ghz}
  device_memory_size: {spec.memory_bytes}
  shared_memory_per_block_optin: {spec.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} feature_extension: {extension} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  mem_clock_ghz: {spec.memory_clock_ghz}
  driver_version: "{cuda}"
  runtime_version: "{cuda}"
  compile_time_toolkit_version: "{cuda}"
  dnn_version: "{cudnn_version()}"
  name: "{spec.device_kind}"
}}
platform_name: "CUDA"
device_description_str: "{spec.device_kind}"
"""


def plugin_installed() -> bool:
    try:  # a missing parent package (jax_plugins) raises instead of returning None
        return importlib.util.find_spec(PLUGIN_MODULE) is not None
    except ModuleNotFoundError:
        return False


def plugin_problem() -> str | None:
    """Why this process cannot compile for a GPU (one line), or None when it can."""
    import jax

    if not plugin_installed():
        return ("compiling for a GPU without one needs JAX's CUDA plugin (XLA's GPU compiler, no "
                f"GPU or driver needed, ~5 GB): pip install 'jax[cuda12]=={jax.__version__}'")
    return None


def install_hint() -> str:
    import jax

    return f"pip install 'jax[cuda12]=={jax.__version__}'"


@functools.cache
def _topology_devices(target: CompileTarget, topology: str) -> tuple[Any, ...]:
    from jax.experimental import topologies

    description = topologies.get_topology_desc(
        f"paxlite-{target.value}-{topology}", platform="cuda", topology=topology,
        target_config=target_config_text(target))
    return tuple(description.devices)


def gpu_devices(target: CompileTarget, topology: GpuTopology) -> list[Any]:
    """The devices of `topology` GPUs of model `target`: compile-only (nothing runs on them).

    A missing plugin, or a process whose JAX asked for the CUDA platform without a GPU, is one
    GpuCompileUnavailableError saying what to do."""
    target = CompileTarget.parse(target)
    problem = plugin_problem()
    if problem:
        raise GpuCompileUnavailableError(problem)
    try:
        return list(_topology_devices(target, str(topology)))
    except Exception as error:  # the plugin's own message, kept on the one line
        text = " ".join(str(error).split())[:300]
        if "not implemented" in text or "cuInit" in text:
            raise GpuCompileUnavailableError(
                f"JAX's CUDA plugin gave no {target.value} topology ({text}): start JAX with "
                "JAX_PLATFORMS=cpu (set before JAX is imported) to compile for a GPU without "
                "one") from None
        raise


def compiler_options(flags: Sequence[str], env: Sequence[tuple[str, str]] = ()) -> dict[str, str]:
    """XLA flags (`--xla_name=value` tokens) and a preset's JAX environment as per-compile options,
    so a compile-only target gets the run's flags without changing this process's XLA_FLAGS.

    JAX_OPTIMIZATION_LEVEL becomes the `optimization_level` build option (what JAX itself does
    with it); other environment entries (memory fraction, ...) act at run time, not on the
    compile, and are left out."""
    options: dict[str, str] = {}
    for token in flags:
        name, _, value = token.lstrip("-").partition("=")
        if name.startswith("xla_"):
            # XLA parses an option's value by its field type: booleans as "True"/"False" only
            options[name] = {"true": "True", "false": "False"}.get(value.lower(), value)
    for name, value in env:
        if name == "JAX_OPTIMIZATION_LEVEL":
            options["optimization_level"] = value
    return options


@functools.cache
def preset_compiler_options(preset_name: str) -> dict[str, str]:
    """The XLA flags and JAX settings of one of paxlite's presets (paxlite.xla_presets), in the
    spellings this jaxlib parses (one probe per process), as compile options."""
    from paxlite import xla_presets

    preset = xla_presets.get_preset(preset_name)
    return compiler_options(xla_presets.resolve(preset).flags, preset.env)
