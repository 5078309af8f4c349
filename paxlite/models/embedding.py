"""Lookup tables: token embeddings (optionally reused as the softmax weight) and positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.typing import DTypeLike


class Embed(nn.Module):
    """A ``[num_embeddings, features]`` table, looked up by id and optionally attended to.

    The same class serves the token table (axes ``('vocab', 'embed')``) and the learned absolute
    position table (axes ``('position', 'embed')``); the param is always called ``embedding``.
    Lookups are a gather, then a cast to the compute dtype, so the whole table is never copied
    into the compute dtype just to read a few rows.
    """

    num_embeddings: int
    features: int
    axes: tuple[str, str] = ("vocab", "embed")
    init_std: float = 0.02
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32

    def setup(self) -> None:
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(stddev=self.init_std), self.axes),
            (self.num_embeddings, self.features),
            self.param_dtype,
        )

    def __call__(self, ids: jax.Array) -> jax.Array:
        """ids int [B, T] -> [B, T, features] in dtype."""
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"Embed ids must be integers, got dtype {ids.dtype}")
        return jnp.take(self.embedding, ids, axis=0).astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """x [B, T, features] -> [B, T, num_embeddings]: the tied softmax weight, no bias."""
        table = self.embedding.astype(self.dtype)
        return jnp.einsum("BTD,VD->BTV", x.astype(self.dtype), table)
