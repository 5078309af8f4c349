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


class _Float32Norm(nn.Module):
    """What both norms share: the settings, and per-feature parameters on the ``norm`` axis."""

    epsilon: float = 1e-5
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32

    def _per_feature(self, name: str, init: nn.initializers.Initializer,
                     features: int) -> jax.Array:
        return self.param(name, nn.with_logical_partitioning(init, NORM_AXES), (features,),
                          self.param_dtype)


class LayerNorm(_Float32Norm):
    """LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * scale + bias."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        features = x.shape[-1]
        scale = self._per_feature("scale", nn.initializers.ones, features)
        bias = self._per_feature("bias", nn.initializers.zeros, features)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
        y = y * scale.astype(jnp.float32) + bias.astype(jnp.float32)
        return y.astype(self.dtype)


class RMSNorm(_Float32Norm):
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * scale (no centring, no bias)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        features = x.shape[-1]
        scale = self._per_feature("scale", nn.initializers.ones, features)
        x32 = x.astype(jnp.float32)
        mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        y = x32 * jax.lax.rsqrt(mean_square + self.epsilon) * scale.astype(jnp.float32)
        return y.astype(self.dtype)
