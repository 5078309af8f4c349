"""Schedules against hand-computed Pax multipliers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxlite.train.schedules import ScheduleConfig, ScheduleKind, make_schedule

LR = 6e-4


def _cosine(**overrides: object) -> ScheduleConfig:
    fields: dict = dict(
        kind=ScheduleKind.LINEAR_RAMPUP_COSINE_DECAY,
        learning_rate=LR,
        warmup_steps=10,
        decay_start=20,
        decay_end=120,
        min_ratio=0.1,
        max_multiplier=2.0,
    )
    fields.update(overrides)
    return ScheduleConfig(**fields)


def test_cosine_hand_values() -> None:
    schedule = make_schedule(_cosine())
    # Multiplier: ramp 0 -> 2 over 10 steps, hold 2 until 20, cosine 2 -> 0.2 over [20, 120].
    expected = {
        0: 0.0,
        5: 1.0,  # mid-warmup: 2 * 5/10
        10: 2.0,  # end of warmup
        15: 2.0,  # hold
        20: 2.0,  # decay start
        70: 0.2 + 1.8 * 0.5,  # mid-decay: cos(pi/2) = 0
        45: 0.2 + 1.8 * 0.5 * (1 + math.cos(math.pi * 0.25)),
        120: 0.2,  # decay end
        500: 0.2,  # held at the minimum
    }
    for count, multiplier in expected.items():
        np.testing.assert_allclose(float(schedule(count)), LR * multiplier, rtol=1e-6, atol=1e-12)


def test_exponential_hand_values() -> None:
    schedule = make_schedule(_cosine(kind=ScheduleKind.LINEAR_RAMPUP_EXPONENTIAL_DECAY))
    expected = {
        0: 0.0,
        5: 1.0,
        10: 2.0,
        20: 2.0,
        70: 2.0 * 0.1**0.5,
        45: 2.0 * 0.1**0.25,
        120: 0.2,
        1000: 0.2,
    }
    for count, multiplier in expected.items():
        np.testing.assert_allclose(float(schedule(count)), LR * multiplier, rtol=1e-6, atol=1e-12)


def test_zero_warmup_starts_at_peak() -> None:
    schedule = make_schedule(_cosine(warmup_steps=0, decay_start=0, decay_end=100))
    np.testing.assert_allclose(float(schedule(0)), LR * 2.0, rtol=1e-6)
    np.testing.assert_allclose(float(schedule(50)), LR * 1.1, rtol=1e-6)
    np.testing.assert_allclose(float(schedule(100)), LR * 0.2, rtol=1e-6)


def test_decay_start_equal_to_warmup_has_no_plateau() -> None:
    # The GPT configs use decay_start = warmup + 1; here the decay starts right at the peak.
    schedule = make_schedule(_cosine(warmup_steps=10, decay_start=10, decay_end=110))
    np.testing.assert_allclose(float(schedule(9)), LR * 1.8, rtol=1e-6)
    np.testing.assert_allclose(float(schedule(10)), LR * 2.0, rtol=1e-6)
    np.testing.assert_allclose(float(schedule(60)), LR * 1.1, rtol=1e-6)


def test_empty_decay_interval_drops_to_minimum() -> None:
    schedule = make_schedule(_cosine(warmup_steps=4, decay_start=8, decay_end=8, min_ratio=0.5))
    assert float(schedule(7)) == pytest.approx(LR * 2.0)
    assert float(schedule(8)) == pytest.approx(LR * 1.0)


def test_constant_is_learning_rate() -> None:
    schedule = make_schedule(ScheduleConfig(
        kind="constant", learning_rate=LR, warmup_steps=5, decay_start=5, decay_end=9
    ))
    for count in (0, 3, 10**6):
        assert float(schedule(count)) == pytest.approx(LR, rel=1e-7)


def test_string_kind_is_coerced() -> None:
    config = ScheduleConfig(kind="linear_rampup_cosine_decay", learning_rate=1.0)
    assert config.kind is ScheduleKind.LINEAR_RAMPUP_COSINE_DECAY


@pytest.mark.parametrize(
    "kind", [ScheduleKind.LINEAR_RAMPUP_COSINE_DECAY, ScheduleKind.LINEAR_RAMPUP_EXPONENTIAL_DECAY]
)
def test_jit_with_traced_count_matches_eager(kind: ScheduleKind) -> None:
    schedule = make_schedule(_cosine(kind=kind))
    counts = jnp.array([0, 5, 10, 20, 45, 70, 120, 500], dtype=jnp.int32)
    jitted = jax.jit(jax.vmap(schedule))(counts)
    eager = np.array([float(schedule(int(c))) for c in counts])
    assert jitted.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(jitted), eager, rtol=1e-6, atol=1e-12)


def test_constant_under_jit() -> None:
    schedule = make_schedule(ScheduleConfig(kind=ScheduleKind.CONSTANT, learning_rate=LR))
    value = jax.jit(schedule)(jnp.int32(7))
    assert value.shape == () and float(value) == pytest.approx(LR)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(decay_start=5), "decay_start"),
        (dict(decay_end=15), "decay_end"),
        (dict(max_multiplier=0.0), "max_multiplier"),
        (dict(min_ratio=1.5), "min_ratio"),
        (dict(min_ratio=-0.1), "min_ratio"),
        (dict(learning_rate=-1e-3), "learning_rate"),
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(kind="cosine"), "linear_rampup_cosine_decay"),
    ],
)
def test_invalid_values_are_named(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _cosine(**overrides)
