"""T5's bucketed relative position bias, as GLaM uses it (Pax ``attentions.RelativeBias``).

Instead of adding position embeddings to the tokens, every attention layer learns one scalar per
head for each *bucket* of key-minus-query distance and adds it to the attention logits. Distances
below ``num_buckets // 2`` each get their own bucket; longer ones share logarithmically wider
buckets up to ``max_distance``, beyond which everything falls into the last bucket. Because the
bias depends only on the distance it extends to any sequence length and ignores where a document
starts, which is why packed rows need nothing beyond their per-document positions.

Einsum letters / shape names: B batch (or 1), T query length, S key length, N heads, X buckets.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.typing import DTypeLike

# Logical axis of the bucket dimension of the bias table. The tables are tiny, so the dimension is
# replicated (no rule maps it, which Flax reads as None); the head dimension follows "heads".
RELPOS_BUCKETS_AXIS: str = "relpos_buckets"


def relative_position_bucket(
    relative_position: jax.Array, *, num_buckets: int, max_distance: int,
    bidirectional: bool = False,
) -> jax.Array:
    """int32 bucket in [0, num_buckets) of each ``key_position - query_position``.

    T5's scheme (Pax ``RelativeBias._relative_position_bucket``). With ``bidirectional=False``
    (causal, GLaM) only the distance back into the past counts, ``n = max(query - key, 0)``, so
    every future key (positive relative position) shares bucket 0 with the query itself; the
    causal mask hides those keys anyway. ``n < num_buckets // 2`` is its own bucket; larger n maps
    to ``num_buckets // 2 + floor(log(n / exact) / log(max_distance / exact) * (num_buckets -
    exact))``, capped at the last bucket. Bidirectional splits the buckets in half, the upper half
    for future keys. The logarithm is taken in float32, as Pax does.
    """
    if num_buckets < 2 or (bidirectional and num_buckets < 4):
        raise ValueError(f"num_buckets={num_buckets} is too small for relative position buckets")
    n = -jnp.asarray(relative_position, jnp.int32)  # how far the key lies in the past
    bucket = jnp.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + jnp.where(n < 0, num_buckets, 0).astype(jnp.int32)
        n = jnp.abs(n)
    else:
        n = jnp.maximum(n, 0)
    max_exact = num_buckets // 2
    if max_distance <= max_exact:
        raise ValueError(
            f"max_distance={max_distance} must exceed the {max_exact} exactly bucketed distances"
        )
    # log(0) is never selected below (n < max_exact there); clamping keeps the graph NaN-free.
    ratio = jnp.maximum(n, max_exact).astype(jnp.float32) / max_exact
    scaled = (jnp.log(ratio) / jnp.log(jnp.float32(max_distance / max_exact))
              * (num_buckets - max_exact))
    large = jnp.minimum(max_exact + scaled.astype(jnp.int32), num_buckets - 1)
    return bucket + jnp.where(n < max_exact, n, large)


class RelativePositionBias(nn.Module):
    """Learned bias [B|1, N, T, S] (float32) added to attention logits, from token positions.

    Parameter ``rel_bias`` [N, X] in Pax's layout (``RelativeBias.wrb``: heads, then buckets), so
    a Pax GLaM checkpoint maps onto it untransposed; logical axes ("heads", "relpos_buckets").
    Initialised N(0, (N * X)**-0.5) as Pax does unless ``init_std`` is given.

    Attributes:
        num_buckets: distance buckets (GLaM: 32).
        max_distance: distance at which the last bucket starts (GLaM: 128).
        num_heads: attention heads; each has its own bias per bucket.
        bidirectional: False (causal LM): future keys all share bucket 0.
        init_std: None for Pax's (num_heads * num_buckets)**-0.5.
        dtype: the table is read in this dtype (as Pax reads it in its activation dtype); the
            result is float32 either way, since it is added to float32 logits.
    """

    num_buckets: int
    max_distance: int
    num_heads: int
    bidirectional: bool = False
    init_std: float | None = None
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32

    @nn.compact
    def __call__(self, query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
        """query_positions int [B|1, T], key_positions int [B|1, S] -> bias f32 [B|1, N, T, S].

        The relative position of key s to query t is ``key_positions[s] - query_positions[t]``
        of the same row, so positions restarting at 0 per packed document give each document the
        same bias as if it were alone in its row.
        """
        if query_positions.ndim != 2 or key_positions.ndim != 2:
            raise ValueError(
                f"positions must be [batch, length], got query {query_positions.shape} and key "
                f"{key_positions.shape}"
            )
        std = (
            (self.num_heads * self.num_buckets) ** -0.5 if self.init_std is None else self.init_std
        )
        table = self.param(
            "rel_bias",
            nn.with_logical_partitioning(
                nn.initializers.normal(stddev=std), ("heads", RELPOS_BUCKETS_AXIS)
            ),
            (self.num_heads, self.num_buckets),
            self.param_dtype,
        )  # [N, X]
        relative = key_positions[:, None, :] - query_positions[:, :, None]  # [B|1, T, S]
        buckets = relative_position_bucket(
            relative, num_buckets=self.num_buckets, max_distance=self.max_distance,
            bidirectional=self.bidirectional,
        )  # [B|1, T, S]
        # A gather rather than Pax's one-hot einsum: the same values without a [B, T, S, X] tensor.
        bias = jnp.take(jnp.asarray(table, self.dtype), buckets, axis=1)  # [N, B|1, T, S]
        return jnp.transpose(bias, (1, 0, 2, 3)).astype(jnp.float32)  # [B|1, N, T, S]
