"""DeepSeek-V3's auxiliary-loss-free load balancing: the train step's update of the routers'
choice biases (models/moe_router_deepseek.py).

After each step, each MoE layer's bias [E] moves by ``speed * sign(mean_e(load) - load_e)``:
up for an expert that got fewer tokens than the average, down for one that got more, unchanged
at exactly the average. ``load_e`` counts the tokens of the step's whole global batch (every
microbatch of a gradient accumulation, every pipeline microbatch; padding, segment id 0,
excluded) that the router sent to expert e, with the biases the step routed by. The layers sow
the counts under their bias's path (models/sown.py ``router_load``), the step collects them
beside its summaries, and this moves the biases: a pure function inside the jitted step, never
through the optimizer (the bias is outside the trainable parameters, so no weight decay, clipping
or learning rate reaches it).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from flax import traverse_util

from paxlite.models import sown

PyTree = Any
_SEP = "/"


def bias_update_speed(model: nn.Module) -> float:
    """The model's ``deepseek_router.bias_update_speed`` (0.0 without such a router)."""
    moe = getattr(getattr(model, "config", None), "moe", None)
    router = getattr(moe, "deepseek_router", None)
    return 0.0 if router is None else float(router.bias_update_speed)


def moved_biases(params: PyTree, loads: PyTree, *, speed: float) -> PyTree:
    """``params`` with each bias that ``loads`` (the router_load tree: counts [..., E] at the
    bias's path; [L, E] for a scanned stack) names moved by the rule (module docstring)."""
    flat = traverse_util.flatten_dict(params, sep=_SEP)
    for path, load in traverse_util.flatten_dict(loads, sep=_SEP).items():
        if path not in flat:
            raise ValueError(f"router counts at {path!r} name no parameter (a choice bias)")
        bias = flat[path]
        load = load.astype(jnp.float32)
        mean = jnp.mean(load, axis=-1, keepdims=True)
        flat[path] = (bias.astype(jnp.float32) + speed * jnp.sign(mean - load)).astype(bias.dtype)
    return traverse_util.unflatten_dict(flat, sep=_SEP)


def apply_bias_update(params: PyTree, summaries: dict[str, Any], model: nn.Module
                      ) -> tuple[PyTree, dict[str, Any]]:
    """(params with the choice biases moved, the summaries without the counts): what the train
    step does with a step's summaries; both as they came when no router sowed counts."""
    if sown.ROUTER_LOAD_KEY not in summaries:
        return params, summaries
    rest = {k: v for k, v in summaries.items() if k != sown.ROUTER_LOAD_KEY}
    moved = moved_biases(params, summaries[sown.ROUTER_LOAD_KEY], speed=bias_update_speed(model))
    return moved, rest
