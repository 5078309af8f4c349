"""Attention kernels that run on CPU against a float64 NumPy reference (forward and dq, dk, dv),
packed and unpacked, causal, grouped-query; sharded (8 CPU devices) against one device; and the
kernel choice: AUTO's fallback, the one-line errors where a named kernel cannot run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec

from paxlite.errors import SettingError
from paxlite.models.attention import einsum_attention, make_attention_mask
from paxlite.models.attention_kernels import (
    AttentionImplementation,
    flash_attention,
    pallas_attention,
    pallas_block_sizes,
    resolve_implementation,
)
from paxlite.models.transformer import Transformer, TransformerConfig
from paxlite.parallel.rules import DEFAULT_RULES

Impl = AttentionImplementation


def _reference(q, k, v, dout, allowed):
    """float64 attention of prescaled q [B, T, N, H] over k, v [B, S, K, H] and its hand-written
    backward for the cotangent dout: (out, dq, dk, dv). allowed: bool [B, T, S]."""
    q, k, v, dout = (np.asarray(a, np.float64) for a in (q, k, v, dout))
    n, kv = q.shape[2], k.shape[2]
    group = n // kv
    out, dq = np.zeros_like(q), np.zeros_like(q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for i in range(n):
        j = i // group  # query head i reads kv head i // G
        qi, kj, vj, doi = q[:, :, i], k[:, :, j], v[:, :, j], dout[:, :, i]
        scores = np.where(allowed, qi @ kj.transpose(0, 2, 1), -np.inf)  # [B, T, S]
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[:, :, i] = p @ vj
        dp = doi @ vj.transpose(0, 2, 1)
        ds = p * (dp - (dp * p).sum(-1, keepdims=True))
        dq[:, :, i] = ds @ kj
        dk[:, :, j] += ds.transpose(0, 2, 1) @ qi
        dv[:, :, j] += p.transpose(0, 2, 1) @ doi
    return out, dq, dk, dv


def _inputs(*, batch=2, length=16, heads=4, kv_heads=2, dims=8, packed=True, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, length, heads, dims)) / np.sqrt(dims)
    k = rng.normal(size=(batch, length, kv_heads, dims))
    v = rng.normal(size=(batch, length, kv_heads, dims))
    dout = rng.normal(size=(batch, length, heads, dims))
    segments = None
    if packed:  # documents of uneven lengths, a padding tail (id 0), one unpacked row
        cut1, cut2 = length // 3, length - 3
        row = [1] * cut1 + [2] * (cut2 - cut1) + [0] * (length - cut2)
        segments = np.array([row] + [[5] * length] * (batch - 1), np.int32)
    causal = np.tril(np.ones((length, length), bool))[None]
    allowed = (
        causal if segments is None else causal & (segments[:, :, None] == segments[:, None, :])
    )
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    return (
        f32(q),
        f32(k),
        f32(v),
        f32(dout),
        None if segments is None else jnp.asarray(segments),
        np.broadcast_to(allowed, (batch, length, length)),
    )


def _run(fn, q, k, v, dout):
    """fn's output and the vjp of dout through it, in one compiled function."""
    def both(q, k, v, dout):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(dout))
    return [np.asarray(a) for a in jax.jit(both)(q, k, v, dout)]


def _paths(segments):
    """Every attention core that runs on CPU, as fn(q, k, v) for these segment ids."""
    mask = None if segments is None else make_attention_mask(seq_len=segments.shape[1],
                                                              segment_ids=segments)
    return {
        "einsum": lambda q, k, v: einsum_attention(q, k, v, segment_ids=segments),
        "jax_nn_xla": lambda q, k, v: flash_attention(q, k, v, implementation=Impl.XLA, mask=mask),
        "pallas_interpret": lambda q, k, v: pallas_attention(q, k, v, segment_ids=segments,
                                                             interpret=True),
    }


CASES = {  # (packed, kv_heads, length); 12 is not a whole number of Pallas blocks (padded to 16)
    "packed-gqa": (True, 2, 16), "unpacked-gqa": (False, 2, 16), "packed-mha": (True, 4, 16),
    "unpacked-mha": (False, 4, 16), "packed-gqa-padded": (True, 1, 12),
}


# Pallas in interpret mode is slow: it runs the GQA cases only, which cover the same kernel code.
PATH_CASES = [
    (path, case)
    for case in CASES
    for path in ("einsum", "jax_nn_xla", "pallas_interpret")
    if not (path == "pallas_interpret" and case in ("unpacked-mha", "packed-mha"))
]


@pytest.mark.parametrize(("path", "case"), PATH_CASES)
def test_forward_and_gradients_match_float64_reference(path, case):
    packed, kv_heads, length = CASES[case]
    q, k, v, dout, segments, allowed = _inputs(kv_heads=kv_heads, length=length, packed=packed)
    got = _run(_paths(segments)[path], q, k, v, dout)
    want = _reference(q, k, v, dout, allowed)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5, err_msg=f"{path} {case} {name}")
    if packed:  # the reference itself depends on the segments (else the packed cases prove nothing)
        unpacked = _reference(q, k, v, dout, np.tril(np.ones((length, length), bool))[None])
        assert not np.allclose(unpacked[0], want[0])


def test_pallas_blocks_are_powers_of_two_and_the_length_is_padded_to_whole_blocks():
    sizes, padded = pallas_block_sizes(12)
    assert (sizes.block_q, sizes.block_k, sizes.block_q_dq, padded) == (16, 16, 16, 16)
    sizes, padded = pallas_block_sizes(2048)
    assert (sizes.block_q, sizes.block_kv_dkv, padded) == (128, 32, 2048)
    assert pallas_block_sizes(300)[1] == 384  # blocks of 128: 300 -> 3 blocks


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh(
        (1, 2, 2, 1, 2, 1),
        ("pipeline", "data", "fsdp", "seq", "tensor", "expert"),
        axis_types=(jax.sharding.AxisType.Auto,) * 6,
    )


@pytest.mark.parametrize("path", ["pallas_interpret", "jax_nn_xla"])
def test_sharded_equals_one_device(path, mesh):
    """Batch over data x fsdp, heads over tensor (the rules table's attention activations): the
    Pallas kernel runs per shard under shard_map and must give the one-device numbers."""
    q, k, v, dout, segments, _ = _inputs(batch=4, heads=4, kv_heads=2, length=16)
    fn = _paths(segments)[path]
    want = _run(fn, q, k, v, dout)
    heads = NamedSharding(mesh, PartitionSpec(("data", "fsdp", "expert"), None, "tensor", None))
    kv_rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp", "expert"), None, None, None))
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp", "expert"), None))
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        segments_sharded = jax.device_put(segments, rows)
        fn = _paths(segments_sharded)[path]
        args = [jax.device_put(q, heads), jax.device_put(k, kv_rows), jax.device_put(v, kv_rows),
                jax.device_put(dout, heads)]
        got = _run(fn, *args)
        if path == "pallas_interpret":  # the kernel really runs per shard
            assert "shard_map" in str(jax.make_jaxpr(fn)(*args[:3]))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"{path} {name}")


# ---------------------------------------------------------------------------- choosing a kernel
def _resolve(requested, **overrides):
    facts = dict(dtype=jnp.bfloat16, head_dim=128, seq_len=2048, dense_bias=False, has_bias=False,
                 backend="gpu", compute_capability="9.0")
    facts.update(overrides)
    return resolve_implementation(requested, **facts)


def test_auto_picks_cudnn_where_it_fits_and_xla_elsewhere():
    assert _resolve("auto") is Impl.CUDNN
    assert _resolve("auto", head_dim=256) is Impl.CUDNN  # Hopper
    assert _resolve("auto", head_dim=256, compute_capability="8.0") is Impl.XLA  # Ampere: <= 128
    assert _resolve("auto", dtype=jnp.float32) is Impl.XLA
    assert _resolve("auto", head_dim=100) is Impl.XLA
    assert _resolve("auto", backend="cpu") is Impl.XLA
    assert _resolve("auto", dense_bias=True, seq_len=2047) is Impl.XLA
    assert resolve_implementation("auto", dtype=jnp.bfloat16, head_dim=64, seq_len=8,
                                  dense_bias=False, has_bias=False) is Impl.XLA  # this CPU job
    assert _resolve("xla") is Impl.XLA and _resolve("pallas_triton") is Impl.PALLAS_TRITON


@pytest.mark.parametrize("overrides, reason", [
    ({"backend": "cpu"}, "JAX backend is 'cpu'"),
    ({"dtype": jnp.float32}, "bfloat16 or float16 activations, and the compute dtype is float32"),
    ({"head_dim": 300}, "at most 256 .*got 300"),
    ({"head_dim": 100}, "multiple of 8 .*got 100"),
    ({"head_dim": 192, "compute_capability": "8.0"}, "at most 128 .*got 192"),
    ({"dense_bias": True, "seq_len": 2047}, "even sequence length, got 2047"),
])
def test_cudnn_where_it_cannot_run_is_one_error_naming_why(overrides, reason):
    with pytest.raises(SettingError, match=reason) as info:
        _resolve("cudnn", **overrides)
    assert "\n" not in str(info.value) and "'auto'" in str(info.value)


def test_pallas_where_it_cannot_run_is_one_error_naming_why():
    with pytest.raises(SettingError, match="backend is 'cpu'"):
        _resolve("pallas_triton", backend="cpu")
    with pytest.raises(SettingError, match="no logit bias"):
        _resolve("pallas_triton", has_bias=True)


def _tiny_model(implementation):
    return Transformer(TransformerConfig(
        vocab_size=16, num_layers=1, model_dims=16, num_heads=2, dims_per_head=8, hidden_dims=16,
        max_seq_len=8, attention_kind="flash", attention_implementation=implementation))


@pytest.mark.parametrize("implementation, reason", [
    ("cudnn", "'cudnn' .*cannot run: cuDNN flash attention runs on NVIDIA GPUs"),
    ("pallas_triton", "'pallas_triton' cannot run: the Pallas-Triton attention kernel runs on"),
])
def test_a_named_kernel_the_backend_cannot_run_fails_while_tracing(implementation, reason):
    """eval_shape traces and never compiles: the error comes before any compilation."""
    tokens = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(SettingError, match=reason):
        jax.eval_shape(_tiny_model(implementation).init, jax.random.key(0), tokens)


def test_named_kernel_with_dot_product_kind_is_refused():
    with pytest.raises(ValueError, match="'cudnn' is a fused kernel and attention kind "
                                         "'dot_product'"):
        TransformerConfig(vocab_size=16, num_layers=1, model_dims=16, num_heads=2, dims_per_head=8,
                          hidden_dims=16, max_seq_len=8, attention_implementation="cudnn")
