"""Parameter counts of a decoder read off its config alone: total, per expert, and active per token.

``transformer.num_params`` counts a built model abstractly and is the authority. These closed
forms exist because some questions are about the config, not a model: how many parameters does
one token pass through (``num_active_params``: the router and its top-k experts of each MoE layer,
not all E), and how large is a config whose modules are not all written yet. The formulas follow
the parameter tree of ``docs/moe_experiments.md`` (and the MoE design): MoE layers hold
``moe/router/kernel [D, E]``, ``moe/wi/kernel [E, D, F]``, ``moe/wi_gate/kernel [E, D, F]``
(gated experts only) and ``moe/wo/kernel [E, F, D]``, with no biases but gpt-oss's
(``moe.use_bias``: ``bias`` [E, out] beside each kernel, [E] beside the router's); the relative
position bias of ``PositionEmbedding.RELATIVE_BIAS`` is one ``[buckets, heads]`` table per layer,
as in Praxis's ``RelativeBias`` (each attention layer owns one). A test checks the dense part
against the built model, so the two cannot drift apart unnoticed.
"""

from __future__ import annotations

from paxlite.models.transformer_config import NormKind, PositionEmbedding, TransformerConfig


def _norm_params(config: TransformerConfig) -> int:
    d = config.model_dims
    return 2 * d if config.norm is NormKind.LAYER_NORM else d  # LayerNorm: scale + bias


def expert_hidden_dims(config: TransformerConfig) -> int:
    """The hidden size of one expert (``moe.expert_hidden_dims``, else the dense
    ``hidden_dims``)."""
    if config.moe is None:
        raise ValueError("expert_hidden_dims: the config has no MoE layers (moe is None)")
    return config.moe.expert_hidden_dims or config.hidden_dims


def params_per_expert(config: TransformerConfig) -> int:
    """One expert's weights: wi and wo (and wi_gate when gated), and their biases with
    ``moe.use_bias``."""
    matrices = 3 if config.moe.gated_experts else 2
    f = expert_hidden_dims(config)
    biases = ((matrices - 1) * f + config.model_dims) if config.moe.use_bias else 0
    return matrices * config.model_dims * f + biases


def router_params(config: TransformerConfig) -> int:
    """The router of one MoE layer: a [D, E] kernel, and an [E] bias with ``moe.use_bias``."""
    return (config.model_dims + int(config.moe.use_bias)) * config.moe.num_experts


def shared_expert_params(config: TransformerConfig) -> int:
    """The shared expert of one MoE layer (gated: three matrices, no biases); 0 without one."""
    hidden = config.moe.shared_expert_hidden_dims
    return 0 if hidden is None else 3 * config.model_dims * hidden


def expert_params_per_layer(config: TransformerConfig) -> int:
    """Every parameter of one MoE layer's feed-forward block: the router, all E experts and the
    shared expert."""
    router = config.moe.deepseek_router
    bias = config.moe.num_experts if router is not None and router.uses_bias else 0
    return (router_params(config) + bias + config.moe.num_experts * params_per_expert(config)
            + shared_expert_params(config))


def num_moe_layers(config: TransformerConfig) -> int:
    return 0 if config.moe is None else config.moe.num_moe_layers(config.num_layers)


def _dense_mlp_params(config: TransformerConfig) -> int:
    d, f = config.model_dims, config.hidden_dims
    matrices = 3 if config.gated_mlp else 2
    biases = ((2 if config.gated_mlp else 1) * f + d) if config.use_bias else 0
    return matrices * d * f + biases


def _mla_params(config: TransformerConfig) -> int:
    """Multi-head latent attention's projections and latent norms (no biases)."""
    mla, d, n = config.mla, config.model_dims, config.num_heads
    query = (d * n * mla.qk_head_dims if mla.q_lora_rank is None
             else d * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * n * mla.qk_head_dims)
    kv = (d * (mla.kv_lora_rank + mla.qk_rope_head_dims) + mla.kv_lora_rank
          + mla.kv_lora_rank * n * (mla.qk_nope_head_dims + mla.v_head_dims))
    return query + kv + n * mla.v_head_dims * d


def _attention_params(config: TransformerConfig) -> int:
    if config.mla is not None:
        return _mla_params(config)
    d, h = config.model_dims, config.dims_per_head
    q, kv = config.num_heads * h, config.kv_heads * h
    weights = d * (q + 2 * kv) + q * d
    qkv_bias = config.use_bias if config.qkv_bias is None else config.qkv_bias
    out_bias = config.use_bias if config.out_bias is None else config.out_bias
    biases = (q + 2 * kv if qkv_bias else 0) + (d if out_bias else 0)
    biases += config.num_heads if config.attention_sinks else 0  # gpt-oss's sinks [N]
    norms = 2 * h if config.qk_norm else 0  # Qwen3's RMSNorm scales of q and k, [H] each
    relative = 0
    if config.position_kind is PositionEmbedding.RELATIVE_BIAS:
        relative = config.relative_position_buckets * config.num_heads
    return weights + biases + norms + relative


def closed_form_num_params(config: TransformerConfig) -> int:
    """Every parameter of the model `config` describes, from the config alone (no LoRA).

    Equals ``transformer.num_params`` of the built model; LoRA adapters are not covered (count
    those abstractly).
    """
    if config.lora_rank is not None:
        raise ValueError("closed_form_num_params does not count LoRA adapters; use "
                         "paxlite.models.transformer.num_params")
    d, v = config.model_dims, config.vocab_size
    total = v * d  # token embedding
    if not config.tie_embeddings:
        total += d * v  # output head, no bias
    if config.position_kind is PositionEmbedding.LEARNED:
        total += config.max_seq_len * d
    total += _norm_params(config)  # final norm
    norms = 4 if config.post_norms else 2  # Gemma's post norms after attention and the MLP
    per_layer = norms * _norm_params(config) + _attention_params(config)
    moe_layers = num_moe_layers(config)
    total += config.num_layers * per_layer
    total += (config.num_layers - moe_layers) * _dense_mlp_params(config)
    if moe_layers:
        total += moe_layers * expert_params_per_layer(config)
    return total


def choice_bias_params(config: TransformerConfig) -> int:
    """Entries of DeepSeek-V3's per-expert choice biases (``score_correction_bias`` [E] in each
    MoE layer): stored beside the parameters and never trained (transformers keeps them as
    buffers), so a count of the model's parameters as transformers gives it leaves them out."""
    router = None if config.moe is None else config.moe.deepseek_router
    if router is None or not router.uses_bias:
        return 0
    return num_moe_layers(config) * config.moe.num_experts


def num_active_params(config: TransformerConfig, num_params: int) -> int:
    """The parameters one token passes through: `num_params` (the whole model's count) less the
    experts it is not routed to, (E - k) per MoE layer. Equal to `num_params` for dense models.

    Every token uses the router and exactly k experts of each MoE layer (GShard may drop an
    assignment over capacity; the count is of what routing chooses, as MaxText's FLOPs are).
    """
    if config.moe is None:
        return num_params
    unused = config.moe.num_experts - config.moe.experts_per_token
    return num_params - num_moe_layers(config) * unused * params_per_expert(config)


def routing_memory(config: TransformerConfig, *, global_tokens: int, mesh: dict[str, int]
                   ) -> dict[str, object]:
    """Per-device sizes of one MoE layer's routing tensors on a mesh (for the planner).

    GShard: the dispatch mask and the float32 combine weights are ``[G, S, E, C]`` each, which is
    ``capacity_factor x tokens x S`` elements over the whole batch; each device holds its groups'
    share. Dropless: each device gathers its expert group's tokens and sorts ``k`` rows per token
    (``ep x tokens_per_device x k`` rows of D and of F / tensor); XLA's ``ragged_dot`` lowering
    expands those rows once per local expert (``MOE_GROUPED_MATMUL=ragged_dot``), the tiled
    kernel does not (0).
    """
    from paxlite.models.moe_config import GroupedMatmul, MoeRouting
    from paxlite.models.moe_gating import expert_capacity

    moe = config.moe
    if moe is None:
        raise ValueError("routing_memory: the config has no MoE layers (moe is None)")
    batch_ways = mesh.get("data", 1) * mesh.get("fsdp", 1) * mesh.get("expert", 1)
    dtype_bytes = 2 if config.dtype == "bfloat16" else 4
    e, ep, tp = moe.num_experts, mesh.get("expert", 1), mesh.get("tensor", 1)
    if moe.routing is MoeRouting.GSHARD_TOP2:
        groups = moe.num_groups if moe.num_groups is not None else batch_ways
        group_size = global_tokens // groups
        capacity = expert_capacity(group_size=group_size, num_experts=e,
                                   capacity_factor=moe.capacity_factor)
        groups_per_device = max(1, groups // batch_ways)
        elements = groups_per_device * group_size * e * capacity
        return {"routing": moe.routing.value, "groups": groups, "group_size": group_size,
                "capacity": capacity, "dispatch_combine_elements_per_device": elements,
                # combine float32 + dispatch in the compute dtype (one-byte mask before the cast)
                "dispatch_combine_bytes_per_device": elements * (4 + dtype_bytes),
                "formula": "groups/device x S x E x C x (4 B combine + dtype B dispatch)"}
    rows = ep * (global_tokens // batch_ways) * moe.experts_per_token
    hidden = expert_hidden_dims(config) // tp
    row_bytes = rows * (config.model_dims + hidden) * dtype_bytes
    return {"routing": moe.routing.value, "sorted_rows_per_device": rows,
            "sorted_rows_bytes_per_device": row_bytes,
            "ragged_dot_dense_expansion_bytes_per_device": (
                row_bytes * (e // ep) if moe.grouped_matmul is GroupedMatmul.RAGGED_DOT else 0),
            "formula": "rows = expert x tokens/device x k; bytes = rows x (D + F/tensor) x dtype B"}
