"""Mixture-of-experts routers as pure functions: GShard top-2 (GLaM) and dropless top-k (Mixtral).

``top2_gating`` reproduces Praxis ``gshard_utils.top2_gating_on_logits`` with the settings of
Pax's GLaM (``second_expert_policy='all'``, ``legacy_mtf_behavior=True``, a capacity factor and
no fixed ``expert_capacity_dim``, no logit cap, no importance), so that a GLaM run here routes
exactly the tokens Pax routes, drops exactly the ones Pax drops and adds the same aux loss. Each
rule that differs from a plain reading of the GShard paper is Praxis's and is kept on purpose:

- Capacity ``C = int(S * cf / E)`` rounded up to a multiple of 4, but only when that exceeds 1
  (or the given ``expert_capacity_dim``); otherwise 1 (or the given value, not rounded).
- Both gates are renormalised to ``g / (g_1 + g_2 + 1e-9)`` *before* capacity: a token whose 2nd
  choice is dropped keeps ``g_1 < 1``; a fully dropped token gets an all-zero combine row.
- Every kept 1st choice in a group outranks every 2nd choice: 2nd-choice positions start after
  the count of *kept* 1st choices of that expert.
- The aux loss uses 1st choices only, before capacity, and divides by the group size S even
  when some of the S tokens are padding (so uniform routing with padding gives less than 1).

``topk_routing``, ``load_balancing_loss_topk`` and ``router_z_loss`` serve the dropless router:
HF Mixtral's softmax -> top-k -> renormalise (Qwen3-MoE's with or without the renormalising),
AXLearn's top-k load-balancing normalisation and AXLearn's router z-loss.

Einsum letters: G groups, S tokens per group, E experts, C capacity per expert and group;
N tokens, K experts per token.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

_RENORM_EPSILON = 1e-9  # Praxis legacy_mtf_behavior: denominator gate_1 + gate_2 + 1e-9


@struct.dataclass
class Top2Gating:
    """What ``top2_gating`` returns (a frozen dataclass and a JAX pytree).

    Attributes:
        combine: [G, S, E, C] float32: ``gate_i`` at (expert_i, position_i) of every kept
            assignment i of token s, 0 elsewhere.
        dispatch: [G, S, E, C] bool: ``combine != 0`` (Praxis ``combine.astype(bool)``).
        aux_loss: scalar float32 load-balancing loss (1.0 for perfectly uniform routing), not
            yet weighted.
        over_capacity_1_ratio: scalar: fraction of (non-padding) 1st choices dropped for lack of
            capacity, over all groups (Praxis summary ``over_capacity_1``).
        over_capacity_2_ratio: scalar: the same for 2nd choices, which count against the capacity
            left after the kept 1st choices (Praxis summary ``over_capacity_2``).
        expert_assignments: [E] float32: (token, choice) assignments routed to each expert over
            all groups before capacity dropping, both choices, padding excluded.
        dropped_fraction: scalar: dropped assignments / all non-padding assignments (2 a token).
    """

    combine: jax.Array
    dispatch: jax.Array
    aux_loss: jax.Array
    over_capacity_1_ratio: jax.Array
    over_capacity_2_ratio: jax.Array
    expert_assignments: jax.Array
    dropped_fraction: jax.Array


def expert_capacity(*, group_size: int, num_experts: int, capacity_factor: float,
                    expert_capacity_dim: int | None = None) -> int:
    """C, the assignments each expert takes per group of ``group_size`` tokens (Praxis's rule).

    ``auto = int(group_size * capacity_factor / num_experts)``; start from
    ``expert_capacity_dim`` (None: 1); if ``auto`` is larger, use ``auto`` rounded up to a
    multiple of 4 ("to avoid possible padding" on TPUs). So auto <= 1 gives 1, 4 gives 4, 5 gives
    8. ``capacity_factor`` counts both choices: 2.0 is room for every token's two assignments
    when routing is uniform.
    """
    _check_capacity_args(capacity_factor=capacity_factor, expert_capacity_dim=expert_capacity_dim)
    auto = int(group_size * capacity_factor / num_experts)
    capacity = 1 if expert_capacity_dim is None else expert_capacity_dim
    if capacity < auto:
        capacity = 4 * math.ceil(auto / 4)
    return capacity


def _check_capacity_args(*, capacity_factor: float, expert_capacity_dim: int | None) -> None:
    if (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float))
            or not capacity_factor > 0 or not math.isfinite(capacity_factor)):
        raise ValueError(f"capacity_factor={capacity_factor!r} must be a finite number > 0 "
                         "(GLaM: 2.0, room for both choices of every token)")
    if expert_capacity_dim is not None and (
            isinstance(expert_capacity_dim, bool) or not isinstance(expert_capacity_dim, int)
            or expert_capacity_dim < 1):
        raise ValueError(
            f"expert_capacity_dim={expert_capacity_dim!r} must be None or a positive integer")


def _check_paddings(paddings: jax.Array | None, *, shape: tuple[int, ...], what: str) -> None:
    if paddings is not None and tuple(paddings.shape) != shape:
        raise ValueError(f"paddings of shape {tuple(paddings.shape)} do not match {what}: "
                         f"expected {shape} (1.0 = padding token, 0.0 = real token)")


def _exclusive_cumsum(x: jax.Array, *, axis: int) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def top2_gating(logits: jax.Array, *, capacity_factor: float, paddings: jax.Array | None = None,
                expert_capacity_dim: int | None = None) -> Top2Gating:
    """GShard top-2 gating of ``logits`` [G, S, E], each group routed on its own.

    Args:
        logits: [G, S, E] router logits (any float dtype; computed in float32).
        capacity_factor: > 0; see ``expert_capacity`` for the capacity C it gives.
        paddings: [G, S], 1.0 for a padding token, 0.0 for a real one; None: all real. A padding
            token takes no capacity, gets an all-zero combine row and adds nothing to the aux
            loss (which still divides by S, as Praxis does).
        expert_capacity_dim: a lower bound for C (Praxis ``expert_capacity_dim``); None for
            GLaM's setting.

    Returns:
        ``Top2Gating`` with combine/dispatch [G, S, E, C].
    """
    logits = jnp.asarray(logits)
    if logits.ndim != 3:
        raise ValueError(f"top2_gating: logits of shape {tuple(logits.shape)} must be [G, S, E]")
    num_groups, group_size, num_experts = logits.shape
    if num_experts < 2:
        raise ValueError(f"top2_gating: logits of shape {tuple(logits.shape)} have "
                         f"E={num_experts} experts; top-2 gating needs at least 2")
    _check_paddings(paddings, shape=(num_groups, group_size), what="logits [G, S, E]")
    capacity = expert_capacity(group_size=group_size, num_experts=num_experts,
                               capacity_factor=capacity_factor,
                               expert_capacity_dim=expert_capacity_dim)

    raw_gates = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # GSE
    index_1 = jnp.argmax(raw_gates, axis=-1)  # GS
    mask_1 = jax.nn.one_hot(index_1, num_experts, dtype=jnp.int32)  # GSE
    density_1_proxy = raw_gates  # GSE
    if paddings is not None:
        nonpaddings = 1.0 - jnp.asarray(paddings, jnp.float32)  # GS
        # Praxis casts the non-padding weight to the int mask dtype for mask_1 but tests
        # "weight > 0" for mask_2; both agree for 0/1 paddings.
        mask_1 = mask_1 * nonpaddings.astype(jnp.int32)[..., None]
        density_1_proxy = density_1_proxy * nonpaddings[..., None]
    gate_1 = jnp.einsum("gse,gse->gs", raw_gates, mask_1.astype(jnp.float32))  # GS

    # 'all': the 2nd expert is greedily the best of the rest.
    gates_without_top_1 = raw_gates * (1 - mask_1).astype(jnp.float32)  # GSE
    index_2 = jnp.argmax(gates_without_top_1, axis=-1)  # GS
    mask_2 = jax.nn.one_hot(index_2, num_experts, dtype=jnp.int32)  # GSE
    if paddings is not None:
        mask_2 = mask_2 * (nonpaddings > 0.0).astype(jnp.int32)[..., None]
    gate_2 = jnp.einsum("gse,gse->gs", gates_without_top_1, mask_2.astype(jnp.float32))  # GS

    # legacy_mtf_behavior: renormalise before capacity, never again after drops.
    denom = gate_1 + gate_2 + _RENORM_EPSILON
    gate_1 = gate_1 / denom
    gate_2 = gate_2 / denom

    # Aux loss from 1st choices before capacity; means over S (padding included) as Praxis.
    density_1 = jnp.mean(mask_1.astype(jnp.float32), axis=1)  # GE
    density_1_proxy = jnp.mean(density_1_proxy, axis=1)  # GE
    aux_loss = jnp.mean(density_1 * density_1_proxy) * float(num_experts * num_experts)

    position_1 = _exclusive_cumsum(mask_1, axis=1)  # GSE: earlier 1st choices of that expert
    kept_1 = mask_1 * (position_1 < capacity).astype(jnp.int32)  # GSE
    kept_1_count = jnp.sum(kept_1, axis=1)  # GE
    # Every kept 1st choice outranks every 2nd choice of the group.
    position_2 = _exclusive_cumsum(mask_2, axis=1) + kept_1_count[:, None, :]  # GSE
    kept_2 = mask_2 * (position_2 < capacity).astype(jnp.int32)  # GSE

    combine = (_combine_part(gate_1, index_1, position_1, kept_1, capacity=capacity)
               + _combine_part(gate_2, index_2, position_2, kept_2, capacity=capacity))  # GSEC

    total_1 = jnp.sum(mask_1).astype(jnp.float32)
    total_2 = jnp.sum(mask_2).astype(jnp.float32)
    dropped_1 = total_1 - jnp.sum(kept_1).astype(jnp.float32)
    dropped_2 = total_2 - jnp.sum(kept_2).astype(jnp.float32)
    return Top2Gating(
        combine=combine,
        dispatch=combine != 0.0,
        aux_loss=aux_loss,
        over_capacity_1_ratio=dropped_1 / jnp.maximum(total_1, 1.0),
        over_capacity_2_ratio=dropped_2 / jnp.maximum(total_2, 1.0),
        expert_assignments=jnp.sum(mask_1 + mask_2, axis=(0, 1)).astype(jnp.float32),
        dropped_fraction=(dropped_1 + dropped_2) / jnp.maximum(total_1 + total_2, 1.0),
    )


def _combine_part(gate: jax.Array, index: jax.Array, position: jax.Array, kept: jax.Array, *,
                  capacity: int) -> jax.Array:
    """[G, S, E, C]: gate [G, S] at (index, position) where the assignment is kept, else 0."""
    kept_flat = jnp.sum(kept, axis=-1).astype(jnp.float32)  # GS: 1 kept, 0 dropped or padding
    slot = jnp.sum(position * kept, axis=-1)  # GS: position of a kept assignment, else 0
    expert_part = (gate * kept_flat)[..., None] * jax.nn.one_hot(
        index, kept.shape[-1], dtype=jnp.float32)  # GSE
    slot_part = jax.nn.one_hot(slot, capacity, dtype=jnp.float32)  # GSC
    return jnp.einsum("gse,gsc->gsec", expert_part, slot_part)


def topk_routing(logits: jax.Array, *, k: int, renormalize: bool = True
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Mixtral's and Qwen3-MoE's router: softmax over all E in float32, top-k, and (Mixtral
    always, Qwen3-MoE with ``norm_topk_prob``) the k weights renormalised to sum 1.

    Args:
        logits: [N, E] router logits.
        k: experts per token, 1 <= k <= E.
        renormalize: False keeps the k softmax probabilities as they are.

    Returns:
        weights [N, K] float32 (summing to 1 per token when renormalised), experts [N, K] int32
        (best first), probs [N, E] float32 (the full softmax, for the load-balancing loss).
    """
    logits = jnp.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"topk_routing: logits of shape {tuple(logits.shape)} must be [N, E]")
    num_experts = logits.shape[-1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
        raise ValueError(f"topk_routing: k={k!r} must be an integer in [1, {num_experts}] "
                         f"(E={num_experts} experts)")
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # NE
    weights, experts = jax.lax.top_k(probs, k)  # NK
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32), probs


def _token_weights(paddings: jax.Array | None, shape: tuple[int, ...]) -> jax.Array:
    if paddings is None:
        return jnp.ones(shape, jnp.float32)
    return 1.0 - jnp.asarray(paddings, jnp.float32)


def load_balancing_loss_topk(probs: jax.Array, experts: jax.Array, *, num_experts: int,
                             paddings: jax.Array | None = None) -> jax.Array:
    """AXLearn's top-k load-balancing loss: ``E^2 / K * mean_e(density_e * proxy_e)``.

    With T the number of non-padding tokens: ``density_e = (1/T) sum_n sum_k [experts[n,k] == e]``
    (the fraction of tokens choosing e in any of their K slots; these sum to K) and
    ``proxy_e = (1/T) sum_n probs[n, e]`` (these sum to 1). Perfectly uniform routing
    (density K/E, proxy 1/E) gives exactly 1.0, whatever K.

    Args:
        probs: [N, E] float softmax of the router logits.
        experts: [N, K] int experts chosen per token.
        num_experts: E.
        paddings: [N], 1.0 for padding tokens (excluded from both means); None: all real.
    """
    probs = jnp.asarray(probs)
    experts = jnp.asarray(experts)
    if probs.ndim != 2 or experts.ndim != 2 or probs.shape[0] != experts.shape[0]:
        raise ValueError(f"load_balancing_loss_topk: probs {tuple(probs.shape)} and experts "
                         f"{tuple(experts.shape)} must be [N, E] and [N, K] with the same N")
    if probs.shape[1] != num_experts:
        raise ValueError(f"load_balancing_loss_topk: num_experts={num_experts!r} does not match "
                         f"probs of shape {tuple(probs.shape)}")
    _check_paddings(paddings, shape=(probs.shape[0],), what="probs [N, E]")
    k = experts.shape[1]
    weight = _token_weights(paddings, (probs.shape[0],))  # N
    num_tokens = jnp.maximum(jnp.sum(weight), 1.0)
    chosen = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32), axis=1)  # NE
    density = jnp.einsum("ne,n->e", chosen, weight) / num_tokens  # E
    proxy = jnp.einsum("ne,n->e", probs.astype(jnp.float32), weight) / num_tokens  # E
    return jnp.mean(density * proxy) * float(num_experts * num_experts) / k


def router_z_loss(logits: jax.Array, paddings: jax.Array | None = None) -> jax.Array:
    """AXLearn's router z-loss: mean over non-padding tokens of ``logsumexp_e(logits)^2``.

    Keeps router logits small (ST-MoE). ``logits`` [..., E] (e.g. [N, E] or [G, S, E]);
    ``paddings`` [...] (1.0 = padding) or None.
    """
    logits = jnp.asarray(logits)
    if logits.ndim < 2:
        raise ValueError(f"router_z_loss: logits of shape {tuple(logits.shape)} must be [..., E]")
    _check_paddings(paddings, shape=tuple(logits.shape[:-1]), what="logits [..., E]")
    log_z = jax.scipy.special.logsumexp(logits.astype(jnp.float32), axis=-1)  # ...
    weight = _token_weights(paddings, log_z.shape)
    return jnp.sum(jnp.square(log_z) * weight) / jnp.maximum(jnp.sum(weight), 1.0)
