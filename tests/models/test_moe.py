"""The MoE layer (models/moe.py) against float64 NumPy references, and its place in the transformer.

The references are written here token by token: each token's output is the gate-weighted sum of its
chosen experts' MLPs (dropless), or of the experts the gating kept (GShard, from top2_gating's
combine tensor, whose own semantics tests/models/test_moe_gating.py pins down).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from paxlite.models import sown
from paxlite.models.activations import Activation
from paxlite.models.moe import MoeMlp, _permute, top2_gating
from paxlite.models.moe_config import MoeConfig, MoeRouting
from paxlite.models.transformer import Transformer, TransformerConfig

D, F, E = 8, 12, 4


def _np_expert(x, params, e, *, gated, act):
    wi = np.asarray(params["wi"]["kernel"][e], np.float64)
    wo = np.asarray(params["wo"]["kernel"][e], np.float64)
    h = x @ wi
    if gated:
        g = x @ np.asarray(params["wi_gate"]["kernel"][e], np.float64)
        h = act(g) * h
    else:
        h = act(h)
    return h @ wo


def _relu(v):
    return np.maximum(v, 0.0)


def _silu(v):
    return v / (1.0 + np.exp(-v))


def _init(cfg: MoeConfig, x):
    layer = MoeMlp(config=cfg, hidden_dims=F, init_std=0.3)
    params = nn.meta.unbox(layer.init({"params": jax.random.key(1)}, x)["params"])
    return layer, params


@pytest.mark.parametrize("gated", [False, True])
def test_dropless_matches_numpy_top_k(gated):
    cfg = MoeConfig(num_experts=E, experts_per_token=2, routing=MoeRouting.DROPLESS_TOPK,
                    gated_experts=gated,
                    expert_activation=Activation.SILU if gated else Activation.RELU)
    x = jax.random.normal(jax.random.key(0), (3, 5, D), jnp.float32)
    layer, params = _init(cfg, x)
    y = np.asarray(layer.apply({"params": params}, x), np.float64)

    xs = np.asarray(x, np.float64).reshape(-1, D)
    router = np.asarray(params["router"]["kernel"], np.float64)
    want = np.zeros_like(xs)
    for n, tok in enumerate(xs):
        logits = tok @ router
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs)[:2]
        w = probs[top] / probs[top].sum()
        for weight, e in zip(w, top):
            want[n] += weight * _np_expert(
                tok, params, e, gated=gated, act=_silu if gated else _relu
            )
    np.testing.assert_allclose(y.reshape(-1, D), want, rtol=2e-5, atol=2e-6)


def test_gshard_matches_numpy_from_combine():
    cfg = MoeConfig(num_experts=E, routing=MoeRouting.GSHARD_TOP2, capacity_factor=0.5,
                    num_groups=2)
    x = jax.random.normal(jax.random.key(0), (2, 8, D), jnp.float32)  # 16 tokens, 2 groups of 8
    layer, params = _init(cfg, x)
    y = np.asarray(layer.apply({"params": params}, x), np.float64).reshape(2, 8, D)

    xg = np.asarray(x, np.float64).reshape(2, 8, D)
    logits = jnp.einsum("GSD,DE->GSE", jnp.asarray(xg, jnp.float32), params["router"]["kernel"])
    combine = np.asarray(top2_gating(logits, capacity_factor=0.5).combine, np.float64)
    want = np.zeros_like(xg)
    dropped_tokens = 0
    for g in range(2):
        for s in range(8):
            weights = combine[g, s].sum(axis=-1)  # [E]: the kept gates of this token
            dropped_tokens += not weights.any()
            for e in np.nonzero(weights)[0]:
                want[g, s] += weights[e] * _np_expert(xg[g, s], params, e, gated=False, act=_relu)
    assert dropped_tokens > 0  # capacity int(0.5 x 8 / 4) = 1 per expert: some tokens must drop
    np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-6)
    fully_dropped = combine.reshape(2, 8, -1).sum(-1) == 0
    assert np.all(y[fully_dropped] == 0.0)  # the residual carries such a token unchanged


def test_gshard_padding_takes_no_capacity():
    """Through the layer: padded tokens are routed nowhere and leave the real ones their places.

    Eight tokens of which the first four are padding, capacity int(8 x 1.0 / 4) = 2 -> 4, against
    the four real tokens alone with capacity int(4 x 4.0 / 4) = 4: the same capacity, so the
    outputs agree exactly when padding takes none of it (padding ranks first in the group, so if
    it took capacity, real tokens would drop).
    """
    padded = MoeConfig(num_experts=E, routing=MoeRouting.GSHARD_TOP2, capacity_factor=1.0,
                       num_groups=1)
    alone = MoeConfig(num_experts=E, routing=MoeRouting.GSHARD_TOP2, capacity_factor=4.0,
                      num_groups=1)
    x = jax.random.normal(jax.random.key(3), (1, 8, D), jnp.float32)
    layer, params = _init(padded, x)
    # every padded token routed like the first real one: if padding took capacity, it would fill it
    x = x.at[0, :4].set(x[0, 4])
    pad = jnp.zeros((1, 8)).at[0, :4].set(1.0)
    y = np.asarray(layer.apply({"params": params}, x, paddings=pad))
    assert np.all(y[0, :4] == 0.0)
    y_alone = np.asarray(MoeMlp(config=alone, hidden_dims=F).apply({"params": params}, x[:, 4:]))
    assert np.abs(y_alone).sum() > 0
    np.testing.assert_allclose(y[0, 4:], y_alone[0], rtol=1e-6, atol=1e-7)
    y_unpadded = np.asarray(layer.apply({"params": params}, x))
    assert not np.allclose(y_unpadded[0, 4:], y_alone[0])  # the check can fail


def test_permute_gradient_is_the_inverse_gather():
    x = jax.random.normal(jax.random.key(0), (6, 3))
    order = jnp.asarray([3, 0, 5, 1, 4, 2])
    inverse = jnp.argsort(order)
    w = jax.random.normal(jax.random.key(1), (6, 3))
    got = jax.grad(lambda v: jnp.sum(_permute(v, order, inverse) * w))(x)
    want = jax.grad(lambda v: jnp.sum(v[order] * w))(x)
    np.testing.assert_array_equal(got, want)


BASE = dict(vocab_size=64, num_layers=4, model_dims=16, num_heads=2, dims_per_head=8,
            hidden_dims=32, max_seq_len=16)


def _stack_unscanned(params, *, num_layers: int, unit: int):
    """The scanned parameter tree from an unscanned one: [L / unit] stacks of `unit` layers."""
    stacked = {}
    for j in range(unit):
        layers = [params[f"layers_{i}"] for i in range(j, num_layers, unit)]
        tree = jax.tree.map(lambda *a: jnp.stack(a), *layers)
        if unit == 1:
            stacked = tree
        else:
            stacked[f"layer_{j}"] = tree
    out = {k: v for k, v in params.items() if not k.startswith("layers_")}
    out["layers"] = stacked
    return out


@pytest.mark.parametrize("routing,interval", [(MoeRouting.GSHARD_TOP2, 2),
                                              (MoeRouting.DROPLESS_TOPK, 1)])
def test_scanned_model_equals_unscanned(routing, interval):
    moe = MoeConfig(num_experts=4, routing=routing, moe_layer_interval=interval,
                    gated_experts=routing is MoeRouting.DROPLESS_TOPK, load_balancing_weight=0.01,
                    num_groups=2)
    unscanned = TransformerConfig(**BASE, moe=moe)
    scanned = TransformerConfig(**BASE, moe=moe, scan_layers=True)
    tokens = jnp.arange(32).reshape(2, 16) % 64
    params = nn.meta.unbox(
        Transformer(unscanned).init({"params": jax.random.key(0)}, tokens)["params"])
    moe_layers = [k for k in params if k.startswith("layers_") and "moe" in params[k]]
    assert moe_layers == [f"layers_{i}" for i in range(0, 4, interval)]
    logits, state = Transformer(unscanned).apply(
        {"params": params}, tokens, mutable=list(sown.COLLECTIONS))
    stacked = _stack_unscanned(params, num_layers=4, unit=interval)
    logits_s, state_s = Transformer(scanned).apply(
        {"params": stacked}, tokens, mutable=list(sown.COLLECTIONS))
    np.testing.assert_allclose(logits_s, logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sown.total_aux_loss(state_s), sown.total_aux_loss(state), rtol=1e-6)
    summaries, summaries_s = sown.summary_means(state), sown.summary_means(state_s)
    assert set(summaries) == {"moe/aux_loss", "moe/dropped_fraction", "moe/expert_load_min",
                              "moe/expert_load_max"}
    for key, value in summaries.items():
        np.testing.assert_allclose(summaries_s[key], value, rtol=1e-6, err_msg=key)
    # the summed load-balancing loss is weight x the per-layer aux losses
    np.testing.assert_allclose(sown.total_aux_loss(state),
                               0.01 * len(moe_layers) * summaries["moe/aux_loss"], rtol=1e-5)
