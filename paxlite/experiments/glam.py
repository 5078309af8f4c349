"""GLaM mixture-of-experts experiments with the settings of Pax's GPU configs (`GLaM126M64EBase`,
`GLaM64B64EBase` and their Pile / Lambada variants).

Pax builds them from its GPT configs and swaps the language model for Praxis
`glam.GlamUniTransformerLmHParams`: RMSNorm everywhere, T5 relative position bias (32 buckets,
max distance 128) instead of absolute positions, the embedding tied with the softmax, no biases,
a gated-GELU dense feed-forward block (Praxis `GELU`, `approximate=True`: the tanh form), and on
every other layer from layer 0 an MoE block of E plain ReLU experts (`wi [E, D, F]`,
`wo [E, F, D]`) with GShard top-2 routing and capacity factor 2.0. The load-balancing loss weight
per layer is 0.01 / (NUM_LAYERS / 2).

Pax never registered these classes (only a dotted --fdl_config reached them); paxlite registers
them, under Pax's class names as well (`GLaM126M64EBase`, `paxml...configs.PileGLaM126M64E`).
docs/moe_experiments.md lists where Pax's README and its configs disagree.
"""

from __future__ import annotations

from typing import ClassVar

import fiddle as fdl

from paxlite.experiments.gpt import GPT126M, SyntheticTokens
from paxlite.experiments.moe_settings import MoeSettings
from paxlite.models.activations import Activation
from paxlite.models.transformer import NormKind, PositionEmbedding, TransformerConfig


class GLaM126M64E(MoeSettings, GPT126M):
    """Pax GLaM126M64EBase: GPT126M's sizes (12 layers, 12 heads x 64, d_model 768, ffn 3072) with
    64 experts on the 6 even layers; 1,921,670,400 parameters, 166,354,176 active per token.

    Pax trains it on 64 GPUs as FSDP 64 (ICI [1,64,1]); its README's table says 8 sequences per GPU,
    the config 4 (kept here)."""

    moe_layer_interval: ClassVar[int] = 2
    gated_experts: ClassVar[bool] = False
    expert_activation: ClassVar[Activation] = Activation.RELU

    NUM_EXPERTS = 64
    MOE_ROUTING = "gshard_top2"
    # CAPACITY_FACTOR 2.0, LOAD_BALANCING_WEIGHT 0.01 and no Z_LOSS_WEIGHT: MoeSettings' defaults
    # are GLaM's. GPT126M's 4 sequences per GPU and unrolled layers stay.
    ICI_MESH_SHAPE = [1, 64, 1]
    DCN_MESH_SHAPE = [1, 1, 1]
    # Praxis RmsNorm's default: Pax sets LAYERNORM_EPSILON on the GPT layers, which GLaM's
    # language model replaces.
    LAYERNORM_EPSILON = 1e-6

    def model_config(self) -> fdl.Config[TransformerConfig]:
        return fdl.Config(
            TransformerConfig,
            **self.transformer_fields(),
            norm=NormKind.RMS_NORM,
            activation=Activation.GELU_TANH,
            gated_mlp=True,
            use_bias=False,
            tie_embeddings=True,
            learned_position_embedding=False,
            position_embedding=PositionEmbedding.RELATIVE_BIAS,
            relative_position_buckets=32,
            relative_position_max_distance=128,
            scale_query=False,  # Praxis GLaM: internal_enable_query_scale=False
            moe=self.moe_config(),
        )


class GLaM64B64E(GLaM126M64E):
    """Pax GLaM64B64EBase: 64 layers, 64 heads x 128, d_model 8192, ffn 32768, 64 experts on the 32
    even layers; 1,142,891,356,160 parameters ("1.14T"), 77,739,466,752 active per token. Pax runs
    it on 512 GPUs, FSDP 64 x tensor 8 (ICI [1,1,8], DCN [1,64,1]).

    Pax sets ADAM_BETA1 = 0, which its optimizer's `X if X else default` turns into 0.9: 0.9 is what
    Pax trains with, so it is 0.9 here. Its README says sequence length 2048; the config 1024
    (kept).
    """

    NUM_LAYERS = 64
    NUM_HEADS = 64
    DIMS_PER_HEAD = 128
    MODEL_DIMS = 8192
    HIDDEN_DIMS = 32768
    MAX_SEQ_LEN = 1024
    ICI_MESH_SHAPE = [1, 1, 8]
    DCN_MESH_SHAPE = [1, 64, 1]
    USE_REPEATED_LAYER = True
    # GPT-3's optimizer (GPT3Optimizer: ADAM_BETA1 0.9, gradients clipped to norm 1, cosine decay)
    # with a larger beta2.
    ADAM_BETA2 = 0.99
    LEARNING_RATE = 2e-5
    LR_COS_WARMUP = 398  # Pax: "steps for BS 1k"
    LR_COS_DECAY_END = 162900
    CHECKPOINT_EVERY_N_STEPS = 100
    CHECKPOINT_MAX_TO_KEEP = 2
    SUMMARY_INTERVAL_STEPS = 10


class PileGLaM126M64E(GLaM126M64E):
    """GLaM126M64E on The Pile (Pax PileGLaM126M64E)."""


class PileGLaM64B64E(GLaM64B64E):
    """GLaM64B64E on The Pile (Pax PileGLaM64B64E)."""


class LambadaGLaM126M64E(GLaM126M64E):
    """Zero-shot Lambada of GLaM126M64E (Pax LambadaGLaM126M64E; README: 46.15% acc_strict at
    fixed compute, 49.21% at fixed steps)."""

    EVAL_TASK = "lambada"
    EVAL_LOOP_NUM_BATCHES = -1


class LambadaGLaM64B64E(GLaM64B64E):
    """Zero-shot Lambada of GLaM64B64E (Pax LambadaGLaM64B64E)."""

    EVAL_TASK = "lambada"
    EVAL_LOOP_NUM_BATCHES = -1


class SyntheticGLaM126M64E(SyntheticTokens, GLaM126M64E):
    """GLaM126M64E on synthetic tokens, 100 steps (paxlite's; Pax has no synthetic GLaM)."""


class SyntheticGLaM64B64E(SyntheticTokens, GLaM64B64E):
    """GLaM64B64E on synthetic tokens, 100 steps (paxlite's; Pax has no synthetic GLaM)."""


GLAM_EXPERIMENTS = (
    GLaM126M64E, GLaM64B64E, PileGLaM126M64E, PileGLaM64B64E, LambadaGLaM126M64E,
    LambadaGLaM64B64E, SyntheticGLaM126M64E, SyntheticGLaM64B64E,
)
# Pax's class names for the bases, so `paxml.contrib.gpu.scripts_gpu.configs.GLaM126M64EBase`
# (the dotted path Pax users ran) resolves too.
PAX_NAMES = {"GLaM126M64EBase": "GLaM126M64E", "GLaM64B64EBase": "GLaM64B64E"}
