"""The base of every registered experiment: the topic mixins together, and the run's Fiddle tree.

Each hyperparameter is declared next to the code that maps and checks it, by topic: the model
(model_settings.py), the mesh, pipeline and sequence parallelism (parallelism_settings.py), the
optimizer and schedule (optimizer_settings.py), the loop, checkpoints, profiler and watchdog
(loop_settings.py), the data (data_settings.py), lm-evaluation-harness tasks (lm_eval_settings.py),
attention (attention_settings.py), mixture-of-experts (moe_settings.py), Weights & Biases
(wandb_settings.py) and chat fine-tuning (chat_settings.py). Families (gpt.py, tiny.py, ...) only
set hyperparameters and say how they build their model. What is left here: the order the checks
run in, the checks that read several topics (paths, unread settings) and the run tree, so
`config.txt` shows the whole run and `fdl.build` turns it into plain dataclasses.

Why some topics are several classes: `show`, the golden files and job records list the
hyperparameters in the reverse order of the base classes (`Experiment.hparam_specs`), and that
order predates the topic modules; the classes below are listed so that it stays the same.
"""

from __future__ import annotations

import os
from typing import ClassVar

import fiddle as fdl

from paxlite.config.errors import ConfigError
from paxlite.config.experiment import Experiment
from paxlite.experiments.attention_settings import AttentionSettings, check_attention_settings
from paxlite.experiments.chat_settings import ChatSettings
from paxlite.experiments.data_settings import DataSettings, DataSource, TfdsSettings
from paxlite.experiments.dpo_settings import DpoSettings
from paxlite.experiments.lm_eval_settings import LmEvalSettings
from paxlite.experiments.loop_settings import (
    BatchSettings,
    CheckpointRestoreSettings,
    GlobalBatchSettings,
    LoopSettings,
    RunSettings,
)
from paxlite.experiments.model_settings import (
    Fp8Settings,
    LoraSettings,
    ModelDtypeSettings,
    ModelLayerSettings,
    ModelShapeSettings,
)
from paxlite.experiments.moe_settings import ExpertParallelSettings
from paxlite.experiments.optimizer_settings import OptimizerSettings
from paxlite.experiments.parallelism_settings import ParallelismSettings
from paxlite.experiments.wandb_settings import WandbSettings
from paxlite.paths import UnsupportedPathError, require_local_path
from paxlite.train.run_config import RunConfig

__all__ = ["DataSource", "LanguageModelExperiment", "TransformerLmSettings"]


class TransformerLmSettings(DataSettings, RunSettings, ModelLayerSettings, LoopSettings,
                            OptimizerSettings, ModelDtypeSettings, ParallelismSettings,
                            BatchSettings, ModelShapeSettings, Experiment):
    """Pax's TransformerLmSpmdAdam hyperparameters and defaults, before any model family or the
    settings paxlite adds (LanguageModelExperiment); not registered, not runnable."""


class LanguageModelExperiment(DpoSettings, ChatSettings, WandbSettings, Fp8Settings,
                              ExpertParallelSettings, LoraSettings, CheckpointRestoreSettings,
                              AttentionSettings, GlobalBatchSettings, TfdsSettings,
                              LmEvalSettings, TransformerLmSettings):
    """Base of every registered experiment: maps hyperparameters to a `RunConfig` Fiddle tree."""

    def validate(self) -> None:
        """Every topic's checks, in the order their errors are reported (the first that fails)."""
        problems = self.dense_mesh_problems() + self.lm_eval_problems()
        if problems:
            raise ConfigError(f"invalid {self.name} hyperparameters: " + "; ".join(problems))
        super().validate()  # each topic's hparam_problems
        for problems in (self.global_batch_problems(), self._attention_problems(),
                         self.eval_data_problems(), self.tfds_dataset_problems(),
                         self.fp8_problems(), self.lora_problems(), self.ignore_rule_problems()):
            if problems:
                raise ConfigError(problems[0])
        problems = [*self._path_problems(), *self._unread_setting_problems(),
                    *self.parallelism_problems()]
        if problems:
            raise ConfigError(f"invalid {self.name} hyperparameters: " + "; ".join(problems))

    def _attention_problems(self) -> list[str]:
        check_attention_settings(self)  # raises its own ConfigError
        return []

    # Hyperparameters that name files or directories (and the environment variables that stand in
    # for two of them): all must be local or mounted paths (paxlite/paths.py says why).
    path_settings: ClassVar[tuple[str, ...]] = (
        "DATA_DIR", "VOCAB_PATH", "TFDS_DATA_DIR", "LAMBADA_PATH", "BOOLQ_PATH", "BOOLQ_TRAIN_PATH",
        "CHECKPOINT_RESTORE_PATH", "CHAT_DATA", "CHAT_EVAL_DATA", "CHAT_TEMPLATE", "DPO_DATA",
        "DPO_EVAL_DATA", "DPO_REFERENCE_PATH",
    )

    def _path_problems(self) -> list[str]:
        values = [(name, getattr(self, name)) for name in self.path_settings]
        values += [(f"the {name} environment variable", os.environ.get(name))
                   for name in ("VOCAB_PATH", "TFDS_DATA_DIR") if getattr(self, name) is None]
        problems = []
        for setting, value in values:
            if value:
                try:
                    require_local_path(value, setting=setting)
                except UnsupportedPathError as e:
                    problems.append(str(e))
        return problems

    def _unread_setting_problems(self) -> list[str]:
        """A setting given (--fdl.X, or the overrides a job recorded) where nothing reads it is an
        error: the run would silently do something other than what was asked. Only explicitly set
        names count, so an experiment class's own defaults (Fuji's TFDS_DATASET) stay harmless."""
        return [*self.unread_lora_problems(), *self.unread_restore_problems(),
                *self.unread_data_problems(), *self.unread_fp8_problems(),
                *self.unread_profiler_problems(), *self.unread_tfds_problems()]

    # ------------------------------------------------------------------ the run
    def run_config(self) -> fdl.Config[RunConfig]:
        """The Fiddle tree of the whole run."""
        return fdl.Config(
            RunConfig,
            experiment=self.name,
            model=self.with_lora(self.model_config()),
            optimizer=self.optimizer_config(),
            schedule=self.schedule_config(),
            mesh=self.mesh_config(),
            data=self.data_config(),
            eval_task=self.eval_task_config(),
            loop=self.loop_config(),
            lm_eval=self.lm_eval_config(),
            wandb=self.wandb_config(),
            dpo=self.dpo_config(),
        )
