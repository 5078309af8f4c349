"""DeepSeek-V3 (``deepseek_v3``) and DeepSeek-V2 / V2-Lite (``deepseek_v2``) in Hugging Face form.

Both are LLaMA's block (RMSNorm, SwiGLU, untied head) with multi-head latent attention
(models/mla_attention.py) and MoE layers from ``first_k_dense_replace`` on, each with
``n_routed_experts`` SwiGLU experts of ``moe_intermediate_size`` and a shared expert of
``n_shared_experts * moe_intermediate_size`` (models/moe_config.py), routed as
models/moe_router_deepseek.py says. What transformers 5.24 ignores is accepted and not kept: V3's
multi-token-prediction layers (``num_nextn_predict_layers``: their tensors, after the last layer,
are skipped on reading; a written config says 0). Anything else paxlite cannot compute exactly
(attention or MLP biases, a V3 ``topk_method`` other than ``noaux_tc``, V2 renormalisation, RoPE
other than plain or YaRN, fewer kv heads than heads) is one error naming the field.

The rotary layout: V2's complex pairs and V3's ``rope_interleave`` are paxlite's interleaved
pairs, read as they are (V3 concatenates the rotated pairs' two halves, one permutation of q's and
k's rotary dimensions alike, which leaves their products unchanged); V3 with
``rope_interleave: false`` (rotate-half rows) is refused.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from paxlite.interop.errors import UnsupportedCheckpointError, refuse_if
from paxlite.interop.hf_moe import ExpertNaming
from paxlite.interop.hf_rope import YARN_ONLY, rope_fields, rope_of
from paxlite.interop.layouts import (
    Dim,
    Params,
    TensorSource,
    _experts_from_params,
    _experts_to_params,
)
from paxlite.models.activations import Activation
from paxlite.models.mla_attention import MlaConfig, softmax_scale
from paxlite.models.moe_config import MoeConfig, MoeRouting
from paxlite.models.moe_router_deepseek import (
    SCORE_BIAS_NAME,
    DeepseekRouter,
    ExpertChoice,
    ScoreFunction,
)
from paxlite.models.transformer_config import LLAMA_ARCHITECTURE, TransformerConfig

V3, V2 = "deepseek_v3", "deepseek_v2"
MODEL_TYPES: tuple[str, ...] = (V3, V2)
_ARCHITECTURES = {V3: "DeepseekV3ForCausalLM", V2: "DeepseekV2ForCausalLM"}
EXPERTS = ExpertNaming(
    what="Hugging Face DeepSeek checkpoint", router="model.layers.{i}.mlp.gate.weight",
    expert="model.layers.{i}.mlp.experts.{e}.{w}.weight", gate="gate_proj", up="up_proj",
    down="down_proj", experts_field="n_routed_experts", hidden_field="moe_intermediate_size")
_P = "model.layers.{i}."


def _int(hf: Mapping[str, Any], key: str) -> int:
    value = hf.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnsupportedCheckpointError(f"config.json {key}={value!r} must be a positive "
                                         f"integer for model_type={hf.get('model_type')!r}")
    return value


def deepseek_config(hf: Mapping[str, Any]) -> TransformerConfig:
    """The TransformerConfig of a DeepSeek-V2/V3 config.json (refusals in the module docstring)."""
    model_type = hf["model_type"]
    v3 = model_type == V3
    for key in ("attention_bias", "mlp_bias"):
        refuse_if(bool(hf.get(key, False)), key, hf.get(key), "DeepSeek's layers have no biases")
    act = hf.get("hidden_act", "silu")
    refuse_if(act != "silu", "hidden_act", act, "DeepSeek converts with 'silu' (SwiGLU) only")
    heads = _int(hf, "num_attention_heads")
    kv_heads = hf.get("num_key_value_heads")
    refuse_if(kv_heads not in (None, heads), "num_key_value_heads", kv_heads,
              f"MLA expands its latent to every head: it must equal num_attention_heads={heads}")
    method = hf.get("topk_method")
    group_fields = {"num_groups": hf.get("n_group") or 1, "top_groups": hf.get("topk_group") or 1}
    if v3:
        refuse_if(method not in (None, "noaux_tc"), "topk_method", method,
                  "transformers' DeepSeek-V3 always routes 'noaux_tc'")
        router = DeepseekRouter(score=ScoreFunction.SIGMOID, choice=ExpertChoice.NOAUX_TC,
                                routed_scaling=float(hf.get("routed_scaling_factor", 2.5)),
                                **group_fields)
        renormalize = bool(hf.get("norm_topk_prob", True))
        interleave = hf.get("rope_interleave", True)
        refuse_if(interleave is not True, "rope_interleave", interleave,
                  "paxlite reads DeepSeek-V3's interleaved rotary layout only (true)")
    else:
        refuse_if(method not in (None, "greedy", "group_limited_greedy"), "topk_method", method,
                  "DeepSeek-V2 routes 'greedy' or 'group_limited_greedy'")
        refuse_if(bool(hf.get("norm_topk_prob", False)), "norm_topk_prob",
                  hf.get("norm_topk_prob"), "transformers' DeepSeek-V2 never renormalises its "
                  "routing weights")
        router = DeepseekRouter(score=ScoreFunction.SOFTMAX,
                                choice=ExpertChoice(method or "greedy"),
                                routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
                                **group_fields)
        renormalize = False
    theta, scaling = rope_of(hf, kinds=YARN_ONLY)
    q_rank = hf.get("q_lora_rank")
    mla_sizes = {name: _int(hf, key) for name, key in (
        ("kv_lora_rank", "kv_lora_rank"), ("qk_nope_head_dims", "qk_nope_head_dim"),
        ("qk_rope_head_dims", "qk_rope_head_dim"), ("v_head_dims", "v_head_dim"))}
    qk_head = mla_sizes["qk_nope_head_dims"] + mla_sizes["qk_rope_head_dims"]
    mla = MlaConfig(**mla_sizes, q_lora_rank=None if q_rank is None else _int(hf, "q_lora_rank"),
                    softmax_scale=softmax_scale(qk_head_dims=qk_head, scaling=scaling))
    shared = hf.get("n_shared_experts") or 0
    moe_hidden = _int(hf, "moe_intermediate_size")
    try:
        moe = MoeConfig(
            num_experts=_int(hf, "n_routed_experts"), experts_per_token=_int(
                hf, "num_experts_per_tok"), routing=MoeRouting.DROPLESS_TOPK,
            gated_experts=True, expert_activation=Activation.SILU, expert_hidden_dims=moe_hidden,
            renormalize_top_k=renormalize,
            shared_expert_hidden_dims=shared * moe_hidden if shared else None,
            first_moe_layer=int(hf.get("first_k_dense_replace") or 0), deepseek_router=router)
    except ValueError as error:
        raise UnsupportedCheckpointError(f"config.json (model_type={model_type!r}): {error}"
                                         ) from None
    return TransformerConfig(
        vocab_size=_int(hf, "vocab_size"), num_layers=_int(hf, "num_hidden_layers"),
        model_dims=_int(hf, "hidden_size"), num_heads=heads, dims_per_head=qk_head,
        hidden_dims=_int(hf, "intermediate_size"),
        max_seq_len=int(hf.get("max_position_embeddings") or 4096),
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **LLAMA_ARCHITECTURE,
        rope_theta=theta, rope_scaling=scaling, mla=mla, moe=moe)


def is_deepseek(config: TransformerConfig) -> bool:
    moe = config.moe
    return (config.mla is not None and moe is not None and moe.deepseek_router is not None
            and moe.gated_experts and moe.routing is MoeRouting.DROPLESS_TOPK)


def model_type_of(config: TransformerConfig) -> str:
    """V3 for the sigmoid router, V2 for the softmax one."""
    return V3 if config.moe.deepseek_router.score is ScoreFunction.SIGMOID else V2


def requirements(config: TransformerConfig) -> dict[str, dict[str, tuple[Any, Any]]]:
    """Per model type, what the model must be to be written as it (hf_config's form)."""
    fits = is_deepseek(config)
    wanted = {
        "mla + deepseek_router + gated dropless experts": (fits, True),
        "norm": (config.norm.value, "rms_norm"), "activation": (config.activation.value, "silu"),
        "gated_mlp": (config.gated_mlp, True), "use_bias": (config.use_bias, False),
        "position_kind": (config.position_kind.value, "rotary"),
        "moe.expert_activation": (config.moe.expert_activation.value if config.moe else None,
                                  "silu"),
        "post_norms": (config.post_norms, False), "scale_embeddings": (config.scale_embeddings,
                                                                      False),
        "final_logit_cap": (config.final_logit_cap, None),
        "moe.load_balancing_weight": (config.moe.load_balancing_weight if config.moe else 0, 0),
        "moe.moe_layer_interval": (config.moe.moe_layer_interval if config.moe else 1, 1),
    }
    if fits:
        scale = softmax_scale(qk_head_dims=config.mla.qk_head_dims, scaling=config.rope_scaling)
        wanted["mla.softmax_scale"] = (config.mla.scale, scale)
        router = config.moe.deepseek_router
        hidden = config.moe.expert_hidden_dims or config.hidden_dims
        shared = config.moe.shared_expert_hidden_dims
        wanted["moe.shared_expert_hidden_dims"] = (
            None if shared is None else shared % hidden, None if shared is None else 0)
        wanted["deepseek_router.bias_update_speed"] = (router.bias_update_speed, 0.0)
    mine = model_type_of(config) if fits else None
    return {t: {**wanted, "model_type": (mine, t)} for t in MODEL_TYPES}


def latent_attention_off(config: TransformerConfig) -> dict[str, tuple[Any, Any]]:
    """What every other family needs of DeepSeek's own parts (MLA, its router): none of them."""
    moe = config.moe
    return {"mla": ("set" if config.mla is not None else None, None),
            "moe.deepseek_router": ("set" if moe and moe.deepseek_router else None, None)}


def shared_experts_off(config: TransformerConfig) -> dict[str, tuple[Any, Any]]:
    """What the families without shared experts or dense first layers need of them (Llama 4 has
    both, as DeepSeek does): none."""
    moe = config.moe
    return {"moe.shared_expert_hidden_dims": (moe and moe.shared_expert_hidden_dims, None),
            "moe.first_moe_layer": (moe.first_moe_layer if moe else 0, 0)}


def off(config: TransformerConfig) -> dict[str, tuple[Any, Any]]:
    """What the families with none of DeepSeek's layout need of it: all of it off."""
    return {**latent_attention_off(config), **shared_experts_off(config)}


def deepseek_hf_config(config: TransformerConfig) -> dict[str, Any]:
    """The config.json of a DeepSeek model (its model type from the router)."""
    model_type = model_type_of(config)
    mla, moe = config.mla, config.moe
    router = moe.deepseek_router
    hidden = moe.expert_hidden_dims or config.hidden_dims
    rope, legacy = rope_fields(config)
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": config.vocab_size, "hidden_size": config.model_dims,
        "intermediate_size": config.hidden_dims, "moe_intermediate_size": hidden,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_heads,
        "n_shared_experts": (moe.shared_expert_hidden_dims or 0) // hidden,
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.experts_per_token,
        "routed_scaling_factor": float(router.routed_scaling),
        "n_group": router.num_groups, "topk_group": router.top_groups,
        "topk_method": router.choice.value, "norm_topk_prob": moe.renormalize_top_k,
        "first_k_dense_replace": moe.first_moe_layer,
        "kv_lora_rank": mla.kv_lora_rank, "q_lora_rank": mla.q_lora_rank,
        "qk_rope_head_dim": mla.qk_rope_head_dims, "qk_nope_head_dim": mla.qk_nope_head_dims,
        "v_head_dim": mla.v_head_dims, "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.norm_epsilon,
        "tie_word_embeddings": config.tie_embeddings, "attention_bias": False,
        "attention_dropout": 0.0, "rope_parameters": rope,
        "rope_theta": float(config.rope_theta), "rope_scaling": legacy,
    }
    if model_type == V3:
        out.update({"rope_interleave": True, "num_nextn_predict_layers": 0})
    else:
        out["mlp_bias"] = False
    return out


# ---------------------------------------------------------------- tensors
def _dims(c: TransformerConfig) -> dict[str, Dim]:
    mla, n = c.mla, c.num_heads
    return {
        "dims": Dim(f"hidden_size={c.model_dims}", c.model_dims),
        "q": Dim(f"num_attention_heads * qk_head_dim = {n} * {mla.qk_head_dims}",
                 n * mla.qk_head_dims),
        "q_rank": Dim(f"q_lora_rank={mla.q_lora_rank}", mla.q_lora_rank or 0),
        "kv_a": Dim(f"kv_lora_rank + qk_rope_head_dim = {mla.kv_lora_rank + mla.qk_rope_head_dims}",
                    mla.kv_lora_rank + mla.qk_rope_head_dims),
        "kv_rank": Dim(f"kv_lora_rank={mla.kv_lora_rank}", mla.kv_lora_rank),
        "kv_b": Dim(f"num_attention_heads * (qk_nope_head_dim + v_head_dim) = {n} * "
                    f"{mla.qk_nope_head_dims + mla.v_head_dims}",
                    n * (mla.qk_nope_head_dims + mla.v_head_dims)),
        "o": Dim(f"num_attention_heads * v_head_dim = {n} * {mla.v_head_dims}",
                 n * mla.v_head_dims),
        "hidden": Dim(f"intermediate_size={c.hidden_dims}", c.hidden_dims),
        "vocab": Dim(f"vocab_size={c.vocab_size}", c.vocab_size),
        "experts": Dim(f"n_routed_experts={c.moe.num_experts}", c.moe.num_experts),
        "shared": Dim(f"n_shared_experts * moe_intermediate_size = "
                      f"{c.moe.shared_expert_hidden_dims}", c.moe.shared_expert_hidden_dims or 0),
    }


def _attention_to_params(src: TensorSource, c: TransformerConfig, d: dict[str, Dim],
                         i: int) -> Params:
    mla, n, dm = c.mla, c.num_heads, c.model_dims
    p = _P.format(i=i) + "self_attn."
    out: Params = {}
    if mla.q_lora_rank is None:
        q = src.take(p + "q_proj.weight", (d["q"], d["dims"]))  # [N*Hqk, D]
        q_in, q_name = dm, "query"
    else:
        out["q_a"] = {"kernel": src.take(p + "q_a_proj.weight", (d["q_rank"], d["dims"])).T}
        out["q_a_norm"] = {"scale": src.take(p + "q_a_layernorm.weight", (d["q_rank"],))}
        q = src.take(p + "q_b_proj.weight", (d["q"], d["q_rank"]))
        q_in, q_name = mla.q_lora_rank, "q_b"
    kv_a = src.take(p + "kv_a_proj_with_mqa.weight", (d["kv_a"], d["dims"]))  # [R+Hr, D]
    out[q_name] = {"kernel": q.T.reshape(q_in, n, mla.qk_head_dims)}
    out["kv_a"] = {"kernel": kv_a[:mla.kv_lora_rank].T}
    out["key_rope"] = {"kernel": kv_a[mla.kv_lora_rank:].T}
    out["kv_a_norm"] = {"scale": src.take(p + "kv_a_layernorm.weight", (d["kv_rank"],))}
    kv_b = src.take(p + "kv_b_proj.weight", (d["kv_b"], d["kv_rank"])).T.reshape(
        mla.kv_lora_rank, n, mla.qk_nope_head_dims + mla.v_head_dims)
    out["key_b"] = {"kernel": kv_b[..., :mla.qk_nope_head_dims]}
    out["value_b"] = {"kernel": kv_b[..., mla.qk_nope_head_dims:]}
    out["out"] = {"kernel": src.take(p + "o_proj.weight", (d["dims"], d["o"])).T.reshape(
        n, mla.v_head_dims, dm)}
    return out


def iter_deepseek_params(tensors: Mapping[str, np.ndarray], *, config: TransformerConfig
                         ) -> Iterator[tuple[str, Any]]:
    """HF DeepSeek tensors -> the unscanned paxlite tree, one top-level subtree at a time; tensors
    of layers past ``num_hidden_layers`` (V3's multi-token prediction) are skipped, as
    transformers skips them."""
    extra = re.compile(r"model\.layers\.(\d+)\.")
    kept = {k: v for k, v in tensors.items()
            if not ((m := extra.match(k)) and int(m.group(1)) >= config.num_layers)}
    src = TensorSource(kept, what="Hugging Face DeepSeek checkpoint")
    d = _dims(config)
    yield "embedding", {"embedding": src.take("model.embed_tokens.weight",
                                              (d["vocab"], d["dims"]))}
    for i in range(config.num_layers):
        p = _P.format(i=i)
        layer: Params = {
            "pre_attention_norm": {"scale": src.take(p + "input_layernorm.weight", (d["dims"],))},
            "attention": _attention_to_params(src, config, d, i),
            "pre_mlp_norm": {"scale": src.take(p + "post_attention_layernorm.weight",
                                               (d["dims"],))},
        }
        if config.moe.is_moe_layer(i):
            moe = _experts_to_params(src, i=i, config=config, naming=EXPERTS)
            if config.moe.deepseek_router.uses_bias:
                moe[SCORE_BIAS_NAME] = src.take(p + "mlp.gate.e_score_correction_bias",
                                                (d["experts"],)).astype(np.float32)
            if config.moe.shared_expert_hidden_dims:
                moe["shared_expert"] = _mlp(src, p + "mlp.shared_experts.", d, "shared")
            layer["moe"] = moe
        else:
            layer["mlp"] = _mlp(src, p + "mlp.", d, "hidden")
        yield f"layers_{i}", layer
    yield "final_norm", {"scale": src.take("model.norm.weight", (d["dims"],))}
    if not config.tie_embeddings:
        yield "output", {"kernel": src.take("lm_head.weight", (d["vocab"], d["dims"])).T}
    src.finish()


def _mlp(src: TensorSource, prefix: str, d: dict[str, Dim], hidden: str) -> Params:
    return {"wi_gate": {"kernel": src.take(prefix + "gate_proj.weight", (d[hidden], d["dims"])).T},
            "wi": {"kernel": src.take(prefix + "up_proj.weight", (d[hidden], d["dims"])).T},
            "wo": {"kernel": src.take(prefix + "down_proj.weight", (d["dims"], d[hidden])).T}}


def _mlp_tensors(mlp: Params, prefix: str) -> Iterator[tuple[str, np.ndarray]]:
    for name, hf in (("wi_gate", "gate_proj"), ("wi", "up_proj"), ("wo", "down_proj")):
        yield f"{prefix}{hf}.weight", np.asarray(mlp[name]["kernel"]).T


def iter_deepseek_tensors(params: Params, *, config: TransformerConfig
                          ) -> Iterator[tuple[str, np.ndarray]]:
    """Inverse of `iter_deepseek_params` (interleaved rotary rows, as written with
    ``rope_interleave: true``)."""
    mla, dm = config.mla, config.model_dims
    yield "model.embed_tokens.weight", params["embedding"]["embedding"]
    for i in range(config.num_layers):
        p, layer = _P.format(i=i), params[f"layers_{i}"]
        att = layer["attention"]
        a = p + "self_attn."
        if mla.q_lora_rank is None:
            yield a + "q_proj.weight", np.asarray(att["query"]["kernel"]).reshape(dm, -1).T
        else:
            yield a + "q_a_proj.weight", np.asarray(att["q_a"]["kernel"]).T
            yield a + "q_a_layernorm.weight", att["q_a_norm"]["scale"]
            yield a + "q_b_proj.weight", np.asarray(att["q_b"]["kernel"]).reshape(
                mla.q_lora_rank, -1).T
        yield a + "kv_a_proj_with_mqa.weight", np.concatenate(
            [np.asarray(att["kv_a"]["kernel"]), np.asarray(att["key_rope"]["kernel"])], axis=1).T
        yield a + "kv_a_layernorm.weight", att["kv_a_norm"]["scale"]
        kv_b = np.concatenate([np.asarray(att["key_b"]["kernel"]),
                               np.asarray(att["value_b"]["kernel"])], axis=-1)  # [R, N, Hn+Hv]
        yield a + "kv_b_proj.weight", kv_b.reshape(mla.kv_lora_rank, -1).T
        yield a + "o_proj.weight", np.asarray(att["out"]["kernel"]).reshape(-1, dm).T
        if config.moe.is_moe_layer(i):
            moe = layer["moe"]
            yield from _experts_from_params(moe, i=i, naming=EXPERTS)
            if SCORE_BIAS_NAME in moe:
                yield p + "mlp.gate.e_score_correction_bias", moe[SCORE_BIAS_NAME]
            if "shared_expert" in moe:
                yield from _mlp_tensors(moe["shared_expert"], p + "mlp.shared_experts.")
        else:
            yield from _mlp_tensors(layer["mlp"], p + "mlp.")
        yield p + "input_layernorm.weight", layer["pre_attention_norm"]["scale"]
        yield p + "post_attention_layernorm.weight", layer["pre_mlp_norm"]["scale"]
    yield "model.norm.weight", params["final_norm"]["scale"]
    if not config.tie_embeddings:
        yield "lm_head.weight", np.asarray(params["output"]["kernel"]).T
