"""Pure NumPy maps between checkpoint tensors (HF / Meta names) and the paxlite params tree.

The paxlite tree here is the *unscanned* one (``layers_0``, ``layers_1``, ...; see
``stack_layers`` for the ``scan_layers=True`` form). Every source tensor is consumed exactly once:
a leftover or a missing tensor, or a shape that does not follow from the config, is an error that
names the tensor and the config field, so a checkpoint never half-loads.

LLaMA-family tensors are torch ``Linear`` weights, [out, in]: they are transposed into paxlite's
[in, ...out] kernels. HF stores q and k rows per head in the *rotate-half* order, paxlite (like Meta
and Pax) rotates *interleaved* pairs, so HF q/k rows are permuted on the way in
(``meta_row[2j + p] = hf_row[p * h/2 + j]``) and back on the way out; Meta rows are used as they
are. The q/k biases (Qwen2) and the q/k norm weights (Qwen3) are indexed by the same head dims and
take the same permutation. GPT-2's layout is in `gpt2_layout`, which shares this module's checked
`TensorSource`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from paxlite.errors import UserError
from paxlite.interop.hf_moe import (
    FUSED_DOWN,
    FUSED_GATE_UP,
    FUSED_ROUTER,
    ExpertNaming,
    expert_naming,
)
from paxlite.models.transformer import TransformerConfig

Params = dict[str, Any]  # nested dicts of np.ndarray, the structure of variables["params"]


class LayoutError(UserError, ValueError):
    """Tensors that do not fit the layout: missing, left over, or of the wrong shape."""


@dataclasses.dataclass(frozen=True)
class Dim:
    """One expected dimension and how the config gives it, e.g.
    ``Dim("num_attention_heads * head_dim = 4 * 16 = 64", 64)``; names the field a tensor defies."""

    expr: str
    size: int


_AXIS_WORDS = ("rows", "columns", "entries along axis 2", "entries along axis 3")


def _some(names: list[str], limit: int = 20) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


class TensorSource:
    """Hands out each named tensor once and checks its shape against the config."""

    def __init__(self, tensors: Mapping[str, np.ndarray], *, what: str,
                 ignore: Callable[[str], bool] = lambda name: False) -> None:
        # Names only: ``tensors`` may read lazily (streaming conversion), so values are fetched on
        # take.
        self._tensors = tensors
        self._names = {k for k in tensors if not ignore(k)}
        self._used: set[str] = set()
        self._missing: list[str] = []
        self._what = what

    def take(self, name: str, dims: tuple[Dim, ...]) -> np.ndarray:
        expected = tuple(d.size for d in dims)
        if name in self._used:
            raise LayoutError(f"{self._what}: tensor {name} was read twice (a converter bug)")
        if name not in self._names:
            self._missing.append(name)
            return np.zeros(expected, np.float32)
        self._used.add(name)
        array = self._tensors[name]
        shape = tuple(array.shape)
        if shape != expected:
            if len(shape) != len(expected):
                raise LayoutError(
                    f"{self._what}: {name} has shape {shape}, expected rank {len(expected)} "
                    f"[{', '.join(d.expr for d in dims)}] = {expected}")
            bad = [f"{name} has {have} {_AXIS_WORDS[axis] if len(shape) > 1 else 'entries'} "
                   f"but {d.expr}" for axis, (have, d) in enumerate(zip(shape, dims))
                   if have != d.size]
            raise LayoutError(f"{self._what}: " + "; ".join(bad)
                              + f" (shape {shape}, expected {expected})")
        return array

    def has(self, name: str) -> bool:
        return name in self._names

    def finish(self) -> None:
        """Raises if any tensor was missing or was never consumed."""
        leftover = sorted(self._names - self._used)
        problems = []
        if self._missing:
            problems.append(f"missing tensors: {_some(self._missing)}")
        if leftover:
            problems.append(f"unexpected tensors (not part of this model): {_some(leftover)}")
        if problems:
            raise LayoutError(f"{self._what}: " + "; ".join(problems))


# ---------------------------------------------------------------- RoPE row order
def rotate_half_to_interleaved(w: np.ndarray, *, heads: int, head_dim: int) -> np.ndarray:
    """Rows of an HF q/k weight [heads*h, in] -> Meta/paxlite order: out[2j + p] = w[p*h/2 + j]."""
    rest = w.shape[1:]
    return w.reshape(heads, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def interleaved_to_rotate_half(w: np.ndarray, *, heads: int, head_dim: int) -> np.ndarray:
    """Inverse of rotate_half_to_interleaved (the row order HF's Meta converter writes)."""
    rest = w.shape[1:]
    return w.reshape(heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------- LLaMA
@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaNaming:
    """Tensor names and config field names of one LLaMA checkpoint flavour (HF or Meta)."""

    what: str
    embed: str
    q: str
    k: str
    v: str
    o: str
    gate: str
    up: str
    down: str
    attn_norm: str
    mlp_norm: str
    final_norm: str
    output: str
    rotate_half: bool  # HF q/k row order; Meta's is interleaved like paxlite's
    vocab: str
    dims: str
    heads: str
    kv_heads: str
    head_dim: str
    hidden: str
    ignore: Callable[[str], bool] = lambda name: False
    # Gemma's norms after attention and after the MLP (read when the config has post_norms)
    post_attn_norm: str | None = None
    post_mlp_norm: str | None = None


_HF_LLAMA_BUFFERS = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")

HF_LLAMA = LlamaNaming(
    what="Hugging Face LLaMA checkpoint",
    embed="model.embed_tokens.weight",
    q="model.layers.{i}.self_attn.q_proj.weight",
    k="model.layers.{i}.self_attn.k_proj.weight",
    v="model.layers.{i}.self_attn.v_proj.weight",
    o="model.layers.{i}.self_attn.o_proj.weight",
    gate="model.layers.{i}.mlp.gate_proj.weight",
    up="model.layers.{i}.mlp.up_proj.weight",
    down="model.layers.{i}.mlp.down_proj.weight",
    attn_norm="model.layers.{i}.input_layernorm.weight",
    mlp_norm="model.layers.{i}.post_attention_layernorm.weight",
    final_norm="model.norm.weight",
    output="lm_head.weight",
    rotate_half=True,
    vocab="vocab_size",
    dims="hidden_size",
    heads="num_attention_heads",
    kv_heads="num_key_value_heads",
    head_dim="head_dim",
    hidden="intermediate_size",
    ignore=lambda name: bool(_HF_LLAMA_BUFFERS.match(name)),
)


def hf_decoder_shape(config: TransformerConfig) -> dict[str, int]:
    """The shape fields of a Hugging Face decoder's config.json, under the names LLaMA's config
    gave them and Mistral's, Qwen's and Gemma's kept."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.model_dims,
        "intermediate_size": config.hidden_dims,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.dims_per_head,
    }


def _llama_dims(c: TransformerConfig, n: LlamaNaming) -> dict[str, Dim]:
    h, heads, kv = c.dims_per_head, c.num_heads, c.kv_heads
    return {
        "vocab": Dim(f"{n.vocab}={c.vocab_size}", c.vocab_size),
        "dims": Dim(f"{n.dims}={c.model_dims}", c.model_dims),
        "q": Dim(f"{n.heads} * {n.head_dim} = {heads} * {h} = {heads * h}", heads * h),
        "kv": Dim(f"{n.kv_heads} * {n.head_dim} = {kv} * {h} = {kv * h}", kv * h),
        "hidden": Dim(f"{n.hidden}={c.hidden_dims}", c.hidden_dims),
    }


# The tensors of the families built on LLaMA's layout: Qwen2's q/k/v biases, Qwen3's q/k norms.
HF_QKV_BIAS = "model.layers.{i}.self_attn.{p}_proj.bias"  # p: q [N*H], k, v [K*H]
HF_QK_NORM = "model.layers.{i}.self_attn.{p}_norm.weight"  # p: q, k; [H]
_KERNELS = ("query", "key", "value")


def _open_family_params(src: TensorSource, attention: Params, *, i: int,
                        config: TransformerConfig, dims: dict[str, Dim], rotate_half: bool
                        ) -> None:
    """Adds layer i's q/k/v biases and q/k norm scales (when the config has them) to its
    ``attention`` params, q and k in paxlite's interleaved order."""
    n, kv, h = config.num_heads, config.kv_heads, config.dims_per_head
    if config.uses_qkv_bias:
        biases = []
        for p, heads, dim in (("q", n, dims["q"]), ("k", kv, dims["kv"]), ("v", kv, dims["kv"])):
            bias = src.take(HF_QKV_BIAS.format(i=i, p=p), (dim,))
            if rotate_half and p != "v":
                bias = rotate_half_to_interleaved(bias, heads=heads, head_dim=h)
            biases.append(bias.reshape(heads, h))  # [N or K, H]
        if kv == n:
            attention["qkv"]["bias"] = np.stack(biases)  # [3, N, H]
        else:
            for name, bias in zip(_KERNELS, biases, strict=True):
                attention[name]["bias"] = bias
    if config.qk_norm:
        head = Dim(f"head_dim={h}", h)
        for p, name in (("q", "query_norm"), ("k", "key_norm")):
            scale = src.take(HF_QK_NORM.format(i=i, p=p), (head,))
            if rotate_half:
                scale = rotate_half_to_interleaved(scale, heads=1, head_dim=h)
            attention[name] = {"scale": scale}


def _open_family_tensors(attention: Params, *, i: int, config: TransformerConfig
                         ) -> Iterator[tuple[str, np.ndarray]]:
    """Inverse of `_open_family_params`: HF's bias and norm tensors of layer i."""
    n, kv, h = config.num_heads, config.kv_heads, config.dims_per_head
    if config.uses_qkv_bias:
        if "qkv" in attention:
            fused = np.asarray(attention["qkv"]["bias"])  # [3, N, H]
            biases = [fused[0], fused[1], fused[2]]
        else:
            biases = [np.asarray(attention[name]["bias"]) for name in _KERNELS]
        for p, heads, bias in zip("qkv", (n, kv, kv), biases, strict=True):
            flat = bias.reshape(heads * h)
            if p != "v":
                flat = interleaved_to_rotate_half(flat, heads=heads, head_dim=h)
            yield HF_QKV_BIAS.format(i=i, p=p), flat
    if config.qk_norm:
        for p, name in (("q", "query_norm"), ("k", "key_norm")):
            yield HF_QK_NORM.format(i=i, p=p), interleaved_to_rotate_half(
                np.asarray(attention[name]["scale"]), heads=1, head_dim=h)


def llama_to_params(tensors: Mapping[str, np.ndarray], *, config: TransformerConfig,
                    naming: LlamaNaming = HF_LLAMA) -> Params:
    """HF (or Meta, with its naming) LLaMA tensors -> unscanned paxlite params."""
    return dict(iter_llama_params(tensors, config=config, naming=naming))


def iter_llama_params(tensors: Mapping[str, np.ndarray], *, config: TransformerConfig,
                      naming: LlamaNaming = HF_LLAMA) -> Iterator[tuple[str, Params]]:
    """`llama_to_params` one top-level subtree (embedding, one layer, ...) at a time, so that a
    streaming writer holds one layer; ``tensors`` may be a lazy mapping (read on ``[]``). The
    missing / left-over check runs after the last subtree (`TensorSource.finish`)."""
    if config.moe is not None and naming is not HF_LLAMA:
        raise LayoutError(f"{naming.what}: mixture-of-experts layers are read from Hugging Face "
                          "checkpoints only")
    experts = None if config.moe is None else expert_naming(config)
    src = TensorSource(tensors, what=naming.what if experts is None else experts.what,
                       ignore=naming.ignore)
    d = _llama_dims(config, naming)
    n, kv, h, dm = config.num_heads, config.kv_heads, config.dims_per_head, config.model_dims
    embedding = src.take(naming.embed, (d["vocab"], d["dims"]))
    yield "embedding", {"embedding": embedding}
    for i in range(config.num_layers):
        q = src.take(naming.q.format(i=i), (d["q"], d["dims"]))  # [N*H, D]
        k = src.take(naming.k.format(i=i), (d["kv"], d["dims"]))  # [K*H, D]
        v = src.take(naming.v.format(i=i), (d["kv"], d["dims"]))
        o = src.take(naming.o.format(i=i), (d["dims"], d["q"]))  # [D, N*H]
        if naming.rotate_half:
            q = rotate_half_to_interleaved(q, heads=n, head_dim=h)
            k = rotate_half_to_interleaved(k, heads=kv, head_dim=h)
        q_k = q.T.reshape(dm, n, h)  # [D, N, H]
        k_k = k.T.reshape(dm, kv, h)  # [D, K, H]
        v_k = v.T.reshape(dm, kv, h)
        if kv == n:
            attention = {"qkv": {"kernel": np.stack([q_k, k_k, v_k], axis=1)}}  # [D, 3, N, H]
        else:
            attention = {"query": {"kernel": q_k}, "key": {"kernel": k_k},
                         "value": {"kernel": v_k}}
        attention["out"] = {"kernel": o.T.reshape(n, h, dm)}  # [N, H, D]
        _open_family_params(src, attention, i=i, config=config, dims=d,
                            rotate_half=naming.rotate_half)
        layer: Params = {
            "pre_attention_norm": {"scale": src.take(naming.attn_norm.format(i=i), (d["dims"],))},
            "attention": attention,
            "pre_mlp_norm": {"scale": src.take(naming.mlp_norm.format(i=i), (d["dims"],))},
        }
        if config.post_norms:  # Gemma
            for name, tensor in (("post_attention_norm", naming.post_attn_norm),
                                 ("post_mlp_norm", naming.post_mlp_norm)):
                layer[name] = {"scale": src.take(str(tensor).format(i=i), (d["dims"],))}
        if config.moe is not None and config.moe.is_moe_layer(i):
            layer["moe"] = _experts_to_params(src, i=i, config=config, naming=experts)
            yield f"layers_{i}", layer
            continue
        gate = src.take(naming.gate.format(i=i), (d["hidden"], d["dims"]))  # [F, D]
        up = src.take(naming.up.format(i=i), (d["hidden"], d["dims"]))
        down = src.take(naming.down.format(i=i), (d["dims"], d["hidden"]))  # [D, F]
        layer["mlp"] = {"wi_gate": {"kernel": gate.T}, "wi": {"kernel": up.T},
                        "wo": {"kernel": down.T}}
        yield f"layers_{i}", layer
    yield "final_norm", {"scale": src.take(naming.final_norm, (d["dims"],))}
    if not config.tie_embeddings:
        yield "output", {"kernel": src.take(naming.output, (d["vocab"], d["dims"])).T}  # [D, V]
    elif src.has(naming.output):
        # Some tied checkpoints also store the head; it must be the embedding itself.
        head = src.take(naming.output, (d["vocab"], d["dims"]))
        if not np.array_equal(head, embedding):
            raise LayoutError(f"{naming.what}: tie_word_embeddings is true but {naming.output} "
                              f"differs from {naming.embed}")
    src.finish()


def llama_from_params(params: Params, *, config: TransformerConfig) -> dict[str, np.ndarray]:
    """Unscanned paxlite LLaMA (or Mixtral, Qwen3-MoE) params -> HF tensors (rotate-half q/k rows,
    [out, in] weights; experts under their per-expert on-disk names)."""
    return {k: np.ascontiguousarray(v) for k, v in iter_llama_tensors(params, config=config)}


def iter_llama_tensors(params: Params, *, config: TransformerConfig,
                       naming: LlamaNaming = HF_LLAMA
                       ) -> Iterator[tuple[str, np.ndarray]]:
    """`llama_from_params` one tensor at a time (views where a transpose suffices), so a writer
    can cast and write each before the next is made."""
    nm = naming
    experts = None if config.moe is None else expert_naming(config)
    n, kv, h, dm = config.num_heads, config.kv_heads, config.dims_per_head, config.model_dims
    yield nm.embed, params["embedding"]["embedding"]
    for i in range(config.num_layers):
        layer = params[f"layers_{i}"]
        att = layer["attention"]
        if "qkv" in att:
            qkv = att["qkv"]["kernel"]  # [D, 3, N, H]
            q_k, k_k, v_k = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        else:
            q_k, k_k, v_k = (att[name]["kernel"] for name in ("query", "key", "value"))
        yield nm.q.format(i=i), interleaved_to_rotate_half(
            np.asarray(q_k).reshape(dm, n * h).T, heads=n, head_dim=h)
        yield nm.k.format(i=i), interleaved_to_rotate_half(
            np.asarray(k_k).reshape(dm, kv * h).T, heads=kv, head_dim=h)
        yield nm.v.format(i=i), np.asarray(v_k).reshape(dm, kv * h).T
        yield nm.o.format(i=i), np.asarray(att["out"]["kernel"]).reshape(n * h, dm).T
        yield from _open_family_tensors(att, i=i, config=config)
        if config.moe is not None and config.moe.is_moe_layer(i):
            yield from _experts_from_params(layer["moe"], i=i, naming=experts)
        else:
            yield nm.gate.format(i=i), np.asarray(layer["mlp"]["wi_gate"]["kernel"]).T
            yield nm.up.format(i=i), np.asarray(layer["mlp"]["wi"]["kernel"]).T
            yield nm.down.format(i=i), np.asarray(layer["mlp"]["wo"]["kernel"]).T
        yield nm.attn_norm.format(i=i), layer["pre_attention_norm"]["scale"]
        yield nm.mlp_norm.format(i=i), layer["pre_mlp_norm"]["scale"]
        if config.post_norms:
            yield str(nm.post_attn_norm).format(i=i), layer["post_attention_norm"]["scale"]
            yield str(nm.post_mlp_norm).format(i=i), layer["post_mlp_norm"]["scale"]
    yield nm.final_norm, params["final_norm"]["scale"]
    if not config.tie_embeddings:
        yield nm.output, np.asarray(params["output"]["kernel"]).T


# ---------------------------------------------------------------- experts (Mixtral, Qwen3-MoE)
def _experts_to_params(src: TensorSource, *, i: int, config: TransformerConfig,
                       naming: ExpertNaming) -> Params:
    """One sparse layer's router and experts -> ``moe/{router, wi_gate, wi, wo}`` (kernels
    [D, E], [E, D, F], [E, D, F], [E, F, D]), from the per-expert names or, where the layer has
    them, transformers 5.x's fused in-memory ones (hf_moe.FUSED_*)."""
    moe = config.moe
    assert moe is not None
    e, dm = moe.num_experts, config.model_dims
    f = moe.expert_hidden_dims or config.hidden_dims
    experts = Dim(f"{naming.experts_field}={e}", e)
    dims = Dim(f"hidden_size={dm}", dm)
    hidden = Dim(f"{naming.hidden_field}={f}", f)
    if src.has(FUSED_GATE_UP.format(i=i)):
        router = src.take(FUSED_ROUTER.format(i=i), (experts, dims))
        gate_up = src.take(FUSED_GATE_UP.format(i=i),
                           (experts, Dim(f"2 * {naming.hidden_field} = {2 * f}", 2 * f), dims))
        down = src.take(FUSED_DOWN.format(i=i), (experts, dims, hidden))
        gate, up = gate_up[:, :f], gate_up[:, f:]  # [E, F, D] each
    else:
        router = src.take(naming.router.format(i=i), (experts, dims))

        def per_expert(w: str, shape: tuple[Dim, Dim]) -> np.ndarray:
            return np.stack([src.take(naming.expert.format(i=i, e=j, w=w), shape)
                             for j in range(e)])

        gate, up = per_expert(naming.gate, (hidden, dims)), per_expert(naming.up, (hidden, dims))
        down = per_expert(naming.down, (dims, hidden))  # [E, D, F]
    return {"router": {"kernel": router.T}, "wi_gate": {"kernel": gate.swapaxes(1, 2)},
            "wi": {"kernel": up.swapaxes(1, 2)}, "wo": {"kernel": down.swapaxes(1, 2)}}


def _experts_from_params(moe: Params, *, i: int, naming: ExpertNaming
                         ) -> Iterator[tuple[str, np.ndarray]]:
    """Inverse of `_experts_to_params`, always under the per-expert names (what transformers
    writes)."""
    yield naming.router.format(i=i), np.asarray(moe["router"]["kernel"]).T
    for name, w in (("wi_gate", naming.gate), ("wi", naming.up), ("wo", naming.down)):
        kernel = np.asarray(moe[name]["kernel"])  # [E, in, out]
        for j in range(kernel.shape[0]):
            yield naming.expert.format(i=i, e=j, w=w), kernel[j].T


# ---------------------------------------------------------------- tree helpers
def flatten(params: Params, prefix: str = "") -> dict[str, np.ndarray]:
    """{'a/b/c': leaf} of a nested dict."""
    out: dict[str, np.ndarray] = {}
    for key, value in params.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{path}/"))
        else:
            out[path] = value
    return out


def check_params(params: Params, *, config: TransformerConfig) -> None:
    """The tree must be exactly the (unscanned) model's: same paths, same shapes."""
    from flax import linen as nn

    from paxlite.models.transformer import abstract_variables

    unscanned = dataclasses.replace(config, scan_layers=False)
    want = flatten(nn.meta.unbox(abstract_variables(unscanned)["params"]))
    have = flatten(params)
    problems = [f"{p}: missing" for p in sorted(set(want) - set(have))]
    problems += [f"{p}: not a parameter of this model" for p in sorted(set(have) - set(want))]
    problems += [f"{p}: shape {tuple(have[p].shape)}, model {tuple(want[p].shape)}"
                 for p in sorted(set(want) & set(have))
                 if tuple(have[p].shape) != tuple(want[p].shape)]
    if problems:
        raise LayoutError("params do not fit the model: " + "; ".join(problems[:20]))


def stack_layers(params: Params, *, num_layers: int, unit: int = 1) -> Params:
    """layers_0..layers_{L-1} -> one ``layers`` subtree with a leading [L] axis (nn.scan's form);
    scan units of ``unit`` > 1 layers (``config.layers_per_scan_unit``): ``layers/layer_{j}``,
    each [L / unit]."""
    import jax

    def stacked(indices: range) -> Any:
        layers = [params[f"layers_{i}"] for i in indices]
        return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *layers)

    out = {k: v for k, v in params.items() if not k.startswith("layers_")}
    out["layers"] = (stacked(range(num_layers)) if unit == 1 else
                     {f"layer_{j}": stacked(range(j, num_layers, unit)) for j in range(unit)})
    return out


def unstack_layers(params: Params, *, num_layers: int, unit: int = 1) -> Params:
    """Inverse of stack_layers."""
    import jax

    out = {k: v for k, v in params.items() if k != "layers"}
    for i in range(num_layers):
        tree = params["layers"] if unit == 1 else params["layers"][f"layer_{i % unit}"]
        out[f"layers_{i}"] = jax.tree.map(lambda x, u=i // unit: np.asarray(x)[u], tree)
    return out


def count(params: Params) -> int:
    return sum(math.prod(np.shape(v)) for v in flatten(params).values())
