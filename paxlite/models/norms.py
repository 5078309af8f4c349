"""Layer normalisations whose statistics are always computed in float32.

Pax GPT sets ``reductions_in_fp32=True`` on every LayerNorm because bfloat16 mean/variance
reductions are not stable enough for training on GPUs; these modules do the same regardless
of the compute dtype, and hand the result back in the compute dtype.

``NormKind`` names them for configs and converters (``TransformerConfig.norm``); it lives here,
below the attention layer, so that the q/k norms of a head can be the model's kind too.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.typing import DTypeLike

NORM_AXES: tuple[str, ...] = ("norm",)


class NormKind(str, enum.Enum):
    """LayerNorm for GPT; RMSNorm for LLaMA-style models; Gemma's RMSNorm times (1 + scale)."""

    LAYER_NORM = "layer_norm"
    RMS_NORM = "rms_norm"
    # Gemma 2/3: x / rms(x) * (1 + scale), scale initialised to 0 and stored as it is (so a
    # Gemma checkpoint's norm weights are copied unchanged); the whole product in float32.
    GEMMA_RMS_NORM = "gemma_rms_norm"


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
        scale = self._per_feature("scale", self._scale_init(), x.shape[-1])
        y = _normalised(x, self.epsilon) * self._gain(scale.astype(jnp.float32))
        return y.astype(self.dtype)

    @staticmethod
    def _scale_init() -> nn.initializers.Initializer:
        return nn.initializers.ones

    @staticmethod
    def _gain(scale: jax.Array) -> jax.Array:
        """What the normalised features are multiplied by (float32)."""
        return scale


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + scale), scale starting at 0."""

    @staticmethod
    def _scale_init() -> nn.initializers.Initializer:
        return nn.initializers.zeros

    @staticmethod
    def _gain(scale: jax.Array) -> jax.Array:
        return 1.0 + scale


def _normalised(x: jax.Array, epsilon: float) -> jax.Array:
    """float32 x / sqrt(mean(x^2) + eps) over the last axis."""
    x32 = x.astype(jnp.float32)
    mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    return x32 * jax.lax.rsqrt(mean_square + epsilon)


def norm_class(kind: NormKind | str) -> type[_Float32Norm]:
    """The module of a NormKind."""
    return {NormKind.LAYER_NORM: LayerNorm, NormKind.RMS_NORM: RMSNorm,
            NormKind.GEMMA_RMS_NORM: GemmaRMSNorm}[NormKind(kind)]
