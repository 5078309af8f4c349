"""The plain-dataclass description of one run that the training loop takes.

Built from an experiment's Fiddle tree, and defined here, by its consumer, so that train/ needs
nothing from config/ or experiments/: everything downstream of the experiment receives these values,
never the experiment class. The model gets its TransformerConfig, the optimizer its OptimizerConfig,
and the loop a LoopConfig.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from paxlite.data.feed import BoolQEvalConfig, BoolQTrainConfig, LambadaEvalConfig
from paxlite.data.pipeline import TextDataConfig
from paxlite.data.synthetic import SyntheticDataConfig
from paxlite.models.transformer import TransformerConfig
from paxlite.parallel.mesh import MeshConfig
from paxlite.train.dpo import DpoConfig
from paxlite.train.optimizer import OptimizerConfig
from paxlite.train.schedules import ScheduleConfig


class SaveFailure(str, enum.Enum):
    """What a checkpoint save that storage refused does (CHECKPOINT_SAVE_FAILURE; train/loop.py)."""

    STOP = "stop"  # exit with status 75 and one line; the previous checkpoint is intact
    CONTINUE = "continue"  # log the line, count it, and save again at the next interval


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopConfig:
    max_steps: int
    percore_batch_size: float
    summary_interval_steps: int
    eval_interval_steps: int
    eval_num_batches: int
    checkpoint_every_n_steps: int
    checkpoint_max_to_keep: int | None
    seed: int
    flops_per_token: int
    peak_tflops: float | None = None
    grad_accum_steps: int = 1  # microbatches per optimizer step; the global batch is unchanged
    global_batch_size: int | None = None  # GLOBAL_BATCH_SIZE; None: percore_batch_size x devices
    # Parameters to initialise a run without checkpoints from (Pax CHECKPOINT_RESTORE_PATH; what
    # checkpointing/pretrained.py reads), except those a CHECKPOINT_IGNORE_RULES regex matches.
    checkpoint_restore_path: str | None = None
    checkpoint_ignore_rules: tuple[str, ...] = ()
    # Pax's z-loss on the output logits: z_loss_weight x the weighted mean of logsumexp(logits)^2
    # (Z_LOSS_WEIGHT of the MoE experiments; 0: off). Logged as moe/z_loss.
    z_loss_weight: float = 0.0
    # Pax's PROFILER_*: trace from step profiler_capture_step (None: never) for profiler_num_steps
    # steps, or more until profiler_min_duration_sec have been captured (train/profiling.py).
    profiler_capture_step: int | None = None
    profiler_num_steps: int = 2
    profiler_min_duration_sec: float = 1.0
    # LOSS_CHUNK_SIZE: the loss is computed over blocks of this many sequence positions, so the
    # float32 [B, T, V] logits never exist at once (train/chunked_loss.py); None: all at once.
    loss_chunk_size: int | None = None
    # WATCHDOG_TIMEOUT_SECONDS / CRASH_ON_HANG_TIMEOUT_SECONDS (train/watchdog.py); None: never.
    watchdog_timeout_seconds: float | None = 3600.0
    crash_on_hang_timeout_seconds: float | None = 7200.0
    # COMPILATION_CACHE / COMPILATION_CACHE_DIR (job.py); None dir: DIR/compilation_cache.
    compilation_cache: bool = True
    compilation_cache_dir: str | None = None
    # CONTEXT_PARALLEL_LOAD_BALANCE: with a `seq` mesh axis > 1, training batches are put in the
    # dual_chunk_swap token order (data/context_order.py) so every shard has equal causal work.
    seq_load_balance: bool = True
    # CHECKPOINT_SAVE_FAILURE: what a save that storage refused (a full disk, ...) does.
    checkpoint_save_failure: SaveFailure = SaveFailure.STOP


@dataclasses.dataclass(frozen=True, kw_only=True)
class LmEvalConfig:
    """lm-evaluation-harness tasks scored on the live train state during training (LM_EVAL_*)."""

    tasks: tuple[str, ...]
    interval_steps: int  # a multiple of LoopConfig.eval_interval_steps; the last step scores too
    num_fewshot: int | None = None  # None: each task's default
    limit: float | None = None  # examples per task (< 1: a fraction), lm_eval's --limit
    include_path: str | None = None  # a directory of local task YAMLs
    vocab_path: str
    add_bos: bool = False  # text starts with the tokenizer's BOS (the LLaMA family)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """Weights & Biases logging from process 0 (WANDB_*; train/wandb_sink.py)."""

    project: str
    entity: str | None = None  # None: the API key's default entity
    run_name: str | None = None  # None: the job directory's name
    tags: tuple[str, ...] = ()
    # The W&B run's config: the resolved hyperparameters, as config.json's "hparams" records them
    hparams: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    experiment: str
    model: TransformerConfig
    optimizer: OptimizerConfig
    schedule: ScheduleConfig
    mesh: MeshConfig
    # None: evaluation-only (no training data given)
    data: SyntheticDataConfig | TextDataConfig | BoolQTrainConfig | None
    # None: evaluate on the training data's eval split
    eval_task: LambadaEvalConfig | BoolQEvalConfig | None = None
    loop: LoopConfig
    lm_eval: LmEvalConfig | None = None  # LM_EVAL_TASKS; None: no lm-evaluation-harness scoring
    wandb: WandbConfig | None = None  # WANDB_PROJECT; None: no Weights & Biases
    # DPO_BETA / DPO_REFERENCE_PATH, where TRAIN_TASK or EVAL_TASK is dpo (train/dpo.py)
    dpo: DpoConfig | None = None
