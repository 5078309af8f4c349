"""The plan of one compile: the measured step (paxlite/planner/search.py) against the device's
memory, with what the run's attention, pipeline, seq axis, MoE layers and FLOPs make of it.

The levers and the longest sequence (paxlite/planner/levers.py, longest_seq.py) are added by
paxlite/planner/plan.py when they are wanted; everything here costs one compile.
"""

from __future__ import annotations

import dataclasses

from paxlite.parallel.compile_targets import CompileTarget
from paxlite.planner.results import (
    GIB,
    PEAK_FORMULA,
    TPU_PEAK_FORMULA,
    FlopsPerStep,
    MoePlan,
    PipelinePlan,
    Plan,
    SeqPlan,
    StepMeasurement,
    Verdict,
)
from paxlite.planner.search import compile_train_step, target_defaults

# A fused attention kernel's custom call in a GPU or TPU program (prefix -> attention
# implementation); a TPU Pallas kernel is a `tpu_custom_call` named by compiled_kernels.
_FUSED_ATTENTION_CALLS = (("__cudnn$fmha", "cudnn"), ("__gpu$xla.gpu.triton", "pallas_triton"),
                          ("tpu_custom_call:splash", "splash"))


def _compiler_notes(measured: StepMeasurement) -> tuple[str, str | None]:
    """(where the memory figures come from, why there are no compiler FLOPs or None): the reader is
    told which compiler measured, and a missing number is never filled with another compiler's."""
    target = measured.compiled_for
    memory = ("XLA's CPU compiler: parameter, optimizer and gradient bytes are exact; GPU kernels, "
              "fusion and buffer assignment differ, so the temporaries are an estimate")
    flops = "XLA's CPU compiler gave no cost analysis"
    if target.is_gpu:
        memory = (f"XLA's GPU compiler for {target} (compile-only devices, XLA preset "
                  f"{measured.program.xla_preset!r}): the run's kernels and buffer "
                  "assignment, without autotuning (default GEMM configurations); temporaries "
                  "include cuBLAS workspaces")
        flops = (f"XLA's GPU compiler gives no cost analysis for a compile-only {target}: the "
                 "analytic count stands, and no CPU compile's count is put in its place")
    elif target.is_tpu:
        chip = target.tpu.chip
        memory = (f"the TPU compiler (libtpu) for {target.describe()}, compile-only, no XLA "
                  "preset (paxlite's are for GPUs): the run's fusion, memory-space and buffer "
                  f"assignment; the device memory is the HBM it lets a program use "
                  f"({chip.usable_hbm_bytes / GIB:.2f} GiB of a {chip.published_hbm_gib} GiB "
                  f"{chip.generation.value} chip)")
        if measured.refused is not None:
            memory += (": it refused this program, which needs "
                       f"{measured.refused.needed_bytes / GIB:.2f} GiB (its figure, to 0.01 GiB; "
                       "the temporaries are that less the arguments)")
        flops = (f"the TPU compiler gave no cost analysis for {target}: the analytic count "
                 "stands")
    return memory, None if measured.compiler_flops_per_device is not None else flops


def plan_base(experiment, *, num_devices: int, device_memory_gib: float | None = None,
              peak_tflops: float | None = None, target: CompileTarget = CompileTarget.CPU,
              ) -> tuple[Plan, StepMeasurement]:
    """(the plan without levers, compile_train_step's measurement it was made of).
    Memory and peak not given are the target's (target_defaults)."""
    import fiddle as fdl

    from paxlite.models.transformer import num_params

    default_bytes, default_tflops = target_defaults(target)
    device_bytes = default_bytes if device_memory_gib is None else int(device_memory_gib * GIB)
    peak_tflops = default_tflops if peak_tflops is None else peak_tflops
    measured = compile_train_step(experiment, num_devices=num_devices, target=target)
    model = fdl.build(experiment.model_config())
    tokens = measured.global_batch_size * measured.seq_len
    analytic = experiment.flops_per_token() * tokens
    compiler = measured.compiler_flops_per_device
    ideal_step_s = analytic / (num_devices * peak_tflops * 1e12)
    memory_note, flops_note = _compiler_notes(measured)
    kernels = (measured.program.kernels if measured.program is not None else None) or {}
    attention = next((name for prefix, name in _FUSED_ATTENTION_CALLS
                      if any(call.startswith(prefix) for call in kernels)), "xla")
    if measured.refused is not None and model.attention_implementation.value == "splash":
        attention = "splash"  # the program was not compiled: its kernels are not known
    plan = Plan(
        experiment=experiment.name,
        experiment_class=f"{type(experiment).__module__}.{type(experiment).__qualname__}",
        overrides={name: experiment.hparams()[name] for name in sorted(experiment.overridden)},
        num_devices=num_devices,
        **measured.layout(),
        memory_note=memory_note,
        tokens_per_step=tokens,
        # traced with XLA's attention (the same parameters): AUTO resolved here, off the target's
        # mesh, would log a fall-back to XLA that a GPU program does not make
        num_params=num_params(dataclasses.replace(model, attention_implementation="xla")),
        remat=experiment.remat_description(),
        memory_per_device=measured.memory,
        peak_formula=TPU_PEAK_FORMULA if measured.compiled_for.is_tpu else PEAK_FORMULA,
        device_memory_bytes=device_bytes,
        verdict=Verdict.of(peak_bytes=measured.memory.peak_bytes, device_bytes=device_bytes),
        attention_kernel=attention,
        attention_logits_bytes_per_layer=_attention_logits_bytes(
            experiment, model, measured) if attention == "xla" else None,
        pipeline=_pipeline_plan(model, measured, grad_accum_steps=experiment.GRAD_ACCUM_STEPS),
        sequence_parallel=_seq_plan(experiment, model, measured),
        moe=moe_plan(experiment, measured),
        attention_note=measured.attention_note,
        program=measured.program,
        refused=measured.refused,
        flops_per_step=FlopsPerStep(
            analytic=analytic,
            analytic_per_token=experiment.flops_per_token(),
            compiler_per_device=compiler,
            compiler_total=None if compiler is None else compiler * num_devices,
            compiler_note=flops_note,
            compiler_counts_scanned_layers_once=bool(experiment.USE_REPEATED_LAYER
                                                     or model.pipeline is not None),
        ),
        peak_tflops_per_device=peak_tflops,
        step_time_at_100pct_mfu_s=ideal_step_s,
        tokens_per_s_at_100pct_mfu=tokens / ideal_step_s,
        compile_s=measured.compile_s,
    )
    return plan, measured


def _attention_logits_bytes(experiment, model, measured: StepMeasurement) -> int:
    """The attention logits and probabilities [B, N, T, S] of one layer on one device: the model
    materialises them in float32, and under remat they are rebuilt layer by layer. With a seq axis
    a device holds T / seq queries against the whole row (all-gather) or one block (ring)."""
    from paxlite.models.parallel_config import ContextParallelStrategy

    mesh, seq_len = measured.mesh, measured.seq_len
    queries, keys = seq_len // mesh.seq, seq_len
    if mesh.seq > 1 and model.context_parallel_strategy is ContextParallelStrategy.RING:
        keys = seq_len // mesh.seq
    batch_rows = measured.global_batch_size // experiment.GRAD_ACCUM_STEPS
    rows = batch_rows // mesh.batch_ways
    if model.pipeline is not None:
        rows //= model.pipeline.microbatches(batch_rows)
    return 4 * max(rows, 1) * experiment.NUM_HEADS // mesh.tensor * queries * keys


def _pipeline_plan(model, measured: StepMeasurement, *,
                   grad_accum_steps: int) -> PipelinePlan | None:
    """Stages, schedule, microbatches and bubble of a pipelined run, and what one stage holds.

    ``microbatch_rows_per_device``: each microbatch's rows over data x fsdp x expert (a whole
    number: the run, and search.py's `_setup`, refuse others before compiling)."""
    pipe = model.pipeline
    if pipe is None:
        return None
    schedule = pipe.schedule(measured.global_batch_size // grad_accum_steps)
    axis = measured.mesh.pipeline
    split = measured.pipeline_split_parameter_bytes
    return PipelinePlan(
        **schedule,
        pipeline_axis=axis,
        stages_per_device=pipe.num_stages // axis,
        microbatch_rows_per_device=schedule["microbatch_rows"] // measured.mesh.batch_ways,
        layers_per_stage=model.num_layers // pipe.num_stages,
        stage_layer_parameter_bytes=split,
        parameter_bytes_on_every_stage=measured.memory.parameter_bytes - split,
        layers_split_over_stages=split > 0,
        memory_is_per_stage=axis > 1,
    )


def _seq_plan(experiment, model, measured: StepMeasurement) -> SeqPlan | None:
    """The seq axis: how many shards a row's tokens are split into and what one device holds."""
    seq = measured.mesh.seq
    if seq == 1:
        return None
    rows = measured.global_batch_size // measured.mesh.batch_ways
    return SeqPlan(seq=seq, strategy=model.context_parallel_strategy.value,
                   load_balance=bool(experiment.CONTEXT_PARALLEL_LOAD_BALANCE),
                   tokens_per_shard=measured.seq_len // seq, rows_per_device=rows,
                   tokens_per_device=rows * measured.seq_len // seq)


def moe_plan(experiment, measured: StepMeasurement) -> MoePlan | None:
    """Experts per device and the routing tensors of one MoE layer per device; None when dense."""
    import fiddle as fdl

    from paxlite.models.moe_params import num_moe_layers, routing_memory

    model = fdl.build(experiment.model_config())
    if model.moe is None:
        return None
    expert_axis = measured.mesh.expert
    return MoePlan.of(
        num_experts=model.moe.num_experts, experts_per_token=model.moe.experts_per_token,
        moe_layers=num_moe_layers(model), expert_axis=expert_axis,
        experts_per_device=model.moe.num_experts // expert_axis,
        routing_memory=routing_memory(
            model, global_tokens=measured.global_batch_size * measured.seq_len,
            mesh=measured.mesh.to_json()))
