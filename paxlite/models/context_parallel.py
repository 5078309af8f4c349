"""Causal self-attention over a sequence sharded on a mesh axis (context / sequence parallelism).

Why: for long rows the [T, T] attention and the per-token activations no longer fit one device;
sharding T over a ``seq`` mesh axis of C devices keeps T/C queries per device. Attention is the
only layer where tokens meet, so it alone needs communication. Two strategies
(``ContextParallelStrategy``), both exact to the unsharded softmax:

- ALL_GATHER (MaxText's default): each shard keeps its T/C queries and all-gathers the keys,
  values, positions and segment ids of the whole row (one collective; [T/C, T] logits per shard);
- RING: keys and values (with their positions and segment ids) go round the ring with ``ppermute``
  C-1 times; each shard folds every block into an online softmax (running max and sum in float32),
  so it never holds more than one remote block ([T/C, T/C] logits per step).

The mask compares *positions*, not slots: query t may see key s iff ``kv_positions[s] <=
q_positions[t]`` and (packed rows) ``segment_ids`` agree. That is what lets a row be reordered for
load balance (data/context_order.py, ``dual_chunk_swap``) with its positions permuted alongside:
the result is the unsharded attention of the original row, permuted. Positions may be each token's
index in the original row (exactly the slot-causal mask of models/attention.py everywhere) or RoPE
positions that restart at 0 per packed document (the same mask inside every segment; they differ
only among padding tokens, segment 0 at position 0, which carry no loss weight and are seen by no
real token).

``Attention`` (models/attention.py) computes its core here whenever the current mesh has a ``seq``
axis larger than 1 (not while decoding), with the strategy of ``TransformerConfig``.

A T5/GLaM relative position bias depends only on the distance between a query and a key, so it
travels as one small vector per head (``distance_bias`` [N, L]: the bias of a key d positions back)
and each shard looks up the [T, S] bias of the keys it holds; no [T, T] bias is ever built whole.

Einsum letters: B batch, T query length (this shard's), S key length (a block or the whole row),
N query heads, K key/value heads, G query heads per kv head (N = K * G; query head i reads kv head
i // G), H dims per head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from paxlite.models.attention_kernels import LARGE_NEGATIVE, einsum_attention
from paxlite.models.parallel_config import ContextParallelStrategy

__all__ = ["ContextParallelStrategy", "context_parallel_attention", "distance_logit_bias",
           "positional_mask"]

DEFAULT_SEQ_AXIS: str = "seq"


def positional_mask(q_positions: jax.Array, kv_positions: jax.Array,
                    q_segment_ids: jax.Array | None,
                    kv_segment_ids: jax.Array | None) -> jax.Array:
    """bool [B, 1, T, S]: True where query t may see key s (causal by position, same segment)."""
    mask = kv_positions[:, None, :] <= q_positions[:, :, None]  # [B, T, S]
    if q_segment_ids is not None:
        mask = mask & (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])
    return mask[:, None]


def distance_logit_bias(distance_bias: jax.Array, q_positions: jax.Array,
                        kv_positions: jax.Array) -> jax.Array:
    """float32 [B, N, T, S]: ``distance_bias`` [N, L] read at d = q_position - kv_position.

    d is clipped to [0, L - 1]: keys ahead of the query (d < 0) are masked anyway, and a vector
    long enough that its last entry is already the farthest bucket covers every longer distance.
    """
    last = distance_bias.shape[1] - 1
    distance = jnp.clip(q_positions[:, :, None] - kv_positions[:, None, :], 0, last)  # [B, T, S]
    bias = jnp.take(distance_bias, distance, axis=1)  # [N, B, T, S]
    return jnp.transpose(bias, (1, 0, 2, 3)).astype(jnp.float32)


def _all_gather_attention(q, k, v, q_pos, kv_pos, seg, dist_bias, *,
                          axis_name: str) -> jax.Array:
    """One shard: its queries [B, T, N, H] against the gathered row's k/v [B, S=C*T, K, H]."""
    gather = functools.partial(jax.lax.all_gather, axis_name=axis_name, axis=1, tiled=True)
    k_all, v_all, kv_pos_all = gather(k), gather(v), gather(kv_pos)  # [B, S, K, H], [B, S]
    seg_all = None if seg is None else gather(seg)
    mask = positional_mask(q_pos, kv_pos_all, seg, seg_all)  # [B, 1, T, S]
    bias = None if dist_bias is None else distance_logit_bias(dist_bias, q_pos, kv_pos_all)
    return einsum_attention(q, k_all, v_all, mask=mask, bias=bias, dtype=q.dtype)


def _ring_attention(q, k, v, q_pos, kv_pos, seg, dist_bias, *, axis_name: str,
                    axis_size: int) -> jax.Array:
    """One shard: online softmax over the C k/v blocks that pass it on the ring.

    After step s the shard holds the block of shard (i - s) mod C; which block comes when does not
    matter, since the mask (and the distance bias) read the positions and segment ids that travel
    with it. A block fully masked for a query row (logits all LARGE_NEGATIVE) adds exp(0) terms only
    while the running max is LARGE_NEGATIVE too; the first visible key rescales them by
    exp(LARGE_NEGATIVE - m) = 0. Every row sees at least its own token, so the final sum is that of
    the visible keys alone.
    """
    batch, length, n, h = q.shape
    kv = k.shape[2]
    qg = q.reshape(batch, length, kv, n // kv, h)  # [B, T, K, G, H]; head i = k*G + g
    perm = [(i, (i + 1) % axis_size) for i in range(axis_size)]

    def fold(state, block):
        running_max, running_sum, acc = state  # [B, K, G, T] f32, same, [B, K, G, T, H] f32
        k_b, v_b, pos_b, seg_b = block
        mask = positional_mask(q_pos, pos_b, seg, seg_b)  # [B, 1, T, S]
        logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k_b).astype(jnp.float32)
        if dist_bias is not None:
            bias = distance_logit_bias(dist_bias, q_pos, pos_b)  # [B, N, T, S]
            logits = logits + bias.reshape(batch, kv, n // kv, *bias.shape[2:])
        logits = jnp.where(mask[:, :, None], logits, LARGE_NEGATIVE)  # [B, K, G, T, S]
        new_max = jnp.maximum(running_max, jax.lax.stop_gradient(jnp.max(logits, axis=-1)))
        scale = jnp.exp(running_max - new_max)  # [B, K, G, T]; 0 where the old max was masked
        p = jnp.exp(logits - new_max[..., None])  # [B, K, G, T, S]
        running_sum = running_sum * scale + jnp.sum(p, axis=-1)
        acc = acc * scale[..., None] + jnp.einsum("BKGTS,BSKH->BKGTH", p,
                                                  v_b.astype(jnp.float32))
        return new_max, running_sum, acc

    shape = (batch, kv, n // kv, length)
    state = (jnp.full(shape, LARGE_NEGATIVE, jnp.float32), jnp.zeros(shape, jnp.float32),
             jnp.zeros(shape + (h,), jnp.float32))
    block = (k, v, kv_pos, seg)
    state = fold(state, block)

    def step(carry, _):
        state, block = carry
        block = jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), block)
        return (fold(state, block), block), None

    if axis_size > 1:
        (state, _), _ = jax.lax.scan(step, (state, block), None, length=axis_size - 1)
    _, running_sum, acc = state
    out = acc / running_sum[..., None]  # [B, K, G, T, H]
    return jnp.einsum("BKGTH->BTKGH", out).reshape(batch, length, n, h).astype(q.dtype)


def context_parallel_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, q_positions: jax.Array,
    kv_positions: jax.Array, segment_ids: jax.Array | None = None,
    distance_bias: jax.Array | None = None,
    strategy: ContextParallelStrategy | str = ContextParallelStrategy.ALL_GATHER,
    mesh: Mesh | None = None, axis_name: str = DEFAULT_SEQ_AXIS,
    batch_axes: tuple[str, ...] = (), head_axes: tuple[str, ...] = (),
) -> jax.Array:
    """Exact causal self-attention of a row sharded on T over ``axis_name``.

    q [B, T, N, H] (already scaled by 1/sqrt(H)), k/v [B, T, K, H] (K divides N), q_positions and
    kv_positions int [B, T] (the mask is causal in them), segment_ids int [B, T] or None (packed
    rows: no attention across segments) -> [B, T, N, H] in q's dtype, softmax in float32.
    distance_bias: None, or float [N, L], added to the logits (before the mask) at
    d = q_position - kv_position clipped to [0, L - 1] (``distance_logit_bias``; a causal relative
    position bias). All sharded on T over ``axis_name``, on B over ``batch_axes`` and on the head
    axes of q/k/v (and of distance_bias) over ``head_axes``; the output is sharded as q. ``mesh``:
    None uses the current mesh (``jax.set_mesh``).
    """
    strategy = ContextParallelStrategy(strategy)
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis_name not in mesh.axis_names:
        raise ValueError(f"context-parallel attention needs a mesh axis {axis_name!r}; the mesh "
                         f"has axes {tuple(mesh.axis_names)}")
    batch, length, n, h = q.shape
    kv = k.shape[2]
    if k.shape != (batch, length, kv, h) or v.shape != k.shape:
        raise ValueError(f"self-attention only: q {q.shape}, k {k.shape} and v {v.shape} must "
                         f"share batch, length and dims per head, and k and v their shape")
    if kv <= 0 or n % kv:
        raise ValueError(f"{kv} kv heads must divide the {n} query heads")
    for name, arr in (("q_positions", q_positions), ("kv_positions", kv_positions),
                      ("segment_ids", segment_ids)):
        if arr is not None and arr.shape != (batch, length):
            raise ValueError(f"{name} must have shape [{batch}, {length}], got {arr.shape}")
    if distance_bias is not None and (distance_bias.ndim != 2 or distance_bias.shape[0] != n):
        raise ValueError(f"distance_bias must have shape [{n}, distances], got "
                         f"{distance_bias.shape}")
    axis_size = mesh.shape[axis_name]
    if length % axis_size:
        raise ValueError(f"sequence length {length} is not divisible by the {axis_name!r} axis "
                         f"size {axis_size}")
    heads = 1
    for axis in head_axes:
        heads *= mesh.shape[axis]
    if kv % heads:
        raise ValueError(f"{kv} kv heads do not divide over the head axes {head_axes} of size "
                         f"{heads}")

    b_spec = batch_axes or None
    h_spec = head_axes or None
    act = PartitionSpec(b_spec, axis_name, h_spec, None)  # q, k, v, out [B, T, N|K, H]
    tok = PartitionSpec(b_spec, axis_name)  # positions, segment ids [B, T]
    if strategy is ContextParallelStrategy.ALL_GATHER:
        body = functools.partial(_all_gather_attention, axis_name=axis_name)
    else:
        body = functools.partial(_ring_attention, axis_name=axis_name, axis_size=axis_size)
    # Optional inputs travel only when given (a None cannot be a shard_map argument).
    optional = (("segment_ids", segment_ids, tok),
                ("distance_bias", distance_bias, PartitionSpec(h_spec, None)))
    given = [(name, arr, spec) for name, arr, spec in optional if arr is not None]

    def shard(q_, k_, v_, qp_, kp_, *rest):
        extra = dict(zip((name for name, _, _ in given), rest, strict=True))
        return body(q_, k_, v_, qp_, kp_, extra.get("segment_ids"), extra.get("distance_bias"))

    specs = (act, act, act, tok, tok, *(spec for _, _, spec in given))
    args = (q, k, v, q_positions, kv_positions, *(arr for _, arr, _ in given))
    return jax.shard_map(shard, mesh=mesh, in_specs=specs, out_specs=act)(*args)
