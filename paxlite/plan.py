"""Will it fit? Compile a run's train step ahead of time on fake CPU devices and read its memory.

Nothing is allocated: the state and the batch are ShapeDtypeStructs carrying their shardings, and
`jit(...).lower(...).compile()` runs XLA's SPMD partitioner and buffer assignment for one device's
program. The numbers are those of the *CPU* compiler: GPU fusion and buffer assignment differ (cuDNN
attention, different fusions), so temporaries are an estimate; parameter, optimizer-state and
gradient bytes are exact (they follow from shapes and shardings alone). The CPU stands in because a
deviceless CUDA compile needs the CUDA plugin on the planning machine (see the AOT notes in
docs/parallelism.md).

This module finds the devices and puts the plan together: one compile and its reading
(paxlite/plan_search.py), then, when the run does not fit, the levers, and when asked (always for a
run with a seq axis) the longest sequence that fits (both paxlite/plan_levers.py); the result is a
JSON-friendly dict that paxlite/plan_report.py prints. The planner needs as many JAX devices as the
mesh has. Fake CPU devices are set by `XLA_FLAGS=--xla_force_host_platform_device_count=N` before
JAX starts; a process whose JAX already started with fewer devices (pytest has 8, `python -m
paxlite.main` has its real ones) plans in a fresh `python -m paxlite plan` subprocess instead.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from paxlite.plan_levers import DEFAULT_SEQ_STEP, find_longest_seq, levers
from paxlite.plan_report import format_text
from paxlite.plan_search import (
    DEFAULT_DEVICE_MEMORY_GIB,
    DEFAULT_PEAK_TFLOPS,
    GIB,
    PlanError,
    compile_train_step,
    plan_base,
)

__all__ = ["DEFAULT_DEVICE_MEMORY_GIB", "DEFAULT_PEAK_TFLOPS", "DEFAULT_SEQ_STEP", "GIB",
           "LongestSeq", "OutputFormat", "PlanError", "PlanRequest", "compile_train_step", "dry_run",
           "emit", "fake_device_env", "format_text", "plan", "plan_command_line", "plan_experiment",
           "prepare_this_process", "run_plan_command"]

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# The planner compiles to read XLA's buffer assignment and cost analysis, both decided before LLVM turns the
# program into CPU code that is never run: LLVM at level 0 gives the same bytes and FLOPs sooner (LLaMA70B on
# 16 devices, its 80-layer step: 87.9 s -> 70.7 s; with 8 layers 18.3 s -> 9.0 s; every memory figure equal).
_CODEGEN_LEVEL_FLAG = "--xla_backend_optimization_level"


class OutputFormat(str, enum.Enum):
    TEXT = "text"
    JSON = "json"


class LongestSeq(str, enum.Enum):
    """Whether the plan searches for the longest sequence that fits (a few more compiles)."""

    AUTO = "auto"  # for a run with a seq axis, where the length is the question
    ON = "on"  # for any run
    OFF = "off"

    def wanted(self, *, seq: int) -> bool:
        return self is LongestSeq.ON or (self is LongestSeq.AUTO and seq > 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What to plan: the experiment as typed on the command line, and the hardware to plan for."""

    name: str
    assignments: tuple[str, ...] = ()
    num_devices: int
    device_memory_gib: float = DEFAULT_DEVICE_MEMORY_GIB
    peak_tflops: float = DEFAULT_PEAK_TFLOPS
    longest_seq: LongestSeq = LongestSeq.AUTO
    seq_step: int = DEFAULT_SEQ_STEP  # the longest sequence's granularity, in tokens

    def __post_init__(self) -> None:
        for flag, value in (("--devices", self.num_devices), ("--seq_step", self.seq_step)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag}={value!r}: expected a positive integer")
        try:
            object.__setattr__(self, "longest_seq", LongestSeq(self.longest_seq))
        except ValueError:
            raise ValueError(f"--longest_seq={self.longest_seq!r}: expected one of "
                             f"{', '.join(mode.value for mode in LongestSeq)}") from None
        for flag, value in (("--device_memory_gib", self.device_memory_gib),
                            ("--peak_tflops", self.peak_tflops)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{flag}={value!r}: expected a positive number")


# ------------------------------------------------------------------------------------------------
# Devices: this process, or a fresh one with enough fake CPU devices


def fake_device_env(num_devices: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default os.environ) with XLA_FLAGS asking for exactly `num_devices` CPU devices, and for
    LLVM's quickest code generation (_CODEGEN_LEVEL_FLAG) unless XLA_FLAGS already sets a level."""
    env = dict(os.environ if base is None else base)
    flags = re.sub(rf"{_DEVICE_COUNT_FLAG}=\S*", "", env.get("XLA_FLAGS", "")).split()
    if not any(flag.startswith(_CODEGEN_LEVEL_FLAG + "=") for flag in flags):
        flags.append(f"{_CODEGEN_LEVEL_FLAG}=0")
    env["XLA_FLAGS"] = " ".join([*flags, f"{_DEVICE_COUNT_FLAG}={num_devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def prepare_this_process(num_devices: int) -> bool:
    """True when this process can plan for `num_devices` (setting the fake devices if JAX has not
    started yet); False when JAX already runs with other devices and a subprocess must plan."""
    if "jax" not in sys.modules:
        os.environ.update(fake_device_env(num_devices))
        return True
    import jax

    devices = jax.devices()
    return devices[0].platform == "cpu" and len(devices) >= num_devices


def plan_command_line(request: PlanRequest, *, output_format: OutputFormat) -> list[str]:
    """The `python -m paxlite plan ...` command that plans `request` in a fresh process."""
    return [
        sys.executable, "-m", "paxlite", "plan", f"--fdl_config={request.name}",
        *(f"--fdl.{a}" for a in request.assignments),
        f"--devices={request.num_devices}",
        f"--device_memory_gib={request.device_memory_gib!r}",
        f"--peak_tflops={request.peak_tflops!r}",
        *([] if request.longest_seq is LongestSeq.AUTO else
          [f"--longest_seq={request.longest_seq.value}"]),
        *([] if request.seq_step == DEFAULT_SEQ_STEP else [f"--seq_step={request.seq_step}"]),
        f"--format={output_format.value}",
    ]


def plan_in_subprocess(request: PlanRequest) -> dict[str, Any]:
    """Plan in a fresh process; its error message (one line on stderr) becomes a PlanError."""
    result = subprocess.run(
        plan_command_line(request, output_format=OutputFormat.JSON),
        capture_output=True, text=True, env=fake_device_env(request.num_devices), check=False,
    )
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        raise PlanError(lines[-1] if lines else f"the planner exited with {result.returncode}")
    return json.loads(result.stdout)


def plan(request: PlanRequest) -> dict[str, Any]:
    """The plan of `request`, in this process when its devices allow, else in a subprocess."""
    if not prepare_this_process(request.num_devices):
        return plan_in_subprocess(request)
    from paxlite.experiments.build import load_experiment

    return plan_experiment(
        load_experiment(request.name, request.assignments),
        num_devices=request.num_devices,
        device_memory_gib=request.device_memory_gib,
        peak_tflops=request.peak_tflops,
        longest_seq=request.longest_seq,
        seq_step=request.seq_step,
    )


def plan_experiment(experiment, *, num_devices: int,
                    device_memory_gib: float = DEFAULT_DEVICE_MEMORY_GIB,
                    peak_tflops: float = DEFAULT_PEAK_TFLOPS,
                    longest_seq: LongestSeq = LongestSeq.AUTO,
                    seq_step: int = DEFAULT_SEQ_STEP) -> dict[str, Any]:
    """The plan (a JSON-friendly dict) of `experiment` on `num_devices` devices of this process:
    the compiled step, levers when it does not fit, the longest sequence when `longest_seq` asks."""
    started = time.perf_counter()
    result, base = plan_base(experiment, num_devices=num_devices,
                             device_memory_gib=device_memory_gib, peak_tflops=peak_tflops)
    device_bytes = result["device_memory_bytes"]
    if not result["fits"]:
        result["levers"] = levers(experiment, base, num_devices=num_devices,
                                  device_bytes=device_bytes)
    result["longest_seq"] = None
    if LongestSeq(longest_seq).wanted(seq=base["mesh"]["seq"]):
        result["longest_seq"] = find_longest_seq(
            experiment, base, num_devices=num_devices, device_bytes=device_bytes, step=seq_step)
    result["plan_s"] = round(time.perf_counter() - started, 2)
    return result


# ------------------------------------------------------------------------------------------------
# Entry points


def emit(p: dict[str, Any], output_format: OutputFormat) -> str:
    return json.dumps(p, indent=2) if output_format is OutputFormat.JSON else format_text(p)


def run_plan_command(request: PlanRequest, *, output_format: OutputFormat) -> int:
    """`python -m paxlite plan`: prints the plan; a bad configuration exits 2 with one line."""
    # First, before anything imports JAX (paxlite.parallel does): a fresh process plans itself.
    if not prepare_this_process(request.num_devices):
        command = plan_command_line(request, output_format=output_format)
        return subprocess.run(command, env=fake_device_env(request.num_devices),
                              check=False).returncode
    from paxlite.config.errors import ConfigError
    from paxlite.parallel.mesh import MeshError

    try:
        print(emit(plan(request), output_format))
    except (ConfigError, MeshError, PlanError, ValueError) as e:
        print(f"paxlite: error: {e}", file=sys.stderr)
        return 2
    return 0


def implied_num_devices(experiment, *, num_local_devices: int) -> int:
    """The device count the mesh flags describe (ICI=None: this process's devices per node)."""
    ici = experiment.ICI_MESH_SHAPE
    return (num_local_devices if ici is None else math.prod(ici)) * math.prod(
        experiment.DCN_MESH_SHAPE)


def dry_run(experiment, *, job_log_dir: str, peak_tflops: float | None = None,
            argv: Sequence[str] = ()) -> int:
    """`python -m paxlite.main --mode=dry_run`: plan for the devices the mesh flags imply, print the
    plan and write DIR/plan.json; nothing is allocated and no checkpoint directory is made."""
    import jax

    from paxlite.config.errors import ConfigError
    from paxlite.parallel.mesh import MeshError

    cls = type(experiment)
    request = PlanRequest(
        name=f"{cls.__module__}.{cls.__qualname__}",
        assignments=tuple(f"{name}={experiment.hparams()[name]!r}"  # plain literals
                          for name in sorted(experiment.overridden)),
        num_devices=implied_num_devices(experiment, num_local_devices=jax.local_device_count()),
        peak_tflops=peak_tflops or experiment.PEAK_TFLOPS or DEFAULT_PEAK_TFLOPS,
    )
    try:
        result = plan(request)
    except (ConfigError, MeshError, PlanError) as e:
        print(f"paxlite: error: {e}", file=sys.stderr)
        return 2
    result["command_line"] = list(argv)
    os.makedirs(job_log_dir, exist_ok=True)
    with open(os.path.join(job_log_dir, "plan.json"), "w") as f:
        f.write(json.dumps(result, indent=2) + "\n")
    print(format_text(result))
    return 0
