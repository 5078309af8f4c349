"""Hugging Face ``config.json`` <-> :class:`TransformerConfig` for LLaMA-style models (LLaMA-1/2/3,
Mistral, Qwen2/2.5, Qwen3), Mixtral, Qwen3-MoE (their experts in hf_moe.py), and through their own
modules GPT-2 (gpt2_layout.py), Gemma 2/3 (hf_gemma.py), DeepSeek-V3/V2 (hf_deepseek.py), Llama 4
(hf_llama4.py: ``llama4_text``, and the text model of a multimodal ``llama4``) and gpt-oss
(hf_gpt_oss.py).

Readers accept both transformers 4.x spellings (``rope_theta`` at the top level, ``torch_dtype``)
and 5.x spellings (a ``rope_parameters`` object, ``dtype``). Writers emit the 5.x form, and also the
top-level ``rope_theta`` (and ``rope_scaling``) so that a transformers 4.x reader does not
silently fall back to 10000 and plain RoPE.

Anything the paxlite model cannot represent exactly (RoPE scaling other than LLaMA-3's, biases on
a LLaMA's projections, Qwen's per-layer sliding windows, shared experts, router jitter, ...) is
refused with one error naming the field and its
value: a converter that drops such a setting produces a model that runs and is quietly wrong.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from paxlite.interop import gpt2_layout, hf_deepseek, hf_gemma, hf_gpt_oss, hf_llama4, hf_moe
from paxlite.interop.errors import UnsupportedCheckpointError, refuse_if
from paxlite.interop.hf_rope import DEFAULT_ROPE_THETA, rope_fields, rope_of, rope_theta_of
from paxlite.interop.layouts import hf_decoder_shape
from paxlite.models.moe_config import MoeConfig, MoeRouting
from paxlite.models.transformer import (
    LLAMA_ARCHITECTURE,
    Activation,
    NormKind,
    PositionEmbedding,
    TransformerConfig,
)

TRANSFORMERS_VERSION_WRITTEN: str = "5.24.0"
MIXTRAL_DEFAULT_ROPE_THETA: float = 1e6  # MixtralConfig's default when config.json has none


class Family(str, enum.Enum):
    """The checkpoint layouts paxlite converts; the value is the HF ``model_type``."""

    LLAMA = "llama"
    MISTRAL = "mistral"
    QWEN2 = "qwen2"
    QWEN3 = "qwen3"
    MIXTRAL = "mixtral"
    QWEN3_MOE = "qwen3_moe"
    GPT2 = "gpt2"
    GEMMA2 = "gemma2"  # Gemma 2 and Gemma 3's text model: hf_gemma.py
    GEMMA3_TEXT = "gemma3_text"
    DEEPSEEK_V3 = "deepseek_v3"  # DeepSeek-V3 and V2 (V2-Lite): hf_deepseek.py
    DEEPSEEK_V2 = "deepseek_v2"
    LLAMA4_TEXT = "llama4_text"  # Llama 4's text model: hf_llama4.py
    GPT_OSS = "gpt_oss"  # hf_gpt_oss.py, its tensors gpt_oss_layout.py


# The families whose tensors are LLaMA's (interop/layouts.py), with their extra tensors.
LLAMA_LAYOUT_FAMILIES: frozenset[Family] = frozenset(
    {Family.LLAMA, Family.MISTRAL, Family.QWEN2, Family.QWEN3, Family.MIXTRAL, Family.QWEN3_MOE,
     Family.GEMMA2, Family.GEMMA3_TEXT})
MOE_FAMILIES: frozenset[Family] = frozenset({Family.MIXTRAL, Family.QWEN3_MOE, Family.GPT_OSS})
_ARCHITECTURES: Mapping[Family, str] = {
    Family.LLAMA: "LlamaForCausalLM", Family.MISTRAL: "MistralForCausalLM",
    Family.QWEN2: "Qwen2ForCausalLM", Family.QWEN3: "Qwen3ForCausalLM",
}
MISTRAL_DEFAULT_SLIDING_WINDOW: int = 4096  # MistralConfig's default when config.json has none
QWEN3_DEFAULT_HEAD_DIM: int = 128  # Qwen3Config's default when config.json has none


def _require(hf: Mapping[str, Any], key: str) -> Any:
    if key not in hf or hf[key] is None:
        raise UnsupportedCheckpointError(f"config.json has no {key!r}; it is required for "
                                         f"model_type={hf.get('model_type')!r}")
    return hf[key]


def stored_dtype(hf: Mapping[str, Any]) -> str | None:
    """The dtype the checkpoint says it was saved in (5.x ``dtype``, 4.x ``torch_dtype``)."""
    value = hf.get("dtype", hf.get("torch_dtype"))
    return None if value is None else str(value).removeprefix("torch.")


# Fields that mean experts every token passes through besides the routed ones (Qwen2-MoE, DeepSeek,
# GLM-4-MoE, ERNIE-4.5-MoE): paxlite's MoE layer has routed experts only.
_SHARED_EXPERT_FIELDS: tuple[str, ...] = (
    "shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts",
    "moe_num_shared_experts",
)
# Fields by which a config of an unknown model_type shows itself to be a mixture of experts.
_MOE_FIELDS: tuple[str, ...] = (
    "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "moe_k",
)


# The mixture-of-experts model types paxlite converts, and those of them with shared experts (which
# DeepSeek's and Llama 4's layouts read under their own names).
_MOE_TYPES = "'mixtral', 'qwen3_moe', 'deepseek_v3', 'deepseek_v2', 'llama4_text', 'gpt_oss'"
_SHARED_TYPES = "'deepseek_v3', 'deepseek_v2', 'llama4_text'"


def _refuse_shared_or_unknown_moe(hf: Mapping[str, Any]) -> None:
    model_type = hf.get("model_type")
    if model_type in hf_deepseek.MODEL_TYPES:  # shared experts are part of DeepSeek's layout
        return
    for field in _SHARED_EXPERT_FIELDS:
        if hf.get(field):  # absent, null and 0 mean no shared expert
            raise UnsupportedCheckpointError(
                f"config.json {field}={hf[field]!r} (model_type={model_type!r}) is not supported: "
                f"paxlite's MoE holds routed experts only, no shared experts, except in the "
                f"layouts that have them (model_type {_SHARED_TYPES}); supported MoE model_type: "
                f"{_MOE_TYPES}")
    if model_type in {f.value for f in Family}:
        return
    for field in _MOE_FIELDS:
        if hf.get(field) is not None:
            raise UnsupportedCheckpointError(
                f"config.json model_type={model_type!r} ({field}={hf[field]!r}) is a "
                "mixture-of-experts model paxlite does not convert: paxlite's MoE holds routed "
                f"experts only, and shared ones in the layouts that have them (supported MoE "
                f"model_type: {_MOE_TYPES})")


def family_of(hf: Mapping[str, Any]) -> Family:
    _refuse_shared_or_unknown_moe(hf)
    model_type = hf.get("model_type")
    hf_gemma.refuse_multimodal(model_type)
    try:
        return Family(model_type)
    except ValueError:
        raise UnsupportedCheckpointError(
            f"config.json model_type={model_type!r} is not supported; supported: 'llama' "
            "(LLaMA-1/2/3 shapes, GQA, any rope_theta, head_dim, 'llama3' RoPE scaling), "
            "'mistral', 'qwen2', 'qwen3', 'mixtral', 'qwen3_moe', 'gemma2', 'gemma3_text', "
            "'gpt2', 'deepseek_v3', 'deepseek_v2', 'llama4_text' (and the text model of a "
            "multimodal 'llama4') and 'gpt_oss'") from None


def _refuse_qwen_windows(hf: Mapping[str, Any]) -> None:
    """Qwen2/3's sliding windows sit on some layers only (``max_window_layers``); refused."""
    use = hf.get("use_sliding_window", False)
    refuse_if(bool(use), "use_sliding_window", use,
               "paxlite applies a sliding window to every layer or to none, not Qwen's "
               "per-layer windows (use_sliding_window must be false)")
    kinds = sorted(set(hf.get("layer_types") or ()) - {"full_attention"})
    refuse_if(bool(kinds), "layer_types", kinds,
               "paxlite's Qwen layers all attend to the whole context ('full_attention')")


def _family_fields(hf: Mapping[str, Any], family: Family) -> dict[str, Any]:
    """The TransformerConfig fields by which a family differs from LLaMA, its refusals checked."""
    bias = hf.get("attention_bias", False)
    window = hf.get("sliding_window")
    if family is Family.QWEN3_MOE:
        return hf_moe.qwen3_moe_attention_fields(hf)
    if family is Family.QWEN2:
        _refuse_qwen_windows(hf)
        return {"qkv_bias": True}  # Qwen2's q, k, v always carry biases, its output none
    if family is Family.QWEN3:
        _refuse_qwen_windows(hf)
        refuse_if(bool(bias), "attention_bias", bias,
                   "Qwen3's attention_bias also puts a bias on the output projection, which "
                   "paxlite has only together with MLP biases")
        return {"qk_norm": True}
    refuse_if(bool(bias), "attention_bias", bias, "paxlite's LLaMA has no attention biases")
    if family is Family.MISTRAL:
        if "sliding_window" not in hf:
            window = MISTRAL_DEFAULT_SLIDING_WINDOW
        kinds = set(hf.get("layer_types") or ())
        refuse_if(len(kinds) > 1, "layer_types", sorted(kinds),
                   "paxlite's Mistral applies one sliding window to every layer")
        return {"sliding_window": None if window is None else int(window)}
    refuse_if(window is not None, "sliding_window", window, "LLaMA attends to the whole context")
    return {}


def _llama_config(hf: Mapping[str, Any], *, default_rope_theta: float = DEFAULT_ROPE_THETA,
                  default_norm_epsilon: float = 1e-6, family: Family = Family.LLAMA
                  ) -> TransformerConfig:
    """LLaMA's config and those of the families built on it (Mistral, Qwen2, Qwen3)."""
    fields = _family_fields(hf, family)
    refuse_if(bool(hf.get("mlp_bias", False)), "mlp_bias", hf.get("mlp_bias"),
               "paxlite's LLaMA has no MLP biases")
    act = hf.get("hidden_act", "silu")
    refuse_if(act != "silu", "hidden_act", act,
               f"{family.value} conversion supports 'silu' (SwiGLU) only")
    dims = int(_require(hf, "hidden_size"))
    heads = int(_require(hf, "num_attention_heads"))
    kv_heads = hf.get("num_key_value_heads")
    head_dim = hf.get("head_dim")
    if head_dim is None and family is Family.QWEN3:
        head_dim = QWEN3_DEFAULT_HEAD_DIM
    if head_dim is None:
        if dims % heads:
            raise UnsupportedCheckpointError(
                f"config.json hidden_size={dims} is not a multiple of num_attention_heads={heads} "
                "and head_dim is not given")
        head_dim = dims // heads
    theta, scaling = rope_of(hf, default=default_rope_theta)
    refuse_if(scaling is not None and family is not Family.LLAMA, "rope_scaling", scaling,
               f"paxlite reads RoPE scaling for model_type 'llama' only, not {family.value!r}")
    return TransformerConfig(
        vocab_size=int(_require(hf, "vocab_size")),
        num_layers=int(_require(hf, "num_hidden_layers")),
        model_dims=dims,
        num_heads=heads,
        num_kv_heads=heads if kv_heads is None else int(kv_heads),
        dims_per_head=int(head_dim),
        hidden_dims=int(_require(hf, "intermediate_size")),
        max_seq_len=int(hf.get("max_position_embeddings") or 4096),
        norm_epsilon=float(hf.get("rms_norm_eps", default_norm_epsilon)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **LLAMA_ARCHITECTURE,
        **fields,
        rope_theta=theta,
        rope_scaling=scaling,
    )


def _mixtral_config(hf: Mapping[str, Any]) -> TransformerConfig:
    jitter = hf.get("router_jitter_noise") or 0.0
    refuse_if(jitter != 0.0, "router_jitter_noise", jitter,
               "paxlite's router adds no noise (router_jitter_noise must be 0)")
    positions = hf.get("max_position_embeddings") or 4096
    window = hf.get("sliding_window")
    refuse_if(window is not None and window < positions, "sliding_window", window,
               f"paxlite has no sliding-window attention; it attends to the whole context, which "
               f"equals a window only if sliding_window is null or >= max_position_embeddings="
               f"{positions}")
    dense = {k: v for k, v in hf.items() if k != "sliding_window"}
    rope_theta_of(dense, default=MIXTRAL_DEFAULT_ROPE_THETA)  # refuses RoPE scaling
    config = _llama_config(dense, default_rope_theta=MIXTRAL_DEFAULT_ROPE_THETA,
                           default_norm_epsilon=1e-5)
    experts = int(_require(hf, "num_local_experts"))
    k = int(_require(hf, "num_experts_per_tok"))
    refuse_if(not 1 <= k <= experts, "num_experts_per_tok", k,
               f"it must be between 1 and num_local_experts={experts}")
    moe = MoeConfig(
        num_experts=experts,
        experts_per_token=k,
        routing=MoeRouting.DROPLESS_TOPK,
        moe_layer_interval=1,
        gated_experts=True,
        expert_activation=Activation.SILU,
        load_balancing_weight=hf_moe.aux_loss_weight(hf, experts_per_token=k,
                                                     moe_layers=config.num_layers),
    )
    return dataclasses.replace(config, moe=moe)


def from_hf_config(hf: Mapping[str, Any], *, dtype: str = "float32"
                   ) -> tuple[Family, TransformerConfig]:
    """(family, TransformerConfig) of an HF ``config.json`` dict; params and math in ``dtype``
    (a multimodal ``llama4``'s: its text model's, ``llama4_text``)."""
    hf = hf_llama4.text_config(hf)
    family = family_of(hf)
    if family is Family.MIXTRAL:
        config = _mixtral_config(hf)
    elif family is Family.QWEN3_MOE:
        config = hf_moe.qwen3_moe_config(hf, dense=_llama_config(hf, family=family))
    elif family.value in hf_gemma.GEMMA_MODEL_TYPES:
        config = hf_gemma.gemma_config(hf)
    elif family.value in hf_deepseek.MODEL_TYPES:
        config = hf_deepseek.deepseek_config(hf)
    elif family is Family.GPT2:
        config = gpt2_layout.gpt2_config(hf)
    elif family is Family.LLAMA4_TEXT:
        config = hf_llama4.llama4_config(hf)
    elif family is Family.GPT_OSS:
        config = hf_gpt_oss.gpt_oss_config(hf)
    else:
        config = _llama_config(hf, family=family)
    return family, dataclasses.replace(config, dtype=dtype, param_dtype=dtype)


def _block_requirements(config: TransformerConfig, *, norm: NormKind, activation: Activation,
                        gated: bool, bias: bool,
                        position: PositionEmbedding) -> dict[str, tuple[Any, Any]]:
    """The block a dense family's layout has: its norm, MLP, biases and positions, no experts."""
    return {
        "norm": (config.norm, norm),
        "activation": (config.activation, activation),
        "gated_mlp": (config.gated_mlp, gated),
        "use_bias": (config.use_bias, bias),
        "position_kind": (config.position_kind, position),
        "moe": ("set" if config.moe else None, None),
    }


def _layout_requirements(config: TransformerConfig) -> dict[Family, dict[str, tuple[Any, Any]]]:
    """Per family, each field it constrains as (the model's value, the value the family needs)."""
    llama = _block_requirements(config, norm=NormKind.RMS_NORM, activation=Activation.SILU,
                                gated=True, bias=False, position=PositionEmbedding.ROTARY)
    plain = {"qkv_bias (resolved)": (config.uses_qkv_bias, False),
             "qk_norm": (config.qk_norm, False),
             "sliding_window": ("set" if config.sliding_window else None, None),
             **hf_gemma.gemma_off(config), **hf_deepseek.off(config)}
    unscaled = {"rope_scaling": (config.rope_scaling, None)}
    mixtral = {**llama, **plain, **unscaled, **hf_moe.mixtral_requirements(config)}
    gpt2 = {
        **_block_requirements(config, norm=NormKind.LAYER_NORM, activation=Activation.GELU_TANH,
                              gated=False, bias=True, position=PositionEmbedding.LEARNED),
        "tie_embeddings": (config.tie_embeddings, True),
        "num_heads*dims_per_head": (config.num_heads * config.dims_per_head, config.model_dims),
        "kv_heads": (config.kv_heads, config.num_heads),
        **plain, **unscaled,
        "qkv_bias (resolved)": (config.uses_qkv_bias, True),  # GPT-2's biases are everywhere
    }
    table = {
        Family.LLAMA: {**llama, **plain},
        Family.MISTRAL: {**llama, **unscaled, **{k: v for k, v in plain.items()
                                                 if k != "sliding_window"}},
        Family.QWEN2: {**llama, **plain, **unscaled,
                       "qkv_bias (resolved)": (config.uses_qkv_bias, True)},
        Family.QWEN3: {**llama, **plain, **unscaled, "qk_norm": (config.qk_norm, True)},
        Family.MIXTRAL: mixtral,
        Family.QWEN3_MOE: {**llama, **plain, **unscaled, **hf_moe.qwen3_moe_requirements(config)},
        Family.GPT2: gpt2,
        **{Family(t): wanted for t, wanted in hf_gemma.gemma_requirements(config).items()},
        **{Family(t): wanted for t, wanted in hf_deepseek.requirements(config).items()},
    }
    # every other family has none of Llama 4's or gpt-oss's fields, and those two none of the
    # other's (nor DeepSeek's)
    llama4_off, gpt_oss_off = hf_llama4.llama4_off(config), hf_gpt_oss.gpt_oss_off(config)
    deepseek_off = hf_deepseek.off(config)
    # Llama 4 has a shared expert and dense layers before its first MoE layer, as DeepSeek has
    return {**{family: {**wanted, **llama4_off, **gpt_oss_off} for family, wanted in table.items()},
            Family.LLAMA4_TEXT: {**hf_llama4.llama4_requirements(config), **gpt_oss_off,
                                 **hf_deepseek.latent_attention_off(config)},
            Family.GPT_OSS: {**hf_gpt_oss.gpt_oss_requirements(config), **llama4_off,
                             **deepseek_off}}


def family_of_config(config: TransformerConfig, *, prefer: Family | None = None) -> Family:
    """Which HF layout a paxlite model fits (``prefer`` when it fits: a Mistral without a window
    also fits LLaMA); an error names, per family, every field that does not fit."""
    requirements = _layout_requirements(config)
    fitting = [family for family, wanted in requirements.items()
               if all(have == want for have, want in wanted.values())]
    if fitting:
        return prefer if prefer in fitting else fitting[0]

    def _diff(wanted: Mapping[str, tuple[Any, Any]]) -> str:
        return ", ".join(f"{k}={getattr(h, 'value', h)!r} (needs {getattr(w, 'value', w)!r})"
                         for k, (h, w) in wanted.items() if h != w)
    raise UnsupportedCheckpointError(
        "this paxlite model fits no Hugging Face layout: " + "; ".join(
            f"as {_NAMES[family]}{' it differs' if i == 0 else ''} in {_diff(wanted)}"
            for i, (family, wanted) in enumerate(requirements.items())))


_NAMES: Mapping[Family, str] = {
    Family.LLAMA: "LLaMA", Family.MISTRAL: "Mistral", Family.QWEN2: "Qwen2",
    Family.QWEN3: "Qwen3", Family.MIXTRAL: "Mixtral", Family.QWEN3_MOE: "Qwen3-MoE",
    Family.GPT2: "GPT-2", Family.GEMMA2: "Gemma 2", Family.GEMMA3_TEXT: "Gemma 3 (text)",
    Family.DEEPSEEK_V3: "DeepSeek-V3", Family.DEEPSEEK_V2: "DeepSeek-V2",
    Family.LLAMA4_TEXT: "Llama 4 (text)",
    Family.GPT_OSS: "gpt-oss",
}


def _mixtral_fields(config: TransformerConfig, *, router_aux_loss_coef: float | None
                    ) -> dict[str, Any]:
    """What MixtralConfig adds to LLaMA's fields. A load-balancing weight becomes HF's
    ``output_router_logits`` + ``router_aux_loss_coef`` (`hf_moe.aux_loss_coef`)."""
    moe = config.moe
    assert moe is not None
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": moe.expert_hidden_dims or config.hidden_dims,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.experts_per_token,
        "output_router_logits": bool(moe.load_balancing_weight),
        "router_aux_loss_coef": hf_moe.aux_loss_coef(config, read=router_aux_loss_coef),
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    }


# Fields `_open_family_fields` removes from LLaMA's (set to None there, then left out).
_DROPPED_WHEN_NONE: frozenset[str] = frozenset({"attention_bias", "mlp_bias", "pretraining_tp"})


def _open_family_fields(config: TransformerConfig, *, family: Family) -> dict[str, Any]:
    """What Mistral's, Qwen2's and Qwen3's configs write in place of LLaMA's own fields."""
    out: dict[str, Any] = {"architectures": [_ARCHITECTURES[family]], "model_type": family.value}
    drop = ["attention_bias", "mlp_bias", "pretraining_tp"]  # not in these families' configs
    if family is Family.MISTRAL:
        out["sliding_window"] = config.sliding_window
    else:  # Qwen2, Qwen3: every layer attends to the whole context
        out.update({"use_sliding_window": False, "sliding_window": None,
                    "max_window_layers": config.num_layers,
                    "layer_types": ["full_attention"] * config.num_layers})
    if family is Family.QWEN3:
        out["attention_bias"] = False
        drop.remove("attention_bias")
    return {**out, **{key: None for key in drop}}


def to_hf_config(config: TransformerConfig, *, family: Family, dtype: str = "float32",
                 bos_token_id: int | None = None, eos_token_id: int | list[int] | None = None,
                 router_aux_loss_coef: float | None = None) -> dict[str, Any]:
    """The ``config.json`` transformers 5.x writes for this model (plus 4.x's ``rope_theta``)."""
    if family_of_config(config, prefer=family) is not family:
        raise UnsupportedCheckpointError(f"the model does not fit the {family.value} layout")
    if family.value in hf_deepseek.MODEL_TYPES:
        out = hf_deepseek.deepseek_hf_config(config)
    elif family is Family.GPT_OSS:
        out = hf_gpt_oss.gpt_oss_hf_config(config, router_aux_loss_coef=router_aux_loss_coef)
    elif family in LLAMA_LAYOUT_FAMILIES:
        rope, legacy_scaling = rope_fields(config)
        out: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **hf_decoder_shape(config),
            "hidden_act": "silu",
            "max_position_embeddings": config.max_seq_len,
            "rms_norm_eps": config.norm_epsilon,
            "tie_word_embeddings": config.tie_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "pretraining_tp": 1,
            "rope_parameters": rope,
            "rope_theta": float(config.rope_theta),
            "rope_scaling": legacy_scaling,
        }
        if family in _ARCHITECTURES and family is not Family.LLAMA:
            out.update(_open_family_fields(config, family=family))
        if family is Family.MIXTRAL:
            for key in ("attention_bias", "mlp_bias", "pretraining_tp"):  # not MixtralConfig's
                del out[key]
            out.update(_mixtral_fields(config, router_aux_loss_coef=router_aux_loss_coef))
        if family is Family.QWEN3_MOE:
            out.update(hf_moe.qwen3_moe_fields(config, router_aux_loss_coef=router_aux_loss_coef))
        if family.value in hf_gemma.GEMMA_MODEL_TYPES:
            out = hf_gemma.gemma_hf_config(config, model_type=family.value)
    elif family is Family.LLAMA4_TEXT:
        out = hf_llama4.llama4_hf_config(config)
    else:
        out = gpt2_layout.gpt2_hf_config(config)
    out = {key: value for key, value in out.items()
           if value is not None or key not in _DROPPED_WHEN_NONE}
    out.update({
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "dtype": dtype,
        "transformers_version": TRANSFORMERS_VERSION_WRITTEN,
    })
    return out
