"""The optax chain against an independent float64 NumPy implementation of Pax's Adam."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from paxlite.train.optimizer import OptimizerConfig, global_norm, make_optimizer
from paxlite.train.schedules import ScheduleConfig, ScheduleKind, make_schedule

LR = 1e-2
WARMUP, DECAY_END, MIN_RATIO = 3, 8, 0.1
STEPS = 6


def _multiplier(count: int) -> float:
    """Hand formula of the schedule used below: ramp over 3 counts, cosine to 0.1 by count 8."""
    if count < WARMUP:
        return count / WARMUP
    frac = min(1.0, (count - WARMUP) / (DECAY_END - WARMUP))
    return MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * frac))


def _schedule() -> optax.Schedule:
    return make_schedule(
        ScheduleConfig(
            kind=ScheduleKind.LINEAR_RAMPUP_COSINE_DECAY,
            learning_rate=LR,
            warmup_steps=WARMUP,
            decay_start=WARMUP,
            decay_end=DECAY_END,
            min_ratio=MIN_RATIO,
        )
    )


def _pax_adam_reference(
    params: dict[str, np.ndarray], grads: list[dict[str, np.ndarray]], config: OptimizerConfig
) -> list[dict[str, np.ndarray]]:
    """Pax `sharded_adam` in float64: moments stored already bias-corrected via beta_hat_t."""
    params = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v = {k: np.zeros_like(p) for k, p in params.items()}
    history = []
    for t in range(1, len(grads) + 1):
        g = {k: x.astype(np.float64) for k, x in grads[t - 1].items()}
        if config.clip_gradient_norm_to_value > 0:
            norm = math.sqrt(sum(float(np.sum(x * x)) for x in g.values()))
            scale = min(1.0, config.clip_gradient_norm_to_value / norm)
            g = {k: x * scale for k, x in g.items()}
        b1, b2 = config.beta1, config.beta2
        b1_hat = b1 * (1 - b1 ** (t - 1)) / (1 - b1**t)
        b2_hat = b2 * (1 - b2 ** (t - 1)) / (1 - b2**t)
        lr = LR * _multiplier(t - 1)
        for k in params:
            m[k] = b1_hat * m[k] + (1 - b1_hat) * g[k]
            v[k] = b2_hat * v[k] + (1 - b2_hat) * g[k] ** 2
            u = m[k] / (np.sqrt(v[k] + config.epsilon_root) + config.epsilon)
            if config.clip_threshold > 0:
                rms = math.sqrt(float(np.mean(u * u)))
                u = u / max(1.0, rms / config.clip_threshold)
            u = u + config.weight_decay * params[k]
            params[k] = params[k] - lr * u
        history.append({k: p.copy() for k, p in params.items()})
    return history


def _problem() -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(0)
    params = {
        "w": rng.normal(size=(4, 3)).astype(np.float32),
        "b": rng.normal(size=(3,)).astype(np.float32),
    }
    # Gradient scales differ per step so that clipping triggers on some steps and not others.
    grads = [
        {k: (rng.normal(size=p.shape) * s).astype(np.float32) for k, p in params.items()}
        for s in (3.0, 0.1, 1.0, 5.0, 0.2, 0.7)
    ]
    return params, grads


def _run_optax(
    params: dict[str, np.ndarray], grads: list[dict[str, np.ndarray]], config: OptimizerConfig
) -> list[dict[str, np.ndarray]]:
    return _run_tx(make_optimizer(config, _schedule()), params, grads)


def _run_tx(
    tx: optax.GradientTransformation,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
) -> list[dict[str, np.ndarray]]:
    p = jax.tree.map(jnp.asarray, params)
    state = tx.init(p)

    @jax.jit
    def step(p, state, g):
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), state

    history = []
    for g in grads:
        p, state = step(p, state, jax.tree.map(jnp.asarray, g))
        history.append(jax.tree.map(np.asarray, p))
    return history


@pytest.mark.parametrize(
    "config",
    [
        OptimizerConfig(
            beta1=0.0,
            beta2=0.99,
            epsilon=1e-6,
            epsilon_root=1e-3,
            weight_decay=0.1,
            clip_gradient_norm_to_value=2.0,
            clip_threshold=0.5,
        ),
        OptimizerConfig(beta1=0.9, beta2=0.95, epsilon=1e-8, weight_decay=0.01),
    ],
    ids=["beta1_0_clipped_capped", "beta1_0.9_plain"],
)
def test_matches_float64_pax_reference(config: OptimizerConfig) -> None:
    params, grads = _problem()
    assert len(grads) == STEPS
    got = _run_optax(params, grads, config)
    want = _pax_adam_reference(params, grads, config)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for k in w:
            np.testing.assert_allclose(g[k], w[k], rtol=1e-5, atol=1e-7, err_msg=f"{k}@{step}")


def test_capping_and_clipping_actually_trigger() -> None:
    """Guards the reference test: the options it enables must change the result."""
    params, grads = _problem()
    base = dict(beta1=0.0, beta2=0.99, epsilon=1e-6, weight_decay=0.1)
    full = _run_optax(
        params, grads, OptimizerConfig(**base, clip_gradient_norm_to_value=2.0, clip_threshold=0.5)
    )[-1]
    no_cap = _run_optax(params, grads, OptimizerConfig(**base, clip_gradient_norm_to_value=2.0))[-1]
    no_clip = _run_optax(params, grads, OptimizerConfig(**base, clip_threshold=0.5))[-1]
    assert not np.allclose(full["w"], no_cap["w"], rtol=1e-4)
    assert not np.allclose(full["w"], no_clip["w"], rtol=1e-4)


def test_beta1_zero_is_really_zero() -> None:
    params, grads = _problem()
    zero = _run_optax(params, grads, OptimizerConfig(beta1=0.0))
    default = _run_optax(params, grads, OptimizerConfig(beta1=0.9))
    # With beta1 = 0 the first moment is the current gradient: a 0.9 fallback would differ.
    assert not np.allclose(zero[-1]["w"], default[-1]["w"], rtol=1e-3)
    # Step 2 (count 1, lr = LR/3) by hand: u = g2 / (sqrt(v_hat) + eps) with v_hat from 2 grads.
    b2 = 0.999
    g1, g2 = (grads[0]["w"].astype(np.float64), grads[1]["w"].astype(np.float64))
    v_hat = (b2 * (1 - b2) * g1**2 + (1 - b2) * g2**2) / (1 - b2**2)
    u1 = g1 / (np.abs(g1) + 1e-8)
    want = params["w"] - 0.0 * u1 - (LR / 3) * g2 / (np.sqrt(v_hat) + 1e-8)
    np.testing.assert_allclose(zero[1]["w"], want, rtol=1e-5, atol=1e-7)


def test_zero_learning_rate_at_count_zero_leaves_params() -> None:
    params, grads = _problem()
    first = _run_optax(params, grads[:1], OptimizerConfig(weight_decay=0.5))[0]
    np.testing.assert_array_equal(first["w"], params["w"])


def test_global_norm_matches_numpy() -> None:
    tree = {"a": jnp.arange(6.0).reshape(2, 3), "b": [jnp.ones(4, jnp.bfloat16) * 300]}
    want = math.sqrt(sum(x * x for x in range(6)) + 4 * 300.0**2)
    np.testing.assert_allclose(float(global_norm(tree)), want, rtol=1e-6)
    assert float(global_norm({})) == 0.0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("beta1", 1.0),
        ("beta1", -0.1),
        ("beta2", 1.0),
        ("epsilon", -1e-8),
        ("epsilon_root", -1.0),
        ("weight_decay", -0.1),
        ("clip_threshold", float("nan")),
        ("mu_dtype", "float16"),
    ],
)
def test_invalid_values_are_named(field: str, value: float | str) -> None:
    with pytest.raises(ValueError, match=field):
        OptimizerConfig(**{field: value})


_SETTINGS = [
    dict(weight_decay=0.0, clip_gradient_norm_to_value=0.0, clip_threshold=-1.0),
    dict(weight_decay=0.1, clip_gradient_norm_to_value=2.0, clip_threshold=0.5),
    dict(weight_decay=0.0, clip_gradient_norm_to_value=2.0, clip_threshold=-1.0),
    dict(weight_decay=0.1, clip_gradient_norm_to_value=-1.0, clip_threshold=0.0),
]


def test_state_tree_does_not_depend_on_settings() -> None:
    """Toggling clipping, the RMS cap or weight decay must not change what a checkpoint holds."""
    params = jax.tree.map(jnp.asarray, _problem()[0])
    trees = [
        jax.tree_util.tree_structure(
            make_optimizer(OptimizerConfig(**settings), _schedule()).init(params))
        for settings in _SETTINGS
    ]
    assert all(tree == trees[0] for tree in trees), trees


def test_disabled_stages_are_bit_identical_to_leaving_them_out() -> None:
    """Reference: the bare optax chain of only the enabled stages (what the chain was before)."""
    params, grads = _problem()
    config = OptimizerConfig(beta1=0.9, beta2=0.95, epsilon=1e-8)
    bare = optax.chain(optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8, eps_root=0.0),
                       optax.scale_by_learning_rate(_schedule()))
    want = _run_tx(bare, params, grads)
    got = _run_optax(params, grads, config)
    assert len(got) == len(want) == STEPS
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for k in params:
            assert g[k].tobytes() == w[k].tobytes(), f"{k}@{step}"


def _bf16(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16).astype(np.float64)


def _adam_with_bf16_mu_reference(
    params: dict[str, np.ndarray], grads: list[dict[str, np.ndarray]], *, b1: float, b2: float,
    eps: float,
) -> list[dict[str, np.ndarray]]:
    """Adam in float64 whose stored first moment (the raw one, bias-corrected only when used) is
    rounded to bfloat16 after each step; the step itself uses the unrounded new moment, and beta1
    is not rounded. nu is not rounded."""
    params = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v = {k: np.zeros_like(p) for k, p in params.items()}
    history = []
    for t in range(1, len(grads) + 1):
        lr = LR * _multiplier(t - 1)
        for k in params:
            g = grads[t - 1][k].astype(np.float64)
            new_m = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g**2
            u = (new_m / (1 - b1**t)) / (np.sqrt(v[k] / (1 - b2**t)) + eps)
            params[k] = params[k] - lr * u
            m[k] = _bf16(new_m)
        history.append({k: p.copy() for k, p in params.items()})
    return history


def test_bfloat16_first_moment_matches_a_rounded_reference() -> None:
    """ADAM_MU_DTYPE=bfloat16: mu is stored in bfloat16 (nu and the weights stay float32) and the
    steps equal Adam whose first moment is rounded to bfloat16 each step."""
    params, grads = _problem()
    config = OptimizerConfig(beta1=0.9, beta2=0.95, epsilon=1e-8, mu_dtype="bfloat16")
    state = make_optimizer(config, _schedule()).init(jax.tree.map(jnp.asarray, params))
    adam = state[1]
    assert {leaf.dtype for leaf in jax.tree.leaves(adam.mu)} == {jnp.dtype(jnp.bfloat16)}
    assert {leaf.dtype for leaf in jax.tree.leaves(adam.nu)} == {jnp.dtype(jnp.float32)}
    got = _run_optax(params, grads, config)
    want = _adam_with_bf16_mu_reference(params, grads, b1=0.9, b2=0.95, eps=1e-8)
    float32_mu = _run_optax(params, grads, OptimizerConfig(beta1=0.9, beta2=0.95, epsilon=1e-8))
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for k in w:
            assert g[k].dtype == np.float32
            np.testing.assert_allclose(g[k], w[k], rtol=1e-5, atol=1e-7, err_msg=f"{k}@{step}")
    # The rounding is real: the float32 moment gives other weights.
    assert not np.allclose(got[-1]["w"], float32_mu[-1]["w"], rtol=1e-6, atol=0)
