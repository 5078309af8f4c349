"""GPT-3 style experiments with exactly the dimensions and training hyperparameters of Pax's GPU
configs.

Architecture (Pax `configure_gpt3_task`): pre-LayerNorm with float32 reductions, tanh-approximated
GELU, learned absolute position embeddings, embedding table tied with the softmax (no softmax bias),
fused biased QKV, Adam with decoupled weight decay, global-norm clipping and a linear-rampup
cosine-decay schedule.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import fiddle as fdl

from paxlite.experiments.base import DataSource, LanguageModelExperiment
from paxlite.experiments.optimizer_settings import GPT3Optimizer
from paxlite.models.transformer import Activation, NormKind, TransformerConfig

# The switches that make a TransformerConfig GPT-3 style (the module docstring says which); sizes
# and the rest stay with the experiment.
GPT3_ARCHITECTURE: Mapping[str, Any] = MappingProxyType({
    "norm": NormKind.LAYER_NORM,
    "activation": Activation.GELU_TANH,
    "use_bias": True,
    "tie_embeddings": True,
    "learned_position_embedding": True,
})


class GPT126M(GPT3Optimizer, LanguageModelExperiment):
    """Pax GPT126MBase: 12 layers, 12 heads x 64, d_model 768, ffn 3072, 125,262,336 parameters."""

    data_source = DataSource.TEXT

    NUM_LAYERS = 12
    NUM_HEADS = 12
    MODEL_DIMS = 768
    HIDDEN_DIMS = 3072
    DIMS_PER_HEAD = 64
    VOCAB_SIZE = 50304
    MAX_SEQ_LEN = 2048
    PERCORE_BATCH_SIZE = 4
    ICI_MESH_SHAPE = [8, 1, 1]
    DCN_MESH_SHAPE = [8, 1, 1]
    FPROP_DTYPE = "bfloat16"
    USE_REPEATED_LAYER = False
    CHECKPOINT_POLICY = "SAVE_NOTHING"
    MAX_STEPS = 600000
    INIT_STD = 0.023
    LAYERNORM_EPSILON = 1e-5
    DROPOUT_PROB = 0.0
    LEARNING_RATE = 6e-4
    LR_COS_WARMUP = 636
    LR_COS_DECAY_END = 500000
    WEIGHT_DECAY = 0.1
    CHECKPOINT_EVERY_N_STEPS = 5000
    CHECKPOINT_MAX_TO_KEEP = 10
    SUMMARY_INTERVAL_STEPS = 100
    EVAL_INTERVAL_STEPS = 100

    def model_config(self) -> fdl.Config[TransformerConfig]:
        return fdl.Config(TransformerConfig, **self.transformer_fields(), **GPT3_ARCHITECTURE)


class LargeGPT:
    """Mixin: what Pax's GPT5B and GPT175B share over GPT126M: heads of 128, a scanned layer
    stack, FSDP over 32 nodes of 8 GPUs, 75,000 steps and a summary every 10. Listed before
    GPT126M, so these values win over its own."""

    DIMS_PER_HEAD = 128
    ICI_MESH_SHAPE = [1, 8, 1]
    DCN_MESH_SHAPE = [1, 32, 1]
    USE_REPEATED_LAYER = True
    MAX_STEPS = 75000
    SUMMARY_INTERVAL_STEPS = 10


class GPT5B(LargeGPT, GPT126M):
    """Pax GPT5BBase: 24 layers, 32 heads x 128, d_model 4096, ffn 16384; input dropout 0.1 as Pax's
    task() sets."""

    NUM_LAYERS = 24
    NUM_HEADS = 32
    MODEL_DIMS = 4096
    HIDDEN_DIMS = 16384
    PERCORE_BATCH_SIZE = 8
    CHECKPOINT_POLICY = "SAVE_DOT_WITH_NO_BATCH_DIM"
    INIT_STD = 0.01
    INPUT_DROPOUT_PROB = 0.1
    LEARNING_RATE = 1.6e-4
    LR_COS_WARMUP = 115
    LR_COS_DECAY_END = 62500
    CHECKPOINT_EVERY_N_STEPS = 250


class GPT175B(LargeGPT, GPT126M):
    """Pax GPT175BBase: 96 layers, 96 heads x 128, d_model 12288, ffn 49152, vocabulary 50257;
    GPT126M's init (0.023) and remat policy (SAVE_NOTHING)."""

    NUM_LAYERS = 96
    NUM_HEADS = 96
    MODEL_DIMS = 12288
    HIDDEN_DIMS = 49152
    VOCAB_SIZE = 50257
    PERCORE_BATCH_SIZE = 6
    LEARNING_RATE = 2e-5
    LR_COS_WARMUP = 265
    LR_COS_DECAY_END = 108600
    CHECKPOINT_EVERY_N_STEPS = 100


class SyntheticTokens:
    """Mixin: synthetic tokens of the experiment's shapes (no I/O), 100 steps, as Pax's synthetic
    GPU configs."""

    data_source = DataSource.SYNTHETIC
    SYNTHETIC_DATA = True
    MAX_STEPS = 100


class Synthetic126M(SyntheticTokens, GPT126M):
    """GPT126M on synthetic tokens."""


class Synthetic5B(SyntheticTokens, GPT5B):
    """GPT5B on synthetic tokens."""


class Synthetic175B(SyntheticTokens, GPT175B):
    """GPT175B on synthetic tokens."""


class Pile126M(GPT126M):
    """GPT126M on The Pile (Pax `PileUnsupervisedDataset`)."""


class Pile5B(GPT5B):
    """GPT5B on The Pile; Pax also registers it as GPT5B."""


class Pile175B(GPT175B):
    """GPT175B on The Pile; Pax also registers it as GPT175B."""


class Lambada126M(GPT126M):
    """Zero-shot Lambada (acc_strict, perplexity) of GPT126M: `--mode=eval` on a pretraining job
    directory, or interleaved with training on DATA_DIR (Pax: ICI [8,1,1])."""

    EVAL_TASK = "lambada"
    EVAL_LOOP_NUM_BATCHES = -1  # the whole set, as Pax
    ICI_MESH_SHAPE = [8, 1, 1]
