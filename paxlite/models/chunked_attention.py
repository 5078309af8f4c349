"""Llama 4's attention pieces: chunked local attention, the weightless q/k norm after RoPE, and
the per-position query temperature of its NoPE layers.

Apart from models/attention.py, which calls them, so that the Attention module keeps its length
and the rules of these pieces read together:

- Chunked attention (``TransformerConfig.attention_chunk_size`` on the ``chunked_attention``
  layers): the positions are cut into chunks of C, and a query sees the keys of its own chunk
  only, causally: key j is visible to query i when ``j <= i`` and ``j // C == i // C``. So the
  first query of a chunk sees itself alone, however long the context. The rule compares
  *positions*, training's and the KV cache's alike (``cached_positions``), so decoding masks the
  cache at the right absolute positions. The einsum cores take it as a mask (``local_mask``); the
  fused core hands the chunk to its kernel (models/attention_kernels.py): XLA's attention ANDs
  the same mask by positions, splash runs JAX's chunked causal mask (or, for packed rows, segment
  ids per chunk), and AUTO runs XLA for it; cuDNN and Pallas-Triton refuse it in one line, and so
  does the sequence-parallel core (attention.py).
- The q/k norm (``qk_l2_norm``): each head's q and k divided by their root mean square over the
  head dims, ``x * rsqrt(mean(x^2) + eps)``, in float32 and without weights, *after* RoPE and on
  the RoPE layers only (transformers names it an L2 norm; it is the L2 norm times sqrt(H)).
- The temperature (``query_temperature_floor`` F and ``query_temperature_scale`` s, NoPE layers):
  the query at position p is multiplied by ``1 + s * log(1 + floor((p + 1) / F))``, which is 1 for
  the first F - 1 positions and grows slowly after, keeping long-context attention sharp.

Einsum letters: B batch, T query length, S key length, N heads, H dims per head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paxlite.models.kernel_masks import chunk_mask, make_attention_mask, sliding_window_mask


def local_mask(mask: jax.Array | None, positions: jax.Array | None,
               key_positions: jax.Array | None, *, length: int,
               segment_ids: jax.Array | None, window: int | None,
               chunk: int | None) -> jax.Array | None:
    """The caller's mask (None: causal, made here when needed) restricted to a sliding window
    and/or a chunk: bool [B, 1, T, S]; unchanged when the layer has neither."""
    if window is None and chunk is None:
        return mask
    if mask is None:
        mask = make_attention_mask(seq_len=length, segment_ids=segment_ids)
    if window is not None:
        mask = mask & sliding_window_mask(positions, key_positions, window=window)
    if chunk is not None:
        mask = mask & chunk_mask(positions, key_positions, chunk=chunk)
    return mask


def rms_unit_norm(x: jax.Array, *, epsilon: float) -> jax.Array:
    """x [..., H] divided by its root mean square over H (float32, no weights), in x's dtype."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + epsilon)
            ).astype(x.dtype)


def temperature_scale(positions: jax.Array, *, floor: int, scale: float) -> jax.Array:
    """float32 [B, T, 1, 1]: ``1 + scale * log1p(floor((p + 1) / floor))`` per position p."""
    p = positions.astype(jnp.float32)
    return (jnp.log1p(jnp.floor((p + 1.0) / floor)) * scale + 1.0)[:, :, None, None]


def tune_query_key(q: jax.Array, k: jax.Array, positions: jax.Array | None, *, l2_norm: bool,
                   epsilon: float, temperature: tuple[int, float] | None
                   ) -> tuple[jax.Array, jax.Array]:
    """q [B, T, N, H], k [B, T, K, H] after RoPE -> the same, normed (``l2_norm``) and the query
    tempered (``temperature`` = (floor, scale)), in transformers' order: norm, then temperature."""
    if l2_norm:
        q = rms_unit_norm(q, epsilon=epsilon)
        k = rms_unit_norm(k, epsilon=epsilon)
    if temperature is not None:
        floor, scale = temperature
        q = (q.astype(jnp.float32) * temperature_scale(positions, floor=floor, scale=scale)
             ).astype(q.dtype)
    return q, k
