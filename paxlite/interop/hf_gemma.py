"""Gemma 2 (``model_type: gemma2``) and Gemma 3's text model (``gemma3_text``): their
``config.json`` <-> TransformerConfig and their tensor names.

Their tensors are LLaMA's (interop/layouts.py, q/k rows permuted from rotate-half to interleaved
pairs, Gemma 3's q/k norm weights too) plus the norms after attention and after the MLP: HF's
``input_layernorm`` / ``post_attention_layernorm`` / ``pre_feedforward_layernorm`` /
``post_feedforward_layernorm`` are paxlite's ``pre_attention_norm`` / ``post_attention_norm`` /
``pre_mlp_norm`` / ``post_mlp_norm``. The norm weights are stored as the ``w`` of ``(1 + w)``, as
paxlite's ``gemma_rms_norm`` keeps them, so they are copied unchanged.

config.json, as transformers 5.24 reads it: Gemma 2's layers alternate sliding and global starting
with a sliding one unless ``layer_types`` says otherwise; Gemma 3's follow
``sliding_window_pattern`` (default 6: five sliding, one global). Gemma 3's RoPE is one entry per
layer type in 5.x's ``rope_parameters``, or 4.x's ``rope_theta`` (global, default 1e6),
``rope_local_base_freq`` (sliding, default 1e4) and ``rope_scaling`` (global layers only).
transformers' Gemma 3 attention never soft-caps its logits whatever ``attn_logit_softcapping``
says, so neither does the converted model. What paxlite does not implement (bidirectional
attention, attention biases, RoPE scaling on the sliding layers, other activations) is one error
naming the field. The multimodal ``gemma3`` wrapper is refused by name.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from paxlite.interop.errors import UnsupportedCheckpointError, refuse_if
from paxlite.interop.hf_rope import (
    refuse_partial_rotation,
    rope_entry,
    rope_of,
    rope_of_entry,
)
from paxlite.interop.layouts import HF_LLAMA, LlamaNaming, hf_decoder_shape
from paxlite.models.activations import Activation
from paxlite.models.norms import NormKind
from paxlite.models.open_model_fields import LayerAttention
from paxlite.models.rotary import RopeScalingKind
from paxlite.models.transformer_config import PositionEmbedding, TransformerConfig

_log = logging.getLogger(__name__)

GEMMA2 = "gemma2"
GEMMA3_TEXT = "gemma3_text"
GEMMA_MODEL_TYPES: tuple[str, ...] = (GEMMA2, GEMMA3_TEXT)
_ARCHITECTURES = {GEMMA2: "Gemma2ForCausalLM", GEMMA3_TEXT: "Gemma3ForCausalLM"}
# transformers' defaults for what a config.json may leave out (Gemma2Config, Gemma3TextConfig)
_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    GEMMA2: {"final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
             "max_position_embeddings": 8192, "rope_theta": 10000.0},
    GEMMA3_TEXT: {"final_logit_softcapping": None, "max_position_embeddings": 131072,
                  "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
                  "sliding_window_pattern": 6},
}
_GEMMA_SCALINGS = (RopeScalingKind.LINEAR, RopeScalingKind.LLAMA3)
_ACTIVATIONS: Mapping[str, Activation] = {
    "gelu_pytorch_tanh": Activation.GELU_TANH, "gelu": Activation.GELU}
_HF_NAMES: Mapping[Activation, str] = {Activation.GELU_TANH: "gelu_pytorch_tanh",
                                       Activation.GELU: "gelu"}

GEMMA_NAMING = dataclasses.replace(
    HF_LLAMA,
    what="Hugging Face Gemma checkpoint",
    mlp_norm="model.layers.{i}.pre_feedforward_layernorm.weight",
    post_attn_norm="model.layers.{i}.post_attention_layernorm.weight",
    post_mlp_norm="model.layers.{i}.post_feedforward_layernorm.weight",
)


def refuse_multimodal(model_type: Any) -> None:
    """The multimodal Gemma 3 (vision tower, projector, text model under ``text_config``)."""
    refuse_if(model_type == "gemma3", "model_type", model_type,
              "the multimodal Gemma 3 (vision tower and text model) is not converted; its text "
              "model alone is model_type 'gemma3_text'")


def tensor_naming(model_type: str) -> LlamaNaming:
    """The tensor names of a family with LLaMA's layout: Gemma's, or LLaMA's own."""
    return GEMMA_NAMING if model_type in GEMMA_MODEL_TYPES else HF_LLAMA


def _count(hf: Mapping[str, Any], key: str, default: Any = None) -> int:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UnsupportedCheckpointError(f"config.json {key}={value!r} must be a positive "
                                         "integer")
    return value


def _layer_types(hf: Mapping[str, Any], model_type: str, num_layers: int
                 ) -> tuple[LayerAttention, ...]:
    """``layer_types``, else transformers' default pattern for the family."""
    given = hf.get("layer_types")
    if given is None:
        period = 2 if model_type == GEMMA2 else _count(
            hf, "sliding_window_pattern", _DEFAULTS[GEMMA3_TEXT]["sliding_window_pattern"])
        return tuple(LayerAttention(kind) for kind in _pattern(period, num_layers=num_layers))
    return sliding_full_layer_types(given, num_layers)


def sliding_full_layer_types(given: Any, num_layers: int) -> tuple[LayerAttention, ...]:
    """A config.json's ``layer_types`` list of Gemma's and gpt-oss's two kinds, one per layer
    (Llama 4's chunked and NoPE layers are paxlite's too, but not these families')."""
    valid = {LayerAttention.SLIDING.value, LayerAttention.FULL.value}
    refuse_if(not isinstance(given, list) or any(kind not in valid for kind in given),
              "layer_types", given, f"each entry must be one of {sorted(valid)}")
    refuse_if(len(given) != num_layers, "layer_types", given,
              f"it has {len(given)} entries for num_hidden_layers={num_layers}")
    return tuple(LayerAttention(kind) for kind in given)


def _rope(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """rope_theta, rope_scaling (and Gemma 3's local_rope_theta) from either config.json form."""
    defaults = _DEFAULTS[model_type]
    if model_type == GEMMA2:
        theta, scaling = rope_of(hf, default=defaults["rope_theta"], kinds=_GEMMA_SCALINGS)
        return {"rope_theta": theta, "rope_scaling": scaling}
    # As transformers 5 reads either form: one entry per layer type (5.x rope_parameters, each
    # absent one plain RoPE), 4.x's rope_scaling merged into the global layers' entry, and a
    # base each entry lacks from rope_theta / rope_local_base_freq
    refuse_partial_rotation(hf)
    per_type = hf.get("rope_parameters") or {}
    kinds = {LayerAttention.SLIDING.value, LayerAttention.FULL.value}
    refuse_if(not isinstance(per_type, Mapping) or not set(per_type) <= kinds, "rope_parameters",
              per_type, f"Gemma 3 keeps one entry per layer type ({sorted(kinds)})")
    full = dict(per_type.get("full_attention") or {"rope_type": "default"})
    if hf.get("rope_scaling") is not None:
        refuse_if(not isinstance(hf["rope_scaling"], Mapping), "rope_scaling", hf["rope_scaling"],
                  "it must be null or an object holding rope_type")
        full.update(hf["rope_scaling"])
        if "type" in hf["rope_scaling"] and full.get("rope_type") != full["type"]:
            _log.warning("config.json rope_scaling spells its kind 'type' (%r), which "
                         "transformers does not read for Gemma 3: the global layers keep "
                         "rope_type %r, as transformers runs them", full["type"],
                         full.get("rope_type"))
            full = {"rope_type": full.get("rope_type", "default"),
                    **({"rope_theta": full["rope_theta"]} if "rope_theta" in full else {})}
    theta = defaults["rope_theta"] if hf.get("rope_theta") is None else float(hf["rope_theta"])
    # named as the file spells it: 4.x's rope_scaling, or 5.x's global entry
    field = ("rope_scaling" if hf.get("rope_scaling") is not None
             else "rope_parameters['full_attention']")
    theta, scaling = rope_of_entry(field, full, theta=theta, kinds=_GEMMA_SCALINGS)
    local = hf.get("rope_local_base_freq")
    local = defaults["rope_local_base_freq"] if local is None else float(local)
    local, local_scaling = rope_of_entry("rope_parameters['sliding_attention']",
                                         per_type.get("sliding_attention"), theta=local,
                                         kinds=_GEMMA_SCALINGS)
    refuse_if(local_scaling is not None, "rope_parameters['sliding_attention']",
              per_type.get("sliding_attention"), "paxlite scales RoPE on the global layers only")
    return {"rope_theta": theta, "rope_scaling": scaling, "local_rope_theta": local}


def gemma_config(hf: Mapping[str, Any]) -> TransformerConfig:
    """The TransformerConfig of a Gemma 2 or Gemma 3 (text) config.json."""
    model_type = hf["model_type"]
    defaults = _DEFAULTS[model_type]
    for field in ("use_bidirectional_attention", "attention_bias"):
        refuse_if(bool(hf.get(field)), field, hf.get(field),
                  "paxlite's Gemma is causal, without attention biases")
    act = hf.get("hidden_activation", "gelu_pytorch_tanh")  # transformers ignores hidden_act
    refuse_if(act not in _ACTIVATIONS, "hidden_activation", act,
              f"supported: {sorted(_ACTIVATIONS)}")
    num_layers = _count(hf, "num_hidden_layers")
    layer_types = _layer_types(hf, model_type, num_layers)
    window = hf.get("sliding_window", 4096)
    refuse_if(window is None, "sliding_window", window,
              "transformers' Gemma builds a sliding-window mask for every model, even one whose "
              "layers are all global, and cannot run without a window")
    scalar = hf.get("query_pre_attn_scalar", 256)
    refuse_if(isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0
              or scalar != int(scalar), "query_pre_attn_scalar", scalar,
              "paxlite scales the query by a positive whole number of dims ** -0.5")
    caps = {name: hf.get(field, defaults.get(field))
            for name, field in (("final_logit_cap", "final_logit_softcapping"),
                                ("attention_logit_cap", "attn_logit_softcapping"))}
    if model_type == GEMMA3_TEXT:
        caps["attention_logit_cap"] = None  # transformers' Gemma 3 attention never soft-caps
    return TransformerConfig(
        vocab_size=_count(hf, "vocab_size"),
        num_layers=num_layers,
        model_dims=_count(hf, "hidden_size"),
        num_heads=_count(hf, "num_attention_heads"),
        num_kv_heads=_count(hf, "num_key_value_heads", 4),
        dims_per_head=_count(hf, "head_dim", 256),
        hidden_dims=_count(hf, "intermediate_size"),
        max_seq_len=_count(hf, "max_position_embeddings", defaults["max_position_embeddings"]),
        norm=NormKind.GEMMA_RMS_NORM,
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        activation=_ACTIVATIONS[act],
        gated_mlp=True,
        use_bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        learned_position_embedding=False,
        position_embedding=PositionEmbedding.ROTARY,
        qk_norm=model_type == GEMMA3_TEXT,
        post_norms=True,
        scale_embeddings=True,
        query_scale_dims=int(scalar),
        **{name: None if value is None else float(value) for name, value in caps.items()},
        layer_types=layer_types,
        # a window no layer slides over is not part of the model
        sliding_window=int(window) if LayerAttention.SLIDING in layer_types else None,
        **_rope(hf, model_type),
    )


def gemma_requirements(config: TransformerConfig) -> dict[str, dict[str, tuple[Any, Any]]]:
    """Per Gemma model type, each field it constrains as (the model's value, the value needed):
    `hf_config.family_of_config`'s table."""
    common = {
        "norm": (config.norm, NormKind.GEMMA_RMS_NORM),
        "activation in (gelu_tanh, gelu)": (config.activation in _HF_NAMES, True),
        "gated_mlp": (config.gated_mlp, True),
        "use_bias": (config.use_bias, False),
        "qkv_bias (resolved)": (config.uses_qkv_bias, False),
        "position_kind": (config.position_kind, PositionEmbedding.ROTARY),
        "moe": ("set" if config.moe else None, None),
        "post_norms": (config.post_norms, True),
        "scale_embeddings": (config.scale_embeddings, True),
        "layer_types": ("set" if config.layer_types else None, "set"),
    }
    return {
        GEMMA2: {**common, "qk_norm": (config.qk_norm, False),
                 "local_rope_theta": (config.local_rope_theta, None)},
        GEMMA3_TEXT: {**common, "qk_norm": (config.qk_norm, True),
                      "attention_logit_cap": (config.attention_logit_cap, None),
                      "local_rope_theta": ("set" if config.local_rope_theta else None, "set")},
    }


def gemma_off(config: TransformerConfig) -> dict[str, tuple[Any, Any]]:
    """What the other families' layouts need of the Gemma fields: all off."""
    return {name: (getattr(config, name), want) for name, want in (
        ("post_norms", False), ("scale_embeddings", False), ("query_scale_dims", None),
        ("attention_logit_cap", None), ("final_logit_cap", None), ("layer_types", None),
        ("local_rope_theta", None))}


def gemma_hf_config(config: TransformerConfig, *, model_type: str) -> dict[str, Any]:
    """The config.json transformers 5.24 writes for this model, plus 4.x's RoPE fields (and
    ``sliding_window_pattern`` where the layers follow one), so a 4.x reader does not fall back
    to its defaults."""
    types = [kind.value for kind in config.layer_types or ()]
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        **hf_decoder_shape(config),
        "hidden_activation": _HF_NAMES[config.activation],
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_epsilon,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "query_pre_attn_scalar": config.query_scale_dims or config.dims_per_head,
        # transformers needs a window even where no layer slides: then one over the whole context
        "sliding_window": config.sliding_window or config.max_seq_len,
        "layer_types": types,
        "final_logit_softcapping": config.final_logit_cap,
        "attn_logit_softcapping": config.attention_logit_cap,
        "use_bidirectional_attention": False,
    }
    global_rope, global_legacy = rope_entry(theta=float(config.rope_theta),
                                            scaling=config.rope_scaling)
    out.update({"rope_theta": float(config.rope_theta), "rope_scaling": global_legacy})
    if model_type == GEMMA2:
        out["rope_parameters"] = global_rope
        return out
    local = float(config.local_rope_theta)
    local_rope, _ = rope_entry(theta=local, scaling=None)
    out.update({"rope_parameters": {"full_attention": global_rope, "sliding_attention": local_rope},
                "rope_local_base_freq": local})
    period = next((p for p in range(1, config.num_layers + 2)
                   if types == _pattern(p, num_layers=config.num_layers)), None)
    if period is not None:
        out.update({"sliding_window_pattern": period, "_sliding_window_pattern": period})
    return out


def _pattern(period: int, *, num_layers: int) -> list[str]:
    """Gemma 3's ``layer_types`` for a ``sliding_window_pattern``: every period-th layer global."""
    return [LayerAttention.SLIDING.value if (i + 1) % period else LayerAttention.FULL.value
            for i in range(num_layers)]
