"""Attention: mask construction, float64 reference, causality and segment isolation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from paxlite.models.attention import Attention, make_attention_mask
from paxlite.models.transformer import Transformer, TransformerConfig, abstract_variables


def test_mask_is_causal_and_respects_segments() -> None:
    seg = np.array([[1, 1, 2, 2, 2, 0], [3, 3, 3, 3, 3, 3]], np.int32)
    got = np.asarray(make_attention_mask(seq_len=6, segment_ids=jnp.asarray(seg)))
    assert got.shape == (2, 1, 6, 6)
    for b in range(2):
        for t in range(6):
            for s in range(6):
                assert got[b, 0, t, s] == (s <= t and seg[b, t] == seg[b, s]), (b, t, s)
    plain = np.asarray(make_attention_mask(seq_len=4, segment_ids=None))
    np.testing.assert_array_equal(plain[0, 0], np.tril(np.ones((4, 4), bool)))


def test_mask_rejects_wrong_segment_shape() -> None:
    with pytest.raises(ValueError, match=r"segment_ids must have shape \[batch, 5\]"):
        make_attention_mask(seq_len=5, segment_ids=jnp.zeros((2, 4), jnp.int32))


def _np_attention(params: dict, x: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Per-head float64 attention written with plain matmuls. allowed: bool [B, T, S]."""
    wqkv = np.asarray(params["qkv"]["kernel"], np.float64)  # [D, 3, N, H]
    bqkv = np.asarray(params["qkv"]["bias"], np.float64)  # [3, N, H]
    wo = np.asarray(params["out"]["kernel"], np.float64)  # [N, H, D]
    bo = np.asarray(params["out"]["bias"], np.float64)
    out = np.zeros_like(x)
    for n in range(wqkv.shape[2]):
        q = x @ wqkv[:, 0, n] + bqkv[0, n]
        k = x @ wqkv[:, 1, n] + bqkv[1, n]
        v = x @ wqkv[:, 2, n] + bqkv[2, n]
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
        scores = np.where(allowed, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out += (probs @ v) @ wo[n]
    return out + bo


def test_attention_matches_float64_reference() -> None:
    rng = np.random.default_rng(0)
    b, t, d, n, h = 2, 7, 10, 3, 4  # n * h != d on purpose
    x = rng.normal(size=(b, t, d))
    seg = np.array([[1, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5]], np.int32)
    module = Attention(num_heads=n, dims_per_head=h)
    shapes = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((b, t, d)),
                            make_attention_mask(seq_len=t, segment_ids=None))
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.5, s.shape), jnp.float32),
                          nn.meta.unbox(shapes)["params"])
    mask = make_attention_mask(seq_len=t, segment_ids=jnp.asarray(seg))
    got = module.apply({"params": params}, jnp.asarray(x, jnp.float32), mask)
    allowed = np.tril(np.ones((t, t), bool))[None] & (seg[:, :, None] == seg[:, None, :])
    want = _np_attention(params, x, allowed)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def _tiny() -> TransformerConfig:
    return TransformerConfig(vocab_size=20, num_layers=2, model_dims=12, num_heads=2,
                             dims_per_head=4, hidden_dims=24, max_seq_len=10)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_changing_future_token_leaves_earlier_logits_unchanged(scan_layers: bool) -> None:
    cfg = dataclasses.replace(_tiny(), scan_layers=scan_layers)
    model = Transformer(cfg)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 20, (2, 9)), jnp.int32)
    # Random params from the abstract tree: a real init compiles the threefry sampler, slow on CPU.
    rng = np.random.default_rng(2)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.3, s.shape), jnp.float32),
                          nn.meta.unbox(abstract_variables(cfg))["params"])
    variables = {"params": params}
    apply = jax.jit(model.apply)
    base = np.asarray(apply(variables, tokens))
    changed = np.asarray(apply(variables, tokens.at[:, 5].set((tokens[:, 5] + 7) % 20)))
    np.testing.assert_array_equal(changed[:, :5], base[:, :5])
    # The change must be visible from position 5 on, otherwise the check above proves nothing.
    assert np.abs(changed[:, 5:] - base[:, 5:]).max() > 1e-3
