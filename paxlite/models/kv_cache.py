"""The KV cache of incremental decoding: one attention layer's keys, values and their positions.

Kept apart from models/attention.py, which calls ``extend_cache`` from its decoding path; the
cache's layout and logical axes are models/decode.py's (``cache_logical_axes``).

Einsum letters: B batch, T new tokens, S cache slots (S_max), K kv heads, H dims per head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from paxlite.parallel import rules as rules_lib


def extend_cache(module: nn.Module, k: jax.Array, v: jax.Array, positions: jax.Array | None, *,
                 kv_axes: tuple[str, ...]) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Writes k, v [B, T, K, H] (after RoPE) and their positions at the cache index of
    ``module`` (an attention layer, whose "cache" collection holds them); returns the whole cache
    (k, v [B, S_max, K, H], positions [B, S_max]) and advances the index.

    The cache keeps the k/v activation layout and logical axes of training, so one rules table
    shards both. It is created by an init pass with the full length (decode.init_cache); that
    pass only allocates it and attends over its own keys.
    """
    batch, length = k.shape[:2]
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    initialized = module.has_variable("cache", "cached_key")
    cached_k = module.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
    cached_v = module.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
    cached_pos = module.variable("cache", "cached_positions", jnp.zeros, positions.shape,
                                 jnp.int32)
    index = module.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
    if not initialized:
        return k, v, positions
    i = index.value
    cached_k.value = rules_lib.logical_constraint(
        jax.lax.dynamic_update_slice(cached_k.value, k.astype(cached_k.value.dtype),
                                     (0, i, 0, 0)), kv_axes)
    cached_v.value = rules_lib.logical_constraint(
        jax.lax.dynamic_update_slice(cached_v.value, v.astype(cached_v.value.dtype),
                                     (0, i, 0, 0)), kv_axes)
    cached_pos.value = jax.lax.dynamic_update_slice(
        cached_pos.value, positions.astype(jnp.int32), (0, i))
    index.value = i + length
    return cached_k.value, cached_v.value, cached_pos.value
