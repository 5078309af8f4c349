"""Attention sinks (gpt-oss): one learned logit per query head that joins every softmax and is
dropped after it.

Each head's probabilities are ``exp(l_s) / (sum_s' exp(l_s') + exp(sink))`` over the keys s it may
see: the sink takes a share of the mass and no value, so a head can attend to "nothing" instead of
spreading its mass over keys it does not need. transformers computes this by concatenating the sink
as an extra column before the softmax and slicing it off after; the same function is computed here
without the concatenation, the maximum taken over the logits and the sink together (masked keys
contribute exp(LARGE_NEGATIVE - max) = 0). The parameter is ``attention/sinks`` [N], float32 logits
like the attention logits they join, on the heads' logical axis.

Where they run: the einsum cores (``softmax_with_sinks``), and the fused core's XLA kernel (an
extra key slot whose logit is the sink, models/kernel_masks.py; AUTO's choice for them) and splash
kernel (its ``sinks`` argument). cuDNN and Pallas-Triton refuse them in one line
(models/attention_kernels.py), and so does the sequence-parallel core (``sinks_param``).

Einsum letters: B batch, N query heads (K kv heads x G heads per kv head), T query length,
S key length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from paxlite.errors import SettingError

SINKS_AXES: tuple[str, ...] = ("heads",)


def sinks_param(layer: nn.Module, *, supported: bool, core: str) -> jax.Array | None:
    """An Attention layer's ``sinks`` [N] when it has them (None otherwise), initialised as
    transformers does (normal(0, init_std)); ``supported``: whether the core the call runs
    (``core``) has a sink logit (all but the sequence-parallel one; SettingError otherwise)."""
    if not layer.sinks:
        return None
    if not supported:
        raise SettingError(f"attention sinks (gpt-oss) cannot run in the {core} core, which has "
                           "no sink logit: use a seq axis of 1")
    return layer.param("sinks", nn.with_logical_partitioning(
        nn.initializers.normal(layer.init_std), SINKS_AXES), (layer.num_heads,),
        layer.param_dtype)  # [N]


def softmax_with_sinks(logits: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """float32 softmax of masked ``logits`` [B, N, T, S] or [B, K, G, T, S] over S, one extra
    logit per head from ``sinks`` [N] in each row's normaliser (None: a plain softmax)."""
    if sinks is None:
        return jax.nn.softmax(logits, axis=-1)
    sink = sinks.astype(jnp.float32)
    if logits.ndim == 5:  # grouped heads: head i = k * G + g
        sink = sink.reshape(logits.shape[1], logits.shape[2])  # [K, G]
    sink = sink.reshape(sink.shape + (1, 1))  # [..., heads, 1, 1] broadcast over T, S
    top = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sink)  # [..., T, 1]
    top = jax.lax.stop_gradient(top)  # any shift gives the same softmax
    weights = jnp.exp(logits - top)
    return weights / (jnp.sum(weights, axis=-1, keepdims=True) + jnp.exp(sink - top))
