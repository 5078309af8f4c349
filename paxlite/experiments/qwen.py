"""Alibaba's Qwen2.5 and Qwen3 base models (Hugging Face `Qwen/Qwen2.5-0.5B`, `Qwen/Qwen2.5-7B`,
`Qwen/Qwen3-8B`) at their published sizes, set up for fine-tuning on one node of 8 GPUs.

The shapes are those of each model's published config.json: LLaMA's layout (llama.py's
`LLAMA_ARCHITECTURE`: RMSNorm, SwiGLU, RoPE, grouped-query attention) with RMSNorm eps 1e-6 and RoPE
base 1e6 without frequency scaling. Qwen2.5 puts biases on the q, k and v projections (none on the
output or the MLP); its small sizes tie the output head to the embedding table (0.5B), the 7B
does not. Qwen3 drops those biases and normalises each head's q and k (RMSNorm over the 128
dimensions) before RoPE. None of them slides a window: Qwen2.5's config.json carries
`sliding_window` but `use_sliding_window: false`. Qwen's tokenizer has no BOS token, so text does
not start with one. Parameter counts equal transformers' for the same config.json.

The weights come from a converted checkpoint (`python -m paxlite convert --from=hf --to=paxlite`,
then --fdl.CHECKPOINT_RESTORE_PATH=DIR). The fine-tuning defaults are llama3.py's, for the same
reasons: FSDP over the 8 GPUs, 2 sequences of 8,192 tokens per GPU (8 for the 0.5B; config.json
allows 32,768 to 131,072 and RoPE has no table, so --fdl.MAX_SEQ_LEN changes no parameter), and
fine_tuning.py's `FineTuningRecipe` (peak rate 2e-5, 5e-5 for the 0.5B; 100 warm-up steps,
cosine over MAX_STEPS=1000).
"""

from __future__ import annotations

from paxlite.experiments.architecture_settings import (
    AttentionVariantSettings,
    TiedEmbeddingSettings,
)
from paxlite.experiments.fine_tuning import FineTuningRecipe
from paxlite.experiments.llama import BaseLLaMA
from paxlite.experiments.model_settings import RotarySettings


class BaseQwen(FineTuningRecipe, TiedEmbeddingSettings, AttentionVariantSettings, RotarySettings,
               BaseLLaMA):
    """Qwen2.5's and Qwen3's shared architecture and fine-tuning defaults; not registered."""

    family_adds_bos = False  # Qwen's tokenizers define no BOS token

    LAYERNORM_EPSILON = 1e-6
    ROPE_THETA = 1e6
    VOCAB_SIZE = 151_936
    MAX_SEQ_LEN = 8192
    PERCORE_BATCH_SIZE = 2
    EVAL_TASK = "validation"
    EVAL_LOOP_NUM_BATCHES = 10


class Qwen2_5_0_5B(BaseQwen):
    """Qwen2.5 0.5B: 24 layers, 14 query and 2 key/value heads x 64, d_model 896, ffn 4864, q/k/v
    biases, tied embeddings; 494,032,768 parameters."""

    NUM_LAYERS = 24
    NUM_HEADS = 14
    NUM_KV_HEADS = 2
    DIMS_PER_HEAD = 64
    MODEL_DIMS = 896
    HIDDEN_DIMS = 4864
    QKV_BIAS = True
    TIE_EMBEDDINGS = True
    PERCORE_BATCH_SIZE = 8
    LEARNING_RATE = 5e-5


class Qwen2_5_7B(BaseQwen):
    """Qwen2.5 7B: 28 layers, 28 query and 4 key/value heads x 128, d_model 3584, ffn 18944, q/k/v
    biases, vocabulary 152064; 7,615,616,512 parameters."""

    NUM_LAYERS = 28
    NUM_HEADS = 28
    NUM_KV_HEADS = 4
    MODEL_DIMS = 3584
    HIDDEN_DIMS = 18944
    VOCAB_SIZE = 152_064
    QKV_BIAS = True


class Qwen3_8B(BaseQwen):
    """Qwen3 8B: 36 layers, 32 query and 8 key/value heads x 128, d_model 4096, ffn 12288, q/k
    norms; 8,190,735,360 parameters."""

    NUM_LAYERS = 36
    NUM_HEADS = 32
    NUM_KV_HEADS = 8
    MODEL_DIMS = 4096
    HIDDEN_DIMS = 12288
    QK_NORM = True


QWEN_EXPERIMENTS = (Qwen2_5_0_5B, Qwen2_5_7B, Qwen3_8B)
# Hugging Face repository ids -> registered names (base and instruct share the shapes; Qwen3's
# one repository is the post-trained model, its base is `Qwen3-8B-Base`).
HF_NAMES = {
    "Qwen/Qwen2.5-0.5B": "Qwen2_5_0_5B",
    "Qwen/Qwen2.5-0.5B-Instruct": "Qwen2_5_0_5B",
    "Qwen/Qwen2.5-7B": "Qwen2_5_7B",
    "Qwen/Qwen2.5-7B-Instruct": "Qwen2_5_7B",
    "Qwen/Qwen3-8B": "Qwen3_8B",
    "Qwen/Qwen3-8B-Base": "Qwen3_8B",
}
# Under the family's table in docs/experiments.md: what `plan` said of the defaults.
CATALOGUE_NOTE = """\
Planned 2026-12-05 as llama3.py's rows (`python -m paxlite plan --fdl_config=NAME --devices=8
--target=h100`, XLA's GPU compiler for H100, compile-only), peak memory per device of the training
step at the defaults:

| experiment | devices | global batch x sequence | peak per device | verdict |
|---|--:|---|--:|---|
| `Qwen2_5_0_5B` | 8 | 64 x 8,192 | 61.37 GiB | fits, 17.74 GiB to spare |
| `Qwen2_5_7B` | 8 | 16 x 8,192 | 31.14 GiB | fits, 47.97 GiB to spare |
| `Qwen3_8B` | 8 | 16 x 8,192 | 33.95 GiB | fits, 45.16 GiB to spare |
"""
