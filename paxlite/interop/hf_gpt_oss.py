"""gpt-oss (``model_type: gpt_oss``): its ``config.json`` <-> TransformerConfig, as transformers
5.24's GptOssConfig reads it; the tensors are in gpt_oss_layout.py.

What a gpt-oss is in paxlite's terms: LLaMA's block (RMSNorm, rotate-half RoPE, grouped-query
attention) with

- biases on q, k, v *and* the output projection (``attention_bias``: ``qkv_bias`` and
  ``out_bias``; its MLP has no dense layer to put one on), and a learned sink logit per head
  (``attention_sinks``);
- ``layer_types`` alternating sliding-window and full attention (default: sliding first);
- an MoE on every layer (``moe_layer_interval`` 1): the router with a bias, top-k of its logits
  then a softmax over the k (``renormalize_top_k``: the same weights), experts with biases and
  the clamped SwiGLU (``moe.use_bias``, ``moe.swiglu_limit`` / ``swiglu_alpha``);
- YaRN RoPE (hf_rope.YARN_ONLY; GptOssConfig's default when config.json has no rope object).

``quantization_config`` may say ``mxfp4`` (the published checkpoints): the expert weights are then
stored as FP4 blocks and scales, which the layout dequantises. Any other quantization, another
activation, attention dropout or a value paxlite cannot hold is one error naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paxlite.interop import hf_moe
from paxlite.interop.errors import UnsupportedCheckpointError, refuse_if
from paxlite.interop.hf_gemma import sliding_full_layer_types
from paxlite.interop.hf_rope import YARN_ONLY, rope_fields, rope_of
from paxlite.interop.layouts import hf_decoder_shape
from paxlite.models.activations import Activation
from paxlite.models.moe_config import MoeConfig, MoeRouting
from paxlite.models.norms import NormKind
from paxlite.models.open_model_fields import LayerAttention
from paxlite.models.transformer_config import (
    LLAMA_ARCHITECTURE,
    PositionEmbedding,
    TransformerConfig,
)

GPT_OSS = "gpt_oss"
ARCHITECTURE = "GptOssForCausalLM"
# GptOssConfig's defaults for what config.json may leave out (its published models' values)
DEFAULT_ROPE_THETA: float = 150000.0
DEFAULT_YARN: Mapping[str, Any] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "truncate": False,
                                   "original_max_position_embeddings": 4096}
DEFAULTS: Mapping[str, Any] = {
    "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64,
    "num_key_value_heads": 8, "sliding_window": 128, "tie_word_embeddings": False,
    "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "attention_dropout": 0.0, "num_experts_per_tok": 4, "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0, "attention_bias": True,
}
MXFP4 = "mxfp4"


def _get(hf: Mapping[str, Any], key: str) -> Any:
    value = hf.get(key)
    return DEFAULTS[key] if value is None and key in DEFAULTS else value


def _positive(hf: Mapping[str, Any], key: str, kind: type = int) -> Any:
    value = _get(hf, key)
    ok = not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
    refuse_if(not ok or not value > 0, key, value, f"it must be a positive "
              f"{'number' if kind is float else 'integer'}")
    return value


def quantization(hf: Mapping[str, Any]) -> str | None:
    """The checkpoint's quantization: None, or 'mxfp4' (the only one read)."""
    quant = hf.get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, Mapping) else None
    refuse_if(method != MXFP4, "quantization_config", quant,
              "gpt-oss converts from float weights or from MXFP4 expert weights "
              "(quant_method 'mxfp4'), which are dequantized")
    return MXFP4


def _layer_types(hf: Mapping[str, Any], num_layers: int) -> tuple[LayerAttention, ...]:
    """``layer_types``, else GptOssConfig's default: sliding, full, sliding, ..."""
    given = hf.get("layer_types")
    if given is None:
        return tuple(LayerAttention.SLIDING if (i + 1) % 2 else LayerAttention.FULL
                     for i in range(num_layers))
    return sliding_full_layer_types(given, num_layers)


def gpt_oss_config(hf: Mapping[str, Any]) -> TransformerConfig:
    """The TransformerConfig of a gpt-oss ``config.json`` (module docstring)."""
    quantization(hf)
    act = _get(hf, "hidden_act")
    refuse_if(act != "silu", "hidden_act", act, "gpt-oss's experts are its clamped SwiGLU "
              "('silu')")
    dropout = _get(hf, "attention_dropout")
    refuse_if(dropout != 0, "attention_dropout", dropout,
              "paxlite has no dropout on attention probabilities")
    bias = _get(hf, "attention_bias")
    refuse_if(not isinstance(bias, bool), "attention_bias", bias, "it must be true or false")
    layers = _positive(hf, "num_hidden_layers")
    types = _layer_types(hf, layers)
    window = hf.get("sliding_window", DEFAULTS["sliding_window"])
    sliding = LayerAttention.SLIDING in types
    refuse_if(sliding and (isinstance(window, bool) or not isinstance(window, int) or window < 1),
              "sliding_window", window, "the 'sliding_attention' layers need a positive window")
    experts = _positive(hf, "num_local_experts")
    k = _positive(hf, "num_experts_per_tok")
    refuse_if(k > experts, "num_experts_per_tok", k,
              f"it must be between 1 and num_local_experts={experts}")
    rope = dict(hf)
    if not rope.get("rope_parameters") and not rope.get("rope_scaling"):
        rope["rope_parameters"] = dict(DEFAULT_YARN)
    theta, scaling = rope_of(rope, default=DEFAULT_ROPE_THETA, kinds=YARN_ONLY)
    moe = MoeConfig(
        num_experts=experts,
        experts_per_token=k,
        routing=MoeRouting.DROPLESS_TOPK,
        moe_layer_interval=1,
        gated_experts=True,
        expert_activation=Activation.SILU,
        renormalize_top_k=True,
        load_balancing_weight=hf_moe.aux_loss_weight(hf, experts_per_token=k, moe_layers=layers),
        use_bias=True,
        swiglu_limit=float(_positive(hf, "swiglu_limit", float)),
        swiglu_alpha=float(_positive(hf, "swiglu_alpha", float)),
    )
    return TransformerConfig(
        vocab_size=_positive(hf, "vocab_size"),
        num_layers=layers,
        model_dims=_positive(hf, "hidden_size"),
        num_heads=_positive(hf, "num_attention_heads"),
        num_kv_heads=_positive(hf, "num_key_value_heads"),
        dims_per_head=_positive(hf, "head_dim"),
        hidden_dims=_positive(hf, "intermediate_size"),
        max_seq_len=_positive(hf, "max_position_embeddings"),
        norm_epsilon=float(_positive(hf, "rms_norm_eps", float)),
        tie_embeddings=bool(_get(hf, "tie_word_embeddings")),
        **LLAMA_ARCHITECTURE,
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=bias,
        out_bias=bias,
        attention_sinks=True,
        layer_types=types,
        sliding_window=int(window) if sliding else None,
        moe=moe,
    )


def gpt_oss_requirements(config: TransformerConfig) -> dict[str, tuple[Any, Any]]:
    """Each field the gpt-oss layout constrains, as (the model's value, the value it needs)."""
    moe = config.moe
    out: dict[str, tuple[Any, Any]] = {
        "norm": (config.norm, NormKind.RMS_NORM),
        "activation": (config.activation, Activation.SILU),
        "use_bias": (config.use_bias, False),
        "position_kind": (config.position_kind, PositionEmbedding.ROTARY),
        "attention_sinks": (config.attention_sinks, True),
        "qkv_bias (resolved) == out_bias (resolved)": (
            config.uses_qkv_bias, config.use_bias if config.out_bias is None else config.out_bias),
        "qk_norm": (config.qk_norm, False),
        "rope_scaling kind": (None if config.rope_scaling is None
                              else config.rope_scaling.kind.value, None if config.rope_scaling
                              is None else "yarn"),
        "local_rope_theta": (config.local_rope_theta, None),
        **{name: (getattr(config, name), None) for name in (
            "query_scale_dims", "attention_logit_cap", "final_logit_cap")},
        **{name: (getattr(config, name), False) for name in ("post_norms", "scale_embeddings")},
        "moe": ("set" if moe else None, "set"),
    }
    if moe is not None:
        out.update({
            "moe.routing": (moe.routing, MoeRouting.DROPLESS_TOPK),
            "moe.gated_experts": (moe.gated_experts, True),
            "moe.expert_activation": (moe.expert_activation, Activation.SILU),
            "moe.moe_layer_interval": (moe.moe_layer_interval, 1),
            "moe.renormalize_top_k": (moe.renormalize_top_k, True),
            "moe.use_bias": (moe.use_bias, True),
            "moe.swiglu_limit": ("set" if moe.swiglu_limit is not None else None, "set"),
        })
    return out


def gpt_oss_off(config: TransformerConfig) -> dict[str, tuple[Any, Any]]:
    """What the other families' layouts need of gpt-oss's fields: off (hf_config adds them to
    every other family's requirements)."""
    out: dict[str, tuple[Any, Any]] = {
        "attention_sinks": (config.attention_sinks, False),
        "out_bias (resolved) == use_bias": (
            config.use_bias if config.out_bias is None else config.out_bias, config.use_bias),
    }
    if config.moe is not None:
        out.update({"moe.use_bias": (config.moe.use_bias, False),
                    "moe.swiglu_limit": (config.moe.swiglu_limit, None)})
    return out


def _layer_types_written(config: TransformerConfig) -> list[str]:
    if config.layer_types is not None:
        return [kind.value for kind in config.layer_types]
    kind = LayerAttention.FULL if config.sliding_window is None else LayerAttention.SLIDING
    return [kind.value] * config.num_layers


def gpt_oss_hf_config(config: TransformerConfig, *, router_aux_loss_coef: float | None
                      ) -> dict[str, Any]:
    """The config.json transformers 5.24 writes for this model (plus 4.x's ``rope_theta`` and
    ``rope_scaling``, as the published files have them)."""
    moe = config.moe
    if moe is None:
        raise UnsupportedCheckpointError("a gpt-oss has experts on every layer (moe is None)")
    rope, legacy_scaling = rope_fields(config)
    shape = hf_decoder_shape(config)
    shape["intermediate_size"] = moe.expert_hidden_dims or config.hidden_dims
    return {
        "architectures": [ARCHITECTURE],
        "model_type": GPT_OSS,
        **shape,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.experts_per_token,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_epsilon,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": config.uses_qkv_bias,
        "attention_dropout": 0.0,
        "sliding_window": config.sliding_window,
        "layer_types": _layer_types_written(config),
        "swiglu_limit": float(moe.swiglu_limit),
        "swiglu_alpha": float(moe.swiglu_alpha),
        "output_router_logits": bool(moe.load_balancing_weight),
        "router_aux_loss_coef": hf_moe.aux_loss_coef(config, read=router_aux_loss_coef),
        "rope_parameters": rope,
        "rope_theta": float(config.rope_theta),
        "rope_scaling": legacy_scaling,
    }
