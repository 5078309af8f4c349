"""Llama 4's attention pieces: chunked local attention, the weightless q/k norm after RoPE, and
the per-position query temperature of its NoPE layers.

Apart from models/attention.py, which calls them, so that the Attention module keeps its length
and the rules of these pieces read together:

- Chunked attention (``TransformerConfig.attention_chunk_size`` on the ``chunked_attention``
  layers): the positions are cut into chunks of C, and a query sees the keys of its own chunk
  only, causally: key j is visible to query i when ``j <= i`` and ``j // C == i // C``. So the
  first query of a chunk sees itself alone, however long the context. The rule compares
  *positions*, training's and the KV cache's alike (``cached_positions``), so decoding masks the
  cache at the right absolute positions. Only the einsum cores take the mask; the fused kernels
  have no chunk pattern (refused by the config, and here for a direct caller), nor does the
  sequence-parallel core (refused in attention.py).
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

from paxlite.errors import SettingError
from paxlite.models.attention_kernels import make_attention_mask, sliding_window_mask


def chunk_mask(q_positions: jax.Array, k_positions: jax.Array, *, chunk: int) -> jax.Array:
    """bool [B, 1, T, S]: True where the key's position is in the query's chunk of ``chunk``
    positions (causality is the other masks' part). q_positions [B, T], k_positions [B, S]."""
    same = (q_positions // chunk)[:, :, None] == (k_positions // chunk)[:, None, :]  # [B, T, S]
    return same[:, None]


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


def refuse_fused_chunks(chunk: int | None) -> None:
    """The fused kernels are causal or windowed, never chunked."""
    if chunk is not None:
        raise SettingError(f"attention_chunk_size={chunk} (chunked attention) cannot run in a "
                           "fused attention kernel, which has no chunk pattern; use attention "
                           "kind 'dot_product'")


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
