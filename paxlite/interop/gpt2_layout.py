"""Hugging Face GPT-2: its ``config.json`` <-> TransformerConfig, and pure NumPy maps between its
tensors and the unscanned paxlite params tree.

GPT-2 is the one family whose layout shares nothing with LLaMA's beyond the checked tensor source
of `layouts`: its ``Conv1D`` weights are already [in, out] and are used as they are (no transpose,
no RoPE row order), q, k and v come fused in one ``c_attn``, and every projection and norm has a
bias. It is its own module so `layouts` stays the LLaMA/Mixtral map plus the shared tree helpers.
Names are accepted with and without HF's ``transformer.`` prefix and written with it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from paxlite.interop.errors import UnsupportedCheckpointError, refuse_if
from paxlite.interop.layouts import Dim, LayoutError, Params, TensorSource
from paxlite.models.transformer import (
    Activation,
    NormKind,
    PositionEmbedding,
    TransformerConfig,
)

_GPT2_BUFFERS = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")
_GPT2_PREFIX = "transformer."


# ---------------------------------------------------------------- config.json
# HF activation names -> paxlite; "gelu_new" and "gelu_pytorch_tanh" are both tanh-approximate GELU.
_GPT2_ACTIVATIONS: Mapping[str, Activation] = {
    "gelu_new": Activation.GELU_TANH,
    "gelu_pytorch_tanh": Activation.GELU_TANH,
    "gelu_fast": Activation.GELU_TANH,
    "gelu": Activation.GELU,
    "relu": Activation.RELU,
}


def _required(hf: Mapping[str, Any], key: str) -> Any:
    if key not in hf or hf[key] is None:
        raise UnsupportedCheckpointError(f"config.json has no {key!r}; it is required for "
                                         f"model_type={hf.get('model_type')!r}")
    return hf[key]


def gpt2_config(hf: Mapping[str, Any]) -> TransformerConfig:
    """The TransformerConfig of a GPT-2 ``config.json``."""
    act = hf.get("activation_function", "gelu_new")
    if act not in _GPT2_ACTIVATIONS:
        raise UnsupportedCheckpointError(
            f"config.json activation_function={act!r} is not supported; supported: "
            f"{sorted(_GPT2_ACTIVATIONS)}")
    refuse_if(not hf.get("scale_attn_weights", True), "scale_attn_weights",
               hf.get("scale_attn_weights"), "paxlite always scales attention by 1/sqrt(head_dim)")
    refuse_if(bool(hf.get("scale_attn_by_inverse_layer_idx", False)),
               "scale_attn_by_inverse_layer_idx", hf.get("scale_attn_by_inverse_layer_idx"),
               "paxlite does not scale attention per layer")
    refuse_if(bool(hf.get("add_cross_attention", False)), "add_cross_attention",
               hf.get("add_cross_attention"), "paxlite is decoder-only")
    refuse_if(not hf.get("tie_word_embeddings", True), "tie_word_embeddings",
               hf.get("tie_word_embeddings"), "GPT-2's output layer is the token embedding")
    dims = int(_required(hf, "n_embd"))
    heads = int(_required(hf, "n_head"))
    if dims % heads:
        raise UnsupportedCheckpointError(
            f"config.json n_embd={dims} is not a multiple of n_head={heads}")
    inner = hf.get("n_inner")
    return TransformerConfig(
        vocab_size=int(_required(hf, "vocab_size")),
        num_layers=int(_required(hf, "n_layer")),
        model_dims=dims,
        num_heads=heads,
        dims_per_head=dims // heads,
        hidden_dims=4 * dims if inner is None else int(inner),
        max_seq_len=int(_required(hf, "n_positions")),
        norm=NormKind.LAYER_NORM,
        norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
        activation=_GPT2_ACTIVATIONS[act],
        gated_mlp=False,
        use_bias=True,
        tie_embeddings=True,
        learned_position_embedding=True,
        position_embedding=PositionEmbedding.LEARNED,
    )


def gpt2_hf_config(config: TransformerConfig) -> dict[str, Any]:
    """The fields of the ``config.json`` transformers writes for this GPT-2 (hf_config adds the
    token ids, dtype and version)."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_embd": config.model_dims,
        "n_layer": config.num_layers,
        "n_head": config.num_heads,
        "n_inner": config.hidden_dims,
        "n_positions": config.max_seq_len,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": config.norm_epsilon,
        "tie_word_embeddings": True,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }


# ---------------------------------------------------------------- tensors
class _Renamed(Mapping):
    """``source`` under other names (new -> old), values read only on ``[]``."""

    def __init__(self, source: Mapping[str, np.ndarray], names: Mapping[str, str]) -> None:
        self._source, self._names = source, names

    def __getitem__(self, name: str) -> np.ndarray:
        return self._source[self._names[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _strip_gpt2_prefix(tensors: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """Accepts names with and without ``transformer.``; ``lm_head.weight`` keeps its name."""
    names: dict[str, str] = {}
    for name in tensors:
        short = name.removeprefix(_GPT2_PREFIX)
        if short in names:
            raise LayoutError(f"GPT-2 checkpoint holds {short} both with and without the "
                              f"'{_GPT2_PREFIX}' prefix")
        names[short] = name
    return _Renamed(tensors, names)


def gpt2_to_params(tensors: Mapping[str, np.ndarray], *, config: TransformerConfig) -> Params:
    """HF GPT-2 tensors (Conv1D [in, out], used as they are) -> unscanned paxlite params."""
    return dict(iter_gpt2_params(tensors, config=config))


def iter_gpt2_params(tensors: Mapping[str, np.ndarray], *, config: TransformerConfig
                     ) -> Iterator[tuple[str, Params]]:
    """`gpt2_to_params` one top-level subtree at a time (see `iter_llama_params`)."""
    src = TensorSource(_strip_gpt2_prefix(tensors), what="Hugging Face GPT-2 checkpoint",
                       ignore=lambda name: bool(_GPT2_BUFFERS.match(name)))
    n, h, dm, f = config.num_heads, config.dims_per_head, config.model_dims, config.hidden_dims
    vocab = Dim(f"vocab_size={config.vocab_size}", config.vocab_size)
    dims = Dim(f"n_embd={dm}", dm)
    qkv3 = Dim(f"3 * n_embd = 3 * {n * h} = {3 * n * h}", 3 * n * h)
    hidden = Dim(f"n_inner={f}", f)
    pos = Dim(f"n_positions={config.max_seq_len}", config.max_seq_len)

    def norm(name: str) -> dict[str, np.ndarray]:
        return {"scale": src.take(f"{name}.weight", (dims,)),
                "bias": src.take(f"{name}.bias", (dims,))}

    embedding = src.take("wte.weight", (vocab, dims))
    yield "embedding", {"embedding": embedding}
    yield "position_embedding", {"embedding": src.take("wpe.weight", (pos, dims))}
    for i in range(config.num_layers):
        p = f"h.{i}"
        c_attn = src.take(f"{p}.attn.c_attn.weight", (dims, qkv3))  # [D, 3*N*H]
        c_attn_b = src.take(f"{p}.attn.c_attn.bias", (qkv3,))
        c_proj = src.take(f"{p}.attn.c_proj.weight", (dims, dims))  # [N*H, D]
        yield f"layers_{i}", {
            "pre_attention_norm": norm(f"{p}.ln_1"),
            "attention": {
                "qkv": {"kernel": c_attn.reshape(dm, 3, n, h), "bias": c_attn_b.reshape(3, n, h)},
                "out": {"kernel": c_proj.reshape(n, h, dm),
                        "bias": src.take(f"{p}.attn.c_proj.bias", (dims,))},
            },
            "pre_mlp_norm": norm(f"{p}.ln_2"),
            "mlp": {
                "wi": {"kernel": src.take(f"{p}.mlp.c_fc.weight", (dims, hidden)),
                       "bias": src.take(f"{p}.mlp.c_fc.bias", (hidden,))},
                "wo": {"kernel": src.take(f"{p}.mlp.c_proj.weight", (hidden, dims)),
                       "bias": src.take(f"{p}.mlp.c_proj.bias", (dims,))},
            },
        }
    yield "final_norm", norm("ln_f")
    if src.has("lm_head.weight"):
        head = src.take("lm_head.weight", (vocab, dims))
        if not np.array_equal(head, embedding):
            raise LayoutError("Hugging Face GPT-2 checkpoint: lm_head.weight differs from "
                              "wte.weight, but GPT-2's output layer is tied to the token embedding")
    src.finish()


def gpt2_from_params(params: Params, *, config: TransformerConfig) -> dict[str, np.ndarray]:
    """Unscanned paxlite GPT params -> HF GPT-2 tensors (with the ``transformer.`` prefix)."""
    return {k: np.ascontiguousarray(v) for k, v in iter_gpt2_tensors(params, config=config)}


def iter_gpt2_tensors(params: Params, *, config: TransformerConfig
                      ) -> Iterator[tuple[str, np.ndarray]]:
    """`gpt2_from_params` one layer at a time."""
    n, h, dm = config.num_heads, config.dims_per_head, config.model_dims
    t = _GPT2_PREFIX
    yield f"{t}wte.weight", params["embedding"]["embedding"]
    yield f"{t}wpe.weight", params["position_embedding"]["embedding"]
    for i in range(config.num_layers):
        layer, p = params[f"layers_{i}"], f"{t}h.{i}"
        att, mlp = layer["attention"], layer["mlp"]
        yield from {
            f"{p}.ln_1.weight": layer["pre_attention_norm"]["scale"],
            f"{p}.ln_1.bias": layer["pre_attention_norm"]["bias"],
            f"{p}.attn.c_attn.weight": np.asarray(att["qkv"]["kernel"]).reshape(dm, 3 * n * h),
            f"{p}.attn.c_attn.bias": np.asarray(att["qkv"]["bias"]).reshape(3 * n * h),
            f"{p}.attn.c_proj.weight": np.asarray(att["out"]["kernel"]).reshape(n * h, dm),
            f"{p}.attn.c_proj.bias": att["out"]["bias"],
            f"{p}.ln_2.weight": layer["pre_mlp_norm"]["scale"],
            f"{p}.ln_2.bias": layer["pre_mlp_norm"]["bias"],
            f"{p}.mlp.c_fc.weight": mlp["wi"]["kernel"],
            f"{p}.mlp.c_fc.bias": mlp["wi"]["bias"],
            f"{p}.mlp.c_proj.weight": mlp["wo"]["kernel"],
            f"{p}.mlp.c_proj.bias": mlp["wo"]["bias"],
        }.items()
    yield f"{t}ln_f.weight", params["final_norm"]["scale"]
    yield f"{t}ln_f.bias", params["final_norm"]["bias"]
