"""Per-row loss sums from the final hidden states, a block of sequence positions at a time.

For 32k-131k vocabularies the float32 logits [B, T, V] are the largest activation of a step, and
the backward pass of a plain cross entropy keeps them (and the softmax) alive. Here the model stops
at its final norm (hidden [B, T, D]); `lax.scan` walks over blocks of `chunk_size` positions, and
each block projects its own [B, c, V] float32 logits and reduces them to per-row sums. The block is
`jax.checkpoint`ed, so the backward pass recomputes one block's logits at a time instead of storing
all of them: peak logits memory is one block's, not the whole sequence's. The sums, and so the loss
and its gradients, are those of the unchunked computation up to float32 summation order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from paxlite.errors import SettingError

PyTree = Any
# (params, hidden [B, c, D]) -> float32 logits [B, c, V]
Project = Callable[[PyTree, jax.Array], jax.Array]
# (logits [B, c, V], per-position arrays [B, c, ...]) -> per-row sums {name: [B]}
ScoreFn = Callable[[jax.Array, Mapping[str, jax.Array]], dict[str, jax.Array]]


def check_chunk_size(value: object) -> int | None:
    """`value` if it is None or an integer >= 1; else a SettingError naming it."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise SettingError(
        f"LOSS_CHUNK_SIZE must be None (whole sequence) or an integer >= 1 (sequence positions "
        f"per loss block), got {value!r}")


def chunked_row_sums(
    params: PyTree,
    hidden: jax.Array,
    per_position: Mapping[str, jax.Array],
    *,
    project: Project,
    score_fn: ScoreFn,
    chunk_size: int,
) -> dict[str, jax.Array]:
    """Sum of ``score_fn(project(params, hidden block), per_position block)`` over blocks of
    ``chunk_size`` positions: {name: [B]}.

    A `chunk_size` that does not divide T is fine: the last block is padded with positions whose
    arrays are zero (so `per_position` must hold a ``weights`` entry that `score_fn` multiplies
    every sum by; padding then adds exactly zero, to the sums and to the gradients).
    """
    check_chunk_size(chunk_size)
    if "weights" not in per_position:
        raise ValueError("per_position must hold the 'weights' that mask the padded positions")
    batch, length = hidden.shape[:2]
    num_blocks = -(-length // chunk_size)
    pad = num_blocks * chunk_size - length

    def blocks(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:  # [B, T, ...] -> [n, B, c, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = jnp.moveaxis(x.reshape(batch, num_blocks, chunk_size, *x.shape[2:]), 1, 0)
        return nn.with_logical_constraint(x, (None, *axes, *(None,) * (x.ndim - 1 - len(axes))))

    xs = (
        blocks(hidden, ("activation_batch", "activation_length", "activation_embed")),
        {k: blocks(v, ("activation_batch", "activation_length")) for k, v in per_position.items()},
    )

    @jax.checkpoint  # the backward pass recomputes this block's logits rather than storing them
    def block(p: PyTree, h: jax.Array, pos: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        return score_fn(project(p, h), pos)

    abstract = jax.eval_shape(block, params, *jax.tree.map(lambda x: x[0], xs))
    init = {k: jnp.zeros(a.shape, a.dtype) for k, a in abstract.items()}

    def body(carry: dict[str, jax.Array], x) -> tuple[dict[str, jax.Array], None]:
        return jax.tree.map(jnp.add, carry, block(params, *x)), None

    sums, _ = jax.lax.scan(body, init, xs)
    return sums
