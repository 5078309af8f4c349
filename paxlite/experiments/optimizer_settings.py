"""The optimizer's and the learning-rate schedule's hyperparameters (Pax's names and defaults).

Declared, mapped to `OptimizerConfig` / `ScheduleConfig` and checked here. A mixin of
``LanguageModelExperiment`` (base.py).
"""

from __future__ import annotations

from typing import Literal

import fiddle as fdl

from paxlite.config.experiment import Derived
from paxlite.experiments.field_names import in_hparam_names
from paxlite.train.optimizer import OptimizerConfig, optimizer_problems
from paxlite.train.schedules import ScheduleConfig, ScheduleKind, schedule_problems

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
# OptimizerConfig's fields -> the hyperparameters that set them (the mapping and the names its
# problems are reported in).
OPTIMIZER_FIELD_NAMES = {
    "beta1": "ADAM_BETA1",
    "beta2": "ADAM_BETA2",
    "epsilon": "ADAM_EPSILON",
    "epsilon_root": "ADAM_EPSILON_ROOT",
    "weight_decay": "WEIGHT_DECAY",
    "clip_gradient_norm_to_value": "CLIP_GRADIENT_NORM_TO_VALUE",
    "clip_threshold": "ADAM_CLIP_THRESHOLD",
    "mu_dtype": "ADAM_MU_DTYPE",
}


# The schedule fields whose settings are checked when an experiment is resolved.
_RESOLVE_TIME_SCHEDULE_FIELDS = ("warmup_steps", "decay_start", "decay_end", "max_multiplier")


def schedule_field_names(prefix: str | None) -> dict[str, str]:
    """ScheduleConfig's fields -> the hyperparameters that set them, for the schedule whose
    warm-up and decay settings start with ``prefix`` (None: a schedule without them)."""
    names = {"learning_rate": "LEARNING_RATE"}
    if prefix is not None:
        names.update({field: f"{prefix}_{suffix}"
                      for field, suffix in _SCHEDULE_FIELD_SUFFIXES.items()})
    return names


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
    # The dtype of Adam's first moment; bfloat16 saves 2 bytes a parameter (the second moment and
    # the weights stay float32).
    ADAM_MU_DTYPE: Literal["float32", "bfloat16"] = "float32"
    WEIGHT_DECAY: float = 1e-3
    CLIP_GRADIENT_NORM_TO_VALUE: float = 5.0

    def hparam_problems(self) -> list[str]:
        """ScheduleConfig's and OptimizerConfig's rules for the settings checked at resolve time:
        the warm-up and decay of every schedule (not only LR_SCHEDULE's, so a typo in the other is
        caught too) and the Adam betas. The other values (LEARNING_RATE, WEIGHT_DECAY, ...) the
        configs refuse when the run is built, which reports them in one line too."""
        problems = super().hparam_problems()
        for prefix in _SCHEDULE_PREFIXES.values():
            names = {field: name for field, name in schedule_field_names(prefix).items()
                     if field in _RESOLVE_TIME_SCHEDULE_FIELDS}
            problems += in_hparam_names(schedule_problems(**self._settings_for(names)),
                                        names=names)
        names = {field: OPTIMIZER_FIELD_NAMES[field] for field in ("beta1", "beta2")}
        problems += in_hparam_names(optimizer_problems(**self._settings_for(names)), names=names)
        return problems

    def _settings_for(self, names: dict[str, str]) -> dict[str, object]:
        """{field: the value of the hyperparameter ``names`` maps it to}."""
        return {field: getattr(self, name) for field, name in names.items()}

    def optimizer_config(self) -> fdl.Config[OptimizerConfig]:
        return fdl.Config(OptimizerConfig, **self._settings_for(OPTIMIZER_FIELD_NAMES))

    def schedule_config(self) -> fdl.Config[ScheduleConfig]:
        kind = ScheduleKind(self.LR_SCHEDULE)
        names = schedule_field_names(_SCHEDULE_PREFIXES.get(kind))
        return fdl.Config(ScheduleConfig, kind=kind, **self._settings_for(names))


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
