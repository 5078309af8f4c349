"""gpt-oss's experts, as transformers computes them: a clamped SwiGLU and a bias per expert on
each of the three matmuls (and on the router, which models/moe.py builds as a biased Linear).

- ``clamped_swiglu``: the gate is clamped to <= limit and the up projection to [-limit, limit],
  then ``(up + 1) * gate * sigmoid(alpha * gate)`` (``MoeConfig.swiglu_limit`` / ``swiglu_alpha``,
  gpt-oss: 7.0 and 1.702). The "+ 1" on up and the gain alpha are the model's, not SiLU's.
- ``add_expert_bias``: the biases of dropless routing, whose rows are sorted by local expert
  (models/moe.py ``_dropless_experts``): each row gets its own expert's bias; the rows that belong
  to another shard's experts get none (they are masked to zero by the grouped matmul anyway).

Routing needs nothing new: transformers takes the top-k of the router logits and a softmax over
those k, which is the softmax over all experts, top-k, renormalised (``renormalize_top_k``): the
same weights, up to float32 rounding.

Einsum letters: M sorted (token, expert) rows, E local experts, F hidden dims.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from paxlite.models.moe_config import MoeConfig

GatedUnit = Callable[[jax.Array, jax.Array], jax.Array]  # (gate [M, F], up [M, F]) -> [M, F]


def clamped_swiglu(gate: jax.Array, up: jax.Array, *, alpha: float, limit: float) -> jax.Array:
    """gpt-oss's gated unit (module docstring); same shapes and dtype in and out."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def gated_unit(config: MoeConfig, activation: Callable[[jax.Array], jax.Array]) -> GatedUnit:
    """The experts' ``hidden = unit(x wi_gate, x wi)``: the clamped SwiGLU with ``swiglu_limit``,
    else ``activation(gate) * up``."""
    if config.swiglu_limit is None:
        return lambda gate, up: activation(gate) * up
    alpha, limit = float(config.swiglu_alpha), float(config.swiglu_limit)
    return lambda gate, up: clamped_swiglu(gate, up, alpha=alpha, limit=limit)


def add_expert_bias(rows: jax.Array, bias: jax.Array | None, local_id: jax.Array) -> jax.Array:
    """rows [M, N] sorted by expert + their expert's row of ``bias`` [E, N] (None: rows as they
    are); ``local_id`` [M]: each row's local expert, E for rows of another shard's experts (no
    bias)."""
    if bias is None:
        return rows
    experts = bias.shape[0]
    own = bias[jnp.minimum(local_id, experts - 1)]  # [M, N]
    return rows + jnp.where((local_id < experts)[:, None], own, jnp.zeros((), own.dtype))
