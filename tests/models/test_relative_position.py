"""T5 relative position bias (GLaM): buckets against T5's formula in float64, the bias table
lookup, and attention with the bias against a float64 NumPy reference."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from paxlite.models.attention import Attention, AttentionKind, make_attention_mask
from paxlite.models.relative_position import RelativePositionBias, relative_position_bucket


def _t5_bucket(relative_position: int, num_buckets: int, max_distance: int,
               bidirectional: bool) -> int:
    """T5's published bucket (Raffel et al.; mesh_tensorflow _relative_position_bucket), float64."""
    ret = 0
    n = -relative_position
    if bidirectional:
        num_buckets //= 2
        ret += num_buckets if n < 0 else 0
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    large = max_exact + int(
        math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    )
    return ret + min(large, num_buckets - 1)


def _np_buckets(rel: np.ndarray, num_buckets: int, max_distance: int,
                bidirectional: bool = False) -> np.ndarray:
    flat = [_t5_bucket(int(r), num_buckets, max_distance, bidirectional) for r in rel.ravel()]
    return np.asarray(flat, np.int64).reshape(rel.shape)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_buckets_match_t5_formula_for_glam_settings(bidirectional: bool) -> None:
    rel = np.arange(-300, 301)
    got = relative_position_bucket(jnp.asarray(rel), num_buckets=32, max_distance=128,
                                   bidirectional=bidirectional)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), _np_buckets(rel, 32, 128, bidirectional))


def test_causal_buckets_hand_checked() -> None:
    # 16 exact buckets for distances 0..15; then 16 + floor(log(n / 16) / log(8) * 16), cap 31:
    # n=20: 1.72 -> 17; n=32: 16/3 -> 21; n=64: 32/3 -> 26; n=127: 15.94 -> 31.
    rel = np.array([0, -1, -15, -16, -20, -32, -64, -127, -128, -5000, 1, 7, 300])
    want = np.array([0, 1, 15, 16, 17, 21, 26, 31, 31, 31, 0, 0, 0])
    got = relative_position_bucket(jnp.asarray(rel), num_buckets=32, max_distance=128)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_bias_module_gathers_the_table_by_key_minus_query_bucket() -> None:
    n, buckets, max_distance = 3, 6, 5
    q_pos = np.array([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]], np.int32)
    k_pos = q_pos
    module = RelativePositionBias(num_buckets=buckets, max_distance=max_distance, num_heads=n)
    variables = module.init(jax.random.key(0), jnp.asarray(q_pos), jnp.asarray(k_pos))
    assert tuple(nn.get_partition_spec(variables)["params"]["rel_bias"]) == (
        "heads", "relpos_buckets")
    table = np.asarray(nn.meta.unbox(variables)["params"]["rel_bias"])
    assert table.shape == (n, buckets)
    got = np.asarray(module.apply(variables, jnp.asarray(q_pos), jnp.asarray(k_pos)))
    assert got.shape == (2, n, 10, 10) and got.dtype == np.float32
    want = np.zeros(got.shape)
    for b in range(2):
        for t in range(10):
            for s in range(10):
                bucket = _t5_bucket(int(k_pos[b, s] - q_pos[b, t]), buckets, max_distance, False)
                want[b, :, t, s] = table[:, bucket]
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(_np_buckets(k_pos[1][None] - q_pos[1][:, None], buckets, 5))) == buckets


def _np_attention(params: dict, x: np.ndarray, allowed: np.ndarray,
                  bias: np.ndarray) -> np.ndarray:
    """float64 softmax(q k / sqrt(H) + bias + mask) v, fused or grouped parameter layout."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    if "qkv" in p:
        w = p["qkv"]["kernel"]  # [D, 3, N, H]
        qkv = np.einsum("btd,dknh->btknh", x, w) + p["qkv"].get("bias", 0.0)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
        q, k, v = (np.einsum("btd,dnh->btnh", x, p[name]["kernel"]) + p[name].get("bias", 0.0)
                   for name in ("query", "key", "value"))  # [B, T, N|K, H]
        groups = q.shape[2] // k.shape[2]
        k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)  # head i -> kv i // G
    scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1]) + bias
    scores = np.where(allowed[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bnts,bsnh,nhd->btd", probs, v, p["out"]["kernel"])
    return out + p["out"].get("bias", 0.0)


_B, _T, _D, _N, _H = 2, 7, 10, 4, 4
_SEG = np.array([[1, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5]], np.int32)
_POS = np.array([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6]], np.int32)
_ALLOWED = np.tril(np.ones((_T, _T), bool))[None] & (_SEG[:, :, None] == _SEG[:, None, :])


def _random_params(module: Attention, rng: np.random.Generator, **call_kwargs) -> dict:
    abstract = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((_B, _T, _D)),
                              make_attention_mask(seq_len=_T, segment_ids=None), **call_kwargs)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.5, s.shape), jnp.float32),
                        nn.meta.unbox(abstract)["params"])


@pytest.mark.parametrize("num_kv_heads", [None, 2])
@pytest.mark.parametrize("kind", [AttentionKind.DOT_PRODUCT, AttentionKind.FLASH])
def test_attention_with_relative_bias_matches_float64(kind: AttentionKind,
                                                      num_kv_heads: int | None) -> None:
    rng = np.random.default_rng(4)
    # 6 buckets / max distance 5: distances 0-2 exact, 3 -> 3, 4 -> 4, 5 and beyond -> 5.
    module = Attention(num_heads=_N, dims_per_head=_H, num_kv_heads=num_kv_heads,
                       use_bias=num_kv_heads is None, attention_kind=kind,
                       relative_position_buckets=6, relative_position_max_distance=5)
    params = _random_params(module, rng)
    table = np.asarray(params["relative_bias"]["rel_bias"], np.float64)
    assert table.shape == (_N, 6)
    x = rng.normal(size=(_B, _T, _D))
    mask = make_attention_mask(seq_len=_T, segment_ids=jnp.asarray(_SEG))
    got = module.apply({"params": params}, jnp.asarray(x, jnp.float32), mask, jnp.asarray(_POS))
    rel = _POS[:, None, :] - _POS[:, :, None]  # [B, T, S] key minus query position
    bias = np.transpose(table[:, _np_buckets(rel, 6, 5)], (1, 0, 2, 3))  # [B, N, T, S]
    want = _np_attention(params, x, _ALLOWED, bias)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # The bias matters: the same weights without it give a different answer.
    assert np.abs(want - _np_attention(params, x, _ALLOWED, 0 * bias)).max() > 1e-2


@pytest.mark.parametrize("num_kv_heads", [None, 2])
@pytest.mark.parametrize("kind", [AttentionKind.DOT_PRODUCT, AttentionKind.FLASH])
def test_attention_adds_a_given_bias_before_the_softmax(kind: AttentionKind,
                                                        num_kv_heads: int | None) -> None:
    rng = np.random.default_rng(5)
    module = Attention(num_heads=_N, dims_per_head=_H, num_kv_heads=num_kv_heads,
                       attention_kind=kind)
    params = _random_params(module, rng)
    assert "relative_bias" not in params
    x = rng.normal(size=(_B, _T, _D))
    mask = make_attention_mask(seq_len=_T, segment_ids=jnp.asarray(_SEG))
    for shape in ((1, _N, _T, _T), (_B, 1, _T, _T)):
        bias = rng.normal(0, 2.0, shape)
        got = module.apply({"params": params}, jnp.asarray(x, jnp.float32), mask,
                           bias=jnp.asarray(bias, jnp.float32))
        want = _np_attention(params, x, _ALLOWED, bias)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=str(shape))


def test_attention_rejects_a_bias_of_the_wrong_shape() -> None:
    module = Attention(num_heads=_N, dims_per_head=_H)
    with pytest.raises(
        ValueError, match=r"attention bias must have shape \[1 or 2, 1 or 4, 7, 7\]"
    ):
        jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((_B, _T, _D)),
                       make_attention_mask(seq_len=_T, segment_ids=None),
                       bias=jnp.zeros((1, 3, _T, _T)))


def test_without_positions_the_bias_is_one_arange_table_for_the_batch() -> None:
    """Default positions are arange: the same as passing arange rows explicitly."""
    rng = np.random.default_rng(6)
    module = Attention(num_heads=_N, dims_per_head=_H, relative_position_buckets=32)
    params = _random_params(module, rng)
    x = jnp.asarray(rng.normal(size=(_B, _T, _D)), jnp.float32)
    mask = make_attention_mask(seq_len=_T, segment_ids=None)
    arange = jnp.broadcast_to(jnp.arange(_T, dtype=jnp.int32), (_B, _T))
    implicit = module.apply({"params": params}, x, mask)
    explicit = module.apply({"params": params}, x, mask, arange)
    np.testing.assert_allclose(np.asarray(implicit), np.asarray(explicit), rtol=1e-6, atol=1e-6)
