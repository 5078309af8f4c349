"""Model FLOPs per token and MFU, MaxText convention.

Training FLOPs per token (forward + backward = 3 x forward), for a decoder-only transformer with
L layers, model width D, H query heads and K key/value heads of size h, MLP width F, vocabulary V
and sequence length S:

    per layer, forward matmuls:
        QKV projections      2 * D * (H + 2K) * h
        attention output     2 * D * H * h
        MLP                  2 * D * F * (3 if gated else 2)    (gate + up + down, or up + down)
    unembedding              2 * D * V                           (once, not per layer)
    matmul total             T = L * (QKV + out + MLP) + unembedding  = 2 * N_matmul
    causal attention         3 * 2 * S * H * h per layer         (scores + context, 4*S*H*h,
                                                                  halved for the causal mask)

    flops_per_token = 3 * T + L * 6 * S * H * h = 6 * N_matmul + 6 * L * S * H * h

LoRA (`lora_params`, the adapters' parameter count, given): FLOPs are the work actually done. The
frozen weights need no weight gradient, only the gradient of their input, so their matmuls cost
2 x forward instead of 3 x; each adapter parameter costs 6 (forward 2, input and weight gradients
2 + 2), as a trained weight does; attention has no weights and keeps its 3 x:

    flops_per_token (LoRA) = 2 * T + 6 * lora_params + L * 6 * S * H * h
                           = 4 * N_matmul + 6 * lora_params + 6 * L * S * H * h

(The input gradient below the lowest adapter, which XLA may skip, is still counted.)

Sliding-window attention (`sliding_window` W, on `num_windowed_layers` of the layers: Mistral
v0.1's every layer, Gemma's local ones): a windowed layer's attention term counts min(W, S) keys
instead of S, MaxText's count for Gemma 2's local layers (halved for the mask as the full term is):

    windowed layer, attention   3 * 2 * min(W, S) * H * h           (replaces 3 * 2 * S * H * h)

Chunked attention (`attention_chunk_size` C on `num_chunked_layers` layers, Llama 4's RoPE layers):
a query sees the keys of its own chunk of C positions, causally, which is causal attention over
sequences of min(C, S), so the full term with S replaced by min(C, S):

    chunked layer, attention    3 * 2 * min(C, S) * H * h           (replaces 3 * 2 * S * H * h)

Mixture of experts (`num_moe_layers` > 0): an MoE layer replaces its dense MLP term by what one
token actually runs through, MaxText's count: the router, 2 * D * E, plus the MLP of the
`experts_per_token` (k) experts it is routed to, each 2 * D * F_e * (3 if gated experts else 2);
the other E - k experts cost it nothing. Dense layers keep their MLP term:

    MoE layer, forward   2 * D * E + k * 2 * D * F_e * (3 if gated else 2)    (replaces MLP)

A shared expert (`shared_expert_hidden_dims` F_s: DeepSeek's `n_shared_experts *
moe_intermediate_size`) is a gated MLP every token of an MoE layer runs beside its k experts:

    MoE layer, forward   ... + 2 * D * F_s * 3                                (shared expert)

Dense first layers (DeepSeek's `first_k_dense_replace`) are simply layers outside the
`num_moe_layers`: they keep the dense MLP term of width F.

Multi-head latent attention (`mla`, DeepSeek-V2/V3; `LatentAttentionSizes`): with h the query/key
head size (qk_nope + qk_rope, `dims_per_head`), h_r its rotary part, v the value head size, r_kv
the key/value latent and r_q the query latent (None: one query projection), the QKV and output
terms are replaced by

    query                2 * D * r_q + 2 * r_q * H * h      (q_a, q_b), or 2 * D * H * h (q_proj)
    kv_a                 2 * D * (r_kv + h_r)                (latent and the shared rotary key)
    kv_b                 2 * r_kv * H * ((h - h_r) + v)      (per-head nope keys and values)
    attention output     2 * H * v * D
    causal attention     3 * S * H * (h + v) per layer       (scores over h, context over v, halved)

which for v = h is the attention term above.

GShard's dispatch and combine einsums (tokens -> expert slots and back) and the slots left empty
or dropped by the capacity limit are not counted, as MaxText does not count them either: the
count is the model's work per token, not the padded work of the implementation.

The input embedding lookup is a gather (0 FLOPs), and norms, biases and activations are not
counted. This is MaxText's `calculate_tflops_training_per_device` (with the causal halving of
maxtext PR #1988) divided by tokens; Levanter counts the full attention map and so reports a
higher MFU for the same run. MFU = tokens/s * flops_per_token / (peak per device * devices).
"""

from __future__ import annotations

import dataclasses
import math

# The peaks per device (GPUs and TPUs, bf16, FP8 and int8) are the accelerators' table, shared
# with the planner's compile targets: paxlite/parallel/compile_targets/chips.py.
from paxlite.parallel.compile_targets.chips import peaks_for_device_kind


@dataclasses.dataclass(frozen=True, kw_only=True)
class LatentAttentionSizes:
    """The sizes multi-head latent attention's count needs (models/mla_attention.py MlaConfig's)."""

    kv_lora_rank: int
    qk_rope_head_dims: int
    v_head_dims: int
    q_lora_rank: int | None = None

    def problems(self, *, dims_per_head: int) -> list[str]:
        bad = [f"mla.{name}={getattr(self, name)!r} must be a positive integer"
               for name in ("kv_lora_rank", "qk_rope_head_dims", "v_head_dims")
               if not _positive(getattr(self, name))]
        if self.q_lora_rank is not None and not _positive(self.q_lora_rank):
            bad.append(f"mla.q_lora_rank={self.q_lora_rank!r} must be a positive integer or None")
        if not bad and self.qk_rope_head_dims >= dims_per_head:
            bad.append(f"mla.qk_rope_head_dims={self.qk_rope_head_dims} must be smaller than "
                       f"dims_per_head={dims_per_head} (qk_nope + qk_rope)")
        return bad


def _positive(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value > 0


def _latent_attention(mla: LatentAttentionSizes, *, model_dims: int, num_heads: int,
                      dims_per_head: int) -> tuple[int, int, int]:
    """(query + key/value projections, output projection) forward FLOPs per layer, and the
    per-key attention width h + v (module docstring)."""
    d, h, v, heads = model_dims, dims_per_head, mla.v_head_dims, num_heads
    if mla.q_lora_rank is None:
        query = 2 * d * heads * h
    else:
        query = 2 * d * mla.q_lora_rank + 2 * mla.q_lora_rank * heads * h
    kv_a = 2 * d * (mla.kv_lora_rank + mla.qk_rope_head_dims)
    kv_b = 2 * mla.kv_lora_rank * heads * ((h - mla.qk_rope_head_dims) + v)
    return query + kv_a + kv_b, 2 * heads * v * d, h + v


def flops_per_token(
    *,
    num_layers: int,
    model_dims: int,
    num_heads: int,
    num_kv_heads: int,
    dims_per_head: int,
    hidden_dims: int,
    vocab_size: int,
    seq_len: int,
    gated_mlp: bool = False,
    lora_params: int | None = None,
    num_moe_layers: int = 0,
    num_experts: int | None = None,
    experts_per_token: int = 2,
    expert_hidden_dims: int | None = None,
    gated_experts: bool = False,
    sliding_window: int | None = None,
    num_windowed_layers: int | None = None,
    shared_expert_hidden_dims: int | None = None,
    mla: LatentAttentionSizes | None = None,
    attention_chunk_size: int | None = None,
    num_chunked_layers: int = 0,
) -> int:
    """Training FLOPs per token (see the module docstring for the formula).

    `lora_params`: None when every weight trains; with LoRA, the number of adapter parameters (the
    base weights are then frozen, and their weight gradients, never computed, are not counted).
    `num_moe_layers` of the `num_layers` are MoE layers of `num_experts` experts (hidden size
    `expert_hidden_dims`, default `hidden_dims`), of which each token runs `experts_per_token`.
    `num_windowed_layers` of the layers (default: all of them when `sliding_window` is given)
    attend over the last `sliding_window` positions only. `shared_expert_hidden_dims`: each MoE
    layer's shared expert (a gated MLP every token runs). `mla`: the layers' attention is
    multi-head latent attention of these sizes (`dims_per_head` is its query/key head size).
    `num_chunked_layers` of the other layers attend within chunks of `attention_chunk_size`
    positions (Llama 4's RoPE layers).
    """
    sizes = {
        "num_layers": num_layers,
        "model_dims": model_dims,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "dims_per_head": dims_per_head,
        "hidden_dims": hidden_dims,
        "vocab_size": vocab_size,
        "seq_len": seq_len,
    }
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if lora_params is not None and (
            isinstance(lora_params, bool) or not isinstance(lora_params, int) or lora_params <= 0):
        raise ValueError(f"lora_params must be a positive integer or None, got {lora_params!r}.")
    if isinstance(num_moe_layers, bool) or not isinstance(num_moe_layers, int) or not (
            0 <= num_moe_layers <= num_layers):
        raise ValueError(
            f"num_moe_layers must be an integer in [0, num_layers={num_layers}], got "
            f"{num_moe_layers!r}.")
    moe_mlp = 0
    if num_moe_layers:
        expert_f = hidden_dims if expert_hidden_dims is None else expert_hidden_dims
        for name, value in (("num_experts", num_experts), ("experts_per_token", experts_per_token),
                            ("expert_hidden_dims", expert_f)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer with MoE layers, got "
                                 f"{value!r}.")
        if experts_per_token > num_experts:
            raise ValueError(f"experts_per_token={experts_per_token} exceeds "
                             f"num_experts={num_experts}.")
        router = 2 * model_dims * num_experts
        expert = 2 * model_dims * expert_f * (3 if gated_experts else 2)
        moe_mlp = router + experts_per_token * expert
        if shared_expert_hidden_dims is not None:
            if not _positive(shared_expert_hidden_dims):
                raise ValueError(f"shared_expert_hidden_dims must be a positive integer or None, "
                                 f"got {shared_expert_hidden_dims!r}.")
            moe_mlp += 2 * model_dims * shared_expert_hidden_dims * 3
    qkv = 2 * model_dims * (num_heads + 2 * num_kv_heads) * dims_per_head
    attention_out = 2 * model_dims * num_heads * dims_per_head
    attention_width = 2 * dims_per_head  # scores over h, context over h
    if mla is not None:
        if problems := mla.problems(dims_per_head=dims_per_head):
            raise ValueError("; ".join(problems) + ".")
        qkv, attention_out, attention_width = _latent_attention(
            mla, model_dims=model_dims, num_heads=num_heads, dims_per_head=dims_per_head)
    mlp = 2 * model_dims * hidden_dims * (3 if gated_mlp else 2)
    unembedding = 2 * model_dims * vocab_size
    forward_matmuls = (num_layers * (qkv + attention_out) + (num_layers - num_moe_layers) * mlp
                       + num_moe_layers * moe_mlp + unembedding)
    windowed = 0
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or (
                sliding_window <= 0):
            raise ValueError(f"sliding_window must be a positive integer or None, got "
                             f"{sliding_window!r}.")
        windowed = num_layers if num_windowed_layers is None else num_windowed_layers
    if isinstance(windowed, bool) or not isinstance(windowed, int) or not (
            0 <= windowed <= num_layers):
        raise ValueError(f"num_windowed_layers must be an integer in [0, num_layers={num_layers}]"
                         f", got {windowed!r}.")
    chunked = _chunked_layers(attention_chunk_size, num_chunked_layers,
                              free_layers=num_layers - windowed)
    keys = ((num_layers - windowed - chunked) * seq_len
            + windowed * min(sliding_window or 0, seq_len)
            + chunked * min(attention_chunk_size or 0, seq_len))
    causal_attention = 3 * keys * num_heads * attention_width  # (scores + context) / 2 x 3
    if lora_params is not None:  # frozen: forward + input gradient; adapters: 6 per parameter
        return 2 * forward_matmuls + 6 * lora_params + causal_attention
    return 3 * forward_matmuls + causal_attention


def _chunked_layers(chunk: int | None, layers: int, *, free_layers: int) -> int:
    """The number of chunked layers, checked: a chunk size exactly when there are such layers,
    and no more of them than the layers not windowed."""
    if isinstance(layers, bool) or not isinstance(layers, int) or not 0 <= layers <= free_layers:
        raise ValueError(f"num_chunked_layers must be an integer in [0, {free_layers}] (the "
                         f"layers not windowed), got {layers!r}.")
    if layers and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0):
        raise ValueError(f"attention_chunk_size must be a positive integer with chunked layers, "
                         f"got {chunk!r}.")
    return layers


def peak_flops_per_device(
    device_kind: str, *, override_tflops: float | None = None, fp8: bool = False
) -> float | None:
    """Dense peak FLOP/s of one device, or None where it is unknown (CPU, unlisted parts).

    Args:
        device_kind: `jax.Device.device_kind`, e.g. "NVIDIA H100 80GB HBM3" or "TPU v5 lite".
        override_tflops: The user's --fdl.PEAK_TFLOPS in TFLOP/s; wins over the table.
        fp8: Use the FP8 peak; None on devices without FP8 matmul units (A100, TPU v4, v5e,
            v5p), because an FP8 run there does not run at any published FP8 rate.
    """
    if override_tflops is not None:
        if not (math.isfinite(override_tflops) and override_tflops > 0):
            raise ValueError(
                f"override_tflops must be a finite number of TFLOP/s > 0, got {override_tflops!r}."
            )
        return float(override_tflops) * 1e12
    peaks = peaks_for_device_kind(device_kind)
    if peaks is None:
        return None
    tflops = peaks.fp8_tflops if fp8 else peaks.bf16_tflops
    return None if tflops is None else tflops * 1e12


def peak_int8_ops_per_device(device_kind: str) -> float | None:
    """Dense int8 peak ops/s of one device (the low-precision matmul path of TPU v5e, v5p and
    v6e: the ceiling an int8 matmul benchmark is measured against), or None where none is
    recorded."""
    peaks = peaks_for_device_kind(device_kind)
    return None if peaks is None or peaks.int8_tops is None else peaks.int8_tops * 1e12


def model_flops_utilization(
    *,
    tokens_per_s: float,
    flops_per_token: float,
    peak_flops_per_device: float | None,
    num_devices: int,
) -> float | None:
    """Achieved model FLOP/s over the peak of all devices (a fraction, 0.41 = 41%)."""
    if num_devices <= 0:
        raise ValueError(f"num_devices must be >= 1, got {num_devices!r}.")
    if peak_flops_per_device is None:
        return None
    if peak_flops_per_device <= 0:
        raise ValueError(
            f"peak_flops_per_device must be > 0 FLOP/s or None, got {peak_flops_per_device!r}."
        )
    return tokens_per_s * flops_per_token / (peak_flops_per_device * num_devices)
