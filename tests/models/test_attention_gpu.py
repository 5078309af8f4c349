"""The fused GPU attention kernels against JAX's XLA attention in bfloat16, forward and dq, dk, dv:
cuDNN unpacked, cuDNN with the dense packed-rows mask, Pallas-Triton with segment ids; the compiled
step really holds the cuDNN / Triton custom call; a packed Transformer equals its einsum twin.
Skipped without an NVIDIA GPU (tests/conftest.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxlite.models.attention import make_attention_mask
from paxlite.models.attention_kernels import AttentionImplementation as Impl
from paxlite.models.attention_kernels import flash_attention
from paxlite.models.transformer import Transformer, TransformerConfig

pytestmark = pytest.mark.gpu

B, T, N, K, H = 2, 512, 8, 2, 64


@pytest.fixture(scope="module")
def inputs():
    keys = jax.random.split(jax.random.key(0), 4)
    q = (jax.random.normal(keys[0], (B, T, N, H)) * H**-0.5).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, T, K, H)).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, T, K, H)).astype(jnp.bfloat16)
    dout = jax.random.normal(keys[3], (B, T, N, H)).astype(jnp.bfloat16)
    lengths = [[100, 250, 162], [T]]  # uneven documents; the second row unpacked
    segments = np.concatenate([np.repeat(np.arange(1, len(r) + 1), r)[None] for r in lengths])
    return q, k, v, dout, jnp.asarray(segments, jnp.int32)


def _fn(implementation, segments):
    mask = None if segments is None else make_attention_mask(seq_len=T, segment_ids=segments)
    return lambda q, k, v: flash_attention(q, k, v, implementation=implementation, mask=mask,
                                           segment_ids=segments)


def _fwd_bwd(fn, q, k, v, dout):
    def both(q, k, v, dout):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(dout))
    return jax.jit(both)


@pytest.mark.parametrize(
    "implementation, packed",
    [
        (Impl.CUDNN, False),
        (Impl.CUDNN, True),
        (Impl.PALLAS_TRITON, True),
        (Impl.PALLAS_TRITON, False),
    ],
)
def test_fused_kernel_matches_xla_in_bf16(inputs, implementation, packed):
    q, k, v, dout, segments = inputs
    segments = segments if packed else None
    want = _fwd_bwd(_fn(Impl.XLA, segments), q, k, v, dout)(q, k, v, dout)
    got = _fwd_bwd(_fn(implementation, segments), q, k, v, dout)(q, k, v, dout)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        scale = np.abs(w).max()
        np.testing.assert_allclose(g / scale, w / scale, atol=2e-2,
                                   err_msg=f"{implementation.value} packed={packed} {name}")


@pytest.mark.parametrize("implementation, marker", [
    (Impl.CUDNN, "__cudnn$fmha"), (Impl.PALLAS_TRITON, "triton"), (Impl.XLA, None),
])
def test_compiled_step_holds_the_kernel(inputs, implementation, marker):
    q, k, v, dout, segments = inputs
    segments = segments if implementation is Impl.PALLAS_TRITON else None
    hlo = (
        _fwd_bwd(_fn(implementation, segments), q, k, v, dout)
        .lower(q, k, v, dout)
        .compile()
        .as_text()
    )
    if marker is None:
        assert "__cudnn$fmha" not in hlo
    else:
        assert marker in hlo


@pytest.mark.parametrize("implementation", [Impl.AUTO, Impl.CUDNN, Impl.PALLAS_TRITON])
def test_packed_transformer_equals_einsum_attention(implementation):
    """The model's glue (segment ids through the scanned blocks) with each GPU kernel."""
    base = dict(vocab_size=64, num_layers=2, model_dims=128, num_heads=4, num_kv_heads=2,
                dims_per_head=32, hidden_dims=256, max_seq_len=128, dtype="bfloat16",
                scan_layers=True, norm="rms_norm", activation="silu", gated_mlp=True,
                use_bias=False, position_embedding="rotary")
    dense = Transformer(TransformerConfig(**base))
    fused = Transformer(TransformerConfig(**base, attention_kind="flash",
                                          attention_implementation=implementation))
    tokens = jax.random.randint(jax.random.key(1), (2, 128), 0, 64)
    segments = jnp.asarray([[1] * 50 + [2] * 78, [3] * 128], jnp.int32)
    positions = jnp.asarray([[*range(50), *range(78)], [*range(128)]], jnp.int32)
    params = dense.init(jax.random.key(0), tokens)

    def loss(model, params):
        logits = model.apply(params, tokens, positions=positions, segment_ids=segments)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    want_loss, want_grads = jax.jit(jax.value_and_grad(lambda p: loss(dense, p)))(params)
    got_loss, got_grads = jax.jit(jax.value_and_grad(lambda p: loss(fused, p)))(params)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=2e-2)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        scale = max(np.abs(w).max(), 1e-6)
        np.testing.assert_allclose(g / scale, w / scale, atol=5e-2)
