"""The masks attention runs under, and XLA's fused attention with Llama 4's chunks and gpt-oss's
sinks.

Below every attention core: the einsum and fused cores (models/attention_kernels.py), the splash
kernel (models/splash_attention.py), Llama 4's pieces (models/chunked_attention.py) and the
sequence-parallel core take their masks from here, and nothing here imports them back.

- ``make_attention_mask``: causal, within packed segments; ``sliding_window_mask`` and
  ``chunk_mask`` narrow it by positions.
- ``xla_attention``: ``jax.nn.dot_product_attention(implementation='xla')`` with a chunk and/or
  sinks. The chunk is one more boolean mask (by positions, as the einsum cores compare them)
  ANDed with the caller's. The sinks (models/attention_sinks.py) ride in one extra key slot past
  the last key: its key and value are zero and its logit is the head's sink, given through
  ``bias`` (0 on the real keys). The slot is visible to every query, so the causal and window
  masks are built here: ``is_causal`` and ``local_window_size`` would hide a key after the
  query. The softmax then runs over the real keys and the sink column, and the zero value row
  adds nothing: ``softmax_with_sinks`` times v, exactly, and the sinks' gradient flows through
  the bias. XLA's implementation adds the bias to float32 logits (the promotion of q's dtype and
  float32), so the sinks stay float32 as in the einsum cores.
- ``chunk_segment_ids``: the chunks of packed rows as segment ids, for the splash kernel, which
  masks by segment ids inside the kernel.
- ``chunk_sink_problems``: the clause a kernel without chunks or sinks gives (cuDNN as paxlite
  calls it, Pallas-Triton).

Shapes: q [B, T, N, H] (prescaled), k and v [B, S, K, H], K dividing N (query head i reads kv
head i // (N / K)); positions and segment ids [B, T].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Pax uses -0.7 * max(float32) rather than -inf so that a fully masked row stays finite.
LARGE_NEGATIVE: float = -0.7 * float(jnp.finfo(jnp.float32).max)


def make_attention_mask(*, seq_len: int, segment_ids: jax.Array | None) -> jax.Array:
    """Boolean mask [B or 1, 1, T, S]: True where query t may attend to key s.

    Causal, and with packed rows also restricted to keys of the same segment, so that documents
    packed into one row never see each other.
    """
    idx = jnp.arange(seq_len)
    mask = idx[:, None] >= idx[None, :]  # [T, S]
    if segment_ids is None:
        return mask[None, None, :, :]
    if segment_ids.ndim != 2 or segment_ids.shape[1] != seq_len:
        raise ValueError(
            f"segment_ids must have shape [batch, {seq_len}], got {segment_ids.shape}"
        )
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, S]
    return (mask[None, :, :] & same_segment)[:, None, :, :]


def sliding_window_mask(q_positions: jax.Array, k_positions: jax.Array, *, window: int
                        ) -> jax.Array:
    """bool [B, 1, T, S]: True where the key's position j is within ``window`` of the query's i,
    i - window < j (the window holds ``window`` positions, the query's own included); causality
    (j <= i) is the other masks' part. q_positions [B, T], k_positions [B, S]."""
    distance = q_positions[:, :, None] - k_positions[:, None, :]  # [B, T, S]
    return (distance < window)[:, None]


def chunk_mask(q_positions: jax.Array, k_positions: jax.Array, *, chunk: int) -> jax.Array:
    """bool [B, 1, T, S]: True where the key's position is in the query's chunk of ``chunk``
    positions (causality is the other masks' part). q_positions [B, T], k_positions [B, S]."""
    same = (q_positions // chunk)[:, :, None] == (k_positions // chunk)[:, None, :]  # [B, T, S]
    return same[:, None]


def chunk_segment_ids(segment_ids: jax.Array | None, positions: jax.Array, *, chunk: int
                      ) -> jax.Array:
    """int32 [B, T]: one id per run of slots in the same segment and the same chunk of
    ``chunk`` positions (segment_ids None: one segment a row). Two slots share an id exactly when
    ``chunk_mask`` and the segment ids both let them see each other, for rows whose documents
    are contiguous runs of slots with increasing positions (how packing lays them out)."""
    block = positions // chunk
    starts = block[:, 1:] != block[:, :-1]  # [B, T - 1]: a new run at slot t + 1
    if segment_ids is not None:
        starts = starts | (segment_ids[:, 1:] != segment_ids[:, :-1])
    starts = jnp.concatenate([jnp.zeros_like(starts[:, :1]), starts], axis=1)
    return jnp.cumsum(starts, axis=1, dtype=jnp.int32)


def chunk_sink_problems(kernel: str, *, chunk: int | None, sinks: bool) -> list[str]:
    """Why ``kernel``, which has no chunk pattern and no sink logit, cannot run a layer with
    ``chunk`` (attention_chunk_size) or ``sinks``: one clause naming what does ([] for neither)."""
    settings = ([] if chunk is None else [f"attention_chunk_size={chunk} (chunked attention)"]
                ) + (["attention sinks (gpt-oss)"] if sinks else [])
    if not settings:
        return []
    return [(f"{kernel} takes no {' and no '.join(settings)} ('xla' runs them, as 'auto' does, "
             "'splash' on a TPU, or attention kind 'dot_product')")]


def xla_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, mask: jax.Array | None,
    bias: jax.Array | None, sliding_window: int | None, chunk: int | None,
    positions: jax.Array | None, sinks: jax.Array | None,
) -> jax.Array:
    """Causal XLA attention of prescaled q [B, T, N, H] over k, v [B, T, K, H] -> [B, T, N, H]
    (the module docstring). mask: bool [B|1, 1, T, T], a subset of causal (None: causal);
    bias: float [B|1, N|1, T, T]; sliding_window: query slot i sees slots j > i - window;
    chunk: keys in the query's chunk of positions only (``positions`` [B, T]); sinks: float [N]
    logits in every softmax. Each of them None: not applied."""
    batch, length, n, _ = q.shape
    if chunk is not None:
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        narrowed = chunk_mask(positions, positions, chunk=chunk)  # [B, 1, T, T]
        mask = narrowed if mask is None else mask & narrowed
    if sinks is None:
        window = None if sliding_window is None else (sliding_window - 1, 0)
        return jax.nn.dot_product_attention(
            q, k, v, bias=bias, mask=mask, scale=1.0, is_causal=True, implementation="xla",
            local_window_size=window)
    slots = jnp.arange(length)
    visible = slots[:, None] >= slots[None, :]  # causal [T, T]
    if sliding_window is not None:
        visible = visible & (slots[:, None] - slots[None, :] < sliding_window)
    visible = visible[None, None] if mask is None else mask & visible  # [B|1, 1, T, T]
    visible = jnp.concatenate([visible, jnp.ones(visible.shape[:-1] + (1,), bool)], axis=-1)
    zero = jnp.zeros((k.shape[0], 1, *k.shape[2:]), k.dtype)  # [B, 1, K, H]: the sink's slot
    k = jnp.concatenate([k, zero], axis=1)  # [B, T + 1, K, H]
    v = jnp.concatenate([v, zero.astype(v.dtype)], axis=1)
    sink = sinks.astype(jnp.float32)[None, :, None, None]  # [1, N, 1, 1]
    if bias is None:  # [1, N, 1, T + 1]: 0 on every key, the sink on the extra slot
        bias = jnp.concatenate([jnp.zeros((1, n, 1, length), jnp.float32), sink], axis=-1)
    else:  # [B|1, N, T, T + 1]
        rows = bias.shape[0]
        bias = jnp.broadcast_to(bias.astype(jnp.float32), (rows, n, length, length))
        bias = jnp.concatenate([bias, jnp.broadcast_to(sink, (rows, n, length, 1))], axis=-1)
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=visible, scale=1.0,
                                        is_causal=False, implementation="xla")
