"""Adam as Pax trains it, built from optax pieces.

The chain reproduces `paxml/learners.py` + `praxis/optimizers.py:sharded_adam`:

    g <- g * min(1, clip_gradient_norm_to_value / ||g||)        (if clip_gradient_norm_to_value > 0)
    u <- m_hat / (sqrt(v_hat + epsilon_root) + epsilon)         (standard bias-corrected Adam)
    u <- u / max(1, rms(u) / clip_threshold)   per tensor       (if clip_threshold > 0)
    u <- u + weight_decay * param                               (decoupled, every parameter)
    u <- -lr(count) * u

Pax stores moments that are already bias-corrected (decay
beta_hat_t = beta(1-beta^(t-1))/(1-beta^t)); optax's `scale_by_adam` stores raw moments and
corrects at use. The updates are identical; only the stored `mu`/`nu` differ by a factor
1/(1-beta^t), which matters when converting optimizer state.

Every stage is always in the chain, whatever its setting: a disabled stage (clipping or the RMS cap
<= 0, weight decay 0) is the identity, so the optimizer-state tree - and therefore what a checkpoint
holds - does not depend on values users change between restarts of one job. Disabled stages return
the updates untouched (no multiply by 1, no `+ 0 * param`), so the updates are bit-identical to a
chain without them.

Adam's first moment may be stored in bfloat16 (`mu_dtype`, MaxText's setting of that name): it
halves mu's memory, a sixth of a float32 Adam state, and mu's decay (beta1 ~0.9) moves each step by
far more than bfloat16's resolution. The second moment stays float32: with beta2 ~0.99 or more its
per-step change is below bfloat16's resolution and the average would stall. Only the stored moment
is rounded: each step widens it to float32, updates and uses it there, and rounds the new moment.
(optax's own `mu_dtype` multiplies the bfloat16 moment by beta1 in bfloat16, which rounds beta1
itself: 0.9 acts as 0.8984375.)

Unlike Pax, a zero is taken at its word: `beta1=0.0` gives beta1 = 0 (Pax's `X if X else default`
turned GLaM's ADAM_BETA1 = 0 into 0.9).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

PyTree = Any
MU_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Adam hyperparameters with Pax names and meanings.

    Attributes:
        beta1: First-moment decay, in [0, 1).
        beta2: Second-moment decay, in [0, 1).
        epsilon: Added to sqrt(v_hat) in the denominator, >= 0.
        epsilon_root: Added to v_hat inside the square root, >= 0.
        weight_decay: Decoupled decay; each step subtracts lr * weight_decay * param.
        clip_gradient_norm_to_value: Global-norm clipping before Adam; <= 0 disables.
        clip_threshold: Pax ADAM_CLIP_THRESHOLD, RMS cap on each tensor's Adam update;
            <= 0 disables.
        mu_dtype: The dtype Adam's first moment is stored in, one of MU_DTYPES.
    """

    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    epsilon_root: float = 0.0
    weight_decay: float = 0.0
    clip_gradient_norm_to_value: float = 0.0
    clip_threshold: float = -1.0
    mu_dtype: str = "float32"

    def __post_init__(self) -> None:
        problems = optimizer_problems(**{f.name: getattr(self, f.name)
                                         for f in dataclasses.fields(self)})
        if problems:
            raise ValueError("; ".join(problems) + ".")


def optimizer_problems(**fields: float | str) -> list[str]:
    """What the values given cannot be, one clause each in OptimizerConfig's field names: the
    rules a config is refused by when it is made, which an experiment reports for its settings
    before it builds one."""
    problems = []
    for name, value in fields.items():
        if name in ("beta1", "beta2") and not 0.0 <= value < 1.0:
            problems.append(f"{name} must be in [0, 1), got {value!r}")
        elif (name in ("epsilon", "epsilon_root", "weight_decay")
              and not (math.isfinite(value) and value >= 0.0)):
            problems.append(f"{name} must be a finite number >= 0, got {value!r}")
        elif name in ("clip_gradient_norm_to_value", "clip_threshold") and math.isnan(value):
            problems.append(f"{name} must be a number (<= 0 disables it), got {value!r}")
        elif name == "mu_dtype" and value not in MU_DTYPES:
            problems.append(f"{name} must be one of {', '.join(MU_DTYPES)}, got {value!r}")
    return problems


def global_norm(tree: PyTree) -> jax.Array:
    """L2 norm over every leaf of `tree`, accumulated in float32 (bf16 squares would overflow)."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((), jnp.float32)
    squares = [jnp.sum(jnp.square(jnp.asarray(leaf, jnp.float32))) for leaf in leaves]
    return jnp.sqrt(sum(squares[1:], squares[0]))


class _EmptyState(NamedTuple):
    """Stateless transformations still need a pytree state."""


def _stateless(transform: Callable[[PyTree], PyTree]) -> optax.GradientTransformation:
    """A transformation of the updates alone: Pax's gradient scaling and update capping keep no
    state, yet optax needs a (empty) pytree state for them."""

    def init(params: PyTree) -> _EmptyState:
        del params
        return _EmptyState()

    def update(
        updates: PyTree, state: _EmptyState, params: PyTree | None = None
    ) -> tuple[PyTree, _EmptyState]:
        del params
        return transform(updates), state

    return optax.GradientTransformation(init, update)


def _clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Pax `Learner.scale_gradients`: scale by min(1, max_norm / ||g||); max_norm <= 0: identity."""

    def clip(updates: PyTree) -> PyTree:
        if max_norm <= 0:
            return updates
        norm = global_norm(updates)
        scale = jnp.minimum(1.0, max_norm / norm)
        return jax.tree.map(lambda g: (g * scale).astype(g.dtype), updates)

    return _stateless(clip)


def _cap_update_rms(clip_threshold: float) -> optax.GradientTransformation:
    """Pax ADAM_CLIP_THRESHOLD: u / max(1, rms(u) / clip_threshold), tensor by tensor; <= 0:
    identity."""

    def cap(u: jax.Array) -> jax.Array:
        rms = jnp.sqrt(jnp.mean(jnp.square(u.astype(jnp.float32))))
        return (u / jnp.maximum(1.0, rms / clip_threshold)).astype(u.dtype)

    def cap_all(updates: PyTree) -> PyTree:
        if clip_threshold <= 0:
            return updates
        return jax.tree.map(cap, updates)

    return _stateless(cap_all)


def _add_decayed_weights(weight_decay: float) -> optax.GradientTransformation:
    """u + weight_decay * param; weight_decay 0 is the identity with the same (empty) state."""
    return optax.add_decayed_weights(weight_decay) if weight_decay > 0 else optax.identity()


def _store_mu_as(dtype: str, adam: optax.GradientTransformation) -> optax.GradientTransformation:
    """`adam` (a float32 `scale_by_adam`) with its first moment stored in `dtype` between steps."""
    if dtype == "float32":
        return adam

    def store(state: optax.ScaleByAdamState, like: str | jnp.dtype) -> optax.ScaleByAdamState:
        mu = jax.tree.map(lambda m: m.astype(like), state.mu)
        return state._replace(mu=mu)

    def init(params: PyTree) -> optax.ScaleByAdamState:
        return store(adam.init(params), dtype)

    def update(updates: PyTree, state: optax.ScaleByAdamState,
               params: PyTree | None = None) -> tuple[PyTree, optax.ScaleByAdamState]:
        updates, state = adam.update(updates, store(state, jnp.float32), params)
        return updates, store(state, dtype)

    return optax.GradientTransformation(init, update)


def make_optimizer(
    config: OptimizerConfig, schedule: optax.Schedule
) -> optax.GradientTransformation:
    """Builds the Pax Adam chain; `schedule` maps the 0-based optimizer count to the rate.

    The five stages are always present (disabled ones are identities), so the state tree is the same
    for every hyperparameter value and a job resumes after any of them is changed.
    """
    return optax.chain(
        _clip_by_global_norm(config.clip_gradient_norm_to_value),
        _store_mu_as(config.mu_dtype, optax.scale_by_adam(
            b1=config.beta1, b2=config.beta2, eps=config.epsilon, eps_root=config.epsilon_root
        )),
        _cap_update_rms(config.clip_threshold),
        _add_decayed_weights(config.weight_decay),
        optax.scale_by_learning_rate(schedule),
    )
