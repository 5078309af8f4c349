"""Llama 4's router as a pure function: top-k of the logits, each chosen expert's gate the sigmoid
of its own logit (``MoeRouting.SIGMOID_TOPK``).

Unlike the softmax routers of models/moe_gating.py the gates are not normalised over the experts
(a top-1 token's gate is ``sigmoid(max logit)``, anywhere in (0, 1)), and the MoE layer multiplies
each token's *input* to an expert by its gate rather than the expert's output (models/moe.py,
``weights_on_input``); with SwiGLU experts the two differ. transformers' Llama 4 sets every
unchosen expert's score to ``sigmoid(-inf) = 0`` and runs all experts on all (zeroed) tokens,
which adds exactly zero for the unchosen ones, so only the top-k need to run.

The load-balancing loss (``load_balancing_loss_topk``) needs a distribution over the experts: it
is given the softmax of the logits, as for the other dropless routers (transformers' Llama 4 adds
no such loss; paxlite's weight for it is 0 unless set).

Einsum letters: N tokens, E experts, K experts per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sigmoid_topk_routing(logits: jax.Array, *, k: int
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits float32 [N, E] -> (gates [N, K] float32 = sigmoid of the chosen logits, experts
    [N, K] int32 highest logit first, probs [N, E] the softmax for the load-balancing loss)."""
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"sigmoid top-k routing: k={k} must be between 1 and the "
                         f"{logits.shape[-1]} experts")
    logits = logits.astype(jnp.float32)
    top, experts = jax.lax.top_k(logits, k)  # [N, K]
    return jax.nn.sigmoid(top), experts.astype(jnp.int32), jax.nn.softmax(logits, axis=-1)
