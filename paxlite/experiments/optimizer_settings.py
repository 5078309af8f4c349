"""The optimizer's and the learning-rate schedule's hyperparameters (Pax's names and defaults).

Declared, mapped to `OptimizerConfig` / `ScheduleConfig` and checked here. A mixin of
``LanguageModelExperiment`` (base.py).
"""

from __future__ import annotations

from typing import Literal

import fiddle as fdl

from paxlite.config.experiment import Derived
from paxlite.train.optimizer import OptimizerConfig
from paxlite.train.schedules import ScheduleConfig, ScheduleKind

# The hyperparameters of each schedule with a warm-up and a decay: their prefix, and each one's
# suffix by the ScheduleConfig field it sets.
_SCHEDULE_PREFIXES = {
    ScheduleKind.LINEAR_RAMPUP_EXPONENTIAL_DECAY: "LR_LRED",
    ScheduleKind.LINEAR_RAMPUP_COSINE_DECAY: "LR_COS",
}
_SCHEDULE_FIELD_SUFFIXES = {
    "warmup_steps": "WARMUP",
    "decay_start": "DECAY_START",
    "decay_end": "DECAY_END",
    "min_ratio": "MIN_RATIO",
    "max_multiplier": "MAX",
}


class OptimizerSettings:
    """Adam with decoupled weight decay and global-norm clipping, and its schedule."""

    LEARNING_RATE: float = 1e-3
    LR_SCHEDULE: Literal[
        "linear_rampup_exponential_decay", "linear_rampup_cosine_decay", "constant"
    ] = "linear_rampup_exponential_decay"
    LR_LRED_WARMUP: int = 4000
    LR_LRED_DECAY_START: int = Derived(lambda hp: hp.LR_LRED_WARMUP + 1, doc="LR_LRED_WARMUP + 1")
    LR_LRED_DECAY_END: int = 300000
    LR_LRED_MIN_RATIO: float = 0.1
    LR_LRED_MAX: float = 1.0
    LR_COS_WARMUP: int = 4000
    LR_COS_DECAY_START: int = Derived(lambda hp: hp.LR_COS_WARMUP + 1, doc="LR_COS_WARMUP + 1")
    LR_COS_DECAY_END: int = 300000
    LR_COS_MIN_RATIO: float = 0.1
    LR_COS_MAX: float = 1.0
    ADAM_BETA1: float = 0.9
    ADAM_BETA2: float = 0.99
    ADAM_EPSILON: float = 1e-6
    ADAM_EPSILON_ROOT: float = 0.0
    ADAM_CLIP_THRESHOLD: float = 1.0
    WEIGHT_DECAY: float = 1e-3
    CLIP_GRADIENT_NORM_TO_VALUE: float = 5.0

    def hparam_problems(self) -> list[str]:
        problems = super().hparam_problems()
        for prefix in _SCHEDULE_PREFIXES.values():
            warmup, start, end = (getattr(self, f"{prefix}_{s}") for s in
                                  ("WARMUP", "DECAY_START", "DECAY_END"))
            if warmup < 0:
                problems.append(f"{prefix}_WARMUP must be >= 0, got {warmup}")
            if start < warmup:
                problems.append(f"{prefix}_DECAY_START ({start}) must be >= {prefix}_WARMUP "
                                f"({warmup})")
            if end < start:
                problems.append(f"{prefix}_DECAY_END ({end}) must be >= {prefix}_DECAY_START "
                                f"({start})")
            if getattr(self, f"{prefix}_MAX") <= 0:
                problems.append(f"{prefix}_MAX must be > 0, got {getattr(self, f'{prefix}_MAX')}")
        for name in ("ADAM_BETA1", "ADAM_BETA2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                problems.append(f"{name} must be in [0, 1), got {getattr(self, name)}")
        return problems

    def optimizer_config(self) -> fdl.Config[OptimizerConfig]:
        return fdl.Config(
            OptimizerConfig,
            beta1=self.ADAM_BETA1,
            beta2=self.ADAM_BETA2,
            epsilon=self.ADAM_EPSILON,
            epsilon_root=self.ADAM_EPSILON_ROOT,
            weight_decay=self.WEIGHT_DECAY,
            clip_gradient_norm_to_value=self.CLIP_GRADIENT_NORM_TO_VALUE,
            clip_threshold=self.ADAM_CLIP_THRESHOLD,
        )

    def schedule_config(self) -> fdl.Config[ScheduleConfig]:
        kind = ScheduleKind(self.LR_SCHEDULE)
        prefix = _SCHEDULE_PREFIXES.get(kind)
        warmup_and_decay = {} if prefix is None else {
            field: getattr(self, f"{prefix}_{suffix}")
            for field, suffix in _SCHEDULE_FIELD_SUFFIXES.items()}
        return fdl.Config(ScheduleConfig, kind=kind, learning_rate=self.LEARNING_RATE,
                          **warmup_and_decay)


class GPT3Optimizer:
    """Mixin: GPT-3's optimizer, which Pax's GPT configs and AXLearn's Fuji both train with: Adam
    with beta2 0.95, epsilon 1e-8 and no update clipping, gradients clipped to global norm 1, and
    a cosine decay to a tenth of the peak. The family sets the peak, the warm-up, the end of the
    decay and the weight decay. Listed before the family's base class, so these values win."""

    LR_SCHEDULE = "linear_rampup_cosine_decay"
    LR_COS_MIN_RATIO = 0.1
    LR_COS_MAX = 1.0
    ADAM_BETA1 = 0.9
    ADAM_BETA2 = 0.95
    ADAM_EPSILON = 1e-8
    ADAM_EPSILON_ROOT = 0.0
    ADAM_CLIP_THRESHOLD = -1.0
    CLIP_GRADIENT_NORM_TO_VALUE = 1.0
