"""The plan as a person reads it: `python -m paxlite plan`'s text (its JSON is the dict itself)."""

from __future__ import annotations

from typing import Any

_GIB = 2**30


def _gib(n: float) -> str:
    """Bytes in the largest binary unit that keeps a number >= 1 (GiB at most)."""
    for unit, size in (("GiB", _GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def format_text(p: dict[str, Any]) -> str:
    m = p["memory_per_device"]
    mesh = " x ".join(f"{axis} {size}" for axis, size in p["mesh"].items())
    flops = p["flops_per_step"]
    lines = [
        (f"{p['experiment']} ({p['class']}) on {p['num_devices']} devices: mesh {mesh} "
         f"(ICI {p['ici_mesh_shape']} x DCN {p['dcn_mesh_shape']})"),
        (f"  {p['num_params']:,} parameters; global batch {p['global_batch_size']} x {p['seq_len']}"
         f" = {p['tokens_per_step']:,} tokens per step"),
        "Memory per device (train step compiled for CPU; GPU temporaries differ):",
        f"  parameters          {_gib(m['parameter_bytes']):>14}",
        f"  optimizer state     {_gib(m['optimizer_state_bytes']):>14}",
        f"  gradients           {_gib(m['gradient_bytes']):>14}  (live inside temporaries)",
        f"  arguments           {_gib(m['argument_bytes']):>14}  (state + batch)",
        f"  outputs             {_gib(m['output_bytes']):>14}",
        f"  aliased (donated)   {_gib(m['alias_bytes']):>14}",
        f"  temporaries (peak)  {_gib(m['temp_bytes']):>14}",
        f"  generated code      {_gib(m['generated_code_bytes']):>14}",
        f"  peak live           {_gib(m['peak_bytes']):>14}  = {p['peak_formula']}",
        (f"  (of the temporaries: attention logits of one layer, float32 [B, N, T, S], "
         f"{_gib(p['attention_logits_bytes_per_layer'])})"),
        *_moe_lines(p.get("moe")),
        (f"Verdict: {'fits' if p['fits'] else 'does NOT fit'} in "
         f"{_gib(p['device_memory_bytes'])}: {_gib(abs(p['margin_bytes']))} "
         f"{'to spare' if p['fits'] else 'short'}"),
        f"FLOPs per step: analytic {flops['analytic']:.4g} (6N + attention, "
        f"{flops['analytic_per_token']:,} per token); compiler "
        + ("n/a" if flops["compiler_total"] is None else
           f"{flops['compiler_total']:.4g} ({flops['compiler_per_device']:.4g} per device x "
           f"{p['num_devices']}; counts rematerialisation"
           + ("; counts the scanned layer stack's loop body ONCE, so it is not comparable"
              if flops["compiler_counts_scanned_layers_once"] else "") + ")"),
        (f"At 100% MFU ({p['peak_tflops_per_device']:g} TFLOP/s per device): "
         f"{p['step_time_at_100pct_mfu_s']:.4g} s per step, "
         f"{p['tokens_per_s_at_100pct_mfu']:,.0f} tokens/s. Real MFU is lower; the batch that "
         "memory allows bounds it."),
    ]
    if p["levers"]:
        lines.append("Levers (each re-planned; none changes the model):")
        for lever in p["levers"]:
            if lever.get("applicable", True):
                lines.append(f"  {lever['lever']}: peak {_gib(lever['peak_bytes'])} -> "
                             f"{'fits' if lever['fits'] else 'does not fit'} "
                             f"[{lever['method']}]")
            else:
                lines.append(f"  {lever['lever']}: not applicable: {lever['reason']}")
    lines.append(f"Planned in {p['plan_s']:.1f} s (compile {p['compile_s']:.1f} s).")
    return "\n".join(lines)


def _moe_lines(moe: dict[str, Any] | None) -> list[str]:
    if moe is None:
        return []
    head = (f"  MoE: {moe['num_experts']} experts (top-{moe['experts_per_token']}, "
            f"{moe['routing']}) on {moe['moe_layers']} layers, {moe['experts_per_device']} per "
            f"device (expert axis {moe['expert_axis']})")
    if "dispatch_combine_bytes_per_device" in moe:
        return [head, (f"  (of the temporaries: dispatch + combine of one MoE layer "
                       f"[G, S, E, C] = {moe['groups']} groups x {moe['group_size']} tokens x "
                       f"{moe['num_experts']} x capacity {moe['capacity']}: "
                       f"{_gib(moe['dispatch_combine_bytes_per_device'])} per device)")]
    return [head, (f"  (of the temporaries: {moe['sorted_rows_per_device']:,} sorted expert rows "
                   f"of one MoE layer, {_gib(moe['sorted_rows_bytes_per_device'])} per device)")]
