"""The planner's measurement: compile a run's train step for N devices of a target (fake CPU
devices, or compile-only H100/H200/A100s through XLA's GPU compiler) and read what XLA decided
(memory per device, FLOPs where the compiler counts them, a GPU program's kernels), with what the
run's mesh, pipeline and seq axis make of it.

Nothing is allocated: the state and the batch are ShapeDtypeStructs carrying their shardings, and
`jit(...).lower(...).compile()` runs XLA's SPMD partitioner and buffer assignment for one device's
program. For `cpu` the temporaries are the CPU compiler's estimate (GPU kernels and fusion differ);
for a GPU target they are the GPU compiler's own, without autotuning. Parameter, optimizer-state and
gradient bytes are exact either way (they follow from shapes and shardings alone). The result is
a StepMeasurement (paxlite/planner/results.py); paxlite/planner/base_plan.py makes the plan of one
compile, paxlite/planner/levers.py and longest_seq.py re-plan variants of the run, and
paxlite/planner/plan.py finds the devices and puts the plan together.

With a pipeline, one device's program is one pipeline rank's: it holds the layers of its stage(s)
(the scanned stack's [L, ...] parameters split over the `pipeline` axis), so the per-device peak
*is* the per-stage memory. With a `seq` axis each device holds its rows' tokens / seq.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

from paxlite.parallel import gpu_target
from paxlite.parallel.compiled_kernels import custom_calls, fp8_gemms
from paxlite.parallel.gpu_target import CompileTarget, GpuTopology, gpu_devices
from paxlite.planner.results import GIB, DeviceMemory, GpuProgram, MeshSizes, StepMeasurement

DEFAULT_DEVICE_MEMORY_GIB = 80.0  # H100 80GB
DEFAULT_PEAK_TFLOPS = 989.0  # H100/H200 dense BF16 (docs/performance.md)


class PlanError(RuntimeError):
    """The planner could not run (not a bad configuration: those raise ConfigError / MeshError)."""


def _resolved_mesh_shapes(experiment, num_devices: int) -> tuple[list[int], list[int]]:
    """ICI and DCN shapes for `num_devices`, as given (3 to 6 entries, or Pax's pipelined 4);
    ICI=None puts each node's devices (num_devices / DCN) on data, as a real multi-node run does."""
    from paxlite.parallel.mesh import MeshError

    dcn = list(experiment.DCN_MESH_SHAPE)
    nodes = math.prod(dcn)
    if experiment.ICI_MESH_SHAPE is None:
        if num_devices % nodes:
            raise MeshError(
                f"ICI_MESH_SHAPE=None x DCN_MESH_SHAPE={dcn}: {nodes} node(s) do not divide "
                f"--devices={num_devices}"
            )
        return [num_devices // nodes, 1, 1], dcn
    ici = list(experiment.ICI_MESH_SHAPE)
    if math.prod(ici) * nodes != num_devices:
        raise MeshError(
            f"ICI_MESH_SHAPE={ici} x DCN_MESH_SHAPE={dcn} needs {math.prod(ici) * nodes} devices, "
            f"but the plan is for --devices={num_devices}; pass --devices={math.prod(ici) * nodes} "
            f"or change the mesh with --fdl.ICI_MESH_SHAPE / --fdl.DCN_MESH_SHAPE"
        )
    return ici, dcn


def _shard_bytes(abstract_tree, *, over_axis: str | None = None) -> int:
    """Bytes of one device's shard of every leaf (the largest shard, for uneven splits); with
    `over_axis`, only of the leaves sharded over that mesh axis."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(abstract_tree):
        if over_axis is not None and over_axis not in _spec_axes(leaf.sharding.spec):
            continue
        total += math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return total


def _spec_axes(spec) -> set[str]:
    axes: set[str] = set()
    for entry in spec:
        if isinstance(entry, str):
            axes.add(entry)
        elif entry is not None:
            axes.update(entry)
    return axes


def _flops_of(compiled) -> float | None:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    return None if not cost or "flops" not in cost else float(cost["flops"])


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Setup:
    """What a run decides before compiling: its mesh, batch and model (every check passed)."""

    mesh: Any
    ici: list[int]
    dcn: list[int]
    global_batch: int
    model_config: Any
    attention_note: str | None
    loop: Any


def target_devices(experiment, *, num_devices: int, target: CompileTarget) -> list[Any]:
    """The devices to compile for: this process's CPU devices, or compile-only GPUs of `target`
    laid out as the run's nodes (DCN_MESH_SHAPE's product hosts, the rest of the devices on
    each)."""
    import jax

    if target.is_gpu:
        _, dcn = _resolved_mesh_shapes(experiment, num_devices)
        hosts = math.prod(dcn)
        return gpu_devices(target, GpuTopology(hosts=hosts, gpus_per_host=num_devices // hosts))
    devices = jax.devices()
    if devices[0].platform != "cpu" or len(devices) < num_devices:
        raise PlanError(
            f"planning for {num_devices} devices needs that many CPU devices in this process, "
            f"which has {len(devices)} {devices[0].platform} device(s); use "
            "paxlite.planner.plan.plan(), which starts a subprocess when needed"
        )
    return devices[:num_devices]


def _setup(experiment, *, num_devices: int, target: CompileTarget = CompileTarget.CPU) -> _Setup:
    """Every refusal a run would make at start-up, without compiling: the mesh on the devices, the
    batch over data x fsdp x expert, gradient-accumulation microbatches and pipeline microbatches
    (ConfigError / MeshError / ValueError naming the numbers)."""
    import fiddle as fdl

    from paxlite.experiments.parallelism_settings import mesh_layout
    from paxlite.models.attention_kernels import AttentionImplementation
    from paxlite.parallel import mesh as mesh_lib
    from paxlite.parallel import rules as rules_lib
    from paxlite.train.grad_accum import microbatch_size, pipeline_microbatches

    devices = target_devices(experiment, num_devices=num_devices, target=target)
    ici, dcn = _resolved_mesh_shapes(experiment, num_devices)
    mesh_config = mesh_lib.MeshConfig(ici_mesh_shape=tuple(ici), dcn_mesh_shape=tuple(dcn),
                                      layout=mesh_layout(experiment))
    mesh = mesh_lib.build_mesh(mesh_config, devices=devices)
    global_batch = mesh_lib.global_batch_size(
        percore_batch_size=experiment.PERCORE_BATCH_SIZE, num_devices=num_devices,
        batch_split=rules_lib.batch_split(mesh),
        fixed_global_batch_size=getattr(experiment, "GLOBAL_BATCH_SIZE", None),
    )
    # the run's model: the family's, plus USE_LORA's adapters (run_config does the same)
    with_lora = getattr(experiment, "with_lora", lambda model: model)
    model_config = fdl.build(with_lora(experiment.model_config()))
    attention_note = None
    if not target.is_gpu and model_config.attention_implementation in (
            AttentionImplementation.CUDNN, AttentionImplementation.PALLAS_TRITON):
        # The CPU compiler has no cuDNN or Triton kernels: plan the same function with XLA's
        # attention (its [B, N, T, S] logits make the temporaries an over-estimate) and say so.
        attention_note = (
            f"attention planned with 'xla': the CPU compiler cannot compile "
            f"{model_config.attention_implementation.value!r}, which holds no [B, N, T, S] logits, "
            "so the temporaries are an over-estimate")
        model_config = dataclasses.replace(model_config,
                                           attention_implementation=AttentionImplementation.XLA)
    loop = fdl.build(experiment.loop_config())
    # Gradient accumulation: activations scale with the microbatch, as in the real run, which
    # refuses microbatches that do not split over data x fsdp x expert; so does the plan.
    microbatch_size(global_batch_size=global_batch, grad_accum_steps=loop.grad_accum_steps,
                    batch_split=rules_lib.batch_split(mesh))
    if model_config.pipeline is not None:  # as train/loop.py checks at start-up
        pipeline_microbatches(model_config.pipeline, global_batch_size=global_batch,
                              grad_accum_steps=loop.grad_accum_steps,
                              batch_split=rules_lib.batch_split(mesh))
    return _Setup(mesh=mesh, ici=ici, dcn=dcn, global_batch=global_batch,
                  model_config=model_config, attention_note=attention_note, loop=loop)


def check_runs(experiment, *, num_devices: int,
               target: CompileTarget = CompileTarget.CPU) -> None:
    """Raise what the run would refuse before compiling (see _setup); a lever's cheap first test."""
    _setup(experiment, num_devices=num_devices, target=target)


def gpu_compile_options(experiment) -> tuple[str, dict[str, str]]:
    """(preset name, its compile options): the XLA flags a run of `experiment` is launched with."""
    from paxlite import xla_presets

    cls = type(experiment)
    name = xla_presets.preset_for_experiment(f"{cls.__module__}.{cls.__qualname__}")
    return name, gpu_target.preset_compiler_options(name)


def compile_train_step(experiment, *, num_devices: int,
                       target: CompileTarget | str = CompileTarget.CPU,
                       compiler_options: dict[str, str] | None = None) -> StepMeasurement:
    """Compile the experiment's train step for `num_devices` devices of `target` (fake CPU devices,
    or compile-only GPUs with the run's XLA preset as compile options unless `compiler_options`
    says otherwise) and measure one device. A GPU target adds the kernels of the optimized HLO."""
    import fiddle as fdl
    import jax
    import jax.numpy as jnp

    from paxlite.experiments.dpo_settings import DPO
    from paxlite.models.lora import is_lora_path
    from paxlite.models.parallel_config import PIPELINE_AXIS
    from paxlite.models.te_layer import logical_axis_rules as te_logical_axis_rules
    from paxlite.models.transformer import Transformer
    from paxlite.parallel.rules import DEFAULT_RULES
    from paxlite.train.dpo import DpoSteps
    from paxlite.train.optimizer import make_optimizer
    from paxlite.train.schedules import make_schedule
    from paxlite.train.step import compile_steps

    target = CompileTarget.parse(target)
    setup = _setup(experiment, num_devices=num_devices, target=target)
    mesh, global_batch, model_config = setup.mesh, setup.global_batch, setup.model_config
    preset = None
    if target.is_gpu and compiler_options is None:
        preset, compiler_options = gpu_compile_options(experiment)
    schedule = make_schedule(fdl.build(experiment.schedule_config()))
    seq_len = model_config.max_seq_len
    # What train/loop.py passes too: a LoRA run differentiates and keeps Adam state for the
    # adapters only, TE's layers add their logical names to the rules.
    accum = {"grad_accum_steps": setup.loop.grad_accum_steps,
             "loss_chunk_size": setup.loop.loss_chunk_size,  # LOSS_CHUNK_SIZE: logits memory
             "z_loss_weight": setup.loop.z_loss_weight,
             "trainable": is_lora_path if model_config.lora_rank is not None else None,
             "logical_rules": te_logical_axis_rules(model_config, DEFAULT_RULES)}
    # TRAIN_TASK=dpo: the DPO step, which also takes the reference model's parameters (the same
    # batch of [B, T] arrays: one pair a row)
    dpo = None
    if getattr(experiment, "TRAIN_TASK", None) == DPO:
        dpo = DpoSteps.of(beta=experiment.DPO_BETA, reference_path=experiment.DPO_REFERENCE_PATH,
                          train=True, eval=False, lora=model_config.lora_rank is not None)
    started = time.perf_counter()
    # A compile-only GPU mesh cannot hold arrays: eager work while building the steps (an
    # optimizer's init on placeholders) runs under its abstract mesh, which is what tracing reads.
    context = (jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if target.is_gpu
               else jax.set_mesh(mesh))
    with context:
        steps = compile_steps(
            model=Transformer(model_config),
            optimizer=make_optimizer(fdl.build(experiment.optimizer_config()), schedule),
            schedule=schedule,
            mesh=mesh,
            seq_len=seq_len,
            seed=experiment.SEED,
            deterministic=model_config.dropout_prob == 0 and model_config.input_dropout_prob == 0,
            dpo=dpo,
            **accum,
        )
        # A packed text batch, the largest the feed produces; synthetic data has the first three.
        dtypes = {"inputs": jnp.int32, "targets": jnp.int32, "weights": jnp.float32,
                  "positions": jnp.int32, "segment_ids": jnp.int32}
        batch = {key: jax.ShapeDtypeStruct((global_batch, seq_len), dtype,
                                           sharding=steps.batch_sharding)
                 for key, dtype in dtypes.items()}
        compiled = steps.train.lower(steps.abstract_state, batch,
                                     *steps.abstract_reference).compile(compiler_options)
    compile_s = time.perf_counter() - started
    stats = compiled.memory_analysis()
    parameter_bytes = _shard_bytes(steps.abstract_state.params)
    on_device = {
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "alias_bytes": int(stats.alias_size_in_bytes),
        "temp_bytes": int(stats.temp_size_in_bytes),
        "generated_code_bytes": int(stats.generated_code_size_in_bytes),
    }
    # Donated state: outputs reuse argument buffers, counted once. Temporaries (activations kept
    # for the backward pass, gradients, gathered FSDP weights) are the peak of the scratch space.
    memory = DeviceMemory(
        parameter_bytes=parameter_bytes,
        optimizer_state_bytes=_shard_bytes(steps.abstract_state.opt_state),
        gradient_bytes=parameter_bytes,  # grads: the params' dtype and sharding
        **on_device,
        peak_bytes=(on_device["argument_bytes"] + on_device["output_bytes"]
                    - on_device["alias_bytes"] + on_device["temp_bytes"]
                    + on_device["generated_code_bytes"]),
        reference_bytes=(_shard_bytes(steps.abstract_reference) if steps.abstract_reference
                         else None),
    )
    gpu_program = None
    if target.is_gpu:
        text = compiled.as_text()
        gpu_program = GpuProgram(kernels=custom_calls(text), fp8_gemms=fp8_gemms(text),
                                 xla_preset=preset,
                                 compiler_options=dict(compiler_options or {}))
    return StepMeasurement(
        compiled_for=target,
        mesh=MeshSizes.from_shape(mesh.shape),
        ici_mesh_shape=tuple(setup.ici),
        dcn_mesh_shape=tuple(setup.dcn),
        global_batch_size=global_batch,
        seq_len=seq_len,
        memory=memory,
        pipeline_split_parameter_bytes=_shard_bytes(steps.abstract_state.params,
                                                    over_axis=PIPELINE_AXIS),
        compiler_flops_per_device=_flops_of(compiled),
        compile_s=round(compile_s, 2),
        attention_note=setup.attention_note,
        gpu_program=gpu_program,
    )


def variant(experiment, changes: dict[str, Any]):
    """The experiment with its own overrides and then `changes` (raises what resolve refuses)."""
    overrides = {name: getattr(experiment, name) for name in experiment.overridden}
    return type(experiment).resolve({**overrides, **changes})


def compile_variants(experiment, variants: list[dict[str, Any]], *, num_devices: int,
                     target: CompileTarget = CompileTarget.CPU,
                     ) -> list[StepMeasurement | Exception]:
    """compile_train_step of each variant (in order), several at once: XLA's compile of one program
    runs its passes on one core, and the variants are independent, so with N cores N of them compile
    in about the time of one (LLaMA70B on 16 devices: three of its four levers are the 80-layer
    step). A variant the configuration refuses gives its ConfigError / MeshError / ValueError."""
    from concurrent.futures import ThreadPoolExecutor

    from paxlite.config.errors import ConfigError
    from paxlite.parallel.mesh import MeshError

    def measure(changes: dict[str, Any]) -> StepMeasurement | Exception:
        try:
            return compile_train_step(variant(experiment, changes), num_devices=num_devices,
                                      target=target)
        except (ConfigError, MeshError, ValueError) as e:
            return e

    if len(variants) <= 1:
        return [measure(changes) for changes in variants]
    with ThreadPoolExecutor(max_workers=min(len(variants), os.cpu_count() or 1)) as pool:
        return list(pool.map(measure, variants))


def target_defaults(target: CompileTarget | str) -> tuple[int, float]:
    """(device bytes, dense BF16 TFLOP/s) a plan for `target` assumes unless told: the GPU's own
    description (GpuSpec), or for `cpu` an H100's 80 GiB and peak (the planner's defaults)."""
    target = CompileTarget.parse(target)
    return ((target.spec.memory_bytes, target.spec.dense_bf16_tflops) if target.is_gpu
            else (int(DEFAULT_DEVICE_MEMORY_GIB * GIB), DEFAULT_PEAK_TFLOPS))
