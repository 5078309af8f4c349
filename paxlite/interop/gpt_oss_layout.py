"""gpt-oss's tensors <-> the paxlite params tree (unscanned), and its MXFP4 expert weights.

The names are transformers 5.24's GptOssForCausalLM parameters, which ``save_pretrained`` writes
unchanged (torch Linear weights [out, in]; the experts as whole-layer tensors, [in, out]):

==============================================  ==========================  =====================
HF tensor (layer i)                             shape                       paxlite (layers_i/)
==============================================  ==========================  =====================
self_attn.{q,k,v}_proj.weight / .bias           [N*H or K*H, D] / [..]      attention/query ...
self_attn.o_proj.weight / .bias                 [D, N*H] / [D]              attention/out
self_attn.sinks                                 [N]                         attention/sinks
mlp.router.weight / .bias                       [E, D] / [E]                moe/router
mlp.experts.gate_up_proj / _bias                [E, D, 2F] / [E, 2F]        moe/wi_gate, moe/wi
mlp.experts.down_proj / _bias                   [E, F, D] / [E, D]          moe/wo
input_layernorm / post_attention_layernorm      [D]                         pre_attention_norm,
                                                                            pre_mlp_norm
==============================================  ==========================  =====================

plus ``model.embed_tokens``, ``model.norm`` and ``lm_head``. gate and up are *interleaved* along
the last axis of ``gate_up_proj`` (gate = ``[..., ::2]``, up = ``[..., 1::2]``), as its forward
reads them; q and k rows (and biases) are permuted from rotate-half to paxlite's interleaved pairs
as for LLaMA (layouts.py). The writer writes the float tensors (never MXFP4).

MXFP4 (the published checkpoints): ``gate_up_proj_blocks`` [E, 2F, D/32, 16] and
``gate_up_proj_scales`` [E, 2F, D/32] (``down_proj_*``: [E, D, F/32, 16], [E, D, F/32]) in place of
the float tensor: each byte packs two FP4 E2M1 codes (low nibble first), each group of 32 values
shares one scale ``2^(s - 127)``; the dequantised [E, out, in] matrix is transposed to the
[E, in, out] of the float tensor, as transformers' ``convert_moe_packed_tensors`` does. The values
are exact in bfloat16, which they are returned in (transformers' dtype for them).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from paxlite.interop.layouts import (
    Dim,
    Params,
    TensorSource,
    interleaved_to_rotate_half,
    rotate_half_to_interleaved,
)
from paxlite.models.transformer_config import TransformerConfig

WHAT = "Hugging Face gpt-oss checkpoint"
EMBED, FINAL_NORM, OUTPUT = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
LAYER = "model.layers.{i}."
# the FP4 E2M1 code -> value table (sign bit 8)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
SCALE_BIAS = 127
VALUES_PER_BLOCK = 32


def _stand_in(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape, (0,) * len(shape))


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [E, R, G, 16] and scales uint8 [E, R, G] -> bfloat16 [E, G*32, R] (module
    docstring); zero-stride stand-ins give a stand-in of the result (no memory)."""
    import ml_dtypes

    if blocks.shape[:-1] != scales.shape or blocks.ndim != 4:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} must be "
                         "[E, rows, groups, 16] and [E, rows, groups]")
    experts, rows, groups, width = blocks.shape
    shape = (experts, groups * 2 * width, rows)
    if not any(blocks.strides):  # a stand-in: the layout is being walked, not read
        return _stand_in(shape, np.dtype(ml_dtypes.bfloat16))
    out = np.empty((experts, groups * 2 * width, rows), ml_dtypes.bfloat16)
    exponents = scales.astype(np.int32) - SCALE_BIAS  # [E, R, G]
    for e in range(experts):  # one expert at a time: float32 temporaries of one matrix
        codes = np.asarray(blocks[e], np.uint8)  # [R, G, 16]
        values = np.empty((rows, groups, 2 * width), np.float32)
        values[..., 0::2] = FP4_VALUES[codes & 0x0F]
        values[..., 1::2] = FP4_VALUES[codes >> 4]
        values = np.ldexp(values, exponents[e][..., None])  # [R, G, 32]
        out[e] = values.reshape(rows, groups * 2 * width).T.astype(ml_dtypes.bfloat16)
    return out


def _expert_matrix(src: TensorSource, name: str, dims: tuple[Dim, Dim, Dim]) -> np.ndarray:
    """The float [E, in, out] tensor ``name``, or its MXFP4 ``_blocks`` / ``_scales``."""
    if not src.has(name + "_blocks"):
        return src.take(name, dims)
    e, fan_in, fan_out = dims
    groups = Dim(f"{fan_in.expr} / {VALUES_PER_BLOCK}", fan_in.size // VALUES_PER_BLOCK)
    if fan_in.size % VALUES_PER_BLOCK:
        raise ValueError(f"{WHAT}: {name}_blocks: {fan_in.expr} is not a multiple of "
                         f"{VALUES_PER_BLOCK}, MXFP4's block")
    blocks = src.take(name + "_blocks", (e, fan_out, groups, Dim("16 bytes", 16)))
    scales = src.take(name + "_scales", (e, fan_out, groups))
    return dequantize_mxfp4(blocks, scales)


def _dims(config: TransformerConfig) -> dict[str, Dim]:
    moe = config.moe
    assert moe is not None
    h, n, kv = config.dims_per_head, config.num_heads, config.kv_heads
    f = moe.expert_hidden_dims or config.hidden_dims
    return {
        "vocab": Dim(f"vocab_size={config.vocab_size}", config.vocab_size),
        "dims": Dim(f"hidden_size={config.model_dims}", config.model_dims),
        "q": Dim(f"num_attention_heads * head_dim = {n} * {h} = {n * h}", n * h),
        "kv": Dim(f"num_key_value_heads * head_dim = {kv} * {h} = {kv * h}", kv * h),
        "heads": Dim(f"num_attention_heads={n}", n),
        "experts": Dim(f"num_local_experts={moe.num_experts}", moe.num_experts),
        "hidden": Dim(f"intermediate_size={f}", f),
        "hidden2": Dim(f"2 * intermediate_size = {2 * f}", 2 * f),
    }


def _attention(src: TensorSource, *, i: int, config: TransformerConfig,
               d: Mapping[str, Dim]) -> Params:
    n, kv, h, dm = config.num_heads, config.kv_heads, config.dims_per_head, config.model_dims
    at = LAYER.format(i=i) + "self_attn."
    kernels, biases = [], []
    for p, heads, dim in (("q", n, d["q"]), ("k", kv, d["kv"]), ("v", kv, d["kv"])):
        weight = src.take(f"{at}{p}_proj.weight", (dim, d["dims"]))  # [heads*H, D]
        bias = src.take(f"{at}{p}_proj.bias", (dim,)) if config.uses_qkv_bias else None
        if p != "v":
            weight = rotate_half_to_interleaved(weight, heads=heads, head_dim=h)
            if bias is not None:
                bias = rotate_half_to_interleaved(bias, heads=heads, head_dim=h)
        kernels.append(weight.T.reshape(dm, heads, h))
        biases.append(None if bias is None else bias.reshape(heads, h))
    if kv == n:
        attention: Params = {"qkv": {"kernel": np.stack(kernels, axis=1)}}  # [D, 3, N, H]
        if config.uses_qkv_bias:
            attention["qkv"]["bias"] = np.stack(biases)  # [3, N, H]
    else:
        attention = {}
        for name, kernel, bias in zip(("query", "key", "value"), kernels, biases, strict=True):
            attention[name] = {"kernel": kernel} if bias is None else {"kernel": kernel,
                                                                       "bias": bias}
    out = src.take(f"{at}o_proj.weight", (d["dims"], d["q"]))  # [D, N*H]
    attention["out"] = {"kernel": out.T.reshape(n, h, dm)}
    if config.use_bias if config.out_bias is None else config.out_bias:
        attention["out"]["bias"] = src.take(f"{at}o_proj.bias", (d["dims"],))
    attention["sinks"] = src.take(f"{at}sinks", (d["heads"],))
    return attention


def _experts(src: TensorSource, *, i: int, d: Mapping[str, Dim]) -> Params:
    mlp = LAYER.format(i=i) + "mlp."
    e = d["experts"]
    gate_up = _expert_matrix(src, f"{mlp}experts.gate_up_proj", (e, d["dims"], d["hidden2"]))
    gate_up_bias = src.take(f"{mlp}experts.gate_up_proj_bias", (e, d["hidden2"]))
    down = _expert_matrix(src, f"{mlp}experts.down_proj", (e, d["hidden"], d["dims"]))
    return {
        "router": {"kernel": src.take(f"{mlp}router.weight", (e, d["dims"])).T,
                   "bias": src.take(f"{mlp}router.bias", (e,))},
        "wi_gate": {"kernel": gate_up[..., 0::2], "bias": gate_up_bias[..., 0::2]},
        "wi": {"kernel": gate_up[..., 1::2], "bias": gate_up_bias[..., 1::2]},
        "wo": {"kernel": down, "bias": src.take(f"{mlp}experts.down_proj_bias",
                                                (e, d["dims"]))},
    }


def iter_gpt_oss_params(tensors: Mapping[str, np.ndarray], *, config: TransformerConfig
                        ) -> Iterator[tuple[str, Params]]:
    """HF gpt-oss tensors -> unscanned paxlite params, one top-level subtree at a time (as
    layouts.iter_llama_params: ``tensors`` may read lazily; the missing / left-over check runs
    after the last subtree)."""
    src = TensorSource(tensors, what=WHAT)
    d = _dims(config)
    embedding = src.take(EMBED, (d["vocab"], d["dims"]))
    yield "embedding", {"embedding": embedding}
    for i in range(config.num_layers):
        at = LAYER.format(i=i)
        yield f"layers_{i}", {
            "pre_attention_norm": {"scale": src.take(at + "input_layernorm.weight",
                                                     (d["dims"],))},
            "attention": _attention(src, i=i, config=config, d=d),
            "pre_mlp_norm": {"scale": src.take(at + "post_attention_layernorm.weight",
                                               (d["dims"],))},
            "moe": _experts(src, i=i, d=d),
        }
    yield "final_norm", {"scale": src.take(FINAL_NORM, (d["dims"],))}
    if not config.tie_embeddings:
        yield "output", {"kernel": src.take(OUTPUT, (d["vocab"], d["dims"])).T}  # [D, V]
    elif src.has(OUTPUT):
        head = src.take(OUTPUT, (d["vocab"], d["dims"]))
        if not np.array_equal(head, embedding):
            raise ValueError(f"{WHAT}: tie_word_embeddings is true but {OUTPUT} differs from "
                             f"{EMBED}")
    src.finish()


def gpt_oss_to_params(tensors: Mapping[str, np.ndarray], *, config: TransformerConfig) -> Params:
    return dict(iter_gpt_oss_params(tensors, config=config))


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gate, up [..., F] -> [..., 2F] with gate at the even and up at the odd positions (a
    stand-in for stand-ins: the writer lays out its files from them before reading anything)."""
    shape = (*np.shape(gate)[:-1], 2 * np.shape(gate)[-1])
    if isinstance(gate, np.ndarray) and gate.ndim and not any(gate.strides):
        return _stand_in(shape, gate.dtype)
    return np.stack([np.asarray(gate), np.asarray(up)], axis=-1).reshape(
        *np.shape(gate)[:-1], 2 * np.shape(gate)[-1])


def iter_gpt_oss_tensors(params: Params, *, config: TransformerConfig
                         ) -> Iterator[tuple[str, np.ndarray]]:
    """Inverse of `iter_gpt_oss_params` (float tensors), one tensor at a time."""
    n, kv, h, dm = config.num_heads, config.kv_heads, config.dims_per_head, config.model_dims
    yield EMBED, params["embedding"]["embedding"]
    for i in range(config.num_layers):
        layer, at = params[f"layers_{i}"], LAYER.format(i=i) + "self_attn."
        att = layer["attention"]
        if "qkv" in att:
            fused = att["qkv"]
            parts = [{"kernel": np.asarray(fused["kernel"])[:, j],
                      **({"bias": np.asarray(fused["bias"])[j]} if "bias" in fused else {})}
                     for j in range(3)]
        else:
            parts = [att[name] for name in ("query", "key", "value")]
        for p, heads, part in zip("qkv", (n, kv, kv), parts, strict=True):
            weight = np.asarray(part["kernel"]).reshape(dm, heads * h).T
            bias = None if "bias" not in part else np.asarray(part["bias"]).reshape(heads * h)
            if p != "v":
                weight = interleaved_to_rotate_half(weight, heads=heads, head_dim=h)
                bias = None if bias is None else interleaved_to_rotate_half(
                    bias, heads=heads, head_dim=h)
            yield f"{at}{p}_proj.weight", weight
            if bias is not None:
                yield f"{at}{p}_proj.bias", bias
        yield f"{at}o_proj.weight", np.asarray(att["out"]["kernel"]).reshape(n * h, dm).T
        if "bias" in att["out"]:
            yield f"{at}o_proj.bias", att["out"]["bias"]
        yield f"{at}sinks", att["sinks"]
        moe, mlp = layer["moe"], LAYER.format(i=i) + "mlp."
        yield f"{mlp}router.weight", np.asarray(moe["router"]["kernel"]).T
        yield f"{mlp}router.bias", moe["router"]["bias"]
        yield f"{mlp}experts.gate_up_proj", _interleave(moe["wi_gate"]["kernel"],
                                                        moe["wi"]["kernel"])
        yield f"{mlp}experts.gate_up_proj_bias", _interleave(moe["wi_gate"]["bias"],
                                                             moe["wi"]["bias"])
        yield f"{mlp}experts.down_proj", moe["wo"]["kernel"]
        yield f"{mlp}experts.down_proj_bias", moe["wo"]["bias"]
        yield LAYER.format(i=i) + "input_layernorm.weight", layer["pre_attention_norm"]["scale"]
        yield LAYER.format(i=i) + "post_attention_layernorm.weight", layer["pre_mlp_norm"]["scale"]
    yield FINAL_NORM, params["final_norm"]["scale"]
    if not config.tie_embeddings:
        yield OUTPUT, np.asarray(params["output"]["kernel"]).T
