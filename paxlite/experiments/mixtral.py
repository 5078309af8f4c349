"""Mixtral 8x7B (Hugging Face `MixtralForCausalLM`, `mistralai/Mixtral-8x7B-v0.1`): LLaMA's
architecture with every feed-forward block an MoE of 8 SwiGLU experts, 2 per token.

Built as the LLaMA experiments are (llama.py, `LLAMA_ARCHITECTURE`): RMSNorm (eps 1e-5), RoPE
(theta 1e6, Mixtral's), grouped-query attention (32 query, 8 key/value heads x 128), no biases, an
untied output head. Routing is dropless top-2 (softmax over the 8 experts, top 2, renormalised):
no capacity, nothing drops. The weights are meant to come from a converted HF checkpoint; like the
LLaMA experiments, MAX_STEPS is 0 until a fine-tune asks for steps, and
`--fdl.SYNTHETIC_DATA=true` runs it on synthetic tokens of its shapes.

MAX_SEQ_LEN is 4096, not HF's max_position_embeddings 32768: the length it is trained and
benchmarked at (MaxText's published Mixtral runs use 4096; the LLaMA-2 experiments too), so a
step fits and FLOPs per token compare. RoPE has no table, so `--fdl.MAX_SEQ_LEN=32768` changes no
parameter, only activations and the attention FLOPs.
"""

from __future__ import annotations

from typing import ClassVar

import fiddle as fdl

from paxlite.experiments.llama import BaseLLaMA
from paxlite.experiments.model_settings import RotarySettings
from paxlite.experiments.moe_settings import MoeSettings
from paxlite.models.activations import Activation
from paxlite.models.transformer import TransformerConfig


class BaseMixtral(RotarySettings, MoeSettings, BaseLLaMA):
    """Mixtral's architecture at any size; not registered (no size of its own)."""

    moe_layer_interval: ClassVar[int] = 1  # every layer
    gated_experts: ClassVar[bool] = True  # SwiGLU experts: HF w1 = wi_gate, w3 = wi, w2 = wo
    expert_activation: ClassVar[Activation] = Activation.SILU

    NUM_EXPERTS = 8
    NUM_EXPERTS_PER_TOKEN = 2
    MOE_ROUTING = "dropless_topk"
    # HF router_aux_loss_coef 0.02, averaged over layers there: 0.02 / L per layer, summed.
    LOAD_BALANCING_WEIGHT = 0.02  # and no router z-loss (MoeSettings' Z_LOSS_WEIGHT 0)
    ROPE_THETA = 1e6  # Mixtral's RoPE base (HF rope_theta)

    def model_config(self) -> fdl.Config[TransformerConfig]:
        config = super().model_config()
        config.moe = self.moe_config()
        return config


class Mixtral8x7B(BaseMixtral):
    """Mixtral 8x7B: 32 layers, d_model 4096, 8 experts of ffn 14336 (2 per token), vocabulary
    32000; 46,702,792,704 parameters, 12,879,925,248 active per token."""

    NUM_LAYERS = 32
    NUM_HEADS = 32
    NUM_KV_HEADS = 8
    MODEL_DIMS = 4096
    HIDDEN_DIMS = 14336
    PERCORE_BATCH_SIZE = 1
