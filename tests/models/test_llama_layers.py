"""LLaMA pieces against float64 NumPy: interleaved RoPE, grouped-query attention, SwiGLU, RMSNorm,
packed rows and the remat tags of separate q/k/v projections."""

import contextlib
import dataclasses
import io
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from paxlite.models.attention import Attention, make_attention_mask
from paxlite.models.mlp import Mlp
from paxlite.models.norms import RMSNorm
from paxlite.models.rotary import apply_rotary
from paxlite.models.transformer import (
    Activation,
    NormKind,
    PositionEmbedding,
    RematPolicy,
    Transformer,
    TransformerConfig,
    abstract_variables,
)


def _np_rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Interleaved pairs (x[2j], x[2j+1]) rotated by pos * theta^(-2j/h); x [B, T, N, h]."""
    h = x.shape[-1]
    out = np.empty_like(x, dtype=np.float64)
    for j in range(h // 2):
        angle = positions[:, :, None].astype(np.float64) * theta ** (-2.0 * j / h)  # [B, T, 1]
        a, b = x[..., 2 * j], x[..., 2 * j + 1]
        out[..., 2 * j] = a * np.cos(angle) - b * np.sin(angle)
        out[..., 2 * j + 1] = a * np.sin(angle) + b * np.cos(angle)
    return out


def _random_params(abstract: Any, rng: np.random.Generator, std: float = 0.3) -> Any:
    """Random values for an abstract param tree; norm scales around 1 (a real init compiles the
    threefry sampler, which is slow on CPU)."""
    def leaf(path: tuple, shape: jax.ShapeDtypeStruct) -> jax.Array:
        noise = rng.normal(size=shape.shape)
        value = 1.0 + 0.2 * noise if path[-1].key == "scale" else std * noise
        return jnp.asarray(value, jnp.float32)

    return jax.tree_util.tree_map_with_path(leaf, nn.meta.unbox(abstract))


# ------------------------------------------------------------------------------------------- RoPE
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope_matches_float64_interleaved_formula(theta: float) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 6, 3, 8))
    positions = np.array([[0, 1, 2, 3, 4, 5], [7, 8, 0, 1, 2, 40]], np.int32)  # restarts: packing
    got = apply_rotary(jnp.asarray(x, jnp.float32), jnp.asarray(positions), theta=theta)
    assert got.shape == x.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), _np_rope(x, positions, theta), rtol=1e-5, atol=1e-5)


def test_rope_pairs_adjacent_elements_not_halves() -> None:
    """Meta/Pax layout: a unit vector on element 0 turns towards element 1 (rotate-half would turn
    it towards element h/2)."""
    x = jnp.zeros((1, 1, 1, 8)).at[..., 0].set(1.0)
    got = np.asarray(apply_rotary(x, jnp.ones((1, 1), jnp.int32)))[0, 0, 0]
    np.testing.assert_allclose(got, [np.cos(1.0), np.sin(1.0), 0, 0, 0, 0, 0, 0], atol=1e-7)
    # Position 0 is the identity; bf16 in gives bf16 out.
    y = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 2, 4)), jnp.bfloat16)
    same = apply_rotary(y, jnp.zeros((2, 3), jnp.int32))
    assert same.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(same, np.float32), np.asarray(y, np.float32))


def test_rope_scores_depend_only_on_position_difference() -> None:
    rng = np.random.default_rng(2)
    q, k = rng.normal(size=(1, 1, 1, 16)), rng.normal(size=(1, 1, 1, 16))

    def score(m: int, n: int) -> float:
        rq = apply_rotary(jnp.asarray(q, jnp.float32), jnp.full((1, 1), m, jnp.int32))
        rk = apply_rotary(jnp.asarray(k, jnp.float32), jnp.full((1, 1), n, jnp.int32))
        return float(jnp.sum(rq * rk))

    base = score(5, 2)
    for shift in (1, 7, 30):
        assert abs(score(5 + shift, 2 + shift) - base) < 1e-5 * max(1.0, abs(base))
    assert abs(score(6, 2) - base) > 1e-3  # a different distance gives a different score


def test_rope_rejects_odd_head_dims_and_bad_positions() -> None:
    with pytest.raises(ValueError, match="even, positive dims_per_head, got 5"):
        apply_rotary(jnp.zeros((1, 2, 1, 5)), jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match=r"positions must have shape \[batch, length\]"):
        apply_rotary(jnp.zeros((1, 2, 1, 4)), jnp.zeros((1, 3), jnp.int32))


# ------------------------------------------------------------------------------ grouped attention
def _np_gqa(params: dict, x: np.ndarray, allowed: np.ndarray, positions: np.ndarray | None,
            theta: float) -> np.ndarray:
    """float64 attention that repeats kv head i // (N/K) for query head i. allowed [B, T, S]."""
    wq = np.asarray(params["query"]["kernel"], np.float64)  # [D, N, H]
    wk = np.asarray(params["key"]["kernel"], np.float64)  # [D, K, H]
    wv = np.asarray(params["value"]["kernel"], np.float64)
    wo = np.asarray(params["out"]["kernel"], np.float64)  # [N, H, D]
    n, kv, h = wq.shape[1], wk.shape[1], wq.shape[2]
    q = np.einsum("btd,dnh->btnh", x, wq)
    k = np.repeat(np.einsum("btd,dkh->btkh", x, wk), n // kv, axis=2)  # [B, T, N, H]
    v = np.repeat(np.einsum("btd,dkh->btkh", x, wv), n // kv, axis=2)
    if positions is not None:
        q, k = _np_rope(q, positions, theta), _np_rope(k, positions, theta)
    scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)
    scores = np.where(allowed[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh,nhd->btd", probs, v, wo)


@pytest.mark.parametrize("rotary", [False, True])
def test_grouped_query_attention_matches_float64_reference(rotary: bool) -> None:
    rng = np.random.default_rng(3)
    b, t, d, n, kv, h = 2, 7, 10, 6, 2, 4
    x = rng.normal(size=(b, t, d))
    seg = np.array([[1, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5]], np.int32)
    positions = np.array([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6]], np.int32)
    theta = 100.0  # a small base makes every pair rotate noticeably over 7 positions
    module = Attention(num_heads=n, dims_per_head=h, num_kv_heads=kv, use_bias=False,
                       rope_theta=theta if rotary else None)
    mask = make_attention_mask(seq_len=t, segment_ids=jnp.asarray(seg))
    abstract = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((b, t, d)), mask,
                              jnp.asarray(positions))
    shapes = {name: leaf["kernel"].value.shape for name, leaf in abstract["params"].items()}
    assert shapes == {"query": (d, n, h), "key": (d, kv, h), "value": (d, kv, h), "out": (n, h, d)}
    assert all(set(leaf) == {"kernel"} for leaf in abstract["params"].values())  # no biases
    specs = nn.get_partition_spec(abstract)["params"]
    assert tuple(specs["key"]["kernel"]) == ("embed", "kv_heads", "kv")
    assert tuple(specs["query"]["kernel"]) == ("embed", "heads", "kv")
    params = _random_params(abstract["params"], rng, std=0.5)
    got = module.apply({"params": params}, jnp.asarray(x, jnp.float32), mask,
                       jnp.asarray(positions))
    allowed = np.tril(np.ones((t, t), bool))[None] & (seg[:, :, None] == seg[:, None, :])
    want = _np_gqa(params, x, allowed, positions if rotary else None, theta)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_num_kv_heads_must_divide_num_heads() -> None:
    module = Attention(num_heads=6, dims_per_head=4, num_kv_heads=4)
    x = jnp.zeros((1, 3, 8))
    with pytest.raises(ValueError, match="num_kv_heads=4 must be a positive divisor of num_heads"):
        jax.eval_shape(module.init, jax.random.key(0), x, make_attention_mask(seq_len=3,
                                                                              segment_ids=None))
    with pytest.raises(ValueError, match=r"num_kv_heads=3 must be a positive divisor of num_heads"):
        TransformerConfig(vocab_size=8, num_layers=1, model_dims=8, num_heads=4, dims_per_head=2,
                          hidden_dims=8, max_seq_len=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="must be even for rotary"):
        TransformerConfig(vocab_size=8, num_layers=1, model_dims=8, num_heads=4, dims_per_head=3,
                          hidden_dims=8, max_seq_len=4, position_embedding="rotary")


# ------------------------------------------------------------------------------------ MLP, norm
def test_swiglu_mlp_matches_numpy() -> None:
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 3, 8))
    module = Mlp(hidden_dims=12, activation=jax.nn.silu, gated=True, use_bias=False)
    abstract = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((2, 3, 8)))
    assert {k: v["kernel"].value.shape for k, v in abstract["params"].items()} == {
        "wi_gate": (8, 12), "wi": (8, 12), "wo": (12, 8)}
    params = _random_params(abstract["params"], rng, std=0.5)
    got = module.apply({"params": params}, jnp.asarray(x, jnp.float32))
    w_gate, w_up, w_down = (np.asarray(params[k]["kernel"], np.float64)
                            for k in ("wi_gate", "wi", "wo"))
    gate = x @ w_gate
    want = (gate / (1.0 + np.exp(-gate)) * (x @ w_up)) @ w_down
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_rms_norm_bfloat16_input_reduces_in_float32() -> None:
    """4096 bf16 values with a large offset: a bf16 mean of squares would be off by percent."""
    rng = np.random.default_rng(5)
    x_bf16 = jnp.asarray(rng.normal(3.0, 1.0, (2, 4096)), jnp.bfloat16)
    x = np.asarray(x_bf16, np.float64)  # exactly the values the module sees
    scale = 1.0 + 0.1 * rng.normal(size=4096)
    params = {"scale": jnp.asarray(scale, jnp.float32)}
    want = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5) * scale
    out32 = RMSNorm(epsilon=1e-5).apply({"params": params}, x_bf16)
    np.testing.assert_allclose(np.asarray(out32), want, rtol=1e-5, atol=1e-5)
    out16 = RMSNorm(epsilon=1e-5, dtype=jnp.bfloat16).apply({"params": params}, x_bf16)
    assert out16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out16, np.float64), want, rtol=2**-8, atol=0)
    variables = jax.eval_shape(RMSNorm().init, jax.random.key(0), x_bf16)
    assert set(variables["params"]) == {"scale"}  # no bias


# ------------------------------------------------------------------------- the whole tiny model
def tiny_llama(**changes: Any) -> TransformerConfig:
    cfg = TransformerConfig(
        vocab_size=40, num_layers=2, model_dims=16, num_heads=4, num_kv_heads=2, dims_per_head=4,
        hidden_dims=24, max_seq_len=16, norm=NormKind.RMS_NORM, activation=Activation.SILU,
        gated_mlp=True, use_bias=False, tie_embeddings=False, learned_position_embedding=False,
        position_embedding=PositionEmbedding.ROTARY, rope_theta=50.0,
    )
    return dataclasses.replace(cfg, **changes)


def test_tiny_llama_parameter_tree() -> None:
    cfg = tiny_llama()
    variables = abstract_variables(cfg)
    params = nn.meta.unbox(variables)["params"]
    assert "position_embedding" not in params
    assert params["output"]["kernel"].shape == (16, 40) and set(params["output"]) == {"kernel"}
    assert tuple(nn.get_partition_spec(variables)["params"]["output"]["kernel"]) == ("embed",
                                                                                     "vocab")
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    assert not [p for p in paths if "bias" in p]
    assert set(params["layers_0"]["attention"]) == {"query", "key", "value", "out"}
    assert set(params["layers_0"]["mlp"]) == {"wi_gate", "wi", "wo"}
    # Equal kv heads keep GPT's fused QKV kernel (Pax combines QKV unless USE_MQA).
    fused = nn.meta.unbox(abstract_variables(tiny_llama(num_kv_heads=None)))["params"]
    assert fused["layers_0"]["attention"]["qkv"]["kernel"].shape == (16, 3, 4, 4)


def test_packed_rows_give_the_per_token_losses_of_separate_documents() -> None:
    cfg = tiny_llama()
    model = Transformer(cfg)
    rng = np.random.default_rng(6)
    params = _random_params(abstract_variables(cfg)["params"], rng)
    docs = [rng.integers(0, 40, n) for n in (5, 7, 4)]

    apply = jax.jit(model.apply)  # op by op, each of the five shapes costs more than a compile

    def token_losses(tokens: np.ndarray, **kwargs: jax.Array) -> np.ndarray:
        """Cross entropy of predicting tokens[t+1] from the logits at t."""
        logits = apply({"params": params}, jnp.asarray(tokens[None], jnp.int32), **kwargs)
        logp = jax.nn.log_softmax(logits[0, :-1], axis=-1)
        return -np.asarray(jnp.take_along_axis(logp, jnp.asarray(tokens[1:, None]), axis=-1))[:, 0]

    packed = np.concatenate(docs)
    seg = np.concatenate([np.full(len(d), i + 1) for i, d in enumerate(docs)])
    pos = np.concatenate([np.arange(len(d)) for d in docs])
    got = token_losses(packed, positions=jnp.asarray(pos[None], jnp.int32),
                       segment_ids=jnp.asarray(seg[None], jnp.int32))
    start = 0
    for doc in docs:
        want = token_losses(doc)
        np.testing.assert_allclose(got[start:start + len(doc) - 1], want, rtol=1e-5, atol=1e-5)
        start += len(doc)
    # The blocks read the positions: stretched positions change the losses. (Positions that keep
    # counting across documents do not: RoPE scores depend on differences only, and the segment
    # mask keeps every pair inside one document.)
    stretched = token_losses(packed, positions=jnp.asarray(2 * pos[None], jnp.int32),
                             segment_ids=jnp.asarray(seg[None], jnp.int32))
    assert np.max(np.abs(stretched - got)) > 1e-3
    counting = token_losses(packed, segment_ids=jnp.asarray(seg[None], jnp.int32))
    np.testing.assert_allclose(counting, got, rtol=1e-5, atol=1e-5)


def test_remat_policies_save_the_separate_qkv_projections() -> None:
    L, B, T, N, K, H, D = 2, 3, 5, 4, 2, 4, 16
    rng = np.random.default_rng(7)
    params = _random_params(abstract_variables(tiny_llama(scan_layers=True))["params"], rng)
    tokens = jnp.asarray(rng.integers(0, 40, (B, T + 1)), jnp.int32)

    def loss_of(policy: RematPolicy):
        cfg = tiny_llama(scan_layers=True, remat_policy=policy)

        def loss(p: Any) -> jax.Array:
            logp = jax.nn.log_softmax(Transformer(cfg).apply({"params": p}, tokens[:, :-1]))
            return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
        return loss

    def saved(policy: RematPolicy) -> list[tuple[int, ...]]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            jax.ad_checkpoint.print_saved_residuals(loss_of(policy), params)
        found = re.findall(r"f32\[([\d,]*)\] output of scan", out.getvalue())
        shapes = [tuple(int(d) for d in s.split(",")) for s in found]
        # The per-layer residuals are stacked [L, ...]; the last layer's [B, T, D] output is the
        # final norm's input, outside the stack.
        return sorted(s for s in shapes if len(s) >= 4 and s[0] == L)

    layer_input, out_proj = (L, B, T, D), (L, B, T, D)
    q, kv, context = (L, B, T, N, H), (L, B, T, K, H), (L, B, T, N, H)
    assert saved(RematPolicy.SAVE_QKV_OUT_PROJ) == sorted([layer_input, q, kv, kv, out_proj])
    assert saved(RematPolicy.SAVE_DOT_FOR_MLPERF_200B) == sorted(
        [layer_input, q, kv, kv, context, out_proj])
    # Each policy's loss and gradients jitted (cheaper than op by op), as two programs: in one,
    # XLA could share work between the two and hide a difference.
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_of(RematPolicy.SAVE_EVERYTHING)))(params)
    got_loss, got_grads = jax.jit(jax.value_and_grad(loss_of(RematPolicy.SAVE_QKV_OUT_PROJ)))(
        params)
    np.testing.assert_allclose(got_loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 got_grads, ref_grads)
