"""The plan as a person reads it: `python -m paxlite plan`'s text (its JSON is Plan.to_json)."""

from __future__ import annotations

from paxlite.planner.results import (
    GIB,
    Lever,
    LongestSeqFound,
    MoePlan,
    PipelinePlan,
    Plan,
    SeqPlan,
)


def _gib(n: float) -> str:
    """Bytes in the largest binary unit that keeps a number >= 1 (GiB at most)."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def format_text(p: Plan) -> str:
    m = p.memory_per_device
    mesh = " x ".join(f"{axis} {size}" for axis, size in p.mesh.to_json().items())
    flops = p.flops_per_step
    lines = [
        (f"{p.experiment} ({p.experiment_class}) on {p.num_devices} devices: mesh {mesh} "
         f"(ICI {list(p.ici_mesh_shape)} x DCN {list(p.dcn_mesh_shape)})"),
        (f"  {p.num_params:,} parameters; global batch {p.global_batch_size} x {p.seq_len}"
         f" = {p.tokens_per_step:,} tokens per step"),
        f"  remat: {p.remat}",
        *_compiler_lines(p),
        f"  parameters          {_gib(m.parameter_bytes):>14}",
        f"  optimizer state     {_gib(m.optimizer_state_bytes):>14}",
        f"  gradients           {_gib(m.gradient_bytes):>14}  (live inside temporaries)",
        *([] if m.reference_bytes is None else
          [f"  DPO reference       {_gib(m.reference_bytes):>14}  (its parameters)"]),
        (f"  arguments           {_gib(m.argument_bytes):>14}  (state + batch"
         f"{'' if m.reference_bytes is None else ' + DPO reference'})"),
        f"  outputs             {_gib(m.output_bytes):>14}",
        f"  aliased (donated)   {_gib(m.alias_bytes):>14}",
        f"  temporaries (peak)  {_gib(m.temp_bytes):>14}",
        f"  generated code      {_gib(m.generated_code_bytes):>14}",
        f"  peak live           {_gib(m.peak_bytes):>14}  = {p.peak_formula}",
        _attention_line(p),
        *_moe_lines(p.moe),
        *_pipeline_lines(p.pipeline),
        *_seq_lines(p.sequence_parallel),
        (f"Verdict: {'fits' if p.verdict.fits else 'does NOT fit'} in "
         f"{_gib(p.device_memory_bytes)}: {_gib(abs(p.verdict.margin_bytes))} "
         f"{'to spare' if p.verdict.fits else 'short'}"),
        f"FLOPs per step: analytic {flops.analytic:.4g} (6N + attention, "
        f"{flops.analytic_per_token:,} per token); compiler "
        + (f"not available ({flops.compiler_note or 'no cost analysis'})"
           if flops.compiler_total is None else
           f"{flops.compiler_total:.4g} ({flops.compiler_per_device:.4g} per device x "
           f"{p.num_devices}; counts rematerialisation"
           + ("; counts the scanned layer stack's loop body ONCE, so it is not comparable"
              if flops.compiler_counts_scanned_layers_once else "") + ")"),
        (f"At 100% MFU ({p.peak_tflops_per_device:g} TFLOP/s per device): "
         f"{p.step_time_at_100pct_mfu_s:.4g} s per step, "
         f"{p.tokens_per_s_at_100pct_mfu:,.0f} tokens/s. Real MFU is lower; the batch that "
         "memory allows bounds it."),
    ]
    if p.levers:
        lines.append("Levers (each re-planned; none changes the model):")
        lines += [_lever_line(lever) for lever in p.levers]
    lines += _longest_seq_lines(p.longest_seq, p.device_memory_bytes)
    lines.append(f"Planned in {p.plan_s:.1f} s (compile {p.compile_s:.1f} s).")
    return "\n".join(lines)


def _lever_line(lever: Lever) -> str:
    if lever.skipped is not None:
        return f"  {lever.lever}: not compiled ({lever.skipped})"
    if lever.refused:
        return f"  {lever.lever}: not applicable: {lever.reason}"
    return (f"  {lever.lever}: peak {_gib(lever.peak_bytes)} -> "
            f"{'fits' if lever.fits else 'does not fit'} [{lever.method}]")


def _compiler_lines(p: Plan) -> list[str]:
    """Which compiler measured, and what a GPU or TPU program launches (custom calls, FP8 GEMMs)."""
    program, target = p.program, p.compiled_for
    if program is None:
        lines = ["Memory per device (train step compiled for CPU; GPU temporaries differ):"]
        if p.attention_note:
            lines.append(f"  ({p.attention_note})")
        return lines
    if target.is_tpu:
        lines = [(f"Memory per device (train step compiled for {target.describe()} by the TPU "
                  "compiler, no XLA preset):")]
        if p.refused is not None:
            lines.append(f"  (the TPU compiler refused the program: it needs "
                         f"{_gib(p.refused.needed_bytes)} of the chip's "
                         f"{_gib(p.refused.available_bytes)}; its temporaries below are that "
                         "figure less the arguments)")
    else:
        lines = [(f"Memory per device (train step compiled for {target.value} by XLA's GPU "
                  f"compiler, preset {program.xla_preset!r}; no autotuning; temporaries include "
                  "cuBLAS workspaces):")]
    if p.attention_note:
        lines.append(f"  ({p.attention_note})")
    if program.kernels is not None:
        calls = ", ".join(f"{name} x{count}" for name, count in program.kernels.items()) or "none"
        lines.append(f"  kernels (custom calls, each call site once): {calls}")
    fp8 = program.fp8_gemms
    if fp8:
        lines.append(f"  FP8 GEMMs: {fp8['total']} (cuBLASLt {fp8['cublaslt']}, cuBLAS "
                     f"{fp8['cublas']}, Triton {fp8['triton']})")
    return lines


def _attention_line(p: Plan) -> str:
    logits = p.attention_logits_bytes_per_layer
    if logits is None:
        return (f"  (attention: the fused {p.attention_kernel!r} kernel, no [B, N, T, S] "
                "logits among the temporaries)")
    return (f"  (of the temporaries: attention logits of one layer, float32 [B, N, T, S], "
            f"{_gib(logits)})")


def _moe_lines(moe: MoePlan | None) -> list[str]:
    if moe is None:
        return []
    head = (f"  MoE: {moe.num_experts} experts (top-{moe.experts_per_token}, "
            f"{moe.routing}) on {moe.moe_layers} layers, {moe.experts_per_device} per "
            f"device (expert axis {moe.expert_axis})")
    if moe.gshard is not None:
        gshard = moe.gshard
        return [head, (f"  (of the temporaries: dispatch + combine of one MoE layer "
                       f"[G, S, E, C] = {gshard.groups} groups x {gshard.group_size} tokens x "
                       f"{moe.num_experts} x capacity {gshard.capacity}: "
                       f"{_gib(gshard.dispatch_combine_bytes_per_device)} per device)")]
    dropless = moe.dropless
    return [head, (f"  (of the temporaries: {dropless.sorted_rows_per_device:,} sorted expert "
                   f"rows of one MoE layer, {_gib(dropless.sorted_rows_bytes_per_device)} per "
                   "device)")]


def _pipeline_lines(pipe: PipelinePlan | None) -> list[str]:
    if pipe is None:
        return []
    lines = [
        (f"  Pipeline: {pipe.num_stages} stages over a pipeline axis of {pipe.pipeline_axis}, "
         f"{pipe.schedule} schedule (repeats {pipe.repeats}), {pipe.num_microbatches} "
         f"microbatches of {pipe.microbatch_rows} rows, {pipe.iterations} iterations"),
        (f"  bubble fraction {pipe.bubble_fraction:.4f} = {pipe.bubble_formula} with S = "
         f"{pipe.num_stages}, R = {pipe.repeats}, M = {pipe.num_microbatches}"),
    ]
    if not pipe.memory_is_per_stage:
        lines.append("  (a pipeline axis of 1: every device runs all stages; the memory above is "
                     "the whole stack's)")
    elif pipe.layers_split_over_stages:
        lines.append(
            f"  The memory above is PER STAGE: each device holds {pipe.stages_per_device} "
            f"stage(s) of {pipe.layers_per_stage} layers: "
            f"{_gib(pipe.stage_layer_parameter_bytes)} of layer parameters, and "
            f"{_gib(pipe.parameter_bytes_on_every_stage)} that every stage holds (embedding, "
            "norms)")
    else:
        lines.append(
            "  The layers are NOT split over the stages (an unscanned stack has no [L] axis to "
            "split; USE_REPEATED_LAYER=true splits it): every device holds all "
            f"{_gib(pipe.parameter_bytes_on_every_stage)} of parameters")
    return lines


def _seq_lines(seq: SeqPlan | None) -> list[str]:
    if seq is None:
        return []
    return [(f"  Sequence parallel: seq {seq.seq} ({seq.strategy}, load balance "
             f"{'on' if seq.load_balance else 'off'}): {seq.tokens_per_shard:,} tokens per "
             f"shard; each device holds {seq.rows_per_device} row(s) x "
             f"{seq.tokens_per_shard:,} = {seq.tokens_per_device:,} tokens")]


def _longest_seq_lines(found: LongestSeqFound | None, device_bytes: int) -> list[str]:
    if found is None:
        return []
    where = f"at {found.rows_per_device} row(s) per device"
    if found.seq > 1:
        where += f", seq {found.seq}"
    if found.pinned:
        head = (f"Longest sequence that fits {_gib(device_bytes)} {where}: "
                f"{found.seq_len:,} tokens ({found.tokens_per_shard:,} per seq shard) "
                f"[compiled: {_gib(found.peak_bytes)}; {found.seq_len + found.step:,} "
                f"does not fit at {_gib(found.next_peak_bytes)}]")
    elif found.bracket[0] is None:
        head = (f"Longest sequence that fits {_gib(device_bytes)} {where}: none; not even "
                f"{found.step:,} tokens fit")
    else:
        lo, hi = found.bracket
        head = (f"Longest sequence that fits {_gib(device_bytes)} {where}: not pinned down in "
                f"{found.compiles} compiles: {lo:,} fits" + (f", {hi:,} does not" if hi else ""))
    return [head, f"  (method: {found.method}; {found.compiles} compiles)"]
