"""`--fdl_config=FineTune --fdl.CHECKPOINT_RESTORE_PATH=DIR`: fine-tune whatever model DIR holds.

A converted model (`python -m paxlite convert --from=hf|meta --to=paxlite`, any family) records
its exact TransformerConfig in `DIR/model_config.json` and keeps its tokenizer beside it. FineTune
reads both, so a model with no registered experiment (a LLaMA-3 merge, a Qwen of another size)
trains without writing one: the sizes and architecture switches are the checkpoint's, the
tokenizer (VOCAB_PATH) is the one beside it, and the rest is a full fine-tune's defaults
(fine_tuning.py's `FineTuningRecipe`, FSDP over one node of 8 GPUs, EVAL_TASK 'validation').

Every hyperparameter stays overridable: the ones read from the checkpoint are Derived, so
`--fdl.MAX_SEQ_LEN=2048` or `--fdl.ROPE_THETA=...` wins over the checkpoint's value. An override
that would change a parameter's shape or the stored layer layout (NUM_LAYERS, MODEL_DIMS,
VOCAB_SIZE, USE_REPEATED_LAYER, ...) is refused in one line before anything runs: the
checkpoint's weights would not fit it. The
architecture the hyperparameters do not name (norm, activation, biases, position embedding,
experts) is taken from the checkpoint as it is. `python -m paxlite show --fdl_config=FineTune
--fdl.CHECKPOINT_RESTORE_PATH=DIR` prints what was read.

Experiments only describe (the import contracts keep checkpointing/ out of them), so the small
JSON file is read here, by name, rather than through checkpointing/pretrained.py.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import os
import re
from typing import Any, ClassVar

import fiddle as fdl

from paxlite.config.errors import ConfigError
from paxlite.config.experiment import Derived
from paxlite.data.tokenizer import tokenizer_in
from paxlite.experiments.architecture_settings import (
    AttentionVariantSettings,
    RopeScalingSettings,
    TiedEmbeddingSettings,
)
from paxlite.experiments.base import DataSource, LanguageModelExperiment
from paxlite.experiments.fine_tuning import FineTuningRecipe
from paxlite.experiments.model_settings import (
    MODEL_FIELD_NAMES,
    KeyValueHeadSettings,
    RotarySettings,
)
from paxlite.experiments.moe_settings import RouterBiasSettings
from paxlite.models.moe_router_deepseek import ExpertChoice
from paxlite.models.rotary import RopeScaling, RopeScalingKind
from paxlite.models.transformer import NormKind, PositionEmbedding, TransformerConfig

# The file `python -m paxlite convert` writes beside a checkpoint (checkpointing/pretrained.py's
# MODEL_CONFIG_FILE; tests/experiments/test_open_models.py checks that they agree).
MODEL_CONFIG_FILE = "model_config.json"
JOB_RECORD_FILE = "config.json"  # what a training job records of itself (its hparams)
_STEP_DIR = re.compile(r"^checkpoint_\d+$")


def model_directory(restore_path: str) -> str:
    """The directory a restore path's model_config.json lies in: the path itself, or the output
    directory above its `checkpoints/` or `checkpoint_<STEP>` (the three spellings
    CHECKPOINT_RESTORE_PATH takes)."""
    directory = os.path.abspath(os.path.expanduser(restore_path))
    if _STEP_DIR.match(os.path.basename(directory)):
        directory = os.path.dirname(directory)
    if os.path.basename(directory) == "checkpoints":
        directory = os.path.dirname(directory)
    return directory


def model_home(restore_path: str) -> str:
    """The directory whose model_config.json and tokenizer describe CHECKPOINT_RESTORE_PATH:
    `model_directory`, or, for the output of a FineTune job (which records no model_config.json
    of its own: its model is the one it started from), the directory that job started from, as
    its config.json records it, followed back through FineTune jobs (SFT, then DPO from it)."""
    directory = model_directory(restore_path)
    seen = {directory}
    while not os.path.exists(os.path.join(directory, MODEL_CONFIG_FILE)):
        try:  # the job's own record (cli/job.py writes it into the job directory)
            with open(os.path.join(directory, JOB_RECORD_FILE)) as f:
                job = json.load(f)
        except (OSError, ValueError):
            break
        started_from = job.get("hparams", {}).get("CHECKPOINT_RESTORE_PATH")
        if job.get("experiment") != "FineTune" or not started_from:
            break
        parent = model_directory(started_from)
        if parent in seen:
            break
        seen.add(parent)
        directory = parent
    return directory


def checkpoint_model(restore_path: str | None) -> TransformerConfig:
    """The TransformerConfig recorded beside the checkpoint; one ConfigError line when there is
    none or it cannot be read."""
    if not restore_path:
        raise ConfigError(
            "FineTune builds its model from the checkpoint it starts from: pass "
            "--fdl.CHECKPOINT_RESTORE_PATH=DIR, a directory `python -m paxlite convert` wrote")
    path = os.path.join(model_home(restore_path), MODEL_CONFIG_FILE)
    try:
        with open(path) as f:
            fields = json.load(f)
    except FileNotFoundError:
        raise ConfigError(
            f"CHECKPOINT_RESTORE_PATH={restore_path}: no {path}, which FineTune builds the model "
            "from; convert the model with `python -m paxlite convert --to=paxlite` (it writes "
            "one), or name its experiment with --fdl_config") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"CHECKPOINT_RESTORE_PATH={restore_path}: cannot read {path}: "
                          f"{type(e).__name__}: {e}") from None
    if not isinstance(fields, dict):
        raise ConfigError(f"CHECKPOINT_RESTORE_PATH={restore_path}: {path} is not a JSON object "
                          "of TransformerConfig fields")
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConfigError(f"CHECKPOINT_RESTORE_PATH={restore_path}: {path} has fields this "
                          f"paxlite does not know: {', '.join(unknown)} (written by a newer one?)")
    try:
        return TransformerConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"CHECKPOINT_RESTORE_PATH={restore_path}: {path} is not a valid model "
                          f"config: {e}") from None


def _starts_with_bos(model: TransformerConfig) -> bool:
    """LLaMA-style models (RMSNorm and RoPE: LLaMA, Mistral, Qwen, Gemma, ...) start text with
    BOS where their tokenizer has one (Qwen's has none); GPT-style ones do not."""
    return (model.norm in (NormKind.RMS_NORM, NormKind.GEMMA_RMS_NORM)
            and model.position_kind is PositionEmbedding.ROTARY)


def _rope_scaling_of(model: TransformerConfig) -> RopeScaling:
    """The checkpoint's RoPE scaling, or RopeScaling's defaults (read only with scaling)."""
    return model.rope_scaling if model.rope_scaling is not None else RopeScaling()


# Hyperparameter -> how its default is read off the checkpoint's TransformerConfig.
_FROM_CHECKPOINT: dict[str, Any] = {
    **{name: operator.attrgetter(field) for field, name in MODEL_FIELD_NAMES.items()},
    "NUM_KV_HEADS": lambda m: m.kv_heads,
    "LAYERNORM_EPSILON": lambda m: m.norm_epsilon,
    "INIT_STD": lambda m: m.init_std,  # for what CHECKPOINT_IGNORE_RULES leaves unread
    "FPROP_DTYPE": lambda m: m.dtype,
    "USE_REPEATED_LAYER": lambda m: m.scan_layers,
    "ROPE_THETA": lambda m: m.rope_theta,
    "TIE_EMBEDDINGS": lambda m: m.tie_embeddings,
    "QKV_BIAS": lambda m: m.qkv_bias is True,
    "QK_NORM": lambda m: m.qk_norm,
    "SLIDING_WINDOW": lambda m: m.sliding_window,
    "DOCUMENT_START": lambda m: "bos" if _starts_with_bos(m) else "zero",
    "ROPE_SCALING": lambda m: "none" if m.rope_scaling is None else m.rope_scaling.kind.value,
    "ROPE_SCALING_FACTOR": lambda m: _rope_scaling_of(m).factor,
    "ROPE_SCALING_LOW_FREQ_FACTOR": lambda m: _rope_scaling_of(m).low_freq_factor,
    "ROPE_SCALING_HIGH_FREQ_FACTOR": lambda m: _rope_scaling_of(m).high_freq_factor,
    "ROPE_SCALING_ORIGINAL_MAX_POSITION":
        lambda m: _rope_scaling_of(m).original_max_position_embeddings,
}
# The hyperparameters that set a parameter's shape (or, for USE_REPEATED_LAYER, the stacked
# layout the weights are stored in): an override must agree with the checkpoint.
_SHAPE_SETTINGS = ("VOCAB_SIZE", "NUM_LAYERS", "MODEL_DIMS", "NUM_HEADS", "DIMS_PER_HEAD",
                   "HIDDEN_DIMS", "NUM_KV_HEADS", "TIE_EMBEDDINGS", "QKV_BIAS", "QK_NORM",
                   "USE_REPEATED_LAYER")


def _fused_fits(model: TransformerConfig) -> bool:
    """Whether AUTO's fused kernel (cuDNN on a GPU) can run the model's attention: not Gemma 2's
    logit soft-cap (no fused kernel but splash has one), nor Llama 4's chunks or gpt-oss's sinks
    (for which AUTO runs XLA's attention: 'flash' runs them, but not as a flash kernel)."""
    return (model.attention_logit_cap is None and model.attention_chunk_size is None
            and not model.attention_sinks)


def _from_checkpoint(name: str) -> Derived:
    read = _FROM_CHECKPOINT[name]
    return Derived(lambda hp: read(checkpoint_model(hp.CHECKPOINT_RESTORE_PATH)),
                   doc="the checkpoint's model_config.json")


def _tokenizer_beside(restore_path: str | None) -> str | None:
    """The tokenizer `convert` copied beside the model, when there is one."""
    if not restore_path:
        return None
    return tokenizer_in(model_home(restore_path))


class CheckpointModelSettings(KeyValueHeadSettings, RouterBiasSettings, LanguageModelExperiment):
    """The model of CHECKPOINT_RESTORE_PATH's model_config.json, its fields set by the
    hyperparameters that name them (the mixins listed before this class). MOE_BIAS_UPDATE_SPEED
    is 0 whatever the checkpoint recorded (a converted DeepSeek-V3's bias stays as loaded, as
    fine-tuning wants) unless given; a checkpoint whose router has no choice bias refuses it."""

    data_source = DataSource.TEXT

    def checkpoint_model(self) -> TransformerConfig:
        return checkpoint_model(self.CHECKPOINT_RESTORE_PATH)

    @property
    def family_adds_bos(self) -> bool:
        return _starts_with_bos(self.checkpoint_model())

    def position_kind(self) -> PositionEmbedding:
        return self.checkpoint_model().position_kind

    def is_moe(self) -> bool:
        return self.checkpoint_model().moe is not None

    def layers_per_scan_unit(self) -> int:
        """The checkpoint model's scanned unit (what a pipeline splits): its MoE interval, or one
        period of its layer kinds (Gemma's sliding and global layers)."""
        return self.checkpoint_model().layers_per_scan_unit

    def validate(self) -> None:
        model = self.checkpoint_model()
        problems = []
        for name in _SHAPE_SETTINGS:
            read_recorded = _FROM_CHECKPOINT[name]
            wanted, recorded = getattr(self, name), read_recorded(model)
            if name in self.overridden and wanted != recorded:
                problems.append(f"{name}={wanted!r} (the checkpoint's is {recorded!r})")
        learned = model.position_kind is PositionEmbedding.LEARNED
        if learned and "MAX_SEQ_LEN" in self.overridden and self.MAX_SEQ_LEN != model.max_seq_len:
            problems.append(f"MAX_SEQ_LEN={self.MAX_SEQ_LEN!r} (the checkpoint's learned position "
                            f"table has {model.max_seq_len!r} rows)")
        cap = model.attention_logit_cap
        if cap is not None and self.ATTENTION_KIND == "flash":  # no fused kernel soft-caps
            raise ConfigError(f"ATTENTION_KIND='flash' with the checkpoint's attention logit "
                              f"soft-cap {cap} (Gemma 2): JAX's fused attention kernels have "
                              "none; use ATTENTION_KIND='dot_product' (its default for it)")
        router = None if model.moe is None else model.moe.deepseek_router
        biased = router is not None and router.choice is ExpertChoice.NOAUX_TC
        if speed_problems := self.router_bias_problems(has_choice_bias=biased,
                                                       router="the checkpoint's router"):
            raise ConfigError("; ".join(speed_problems))
        if problems:
            raise ConfigError(
                f"{'; '.join(problems)}: the weights in CHECKPOINT_RESTORE_PATH="
                f"{self.CHECKPOINT_RESTORE_PATH} would not fit that model; drop the override "
                "(FineTune takes it from the checkpoint), or start from a checkpoint of that shape")
        super().validate()

    def model_config(self) -> fdl.Config[TransformerConfig]:
        model = self.checkpoint_model()
        fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
        # LoRA comes from USE_LORA (with_lora), never from the checkpoint
        fields.update(lora_rank=None, lora_alpha=None)
        fields.update(self.transformer_fields())
        # As recorded where they mean the same: None is "as num_heads" / "as init_std" (and
        # NUM_KV_HEADS cannot differ from the checkpoint's: validate says so)
        if model.softmax_init_std is None and self.SOFTMAX_INIT_STD == self.INIT_STD:
            fields["softmax_init_std"] = None
        router = None if model.moe is None else model.moe.deepseek_router
        if router is not None and router.choice is ExpertChoice.NOAUX_TC:
            fields["moe"] = dataclasses.replace(model.moe, deepseek_router=dataclasses.replace(
                router, bias_update_speed=self.MOE_BIAS_UPDATE_SPEED))
        return fdl.Config(TransformerConfig, **fields)


class FineTune(FineTuningRecipe, TiedEmbeddingSettings, AttentionVariantSettings,
               RopeScalingSettings, RotarySettings, CheckpointModelSettings):
    """Fine-tune the model CHECKPOINT_RESTORE_PATH holds (module docstring): its sizes, switches
    and tokenizer by default, a full fine-tune's optimizer and schedule, FSDP over 8 devices and
    2 sequences per device (override ICI_MESH_SHAPE and PERCORE_BATCH_SIZE for another node)."""

    # No model until CHECKPOINT_RESTORE_PATH names one: `list` and the golden files of every
    # registered experiment (resolved with no overrides) leave it out.
    model_from_checkpoint: ClassVar[bool] = True

    NUM_LAYERS = _from_checkpoint("NUM_LAYERS")
    NUM_HEADS = _from_checkpoint("NUM_HEADS")
    MODEL_DIMS = _from_checkpoint("MODEL_DIMS")
    HIDDEN_DIMS = _from_checkpoint("HIDDEN_DIMS")
    DIMS_PER_HEAD = _from_checkpoint("DIMS_PER_HEAD")
    VOCAB_SIZE = _from_checkpoint("VOCAB_SIZE")
    MAX_SEQ_LEN = _from_checkpoint("MAX_SEQ_LEN")
    NUM_KV_HEADS = _from_checkpoint("NUM_KV_HEADS")
    LAYERNORM_EPSILON = _from_checkpoint("LAYERNORM_EPSILON")
    INIT_STD = _from_checkpoint("INIT_STD")
    FPROP_DTYPE = _from_checkpoint("FPROP_DTYPE")
    USE_REPEATED_LAYER = _from_checkpoint("USE_REPEATED_LAYER")
    ROPE_THETA = _from_checkpoint("ROPE_THETA")
    TIE_EMBEDDINGS = _from_checkpoint("TIE_EMBEDDINGS")
    QKV_BIAS = _from_checkpoint("QKV_BIAS")
    QK_NORM = _from_checkpoint("QK_NORM")
    SLIDING_WINDOW = _from_checkpoint("SLIDING_WINDOW")
    ROPE_SCALING = _from_checkpoint("ROPE_SCALING")
    DOCUMENT_START = _from_checkpoint("DOCUMENT_START")
    ROPE_SCALING_FACTOR = _from_checkpoint("ROPE_SCALING_FACTOR")
    ROPE_SCALING_LOW_FREQ_FACTOR = _from_checkpoint("ROPE_SCALING_LOW_FREQ_FACTOR")
    ROPE_SCALING_HIGH_FREQ_FACTOR = _from_checkpoint("ROPE_SCALING_HIGH_FREQ_FACTOR")
    ROPE_SCALING_ORIGINAL_MAX_POSITION = _from_checkpoint("ROPE_SCALING_ORIGINAL_MAX_POSITION")
    VOCAB_PATH = Derived(lambda hp: _tokenizer_beside(hp.CHECKPOINT_RESTORE_PATH),
                         doc="the tokenizer.json or tokenizer.model beside the checkpoint")
    # fused kernels where cuDNN can run the checkpoint's attention (not Gemma 2's soft-cap, not
    # Llama 4's chunks, gpt-oss's sinks: _fused_fits)
    ATTENTION_KIND = Derived(
        lambda hp: "flash" if _fused_fits(checkpoint_model(hp.CHECKPOINT_RESTORE_PATH))
        else "dot_product",
        doc="'flash', or 'dot_product' for a checkpoint whose attention logits are soft-capped, "
            "whose layers attend in chunks or whose attention has sinks")

    def rope_scaling(self) -> RopeScaling | None:
        """The settings' scaling; for a YaRN checkpoint kept YaRN, its fields no setting names
        (beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor, truncate) the
        checkpoint's."""
        scaling = super().rope_scaling()
        recorded = self.checkpoint_model().rope_scaling
        yarn = RopeScalingKind.YARN
        if scaling is None or scaling.kind is not yarn or recorded is None or (
                recorded.kind is not yarn):
            return scaling
        return dataclasses.replace(
            recorded, factor=scaling.factor,
            original_max_position_embeddings=scaling.original_max_position_embeddings)

    ICI_MESH_SHAPE = [1, 8, 1]
    DCN_MESH_SHAPE = [1, 1, 1]
    PACKED_INPUT = False


# Under its row in docs/experiments.md (`python -m paxlite list --format=markdown`).
CATALOGUE_NOTE = """\
`FineTune` has no model of its own: `--fdl.CHECKPOINT_RESTORE_PATH=DIR` names a directory that
`python -m paxlite convert --to=paxlite` wrote, and the sizes, switches and tokenizer are read from
its `model_config.json` ([training.md](training.md), "Any converted model: `FineTune`").
`python -m paxlite show --fdl_config=FineTune --fdl.CHECKPOINT_RESTORE_PATH=DIR` prints them, and
`plan` plans it the same way.
"""
