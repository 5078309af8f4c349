"""Llama 4's text model (``model_type: llama4_text``, transformers' ``Llama4ForCausalLM``): its
``config.json`` <-> TransformerConfig and its tensor names.

config.json, as transformers 5.24 reads it (``Llama4TextConfig.__post_init__`` fills what a file
leaves out): layer i rotates q and k when ``no_rope_layers[i]`` is 1 (default: every
``no_rope_layer_interval``-th layer, counting from 1, is NoPE); ``layer_types`` says which layers
attend in chunks (default: the RoPE layers, when ``attention_chunk_size`` is set). paxlite holds
the pair as one ``LayerAttention`` per layer: a chunked RoPE layer ``chunked_attention``, a
global RoPE layer ``full_attention``, a global NoPE layer ``full_attention_no_rope``; a chunked
NoPE layer (no published model has one) is refused. ``use_qk_norm`` normalises q and k of the RoPE
layers (``qk_l2_norm``, with ``rms_norm_eps``), ``attn_temperature_tuning`` tempers the NoPE
layers' queries (``floor_scale``, ``attn_scale``). The sparse layers are ``moe_layers`` (default
every ``interleave_moe_layer_step``-th, counting from 1): paxlite's ``first_moe_layer`` and
``moe_layer_interval`` must give exactly that list. Their experts and shared expert are
``intermediate_size`` wide, the dense layers' MLP ``intermediate_size_mlp``. transformers'
``Llama4ForCausalLM`` adds no router loss and no router noise, so ``output_router_logits``,
``router_aux_loss_coef`` and ``router_jitter_noise`` change nothing it computes and are not read.

Tensors: LLaMA's attention and norm names, q and k rows as they are (Llama 4 rotates interleaved
pairs, as paxlite does: no permutation); the feed-forward block is ``feed_forward``: a dense
layer's ``gate_proj`` / ``up_proj`` / ``down_proj``, a sparse layer's ``router`` [E, D],
``experts.gate_up_proj`` [E, D, 2F] (gate columns first) and ``experts.down_proj`` [E, F, D],
stored fused as they are, and ``shared_expert.{gate,up,down}_proj``.

The multimodal ``llama4`` checkpoints as published (Scout's and Maverick's,
``Llama4ForConditionalGeneration``) hold the text model's config.json fields under
``text_config`` and its tensors under ``language_model.`` (``language_model.model.*``,
``language_model.lm_head.weight``) beside the vision tower (``vision_model.*``) and the projector
(``multi_modal_projector.*``). paxlite reads the text model (`text_config`, `text_tensors`): the
same Llama4ForCausalLM, and written back it is a ``llama4_text`` checkpoint; the vision tower and
the projector are left out, which a warning logged as the config.json is read says in one
line (`text_tower_note`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from paxlite.interop.errors import UnsupportedCheckpointError, refuse_if
from paxlite.interop.hf_rope import rope_fields, rope_of
from paxlite.interop.layouts import Dim, LayoutError, Params, TensorSource
from paxlite.models.activations import Activation
from paxlite.models.moe_config import MoeConfig, MoeRouting
from paxlite.models.norms import NormKind
from paxlite.models.open_model_fields import LayerAttention
from paxlite.models.transformer_config import (
    LLAMA_ARCHITECTURE,
    PositionEmbedding,
    TransformerConfig,
)

_log = logging.getLogger(__name__)

LLAMA4_TEXT = "llama4_text"
ARCHITECTURE = "Llama4ForCausalLM"
# Llama4TextConfig's defaults for what a config.json may leave out
_DEFAULTS: Mapping[str, Any] = {
    "rope_theta": 500000.0, "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5,
    "num_experts_per_tok": 1, "num_local_experts": 16, "interleave_moe_layer_step": 1,
    "use_qk_norm": True, "no_rope_layer_interval": 4, "attention_chunk_size": 8192,
    "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
    "intermediate_size": 8192, "intermediate_size_mlp": 16384, "head_dim": 128,
}
_BY_PAIR: Mapping[tuple[str, bool], LayerAttention] = {  # (HF layer type, rotates) -> paxlite
    ("chunked_attention", True): LayerAttention.CHUNKED,
    ("full_attention", True): LayerAttention.FULL,
    ("full_attention", False): LayerAttention.FULL_NO_ROPE,
}
_LLAMA4_KINDS = frozenset(_BY_PAIR.values())

_P = "model.layers.{i}."
NAMES: Mapping[str, str] = {
    "embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
    "output": "lm_head.weight",
    "q": _P + "self_attn.q_proj.weight", "k": _P + "self_attn.k_proj.weight",
    "v": _P + "self_attn.v_proj.weight", "o": _P + "self_attn.o_proj.weight",
    "attn_norm": _P + "input_layernorm.weight", "mlp_norm": _P + "post_attention_layernorm.weight",
    "mlp": _P + "feed_forward.{w}_proj.weight",  # w: gate, up, down
    "router": _P + "feed_forward.router.weight",
    "gate_up": _P + "feed_forward.experts.gate_up_proj",
    "down": _P + "feed_forward.experts.down_proj",
    "shared": _P + "feed_forward.shared_expert.{w}_proj.weight",
}
_MLP = (("gate", "wi_gate"), ("up", "wi"), ("down", "wo"))  # HF projection -> paxlite Mlp name


# ---------------------------------------------------------------- the multimodal checkpoint
LLAMA4 = "llama4"  # Llama4ForConditionalGeneration's model_type
TEXT_TOWER = "language_model."  # its text model's tensor names: this, then Llama4ForCausalLM's
LEFT_OUT = ("vision_model.", "multi_modal_projector.")
# what the checkpoint records once for the whole model, read for the text model
_FILE_FIELDS = ("dtype", "torch_dtype")


def text_config(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """A multimodal ``llama4`` config.json's text model as a ``llama4_text`` config.json (its
    ``text_config``, with the file's dtype where that has none); any other config as it is."""
    if hf.get("model_type") != LLAMA4:
        return hf
    text = hf.get("text_config")
    refuse_if(not isinstance(text, Mapping) or text.get("model_type", LLAMA4_TEXT) != LLAMA4_TEXT,
              "text_config", text if not isinstance(text, Mapping) else text.get("model_type"),
              f"a model_type='{LLAMA4}' checkpoint needs its text model's fields as text_config "
              f"(model_type '{LLAMA4_TEXT}'), which paxlite converts")
    _log.warning(text_tower_note(hf))
    return {**{k: hf[k] for k in _FILE_FIELDS if k in hf}, **text, "model_type": LLAMA4_TEXT}


def text_tower_note(hf: Mapping[str, Any]) -> str:
    """The one line (logged when a multimodal config.json is read) saying what of the checkpoint
    paxlite leaves out."""
    return (f"config.json model_type='{LLAMA4}' "
            f"({', '.join(hf.get('architectures') or ['multimodal'])}): its text model is read "
            f"(as '{LLAMA4_TEXT}', tensors under '{TEXT_TOWER}'); the vision tower and the "
            f"multimodal projector (tensors under {' and '.join(repr(p) for p in LEFT_OUT)}) are "
            "left out")


class _TextTower(Mapping):
    """A multimodal checkpoint's tensors as its text model's: ``language_model.X`` named X, the
    vision tower's and projector's not there, any other name as it is (reported as left over)."""

    def __init__(self, tensors: Mapping[str, np.ndarray]) -> None:
        self._tensors = tensors
        self._names = {name.removeprefix(TEXT_TOWER): name for name in tensors
                       if not name.startswith(LEFT_OUT)}

    def __getitem__(self, name: str) -> np.ndarray:
        return self._tensors[self._names[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def text_tensors(tensors: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """The text model's tensors: those of a multimodal checkpoint (its embedding under
    ``language_model.``) by their Llama4ForCausalLM names; a text checkpoint's as they are."""
    if TEXT_TOWER + NAMES["embed"] in tensors:
        return _TextTower(tensors)
    return tensors


def _count(hf: Mapping[str, Any], key: str) -> int:
    value = hf.get(key)
    if value is None:
        value = _DEFAULTS.get(key)
    refuse_if(isinstance(value, bool) or not isinstance(value, int) or value <= 0, key, value,
              "it must be a positive integer")
    return value


def _per_layer(hf: Mapping[str, Any], num_layers: int) -> tuple[list[str], list[int]]:
    """(layer_types, no_rope_layers) as Llama4TextConfig completes them."""
    interval = _count(hf, "no_rope_layer_interval")
    no_rope = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
    refuse_if(not isinstance(no_rope, list) or len(no_rope) < num_layers
              or any(v not in (0, 1) for v in no_rope), "no_rope_layers", no_rope,
              f"it must list 1 (RoPE) or 0 (NoPE) for each of the {num_layers} layers")
    chunk = hf.get("attention_chunk_size", _DEFAULTS["attention_chunk_size"])
    types = hf.get("layer_types") or [
        "chunked_attention" if rope and chunk is not None else "full_attention"
        for rope in no_rope[:num_layers]]
    refuse_if(not isinstance(types, list) or len(types) != num_layers, "layer_types", types,
              f"it must have one entry for each of the {num_layers} layers")
    return types, list(no_rope[:num_layers])


def _layer_kinds(hf: Mapping[str, Any], num_layers: int) -> tuple[LayerAttention, ...]:
    types, no_rope = _per_layer(hf, num_layers)
    kinds = []
    for i, (kind, rope) in enumerate(zip(types, no_rope, strict=True)):
        refuse_if((kind, bool(rope)) not in _BY_PAIR, f"layer_types[{i}]", kind,
                  f"with no_rope_layers[{i}]={rope}: paxlite's Llama 4 layers are chunked with "
                  "RoPE, or global with or without RoPE")
        kinds.append(_BY_PAIR[kind, bool(rope)])
    return tuple(kinds)


def _moe_placement(hf: Mapping[str, Any], num_layers: int) -> tuple[int, int] | None:
    """(first_moe_layer, moe_layer_interval) giving exactly transformers' ``moe_layers``; None
    for no sparse layer."""
    step = _count(hf, "interleave_moe_layer_step")
    layers = hf.get("moe_layers")
    if layers is None:
        layers = list(range(step - 1, num_layers, step))
    refuse_if(not isinstance(layers, list), "moe_layers", layers, "it must be a list of layers")
    layers = sorted({i for i in layers if isinstance(i, int) and 0 <= i < num_layers})
    if not layers:
        return None
    first = layers[0]
    interval = layers[1] - first if len(layers) > 1 else num_layers - first
    if [i for i in range(first, num_layers, interval)] != layers:
        raise UnsupportedCheckpointError(
            f"config.json moe_layers={hf.get('moe_layers', layers)!r} (interleave_moe_layer_step="
            f"{step}) is not every n-th layer from one layer on, which is what paxlite's "
            "first_moe_layer and moe_layer_interval can hold")
    return first, interval


def llama4_config(hf: Mapping[str, Any]) -> TransformerConfig:
    """The TransformerConfig of a ``llama4_text`` config.json."""
    refuse_if(bool(hf.get("attention_bias")), "attention_bias", hf.get("attention_bias"),
              "paxlite's Llama 4 has no attention biases")
    act = hf.get("hidden_act", "silu")
    refuse_if(act != "silu", "hidden_act", act, "Llama 4 conversion supports 'silu' only")
    num_layers = _count(hf, "num_hidden_layers")
    kinds = _layer_kinds(hf, num_layers)
    heads = _count(hf, "num_attention_heads")
    kv = hf.get("num_key_value_heads")
    head_dim = hf.get("head_dim", _DEFAULTS["head_dim"]) or _count(hf, "hidden_size") // heads
    theta, scaling = rope_of(hf, default=_DEFAULTS["rope_theta"])
    tuning = hf.get("attn_temperature_tuning", _DEFAULTS["attn_temperature_tuning"])
    tempered = bool(tuning) and LayerAttention.FULL_NO_ROPE in kinds
    scale = hf.get("attn_scale", _DEFAULTS["attn_scale"])
    use_qk_norm = hf.get("use_qk_norm", _DEFAULTS["use_qk_norm"])
    placement = _moe_placement(hf, num_layers)
    experts_hidden = _count(hf, "intermediate_size")
    moe = None
    if placement is not None:
        experts = _count(hf, "num_local_experts")
        k = _count(hf, "num_experts_per_tok")
        refuse_if(k > experts, "num_experts_per_tok", k,
                  f"it must be between 1 and num_local_experts={experts}")
        moe = MoeConfig(num_experts=experts, experts_per_token=k,
                        routing=MoeRouting.SIGMOID_TOPK, renormalize_top_k=False,
                        first_moe_layer=placement[0], moe_layer_interval=placement[1],
                        expert_hidden_dims=experts_hidden, gated_experts=True,
                        expert_activation=Activation.SILU,
                        shared_expert_hidden_dims=experts_hidden)
    chunked = LayerAttention.CHUNKED in kinds
    return TransformerConfig(
        vocab_size=_count(hf, "vocab_size"),
        num_layers=num_layers,
        model_dims=_count(hf, "hidden_size"),
        num_heads=heads,
        num_kv_heads=heads if kv is None else int(kv),
        dims_per_head=int(head_dim),
        hidden_dims=_count(hf, "intermediate_size_mlp"),
        max_seq_len=_count(hf, "max_position_embeddings"),
        norm_epsilon=float(hf.get("rms_norm_eps", _DEFAULTS["rms_norm_eps"])),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **LLAMA_ARCHITECTURE,
        rope_theta=theta,
        rope_scaling=scaling,
        moe=moe,
        layer_types=None if set(kinds) == {LayerAttention.FULL} else kinds,
        attention_chunk_size=_count(hf, "attention_chunk_size") if chunked else None,
        qk_l2_norm=bool(use_qk_norm) and any(kind is not LayerAttention.FULL_NO_ROPE
                                             for kind in kinds),
        query_temperature_floor=_count(hf, "floor_scale") if tempered else None,
        query_temperature_scale=float(scale) if tempered else 0.1,
    )


# ---------------------------------------------------------------- which models fit, writing
def llama4_off(config: TransformerConfig) -> dict[str, tuple[Any, Any]]:
    """What the other families' layouts need of the Llama 4 fields: all off."""
    return {"qk_l2_norm": (config.qk_l2_norm, False),
            "attention_chunk_size": (config.attention_chunk_size, None),
            "query_temperature_floor": (config.query_temperature_floor, None),
            "moe.routing is sigmoid_topk": (
                config.moe is not None and config.moe.routing is MoeRouting.SIGMOID_TOPK, False)}


def llama4_requirements(config: TransformerConfig) -> dict[str, tuple[Any, Any]]:
    """Each field Llama 4's layout constrains, as (the model's value, the value it needs)."""
    out: dict[str, tuple[Any, Any]] = {
        "norm": (config.norm, NormKind.RMS_NORM),
        "activation": (config.activation, Activation.SILU),
        "gated_mlp": (config.gated_mlp, True),
        "use_bias": (config.use_bias, False),
        "qkv_bias (resolved)": (config.uses_qkv_bias, False),
        "position_kind": (config.position_kind, PositionEmbedding.ROTARY),
        "qk_norm": (config.qk_norm, False),
        "sliding_window": (config.sliding_window, None),
        "layer_types within Llama 4's": (set(config.layer_types or ()) <= _LLAMA4_KINDS, True),
        **{name: (getattr(config, name), want) for name, want in (
            ("post_norms", False), ("scale_embeddings", False), ("query_scale_dims", None),
            ("attention_logit_cap", None), ("final_logit_cap", None),
            ("local_rope_theta", None))},
    }
    moe = config.moe
    if moe is not None:
        f = moe.expert_hidden_dims or config.hidden_dims
        out.update({
            "moe.routing": (moe.routing, MoeRouting.SIGMOID_TOPK),
            "moe.gated_experts": (moe.gated_experts, True),
            "moe.expert_activation": (moe.expert_activation, Activation.SILU),
            "moe.shared_expert_hidden_dims": (moe.shared_expert_hidden_dims, f),
        })
    return out


def llama4_hf_config(config: TransformerConfig) -> dict[str, Any]:
    """The config.json transformers 5.24 writes for this model (plus 4.x's RoPE fields)."""
    kinds = config.layer_types or (LayerAttention.FULL,) * config.num_layers
    moe = config.moe
    rope, legacy = rope_fields(config)
    moe_layers = [] if moe is None else [i for i in range(config.num_layers)
                                          if moe.is_moe_layer(i)]
    return {
        "architectures": [ARCHITECTURE],
        "model_type": LLAMA4_TEXT,
        "vocab_size": config.vocab_size,
        "hidden_size": config.model_dims,
        "intermediate_size": (config.hidden_dims if moe is None
                              else moe.expert_hidden_dims or config.hidden_dims),
        "intermediate_size_mlp": config.hidden_dims,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.dims_per_head,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_epsilon,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "num_local_experts": _DEFAULTS["num_local_experts"] if moe is None else moe.num_experts,
        "num_experts_per_tok": 1 if moe is None else moe.experts_per_token,
        "moe_layers": moe_layers,
        "interleave_moe_layer_step": 1 if moe is None else moe.moe_layer_interval,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "use_qk_norm": config.qk_l2_norm,
        "rope_parameters": rope,
        "rope_theta": float(config.rope_theta),
        "rope_scaling": legacy,
        "no_rope_layers": [int(kind is not LayerAttention.FULL_NO_ROPE) for kind in kinds],
        "no_rope_layer_interval": _DEFAULTS["no_rope_layer_interval"],
        "attention_chunk_size": config.attention_chunk_size,
        "layer_types": ["chunked_attention" if kind is LayerAttention.CHUNKED
                        else "full_attention" for kind in kinds],
        "attn_temperature_tuning": config.query_temperature_floor is not None,
        "floor_scale": config.query_temperature_floor or _DEFAULTS["floor_scale"],
        "attn_scale": config.query_temperature_scale,
    }


# ---------------------------------------------------------------- tensors
def _dims(c: TransformerConfig) -> dict[str, Dim]:
    h, n, kv = c.dims_per_head, c.num_heads, c.kv_heads
    f = c.hidden_dims if c.moe is None else c.moe.expert_hidden_dims or c.hidden_dims
    return {
        "vocab": Dim(f"vocab_size={c.vocab_size}", c.vocab_size),
        "dims": Dim(f"hidden_size={c.model_dims}", c.model_dims),
        "q": Dim(f"num_attention_heads * head_dim = {n} * {h} = {n * h}", n * h),
        "kv": Dim(f"num_key_value_heads * head_dim = {kv} * {h} = {kv * h}", kv * h),
        "mlp": Dim(f"intermediate_size_mlp={c.hidden_dims}", c.hidden_dims),
        "f": Dim(f"intermediate_size={f}", f),
        "2f": Dim(f"2 * intermediate_size = {2 * f}", 2 * f),
        "experts": Dim(f"num_local_experts={c.moe.num_experts if c.moe else 0}",
                       c.moe.num_experts if c.moe else 0),
    }


def _attention(src: TensorSource, *, i: int, c: TransformerConfig, d: dict[str, Dim]) -> Params:
    n, kv, h, dm = c.num_heads, c.kv_heads, c.dims_per_head, c.model_dims
    q = src.take(NAMES["q"].format(i=i), (d["q"], d["dims"])).T.reshape(dm, n, h)  # [D, N, H]
    k = src.take(NAMES["k"].format(i=i), (d["kv"], d["dims"])).T.reshape(dm, kv, h)
    v = src.take(NAMES["v"].format(i=i), (d["kv"], d["dims"])).T.reshape(dm, kv, h)
    o = src.take(NAMES["o"].format(i=i), (d["dims"], d["q"])).T.reshape(n, h, dm)  # [N, H, D]
    if kv == n:
        return {"qkv": {"kernel": np.stack([q, k, v], axis=1)}, "out": {"kernel": o}}
    return {"query": {"kernel": q}, "key": {"kernel": k}, "value": {"kernel": v},
            "out": {"kernel": o}}


def _mlp(src: TensorSource, name: str, *, i: int, hidden: Dim, d: dict[str, Dim]) -> Params:
    shapes = {"gate": (hidden, d["dims"]), "up": (hidden, d["dims"]), "down": (d["dims"], hidden)}
    return {ours: {"kernel": src.take(name.format(i=i, w=w), shapes[w]).T} for w, ours in _MLP}


def iter_llama4_params(tensors: Mapping[str, np.ndarray], *, config: TransformerConfig
                       ) -> Iterator[tuple[str, Params]]:
    """Llama 4 text tensors -> unscanned paxlite params, one top-level subtree at a time."""
    if config.moe is not None and config.moe.routing is not MoeRouting.SIGMOID_TOPK:
        raise LayoutError(f"a Llama 4 checkpoint needs moe.routing='sigmoid_topk', not "
                          f"{config.moe.routing.value!r}")
    src = TensorSource(text_tensors(tensors), what="Hugging Face Llama 4 checkpoint")
    d = _dims(config)
    embedding = src.take(NAMES["embed"], (d["vocab"], d["dims"]))
    yield "embedding", {"embedding": embedding}
    for i in range(config.num_layers):
        layer: Params = {
            "pre_attention_norm": {"scale": src.take(NAMES["attn_norm"].format(i=i),
                                                     (d["dims"],))},
            "attention": _attention(src, i=i, c=config, d=d),
            "pre_mlp_norm": {"scale": src.take(NAMES["mlp_norm"].format(i=i), (d["dims"],))},
        }
        if config.moe is not None and config.moe.is_moe_layer(i):
            f = d["f"].size
            gate_up = src.take(NAMES["gate_up"].format(i=i), (d["experts"], d["dims"], d["2f"]))
            layer["moe"] = {
                "router": {"kernel": src.take(NAMES["router"].format(i=i),
                                              (d["experts"], d["dims"])).T},  # [D, E]
                "wi_gate": {"kernel": gate_up[:, :, :f]}, "wi": {"kernel": gate_up[:, :, f:]},
                "wo": {"kernel": src.take(NAMES["down"].format(i=i),
                                          (d["experts"], d["f"], d["dims"]))},  # [E, F, D]
                "shared_expert": _mlp(src, NAMES["shared"], i=i, hidden=d["f"], d=d),
            }
        else:
            layer["mlp"] = _mlp(src, NAMES["mlp"], i=i, hidden=d["mlp"], d=d)
        yield f"layers_{i}", layer
    yield "final_norm", {"scale": src.take(NAMES["final_norm"], (d["dims"],))}
    if not config.tie_embeddings:
        yield "output", {"kernel": src.take(NAMES["output"], (d["vocab"], d["dims"])).T}
    elif src.has(NAMES["output"]):
        head = src.take(NAMES["output"], (d["vocab"], d["dims"]))
        if not np.array_equal(head, embedding):
            raise LayoutError("Hugging Face Llama 4 checkpoint: tie_word_embeddings is true but "
                              "lm_head.weight differs from model.embed_tokens.weight")
    src.finish()


def iter_llama4_tensors(params: Params, *, config: TransformerConfig
                        ) -> Iterator[tuple[str, np.ndarray]]:
    """Inverse of `iter_llama4_params`: HF's tensors, one at a time."""
    n, kv, h, dm = config.num_heads, config.kv_heads, config.dims_per_head, config.model_dims
    yield NAMES["embed"], params["embedding"]["embedding"]
    for i in range(config.num_layers):
        layer = params[f"layers_{i}"]
        att = layer["attention"]
        if "qkv" in att:
            qkv = np.asarray(att["qkv"]["kernel"])  # [D, 3, N, H]
            kernels = {"q": qkv[:, 0], "k": qkv[:, 1], "v": qkv[:, 2]}
        else:
            kernels = {p: np.asarray(att[name]["kernel"])
                       for p, name in (("q", "query"), ("k", "key"), ("v", "value"))}
        for p, heads in (("q", n), ("k", kv), ("v", kv)):
            yield NAMES[p].format(i=i), kernels[p].reshape(dm, heads * h).T
        yield NAMES["o"].format(i=i), np.asarray(att["out"]["kernel"]).reshape(n * h, dm).T
        yield NAMES["attn_norm"].format(i=i), layer["pre_attention_norm"]["scale"]
        yield NAMES["mlp_norm"].format(i=i), layer["pre_mlp_norm"]["scale"]
        if config.moe is not None and config.moe.is_moe_layer(i):
            moe = layer["moe"]
            yield NAMES["router"].format(i=i), np.asarray(moe["router"]["kernel"]).T
            yield NAMES["gate_up"].format(i=i), np.concatenate(
                [np.asarray(moe["wi_gate"]["kernel"]), np.asarray(moe["wi"]["kernel"])], axis=2)
            yield NAMES["down"].format(i=i), np.asarray(moe["wo"]["kernel"])
            mlp, name = moe["shared_expert"], NAMES["shared"]
        else:
            mlp, name = layer["mlp"], NAMES["mlp"]
        for w, ours in _MLP:
            yield name.format(i=i, w=w), np.asarray(mlp[ours]["kernel"]).T
    yield NAMES["final_norm"], params["final_norm"]["scale"]
    if not config.tie_embeddings:
        yield NAMES["output"], np.asarray(params["output"]["kernel"]).T
