"""Mistral 7B v0.3 (Hugging Face `mistralai/Mistral-7B-v0.3`) at its published size, set up for
fine-tuning on one node of 8 GPUs.

The shapes are those of the published config.json: LLaMA-2's architecture (llama.py's
`LLAMA_ARCHITECTURE`: RMSNorm eps 1e-5, SwiGLU, no biases, RoPE) with 32 query and 8 key/value
heads x 128, d_model 4096, ffn 14336, a 32,768-token vocabulary, RoPE base 1e6 without frequency
scaling, an untied output head, and no sliding window (`sliding_window: null`: v0.2 and v0.3
attend to the whole context; v0.1's 4,096-key window is --fdl.SLIDING_WINDOW=4096). Its parameter
count equals transformers' for the same config.json.

The weights come from a converted checkpoint (`python -m paxlite convert --from=hf --to=paxlite`,
then --fdl.CHECKPOINT_RESTORE_PATH=DIR). The fine-tuning defaults are llama3.py's, for the same
reasons: FSDP over the 8 GPUs, 2 sequences of 8,192 tokens per GPU (config.json allows 32,768;
RoPE has no table, so --fdl.MAX_SEQ_LEN changes no parameter), and fine_tuning.py's
`FineTuningRecipe` (peak rate 2e-5, 100 warm-up steps, cosine over MAX_STEPS=1000).
"""

from __future__ import annotations

from paxlite.experiments.architecture_settings import AttentionVariantSettings
from paxlite.experiments.fine_tuning import FineTuningRecipe
from paxlite.experiments.llama import BaseLLaMA
from paxlite.experiments.model_settings import RotarySettings


class Mistral7B(FineTuningRecipe, AttentionVariantSettings, RotarySettings, BaseLLaMA):
    """Mistral 7B v0.3: 32 layers, 32 query and 8 key/value heads x 128, d_model 4096, ffn 14336,
    vocabulary 32768; 7,248,023,552 parameters."""

    hf_ids = ("mistralai/Mistral-7B-v0.3", "mistralai/Mistral-7B-Instruct-v0.3")

    NUM_LAYERS = 32
    NUM_HEADS = 32
    NUM_KV_HEADS = 8
    MODEL_DIMS = 4096
    HIDDEN_DIMS = 14336
    VOCAB_SIZE = 32_768
    ROPE_THETA = 1e6
    SLIDING_WINDOW = None
    MAX_SEQ_LEN = 8192


MISTRAL_EXPERIMENTS = (Mistral7B,)
# Under the family's table in docs/experiments.md: what `plan` said of the defaults.
CATALOGUE_NOTE = """\
Planned 2026-12-05 as llama3.py's rows (`python -m paxlite plan --fdl_config=Mistral7B
--devices=8 --target=h100`, XLA's GPU compiler for H100, compile-only): 16 x 8,192 tokens per
step, peak 24.07 GiB per device, fits with 55.04 GiB to spare.
"""
