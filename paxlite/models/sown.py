"""What a model reports besides its logits, and how a trainer reads it without knowing the model.

Layers ``sow`` into two Flax collections. ``aux_loss``: scalars already weighted, which the
training objective adds as they are (MoE load balancing, router z-loss). ``summaries``: dicts of
scalars, ``self.sow("summaries", NAME, {KEY: value})``, logged as ``NAME/KEY`` averaged over every
layer that sowed them (``moe/aux_loss``, ``moe/dropped_fraction``, ...). Under ``nn.scan`` the
collections are stacked per layer like the parameters; averaging over all elements is the same mean.

``router_load``: per-expert counts [E] of the tokens (padding excluded) each router sent to each
expert, sown only by a router whose choice bias moves during training (DeepSeek-V3's auxiliary-
loss-free balancing, models/moe_router_deepseek.py), under the bias parameter's own name, so its
path is the bias's path. Counts are sums, never means: the trainer returns them in the summaries
under ``ROUTER_LOAD_KEY`` (a tree, not a scalar) summed over microbatches, and train/router_bias.py
moves each bias by them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

AUX_LOSS_COLLECTION = "aux_loss"
SUMMARIES_COLLECTION = "summaries"
ROUTER_LOAD_COLLECTION = "router_load"
COLLECTIONS: tuple[str, ...] = (AUX_LOSS_COLLECTION, SUMMARIES_COLLECTION, ROUTER_LOAD_COLLECTION)
# The summaries entry holding the router_load tree (no "/": never a logged metric's name).
ROUTER_LOAD_KEY = "router_load"


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


def collected_summaries(state: Any) -> dict[str, Any]:
    """``summary_means``, plus ``{ROUTER_LOAD_KEY: the router_load tree}`` when a router sowed
    counts."""
    summaries: dict[str, Any] = summary_means(state)
    loads = state.get(ROUTER_LOAD_COLLECTION)
    if loads:
        summaries[ROUTER_LOAD_KEY] = jax.tree.map(lambda a: a.astype(jnp.float32), loads)
    return summaries


def microbatch_means(sums: dict[str, Any], num_microbatches: int) -> dict[str, Any]:
    """Summaries summed over microbatches -> their means; the router counts stay sums (the whole
    batch's)."""
    return {k: v if k == ROUTER_LOAD_KEY else v / num_microbatches for k, v in sums.items()}
