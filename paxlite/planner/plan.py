"""Will it fit? Compile a run's train step ahead of time for a target and read its memory.

Nothing is allocated: the state and the batch are ShapeDtypeStructs carrying their shardings, and
`jit(...).lower(...).compile()` runs XLA's SPMD partitioner and buffer assignment for one device's
program. The target (`--target`, paxlite/parallel/compile_targets/) says which compiler: `cpu`
(the default) compiles for fake CPU devices, whose temporaries are an estimate (GPU kernels and
fusion differ); `h100`, `h200`, `a100` compile with XLA's GPU compiler for compile-only GPUs of
that model (JAX's CUDA plugin, no GPU needed): the run's own kernels (cuDNN attention, cuBLAS,
Triton), without autotuning, and no FLOPs (its cost analysis is empty); a TPU slice (`v5e-8`,
`v5p-512`, `v6e-256`, `v5e:2x4`) compiles with the TPU compiler (libtpu, no TPU needed) for its
chips, whose number is the plan's device count. Parameter, optimizer-state and gradient bytes are
exact either way (they follow from shapes and shardings alone).

This module finds the devices and puts the plan together: one compile and its reading
(paxlite/planner/search.py, base_plan.py), then, when the run does not fit, the levers
(levers.py), and when asked (always for a run with a seq axis) the longest sequence that fits
(longest_seq.py); the result is a Plan (results.py) that paxlite/planner/report.py prints, and
whose JSON (`Plan.to_json`) is `--format=json`'s and plan.json's. For `cpu` the planner needs as
many JAX devices as the mesh has: fake CPU devices are set by
`XLA_FLAGS=--xla_force_host_platform_device_count=N` before JAX starts; a process whose JAX
already started with fewer devices (pytest has 8, `python -m paxlite.main` has its real ones) plans
in a fresh `python -m paxlite plan` subprocess instead. A GPU or TPU target needs only JAX started
on the CPU platform (JAX_PLATFORMS=cpu: the plugin then compiles without initialising CUDA, libtpu
without a TPU); a process whose JAX runs on an accelerator plans it in a subprocess.
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

from paxlite.errors import UserError, exit_status
from paxlite.parallel.compile_targets import CompileTarget, compiler_problem, unavailable_error
from paxlite.parallel.compile_targets.tpu import COMPILE_ONLY_ENV
from paxlite.planner.base_plan import plan_base
from paxlite.planner.levers import levers
from paxlite.planner.longest_seq import DEFAULT_SEQ_STEP, find_longest_seq
from paxlite.planner.report import format_text
from paxlite.planner.results import GIB, Plan
from paxlite.planner.search import (
    DEFAULT_DEVICE_MEMORY_GIB,
    DEFAULT_PEAK_TFLOPS,
    PlanError,
    compile_train_step,
    target_defaults,
)

__all__ = ["DEFAULT_DEVICE_MEMORY_GIB", "DEFAULT_PEAK_TFLOPS", "DEFAULT_SEQ_STEP", "GIB",
           "CompileTarget", "LongestSeq", "OutputFormat", "Plan", "PlanError", "PlanRequest",
           "compile_train_step", "dry_run", "emit", "fake_device_env", "format_text", "plan",
           "plan_command_line", "plan_experiment", "prepare_this_process", "run_plan_command",
           "target_defaults"]

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# The planner compiles to read XLA's buffer assignment and cost analysis, both decided before LLVM
# turns the program into CPU code that is never run: LLVM at level 0 gives the same bytes and FLOPs
# sooner (LLaMA70B on 16 devices, its 80-layer step: 87.9 s -> 70.7 s; with 8 layers 18.3 s ->
# 9.0 s; every memory figure equal).
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
    """What to plan: the experiment as typed on the command line, and the hardware to plan for
    (memory and peak not given are the target's: target_defaults; devices not given are a TPU
    slice's chips, and must be given for cpu and GPU targets)."""

    name: str
    assignments: tuple[str, ...] = ()
    num_devices: int | None = None
    target: CompileTarget = CompileTarget.CPU  # which compiler measures (a name is parsed, once)
    device_memory_gib: float | None = None
    peak_tflops: float | None = None
    longest_seq: LongestSeq = LongestSeq.AUTO
    seq_step: int = DEFAULT_SEQ_STEP  # the longest sequence's granularity, in tokens

    def __post_init__(self) -> None:
        target = CompileTarget.parse(self.target)  # UserError: names every valid form
        object.__setattr__(self, "target", target)
        object.__setattr__(self, "num_devices", _num_devices(target, self.num_devices))
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
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{flag}={value!r}: expected a positive number")
        usable = target.memory_bytes
        if target.is_tpu and self.device_memory_gib is not None and (
                self.device_memory_gib * GIB > usable):
            raise ValueError(
                f"--device_memory_gib={self.device_memory_gib!r} is more than the "
                f"{usable / GIB:.2f} GiB of HBM a {target.tpu.generation.value} chip gives a "
                "program: the TPU compiler refuses anything larger (leave it out, or pass less)")


def _num_devices(target: CompileTarget, given: int | None) -> int | None:
    """--devices, or a TPU slice's chips; for a TPU slice the two must agree (ValueError)."""
    chips = target.num_devices
    if given is None:
        if chips is None:
            raise ValueError(f"--devices is required for --target={target} (a TPU target's "
                             "default is its chips)")
        return chips
    if chips is not None and given != chips:
        same = [t for t in (f"{target.tpu.generation.value}-{given * n}" for n in (1, 2))
                if _parses(t) and CompileTarget.parse(t).num_devices == given]
        raise ValueError(
            f"--devices={given} but --target={target} is {chips} chips (topology "
            f"{target.tpu.topology}): leave --devices out"
            + (f", or plan --target={same[0]}" if same else ""))
    return given


def _parses(text: str) -> bool:
    try:
        CompileTarget.parse(text)
    except UserError:
        return False
    return True


# ------------------------------------------------------------------------------------------------
# Devices: this process, or a fresh one with enough fake CPU devices (or on the CPU platform)


def fake_device_env(num_devices: int, base: dict[str, str] | None = None, *,
                    target: CompileTarget | str = CompileTarget.CPU) -> dict[str, str]:
    """`base` (default os.environ) with XLA_FLAGS asking for exactly `num_devices` CPU devices, and
    for LLVM's quickest code generation (_CODEGEN_LEVEL_FLAG) unless XLA_FLAGS already sets a level.
    A GPU or TPU target compiles on compile-only devices: it needs JAX on the CPU platform only
    (the CUDA plugin registers its compiler without initialising CUDA; libtpu compiles without a
    TPU, with tpu.COMPILE_ONLY_ENV where unset: beside other processes that loaded libtpu, and
    quietly), and XLA_FLAGS is left as it is."""
    env = dict(os.environ if base is None else base)
    env["JAX_PLATFORMS"] = "cpu"
    target = CompileTarget.parse(target)
    if target.is_tpu:
        env = {**COMPILE_ONLY_ENV, **env}
    if target.compile_only:
        return env
    flags = re.sub(rf"{_DEVICE_COUNT_FLAG}=\S*", "", env.get("XLA_FLAGS", "")).split()
    if not any(flag.startswith(_CODEGEN_LEVEL_FLAG + "=") for flag in flags):
        flags.append(f"{_CODEGEN_LEVEL_FLAG}=0")
    env["XLA_FLAGS"] = " ".join([*flags, f"{_DEVICE_COUNT_FLAG}={num_devices}"])
    return env


def prepare_this_process(num_devices: int, *,
                         target: CompileTarget | str = CompileTarget.CPU) -> bool:
    """True when this process can plan for `num_devices` of `target` (setting up JAX's environment
    if JAX has not started yet); False when JAX already runs on other devices (a GPU; for `cpu`,
    fewer CPU devices) and a subprocess must plan."""
    if "jax" not in sys.modules:
        os.environ.update(fake_device_env(num_devices, target=target))
        return True
    import jax

    devices = jax.devices()
    if CompileTarget.parse(target).compile_only:  # compile-only devices, beside the CPU
        return devices[0].platform == "cpu"
    return devices[0].platform == "cpu" and len(devices) >= num_devices


def plan_command_line(request: PlanRequest, *, output_format: OutputFormat) -> list[str]:
    """The `python -m paxlite plan ...` command that plans `request` in a fresh process."""
    return [
        sys.executable, "-m", "paxlite", "plan", f"--fdl_config={request.name}",
        *(f"--fdl.{a}" for a in request.assignments),
        f"--devices={request.num_devices}",
        *([] if request.target is CompileTarget.CPU else [f"--target={request.target.value}"]),
        *([] if request.device_memory_gib is None else
          [f"--device_memory_gib={request.device_memory_gib!r}"]),
        *([] if request.peak_tflops is None else [f"--peak_tflops={request.peak_tflops!r}"]),
        *([] if request.longest_seq is LongestSeq.AUTO else
          [f"--longest_seq={request.longest_seq.value}"]),
        *([] if request.seq_step == DEFAULT_SEQ_STEP else [f"--seq_step={request.seq_step}"]),
        f"--format={output_format.value}",
    ]


def plan_in_subprocess(request: PlanRequest) -> Plan:
    """Plan in a fresh process, read back from its JSON; its error message (one line on stderr)
    becomes a PlanError."""
    result = subprocess.run(
        plan_command_line(request, output_format=OutputFormat.JSON),
        capture_output=True, text=True, check=False,
        env=fake_device_env(request.num_devices, target=request.target),
    )
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        raise PlanError(lines[-1].removeprefix("paxlite: error: ") if lines
                        else f"the planner exited with {result.returncode}")
    return Plan.from_json(json.loads(result.stdout))


def plan(request: PlanRequest) -> Plan:
    """The plan of `request`, in this process when its devices allow, else in a subprocess. A GPU
    target without JAX's CUDA plugin, or a TPU target without libtpu, is a
    CompileUnavailableError saying how to install it."""
    if not prepare_this_process(request.num_devices, target=request.target):
        return plan_in_subprocess(request)
    problem = compiler_problem(request.target)
    if problem:  # before the experiment is loaded: nothing else would be of use
        raise unavailable_error(request.target, problem)
    from paxlite.experiments.build import load_experiment

    return plan_experiment(
        load_experiment(request.name, request.assignments),
        num_devices=request.num_devices,
        target=request.target,
        device_memory_gib=request.device_memory_gib,
        peak_tflops=request.peak_tflops,
        longest_seq=request.longest_seq,
        seq_step=request.seq_step,
    )


def plan_experiment(experiment, *, num_devices: int,
                    target: CompileTarget | str = CompileTarget.CPU,
                    device_memory_gib: float | None = None,
                    peak_tflops: float | None = None,
                    longest_seq: LongestSeq = LongestSeq.AUTO,
                    seq_step: int = DEFAULT_SEQ_STEP) -> Plan:
    """The plan of `experiment` on `num_devices` devices of `target` (this process's CPU devices,
    compile-only GPUs or a TPU slice's chips): the compiled step, levers when it does not fit, the
    longest sequence when `longest_seq` asks, every re-plan compiled for the same target."""
    started = time.perf_counter()
    target = CompileTarget.parse(target)
    result, base = plan_base(experiment, num_devices=num_devices, target=target,
                             device_memory_gib=device_memory_gib, peak_tflops=peak_tflops)
    device_bytes = result.device_memory_bytes
    if not result.verdict.fits:
        result = dataclasses.replace(result, levers=tuple(levers(
            experiment, base, num_devices=num_devices, device_bytes=device_bytes, target=target)))
    if LongestSeq(longest_seq).wanted(seq=base.mesh.seq):
        result = dataclasses.replace(result, longest_seq=find_longest_seq(
            experiment, base, num_devices=num_devices, device_bytes=device_bytes, step=seq_step,
            target=target))
    return dataclasses.replace(result, plan_s=round(time.perf_counter() - started, 2))


# ------------------------------------------------------------------------------------------------
# Entry points


def emit(p: Plan, output_format: OutputFormat) -> str:
    return (json.dumps(p.to_json(), indent=2) if output_format is OutputFormat.JSON
            else format_text(p))


def run_plan_command(request: PlanRequest, *, output_format: OutputFormat) -> int:
    """`python -m paxlite plan`: prints the plan; a bad configuration exits 2 with one line."""
    # First, before anything imports JAX (paxlite.parallel does): a fresh process plans itself.
    if not prepare_this_process(request.num_devices, target=request.target):
        command = plan_command_line(request, output_format=output_format)
        return subprocess.run(command, check=False, env=fake_device_env(
            request.num_devices, target=request.target)).returncode
    try:
        print(emit(plan(request), output_format))
    except (UserError, PlanError, ValueError) as e:  # ConfigError, MeshError, no compiler
        return exit_status(e, user_errors=(PlanError, ValueError))
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
        return exit_status(e, user_errors=(PlanError,))
    os.makedirs(job_log_dir, exist_ok=True)
    with open(os.path.join(job_log_dir, "plan.json"), "w") as f:
        f.write(json.dumps({**result.to_json(), "command_line": list(argv)}, indent=2) + "\n")
    print(format_text(result))
    return 0
