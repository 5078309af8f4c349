"""Alibaba's Qwen2.5 and Qwen3 base models (Hugging Face `Qwen/Qwen2.5-0.5B`, `Qwen/Qwen2.5-7B`,
`Qwen/Qwen3-8B`, `Qwen/Qwen3-30B-A3B`) at their published sizes, set up for fine-tuning on one node
of 8 GPUs.

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

Qwen3-30B-A3B is Qwen3's attention with every feed-forward block a dropless top-8 mixture of 128
SwiGLU experts (Mixtral's routing, mixtral.py; the 8 weights renormalised, config.json's
`norm_topk_prob: true`), no shared expert. Its weights, gradients and Adam state (~490 GB) fill
8 GPUs whatever the mesh, so the 128 experts are split over an expert axis of 4 and FSDP of 2
(ICI [1, 2, 1, 4]: each device holds 32 experts, half of each), and each GPU takes one sequence of
8,192 tokens. The load-balancing loss is on: HF's router_aux_loss_coef 0.001 times top-k 8, spread
over the 48 layers as interop/hf_moe.py maps it (Qwen's config.json ships it switched off,
output_router_logits false; a fine-tune that drops it can unbalance the experts).
"""

from __future__ import annotations

from typing import ClassVar

import fiddle as fdl

from paxlite.experiments.architecture_settings import (
    AttentionVariantSettings,
    TiedEmbeddingSettings,
)
from paxlite.experiments.fine_tuning import FineTuningRecipe
from paxlite.experiments.llama import BaseLLaMA
from paxlite.experiments.model_settings import RotarySettings
from paxlite.experiments.moe_settings import MoeSettings
from paxlite.models.activations import Activation
from paxlite.models.transformer import TransformerConfig


class BaseQwen(FineTuningRecipe, TiedEmbeddingSettings, AttentionVariantSettings, RotarySettings,
               BaseLLaMA):
    """Qwen2.5's and Qwen3's shared architecture and fine-tuning defaults; not registered."""

    family_adds_bos = False  # Qwen's tokenizers define no BOS token

    LAYERNORM_EPSILON = 1e-6
    ROPE_THETA = 1e6
    VOCAB_SIZE = 151_936
    MAX_SEQ_LEN = 8192


class Qwen2_5_0_5B(BaseQwen):
    """Qwen2.5 0.5B: 24 layers, 14 query and 2 key/value heads x 64, d_model 896, ffn 4864, q/k/v
    biases, tied embeddings; 494,032,768 parameters."""

    hf_ids = ("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B-Instruct")

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

    hf_ids = ("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct")

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

    hf_ids = ("Qwen/Qwen3-8B", "Qwen/Qwen3-8B-Base")

    NUM_LAYERS = 36
    NUM_HEADS = 32
    NUM_KV_HEADS = 8
    MODEL_DIMS = 4096
    HIDDEN_DIMS = 12288
    QK_NORM = True


class Qwen3_30B_A3B(MoeSettings, BaseQwen):
    """Qwen3-30B-A3B: 48 layers, 32 query and 4 key/value heads x 128, d_model 2048, q/k norms, on
    every layer 128 experts of ffn 768, 8 per token (renormalised); 30,532,122,624 parameters,
    3,353,032,704 active per token (module docstring)."""

    hf_ids = ("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B-Base")

    moe_layer_interval: ClassVar[int] = 1  # every layer sparse (decoder_sparse_step 1)
    gated_experts: ClassVar[bool] = True  # HF gate_proj = wi_gate, up_proj = wi, down_proj = wo
    expert_activation: ClassVar[Activation] = Activation.SILU

    NUM_LAYERS = 48
    NUM_HEADS = 32
    NUM_KV_HEADS = 4
    MODEL_DIMS = 2048
    HIDDEN_DIMS = 6144  # config.json's intermediate_size: a dense layer's, which it has none of
    QK_NORM = True
    NUM_EXPERTS = 128
    NUM_EXPERTS_PER_TOKEN = 8
    EXPERT_HIDDEN_DIMS = 768
    MOE_ROUTING = "dropless_topk"
    # XLA:GPU expands jax.lax.ragged_dot to [32 local experts, 262,144 rows, 2,048] per matmul
    # (32 GiB); the tiled kernel keeps the step's memory in proportion to the rows (the note below)
    MOE_GROUPED_MATMUL = "tiled"
    LOAD_BALANCING_WEIGHT = 0.008
    ICI_MESH_SHAPE = [1, 2, 1, 4]
    PERCORE_BATCH_SIZE = 1

    def model_config(self) -> fdl.Config[TransformerConfig]:
        config = super().model_config()
        config.moe = self.moe_config()
        return config


QWEN_EXPERIMENTS = (Qwen2_5_0_5B, Qwen2_5_7B, Qwen3_8B, Qwen3_30B_A3B)
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
| `Qwen3_30B_A3B` | 8 | 8 x 8,192 | 95.69 GiB | no, 16.58 GiB short |
| `Qwen3_30B_A3B` (`MAX_SEQ_LEN=4096`) | 8 | 8 x 4,096 | 88.03 GiB | no, 8.92 GiB short |
| `Qwen3_30B_A3B` (LoRA on `attention`) | 8 | 8 x 8,192 | 46.41 GiB | fits, 32.70 GiB to spare |
| `Qwen3_30B_A3B` (`ICI_MESH_SHAPE=[1,8,1,1]`) | 8 | 8 x 8,192 | 81.03 GiB | no, 1.92 GiB short |
| `Qwen3_30B_A3B` (same, `MAX_SEQ_LEN=2048`) | 8 | 8 x 2,048 | 77.79 GiB | fits, 1.32 to spare |

`Qwen3_30B_A3B`'s rows were planned on 2026-12-06 with its default `MOE_GROUPED_MATMUL=tiled`
(LoRA: `--fdl.USE_LORA=true --fdl.LORA_TARGET_LAYERS=attention`, plus the checkpoint to adapt).
With `MOE_GROUPED_MATMUL=ragged_dot` the same step peaked at 186.27 GiB (2026-12-05): XLA's
GPU compiler expands each grouped matmul to a dense [32 experts, 262,144 rows, 2,048] array per
device (32 GiB). A full fine-tune still does not fit one node of H100s: its float32 state
(weights and Adam's two moments, 49.11 GiB a device) and float32 gradients (16.37 GiB) take 65.48
of the 79.11 GiB before anything else, and the rest of the step's temporaries take 30.21 GiB at
8,192 tokens a device (22.55 at 4,096); none of `plan`'s levers (expert 8, two pipeline stages)
brings it under. LoRA fits. FSDP over all 8 devices without an expert axis holds every
parameter 8 ways (state 42.66 GiB) and comes within 1.92 GiB at 8,192 tokens; at 2,048 it fits,
but with too little to spare for a default.
"""
