"""How the shared UPPERCASE hyperparameters map onto the configs of the parts of a run.

Families (gpt.py, tiny.py) only set hyperparameters and say how they build their model; everything else
(optimizer, schedule, mesh, data, loop) is mapped here once, as a Fiddle tree, so `config.txt` shows the
whole run and `fdl.build` turns it into plain dataclasses.
"""

from __future__ import annotations

import enum
import os
import re
from typing import Any, ClassVar, Literal

import fiddle as fdl
from absl import logging

from paxlite.config.errors import ConfigError
from paxlite.config.experiment import Derived, Experiment
from paxlite.config.transformer_engine import transformer_engine_fields
from paxlite.experiments.attention_settings import check_attention_settings
from paxlite.experiments.data_settings import DataSettings
from paxlite.experiments.lm_eval_settings import LmEvalSettings
from paxlite.experiments.moe_mixin import (
    MOE_HPARAM_NAMES,
    dense_moe_setting_error,
    expert_axis_size,
)
from paxlite.experiments.parallelism_settings import (
    context_parallel_strategy,
    mesh_axis_sizes,
    mesh_layout,
    num_stages,
    parallelism_problems,
    pipeline_config,
)
from paxlite.models.attention import AttentionKind
from paxlite.models.attention_kernels import AttentionImplementation
from paxlite.models.linear import Fp8Config
from paxlite.models.lora import PAX_LORA_RULE, LoraTargets
from paxlite.models.te_layer import uses_transformer_engine
from paxlite.models.transformer import RematPolicy, TransformerConfig, num_params
from paxlite.parallel.mesh import MeshConfig
from paxlite.paths import UnsupportedPathError, require_local_path
from paxlite.train import flops as flops_lib
from paxlite.train.optimizer import OptimizerConfig
from paxlite.train.run_config import LoopConfig, RunConfig
from paxlite.train.schedules import ScheduleConfig, ScheduleKind


class DataSource(str, enum.Enum):
    """Where an experiment's training tokens come from (SYNTHETIC_DATA=true replaces any of them)."""

    SYNTHETIC = "synthetic"
    TEXT = "text"  # DATA_DIR (python -m paxlite.data.prepare) or TFDS_DATASET under TFDS_DATA_DIR


class LanguageModelExperiment(DataSettings, LmEvalSettings, Experiment):
    """Base of every registered experiment: maps hyperparameters to a `RunConfig` Fiddle tree."""

    data_source: ClassVar[DataSource] = DataSource.SYNTHETIC

    DATA_DIR: str | None = None  # a directory made by `python -m paxlite.data.prepare`
    # Weighted sources instead of DATA_DIR: [[source, weight], ...], each source a prepared directory or a TFDS
    # name[/config]:version under TFDS_DATA_DIR; weights are normalised (docs/data.md). With INPUT_PIPELINE=seqio:
    # the name of a registered SeqIO mixture or task.
    DATA_MIXTURE: str | list[list[str | float]] | None = None
    # A resumed mixture whose weights differ from the checkpoint's is an error; true: re-weight from the resume on.
    DATA_MIXTURE_REWEIGHT: bool = False
    VOCAB_PATH: str | None = None  # SentencePiece model; None: the VOCAB_PATH environment variable (Pax)
    # What EVAL_INTERVAL_STEPS / --mode=eval score: the training data's validation split, or a zero-shot task.
    EVAL_TASK: Literal["validation", "lambada", "boolq"] = "validation"
    LAMBADA_PATH: str | None = None  # lambada_test.jsonl ({"text": ...} lines) for EVAL_TASK="lambada"
    BOOLQ_PATH: str | None = None  # SuperGLUE BoolQ val.jsonl (passage, question, label) for EVAL_TASK="boolq"
    # What training reads: "text" (DATA_DIR / TFDS_DATASET, language modelling) or "boolq" (supervised fine-tuning on
    # BoolQ's train split, one example per row, loss on the answer token; BOOLQ_TRAIN_PATH or super_glue/boolq:1.0.2).
    TRAIN_TASK: Literal["text", "boolq"] = "text"
    # lm-evaluation-harness tasks scored during training (docs/evaluation.md; the `eval` extra), at every
    # LM_EVAL_INTERVAL_STEPS-th step (None: at every EVAL_INTERVAL_STEPS boundary), into metrics.jsonl as
    # lm_eval/<task>/<metric>. LM_EVAL_LIMIT: examples per task (< 1: a fraction), as lm_eval's --limit.
    LM_EVAL_TASKS: list[str] | None = None
    LM_EVAL_INTERVAL_STEPS: int | None = None
    LM_EVAL_NUM_FEWSHOT: int | None = None  # None: each task's own default, as lm_eval's --num_fewshot
    LM_EVAL_LIMIT: float | None = None
    LM_EVAL_INCLUDE_PATH: str | None = None  # a directory of local task YAMLs (lm_eval's --include_path)
    BOOLQ_TRAIN_PATH: str | None = None  # SuperGLUE BoolQ train.jsonl for TRAIN_TASK="boolq"
    # Pax's --tfds_data_dir (the flag sets this; else the TFDS_DATA_DIR environment variable). Used when
    # DATA_DIR is unset: training reads TFDS_DATASET there, EVAL_TASK="lambada" reads my_lambada:1.0.0 and
    # EVAL_TASK="boolq" reads super_glue/boolq:1.0.2 (validation split).
    TFDS_DATA_DIR: str | None = None
    TFDS_DATASET: str = "the_pile:1.0.0"  # or "c4/en:3.0.1"
    # grain: TFDS ArrayRecord files, random access, exact resume, no TensorFlow. seqio: Pax's own tasks
    # (the_pile_lm, c4_lm_v301_gpt) through TensorFlow; needs pip install 'paxlite[seqio]'.
    INPUT_PIPELINE: Literal["grain", "seqio"] = "grain"
    # The global batch in sequences, fixed whatever the device count (AXLearn's train_batch_size).
    # None: PERCORE_BATCH_SIZE x devices (Pax). Set, it wins; each device holds GLOBAL / devices rows
    # (fractional only with tensor parallelism), and it must divide over data x fsdp (x expert).
    GLOBAL_BATCH_SIZE: int | None = None
    # Attention (docs/attention.md). Pax's switch: true runs cuDNN flash attention, and refuses to
    # start (naming why) where it cannot run: CPU, float32, dims per head not a multiple of 8 or
    # above 256 (128 before Hopper). Packed rows reach it as a dense mask.
    USE_CUDNN_FLASH_ATTENTION: bool = False
    # The kernel of fused attention: "auto" (cuDNN where it fits, else XLA), "xla", "cudnn", or
    # "pallas_triton" (JAX's Pallas-Triton flash attention, which reads packed rows' segment ids in
    # the kernel instead of a dense mask; GPU only, no relative position bias).
    ATTENTION_IMPLEMENTATION: Literal["auto", "xla", "cudnn", "pallas_triton"] = Derived(
        lambda hp: "cudnn" if hp.USE_CUDNN_FLASH_ATTENTION else "auto",
        doc="'cudnn' if USE_CUDNN_FLASH_ATTENTION else 'auto'")
    # How attention computes softmax(q k^T) v: "dot_product" (einsums, Pax) or "flash" (a fused
    # kernel, ATTENTION_IMPLEMENTATION's). Same parameters, same result.
    ATTENTION_KIND: Literal["dot_product", "flash"] = Derived(
        lambda hp: "flash" if hp.ATTENTION_IMPLEMENTATION in ("cudnn", "pallas_triton") else "dot_product",
        doc="'flash' if ATTENTION_IMPLEMENTATION is 'cudnn' or 'pallas_triton' else 'dot_product'")
    # Initialise from pretrained weights (Pax CheckpointRestoreMixin): a job directory, its
    # checkpoints/ or one checkpoint_<STEP> directory (e.g. from python -m paxlite convert). Used
    # only when the job has no checkpoint of its own; the run starts at step 0 with fresh optimizer
    # state. docs/training.md.
    CHECKPOINT_RESTORE_PATH: str | None = None
    # Regexes of parameters NOT read from CHECKPOINT_RESTORE_PATH (they keep their fresh
    # initialisation), matched as Pax does (re.match) against the path joined with '/'
    # (layers_0/mlp/wi/kernel) and with '.'.
    CHECKPOINT_IGNORE_RULES: list[str] | None = Derived(
        lambda hp: [PAX_LORA_RULE] if hp.USE_LORA else None,
        doc="['^.*lora.*$'] if USE_LORA else None")
    # LoRA (Pax LoRAMixin): adapters of rank LORA_RANK on LORA_TARGET_LAYERS ("attention": q, k, v
    # and the attention output; "mlp": every MLP matmul; "all": both); only they train. The deltas
    # are scaled by LORA_ALPHA / LORA_RANK; None means LORA_ALPHA = LORA_RANK (scale 1, as Pax).
    USE_LORA: bool = False
    LORA_RANK: int = 8
    LORA_TARGET_LAYERS: Literal["all", "attention", "mlp"] = "all"
    LORA_ALPHA: float | None = None
    # USE_LORA freezes the base model, so it needs CHECKPOINT_RESTORE_PATH: adapters on a random
    # frozen base learn nothing useful. True opts in to exactly that (tests, benchmarks), with a
    # warning in the log.
    LORA_RANDOM_BASE: bool = False
    # Pax's switch for expert parallelism. In paxlite the mesh says it (a 4th entry, `expert`, of
    # ICI_MESH_SHAPE / DCN_MESH_SHAPE); true asks for it and is checked against the mesh: an MoE
    # experiment with an expert axis > 1 (experiments/moe_mixin.py). A dense model has no experts.
    USE_EXPERT_PARALLEL: bool = False
    # Pax's native FP8 (docs/fp8.md): the QKV, attention-output, MLP and GShard expert matmuls run in
    # FP8 through Flax's Fp8Einsum (e4m3 forward, e5m2 gradients, delayed per-tensor scaling), each
    # with its own scales and amax histories of FP8_AMAX_HISTORY_LENGTH steps (Pax 1024; Fuji -fp8:
    # 128). The embedding, softmax and router stay in FPROP_DTYPE.
    USE_FP8: bool = False
    FP8_AMAX_HISTORY_LENGTH: int = 1024

    @classmethod
    def check_names(cls, names) -> None:
        """An MoE setting (NUM_EXPERTS, ...) on a dense experiment says so, rather than 'unknown'."""
        names = list(names)
        specs = cls.hparam_specs()
        moe_only = [n for n in names if n in MOE_HPARAM_NAMES and n not in specs]
        if moe_only:
            raise dense_moe_setting_error(cls.__name__, moe_only)
        super().check_names(names)

    def is_moe(self) -> bool:
        """Whether the model has expert layers (the MoE mixin says True)."""
        return False

    def dense_mesh_problems(self) -> list[str]:
        """Expert parallelism asked of a dense model (checked before the mesh's own checks)."""
        if self.is_moe():
            return []
        problems = []
        if expert_axis_size(self.ICI_MESH_SHAPE, self.DCN_MESH_SHAPE, mesh_layout(self)) > 1:
            problems.append(
                f"ICI_MESH_SHAPE={self.ICI_MESH_SHAPE}, DCN_MESH_SHAPE={self.DCN_MESH_SHAPE}: the "
                f"4th (expert) entry is > 1, and {self.name} is a dense model with no experts to "
                "split; give 3 entries [data, fsdp, tensor] (or a 4th entry of 1)")
        if self.USE_EXPERT_PARALLEL:
            problems.append(
                f"USE_EXPERT_PARALLEL=true, and {self.name} is a dense model with no experts: drop "
                "it, or run an MoE experiment (GLaM, Mixtral)")
        return problems

    def uses_synthetic_data(self) -> bool:
        return self.SYNTHETIC_DATA or self.data_source is DataSource.SYNTHETIC

    def validate(self) -> None:
        problems = self.dense_mesh_problems() + self.lm_eval_problems()
        if problems:
            raise ConfigError(f"invalid {self.name} hyperparameters: " + "; ".join(problems))
        super().validate()
        if self.GLOBAL_BATCH_SIZE is not None and self.GLOBAL_BATCH_SIZE < 1:
            raise ConfigError(
                f"GLOBAL_BATCH_SIZE must be a positive number of sequences or None "
                f"(PERCORE_BATCH_SIZE x devices), got {self.GLOBAL_BATCH_SIZE}"
            )
        check_attention_settings(self)
        whole_eval_set = self.EVAL_LOOP_NUM_BATCHES == -1
        if self.uses_synthetic_data() and self.EVAL_TASK == "validation" and whole_eval_set:
            raise ConfigError(
                "EVAL_LOOP_NUM_BATCHES=-1 means 'the whole eval set', and synthetic data has no end; "
                "give a number of batches (e.g. --fdl.EVAL_LOOP_NUM_BATCHES=10)"
            )
        from paxlite.data.errors import DatasetError
        from paxlite.data.tfds_datasets import LM_TEXT_FEATURES, TfdsName

        try:
            dataset = TfdsName.parse(self.TFDS_DATASET)
        except DatasetError as e:
            raise ConfigError(f"TFDS_DATASET: {e}") from e
        if dataset.name not in LM_TEXT_FEATURES:
            raise ConfigError(
                f"TFDS_DATASET={self.TFDS_DATASET!r}: paxlite trains language models on {sorted(LM_TEXT_FEATURES)} "
                "(e.g. 'the_pile:1.0.0', 'c4/en:3.0.1')"
            )
        if self.FP8_AMAX_HISTORY_LENGTH < 1:
            raise ConfigError(
                f"FP8_AMAX_HISTORY_LENGTH={self.FP8_AMAX_HISTORY_LENGTH} must be a positive number "
                "of steps (Pax's default is 1024)")
        if self.LORA_RANK <= 0:
            raise ConfigError(
                f"LORA_RANK={self.LORA_RANK} must be a positive integer (Pax's default is 8)")
        if self.LORA_ALPHA is not None and not self.LORA_ALPHA > 0:
            raise ConfigError(
                f"LORA_ALPHA={self.LORA_ALPHA} must be > 0, or None (= LORA_RANK: scale 1, as Pax)")
        for rule in self.CHECKPOINT_IGNORE_RULES or []:
            try:
                re.compile(rule)
            except re.error as e:
                raise ConfigError(
                    f"CHECKPOINT_IGNORE_RULES: {rule!r} is not a regular expression: {e}") from e
        problems = [*self._path_problems(), *self._ignored_setting_problems(),
                    *self._parallelism_problems()]
        if problems:
            raise ConfigError(f"invalid {self.name} hyperparameters: " + "; ".join(problems))

    def _parallelism_problems(self) -> list[str]:
        """Pipeline / seq settings the mesh and the model cannot run (parallelism_settings.py)."""
        # The model's layer grouping and layer kind matter only with a pipeline or a seq axis
        # (and building it is what reports a bad model setting, so only then)
        model = None
        if num_stages(self) > 1 or mesh_axis_sizes(self)["seq"] > 1:
            config = self.model_config()
            config.pipeline = None  # its own checks would pre-empt the fuller messages below
            model = fdl.build(config)
        scan_unit = model.layers_per_scan_unit if model is not None else 1
        uses_te = model is not None and uses_transformer_engine(model)
        return parallelism_problems(self, scan_unit=scan_unit, uses_te=uses_te)

    # Hyperparameters that name files or directories (and the environment variables that stand in
    # for two of them): all must be local or mounted paths (paxlite/paths.py says why).
    path_settings: ClassVar[tuple[str, ...]] = (
        "DATA_DIR", "VOCAB_PATH", "TFDS_DATA_DIR", "LAMBADA_PATH", "BOOLQ_PATH", "BOOLQ_TRAIN_PATH",
        "CHECKPOINT_RESTORE_PATH",
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

    def _ignored_setting_problems(self) -> list[str]:
        """A setting given (--fdl.X, or the overrides a job recorded) where nothing reads it is an
        error: the run would silently do something other than what was asked. Only explicitly set
        names count, so an experiment class's own defaults (Fuji's TFDS_DATASET) stay harmless."""
        given = set(self.overridden)
        problems = []
        if not self.USE_LORA:
            unused = sorted(given & {"LORA_RANK", "LORA_ALPHA", "LORA_TARGET_LAYERS", "LORA_RANDOM_BASE"})
            if unused:
                problems.append(
                    f"{', '.join(unused)} set but USE_LORA is false, so a full fine-tune would run and "
                    "ignore them: add --fdl.USE_LORA=true, or drop them")
        elif not self.CHECKPOINT_RESTORE_PATH and not self.LORA_RANDOM_BASE:
            problems.append(
                "USE_LORA=true freezes the base model, and CHECKPOINT_RESTORE_PATH is unset, so the "
                "adapters would train on a randomly initialised base: pass --fdl.CHECKPOINT_RESTORE_PATH="
                "<a job or converted checkpoint>, or --fdl.LORA_RANDOM_BASE=true to mean it")
        if "CHECKPOINT_IGNORE_RULES" in given and self.CHECKPOINT_IGNORE_RULES and not self.CHECKPOINT_RESTORE_PATH:
            problems.append(
                "CHECKPOINT_IGNORE_RULES set but CHECKPOINT_RESTORE_PATH is unset: nothing is restored")
        needs = (("LAMBADA_PATH", "EVAL_TASK", "lambada"), ("BOOLQ_PATH", "EVAL_TASK", "boolq"),
                 ("BOOLQ_TRAIN_PATH", "TRAIN_TASK", "boolq"))
        for name, switch, value in needs:
            if name in given and getattr(self, name) is not None and getattr(self, switch) != value:
                problems.append(
                    f"{name} is read only with {switch}={value!r}, and {switch}={getattr(self, switch)!r}: "
                    f"add --fdl.{switch}={value!r}, or drop {name}")
        if "FP8_AMAX_HISTORY_LENGTH" in given and not self.USE_FP8:
            problems.append("FP8_AMAX_HISTORY_LENGTH set but USE_FP8 is false, so no matmul runs "
                            "in FP8: add --fdl.USE_FP8=true, or drop it")
        unused = sorted(given & {"PROFILER_NUM_STEPS", "PROFILER_MIN_DURATION_SEC"})
        if unused and self.PROFILER_CAPTURE_STEP is None:
            problems.append(f"{', '.join(unused)} set but PROFILER_CAPTURE_STEP is None, so nothing "
                            "is profiled: add --fdl.PROFILER_CAPTURE_STEP=<first step to trace>")
        if "TFDS_DATASET" in given and self.DATA_DIR is not None:
            problems.append(
                f"TFDS_DATASET={self.TFDS_DATASET!r} is read only without DATA_DIR, and DATA_DIR="
                f"{self.DATA_DIR!r} is set: drop one of them")
        return problems

    # ------------------------------------------------------------------ parts
    def model_config(self) -> fdl.Config[TransformerConfig]:
        raise ConfigError(f"{self.name} does not describe a model; subclass a model family")

    def transformer_fields(self) -> dict[str, Any]:
        """The TransformerConfig fields every family maps the same way (sizes, init, dropout, layer
        stacking, remat, dtypes); a family's model_config adds only its architecture switches."""
        return {
            "vocab_size": self.VOCAB_SIZE,
            "num_layers": self.NUM_LAYERS,
            "model_dims": self.MODEL_DIMS,
            "num_heads": self.NUM_HEADS,
            "dims_per_head": self.DIMS_PER_HEAD,
            "hidden_dims": self.HIDDEN_DIMS,
            "max_seq_len": self.MAX_SEQ_LEN,
            "norm_epsilon": self.LAYERNORM_EPSILON,
            "init_std": self.INIT_STD,
            "softmax_init_std": self.SOFTMAX_INIT_STD,
            "dropout_prob": self.DROPOUT_PROB,
            "input_dropout_prob": self.INPUT_DROPOUT_PROB,
            "scan_layers": self.USE_REPEATED_LAYER,
            "remat_policy": self.remat_policy(),
            "attention_kind": AttentionKind(self.ATTENTION_KIND),
            "attention_implementation": AttentionImplementation(self.ATTENTION_IMPLEMENTATION),
            "dtype": self.FPROP_DTYPE,
            "param_dtype": "float32",
            # Pax's ENABLE_TE / ENABLE_FP8 environment variables (config/transformer_engine.py)
            **transformer_engine_fields(native_fp8=bool(getattr(self, "USE_FP8", False))),
            "fp8": (fdl.Config(Fp8Config, amax_history_length=self.FP8_AMAX_HISTORY_LENGTH)
                    if self.USE_FP8 else None),
            "pipeline": pipeline_config(self),
            "context_parallel_strategy": context_parallel_strategy(self),
        }

    def with_lora(self, model: fdl.Config[TransformerConfig]) -> fdl.Config[TransformerConfig]:
        """The family's base model plus USE_LORA's adapters (families describe the base model)."""
        if self.USE_LORA:
            if not self.CHECKPOINT_RESTORE_PATH:  # validate() allowed it: LORA_RANDOM_BASE=true
                logging.warning(
                    "LORA_RANDOM_BASE=true: the LoRA adapters train on a randomly initialised, frozen "
                    "base model (no CHECKPOINT_RESTORE_PATH)")
            model.lora_rank = self.LORA_RANK
            model.lora_alpha = self.LORA_ALPHA
            model.lora_targets = LoraTargets(self.LORA_TARGET_LAYERS)
        return model

    def remat_policy(self) -> RematPolicy:
        """Pax applies CHECKPOINT_POLICY to the repeated (scanned) stack only; unrolled layers keep everything."""
        if not self.USE_REPEATED_LAYER:
            return RematPolicy.NONE
        return RematPolicy.parse(self.CHECKPOINT_POLICY)

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
        if kind is ScheduleKind.LINEAR_RAMPUP_COSINE_DECAY:
            return fdl.Config(
                ScheduleConfig,
                kind=kind,
                learning_rate=self.LEARNING_RATE,
                warmup_steps=self.LR_COS_WARMUP,
                decay_start=self.LR_COS_DECAY_START,
                decay_end=self.LR_COS_DECAY_END,
                min_ratio=self.LR_COS_MIN_RATIO,
                max_multiplier=self.LR_COS_MAX,
            )
        if kind is ScheduleKind.LINEAR_RAMPUP_EXPONENTIAL_DECAY:
            return fdl.Config(
                ScheduleConfig,
                kind=kind,
                learning_rate=self.LEARNING_RATE,
                warmup_steps=self.LR_LRED_WARMUP,
                decay_start=self.LR_LRED_DECAY_START,
                decay_end=self.LR_LRED_DECAY_END,
                min_ratio=self.LR_LRED_MIN_RATIO,
                max_multiplier=self.LR_LRED_MAX,
            )
        return fdl.Config(ScheduleConfig, kind=kind, learning_rate=self.LEARNING_RATE)

    def mesh_config(self) -> fdl.Config[MeshConfig]:
        ici = None if self.ICI_MESH_SHAPE is None else tuple(self.ICI_MESH_SHAPE)
        return fdl.Config(MeshConfig, ici_mesh_shape=ici, dcn_mesh_shape=tuple(self.DCN_MESH_SHAPE),
                          layout=mesh_layout(self))

    def flops_per_token(self) -> int:
        """MaxText's count, read off the model this experiment builds (so GQA, gated MLPs and the
        top-k experts of MoE layers follow it).

        With USE_LORA the work actually done: the base weights are frozen (no weight-gradient
        matmuls) and the adapters train (paxlite/train/flops.py), so MFU is not overstated."""
        model = fdl.build(self.model_config())
        moe = model.moe
        lora_params = None
        if self.USE_LORA:  # the adapters are what with_lora adds to the base model
            lora_params = num_params(fdl.build(self.with_lora(self.model_config()))) - num_params(model)
        return flops_lib.flops_per_token(
            num_layers=model.num_layers,
            model_dims=model.model_dims,
            num_heads=model.num_heads,
            num_kv_heads=model.kv_heads,
            dims_per_head=model.dims_per_head,
            hidden_dims=model.hidden_dims,
            vocab_size=model.vocab_size,
            seq_len=model.max_seq_len,
            gated_mlp=model.gated_mlp,
            lora_params=lora_params,
            num_moe_layers=0 if moe is None else moe.num_moe_layers(model.num_layers),
            num_experts=None if moe is None else moe.num_experts,
            experts_per_token=2 if moe is None else moe.experts_per_token,
            expert_hidden_dims=None if moe is None else moe.expert_hidden_dims,
            gated_experts=False if moe is None else moe.gated_experts,
        )

    def loop_config(self) -> fdl.Config[LoopConfig]:
        return fdl.Config(
            LoopConfig,
            max_steps=self.MAX_STEPS,
            percore_batch_size=self.PERCORE_BATCH_SIZE,
            summary_interval_steps=self.SUMMARY_INTERVAL_STEPS,
            eval_interval_steps=self.EVAL_INTERVAL_STEPS,
            eval_num_batches=self.EVAL_LOOP_NUM_BATCHES,
            checkpoint_every_n_steps=self.CHECKPOINT_EVERY_N_STEPS,
            checkpoint_max_to_keep=self.CHECKPOINT_MAX_TO_KEEP,
            seed=self.SEED,
            flops_per_token=self.flops_per_token(),
            peak_tflops=self.PEAK_TFLOPS,
            grad_accum_steps=self.GRAD_ACCUM_STEPS,
            global_batch_size=self.GLOBAL_BATCH_SIZE,
            checkpoint_restore_path=self.CHECKPOINT_RESTORE_PATH,
            checkpoint_ignore_rules=tuple(self.CHECKPOINT_IGNORE_RULES or ()),
            profiler_capture_step=self.PROFILER_CAPTURE_STEP,
            profiler_num_steps=self.PROFILER_NUM_STEPS,
            profiler_min_duration_sec=self.PROFILER_MIN_DURATION_SEC,
            loss_chunk_size=self.LOSS_CHUNK_SIZE,
            watchdog_timeout_seconds=self.WATCHDOG_TIMEOUT_SECONDS,
            crash_on_hang_timeout_seconds=self.CRASH_ON_HANG_TIMEOUT_SECONDS,
            compilation_cache=self.COMPILATION_CACHE,
            compilation_cache_dir=self.COMPILATION_CACHE_DIR,
            seq_load_balance=self.CONTEXT_PARALLEL_LOAD_BALANCE,
        )

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
        )
