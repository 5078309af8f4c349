"""gpt-oss's layers on their own: attention sinks (an extra logit column in each softmax, dropped
after it) in the grouped and ungrouped einsum cores against a float64 reference that concatenates
the column as transformers does; the clamped SwiGLU against its formula; and the configurations
that cannot run refused in one line."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxlite.models.attention_kernels import einsum_attention
from paxlite.models.moe_config import MoeConfig
from paxlite.models.moe_gpt_oss import clamped_swiglu
from paxlite.models.transformer_config import TransformerConfig


def _reference(q, k, v, sinks, mask):
    """float64 attention with the sink column concatenated, softmaxed and dropped: q [B,T,N,H],
    k, v [B,S,K,H], sinks [N], mask [T, S]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    logits = np.einsum("btnh,bsnh->bnts", q, k)
    logits = np.where(mask, logits, -np.inf)
    column = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None],
                             logits.shape[:-1] + (1,))
    full = np.concatenate([logits, column], axis=-1)
    full = np.exp(full - full.max(-1, keepdims=True))
    probs = (full / full.sum(-1, keepdims=True))[..., :-1]
    return np.einsum("bnts,bsnh->btnh", probs, v)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_sinks_join_the_softmax_and_are_dropped(kv_heads):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 6, 4, 8)).astype(np.float32)
    k = rng.normal(size=(2, 6, kv_heads, 8)).astype(np.float32)
    v = rng.normal(size=(2, 6, kv_heads, 8)).astype(np.float32)
    sinks = np.array([-1.0, 0.5, 3.0, 20.0], np.float32)  # the last takes nearly all the mass
    mask = np.tril(np.ones((6, 6), bool))
    out = einsum_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                           mask=jnp.asarray(mask)[None, None], sinks=jnp.asarray(sinks))
    np.testing.assert_allclose(out, _reference(q, k, v, sinks, mask), atol=1e-5, rtol=1e-5)
    plain = einsum_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                             mask=jnp.asarray(mask)[None, None])
    assert not np.allclose(out, plain, atol=1e-3)
    assert np.abs(np.asarray(out)[:, :, 3]).max() < 1e-4  # a sink of 20 drowns the keys
    # differentiable, the sinks included
    grad = jax.grad(lambda s: einsum_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), sinks=s).sum())(jnp.asarray(sinks))
    assert np.all(np.isfinite(grad)) and np.abs(grad).max() > 0


def test_clamped_swiglu_is_gpt_oss_formula():
    gate = jnp.array([-9.0, -1.0, 0.0, 0.5, 6.0, 9.0])
    up = jnp.array([-9.0, -1.0, 0.0, 0.5, 6.0, 9.0])
    g, u = np.minimum(np.asarray(gate), 7.0), np.clip(np.asarray(up), -7.0, 7.0)
    want = (u + 1) * g / (1 + np.exp(-1.702 * g))
    np.testing.assert_allclose(clamped_swiglu(gate, up, alpha=1.702, limit=7.0), want, rtol=1e-6)


def _gpt_oss(**changes) -> TransformerConfig:
    base = TransformerConfig(
        vocab_size=32, num_layers=2, model_dims=16, num_heads=2, dims_per_head=8, hidden_dims=16,
        max_seq_len=8, norm="rms_norm", activation="silu", gated_mlp=True, use_bias=False,
        position_embedding="rotary", attention_sinks=True, qkv_bias=True, out_bias=True,
        sliding_window=4, layer_types=("sliding_attention", "full_attention"),
        moe=MoeConfig(num_experts=4, routing="dropless_topk", gated_experts=True,
                      expert_activation="silu", use_bias=True, swiglu_limit=7.0))
    return dataclasses.replace(base, **changes)


def test_configs_that_cannot_run_are_refused():
    config = _gpt_oss(scan_layers=True)
    assert config.layers_per_scan_unit == 2
    with pytest.raises(ValueError, match=r"attention_sinks=True with attention implementation "
                                         r"'cudnn': that kernel has no sink logit"):
        _gpt_oss(attention_kind="flash", attention_implementation="cudnn")
    with pytest.raises(ValueError, match=r"out_bias='yes' must be None"):
        _gpt_oss(out_bias="yes")
    with pytest.raises(ValueError, match=r"a pattern of period 2\) with moe_layer_interval=3"):
        _gpt_oss(num_layers=6, layer_types=("sliding_attention", "full_attention") * 3,
                 moe=dataclasses.replace(config.moe, moe_layer_interval=3))
    with pytest.raises(ValueError, match=r"use_bias with routing='gshard_top2'"):
        MoeConfig(num_experts=4, use_bias=True)
    with pytest.raises(ValueError, match=r"swiglu_limit \(the clamped SwiGLU\) needs "
                                         r"gated_experts=True and expert_activation='silu'"):
        MoeConfig(num_experts=4, routing="dropless_topk", swiglu_limit=7.0)
    with pytest.raises(ValueError, match=r"swiglu_alpha=0 must be a positive number"):
        MoeConfig(num_experts=4, routing="dropless_topk", gated_experts=True,
                  expert_activation="silu", swiglu_limit=7.0, swiglu_alpha=0)
