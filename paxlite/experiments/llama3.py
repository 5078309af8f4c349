"""Meta's LLaMA-3.1 and 3.2 base models (Hugging Face `meta-llama/Llama-3.1-8B`, `-70B`,
`Llama-3.2-1B`, `-3B`) at their published sizes, set up for fine-tuning on one node of 8 GPUs.

The shapes are those of each model's published config.json: LLaMA-2's architecture (llama.py's
`LLAMA_ARCHITECTURE`: RMSNorm eps 1e-5, SwiGLU, no biases, RoPE) with grouped-query attention of 8
key/value heads, a 128,256-token vocabulary, RoPE base 500,000 and the `llama3` frequency scaling
(factor 8 for 3.1, 32 for 3.2; low/high frequency factors 1 and 4 over the original 8,192
positions). The 3.2 sizes tie the output head to the embedding table. Parameter counts equal
transformers' for the same config.json.

The weights come from a converted checkpoint (`python -m paxlite convert --from=hf --to=paxlite
--fdl_config=LLaMA3_1_8B`, which writes the experiment's scanned layer stack; then
--fdl.CHECKPOINT_RESTORE_PATH=DIR); the training text is the user's (DATA_DIR, or
--fdl.SYNTHETIC_DATA=true for tokens of the same shapes). The defaults are a fine-tuning run's, not
pretraining's (fine_tuning.py has the optimizer, schedule and memory settings and why):
- MAX_SEQ_LEN 8192, the original context the scaling is anchored to; RoPE has no table, so
  --fdl.MAX_SEQ_LEN up to config.json's 131,072 changes no parameter, only activations.
- FSDP over the 8 GPUs (ICI [1, 8, 1]). The 70B's weights, gradients and Adam state (16 bytes
  per parameter, ~1.1 TB) need more than one node: its default is four nodes sharded alike
  (DCN [1, 4, 1], 32 GPUs; on 16 H100s a step is 10 GiB short); on one 8-GPU node it is LoRA
  (--fdl.USE_LORA=true --fdl.DCN_MESH_SHAPE=[1,1,1]), whose frozen base needs no Adam state.
- 2 sequences per GPU, a global batch of 16 (131k tokens per step); the 1B takes 8 per GPU, the
  70B 1 per GPU over its 32.
- A peak learning rate of 2e-5 (1B/3B: 5e-5; 70B: 1e-5), the usual full fine-tuning rates for
  these sizes, an order of magnitude below their pretraining rates.
- bfloat16 activations, float32 weights; validation on held-out batches of the training data
  (EVAL_TASK 'validation', not LLaMA-2's zero-shot BoolQ).
"""

from __future__ import annotations

from paxlite.experiments.architecture_settings import RopeScalingSettings, TiedEmbeddingSettings
from paxlite.experiments.fine_tuning import FineTuningRecipe
from paxlite.experiments.llama import BaseLLaMA
from paxlite.experiments.model_settings import RotarySettings


class BaseLLaMA3(FineTuningRecipe, TiedEmbeddingSettings, RopeScalingSettings, RotarySettings,
                 BaseLLaMA):
    """LLaMA-3's architecture and fine-tuning defaults at any size; not registered."""

    VOCAB_SIZE = 128_256
    NUM_KV_HEADS = 8
    ROPE_THETA = 5e5
    ROPE_SCALING = "llama3"
    ROPE_SCALING_FACTOR = 8.0
    ROPE_SCALING_LOW_FREQ_FACTOR = 1.0
    ROPE_SCALING_HIGH_FREQ_FACTOR = 4.0
    ROPE_SCALING_ORIGINAL_MAX_POSITION = 8192
    MAX_SEQ_LEN = 8192


class LLaMA3_1_8B(BaseLLaMA3):
    """LLaMA-3.1 8B: 32 layers, 32 query and 8 key/value heads x 128, d_model 4096, ffn 14336;
    8,030,261,248 parameters."""

    hf_ids = ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct")

    NUM_LAYERS = 32
    NUM_HEADS = 32
    MODEL_DIMS = 4096
    HIDDEN_DIMS = 14336


class LLaMA3_1_70B(BaseLLaMA3):
    """LLaMA-3.1 70B: 80 layers, 64 query and 8 key/value heads x 128, d_model 8192, ffn 28672;
    70,553,706,496 parameters; four nodes, or LoRA on one (module docstring)."""

    hf_ids = ("meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-70B-Instruct")

    NUM_LAYERS = 80
    NUM_HEADS = 64
    MODEL_DIMS = 8192
    HIDDEN_DIMS = 28672
    PERCORE_BATCH_SIZE = 1
    DCN_MESH_SHAPE = [1, 4, 1]
    LEARNING_RATE = 1e-5


class BaseLLaMA3_2(BaseLLaMA3):
    """LLaMA-3.2's small models: tied input and output embeddings, RoPE frequencies scaled by
    32 (config.json's rope_scaling factor), and a peak rate of 5e-5 for their size."""

    TIE_EMBEDDINGS = True
    ROPE_SCALING_FACTOR = 32.0
    LEARNING_RATE = 5e-5


class LLaMA3_2_1B(BaseLLaMA3_2):
    """LLaMA-3.2 1B: 16 layers, 32 query and 8 key/value heads x 64, d_model 2048, ffn 8192, tied
    embeddings, RoPE scaling factor 32; 1,235,814,400 parameters."""

    hf_ids = ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B-Instruct")

    NUM_LAYERS = 16
    NUM_HEADS = 32
    DIMS_PER_HEAD = 64
    MODEL_DIMS = 2048
    HIDDEN_DIMS = 8192
    PERCORE_BATCH_SIZE = 8


class LLaMA3_2_3B(BaseLLaMA3_2):
    """LLaMA-3.2 3B: 28 layers, 24 query and 8 key/value heads x 128, d_model 3072, ffn 8192, tied
    embeddings, RoPE scaling factor 32; 3,212,749,824 parameters."""

    hf_ids = ("meta-llama/Llama-3.2-3B", "meta-llama/Llama-3.2-3B-Instruct")

    NUM_LAYERS = 28
    NUM_HEADS = 24
    MODEL_DIMS = 3072
    HIDDEN_DIMS = 8192


LLAMA3_EXPERIMENTS = (LLaMA3_1_8B, LLaMA3_1_70B, LLaMA3_2_1B, LLaMA3_2_3B)
# Under the family's table in docs/experiments.md (`python -m paxlite list --format=markdown`):
# what `plan` said of the defaults, re-planned by hand when they change.
CATALOGUE_NOTE = """\
Planned 2026-12-05 with XLA's GPU compiler for H100 (80 GB; compile-only, JAX's CUDA plugin on
`PYTHONPATH`, no GPU): `python -m paxlite plan --fdl_config=NAME --devices=8 --target=h100`. Peak
memory per device of the training step at the defaults (fused cuDNN attention, scanned layers
recomputed in the backward pass: `paxlite/experiments/fine_tuning.py` says why):

| experiment (overrides) | devices | global batch x sequence | peak per device | verdict |
|---|--:|---|--:|---|
| `LLaMA3_1_8B` | 8 | 16 x 8,192 | 30.69 GiB | fits, 48.42 GiB to spare |
| `LLaMA3_1_70B` | 32 | 32 x 8,192 | 53.36 GiB | fits, 25.75 GiB to spare |
| `LLaMA3_1_70B` (`DCN_MESH_SHAPE=[1,2,1]`) | 16 | 16 x 8,192 | 89.14 GiB | no, 10.03 GiB short |
| `LLaMA3_1_70B` (`USE_LORA=true`, `DCN_MESH_SHAPE=[1,1,1]`) | 8 | 8 x 8,192 | 64.26 GiB | fits |
| `LLaMA3_2_1B` | 8 | 64 x 8,192 | 56.31 GiB | fits, 22.80 GiB to spare |
| `LLaMA3_2_3B` | 8 | 16 x 8,192 | 21.33 GiB | fits, 57.78 GiB to spare |

The CPU planner (`plan`'s default target: `python -m paxlite plan --fdl_config=LLaMA3_1_8B
--devices=8`, same day) compiles XLA's attention instead of cuDNN's and counts its float32
`[B, N, T, S]` logits (16 GiB for one layer): peak 74.42 GiB, "fits in 80.00 GiB: 5.58 GiB to
spare". Convert with `--fdl_config=NAME` (`python -m paxlite convert --from=hf --to=paxlite
--fdl_config=LLaMA3_1_8B ...`) so the checkpoint has the experiment's scanned layout.
"""
