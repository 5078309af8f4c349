"""The planner's measurement: compile a run's train step for N devices of a target (fake CPU
devices, compile-only H100/H200/A100s through XLA's GPU compiler, or a compile-only TPU slice
through the TPU compiler: paxlite/parallel/compile_targets/) and read what XLA decided (memory per
device, FLOPs where the compiler counts them, a GPU or TPU program's kernels), with what the run's
mesh, pipeline and seq axis make of it.

Nothing is allocated: the state and the batch are ShapeDtypeStructs carrying their shardings, and
`jit(...).lower(...).compile()` runs XLA's SPMD partitioner and buffer assignment for one device's
program. For `cpu` the temporaries are the CPU compiler's estimate (GPU kernels and fusion differ);
for a GPU target they are the GPU compiler's own, without autotuning; for a TPU target the TPU
compiler's, which refuses a program that does not fit the chip's HBM and then says how much it
needs (`TpuOutOfMemory`). Parameter, optimizer-state and gradient bytes are exact either way (they
follow from shapes and shardings alone). The result is
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

from paxlite.parallel import compile_targets
from paxlite.parallel.compile_targets import CompileTarget, TargetKind
from paxlite.parallel.compiled_kernels import custom_calls, fp8_gemms
from paxlite.planner.results import (
    GIB,
    CompiledProgram,
    DeviceMemory,
    HbmRefusal,
    MeshSizes,
    StepMeasurement,
)

# What a plan for `cpu` assumes unless told: an H100's 80 GB and its dense BF16 peak.
DEFAULT_DEVICE_MEMORY_GIB = 80.0
DEFAULT_PEAK_TFLOPS = CompileTarget.H100.peak_tflops


class PlanError(RuntimeError):
    """The planner could not run (not a bad configuration: those raise ConfigError / MeshError)."""


def _resolved_mesh_shapes(experiment, num_devices: int,
                          target: CompileTarget = CompileTarget.CPU) -> tuple[list[int], list[int]]:
    """ICI and DCN shapes for `num_devices`, as given (3 to 6 entries, or Pax's pipelined 4);
    ICI=None puts each node's devices (num_devices / DCN) on data, as a real multi-node run does.
    A TPU target's device count is its chips: a mesh of another size is told to change."""
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
    if math.prod(ici) * nodes != num_devices and target.tpu is not None:
        raise MeshError(
            f"ICI_MESH_SHAPE={ici} x DCN_MESH_SHAPE={dcn} needs {math.prod(ici) * nodes} devices, "
            f"but --target={target} is {num_devices} chips (topology {target.tpu.topology}); "
            "change the mesh with --fdl.ICI_MESH_SHAPE / --fdl.DCN_MESH_SHAPE, or plan for a "
            f"slice of {math.prod(ici) * nodes} chips")
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
    """The devices to compile for: this process's CPU devices, compile-only GPUs of `target` laid
    out as the run's nodes (DCN_MESH_SHAPE's product hosts, the rest of the devices on each), or
    the chips of a TPU slice (all of them: `num_devices` must be its chip count)."""
    import jax

    if target.compile_only:
        _, dcn = _resolved_mesh_shapes(experiment, num_devices, target)
        return compile_targets.target_devices(target, hosts=math.prod(dcn),
                                               num_devices=num_devices)
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
    from paxlite.parallel import mesh as mesh_lib
    from paxlite.parallel import rules as rules_lib
    from paxlite.train.grad_accum import microbatch_size, pipeline_microbatches

    devices = target_devices(experiment, num_devices=num_devices, target=target)
    ici, dcn = _resolved_mesh_shapes(experiment, num_devices, target)
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
    model_config, attention_note = _attention_for(target, model_config)
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


# The attention kernels each compiler can compile (AUTO resolves to one of them on the target).
_COMPILABLE_ATTENTION = {
    TargetKind.CPU: frozenset({"auto", "xla"}),
    TargetKind.GPU: frozenset({"auto", "xla", "cudnn", "pallas_triton"}),
    TargetKind.TPU: frozenset({"auto", "xla", "splash"}),
}


def _attention_for(target: CompileTarget, model_config) -> tuple[Any, str | None]:
    """(the model to compile, why its attention was replaced or None): a fused kernel the target's
    compiler cannot compile is planned with XLA's attention, whose [B, N, T, S] logits make the
    temporaries an over-estimate, and the plan says so. The CPU stands in for a GPU; on a GPU or
    TPU target the run itself would refuse the kernel (another platform's)."""
    from paxlite.models.attention_kernels import AttentionImplementation

    requested = model_config.attention_implementation
    if requested.value in _COMPILABLE_ATTENTION[target.kind]:
        return model_config, None
    if target.kind is TargetKind.CPU:
        why = f"the CPU compiler cannot compile {requested.value!r}"
    else:
        fused = {TargetKind.GPU: "'cudnn'", TargetKind.TPU: "'splash'"}[target.kind]
        why = (f"a {target.kind.value.upper()} run cannot run {requested.value!r} and refuses it "
               f"({fused} is its fused kernel)")
    note = (f"attention planned with 'xla': {why}, which holds no [B, N, T, S] logits, so the "
            "temporaries are an over-estimate")
    return dataclasses.replace(model_config,
                               attention_implementation=AttentionImplementation.XLA), note


def check_runs(experiment, *, num_devices: int,
               target: CompileTarget = CompileTarget.CPU) -> None:
    """Raise what the run would refuse before compiling (see _setup); a lever's cheap first test."""
    _setup(experiment, num_devices=num_devices, target=target)


def gpu_compile_options(experiment) -> tuple[str, dict[str, str]]:
    """(preset name, its compile options): the XLA flags a run of `experiment` is launched with."""
    from paxlite import xla_presets

    cls = type(experiment)
    name = xla_presets.preset_for_experiment(f"{cls.__module__}.{cls.__qualname__}")
    return name, compile_targets.preset_compiler_options(name)


def compile_options(experiment, target: CompileTarget) -> tuple[str | None, dict[str, str]]:
    """(the XLA preset applied or None, the compile options) for a compile-only target: a run's
    preset where it applies to the target's platform (paxlite.xla_presets: every preset is a GPU
    one, so none for a TPU, whose compile then gets no option: no `--xla_gpu_*` flag and no
    JAX_OPTIMIZATION_LEVEL)."""
    from paxlite import xla_presets

    name, options = gpu_compile_options(experiment) if target.is_gpu else (None, {})
    if target.is_tpu:
        cls = type(experiment)
        preset = xla_presets.get_preset(
            xla_presets.preset_for_experiment(f"{cls.__module__}.{cls.__qualname__}"))
        if preset.applies_on(xla_presets.Platform.TPU):  # none does today
            name, options = preset.name, compile_targets.preset_compiler_options(preset.name)
    return name, options


def compile_train_step(experiment, *, num_devices: int,
                       target: CompileTarget | str = CompileTarget.CPU,
                       compiler_options: dict[str, str] | None = None) -> StepMeasurement:
    """Compile the experiment's train step for `num_devices` devices of `target` (fake CPU devices,
    compile-only GPUs with the run's XLA preset as compile options unless `compiler_options` says
    otherwise, or a TPU slice's compile-only chips with no options) and measure one device. A GPU
    or TPU target adds the custom calls of the optimized HLO (`program`); a TPU program that does
    not fit the chip is measured from the compiler's refusal (`refused`)."""
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
    if target.compile_only and compiler_options is None:
        preset, compiler_options = compile_options(experiment, target)
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
    # A compile-only GPU or TPU mesh cannot hold arrays: eager work while building the steps (an
    # optimizer's init on placeholders) runs under its abstract mesh, which is what tracing reads.
    context = (jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if target.compile_only
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
        lowered = steps.train.lower(steps.abstract_state, batch, *steps.abstract_reference)
        compiled, refused = _compile(lowered, target=target, options=compiler_options)
    compile_s = time.perf_counter() - started
    parameter_bytes = _shard_bytes(steps.abstract_state.params)
    if compiled is not None:
        on_device = _memory_analysis(compiled)
    else:  # what the TPU compiler's refusal says, and the state's shapes
        on_device = _refused_memory(refused, arguments=_shard_bytes(
            (steps.abstract_state, batch, steps.abstract_reference)),
            donated=_shard_bytes(steps.abstract_state))
    # Donated state: outputs reuse argument buffers, counted once. Temporaries (activations kept
    # for the backward pass, gradients, gathered FSDP weights) are the peak of the scratch space.
    # A TPU's peak is its compiler's own (results.TPU_PEAK_FORMULA): the sum counts every
    # temporary as live beside the state, 20% over the chip's measured peak on a 507M GPT.
    peak = (on_device["argument_bytes"] + on_device["output_bytes"] - on_device["alias_bytes"]
            + on_device["temp_bytes"] + on_device["generated_code_bytes"])
    if refused is not None:
        peak = refused.needed_bytes
    elif target.is_tpu and _compiler_peak(compiled):
        peak = _compiler_peak(compiled)
    memory = DeviceMemory(
        parameter_bytes=parameter_bytes,
        optimizer_state_bytes=_shard_bytes(steps.abstract_state.opt_state),
        gradient_bytes=parameter_bytes,  # grads: the params' dtype and sharding
        **on_device,
        peak_bytes=peak,
        reference_bytes=(_shard_bytes(steps.abstract_reference) if steps.abstract_reference
                         else None),
    )
    program = None
    if target.compile_only:
        text = compiled.as_text() if compiled is not None else None
        program = CompiledProgram(
            kernels=None if text is None else custom_calls(text),
            fp8_gemms=fp8_gemms(text) if target.is_gpu and text is not None else None,
            xla_preset=preset, compiler_options=dict(compiler_options or {}))
    return StepMeasurement(
        compiled_for=target,
        topology=_topology_of(target, setup.dcn, num_devices),
        mesh=MeshSizes.from_shape(mesh.shape),
        ici_mesh_shape=tuple(setup.ici),
        dcn_mesh_shape=tuple(setup.dcn),
        global_batch_size=global_batch,
        seq_len=seq_len,
        memory=memory,
        pipeline_split_parameter_bytes=_shard_bytes(steps.abstract_state.params,
                                                    over_axis=PIPELINE_AXIS),
        compiler_flops_per_device=None if compiled is None else _flops_of(compiled),
        compile_s=round(compile_s, 2),
        attention_note=setup.attention_note,
        program=program,
        refused=refused,
    )


def _compile(lowered, *, target: CompileTarget,
             options: dict[str, str] | None) -> tuple[Any, HbmRefusal | None]:
    """(the compiled step, None), or (None, the refusal) where the TPU compiler refuses a program
    that does not fit the chip (compile_targets/tpu.py: it compiles nothing bigger)."""
    try:
        return lowered.compile(options), None
    except RuntimeError as error:  # JaxRuntimeError; only the TPU's out-of-memory refusal is read
        oom = compile_targets.hbm_oom(error) if target.is_tpu else None
        if oom is None:
            raise
        needed, available = oom
        return None, HbmRefusal(needed_bytes=needed, available_bytes=available,
                                message=" ".join(str(error).split())[:400])


def _memory_analysis(compiled) -> dict[str, int]:
    stats = compiled.memory_analysis()
    return {"argument_bytes": int(stats.argument_size_in_bytes),
            "output_bytes": int(stats.output_size_in_bytes),
            "alias_bytes": int(stats.alias_size_in_bytes),
            "temp_bytes": int(stats.temp_size_in_bytes),
            "generated_code_bytes": int(stats.generated_code_size_in_bytes)}


def _compiler_peak(compiled) -> int:
    """The compiler's own peak of the program's live bytes (0 where it states none)."""
    return int(getattr(compiled.memory_analysis(), "peak_memory_in_bytes", 0) or 0)


def _refused_memory(refused: HbmRefusal, *, arguments: int, donated: int) -> dict[str, int]:
    """The memory analysis a refused program would have had: its arguments (exact: the shards of
    the state, the batch and a DPO reference), the donated state's outputs in the arguments'
    buffers, and the rest of the compiler's total as temporaries (its figure, to 0.01 GiB)."""
    return {"argument_bytes": arguments, "output_bytes": donated, "alias_bytes": donated,
            "temp_bytes": max(refused.needed_bytes - arguments, 0), "generated_code_bytes": 0}


def _topology_of(target: CompileTarget, dcn: list[int], num_devices: int) -> str | None:
    """The compile-only devices' topology: a TPU slice's, or the GPUs' hosts (None for cpu)."""
    if target.tpu is not None:
        return target.tpu.topology
    if target.is_gpu:
        hosts = math.prod(dcn)
        return str(compile_targets.GpuTopology(hosts=hosts, gpus_per_host=num_devices // hosts))
    return None


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
    """(device bytes, dense BF16 TFLOP/s) a plan for `target` assumes unless told: a GPU's memory
    and a TPU chip's HBM as the TPU compiler lets a program use it (compile_targets/chips.py), with
    their peaks; for `cpu` an H100's 80 GiB and peak. A TPU target's device count is its chips
    (`CompileTarget.num_devices`), the `--devices` a plan for it takes by default."""
    target = CompileTarget.parse(target)
    if target.compile_only:
        return target.memory_bytes, target.peak_tflops
    return int(DEFAULT_DEVICE_MEMORY_GIB * GIB), DEFAULT_PEAK_TFLOPS
