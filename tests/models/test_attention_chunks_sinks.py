"""Llama 4's chunked attention and gpt-oss's sinks in the fused core (AttentionKind.FLASH): the XLA
kernel against the einsum core (outputs and the gradients of q, k, v and the sinks, float32) and
against float64 NumPy for one case, the splash kernel interpreted on the CPU against the einsums
(one device and a data x tensor mesh), the one-line refusals of the kernels that have neither, and
tiny Llama 4- and gpt-oss-like models whose FLASH logits equal their DOT_PRODUCT ones, on one
device and on an fsdp x tensor mesh. The splash kernel compiled on a chip:
tests/models/test_attention_tpu.py.

Before this, every fused kernel refused chunks and sinks (``refuse_fused_chunks``, and
``sinks_param`` raising "attention sinks (gpt-oss) run in the einsum cores only").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from paxlite.errors import SettingError
from paxlite.models.attention_kernels import (
    AttentionImplementation,
    auto_choice_message,
    cudnn_problems,
    einsum_attention,
    flash_attention,
    resolve_implementation,
)
from paxlite.models.chunked_attention import local_mask
from paxlite.models.kernel_masks import chunk_segment_ids, make_attention_mask
from paxlite.models.transformer import Transformer, logical_param_axes
from paxlite.parallel.mesh import MeshConfig, build_mesh
from paxlite.parallel.rules import DEFAULT_RULES, logical_to_shardings
from tests.models.test_gpt_oss_layers import _gpt_oss
from tests.models.test_llama4_layers import _llama4
from tests.models.test_seq_parallel_transformer import make_mesh, random_params

Impl = AttentionImplementation
# name: (chunk, sinks, sliding window, packed, kv heads); 4 query heads, 8 dims per head
CASES = {
    "chunk_gqa": (4, False, None, False, 2),
    "chunk_packed": (4, False, None, True, 2),  # positions restart in each document
    "sinks_gqa": (None, True, None, False, 2),
    "sinks_window_packed": (None, True, 5, True, 4),  # gpt-oss's sliding layers
    "chunk_sinks_packed_gqa": (3, True, None, True, 1),
}


def _inputs(length, kv, packed, *, seed=0, batch=2, heads=4, dims=8):
    """q (prescaled), k, v, the cotangent, sinks [N], segment ids or None, positions [B, T]."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, length, heads, dims)) / np.sqrt(dims)
    k, v = (rng.normal(size=(batch, length, kv, dims)) for _ in range(2))
    dout = rng.normal(size=(batch, length, heads, dims))
    sinks = rng.normal(size=heads) + np.array([0.0, 1.0, -1.0, 2.0])
    arrays = [jnp.asarray(a, jnp.float32) for a in (q, k, v, dout, sinks)]
    positions = np.broadcast_to(np.arange(length), (batch, length)).astype(np.int32)
    segments = None
    if packed:  # uneven documents, positions from 0 in each, padding (id 0, position 0) last
        cuts = [(length // 3 + 2 * b, length - 3 - b) for b in range(batch)]
        segments = np.stack([np.searchsorted(np.asarray(c), np.arange(length), side="right") + 1
                             for c in cuts]).astype(np.int32)
        segments[:, -2:] = 0
        positions = np.zeros_like(segments)
        for b in range(batch):
            for s in np.unique(segments[b]):
                where = segments[b] == s
                positions[b, where] = 0 if s == 0 else np.arange(where.sum())
        segments = jnp.asarray(segments)
    return (*arrays, segments, jnp.asarray(positions))


def _case_inputs(case, length):
    chunk, with_sinks, window, packed, kv = CASES[case]
    q, k, v, dout, sinks, segments, positions = _inputs(length, kv, packed)
    return (chunk, sinks if with_sinks else None, window, q, k, v, dout, segments, positions)


def _grads(attend, q, k, v, dout, sinks):
    """(out, dq, dk, dv[, dsinks]) of sum(out * dout)."""
    args = (q, k, v) if sinks is None else (q, k, v, sinks)
    out, vjp = jax.vjp(attend, *args)
    return (out, *vjp(dout))


def _einsum(case, length):
    chunk, sinks, window, q, k, v, dout, segments, positions = _case_inputs(case, length)

    def attend(q, k, v, *sinks_arg):
        mask = local_mask(None, positions, positions, length=length, segment_ids=segments,
                          window=window, chunk=chunk)
        mask = make_attention_mask(seq_len=length, segment_ids=segments) if mask is None else mask
        return einsum_attention(q, k, v, mask=mask, sinks=sinks_arg[0] if sinks_arg else None)

    with jax.default_matmul_precision("highest"):
        return jax.device_get(jax.jit(lambda *a: _grads(attend, *a))(q, k, v, dout, sinks))


def _fused(case, length, implementation, *, interpret=False):
    chunk, sinks, window, q, k, v, dout, segments, positions = _case_inputs(case, length)

    def attend(q, k, v, *sinks_arg):
        mask = None if segments is None else make_attention_mask(seq_len=length,
                                                                 segment_ids=segments)
        return flash_attention(q, k, v, implementation=implementation, mask=mask,
                               segment_ids=segments, sliding_window=window, chunk=chunk,
                               positions=positions, sinks=sinks_arg[0] if sinks_arg else None,
                               interpret=interpret)

    with jax.default_matmul_precision("highest"):
        return jax.device_get(jax.jit(lambda *a: _grads(attend, *a))(q, k, v, dout, sinks))


def _assert_close(got, want, *, rtol):
    """Each of out, dq, dk, dv (and dsinks) within rtol of its reference's largest entry."""
    assert len(got) == len(want)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        error = np.max(np.abs(a - b)) / np.max(np.abs(b))
        assert error < rtol, f"{name}: {error:.2e} of the largest entry"


@pytest.mark.parametrize("case", list(CASES))
def test_xla_kernel_equals_the_einsum_core(case):
    _assert_close(_fused(case, 16, Impl.XLA), _einsum(case, 16), rtol=1e-5)


def test_xla_kernel_against_float64_numpy():
    """Chunks of positions, packed rows, a sink column and one kv head for four query heads, as
    transformers writes it: the sink concatenated to the logits, softmaxed, dropped."""
    chunk, sinks, _, q, k, v, _, segments, positions = _case_inputs("chunk_sinks_packed_gqa", 16)
    got = _fused("chunk_sinks_packed_gqa", 16, Impl.XLA)[0]
    seg, pos = np.asarray(segments), np.asarray(positions)
    slots = np.arange(16)
    allowed = ((slots[:, None] >= slots[None, :])[None] & (seg[:, :, None] == seg[:, None, :])
               & (pos[:, :, None] // chunk == pos[:, None, :] // chunk))  # [B, T, S]
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    k64, v64 = np.repeat(k64, 4, axis=2), np.repeat(v64, 4, axis=2)
    logits = np.where(allowed[:, None], np.einsum("btnh,bsnh->bnts", q64, k64), -np.inf)
    column = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None],
                             logits.shape[:-1] + (1,))
    full = np.concatenate([logits, column], axis=-1)
    probs = np.exp(full - full.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True))[..., :-1]
    want = np.einsum("bnts,bsnh->btnh", probs, v64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_comparison_catches_a_missing_chunk_or_sink():
    # the same call without the chunk, or without the sinks, is far from the reference (jitted: one
    # compile each, not one per primitive as an eager call has)
    chunk, sinks, _, q, k, v, _, segments, positions = _case_inputs("chunk_sinks_packed_gqa", 16)
    want = _einsum("chunk_sinks_packed_gqa", 16)[0]
    mask = make_attention_mask(seq_len=16, segment_ids=segments)
    for drop in ({"chunk": None, "sinks": sinks}, {"chunk": chunk, "sinks": None}):
        out = jax.jit(lambda q, k, v, mask, positions, sinks, chunk=drop["chunk"]: flash_attention(
            q, k, v, implementation=Impl.XLA, mask=mask, positions=positions, chunk=chunk,
            sinks=sinks))(q, k, v, mask, positions, drop["sinks"])
        assert np.max(np.abs(np.asarray(out) - want)) > 1e-2 * np.max(np.abs(want))


def test_chunk_segment_ids_follow_positions():
    segments = jnp.asarray([[1, 1, 1, 1, 1, 2, 2, 2, 0, 0]])
    positions = jnp.asarray([[0, 1, 2, 3, 4, 0, 1, 2, 0, 0]])
    ids = np.asarray(chunk_segment_ids(segments, positions, chunk=2))[0]
    np.testing.assert_array_equal(ids, [0, 0, 1, 1, 2, 3, 3, 4, 5, 5])
    ids = np.asarray(chunk_segment_ids(None, positions, chunk=4))[0]
    np.testing.assert_array_equal(ids, [0, 0, 0, 0, 1, 2, 2, 2, 2, 2])


# the splash kernel interpreted on the CPU: a length of 160 (padded to 256 inside), chunks of 48
SPLASH_CASES = {
    "chunk_gqa": (48, False, None, False, 2),  # JAX's ChunkedCausalMask over the slots
    "chunk_packed": (48, False, None, True, 2),  # segment ids per document and chunk
    "sinks_window_packed": (None, True, 40, True, 2),
}


@pytest.mark.parametrize("case", list(SPLASH_CASES))
def test_interpreted_splash_equals_the_einsum_core(case, monkeypatch):
    monkeypatch.setitem(CASES, case, SPLASH_CASES[case])
    want = _einsum(case, 160)
    _assert_close(_fused(case, 160, Impl.SPLASH, interpret=True), want, rtol=2e-5)


def test_sharded_splash_sinks_equal_one_device(monkeypatch):
    """Batch over `data`, heads (and their sinks) over `tensor`: each shard's kernel takes its
    heads' sinks."""
    monkeypatch.setitem(CASES, "sharded", (None, True, None, True, 2))
    want = _fused("sharded", 128, Impl.SPLASH, interpret=True)
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(2, 1, 2)), devices=jax.devices("cpu")[:4])
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        got = _fused("sharded", 128, Impl.SPLASH, interpret=True)
    _assert_close(got, want, rtol=1e-5)


# ---------------------------------------------------------------------------- choosing a kernel
GPU = dict(dtype=jnp.bfloat16, head_dim=128, seq_len=2048, dense_bias=False, has_bias=False,
           backend="gpu", compute_capability="9.0")


@pytest.mark.parametrize("kernel", ["cudnn", "pallas_triton"])
@pytest.mark.parametrize("layer, names", [
    (dict(chunk=8192), "attention_chunk_size=8192"), (dict(sinks=True), "attention sinks")])
def test_a_named_kernel_without_them_is_one_setting_error(kernel, layer, names):
    with pytest.raises(SettingError, match=f"^attention implementation '{kernel}'") as info:
        resolve_implementation(kernel, **GPU, **layer)
    message = str(info.value)
    assert names in message and "'xla'" in message and "'dot_product'" in message
    assert "\n" not in message
    q = jnp.zeros((1, 8, 2, 8), jnp.float32)
    with pytest.raises(SettingError, match=names):  # a direct caller of a resolved kernel
        flash_attention(q, q, q, implementation=kernel, interpret=True,
                        chunk=layer.get("chunk"), sinks=jnp.zeros(2) if "sinks" in layer else None)


def test_auto_runs_xla_for_them_and_says_why():
    assert resolve_implementation("auto", **GPU) is Impl.CUDNN
    assert resolve_implementation("auto", **GPU, chunk=8192) is Impl.XLA
    assert resolve_implementation("auto", **GPU, sinks=True) is Impl.XLA
    message = auto_choice_message(cudnn_problems(dtype=jnp.bfloat16, head_dim=128, sinks=True))
    assert "runs XLA attention" in message and "attention sinks (gpt-oss)" in message
    assert resolve_implementation("splash", **{**GPU, "backend": "tpu"}, chunk=8192,
                                  sinks=True) is Impl.SPLASH


def test_splash_refuses_a_chunk_and_a_window_together():
    with pytest.raises(SettingError, match=r"^attention implementation 'splash' cannot run: .*"
                                           r"attention_chunk_size=8 or sliding_window=4"):
        resolve_implementation("splash", **{**GPU, "backend": "tpu"}, chunk=8, sliding_window=4)


def test_config_refuses_only_the_kernels_without_them():
    for config in (lambda **c: _llama4(num_layers=2, interval=2, first=1, **c), _gpt_oss):
        assert config(attention_kind="flash").attention_kind.value == "flash"  # AUTO: XLA
        for kernel in ("cudnn", "pallas_triton"):
            with pytest.raises(ValueError, match=f"with attention implementation '{kernel}': "
                                                 "that kernel has no"):
                config(attention_kind="flash", attention_implementation=kernel)


# ------------------------------------------------------------------------------- whole models
def _models():
    llama4 = _llama4(num_layers=2, interval=2, first=1)  # a chunked and a NoPE layer
    gpt_oss = _gpt_oss(max_seq_len=16)  # a sliding and a full layer, sinks on both
    return {"llama4": llama4, "gpt_oss": gpt_oss}


@pytest.fixture(scope="module")
def model_logits():
    """(config, params, tokens, positions, segment ids, DOT_PRODUCT logits) per model: packed rows
    of documents whose positions restart, so the chunks fall where the einsums put them."""
    out = {}
    for name, config in _models().items():
        params = random_params(config, seed=3)
        rng = np.random.default_rng(5)
        tokens = jnp.asarray(rng.integers(0, config.vocab_size, size=(2, 16)), jnp.int32)
        segments = jnp.asarray([[1] * 11 + [2] * 5, [1] * 16], jnp.int32)
        positions = jnp.asarray([list(range(11)) + list(range(5)), list(range(16))], jnp.int32)
        apply = jax.jit(lambda p, t, pos, seg, c=config: Transformer(c).apply(
            {"params": p}, t, positions=pos, segment_ids=seg))
        out[name] = (config, params, tokens, positions, segments,
                     apply(params, tokens, positions, segments))
    return out


@pytest.mark.parametrize("name", ["llama4", "gpt_oss"])
def test_flash_logits_equal_dot_product_on_one_device_and_a_mesh(name, model_logits):
    config, params, tokens, positions, segments, want = model_logits[name]
    flash = dataclasses.replace(config, attention_kind="flash")  # AUTO: XLA on the CPU

    def apply(p, t, pos, seg):
        return Transformer(flash).apply({"params": p}, t, positions=pos, segment_ids=seg)

    got = jax.jit(apply)(params, tokens, positions, segments)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    mesh = make_mesh(fsdp=2, tensor=2)
    shardings = logical_to_shardings(logical_param_axes(flash), mesh, DEFAULT_RULES,
                                     shapes=params)
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        sharded = jax.jit(apply)(jax.device_put(params, shardings), tokens, positions, segments)
    np.testing.assert_allclose(sharded, want, rtol=1e-5, atol=1e-5)
