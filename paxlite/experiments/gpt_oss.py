"""OpenAI's gpt-oss (Hugging Face `openai/gpt-oss-20b`, `openai/gpt-oss-120b`) at its published
sizes, set up for fine-tuning.

The shapes are the published config.json's (transformers' GptOssConfig counts 20,914,757,184 and
116,829,156,672 parameters for them): d_model 2880, 64 query and 8 key/value heads x 64, RMSNorm
eps 1e-5, untied embeddings over a 201,088-token vocabulary, and gpt-oss's differences from LLaMA,
each a TransformerConfig option (interop/hf_gpt_oss.py lists them): biases on q, k, v and the
output projection, a learned sink logit per head in every softmax, layers alternating a 128-token
sliding window and the whole context (the first sliding), YaRN RoPE (base 150,000, factor 32 from
an original 4,096 positions, beta_fast 32, beta_slow 1, not truncated), and on every layer a
dropless top-4 mixture of experts (32 for the 20b, 128 for the 120b) of hidden size 2880 whose
router and experts carry biases and whose experts compute the clamped SwiGLU (limit 7.0, alpha
1.702). The published weights store the experts in MXFP4, which `convert` dequantises.

The weights come from a converted checkpoint (`python -m paxlite convert --from=hf --to=paxlite`,
then --fdl.CHECKPOINT_RESTORE_PATH=DIR). cuDNN has no sink logit, so attention runs Pax's einsums
(ATTENTION_KIND 'dot_product'; 'flash' runs XLA's attention, or splash on a TPU); the stack is
scanned by units of a sliding and a full layer. The load-balancing loss is HF's
router_aux_loss_coef 0.001 times top-k 4, spread over the layers as interop/hf_moe.py maps it. The
memory defaults follow Qwen3-30B-A3B's (qwen.py): Adam's first moment in bfloat16, the loss in
blocks of 1,024 positions, the tiled grouped matmul (the catalogue note has what `plan` said).
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
from paxlite.models.open_model_fields import LayerAttention
from paxlite.models.rotary import RopeScaling, RopeScalingKind
from paxlite.models.transformer import TransformerConfig

# config.json's rope_scaling (both published sizes)
GPT_OSS_ROPE = RopeScaling(kind=RopeScalingKind.YARN, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                           original_max_position_embeddings=4096, truncate=False)


class BaseGptOss(FineTuningRecipe, MoeSettings, TiedEmbeddingSettings, AttentionVariantSettings,
                 RotarySettings, BaseLLaMA):
    """gpt-oss's shared architecture and fine-tuning defaults (module docstring); not
    registered."""

    family_adds_bos = False  # text starts without <|startoftext|>, as its tokenizer encodes it

    moe_layer_interval: ClassVar[int] = 1
    gated_experts: ClassVar[bool] = True  # gate_up_proj's even columns wi_gate, odd ones wi
    expert_activation: ClassVar[Activation] = Activation.SILU
    swiglu_limit: ClassVar[float] = 7.0
    swiglu_alpha: ClassVar[float] = 1.702
    rope_scaling: ClassVar[RopeScaling] = GPT_OSS_ROPE

    NUM_HEADS = 64
    NUM_KV_HEADS = 8
    DIMS_PER_HEAD = 64
    MODEL_DIMS = 2880
    HIDDEN_DIMS = 2880  # config.json's intermediate_size: each expert's
    VOCAB_SIZE = 201_088
    LAYERNORM_EPSILON = 1e-5
    ROPE_THETA = 150_000.0
    QKV_BIAS = True
    SLIDING_WINDOW = 128
    NUM_EXPERTS_PER_TOKEN = 4
    MOE_ROUTING = "dropless_topk"
    LOAD_BALANCING_WEIGHT = 0.004
    ATTENTION_KIND = "dot_product"
    USE_REPEATED_LAYER = True
    MAX_SEQ_LEN = 4096
    PERCORE_BATCH_SIZE = 1
    # memory (the catalogue note): Adam's first moment in bfloat16, the loss over blocks of 1,024
    # positions, the grouped matmul over row tiles (ragged_dot's dense expansion: 98 GiB planned)
    ADAM_MU_DTYPE = "bfloat16"
    LOSS_CHUNK_SIZE = 1024
    MOE_GROUPED_MATMUL = "tiled"

    def layers_per_scan_unit(self) -> int:
        """A sliding and a full layer, both MoE: what the model scans and a pipeline splits."""
        return max(super().layers_per_scan_unit(), 2)

    def model_config(self) -> fdl.Config[TransformerConfig]:
        config = super().model_config()
        moe = self.moe_config()
        moe.use_bias = True
        moe.swiglu_limit = self.swiglu_limit
        moe.swiglu_alpha = self.swiglu_alpha
        config.moe = moe
        config.out_bias = True
        config.attention_sinks = True
        config.rope_scaling = self.rope_scaling
        config.layer_types = tuple(LayerAttention.SLIDING if (i + 1) % 2 else LayerAttention.FULL
                                   for i in range(self.NUM_LAYERS))
        return config


class GptOss20B(BaseGptOss):
    """gpt-oss-20b: 24 layers of 32 experts, 4 per token; 20,914,757,184 parameters."""

    hf_ids = ("openai/gpt-oss-20b",)

    NUM_LAYERS = 24
    NUM_EXPERTS = 32


class GptOss120B(BaseGptOss):
    """gpt-oss-120b: 36 layers of 128 experts, 4 per token; 116,829,156,672 parameters."""

    hf_ids = ("openai/gpt-oss-120b",)

    NUM_LAYERS = 36
    NUM_EXPERTS = 128


GPT_OSS_EXPERIMENTS = (GptOss20B, GptOss120B)
# Under the family's table in docs/experiments.md: what `plan` said of the defaults.
CATALOGUE_NOTE = """\
Planned 2026-12-07 with the CPU compiler (`python -m paxlite plan --fdl_config=GptOss20B
--devices=8`: 8 fake CPU devices of 80 GiB, compile-only; GPU temporaries differ): 8 x 4,096 tokens
per step, einsum attention (one layer's float32 logits: 4.00 GiB), peak 65.58 GiB per device, fits
with 14.42 GiB to spare. With `MOE_GROUPED_MATMUL=ragged_dot` and float32 Adam moments the same
plan peaked at 99.87 GiB (19.87 GiB short); with only the first two memory settings, 97.95 GiB.

With XLA's GPU compiler (`python -m paxlite plan --fdl_config=NAME --devices=N
--target=h100|h200 [--fdl.X=Y ...]`, compile-only on a 2-core CPU host, 2026-12-07; peaks per
device, against 79.11 GiB for an H100 and 141.00 GiB for an H200):

- `GptOss20B` on its 8 devices fits both: 65.10 GiB on H100s (14.01 GiB to spare), 70.49 GiB on
  H200s (70.51 to spare).
- `GptOss120B` on its 8 devices: 299.00 GiB on H100s, 219.89 GiB short. Its train state (116.8
  billion parameters x 14 bytes: float32 weights and gradients, bfloat16 first and float32 second
  Adam moments; 1,523 GiB) is 190.4 GiB a device on 8, more than an H200 holds too (8 H200s not
  compiled). It needs more nodes: fsdp across them (`--fdl.DCN_MESH_SHAPE=[1,NODES,1]`) and,
  within each node, fsdp 2 x expert 4 (`--fdl.ICI_MESH_SHAPE=[1,2,1,4]`, so that a device gathers
  32 experts of a layer, not all 128):
  - 48 H100s (6 nodes, `--fdl.DCN_MESH_SHAPE=[1,6,1]`): 76.33 GiB, fits with 2.78 GiB to spare.
    32 H100s (`[1,4,1]`): 95.03 GiB, 15.92 short (experts over 8 instead, `[1,1,1,8]`: 99.26;
    with `--fdl.MAX_SEQ_LEN=2048` as well: 83.15 GiB, still 4.04 short).
  - 32 H200s (4 nodes, `[1,4,1]`): 100.11 GiB, fits with 40.89 GiB to spare. 16 H200s
    (`[1,2,1]`): 162.15 GiB, 21.15 short. 24 H200s (`[1,3,1]`) did not compile: XLA's SPMD
    partitioner aborts (`Check failed: sliced.has_value() Could not slice dimension 0 with size
    4`, in its gather partitioning; the same with the experts over 8), so a 3-node fsdp axis is
    not planned.

  More devices shrink the state, not the temporaries: besides the gradients these were 43 to 62
  GiB a device in every plan above (one 4,096-token row per device; about 21 GiB whatever the
  sequence plus about 12 GiB per 2,048 tokens), 108.28 GiB at the default mesh on 8 H100s. 40
  H100s (5 nodes) were not planned: by the same arithmetic their state (about 40 GiB) leaves too
  little room.
"""
