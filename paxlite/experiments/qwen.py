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
`norm_topk_prob: true`), no shared expert. Its float32 weights, gradients and Adam state (~490 GB)
overfill 8 80-GB GPUs, so its defaults trade three things for memory (the catalogue note below has
`plan`'s figures): FSDP over all 8 GPUs without an expert axis (ICI [1, 8, 1, 1]: every parameter
held 8 ways; an expert axis leaves the attention and embeddings less sharded), Adam's first moment
in bfloat16 (ADAM_MU_DTYPE, 2 bytes a parameter less; the second moment and the weights stay
float32), and the loss over blocks of 1,024 positions (LOSS_CHUNK_SIZE: the [8,192, 151,936] logits
are never whole). Each GPU takes one sequence of 8,192 tokens. The load-balancing loss is on: HF's
router_aux_loss_coef 0.001 times top-k 8, spread over the 48 layers as interop/hf_moe.py maps it
(Qwen's config.json ships it switched off, output_router_logits false; a fine-tune that drops it can
unbalance the experts).
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
    # A full fine-tune on 8 H100s: the module docstring and the catalogue note
    ICI_MESH_SHAPE = [1, 8, 1, 1]
    ADAM_MU_DTYPE = "bfloat16"
    LOSS_CHUNK_SIZE = 1024
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
| `Qwen3_30B_A3B` | 8 | 8 x 8,192 | 73.73 GiB | fits, 5.38 GiB to spare |
| `Qwen3_30B_A3B` (`ADAM_MU_DTYPE=float32`) | 8 | 8 x 8,192 | 80.84 GiB | no, 1.73 GiB short |
| `Qwen3_30B_A3B` (`LOSS_CHUNK_SIZE=None`) | 8 | 8 x 8,192 | 75.64 GiB | fits, 3.47 GiB to spare |
| `Qwen3_30B_A3B` (`ICI_MESH_SHAPE=[1,2,1,4]`) | 8 | 8 x 8,192 | 86.01 GiB | no, 6.90 GiB short |
| `Qwen3_30B_A3B` (same, `ADAM_MU_DTYPE=float32`) | 8 | 8 x 8,192 | 94.20 GiB | no, 15.09 short |
| `Qwen3_30B_A3B` (LoRA on `attention`) | 8 | 8 x 8,192 | 36.36 GiB | fits, 42.75 GiB to spare |

`Qwen3_30B_A3B`'s rows were planned on 2026-12-07 with its defaults (`MOE_GROUPED_MATMUL=tiled`,
`ICI_MESH_SHAPE=[1,8,1,1]`, `ADAM_MU_DTYPE=bfloat16`, `LOSS_CHUNK_SIZE=1024`), each row changing the
one setting it names (LoRA: `--fdl.USE_LORA=true --fdl.LORA_TARGET_LAYERS=attention`, planned with
`--fdl.LORA_RANDOM_BASE=true` in place of the checkpoint to adapt). A full fine-tune in float32 fits
no mesh of 8 H100s: the float32 weights, gradients and both Adam moments are 16 bytes a parameter,
56.9 GiB a device at best, and the rest of the step takes 24 GiB more. The bfloat16 first moment
saves 7.1 GiB a device, the chunked loss 1.9. An expert axis (fsdp 2 x expert 4, the layout of the
2026-12-06 plan) holds the attention and embedding weights (1.5 billion parameters) only 2 ways.
With `MOE_GROUPED_MATMUL=ragged_dot` the step peaked at 186.27 GiB (2026-12-05, fsdp 2 x expert 4):
XLA's GPU compiler expands each grouped matmul to a dense [32 experts, 262,144 rows, 2,048] array
per device (32 GiB).

73.73 GiB is more than JAX hands its allocator by default (75 % of the device, 59.33 GiB) and more
than the 0.8 of the other presets (63.29 GiB): run `Qwen3_30B_A3B` with
`XLA_PYTHON_CLIENT_MEM_FRACTION=0.95` (75.15 GiB), which scripts_gpu's preset for it (`moe-fsdp`)
exports; `python -m paxlite.main` run by hand needs the variable set.
"""
