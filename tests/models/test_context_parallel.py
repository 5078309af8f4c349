"""Sequence-parallel attention (models/context_parallel.py) against a float64 NumPy reference.

Each case shards a row over a ``seq`` axis of 2, 4 or 8 of the 8 CPU devices (the rest of them a
``data`` axis that splits the batch), optionally in the dual_chunk_swap order with positions and
segment ids permuted alongside, and checks the output and the gradients of q, k and v, after undoing
the reorder, against hand-written causal masked attention (forward and backward) of the original
row in float64, to 1e-5.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from paxlite.data.context_order import dual_chunk_swap_order, inverse_order
from paxlite.models.context_parallel import ContextParallelStrategy, context_parallel_attention

B, T, N, K, H = 4, 16, 4, 2, 8  # GQA: query head i reads kv head i // 2
PACKED = np.array([[1] * 5 + [2] * 7 + [3] * 4,  # three documents
                   [1] * 9 + [2] * 3 + [0] * 4,  # two documents and padding
                   [1] * 16,  # one document
                   [1, 1, 2, 3, 3, 3, 4, 5, 5, 5, 5, 5, 6, 6, 7, 0]], np.int32)


def _reference(q, k, v, segment_ids, cotangent):
    """float64 causal (slot order) masked GQA attention and the gradients of sum(out *
    cotangent)."""
    q, k, v, g_out = (np.asarray(a, np.float64) for a in (q, k, v, cotangent))
    out, dq, dk, dv = (np.zeros_like(a) for a in (q, q, k, v))
    allowed = np.tril(np.ones((T, T), bool))[None]  # [1, T, S]
    if segment_ids is not None:
        allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])
    allowed = np.broadcast_to(allowed, (B, T, T))
    for b in range(B):
        for i in range(N):
            j = i // (N // K)
            logits = np.where(allowed[b], q[b, :, i] @ k[b, :, j].T, -np.inf)  # [T, S]
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[b, :, i] = p @ v[b, :, j]
            g = g_out[b, :, i]  # [T, H]
            dv[b, :, j] += p.T @ g
            dp = g @ v[b, :, j].T
            ds = p * (dp - (dp * p).sum(-1, keepdims=True))
            dq[b, :, i] = ds @ k[b, :, j]
            dk[b, :, j] += ds.T @ q[b, :, i]
    return out, dq, dk, dv


@pytest.fixture(scope="module")
def tensors():
    rng = np.random.default_rng(0)
    q, cot = (rng.normal(size=(B, T, N, H)).astype(np.float32) for _ in range(2))
    k, v = (rng.normal(size=(B, T, K, H)).astype(np.float32) for _ in range(2))
    return q * H**-0.5, k, v, cot


def _sharded_value_and_grads(mesh, strategy, q, k, v, positions, segment_ids, cot, *,
                             batch_axes=("data",), head_axes=()):
    act = NamedSharding(mesh, PartitionSpec(batch_axes or None, "seq", head_axes or None, None))
    tok = NamedSharding(mesh, PartitionSpec(batch_axes or None, "seq"))

    def loss(q_, k_, v_, pos_, seg_, cot_):
        out = context_parallel_attention(
            q_, k_, v_, q_positions=pos_, kv_positions=pos_, segment_ids=seg_,
            strategy=strategy, mesh=mesh, batch_axes=batch_axes, head_axes=head_axes)
        return jnp.sum(out * cot_), out

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    put = lambda a, s: None if a is None else jax.device_put(jnp.asarray(a), s)
    (_, out), grads = fn(put(q, act), put(k, act), put(v, act), put(positions, tok),
                         put(segment_ids, tok), put(cot, act))
    assert out.sharding.spec == act.spec, out.sharding.spec
    return np.asarray(out), *(np.asarray(g) for g in grads)


@pytest.mark.parametrize("strategy", list(ContextParallelStrategy))
@pytest.mark.parametrize("seq", [2, 4, 8])
@pytest.mark.parametrize("balanced", [False, True], ids=["slot_order", "dual_chunk_swap"])
def test_exact_to_float64_reference(tensors, strategy, seq, balanced) -> None:
    q, k, v, cot = tensors
    mesh = Mesh(np.array(jax.devices()).reshape(8 // seq, seq), ("data", "seq"))
    order = dual_chunk_swap_order(T, seq) if balanced else np.arange(T)
    undo = inverse_order(order)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    for segment_ids in (None, PACKED):
        want = _reference(q, k, v, segment_ids, cot)
        got = _sharded_value_and_grads(
            mesh, strategy, q[:, order], k[:, order], v[:, order], positions[:, order],
            None if segment_ids is None else segment_ids[:, order], cot[:, order])
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            np.testing.assert_allclose(g[:, undo], w, atol=1e-5, rtol=1e-5,
                                       err_msg=f"{name} packed={segment_ids is not None}")


@pytest.mark.parametrize("strategy", list(ContextParallelStrategy))
def test_heads_sharded_over_a_tensor_axis(tensors, strategy) -> None:
    """seq 2 x tensor 2 x data 2: each tensor shard holds one kv head and its two query heads."""
    q, k, v, cot = tensors
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "seq", "tensor"))
    order = dual_chunk_swap_order(T, 2)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    want = _reference(q, k, v, PACKED, cot)
    got = _sharded_value_and_grads(mesh, strategy, q[:, order], k[:, order], v[:, order],
                                   positions[:, order], PACKED[:, order], cot[:, order],
                                   head_axes=("tensor",))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g[:, inverse_order(order)], w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strategy", list(ContextParallelStrategy))
def test_rope_positions_restarting_per_document_mask_the_same(tensors, strategy) -> None:
    """Packed rows' positions restart at 0 per document (and padding sits at 0): inside every
    document that masks as the slot order does, so every real token's output is the reference's."""
    q, k, v, cot = tensors
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "seq"))
    rope = np.zeros((B, T), np.int32)
    for b in range(B):
        for s in np.unique(PACKED[b]):
            where = PACKED[b] == s
            rope[b, where] = 0 if s == 0 else np.arange(where.sum())
    order = dual_chunk_swap_order(T, 4)
    out = _sharded_value_and_grads(mesh, strategy, q[:, order], k[:, order], v[:, order],
                                   rope[:, order], PACKED[:, order], cot[:, order])[0]
    real = PACKED > 0
    want = _reference(q, k, v, PACKED, cot)[0]
    np.testing.assert_allclose(out[:, inverse_order(order)][real], want[real], atol=1e-5,
                               rtol=1e-5)


def test_refuses_a_missing_axis_and_an_indivisible_length(tensors) -> None:
    q, k, v, _ = tensors
    pos = jnp.zeros((B, T), jnp.int32)
    mesh = Mesh(np.array(jax.devices()).reshape(8, 1), ("data", "model"))
    with pytest.raises(ValueError, match=r"needs a mesh axis 'seq'; the mesh has axes \('data', "
                                         r"'model'\)"):
        context_parallel_attention(q, k, v, q_positions=pos, kv_positions=pos, mesh=mesh)
    mesh = Mesh(np.array(jax.devices()[:3]), ("seq",))
    with pytest.raises(ValueError, match="sequence length 16 is not divisible by the 'seq' axis "
                                         "size 3"):
        context_parallel_attention(q, k, v, q_positions=pos, kv_positions=pos, mesh=mesh,
                                   strategy="ring")
    with pytest.raises(ValueError, match="'sideways' is not a valid ContextParallelStrategy"):
        context_parallel_attention(q, k, v, q_positions=pos, kv_positions=pos, mesh=mesh,
                                   strategy="sideways")


def test_uses_the_current_mesh_when_none_is_given(tensors) -> None:
    """Inside ``jax.set_mesh`` (as a model under a run's mesh would be) mesh=None finds the axis."""
    q, k, v, cot = tensors
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "seq"))
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    act = NamedSharding(mesh, PartitionSpec("data", "seq", None, None))
    tok = NamedSharding(mesh, PartitionSpec("data", "seq"))
    args = [jax.device_put(jnp.asarray(a), s) for a, s in
            ((q, act), (k, act), (v, act), (positions, tok), (PACKED, tok))]

    @jax.jit
    def attend(q_, k_, v_, pos_, seg_):
        return context_parallel_attention(q_, k_, v_, q_positions=pos_, kv_positions=pos_,
                                          segment_ids=seg_, strategy="ring", batch_axes=("data",))

    with jax.set_mesh(mesh):
        out = attend(*args)
    np.testing.assert_allclose(np.asarray(out), _reference(q, k, v, PACKED, cot)[0], atol=1e-5,
                               rtol=1e-5)
