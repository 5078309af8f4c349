"""paxlite <-> Transformer Engine parameter trees
(``python -m paxlite convert --from=paxlite --to=te``).

A TE model (``layer_implementation=TRANSFORMER_ENGINE``, models/te_layer.py) keeps paxlite's
embeddings, final norm and output, and has TE's ``TransformerLayer`` tree under each
``layers_<i>/transformer_layer`` (names and shapes as TE 2.x's Flax modules create them):

    paxlite layers_i/...                     TE layers_i/transformer_layer/...
    pre_attention_norm/scale, bias           attention/qkv/scale, ln_bias
                                             (GQA: attention/query/scale, ln_bias)
    attention/qkv/kernel [D, 3, N, H]        attention/qkv/kernel [D, 3, N*H]       (qkv_packed)
    attention/qkv/bias [3, N, H]             attention/qkv/bias [3, N*H]
    attention/query/kernel [D, N, H]         attention/query/kernel [D, N*H]        (kv_packed)
    attention/key|value/kernel [D, K, H]     attention/kv/kernel [D, 2, K*H]  (k, v)
    attention/out/kernel [N, H, D], bias     attention/out/kernel [N*H, D], bias [D]
    pre_mlp_norm/scale, bias                 mlp/scale, ln_bias
    mlp/wi/kernel [D, F] (+ wi_gate)         mlp/wi_kernel [D, A, F]  (A = 1; gated: gate, then wi)
    mlp/wi/bias [F] (+ wi_gate)              mlp/wi_bias [A, F]
    mlp/wo/kernel [F, D], bias [D]           mlp/wo_kernel [F, D], wo_bias [D]

LayerNorm scales are zero-centred in TE (Pax's ``zero_centered_gamma=True``): TE's scale is
paxlite's minus 1. Optimizer moments (Adam mu, nu) move the same way but without that shift (the
gradient of ``1 + gamma`` equals that of the scale). RMSNorm scales move unchanged.

The options are those of Pax's converter (NVIDIA/JAX-Toolbox te_pax_t5x_ckpt_converter). A paxlite
checkpoint records its model config, which already decides most of what they describe, so each
option given must agree with it (one clear error otherwise) and the missing ones default from it:
``--num-gqa-groups`` (= kv heads), ``--te-qkv-layout`` (qkv_packed without GQA, kv_packed with
it: TE's fused layouts), ``--skip-bias`` (the model has no biases), ``--use-gated-activations``
(a gated MLP), ``--pax-split-qkv`` (paxlite's q/k/v kernels are separate: GQA models).
``--weight-only`` drops the optimizer state (the converted checkpoint holds step and params).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from paxlite.interop import layouts
from paxlite.interop.errors import ConversionError
from paxlite.models.transformer_config import (
    LayerImplementation,
    NormKind,
    TransformerConfig,
)

Params = layouts.Params
TE_SUBTREE = "transformer_layer"  # TransformerEngineBlock's child holding TE's TransformerLayer


class QkvLayout(str, enum.Enum):
    """TE's fused projection layouts (Pax converter ``--te-qkv-layout``)."""

    QKV_PACKED = "qkv_packed"  # attention/qkv [D, 3, N*H]: TE's layout without GQA
    KV_PACKED = "kv_packed"  # attention/query [D, N*H] + attention/kv [D, 2, K*H]: with GQA


class Kind(str, enum.Enum):
    """What a tree holds: parameters, or optimizer moments shaped like them (no scale shift)."""

    PARAMS = "params"
    MOMENTS = "moments"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TeOptions:
    """Pax converter options; None / False means 'not given' (resolved from the model config)."""

    num_gqa_groups: int | None = None
    te_qkv_layout: QkvLayout | None = None
    weight_only: bool = False
    skip_bias: bool = False
    use_gated_activations: bool = False
    pax_split_qkv: bool = False


def _natural_layout(config: TransformerConfig) -> QkvLayout:
    return QkvLayout.QKV_PACKED if config.kv_heads == config.num_heads else QkvLayout.KV_PACKED


def resolve_options(config: TransformerConfig, options: TeOptions) -> QkvLayout:
    """The TE qkv layout for ``config``; every given option that contradicts the model is an
    error."""
    kv, n = config.kv_heads, config.num_heads
    gqa = kv != n
    if options.num_gqa_groups is not None and options.num_gqa_groups != kv:
        raise ConversionError(
            f"--num-gqa-groups={options.num_gqa_groups} but the model has {kv} key/value heads "
            f"(num_heads={n}); drop the option or pass --num-gqa-groups={kv}")
    natural = _natural_layout(config)
    if options.te_qkv_layout is not None and QkvLayout(options.te_qkv_layout) is not natural:
        why = ("TE packs q, k and v together when num_gqa_groups equals num_attention_heads"
               if not gqa else f"a GQA model ({kv} kv heads < {n} heads) has TE's kv_packed layout")
        raise ConversionError(
            f"--te-qkv-layout={QkvLayout(options.te_qkv_layout).value} does not fit this model: "
            f"{why}; use --te-qkv-layout={natural.value}")
    if options.skip_bias and config.use_bias:
        raise ConversionError(
            "--skip-bias but the model has biases (use_bias=True): dropping them would change what "
            "it computes; drop --skip-bias")
    if options.use_gated_activations and not config.gated_mlp:
        raise ConversionError(
            f"--use-gated-activations but the model's MLP is not gated (activation "
            f"{config.activation.value!r}, gated_mlp=False); drop the option")
    if options.pax_split_qkv and not gqa:
        raise ConversionError(
            "--pax-split-qkv but paxlite stores this model's q, k and v in one fused qkv kernel "
            "(num_kv_heads == num_heads); drop the option")
    return natural


def te_config(config: TransformerConfig) -> TransformerConfig:
    """The TE model of a paxlite config (same architecture; TE settings default)."""
    if config.layer_implementation is LayerImplementation.TRANSFORMER_ENGINE:
        raise ConversionError("the input is already a Transformer Engine model "
                              "(layer_implementation='transformer_engine'); use --from=te")
    out = dataclasses.replace(config, layer_implementation=LayerImplementation.TRANSFORMER_ENGINE,
                              te=None)
    return out  # __post_init__ refused what TE cannot build (ValueError)


def paxlite_config(config: TransformerConfig) -> TransformerConfig:
    if config.layer_implementation is not LayerImplementation.TRANSFORMER_ENGINE:
        raise ConversionError("the input is not a Transformer Engine model (its model config says "
                              "layer_implementation='paxlite'); use --from=paxlite")
    return dataclasses.replace(config, layer_implementation=LayerImplementation.PAXLITE, te=None)


# ------------------------------------------------------------------ one layer
def _scale_shift(config: TransformerConfig, kind: Kind) -> float:
    return 1.0 if config.norm is NormKind.LAYER_NORM and kind is Kind.PARAMS else 0.0


def _norm_to_te(norm: Params, config: TransformerConfig, kind: Kind) -> Params:
    out = {"scale": np.asarray(norm["scale"]) - _scale_shift(config, kind)}
    if config.norm is NormKind.LAYER_NORM:
        out["ln_bias"] = np.asarray(norm["bias"])
    return out


def _norm_from_te(te: Params, config: TransformerConfig, kind: Kind) -> Params:
    out = {"scale": np.asarray(te["scale"]) + _scale_shift(config, kind)}
    if config.norm is NormKind.LAYER_NORM:
        out["bias"] = np.asarray(te["ln_bias"])
    return out


def _dense(kernel: np.ndarray, bias: np.ndarray | None, *, kshape: tuple[int, ...],
           bshape: tuple[int, ...] | None) -> Params:
    out = {"kernel": np.asarray(kernel).reshape(kshape)}
    if bias is not None and bshape is not None:
        out["bias"] = np.asarray(bias).reshape(bshape)
    return out


def layer_to_te(layer: Params, *, config: TransformerConfig, kind: Kind = Kind.PARAMS) -> Params:
    """One paxlite Block's tree -> TE TransformerLayer's tree (module docstring)."""
    d, n, h, kv, f = (config.model_dims, config.num_heads, config.dims_per_head, config.kv_heads,
                      config.hidden_dims)
    bias = config.use_bias
    att = layer["attention"]
    attention: Params = {}
    ln = _norm_to_te(layer["pre_attention_norm"], config, kind)
    if _natural_layout(config) is QkvLayout.QKV_PACKED:
        qkv = att["qkv"]
        attention["qkv"] = {**ln, **_dense(qkv["kernel"], qkv.get("bias") if bias else None,
                                           kshape=(d, 3, n * h), bshape=(3, n * h))}
    else:
        q = att["query"]
        attention["query"] = {**ln, **_dense(q["kernel"], q.get("bias") if bias else None,
                                             kshape=(d, n * h), bshape=(n * h,))}
        k_kernel = np.asarray(att["key"]["kernel"]).reshape(d, kv * h)
        v_kernel = np.asarray(att["value"]["kernel"]).reshape(d, kv * h)
        attention["kv"] = {"kernel": np.stack([k_kernel, v_kernel], axis=1)}
        if bias:
            attention["kv"]["bias"] = np.stack([np.asarray(att["key"]["bias"]).reshape(kv * h),
                                                np.asarray(att["value"]["bias"]).reshape(kv * h)])
    out = att["out"]
    attention["out"] = _dense(out["kernel"], out.get("bias") if bias else None,
                              kshape=(n * h, d), bshape=(d,))
    mlp_in = layer["mlp"]
    wis = [mlp_in["wi_gate"], mlp_in["wi"]] if config.gated_mlp else [mlp_in["wi"]]
    mlp: Params = {
        **_norm_to_te(layer["pre_mlp_norm"], config, kind),
        "wi_kernel": np.stack([np.asarray(w["kernel"]).reshape(d, f) for w in wis], axis=1),
        "wo_kernel": np.asarray(mlp_in["wo"]["kernel"]).reshape(f, d),
    }
    if bias:
        mlp["wi_bias"] = np.stack([np.asarray(w["bias"]).reshape(f) for w in wis])
        mlp["wo_bias"] = np.asarray(mlp_in["wo"]["bias"]).reshape(d)
    return {TE_SUBTREE: {"attention": attention, "mlp": mlp}}


def layer_from_te(layer: Params, *, config: TransformerConfig, kind: Kind = Kind.PARAMS) -> Params:
    """Inverse of `layer_to_te`."""
    d, n, h, kv, f = (config.model_dims, config.num_heads, config.dims_per_head, config.kv_heads,
                      config.hidden_dims)
    bias = config.use_bias
    te = layer[TE_SUBTREE]
    att = te["attention"]
    attention: Params = {}
    if _natural_layout(config) is QkvLayout.QKV_PACKED:
        qkv = att["qkv"]
        norm = _norm_from_te(qkv, config, kind)
        attention["qkv"] = _dense(qkv["kernel"], qkv.get("bias") if bias else None,
                                  kshape=(d, 3, n, h), bshape=(3, n, h))
    else:
        q = att["query"]
        norm = _norm_from_te(q, config, kind)
        attention["query"] = _dense(q["kernel"], q.get("bias") if bias else None,
                                    kshape=(d, n, h), bshape=(n, h))
        kv_kernel = np.asarray(att["kv"]["kernel"])  # [D, 2, K*H]
        kv_bias = np.asarray(att["kv"]["bias"]) if bias else None  # [2, K*H]
        for j, name in enumerate(("key", "value")):
            attention[name] = _dense(kv_kernel[:, j], None if kv_bias is None else kv_bias[j],
                                     kshape=(d, kv, h), bshape=(kv, h))
    attention["out"] = _dense(att["out"]["kernel"], att["out"].get("bias") if bias else None,
                              kshape=(n, h, d), bshape=(d,))
    m = te["mlp"]
    wi_kernel = np.asarray(m["wi_kernel"])  # [D, A, F]
    wi_bias = np.asarray(m["wi_bias"]) if bias else None  # [A, F]
    names = ("wi_gate", "wi") if config.gated_mlp else ("wi",)
    mlp: Params = {}
    for j, name in enumerate(names):
        mlp[name] = _dense(wi_kernel[:, j], None if wi_bias is None else wi_bias[j],
                           kshape=(d, f), bshape=(f,))
    mlp["wo"] = _dense(m["wo_kernel"], m.get("wo_bias") if bias else None, kshape=(f, d),
                       bshape=(d,))
    return {"pre_attention_norm": norm, "attention": attention,
            "pre_mlp_norm": _norm_from_te(m, config, kind), "mlp": mlp}


# ------------------------------------------------------------------ whole trees
def te_param_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """'/'-joined path -> shape of one TE layer's tree (``transformer_layer/...``), as TE 2.x's
    TransformerLayer creates it for ``config`` (checked against TE itself on a GPU)."""
    d, n, h, kv, f = (config.model_dims, config.num_heads, config.dims_per_head, config.kv_heads,
                      config.hidden_dims)
    a = 2 if config.gated_mlp else 1
    p = f"{TE_SUBTREE}/attention"
    ln = config.norm is NormKind.LAYER_NORM
    shapes: dict[str, tuple[int, ...]] = {}
    if _natural_layout(config) is QkvLayout.QKV_PACKED:
        proj = {f"{p}/qkv/kernel": (d, 3, n * h), f"{p}/qkv/bias": (3, n * h)}
        norm_at = f"{p}/qkv"
    else:
        proj = {f"{p}/query/kernel": (d, n * h), f"{p}/query/bias": (n * h,),
                f"{p}/kv/kernel": (d, 2, kv * h), f"{p}/kv/bias": (2, kv * h)}
        norm_at = f"{p}/query"
    m = f"{TE_SUBTREE}/mlp"
    shapes.update({f"{norm_at}/scale": (d,), f"{m}/scale": (d,)})
    if ln:
        shapes.update({f"{norm_at}/ln_bias": (d,), f"{m}/ln_bias": (d,)})
    shapes.update(proj)
    shapes.update({f"{p}/out/kernel": (n * h, d), f"{p}/out/bias": (d,),
                   f"{m}/wi_kernel": (d, a, f), f"{m}/wi_bias": (a, f), f"{m}/wo_kernel": (f, d),
                   f"{m}/wo_bias": (d,)})
    if not config.use_bias:
        shapes = {
            k: v for k, v in shapes.items() if not k.endswith(("/bias", "wi_bias", "wo_bias"))
        }
    return shapes


def _layer_keys(tree: Mapping[str, Any], config: TransformerConfig) -> list[str]:
    if config.scan_layers:
        return ["layers"]
    return [f"layers_{i}" for i in range(config.num_layers)]


def _map_layers(tree: Params, *, config: TransformerConfig, kind: Kind,
                fn: Callable[..., Params]) -> Params:
    """Applies ``fn`` to every layer of a params-shaped tree (stacked ones are unstacked first)."""
    missing = [k for k in _layer_keys(tree, config) if k not in tree]
    if missing:
        raise layouts.LayoutError(
            f"the tree has no {', '.join(missing[:3])} (keys: {sorted(tree)[:8]}): not this "
            "model's parameters")
    flat = layouts.unstack_layers(tree, num_layers=config.num_layers) if config.scan_layers \
        else dict(tree)
    unscanned = dataclasses.replace(config, scan_layers=False)
    out = dict(flat)
    for i in range(config.num_layers):
        out[f"layers_{i}"] = fn(flat[f"layers_{i}"], config=unscanned, kind=kind)
    if config.scan_layers:
        out = layouts.stack_layers(out, num_layers=config.num_layers)
    return out


def params_to_te(params: Params, *, config: TransformerConfig, kind: Kind = Kind.PARAMS) -> Params:
    """A paxlite model's params (or moments shaped like them) -> the TE model's."""
    return _map_layers(params, config=config, kind=kind, fn=layer_to_te)


def params_from_te(params: Params, *, config: TransformerConfig, kind: Kind = Kind.PARAMS
                   ) -> Params:
    """A TE model's params (or moments) -> the paxlite model's; ``config`` is either model's."""
    return _map_layers(params, config=config, kind=kind, fn=layer_from_te)


def _is_params_shaped(node: Any, params: Mapping[str, Any]) -> bool:
    return isinstance(node, Mapping) and set(node) == set(params)


def _map_moments(node: Any, params: Mapping[str, Any], fn: Callable[[Params], Params]) -> Any:
    """Every subtree of an optimizer state with the params' top-level keys (Adam's mu, nu) mapped;
    counts, empty stages and the schedule count copied."""
    if _is_params_shaped(node, params):
        return fn(node)
    if isinstance(node, Mapping):
        return {k: _map_moments(v, params, fn) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_map_moments(v, params, fn) for v in node)
    return node


def convert_state(state: Mapping[str, Any], *, config: TransformerConfig, to_te: bool,
                  options: TeOptions = TeOptions()) -> dict[str, Any]:
    """A saved train state {'step', 'params', 'opt_state'?} converted; ``config`` is the input's.

    ``options.weight_only`` drops ``opt_state``; every other entry is copied.
    """
    resolve_options(config, options)
    if "params" not in state:
        raise layouts.LayoutError(f"the checkpoint state has no 'params' (keys: {sorted(state)})")
    convert = params_to_te if to_te else params_from_te
    params = state["params"]
    out: dict[str, Any] = {k: v for k, v in state.items() if k not in ("params", "opt_state")}
    out["params"] = convert(params, config=config, kind=Kind.PARAMS)
    if "opt_state" in state and not options.weight_only:
        out["opt_state"] = _map_moments(
            state["opt_state"], params, lambda t: convert(t, config=config, kind=Kind.MOMENTS))
    return out
