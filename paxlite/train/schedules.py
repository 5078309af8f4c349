"""Learning-rate schedules with Pax semantics.

Pax (praxis `schedules.py`, used by `c4.py:set_adam_and_learning_rate_schedule`) expresses every
schedule as a *multiplier* on LEARNING_RATE, evaluated at the optimizer count (0-based, read before
it is incremented). We keep that meaning so that a Pax experiment's numbers give the same curve:

    lr(count) = learning_rate * multiplier(count)

Ramp-up kinds: the multiplier rises linearly from 0 (at count 0) to `max_multiplier` over
`warmup_steps`, holds `max_multiplier` until `decay_start`, decays to
`max_multiplier * min_ratio` over `[decay_start, decay_end]` (cosine or exponential) and is held at
that minimum afterwards. CONSTANT is Pax's `Constant` schedule: the multiplier is 1, so the rate is
`learning_rate` and the shape fields are not used (they are still validated, so a typo is caught).

The schedule is written with `jnp.where` rather than Python branches so that it is traceable: the
count arrives as a traced int32 inside the jitted train step.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import jax
import jax.numpy as jnp
import optax


class ScheduleKind(str, enum.Enum):
    """The Pax LR_SCHEDULE values."""

    LINEAR_RAMPUP_COSINE_DECAY = "linear_rampup_cosine_decay"
    LINEAR_RAMPUP_EXPONENTIAL_DECAY = "linear_rampup_exponential_decay"
    CONSTANT = "constant"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """Learning-rate schedule; `learning_rate` is multiplied by the Pax-style multiplier.

    Attributes:
        kind: Schedule shape; a string such as "constant" is coerced to the enum.
        learning_rate: Peak base rate (Pax LEARNING_RATE).
        warmup_steps: Steps of the linear ramp from 0 (Pax LR_COS_WARMUP / LR_LRED_WARMUP).
        decay_start: Count at which the decay begins; must be >= warmup_steps.
        decay_end: Count at which the minimum is reached; must be >= decay_start.
        min_ratio: Final multiplier as a fraction of `max_multiplier`, in [0, 1].
        max_multiplier: Multiplier at the end of the ramp (Pax LR_COS_MAX / LR_LRED_MAX).
    """

    kind: ScheduleKind
    learning_rate: float
    warmup_steps: int = 0
    decay_start: int = 0
    decay_end: int = 0
    min_ratio: float = 0.1
    max_multiplier: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ScheduleKind):
            try:
                kind = ScheduleKind(self.kind)
            except ValueError:
                valid = ", ".join(k.value for k in ScheduleKind)
                raise ValueError(
                    f"Unknown schedule kind {self.kind!r}; valid kinds are: {valid}."
                ) from None
            object.__setattr__(self, "kind", kind)
        problems = schedule_problems(**{f.name: getattr(self, f.name)
                                        for f in dataclasses.fields(self) if f.name != "kind"})
        if problems:
            raise ValueError("; ".join(problems) + ".")


def schedule_problems(**fields: object) -> list[str]:
    """Values Pax would either assert on or silently misuse, one clause each in ScheduleConfig's
    field names: the rules a config is refused by when it is made, which an experiment reports for
    its settings before it builds one. Only the fields given are checked (an experiment checks the
    warm-up and decay of each schedule it has settings for)."""
    problems = []
    rate = fields.get("learning_rate")
    if "learning_rate" in fields and not _is_number(rate, minimum=0.0):
        problems.append(f"learning_rate must be a finite number >= 0, got {rate!r}")
    steps = {}
    for name in ("warmup_steps", "decay_start", "decay_end"):
        if name not in fields:
            continue
        value = fields[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            problems.append(f"{name} must be an integer >= 0, got {value!r}")
        else:
            steps[name] = value
    for later, earlier in (("decay_start", "warmup_steps"), ("decay_end", "decay_start")):
        if later in steps and earlier in steps and steps[later] < steps[earlier]:
            problems.append(f"{later} ({steps[later]}) must be >= {earlier} ({steps[earlier]})")
    peak = fields.get("max_multiplier")
    if "max_multiplier" in fields and not (_is_number(peak, minimum=0.0) and peak > 0):
        problems.append(f"max_multiplier must be a finite number > 0, got {peak!r}")
    ratio = fields.get("min_ratio")
    if "min_ratio" in fields and not (_is_number(ratio, minimum=0.0) and ratio <= 1.0):
        problems.append(f"min_ratio must be in [0, 1], got {ratio!r}")
    return problems


def _is_number(value: object, *, minimum: float) -> bool:
    """A finite int or float (not a bool) of at least ``minimum``."""
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value) and value >= minimum)


def _ramp_then_hold(count: jax.Array, config: ScheduleConfig) -> jax.Array:
    """Multiplier for counts before decay_start: linear ramp 0 -> max, then max."""
    peak = config.max_multiplier
    if config.warmup_steps == 0:
        return jnp.full_like(count, peak)
    ramp = peak * count / config.warmup_steps
    return jnp.where(count < config.warmup_steps, ramp, peak)


def _decay_fraction(count: jax.Array, config: ScheduleConfig) -> jax.Array:
    """Progress through [decay_start, decay_end] in [0, 1]; an empty interval jumps to 1."""
    length = config.decay_end - config.decay_start
    if length == 0:
        return jnp.where(count < config.decay_start, 0.0, 1.0).astype(count.dtype)
    return jnp.clip((count - config.decay_start) / length, 0.0, 1.0)


def make_schedule(config: ScheduleConfig) -> optax.Schedule:
    """Returns count (0-based optimizer count, Python int or jnp scalar) -> learning rate."""
    learning_rate = config.learning_rate
    if config.kind is ScheduleKind.CONSTANT:

        def constant(count: jax.Array | int) -> jax.Array:
            # Shape and dtype follow a float32 scalar regardless of the count's integer type.
            return jnp.full(jnp.shape(count), learning_rate, dtype=jnp.float32)

        return constant

    peak = config.max_multiplier
    floor = peak * config.min_ratio
    exponential = config.kind is ScheduleKind.LINEAR_RAMPUP_EXPONENTIAL_DECAY

    def schedule(count: jax.Array | int) -> jax.Array:
        step = jnp.asarray(count).astype(jnp.float32)
        fraction = _decay_fraction(step, config)
        if exponential:
            # max * min_ratio ** fraction: equals max at the start and max*min_ratio at the end.
            decayed = peak * jnp.power(jnp.float32(config.min_ratio), fraction)
        else:
            decayed = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * fraction))
        multiplier = jnp.where(step < config.decay_start, _ramp_then_hold(step, config), decayed)
        return learning_rate * multiplier

    return schedule
