"""WANDB_*: logging a run to Weights & Biases, declared, mapped to `WandbConfig` and checked here.

Apart from base.py because the settings are their own small family with their own mistakes, found
when the experiment resolves, before any device is touched: a project name W&B would refuse, an
empty tag, an entity, run name or tags given without WANDB_PROJECT (nothing would read them).
Whether the wandb package is installed is asked when the run starts (train/wandb_sink.py), before
anything compiles, and not here: a job recorded with WANDB_PROJECT must stay readable (convert,
generate, show) on a machine without wandb. What else W&B needs (online or offline, where its
files go, the API key) is wandb's own environment (WANDB_MODE, WANDB_DIR, WANDB_API_KEY), read by
wandb. A mixin of ``LanguageModelExperiment`` (base.py).
"""

from __future__ import annotations

import fiddle as fdl

from paxlite.train.run_config import WandbConfig

_DEPENDENT = ("WANDB_ENTITY", "WANDB_RUN_NAME", "WANDB_TAGS")
# What W&B refuses in a project name (wandb's own check, which would come only once the run starts)
_PROJECT_NAME_FORBIDS = "/\\#?%:"
_PROJECT_NAME_MAX = 128
_TAG_MAX = 64


class WandbSettings:
    """The WANDB_* part of an experiment's run tree."""

    # Weights & Biases project to log to (docs/training.md; the `wandb` extra): metrics.jsonl's
    # scalars at its steps, and the hyperparameters as the W&B run's config, from process 0. None:
    # no W&B. WANDB_RUN_NAME None: the job directory's name. A job directory keeps its W&B run
    # (DIR/wandb_run_id): the same job started again continues the same W&B run.
    WANDB_PROJECT: str | None = None
    WANDB_ENTITY: str | None = None  # None: the API key's default entity
    WANDB_RUN_NAME: str | None = None
    WANDB_TAGS: list[str] | None = None

    def hparam_problems(self) -> list[str]:
        problems = super().hparam_problems()
        project = self.WANDB_PROJECT
        if project is None:
            given = [n for n in _DEPENDENT if n in self.overridden]
            if given:
                problems.append(
                    f"{', '.join(given)} set without WANDB_PROJECT: name the Weights & Biases "
                    f"project to log to (--fdl.WANDB_PROJECT=NAME), or drop "
                    f"{'it' if len(given) == 1 else 'them'}")
            return problems
        forbidden = sorted({c for c in project if c in _PROJECT_NAME_FORBIDS})
        if not project.strip() or forbidden or len(project) > _PROJECT_NAME_MAX:
            problems.append(
                f"WANDB_PROJECT={project!r} is not a Weights & Biases project name: it is 1 to "
                f"{_PROJECT_NAME_MAX} characters without any of {_PROJECT_NAME_FORBIDS!r}")
        for name in ("WANDB_ENTITY", "WANDB_RUN_NAME"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                problems.append(f"{name}={value!r} is empty: give a name or leave it unset")
        bad_tags = [t for t in self.WANDB_TAGS or () if not 1 <= len(t.strip()) <= _TAG_MAX]
        if bad_tags:
            problems.append(f"WANDB_TAGS={self.WANDB_TAGS}: {bad_tags} are not tags (W&B takes 1 "
                            f"to {_TAG_MAX} characters each)")
        return problems

    def wandb_config(self) -> fdl.Config[WandbConfig] | None:
        if self.WANDB_PROJECT is None:
            return None
        return fdl.Config(
            WandbConfig,
            project=self.WANDB_PROJECT,
            entity=self.WANDB_ENTITY,
            run_name=self.WANDB_RUN_NAME,
            tags=tuple(t.strip() for t in self.WANDB_TAGS or ()),
            hparams=self.hparams(),
        )
