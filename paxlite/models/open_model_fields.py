"""The checks of TransformerConfig's open-model fields (LLaMA-3's RoPE scaling, Qwen's q/k/v
biases and q/k norms, Mistral's window, Gemma 2/3's norms, soft-caps and per-layer attention,
Llama 4's chunked and NoPE layers), and the per-layer attention pattern they define.

Apart from models/transformer_config.py, which keeps the dataclass: these fields grew with every
family, and their rules (which combinations a kernel, a scan or a pipeline can run) read best
together. ``check_open_model_fields`` runs at the end of the config's ``__post_init__``, after the
enums there are coerced.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from typing import Any

from paxlite.models.attention_kernels import AttentionImplementation
from paxlite.models.rotary import RopeScaling


class LayerAttention(str, enum.Enum):
    """What one layer attends to (``TransformerConfig.layer_types``); the values are Hugging Face's
    ``layer_types`` entries."""

    FULL = "full_attention"  # the whole context (Gemma's global layers)
    SLIDING = "sliding_attention"  # the last ``sliding_window`` positions (Gemma's local layers)
    # Llama 4's RoPE layers: the keys of the query's own chunk of ``attention_chunk_size``
    # positions, causally (models/chunked_attention.py)
    CHUNKED = "chunked_attention"
    # Llama 4's NoPE layers: the whole context without a rotary embedding (paxlite's name: in
    # transformers' config a 'full_attention' layer whose ``no_rope_layers`` entry is 0)
    FULL_NO_ROPE = "full_attention_no_rope"


def layer_pattern_period(layer_types: Sequence[LayerAttention] | None) -> int:
    """The shortest p such that layer i attends as layer i - p does (1 without layer_types):
    Gemma 2's alternation is 2, Gemma 3's five local layers and one global 6."""
    if not layer_types:
        return 1
    count = len(layer_types)
    return next(p for p in range(1, count + 1)
                if all(layer_types[i] == layer_types[i - p] for i in range(p, count)))


def _is_positive_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0


def _is_size(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value > 0


def check_open_model_fields(config: Any) -> None:
    """rope_scaling (read back from JSON too), qkv_bias, qk_norm, sliding_window, and Gemma's
    post_norms, scale_embeddings, query_scale_dims, the soft-caps, layer_types and
    local_rope_theta; ``config`` is the TransformerConfig being made."""
    if isinstance(config.rope_scaling, Mapping):  # read back from JSON
        object.__setattr__(config, "rope_scaling", RopeScaling(**config.rope_scaling))
    if config.rope_scaling is not None and not isinstance(config.rope_scaling, RopeScaling):
        raise ValueError(f"TransformerConfig.rope_scaling={config.rope_scaling!r} must be None "
                         "or a RopeScaling")
    if config.qkv_bias is not None and not isinstance(config.qkv_bias, bool):
        raise ValueError(f"TransformerConfig.qkv_bias={config.qkv_bias!r} must be None (as "
                         "use_bias), True or False")
    if not isinstance(config.qk_norm, bool):
        raise ValueError(f"TransformerConfig.qk_norm={config.qk_norm!r} must be True or False")
    window = config.sliding_window
    if window is not None and not _is_size(window):
        raise ValueError(f"TransformerConfig.sliding_window={window!r} must be None (the whole "
                         "context) or a positive integer (keys seen per query, its own included)")
    if (window is not None
            and config.attention_implementation is AttentionImplementation.PALLAS_TRITON):
        raise ValueError(f"TransformerConfig.sliding_window={window} with attention "
                         "implementation 'pallas_triton': that kernel has no local window; use "
                         "'auto', 'cudnn' or 'xla'")
    if config.rope_scaling is not None and config.position_kind.value != "rotary":
        raise ValueError(f"TransformerConfig.rope_scaling is set but the position embedding is "
                         f"{config.position_kind.value!r}: it rescales rotary embeddings only")
    _check_gemma_fields(config)
    _check_llama4_fields(config)
    _check_gpt_oss_fields(config)


def _check_llama4_fields(config: Any) -> None:
    """attention_chunk_size, qk_l2_norm and the query temperature: valid values, and each set
    only where a layer reads it."""
    types = config.layer_types or ()
    chunk, floor = config.attention_chunk_size, config.query_temperature_floor
    for name, value in (("attention_chunk_size", chunk), ("query_temperature_floor", floor)):
        if value is not None and not _is_size(value):
            raise ValueError(f"TransformerConfig.{name}={value!r} must be None or a positive "
                             "integer")
    scale = config.query_temperature_scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale >= 0:
        raise ValueError(f"TransformerConfig.query_temperature_scale={scale!r} must be a number "
                         ">= 0")
    if not isinstance(config.qk_l2_norm, bool):
        raise ValueError(f"TransformerConfig.qk_l2_norm={config.qk_l2_norm!r} must be True or "
                         "False")
    if (chunk is None) == (LayerAttention.CHUNKED in types):
        raise ValueError(
            f"TransformerConfig.attention_chunk_size={chunk!r} with layer_types "
            f"{'without' if chunk is not None else 'with'} 'chunked_attention' layers: it is set "
            "exactly when such layers are there")
    if floor is not None and LayerAttention.FULL_NO_ROPE not in types:
        raise ValueError(f"TransformerConfig.query_temperature_floor={floor} is set but no layer "
                         "is 'full_attention_no_rope', the only ones it tempers")
    rotary = config.position_kind.value == "rotary"
    if not rotary and (config.qk_l2_norm or LayerAttention.FULL_NO_ROPE in types):
        raise ValueError(f"TransformerConfig.qk_l2_norm or 'full_attention_no_rope' layers with "
                         f"position embedding {config.position_kind.value!r}: they are defined "
                         "against rotary layers")
    _check_fused_kernel(config, f"attention_chunk_size={chunk}", chunk is not None,
                        "chunk pattern")


def _check_gpt_oss_fields(config: Any) -> None:
    """attention_sinks and out_bias (gpt-oss)."""
    if not isinstance(config.attention_sinks, bool):
        raise ValueError(f"TransformerConfig.attention_sinks={config.attention_sinks!r} must be "
                         "True or False")
    if config.out_bias is not None and not isinstance(config.out_bias, bool):
        raise ValueError(f"TransformerConfig.out_bias={config.out_bias!r} must be None (as "
                         "use_bias), True or False")
    _check_fused_kernel(config, "attention_sinks=True", config.attention_sinks, "sink logit")


def _check_fused_kernel(config: Any, setting: str, present: bool, what: str) -> None:
    """Llama 4's chunks and gpt-oss's sinks run in the XLA and splash kernels (AUTO runs XLA for
    them), not in cuDNN (as paxlite calls it) or Pallas-Triton (models/attention_kernels.py)."""
    implementation = config.attention_implementation.value
    if present and config.attention_kind.value == "flash" and implementation in (
            "cudnn", "pallas_triton"):
        raise ValueError(f"TransformerConfig.{setting} with attention implementation "
                         f"{implementation!r}: that kernel has no {what}; use 'xla', 'auto' or "
                         "'splash' (TPU), or attention kind 'dot_product'")


def _check_gemma_fields(config: Any) -> None:
    for name in ("post_norms", "scale_embeddings"):
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"TransformerConfig.{name}={getattr(config, name)!r} must be True "
                             "or False")
    dims = config.query_scale_dims
    if dims is not None and not _is_size(dims):
        raise ValueError(f"TransformerConfig.query_scale_dims={dims!r} must be None "
                         "(dims_per_head) or a positive integer")
    for name in ("attention_logit_cap", "final_logit_cap", "local_rope_theta"):
        value = getattr(config, name)
        if value is not None and not _is_positive_number(value):
            raise ValueError(f"TransformerConfig.{name}={value!r} must be None or a positive "
                             "number")
    cap = config.attention_logit_cap
    if (cap is not None and config.attention_kind.value == "flash"
            and config.attention_implementation.value != "splash"):
        raise ValueError(f"TransformerConfig.attention_logit_cap={cap} with attention kind "
                         f"'flash': JAX's fused kernels (XLA, cuDNN, Pallas-Triton) have no logit "
                         f"soft-capping; use attention kind 'dot_product', or attention "
                         f"implementation 'splash' on a TPU")
    _check_layer_types(config)


def _check_layer_types(config: Any) -> None:
    """layer_types (a list from JSON made a tuple of LayerAttention), and what scans, pipelines
    and experts need of its pattern."""
    types = config.layer_types
    if types is None:
        if config.local_rope_theta is not None:
            raise ValueError(f"TransformerConfig.local_rope_theta={config.local_rope_theta} is "
                             "set but layer_types is None: it is the RoPE base of the "
                             "'sliding_attention' layers of layer_types")
        return
    if isinstance(types, str) or not isinstance(types, Sequence):
        valid = " / ".join(repr(m.value) for m in LayerAttention)
        raise ValueError(f"TransformerConfig.layer_types={types!r} must be None or a sequence "
                         f"of {valid}, one per layer")
    try:
        types = tuple(LayerAttention(kind) for kind in types)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in LayerAttention)
        raise ValueError(f"TransformerConfig.layer_types={list(types)!r} is not valid; each "
                         f"entry is one of {valid}") from None
    object.__setattr__(config, "layer_types", types)
    if len(types) != config.num_layers:
        raise ValueError(f"TransformerConfig.layer_types has {len(types)} entries but "
                         f"num_layers={config.num_layers}: one per layer")
    if LayerAttention.SLIDING in types and config.sliding_window is None:
        raise ValueError("TransformerConfig.layer_types has 'sliding_attention' layers but "
                         "sliding_window is None: set the window they attend over")
    period = layer_pattern_period(types)
    interval = 1 if config.moe is None else config.moe.moe_layer_interval
    if period > 1 and math.lcm(period, interval) != max(period, interval):
        raise ValueError(f"TransformerConfig.layer_types (a pattern of period {period}) with "
                         f"moe_layer_interval={interval}: paxlite's scan unit is the longer of "
                         "the two, so one must divide the other")
    stacked = [what for what, on in (("scan_layers=True", config.scan_layers),
                                     ("a pipeline", config.pipeline is not None)) if on]
    if period > 1 and config.num_layers % period and stacked:
        raise ValueError(
            f"TransformerConfig.layer_types repeats every {period} layers, which does not divide "
            f"num_layers={config.num_layers}: {' with '.join(stacked)} runs identical units "
            f"of whole periods; use scan_layers=False without a pipeline")


def transformer_engine_problems(config: Any) -> list[str]:
    """What of these fields TE's TransformerLayer cannot express, one clause each."""
    problems = [f"{name}={getattr(config, name)!r} is paxlite's attention option"
                for name in ("rope_scaling", "qkv_bias", "sliding_window", "query_scale_dims",
                             "attention_logit_cap", "layer_types", "local_rope_theta",
                             "attention_chunk_size", "query_temperature_floor", "out_bias")
                if getattr(config, name) is not None]
    problems += [f"{name}=True is paxlite's option"
                 for name in ("qk_norm", "post_norms", "scale_embeddings", "qk_l2_norm",
                              "attention_sinks")
                 if getattr(config, name)]
    if config.final_logit_cap is not None:
        problems.append(f"final_logit_cap={config.final_logit_cap!r} is paxlite's output option")
    if config.norm.value == "gemma_rms_norm":
        problems.append("norm='gemma_rms_norm' has no TE layer norm")
    return problems
