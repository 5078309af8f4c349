"""What a model reports besides its logits, and how a trainer reads it without knowing the model.

Layers ``sow`` into two Flax collections. ``aux_loss``: scalars already weighted, which the
training objective adds as they are (MoE load balancing, router z-loss). ``summaries``: dicts of
scalars, ``self.sow("summaries", NAME, {KEY: value})``, logged as ``NAME/KEY`` averaged over every
layer that sowed them (``moe/aux_loss``, ``moe/dropped_fraction``, ...). Under ``nn.scan`` the
collections are stacked per layer like the parameters; averaging over all elements is the same mean.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

AUX_LOSS_COLLECTION = "aux_loss"
SUMMARIES_COLLECTION = "summaries"
COLLECTIONS: tuple[str, ...] = (AUX_LOSS_COLLECTION, SUMMARIES_COLLECTION)


def total_aux_loss(state: Any) -> jax.Array:
    """The sum of every sown auxiliary loss (0.0 when nothing was sown)."""
    leaves = jax.tree.leaves(state.get(AUX_LOSS_COLLECTION, {}))
    return sum((jnp.sum(leaf.astype(jnp.float32)) for leaf in leaves), jnp.zeros((), jnp.float32))


def summary_means(state: Any) -> dict[str, jax.Array]:
    """``{"NAME/KEY": mean over layers}`` of the sown summaries."""
    groups: dict[str, list[jax.Array]] = {}
    flat = jax.tree_util.tree_flatten_with_path(state.get(SUMMARIES_COLLECTION, {}))[0]
    for path, leaf in flat:
        names = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]
        if len(names) < 2:
            raise ValueError(
                f"summary at {jax.tree_util.keystr(path)} must be sown as a dict of scalars "
                "(self.sow('summaries', NAME, {KEY: value}))"
            )
        groups.setdefault(f"{names[-2]}/{names[-1]}", []).append(
            jnp.ravel(leaf.astype(jnp.float32)))
    return {name: jnp.mean(jnp.concatenate(parts)) for name, parts in sorted(groups.items())}
