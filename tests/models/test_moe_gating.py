"""MoE routers against hand-computed cases and an independent float64 NumPy loop.

The loop reference walks each group token by token, the way the GShard paper (Algorithm 2) and
Praxis's ``top2_gating_on_logits`` (second_expert_policy='all', legacy_mtf_behavior=True) define
the routing: first all 1st choices in token order, then all 2nd choices in token order, counting
against the capacity the kept 1st choices left.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxlite.models.moe_gating import (
    Top2Gating,
    expert_capacity,
    load_balancing_loss_topk,
    router_z_loss,
    top2_gating,
    topk_routing,
)


def _softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def _logits_for(choices: list[tuple[int, int]], num_experts: int) -> np.ndarray:
    """[1, S, E] logits whose 1st/2nd choices are the given pairs (2.0, 1.0, others 0.0)."""
    logits = np.zeros((1, len(choices), num_experts))
    for s, (first, second) in enumerate(choices):
        logits[0, s, first] = 2.0
        logits[0, s, second] = 1.0
    return logits


def _renormalised(logits_row: np.ndarray, first: int, second: int) -> tuple[float, float]:
    p = _softmax(logits_row)
    denom = p[first] + p[second] + 1e-9
    return p[first] / denom, p[second] / denom


def _gate(logits: np.ndarray, *, capacity_factor: float,
          paddings: np.ndarray | None = None) -> Top2Gating:
    return _top2_gating(jnp.asarray(logits, jnp.float32), capacity_factor=capacity_factor,
                        paddings=None if paddings is None else jnp.asarray(paddings, jnp.float32))


# One program per shape, not one per operation run eagerly (eager and jitted routing are compared
# in test_jit_and_low_precision_logits).
_top2_gating = jax.jit(top2_gating, static_argnames=("capacity_factor", "expert_capacity_dim"))


def _reference(logits: np.ndarray, *, capacity_factor: float,
               paddings: np.ndarray | None) -> dict[str, np.ndarray | float]:
    """Float64 loop implementation of GShard top-2 gating (Praxis legacy semantics)."""
    num_groups, group_size, num_experts = logits.shape
    auto = int(group_size * capacity_factor / num_experts)
    capacity = 1 if auto <= 1 else 4 * math.ceil(auto / 4)
    if paddings is None:
        paddings = np.zeros((num_groups, group_size))
    combine = np.zeros((num_groups, group_size, num_experts, capacity))
    aux = 0.0
    assignments = np.zeros(num_experts)
    firsts = seconds = dropped_1 = dropped_2 = 0
    for g in range(num_groups):
        probs = _softmax(logits[g].astype(np.float64))
        choices = []
        for s in range(group_size):
            if paddings[g, s] == 1.0:
                choices.append(None)
                continue
            first = int(np.argmax(probs[s]))
            rest = probs[s].copy()
            rest[first] = -1.0
            second = int(np.argmax(rest))
            w1, w2 = (probs[s, first], probs[s, second]) / (probs[s, first] + probs[s, second]
                                                          + 1e-9)
            choices.append((first, second, w1, w2))
            assignments[first] += 1
            assignments[second] += 1
        fill = np.zeros(num_experts, int)  # the next free slot of each expert
        seen_1 = np.zeros(num_experts, int)  # 1st choices seen so far (kept or not)
        for s, choice in enumerate(choices):
            if choice is None:
                continue
            first, _, w1, _ = choice
            firsts += 1
            if seen_1[first] < capacity:
                combine[g, s, first, fill[first]] += w1
                fill[first] += 1
            else:
                dropped_1 += 1
            seen_1[first] += 1
        for s, choice in enumerate(choices):
            if choice is None:
                continue
            _, second, _, w2 = choice
            seconds += 1
            if fill[second] < capacity:
                combine[g, s, second, fill[second]] += w2
            else:
                dropped_2 += 1
            fill[second] += 1
        real = paddings[g] == 0.0
        density = np.array([sum(1 for c in choices if c is not None and c[0] == e)
                            for e in range(num_experts)]) / group_size
        proxy = (probs * real[:, None]).sum(0) / group_size
        aux += np.mean(density * proxy) * num_experts**2 / num_groups
    return {
        "combine": combine, "aux_loss": aux,
        "over_capacity_1_ratio": dropped_1 / max(firsts, 1),
        "over_capacity_2_ratio": dropped_2 / max(seconds, 1),
        "expert_assignments": assignments,
        "dropped_fraction": (dropped_1 + dropped_2) / max(firsts + seconds, 1),
    }


# ------------------------------------------------------------------------------------ capacity


@pytest.mark.parametrize(
    ("group_size", "num_experts", "capacity_factor", "want"),
    [
        (4, 4, 1.0, 1),  # auto = 1: not rounded
        (2, 4, 1.0, 1),  # auto = 0 -> 1
        (6, 4, 1.5, 4),  # auto = int(2.25) = 2 -> 4
        (8, 4, 2.0, 4),  # auto = 4 stays 4
        (10, 4, 2.0, 8),  # auto = 5 -> 8
        (16, 4, 2.0, 8),  # auto = 8 stays 8
        (12, 8, 2.0, 4),  # auto = 3 -> 4
        (36, 4, 1.0, 12),  # auto = 9 -> 12
    ],
)
def test_capacity_rounds_up_to_a_multiple_of_4_above_1(group_size, num_experts, capacity_factor,
                                                      want) -> None:
    assert expert_capacity(group_size=group_size, num_experts=num_experts,
                           capacity_factor=capacity_factor) == want
    logits = np.zeros((1, group_size, num_experts))
    gating = _gate(logits, capacity_factor=capacity_factor)
    assert gating.combine.shape == (1, group_size, num_experts, want)
    assert gating.dispatch.shape == (1, group_size, num_experts, want)


def test_capacity_with_an_explicit_expert_capacity_dim() -> None:
    # A larger given value wins unrounded; a smaller one yields to the rounded automatic one.
    assert expert_capacity(group_size=10, num_experts=4, capacity_factor=2.0,
                           expert_capacity_dim=6) == 6
    assert expert_capacity(group_size=10, num_experts=4, capacity_factor=2.0,
                           expert_capacity_dim=3) == 8


# -------------------------------------------------------------------------- hand-computed cases


def test_first_choices_outrank_earlier_second_choices() -> None:
    # C = 1. Token s picks expert s first and s+1 second: every 2nd choice loses to the 1st
    # choice of a LATER token (token-major priority would keep token 0's 2nd choice instead).
    choices = [(0, 1), (1, 2), (2, 3), (3, 0)]
    logits = _logits_for(choices, 4)
    gating = _gate(logits, capacity_factor=1.0)
    want = np.zeros((1, 4, 4, 1))
    for s, (first, second) in enumerate(choices):
        w1, _ = _renormalised(logits[0, s], first, second)
        want[0, s, first, 0] = w1
        assert w1 < 0.8  # renormalised before dropping: the lost 2nd choice is not given back
    np.testing.assert_allclose(np.asarray(gating.combine), want, rtol=1e-6, atol=1e-7)
    assert float(gating.over_capacity_1_ratio) == 0.0
    assert float(gating.over_capacity_2_ratio) == 1.0
    assert float(gating.dropped_fraction) == 0.5
    np.testing.assert_array_equal(np.asarray(gating.expert_assignments), [2, 2, 2, 2])


def test_second_choices_queue_after_the_kept_first_choices() -> None:
    # C = int(8 * 2 / 4) = 4. Expert 0 takes 1st choices of tokens 0-2 (slots 0-2), then the 2nd
    # choice of token 3 (slot 3); token 4's 2nd choice drops. Expert 1 takes 1st choices of tokens
    # 3, 4 (slots 0, 1), then 2nd choices of tokens 0, 1 (slots 2, 3); token 2's drops.
    choices = [(0, 1)] * 3 + [(1, 0)] * 2 + [(2, 3)] * 3
    logits = _logits_for(choices, 4)
    gating = _gate(logits, capacity_factor=2.0)
    w1, w2 = _renormalised(logits[0, 0], 0, 1)  # the same pair of values for every token
    want = np.zeros((1, 8, 4, 4))
    for s, e, c, w in [(0, 0, 0, w1), (1, 0, 1, w1), (2, 0, 2, w1), (3, 0, 3, w2),
                       (3, 1, 0, w1), (4, 1, 1, w1), (0, 1, 2, w2), (1, 1, 3, w2),
                       (5, 2, 0, w1), (6, 2, 1, w1), (7, 2, 2, w1),
                       (5, 3, 0, w2), (6, 3, 1, w2), (7, 3, 2, w2)]:
        want[0, s, e, c] = w
    np.testing.assert_allclose(np.asarray(gating.combine), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(gating.dispatch), want > 0)
    assert float(gating.over_capacity_1_ratio) == 0.0
    assert float(gating.over_capacity_2_ratio) == 2 / 8
    assert float(gating.dropped_fraction) == 2 / 16
    np.testing.assert_array_equal(np.asarray(gating.expert_assignments), [5, 5, 3, 3])
    # Aux loss: 1st choices only, before capacity.
    probs = _softmax(logits[0])
    density = np.array([3, 2, 3, 0]) / 8
    want_aux = np.mean(density * probs.mean(0)) * 16
    np.testing.assert_allclose(float(gating.aux_loss), want_aux, rtol=1e-6)


def test_dropped_assignments_contribute_exactly_zero() -> None:
    # C = 1 and all four tokens want experts 0 then 1: token 0 gets both, tokens 1-3 nothing.
    logits = _logits_for([(0, 1)] * 4, 4)
    gating = _gate(logits, capacity_factor=1.0)
    combine = np.asarray(gating.combine)
    w1, w2 = _renormalised(logits[0, 0], 0, 1)
    np.testing.assert_allclose(combine[0, 0, :, 0], [w1, w2, 0.0, 0.0], rtol=1e-6)
    assert np.all(combine[0, 1:] == 0.0)  # fully dropped tokens: all-zero rows, exactly
    assert not np.asarray(gating.dispatch)[0, 1:].any()
    assert float(gating.over_capacity_1_ratio) == 0.75
    assert float(gating.over_capacity_2_ratio) == 0.75
    assert float(gating.dropped_fraction) == 0.75
    np.testing.assert_array_equal(np.asarray(gating.expert_assignments), [4, 4, 0, 0])
    np.testing.assert_allclose(float(gating.aux_loss), 4 * _softmax(logits[0, 0])[0], rtol=1e-6)


def test_padding_takes_no_capacity_and_gets_nothing() -> None:
    # C = 1. Padding token 0 would take expert 0's only slot ahead of token 1, and padding token 3
    # would be counted; neither may.
    choices = [(0, 1), (0, 1), (2, 3), (2, 3)]
    logits = _logits_for(choices, 4)
    logits[0, 0] += np.array([0.5, 0.0, 0.0, 0.0])  # padding rows may hold anything
    paddings = np.array([[1.0, 0.0, 0.0, 1.0]])
    gating = _gate(logits, capacity_factor=1.0, paddings=paddings)
    w1, w2 = _renormalised(logits[0, 1], 0, 1)
    want = np.zeros((1, 4, 4, 1))
    want[0, 1, 0, 0], want[0, 1, 1, 0] = w1, w2
    want[0, 2, 2, 0], want[0, 2, 3, 0] = w1, w2
    np.testing.assert_allclose(np.asarray(gating.combine), want, rtol=1e-6, atol=1e-7)
    assert float(gating.over_capacity_1_ratio) == 0.0
    assert float(gating.over_capacity_2_ratio) == 0.0
    assert float(gating.dropped_fraction) == 0.0
    np.testing.assert_array_equal(np.asarray(gating.expert_assignments), [1, 1, 1, 1])
    # Praxis (legacy) divides density and proxy by S = 4, not by the 2 real tokens.
    probs = _softmax(logits[0])
    density = np.array([1, 0, 1, 0]) / 4
    proxy = (probs[1] + probs[2]) / 4
    np.testing.assert_allclose(float(gating.aux_loss), np.mean(density * proxy) * 16, rtol=1e-6)


def test_aux_loss_is_one_for_perfectly_uniform_routing() -> None:
    # Token s has the logits [3, 2, 1, 0] rolled by s: each expert is 1st choice equally often
    # and the mean gate of every expert is exactly 1/E (no argmax ties).
    base = np.array([3.0, 2.0, 1.0, 0.0])
    logits = np.stack([np.stack([np.roll(base, s + g) for s in range(8)]) for g in range(2)])
    gating = _gate(logits, capacity_factor=2.0)
    np.testing.assert_allclose(float(gating.aux_loss), 1.0, rtol=1e-6)
    # And a collapsed router (every token prefers expert 0) scores higher.
    collapsed = _gate(np.tile(base, (2, 8, 1)), capacity_factor=2.0)
    assert float(collapsed.aux_loss) > 2.0


# ----------------------------------------------------------------------- reference comparison


@pytest.mark.parametrize("capacity_factor", [1.0, 2.0])
@pytest.mark.parametrize("with_paddings", [False, True])
def test_matches_float64_loop_reference(capacity_factor, with_paddings) -> None:
    rng = np.random.default_rng(7 + int(with_paddings))
    logits = rng.normal(0.0, 1.5, (3, 16, 4))
    logits[1] += np.array([1.5, 0.0, 0.0, 0.0])  # group 1 is imbalanced: drops happen
    paddings = None
    if with_paddings:
        paddings = (rng.uniform(size=(3, 16)) < 0.3).astype(np.float64)
        paddings[2, :] = 0.0
        paddings[0, -5:] = 1.0
    gating = _gate(logits, capacity_factor=capacity_factor, paddings=paddings)
    want = _reference(logits, capacity_factor=capacity_factor, paddings=paddings)
    combine = np.asarray(gating.combine)
    np.testing.assert_allclose(combine, want["combine"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(gating.dispatch), combine > 0)
    assert gating.combine.dtype == jnp.float32 and gating.dispatch.dtype == jnp.bool_
    for key in ("aux_loss", "over_capacity_1_ratio", "over_capacity_2_ratio", "dropped_fraction"):
        np.testing.assert_allclose(float(getattr(gating, key)), want[key], rtol=1e-5, err_msg=key)
    np.testing.assert_array_equal(np.asarray(gating.expert_assignments),
                                  want["expert_assignments"])
    assert float(gating.dropped_fraction) > 0.0  # the case does exercise dropping


def test_jit_and_low_precision_logits() -> None:
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(2, 8, 4)), jnp.bfloat16)
    paddings = jnp.asarray(rng.uniform(size=(2, 8)) < 0.25, jnp.float32)
    eager = top2_gating(logits, capacity_factor=2.0, paddings=paddings)
    jitted = jax.jit(functools.partial(top2_gating, capacity_factor=2.0))(logits,
                                                                         paddings=paddings)
    assert len(jax.tree.leaves(jitted)) == 7
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    want = _reference(np.asarray(logits.astype(jnp.float32), np.float64), capacity_factor=2.0,
                      paddings=np.asarray(paddings, np.float64))
    np.testing.assert_allclose(np.asarray(jitted.combine), want["combine"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"logits": np.zeros((4, 4)), "capacity_factor": 2.0}, r"\(4, 4\) must be \[G, S, E\]"),
        ({"logits": np.zeros((1, 4, 1)), "capacity_factor": 2.0}, "E=1 experts"),
        ({"logits": np.zeros((1, 4, 4)), "capacity_factor": 0.0}, "capacity_factor=0.0"),
        ({"logits": np.zeros((1, 4, 4)), "capacity_factor": -1}, "capacity_factor=-1"),
        ({"logits": np.zeros((1, 4, 4)), "capacity_factor": 2.0, "paddings": np.zeros((4,))},
         r"paddings of shape \(4,\)"),
        ({"logits": np.zeros((1, 4, 4)), "capacity_factor": 2.0, "expert_capacity_dim": 0},
         "expert_capacity_dim=0"),
    ],
)
def test_top2_gating_rejects_bad_inputs(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        top2_gating(**kwargs)


# ---------------------------------------------------------------------------- dropless top-k


@pytest.mark.parametrize("k", [1, 2, 3])
def test_topk_routing_matches_numpy(k) -> None:
    rng = np.random.default_rng(k)
    logits = rng.normal(size=(10, 8))
    weights, experts, probs = topk_routing(jnp.asarray(logits, jnp.float32), k=k)
    want_probs = _softmax(logits)
    want_experts = np.argsort(-want_probs, axis=-1, kind="stable")[:, :k]
    top = np.take_along_axis(want_probs, want_experts, axis=-1)
    np.testing.assert_array_equal(np.asarray(experts), want_experts)
    np.testing.assert_allclose(np.asarray(weights), top / top.sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(probs), want_probs, rtol=1e-6)
    assert experts.dtype == jnp.int32 and weights.dtype == jnp.float32


def test_topk_routing_rejects_bad_k() -> None:
    with pytest.raises(ValueError, match="k=9"):
        topk_routing(jnp.zeros((2, 8)), k=9)
    with pytest.raises(ValueError, match="k=0"):
        topk_routing(jnp.zeros((2, 8)), k=0)


@pytest.mark.parametrize("k", [1, 2])
def test_load_balancing_loss_topk_is_one_for_uniform_routing(k) -> None:
    base = np.array([3.0, 2.0, 1.0, 0.0])
    logits = np.stack([np.roll(base, n) for n in range(8)])
    _, experts, probs = topk_routing(jnp.asarray(logits, jnp.float32), k=k)
    loss = load_balancing_loss_topk(probs, experts, num_experts=4)
    np.testing.assert_allclose(float(loss), 1.0, rtol=1e-6)


def test_load_balancing_loss_topk_matches_numpy_with_paddings() -> None:
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(12, 6)) + np.array([1.0, 0, 0, 0, 0, 0])
    paddings = (rng.uniform(size=12) < 0.3).astype(np.float64)
    _, experts, probs = topk_routing(jnp.asarray(logits, jnp.float32), k=2)
    loss = load_balancing_loss_topk(probs, experts, num_experts=6,
                                    paddings=jnp.asarray(paddings, jnp.float32))
    p = _softmax(logits)
    chosen = np.argsort(-p, axis=-1, kind="stable")[:, :2]
    real = paddings == 0.0
    density = np.array([np.sum(chosen[real] == e) for e in range(6)]) / real.sum()
    proxy = p[real].mean(0)
    np.testing.assert_allclose(float(loss), np.mean(density * proxy) * 36 / 2, rtol=1e-5)


def test_router_z_loss_matches_numpy() -> None:
    rng = np.random.default_rng(11)
    logits = rng.normal(0.0, 3.0, (2, 5, 4))
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(float(router_z_loss(jnp.asarray(logits, jnp.float32))),
                               np.mean(lse**2), rtol=1e-5)
    paddings = np.zeros((2, 5))
    paddings[0, 3:] = 1.0
    got = router_z_loss(jnp.asarray(logits, jnp.float32), jnp.asarray(paddings, jnp.float32))
    np.testing.assert_allclose(float(got), np.mean(lse[paddings == 0.0] ** 2), rtol=1e-5)
    with pytest.raises(ValueError, match=r"paddings of shape \(5,\)"):
        router_z_loss(jnp.zeros((2, 5, 4)), jnp.zeros((5,)))
