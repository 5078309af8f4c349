"""Tiny GPT, LLaMA, GLaM and Mixtral configurations that train in seconds on a CPU: for tests, the
demo and benchmarks."""

from __future__ import annotations

from paxlite.experiments.base import DataSource
from paxlite.experiments.glam import GLaM126M64E
from paxlite.experiments.gpt import GPT126M, SyntheticTokens
from paxlite.experiments.llama import BaseLLaMA
from paxlite.experiments.mixtral import BaseMixtral


class TinyRun:
    """Mixin: what every tiny experiment runs with, whatever its family: 64 tokens, 2 rows per
    device, every local device on the data axis, float32, and a learning rate and intervals for
    runs of tens of steps. Listed before the family's class, so these values win over its own."""

    MAX_SEQ_LEN = 64
    PERCORE_BATCH_SIZE = 2
    ICI_MESH_SHAPE = None
    DCN_MESH_SHAPE = [1, 1, 1]
    FPROP_DTYPE = "float32"
    INIT_STD = 0.02
    LEARNING_RATE = 3e-3
    CHECKPOINT_EVERY_N_STEPS = 50
    SUMMARY_INTERVAL_STEPS = 10
    EVAL_INTERVAL_STEPS = 50


class TinyWidths:
    """Mixin: the widths of the tiny LLaMA, Mixtral and GLaM: 4 heads x 8, d_model 32, ffn 64."""

    NUM_HEADS = 4
    DIMS_PER_HEAD = 8
    MODEL_DIMS = 32
    HIDDEN_DIMS = 64


class TinyLLaMASizes(TinyWidths):
    """Mixin: LLaMA's shape at test size, for TinyLLaMA and TinyMixtral's attention and experts:
    2 layers, 4 query / 2 key-value heads x 8, d_model 32, ffn 64, vocabulary 512."""

    NUM_LAYERS = 2
    NUM_KV_HEADS = 2
    VOCAB_SIZE = 512


class TinySynthetic(SyntheticTokens, TinyRun, GPT126M):
    """2 layers, 8 heads (so an 8-way tensor axis divides them), d_model 64, vocabulary 256, 64
    tokens; float32; every local device on the data axis."""

    NUM_LAYERS = 2
    NUM_HEADS = 8
    MODEL_DIMS = 64
    HIDDEN_DIMS = 256
    DIMS_PER_HEAD = 8
    VOCAB_SIZE = 256
    MAX_STEPS = 100
    LR_COS_WARMUP = 10
    LR_COS_DECAY_END = 100
    CHECKPOINT_MAX_TO_KEEP = 3
    EVAL_LOOP_NUM_BATCHES = 2


class TinySyntheticRepeated(TinySynthetic):
    """TinySynthetic with a scanned layer stack and full rematerialisation."""

    USE_REPEATED_LAYER = True
    CHECKPOINT_POLICY = "SAVE_NOTHING"


class DemoSizes:
    """Mixin: the `make demo` model, on synthetic tokens or Shakespeare: 4 layers, 4 heads x 32,
    d_model 128, ffn 512, 128 tokens, 16 rows per device, summaries every 20 steps."""

    NUM_LAYERS = 4
    NUM_HEADS = 4
    MODEL_DIMS = 128
    HIDDEN_DIMS = 512
    DIMS_PER_HEAD = 32
    MAX_SEQ_LEN = 128
    PERCORE_BATCH_SIZE = 16
    SUMMARY_INTERVAL_STEPS = 20
    EVAL_INTERVAL_STEPS = 100


class DemoSynthetic(DemoSizes, TinySynthetic):
    """`make demo`: 4 layers, d_model 128, 300 steps on one CPU; the loss falls from ln(512)
    towards zero."""

    VOCAB_SIZE = 512
    MAX_STEPS = 300
    LR_COS_WARMUP = 30
    LR_COS_DECAY_END = 300
    CHECKPOINT_EVERY_N_STEPS = 100


class TinyShakespeare(DemoSizes, TinySynthetic):
    """`make demo`: a small GPT on Shakespeare's works, tokenised with a 2,048-piece SentencePiece
    model; packed rows, no dropout, GPT's weight decay 0.1 and TinyRun's learning rate.

    Needs DATA_DIR (made by `python -m paxlite.data.prepare`) and VOCAB_PATH; `make demo` builds
    both. Sized to train in a few minutes on two CPU cores.
    """

    data_source = DataSource.TEXT
    SYNTHETIC_DATA = False
    VOCAB_SIZE = 2048
    MAX_STEPS = 600
    LR_COS_WARMUP = 60
    LR_COS_DECAY_END = 600
    CHECKPOINT_EVERY_N_STEPS = 200
    EVAL_LOOP_NUM_BATCHES = 8


class TinyLLaMA(TinyLLaMASizes, TinyRun, BaseLLaMA):
    """LLaMA's architecture and BoolQ evaluation at test size: 2 layers, 4 query / 2 key-value
    heads x 8, d_model 32, vocabulary 512, 64 tokens, float32.
    `CONFIG=paxlite.experiments.tiny.TinyLLaMA` runs scripts_gpu/run_llama_boolq.sh on a CPU."""

    MAX_STEPS = 2
    LR_SCHEDULE = "constant"


class TinyGLaM(SyntheticTokens, TinyWidths, TinyRun, GLaM126M64E):
    """GLaM's architecture at test size on synthetic tokens: 4 layers (MoE on layers 0 and 2, 8 ReLU
    experts, GShard top-2), 4 heads x 8, d_model 32, ffn 64, vocabulary 256, 64 tokens; float32;
    every local device on the data axis."""

    NUM_LAYERS = 4
    VOCAB_SIZE = 256
    NUM_EXPERTS = 8
    MAX_STEPS = 20
    LR_SCHEDULE = "constant"
    CHECKPOINT_MAX_TO_KEEP = 3
    EVAL_LOOP_NUM_BATCHES = 2


class TinyMixtral(SyntheticTokens, TinyLLaMASizes, TinyRun, BaseMixtral):
    """Mixtral's architecture at test size on synthetic tokens: 2 layers, every one MoE (8 SwiGLU
    experts, dropless top-2), 4 query / 2 key-value heads x 8, d_model 32, expert ffn 64,
    vocabulary 512, 64 tokens; float32."""

    MAX_STEPS = 20
    LR_SCHEDULE = "constant"
