"""Layer normalisations whose statistics are always computed in float32.

Pax GPT sets ``reductions_in_fp32=True`` on every LayerNorm because bfloat16 mean/variance
reductions are not stable enough for training on GPUs; these modules do the same regardless
of the compute dtype, and hand the result back in the compute dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.typing import DTypeLike

NORM_AXES: tuple[str, ...] = ("norm",)


class LayerNorm(nn.Module):
    """LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * scale + bias."""

    epsilon: float = 1e-5
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        features = x.shape[-1]
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, NORM_AXES),
            (features,), self.param_dtype,
        )
        bias = self.param(
            "bias", nn.with_logical_partitioning(nn.initializers.zeros, NORM_AXES),
            (features,), self.param_dtype,
        )
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
        y = y * scale.astype(jnp.float32) + bias.astype(jnp.float32)
        return y.astype(self.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * scale (no centring, no bias)."""

    epsilon: float = 1e-5
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        features = x.shape[-1]
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, NORM_AXES),
            (features,), self.param_dtype,
        )
        x32 = x.astype(jnp.float32)
        mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        y = x32 * jax.lax.rsqrt(mean_square + self.epsilon) * scale.astype(jnp.float32)
        return y.astype(self.dtype)
