"""The attention implementations that run on a TPU, on the chip (tests/tpu_pass.py): XLA's
attention (what 'auto' runs there) and the splash kernel, forward and gradients, against Pax's
einsum attention computed on the CPU in float32 at "highest" precision, and against each other.

Cases: causal rows, packed rows (segment ids), grouped kv heads, a sliding window, logit
soft-capping (splash only: XLA's fused API takes no cap), a length that is not a whole number of
128-slot lanes (the kernel pads it), a sharded call (batch and heads over two CPU meshes is the
CPU test's part; one chip has one device), and bfloat16 activations; then Llama 4's chunks and
gpt-oss's sinks in both kernels, forward and the gradients of q, k, v and the sinks. The splash
kernel must be a Mosaic custom call in the compiled program: a fallback to XLA would pass every
number here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxlite.models.attention_kernels import (
    AttentionImplementation,
    einsum_attention,
    flash_attention,
    make_attention_mask,
)
from paxlite.models.kernel_masks import chunk_mask, sliding_window_mask

CASES = {
    # name: (batch, length, heads, kv heads, head dim, packed, window, cap)
    "causal": (2, 512, 4, 4, 128, False, None, None),
    "packed_gqa": (2, 512, 8, 2, 128, True, None, None),
    "window_64": (1, 512, 4, 2, 64, True, 64, None),
    "soft_cap": (2, 256, 4, 4, 128, False, None, 5.0),
    "padded_300": (2, 300, 4, 1, 64, True, None, None),
}


def _inputs(batch, length, heads, kv, dims, packed, *, dtype=jnp.float32):
    rng = np.random.default_rng(length + heads + kv)
    q = rng.standard_normal((batch, length, heads, dims)) * dims**-0.5  # prescaled
    k = rng.standard_normal((batch, length, kv, dims))
    v = rng.standard_normal((batch, length, kv, dims))
    segments = None
    if packed:  # three documents a row, of different lengths in each row
        cuts = [(length // 3 + 7 * b, 2 * length // 3 + 11 * b) for b in range(batch)]
        segments = np.stack([np.searchsorted(np.asarray(c), np.arange(length), side="right") + 1
                             for c in cuts]).astype(np.int32)
    return tuple(np.asarray(a, dtype) for a in (q, k, v)), segments


def _mask(length, segments, window, batch):
    mask = make_attention_mask(seq_len=length, segment_ids=None if segments is None
                               else jnp.asarray(segments))
    if window is not None:
        positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
        mask = mask & sliding_window_mask(positions, positions, window=window)
    return mask


def reference(case, device):
    """(output, gradients of sum(out * cotangent)) of Pax's einsum attention on `device`."""
    batch, length, heads, kv, dims, packed, window, cap = CASES[case]
    (q, k, v), segments = _inputs(batch, length, heads, kv, dims, packed)
    cotangent = np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)

    def f(q, k, v):
        mask = _mask(length, segments, window, batch)
        return einsum_attention(q, k, v, mask=mask, logit_cap=cap)

    with jax.default_device(device), jax.default_matmul_precision("highest"):
        out, vjp = jax.vjp(jax.jit(f), q, k, v)
        return jax.device_get(out), jax.device_get(vjp(jnp.asarray(cotangent)))


def kernel_run(case, implementation, device, *, dtype=jnp.float32, interpret=False):
    """(output, gradients, compiled program text) of `implementation` on `device`."""
    batch, length, heads, kv, dims, packed, window, cap = CASES[case]
    (q, k, v), segments = _inputs(batch, length, heads, kv, dims, packed, dtype=dtype)
    cotangent = np.random.default_rng(1).standard_normal(q.shape).astype(dtype)
    segment_ids = None if segments is None else jnp.asarray(segments)
    implementation = AttentionImplementation(implementation)

    def f(q, k, v):
        mask = None
        if implementation is AttentionImplementation.XLA and (segments is not None):
            mask = _mask(length, segments, None, batch)
        return flash_attention(q, k, v, implementation=implementation, mask=mask,
                               segment_ids=segment_ids, sliding_window=window, logit_cap=cap,
                               interpret=interpret)

    def forward_and_backward(q, k, v, cotangent):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(cotangent)

    # "highest" for float32 (exact comparisons); bfloat16 at the chip's native precision, as
    # training runs it: Mosaic refuses a float32 contract precision on bfloat16 operands, and
    # the kernel's backward pass is traced outside the forward's own precision scope.
    precision = "highest" if jnp.dtype(dtype) == jnp.float32 else "default"
    with jax.default_device(device), jax.default_matmul_precision(precision):
        compiled = jax.jit(forward_and_backward).lower(q, k, v, cotangent).compile()
        out, grads = compiled(q, k, v, cotangent)
        return jax.device_get(out), jax.device_get(grads), compiled.as_text()


def assert_close(got, want, *, rtol):
    """Every array within `rtol` of the reference's largest entry (attention outputs and
    gradients are sums of many terms: an elementwise relative test fails on cancellations)."""
    out, grads = got
    ref_out, ref_grads = want
    for name, a, b in (("out", out, ref_out), *(
            (f"d{x}", g, r) for x, g, r in zip("qkv", grads, ref_grads, strict=True))):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        error = np.max(np.abs(a - b)) / np.max(np.abs(b))
        assert error < rtol, f"{name}: {error:.2e} of the largest entry"


TPU_KERNELS = [(case, "splash") for case in CASES] + [
    (case, "xla") for case, spec in CASES.items() if spec[7] is None]


@pytest.mark.tpu
@pytest.mark.parametrize("case, implementation", TPU_KERNELS)
def test_tpu_attention_equals_einsum_attention(case, implementation):
    # float32 at "highest": the kernel's online softmax (exp and its running rescaling on the
    # chip) left at most 5.3e-5 of the largest entry (dq, first run on the chip, 2026-12-07);
    # a wrong mask or head mapping is off by order 1.
    out, grads, program = kernel_run(case, implementation, jax.devices("tpu")[0])
    assert_close((out, grads), reference(case, jax.devices("cpu")[0]), rtol=1e-4)
    if implementation == "splash":  # the kernel ran, forward and backward (Mosaic custom calls)
        assert program.count("tpu_custom_call") >= 2, "no splash kernel in the compiled program"
    else:
        assert "tpu_custom_call" not in program


@pytest.mark.tpu
@pytest.mark.parametrize("case", ["packed_gqa", "window_64"])
def test_tpu_bfloat16_splash_follows_xla(case):
    # bfloat16 activations: the kernel and XLA's attention round in different places (8 mantissa
    # bits); both stay within 2% of the largest float32 entry.
    tpu = jax.devices("tpu")[0]
    want = reference(case, jax.devices("cpu")[0])
    for implementation in ("splash", "xla"):
        out, grads, _ = kernel_run(case, implementation, tpu, dtype=jnp.bfloat16)
        assert_close((out, grads), want, rtol=2e-2)


# Llama 4's chunks and gpt-oss's sinks (models/kernel_masks.py, models/splash_attention.py).
# name: (batch, length, heads, kv heads, head dim, packed, window, chunk, sinks)
CHUNK_SINK_CASES = {
    # JAX's ChunkedCausalMask over the slots: 4 chunks of 256 in blocks of 512, partly skipped
    "chunk_256": (2, 1024, 4, 2, 128, False, None, 256, False),
    # packed rows chunked by their positions (restarting per document), through the segment ids
    "chunk_packed": (2, 512, 4, 2, 128, True, None, 96, False),
    # gpt-oss's sliding layers: sinks and a window, packed, one kv head per 4 query heads
    "sinks_window_packed": (2, 512, 8, 2, 64, True, 64, None, True),
    "sinks_gqa": (2, 384, 8, 1, 128, False, None, None, True),
}


def _positions(segments, batch, length):
    """Positions restarting at 0 in each document (arange for unpacked rows)."""
    if segments is None:
        return np.broadcast_to(np.arange(length), (batch, length)).astype(np.int32)
    starts = np.concatenate([np.ones((batch, 1), bool), segments[:, 1:] != segments[:, :-1]], 1)
    first = np.maximum.accumulate(np.where(starts, np.arange(length), 0), axis=1)
    return (np.arange(length) - first).astype(np.int32)


def _chunk_sink_inputs(case, dtype=jnp.float32):
    batch, length, heads, kv, dims, packed, window, chunk, with_sinks = CHUNK_SINK_CASES[case]
    (q, k, v), segments = _inputs(batch, length, heads, kv, dims, packed, dtype=dtype)
    positions = _positions(segments, batch, length)
    sinks = (np.random.default_rng(2).standard_normal(heads) + 1.0).astype(np.float32)
    cotangent = np.random.default_rng(1).standard_normal(q.shape).astype(dtype)
    return (q, k, v, sinks if with_sinks else None, cotangent, segments, positions, window,
            chunk)


def _chunk_sink_run(f, q, k, v, sinks, cotangent, device, precision):
    args = (q, k, v) if sinks is None else (q, k, v, sinks)

    def forward_and_backward(cotangent, *args):
        out, vjp = jax.vjp(f, *args)
        return out, vjp(cotangent)

    with jax.default_device(device), jax.default_matmul_precision(precision):
        compiled = jax.jit(forward_and_backward).lower(cotangent, *args).compile()
        out, grads = compiled(cotangent, *args)
        return jax.device_get(out), jax.device_get(grads), compiled.as_text()


def chunk_sink_reference(case, device):
    """(output, gradients of q, k, v[, sinks]) of the einsum core in float32 at "highest"."""
    q, k, v, sinks, cotangent, segments, positions, window, chunk = _chunk_sink_inputs(case)
    length = q.shape[1]

    def f(q, k, v, *sinks):
        mask = make_attention_mask(seq_len=length, segment_ids=None if segments is None
                                   else jnp.asarray(segments))
        pos = jnp.asarray(positions)
        if window is not None:
            mask = mask & sliding_window_mask(pos, pos, window=window)
        if chunk is not None:
            mask = mask & chunk_mask(pos, pos, chunk=chunk)
        return einsum_attention(q, k, v, mask=mask, sinks=sinks[0] if sinks else None)

    out, grads, _ = _chunk_sink_run(f, q, k, v, sinks, cotangent, device, "highest")
    return out, grads


def chunk_sink_kernel_run(case, implementation, device, *, dtype=jnp.float32):
    q, k, v, sinks, cotangent, segments, positions, window, chunk = _chunk_sink_inputs(case, dtype)
    segment_ids = None if segments is None else jnp.asarray(segments)
    implementation = AttentionImplementation(implementation)

    def f(q, k, v, *sinks):
        mask = None
        if implementation is AttentionImplementation.XLA and segments is not None:
            mask = make_attention_mask(seq_len=q.shape[1], segment_ids=segment_ids)
        return flash_attention(q, k, v, implementation=implementation, mask=mask,
                               segment_ids=segment_ids, sliding_window=window, chunk=chunk,
                               positions=jnp.asarray(positions),
                               sinks=sinks[0] if sinks else None)

    precision = "highest" if jnp.dtype(dtype) == jnp.float32 else "default"
    return _chunk_sink_run(f, q, k, v, sinks, cotangent, device, precision)


def assert_chunk_sink_close(got, want, *, rtol):
    """As assert_close, the sinks' gradient (when there are sinks) included."""
    (out, grads), (ref_out, ref_grads) = got, want
    assert len(grads) == len(ref_grads)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads),
                          (ref_out, *ref_grads)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        error = np.max(np.abs(a - b)) / np.max(np.abs(b))
        assert error < rtol, f"{name}: {error:.2e} of the largest entry"


@pytest.mark.tpu
@pytest.mark.parametrize("case", list(CHUNK_SINK_CASES))
@pytest.mark.parametrize("implementation", ["splash", "xla"])
def test_tpu_chunks_and_sinks_equal_einsum_attention(case, implementation):
    # float32 at "highest", as the cases above; dsinks is a sum over every query and dim
    out, grads, program = chunk_sink_kernel_run(case, implementation, jax.devices("tpu")[0])
    want = chunk_sink_reference(case, jax.devices("cpu")[0])
    assert_chunk_sink_close((out, grads), want, rtol=1e-4)
    if implementation == "splash":
        assert program.count("tpu_custom_call") >= 2, "no splash kernel in the compiled program"
    else:
        assert "tpu_custom_call" not in program


@pytest.mark.tpu
@pytest.mark.parametrize("case", ["chunk_packed", "sinks_window_packed"])
def test_tpu_bfloat16_chunks_and_sinks_follow_float32(case):
    # bfloat16 activations (the sinks stay float32): within 2% of the largest float32 entry, as
    # the bfloat16 cases above; JAX 0.10.2's splash sums dsinks in bfloat16, JAX 0.12's in float32
    tpu = jax.devices("tpu")[0]
    want = chunk_sink_reference(case, jax.devices("cpu")[0])
    for implementation in ("splash", "xla"):
        out, grads, _ = chunk_sink_kernel_run(case, implementation, tpu, dtype=jnp.bfloat16)
        assert_chunk_sink_close((out, grads), want, rtol=2e-2)
