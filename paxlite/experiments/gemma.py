"""Google's Gemma 2 9B (Hugging Face `google/gemma-2-9b`, `google/gemma-2-9b-it`) at its published
size, set up for fine-tuning on one node of 8 GPUs.

The shape is the published config.json's: LLaMA's layout (grouped-query attention, a gated MLP,
RoPE base 10,000, no biases) with Gemma 2's differences, each a TransformerConfig option
(models/open_model_fields.py): RMSNorm times (1 + w), eps 1e-6, before and after both attention and
the MLP; GeGLU with tanh-approximate GELU; the embeddings multiplied by sqrt(3584) and tied to the
output head; the query scaled by query_pre_attn_scalar 256 ** -0.5; attention logits soft-capped
at 50 and the output logits at 30 (cap * tanh(x / cap)); the layers alternating a 4,096-token
sliding window and the whole context, the first sliding. Parameter count equal to transformers'
for the same config.json.

The weights come from a converted checkpoint (`python -m paxlite convert --from=hf --to=paxlite
--fdl_config=Gemma2_9B`, which writes the experiment's scanned stack: units of one sliding and one
global layer; then --fdl.CHECKPOINT_RESTORE_PATH=DIR). Fine-tuning defaults as llama3.py's
(fine_tuning.py: peak rate 2e-5, FSDP over the 8 GPUs, the scanned stack recomputed in the
backward pass), except where the soft-cap decides: JAX's GPU attention kernels (XLA's, cuDNN's
and Pallas-Triton's) have no logit soft-capping, so attention runs Pax's einsums
(ATTENTION_KIND 'dot_product'), which hold each layer's [heads, T, T] logits; sequences are
therefore 4,096 tokens (the sliding window; config.json allows 8,192), 2 per GPU.
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
from paxlite.models.activations import Activation
from paxlite.models.norms import NormKind
from paxlite.models.open_model_fields import LayerAttention
from paxlite.models.transformer import TransformerConfig


class GemmaSettings:
    """Gemma 2's differences from LLaMA (module docstring); listed before the family's base."""

    # Soft-caps: cap * tanh(x / cap) on the attention logits and on the output logits; None: off.
    ATTENTION_LOGIT_SOFTCAP: float | None = 50.0
    FINAL_LOGIT_SOFTCAP: float | None = 30.0
    # The query is scaled by QUERY_PRE_ATTN_SCALAR ** -0.5 (HF query_pre_attn_scalar).
    QUERY_PRE_ATTN_SCALAR: int = 256
    # Layer i attends over SLIDING_WINDOW positions when i is even, the whole context when odd.
    layer_period: ClassVar[int] = 2

    def layers_per_scan_unit(self) -> int:
        """A sliding and a global layer: what the model scans and a pipeline splits."""
        return max(super().layers_per_scan_unit(), self.layer_period)

    def hparam_problems(self) -> list[str]:
        problems = super().hparam_problems()
        if (self.ATTENTION_LOGIT_SOFTCAP is not None and self.ATTENTION_KIND == "flash"
                and self.ATTENTION_IMPLEMENTATION != "splash"):
            problems.append(
                f"ATTENTION_LOGIT_SOFTCAP={self.ATTENTION_LOGIT_SOFTCAP} with "
                f"ATTENTION_KIND='flash' and ATTENTION_IMPLEMENTATION="
                f"{self.ATTENTION_IMPLEMENTATION!r}: JAX's XLA, cuDNN and Pallas-Triton attention "
                "kernels have no logit soft-capping; use ATTENTION_KIND='dot_product', or "
                "ATTENTION_IMPLEMENTATION='splash' on a TPU")
        return problems

    def model_config(self) -> fdl.Config[TransformerConfig]:
        config = super().model_config()
        config.norm = NormKind.GEMMA_RMS_NORM
        config.activation = Activation.GELU_TANH
        config.post_norms = True
        config.scale_embeddings = True
        config.query_scale_dims = self.QUERY_PRE_ATTN_SCALAR
        config.attention_logit_cap = self.ATTENTION_LOGIT_SOFTCAP
        config.final_logit_cap = self.FINAL_LOGIT_SOFTCAP
        config.layer_types = tuple(
            LayerAttention.SLIDING if (i + 1) % self.layer_period else LayerAttention.FULL
            for i in range(self.NUM_LAYERS))
        return config


class Gemma2_9B(FineTuningRecipe, GemmaSettings, TiedEmbeddingSettings, AttentionVariantSettings,
                RotarySettings, BaseLLaMA):
    """Gemma 2 9B: 42 layers, 16 query and 8 key/value heads x 256, d_model 3584, ffn 14336,
    vocabulary 256000, tied; 9,241,705,984 parameters."""

    hf_ids = ("google/gemma-2-9b", "google/gemma-2-9b-it")

    NUM_LAYERS = 42
    NUM_HEADS = 16
    NUM_KV_HEADS = 8
    DIMS_PER_HEAD = 256
    MODEL_DIMS = 3584
    HIDDEN_DIMS = 14336
    VOCAB_SIZE = 256_000
    TIE_EMBEDDINGS = True
    LAYERNORM_EPSILON = 1e-6
    ROPE_THETA = 1e4
    SLIDING_WINDOW = 4096
    MAX_SEQ_LEN = 4096
    ATTENTION_KIND = "dot_product"


GEMMA_EXPERIMENTS = (Gemma2_9B,)
# Under the family's table in docs/experiments.md: what `plan` said of the defaults.
CATALOGUE_NOTE = """\
Planned 2026-12-05 as llama3.py's rows (`python -m paxlite plan --fdl_config=Gemma2_9B
--devices=8 --target=h100`, XLA's GPU compiler for H100, compile-only): 16 x 4,096 tokens per step
with einsum attention (one layer's float32 logits: 2.00 GiB), peak 48.27 GiB per device, fits with
30.84 GiB to spare.
"""
