"""The model's hyperparameters (sizes, dtype, layers, LoRA, FP8), mapped to the model config.

Families (gpt.py, llama.py, glam.py, ...) describe their architecture in `model_config`; the fields
every family maps the same way come from `transformer_fields` here, so NUM_LAYERS or DROPOUT_PROB is
declared, defaulted, mapped and checked in this one file. Mixins of ``LanguageModelExperiment``
(base.py), split where `show` lists other settings between them (base.py says why the order).
"""

from __future__ import annotations

from typing import Any, Literal

import fiddle as fdl
from absl import logging

from paxlite.config.errors import ConfigError
from paxlite.config.experiment import Derived
from paxlite.experiments.field_names import in_hparam_names
from paxlite.experiments.transformer_engine_settings import transformer_engine_fields
from paxlite.models.attention import AttentionKind
from paxlite.models.attention_kernels import AttentionImplementation
from paxlite.models.linear import Fp8Config, fp8_config_problems
from paxlite.models.lora import LoraTargets, alpha_problems, rank_problems
from paxlite.models.transformer import RematPolicy, TransformerConfig, num_params
from paxlite.models.transformer_config import (
    LayerAttention,
    PositionEmbedding,
    dropout_problems,
    shape_problems,
)
from paxlite.train import flops as flops_lib

# TransformerConfig's sizes -> the hyperparameters that set them (transformer_fields maps them,
# and shape_problems' clauses are reported in these names). NUM_KV_HEADS is the families' that
# have it (llama.py).
MODEL_FIELD_NAMES = {
    "vocab_size": "VOCAB_SIZE",
    "num_layers": "NUM_LAYERS",
    "model_dims": "MODEL_DIMS",
    "num_heads": "NUM_HEADS",
    "dims_per_head": "DIMS_PER_HEAD",
    "hidden_dims": "HIDDEN_DIMS",
    "max_seq_len": "MAX_SEQ_LEN",
}
# The same for the LoRA fields with_lora sets, and for Fp8Config's.
LORA_FIELD_NAMES = {"lora_rank": "LORA_RANK", "lora_alpha": "LORA_ALPHA",
                    "lora_targets": "LORA_TARGET_LAYERS"}
FP8_FIELD_NAMES = {"amax_history_length": "FP8_AMAX_HISTORY_LENGTH"}
DROPOUT_FIELD_NAMES = {"dropout_prob": "DROPOUT_PROB", "input_dropout_prob": "INPUT_DROPOUT_PROB"}


class ModelShapeSettings:
    """The model's sizes (Pax TransformerLmSpmdAdam's defaults), mapped by transformer_fields."""

    NUM_LAYERS: int = 32
    NUM_HEADS: int = 16
    MODEL_DIMS: int = 1024
    HIDDEN_DIMS: int = Derived(lambda hp: 4 * hp.MODEL_DIMS, doc="4 * MODEL_DIMS")
    DIMS_PER_HEAD: int = Derived(lambda hp: hp.MODEL_DIMS // hp.NUM_HEADS,
                                 doc="MODEL_DIMS // NUM_HEADS")
    VOCAB_SIZE: int = 32000
    MAX_SEQ_LEN: int = 1024

    def hparam_problems(self) -> list[str]:
        problems = super().hparam_problems()
        return problems + in_hparam_names(shape_problems(**self.model_sizes()),
                                          names=MODEL_FIELD_NAMES)

    def model_sizes(self) -> dict[str, int]:
        """TransformerConfig's size fields, from the hyperparameters MODEL_FIELD_NAMES names."""
        return {field: getattr(self, name) for field, name in MODEL_FIELD_NAMES.items()}

    def model_config(self) -> fdl.Config[TransformerConfig]:
        raise ConfigError(f"{self.name} does not describe a model; subclass a model family")

    def transformer_fields(self) -> dict[str, Any]:
        """The TransformerConfig fields every family maps the same way (sizes, init, dropout, layer
        stacking, remat, dtypes); a family's model_config adds only its architecture switches."""
        return {
            **self.model_sizes(),
            "norm_epsilon": self.LAYERNORM_EPSILON,
            "init_std": self.INIT_STD,
            "softmax_init_std": self.SOFTMAX_INIT_STD,
            **{field: getattr(self, name) for field, name in DROPOUT_FIELD_NAMES.items()},
            "scan_layers": self.USE_REPEATED_LAYER,
            "remat_policy": self.remat_policy(),
            "attention_kind": AttentionKind(self.ATTENTION_KIND),
            "attention_implementation": AttentionImplementation(self.ATTENTION_IMPLEMENTATION),
            "dtype": self.FPROP_DTYPE,
            "param_dtype": "float32",
            # Pax's ENABLE_TE / ENABLE_FP8 environment variables (transformer_engine_settings.py)
            **transformer_engine_fields(native_fp8=bool(getattr(self, "USE_FP8", False))),
            "fp8": fdl.Config(Fp8Config, **self.fp8_fields()) if self.USE_FP8 else None,
            "pipeline": self.pipeline_config(),
            "context_parallel_strategy": self.context_parallel_strategy(),
        }

    def flops_per_token(self) -> int:
        """MaxText's count, read off the model this experiment builds (so GQA, gated MLPs, the
        top-k and shared experts of MoE layers, dense first layers and latent attention follow
        it).

        With USE_LORA the work actually done: the base weights are frozen (no weight-gradient
        matmuls) and the adapters train (paxlite/train/flops.py), so MFU is not overstated."""
        model = fdl.build(self.model_config())
        moe = model.moe
        lora_params = None
        if self.USE_LORA:  # the adapters are what with_lora adds to the base model
            lora_params = (num_params(fdl.build(self.with_lora(self.model_config())))
                           - num_params(model))
        # The sizes MODEL_FIELD_NAMES lists, as the built model has them.
        sizes = {field: getattr(model, field) for field in MODEL_FIELD_NAMES
                 if field != "max_seq_len"}
        return flops_lib.flops_per_token(
            **sizes,
            seq_len=model.max_seq_len,
            num_kv_heads=model.kv_heads,
            gated_mlp=model.gated_mlp,
            lora_params=lora_params,
            num_moe_layers=0 if moe is None else moe.num_moe_layers(model.num_layers),
            num_experts=None if moe is None else moe.num_experts,
            experts_per_token=2 if moe is None else moe.experts_per_token,
            expert_hidden_dims=None if moe is None else moe.expert_hidden_dims,
            gated_experts=False if moe is None else moe.gated_experts,
            sliding_window=model.sliding_window,
            num_windowed_layers=None if model.layer_types is None else sum(
                kind is LayerAttention.SLIDING for kind in model.layer_types),
            shared_expert_hidden_dims=None if moe is None else moe.shared_expert_hidden_dims,
            attention_chunk_size=model.attention_chunk_size,
            num_chunked_layers=0 if model.layer_types is None else sum(
                kind is LayerAttention.CHUNKED for kind in model.layer_types),
            mla=None if model.mla is None else flops_lib.LatentAttentionSizes(
                kv_lora_rank=model.mla.kv_lora_rank, qk_rope_head_dims=model.mla.qk_rope_head_dims,
                v_head_dims=model.mla.v_head_dims, q_lora_rank=model.mla.q_lora_rank),
        )


class KeyValueHeadSettings:
    """Grouped-query attention (Pax USE_MQA with NUM_KV_HEADS), for the families that have it
    (llama.py and those built on it, finetune.py); listed last among their bases, so `show` lists
    it after every shared setting."""

    # Key/value heads of grouped-query attention; equal to NUM_HEADS means plain multi-head
    # attention with Pax's combined QKV projection, fewer means separate q/k/v projections (Pax
    # USE_MQA=True, NUM_KV_HEADS=K).
    NUM_KV_HEADS: int = Derived(lambda hp: hp.NUM_HEADS, doc="NUM_HEADS")

    def validate(self) -> None:
        super().validate()
        names = {**MODEL_FIELD_NAMES, "num_kv_heads": "NUM_KV_HEADS"}
        problems = shape_problems(**self.model_sizes(), num_kv_heads=self.NUM_KV_HEADS,
                                  position_embedding=self.position_kind())
        if problems:
            raise ConfigError("; ".join(in_hparam_names(problems, names=names)))

    def position_kind(self) -> PositionEmbedding:
        """How the model encodes positions (rotary embeddings need an even DIMS_PER_HEAD)."""
        return PositionEmbedding.ROTARY


class RotarySettings:
    """The base of the rotary position embedding, for the families that change LLaMA-2's
    (fuji.py, mixtral.py, llama3.py, mistral.py, qwen.py, finetune.py); listed first among their
    bases, so `show` keeps its place."""

    ROPE_THETA: float = 1e4  # RoPE base (HF rope_theta); LLaMA-2's is 1e4

    def model_config(self) -> fdl.Config[TransformerConfig]:
        config = super().model_config()
        config.rope_theta = self.ROPE_THETA
        return config


class ModelDtypeSettings:
    """The activations' dtype (the parameters stay float32)."""

    FPROP_DTYPE: Literal["float32", "bfloat16"] = "float32"


class ModelLayerSettings:
    """How the layers are stacked, rematerialised, regularised and initialised."""

    USE_REPEATED_LAYER: bool = False
    # Remat policy of each layer (Pax's names; docs/training.md says what each saves): of the
    # repeated (scanned) stack always; of unrolled layers only where set explicitly (remat_policy).
    CHECKPOINT_POLICY: Literal[
        "SAVE_NOTHING", "SAVE_EVERYTHING", "SAVE_DOT_ONLY", "SAVE_DOT_WITH_NO_BATCH_DIM",
        "SAVE_DOT_FOR_MLPERF_200B", "SAVE_ITERATION_INPUT", "SAVE_QKV_OUT_PROJ", "SAVE_OUT_PROJ",
        "SAVE_CONTEXT", "SAVE_CONTEXT_AND_OUT_PROJ",
    ] = "SAVE_NOTHING"
    DROPOUT_PROB: float = 0.0
    INPUT_DROPOUT_PROB: float = 0.0
    INIT_STD: float = 0.02
    SOFTMAX_INIT_STD: float = Derived(lambda hp: hp.INIT_STD, doc="INIT_STD")
    LAYERNORM_EPSILON: float = 1e-5

    def hparam_problems(self) -> list[str]:
        dropout = {field: getattr(self, name) for field, name in DROPOUT_FIELD_NAMES.items()}
        return super().hparam_problems() + in_hparam_names(dropout_problems(**dropout),
                                                           names=DROPOUT_FIELD_NAMES)

    def remat_policy(self) -> RematPolicy:
        """The policy each layer is remat'd with (RematPolicy.NONE: no jax.checkpoint at all).

        The scanned stack (USE_REPEATED_LAYER) takes CHECKPOINT_POLICY, as in Pax. Pax ignores it
        on unrolled layers, which keep every activation; paxlite keeps that where the policy is
        the inherited default, so Pax's unrolled experiments (GPT126M) compile the same step at
        the same speed. A policy set explicitly (``checkpoint_policy_set``) is applied to each
        unrolled layer instead, with the same jax.checkpoint policy the scanned stack would use
        (models/layer_stacks.py): that is what a user who sets it expects, and on a TPU v5e it is
        the difference between an out-of-memory 507M step (20 GB of temporaries unrolled with the
        policy ignored) and 5.9 GB with a checkpoint per layer. Refusing it instead would send
        the user to USE_REPEATED_LAYER=true, which stores the parameters stacked: a checkpoint
        saved unrolled would no longer restore as it is.
        """
        if self.USE_REPEATED_LAYER or self.checkpoint_policy_set():
            return RematPolicy.parse(self.CHECKPOINT_POLICY)
        return RematPolicy.NONE

    def checkpoint_policy_set(self) -> bool:
        """Whether CHECKPOINT_POLICY was chosen rather than inherited: given as an override
        (--fdl.CHECKPOINT_POLICY, a config modifier, ``resolve``: the experiment's ``overridden``)
        or an experiment's own value other than the default declared here. An experiment that
        writes the default out (GPT126M's SAVE_NOTHING) has not chosen anything for its
        unrolled layers: Pax's value had no effect there."""
        return ("CHECKPOINT_POLICY" in self.overridden
                or self.CHECKPOINT_POLICY != ModelLayerSettings.CHECKPOINT_POLICY)

    def remat_description(self) -> str:
        """The remat each layer of the step really has, in words (the plan reports it)."""
        policy = self.remat_policy()
        if policy is RematPolicy.NONE:
            return ("none (unrolled layers keep every activation; CHECKPOINT_POLICY applies to "
                    "scanned layers, and to unrolled ones only where set explicitly)")
        where = ("each scanned layer" if self.USE_REPEATED_LAYER
                 else "each unrolled layer (CHECKPOINT_POLICY set explicitly)")
        if self.pipeline_config() is not None:
            where = "each pipeline iteration (a stage's layers)"
        return f"{policy.name} on {where}"


class LoraSettings:
    """LoRA (Pax LoRAMixin): adapters on the family's base model; only they train."""

    # Adapters of rank LORA_RANK on LORA_TARGET_LAYERS ("attention": q, k, v and the attention
    # output; "mlp": every MLP matmul; "all": both). The deltas are scaled by LORA_ALPHA /
    # LORA_RANK; None means LORA_ALPHA = LORA_RANK (scale 1, as Pax).
    USE_LORA: bool = False
    LORA_RANK: int = 8
    LORA_TARGET_LAYERS: Literal["all", "attention", "mlp"] = "all"
    LORA_ALPHA: float | None = None
    # USE_LORA freezes the base model, so it needs CHECKPOINT_RESTORE_PATH: adapters on a random
    # frozen base learn nothing useful. True opts in to exactly that (tests, benchmarks), with a
    # warning in the log.
    LORA_RANDOM_BASE: bool = False

    def lora_problems(self) -> list[str]:
        """LORA_RANK / LORA_ALPHA out of range (the first is raised: each stands alone)."""
        problems = rank_problems(self.LORA_RANK) + alpha_problems(self.LORA_ALPHA)
        if self.USE_LORA and self.LORA_TARGET_LAYERS != "attention" and self.is_moe():
            problems.append(f"LORA_TARGET_LAYERS={self.LORA_TARGET_LAYERS!r} puts adapters on "
                            "the MLP matmuls, and paxlite has none for a mixture of experts: use "
                            "--fdl.LORA_TARGET_LAYERS=attention with an MoE model")
        return in_hparam_names(problems, names=LORA_FIELD_NAMES)

    def unread_lora_problems(self) -> list[str]:
        """LoRA settings given where nothing reads them, or LoRA on a random base by accident."""
        given = set(self.overridden)
        if not self.USE_LORA:
            unused = sorted(given & {"LORA_RANK", "LORA_ALPHA", "LORA_TARGET_LAYERS",
                                     "LORA_RANDOM_BASE"})
            if unused:
                return [(f"{', '.join(unused)} set but USE_LORA is false, so a full fine-tune "
                         "would run and ignore them: add --fdl.USE_LORA=true, or drop them")]
        elif not self.CHECKPOINT_RESTORE_PATH and not self.LORA_RANDOM_BASE:
            return [(
                "USE_LORA=true freezes the base model, and CHECKPOINT_RESTORE_PATH is unset, so "
                "the adapters would train on a randomly initialised base: pass "
                "--fdl.CHECKPOINT_RESTORE_PATH=<a job or converted checkpoint>, or "
                "--fdl.LORA_RANDOM_BASE=true to mean it")]
        return []

    def with_lora(self, model: fdl.Config[TransformerConfig]) -> fdl.Config[TransformerConfig]:
        """The family's base model plus USE_LORA's adapters (families describe the base model)."""
        if self.USE_LORA:
            if not self.CHECKPOINT_RESTORE_PATH:  # validate() allowed it: LORA_RANDOM_BASE=true
                logging.warning(
                    "LORA_RANDOM_BASE=true: the LoRA adapters train on a randomly initialised, "
                    "frozen base model (no CHECKPOINT_RESTORE_PATH)")
            for field, name in LORA_FIELD_NAMES.items():
                setattr(model, field, getattr(self, name))
            model.lora_targets = LoraTargets(model.lora_targets)
        return model


class Fp8Settings:
    """Pax's native FP8 (docs/fp8.md), mapped to the model's `fp8` field by transformer_fields."""

    # The QKV, attention-output, MLP and GShard expert matmuls run in FP8 through Flax's
    # Fp8Einsum (e4m3 forward, e5m2 gradients, delayed per-tensor scaling), each with its own
    # scales and amax histories of FP8_AMAX_HISTORY_LENGTH steps (Pax 1024; Fuji -fp8: 128). The
    # embedding, softmax and router stay in FPROP_DTYPE.
    USE_FP8: bool = False
    FP8_AMAX_HISTORY_LENGTH: int = 1024

    def fp8_fields(self) -> dict[str, int]:
        """Fp8Config's fields, from the hyperparameters FP8_FIELD_NAMES names."""
        return {field: getattr(self, name) for field, name in FP8_FIELD_NAMES.items()}

    def fp8_problems(self) -> list[str]:
        return in_hparam_names(fp8_config_problems(**self.fp8_fields()), names=FP8_FIELD_NAMES)

    def unread_fp8_problems(self) -> list[str]:
        if "FP8_AMAX_HISTORY_LENGTH" in self.overridden and not self.USE_FP8:
            return [("FP8_AMAX_HISTORY_LENGTH set but USE_FP8 is false, so no matmul runs in FP8: "
                    "add --fdl.USE_FP8=true, or drop it")]
        return []
