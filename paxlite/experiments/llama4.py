"""Meta's Llama 4 Scout (Hugging Face `meta-llama/Llama-4-Scout-17B-16E`): its text model at the
published size, set up for fine-tuning.

The shape is the published config.json's ``text_config`` (transformers' ``Llama4TextConfig``):
LLaMA's layout (RMSNorm eps 1e-5, SwiGLU, grouped-query attention, no biases, an untied output
head) with Llama 4's differences, each a TransformerConfig option (models/chunked_attention.py,
models/moe_sigmoid_gating.py):

- Every 4th layer is NoPE: no rotary embedding, the whole context, and its query tempered by
  position (``1 + 0.1 * log1p(floor((p + 1) / 8192))``). The other three are chunked: RoPE
  (base 5e5, LLaMA-3's scaling with factor 16, low and high frequency factors both 1, original
  context 8,192), the keys of the query's own chunk of 8,192 positions only, and q and k
  RMS-normalised without weights after RoPE.
- Every layer's feed-forward block is a mixture of 16 SwiGLU experts of width 8,192, one per token:
  the sigmoid of the chosen expert's router logit scales the token before that expert, and a
  shared SwiGLU expert of the same width adds its output for every token. transformers' Llama 4
  adds no load-balancing loss, so neither does this experiment (LOAD_BALANCING_WEIGHT 0).

Parameter count equal to transformers' for the same text config (107,769,861,120). Attention runs
Pax's einsums (ATTENTION_KIND 'dot_product': cuDNN has no chunk pattern, so 'flash' runs XLA's
attention on a GPU; ATTENTION_IMPLEMENTATION='splash' runs the chunks in a fused kernel on a TPU);
the layers are scanned in units of 4 (three chunked layers and a NoPE one). The weights come from a
converted ``llama4_text`` checkpoint (`python -m paxlite convert --from=hf --to=paxlite`), then
--fdl.CHECKPOINT_RESTORE_PATH=DIR.
"""

from __future__ import annotations

from typing import ClassVar

import fiddle as fdl

from paxlite.experiments.architecture_settings import RopeScalingSettings, TiedEmbeddingSettings
from paxlite.experiments.fine_tuning import FineTuningRecipe
from paxlite.experiments.llama import BaseLLaMA
from paxlite.experiments.model_settings import RotarySettings
from paxlite.experiments.moe_settings import MoeSettings
from paxlite.models.activations import Activation
from paxlite.models.open_model_fields import LayerAttention
from paxlite.models.transformer import TransformerConfig


class Llama4Scout17B16E(MoeSettings, FineTuningRecipe, TiedEmbeddingSettings,
                        RopeScalingSettings, RotarySettings, BaseLLaMA):
    """Llama 4 Scout's text model: 48 layers (every 4th NoPE, the others chunked by 8,192), 40
    query and 8 key/value heads x 128, d_model 5120, on every layer 16 experts of ffn 8192, one per
    token, plus a shared expert; vocabulary 202,048; 107,769,861,120 parameters."""

    hf_ids = ("meta-llama/Llama-4-Scout-17B-16E", "meta-llama/Llama-4-Scout-17B-16E-Instruct")

    moe_layer_interval: ClassVar[int] = 1  # interleave_moe_layer_step 1: every layer sparse
    gated_experts: ClassVar[bool] = True
    expert_activation: ClassVar[Activation] = Activation.SILU
    no_rope_layer_interval: ClassVar[int] = 4  # layer i is NoPE when (i + 1) % 4 == 0

    NUM_LAYERS = 48
    NUM_HEADS = 40
    NUM_KV_HEADS = 8
    DIMS_PER_HEAD = 128
    MODEL_DIMS = 5120
    HIDDEN_DIMS = 16384  # intermediate_size_mlp: a dense layer's, which Scout has none of
    VOCAB_SIZE = 202_048
    LAYERNORM_EPSILON = 1e-5
    ROPE_THETA = 5e5
    ROPE_SCALING = "llama3"
    ROPE_SCALING_FACTOR = 16.0
    ROPE_SCALING_LOW_FREQ_FACTOR = 1.0
    ROPE_SCALING_HIGH_FREQ_FACTOR = 1.0
    ROPE_SCALING_ORIGINAL_MAX_POSITION = 8192
    MAX_SEQ_LEN = 8192
    ATTENTION_KIND = "dot_product"
    NUM_EXPERTS = 16
    NUM_EXPERTS_PER_TOKEN = 1
    EXPERT_HIDDEN_DIMS = 8192
    MOE_ROUTING = "sigmoid_topk"
    LOAD_BALANCING_WEIGHT = 0.0
    PERCORE_BATCH_SIZE = 1
    # Llama 4's attention (module docstring)
    ATTENTION_CHUNK_SIZE: int = 8192
    ATTN_FLOOR_SCALE: int = 8192
    ATTN_SCALE: float = 0.1

    def layers_per_scan_unit(self) -> int:
        """Three chunked layers and a NoPE one: what the model scans and a pipeline splits."""
        return max(super().layers_per_scan_unit(), self.no_rope_layer_interval)

    def model_config(self) -> fdl.Config[TransformerConfig]:
        config = super().model_config()
        moe = self.moe_config()
        moe.renormalize_top_k = False  # sigmoid gates
        moe.shared_expert_hidden_dims = self.EXPERT_HIDDEN_DIMS
        config.moe = moe
        config.layer_types = tuple(
            LayerAttention.CHUNKED if (i + 1) % self.no_rope_layer_interval
            else LayerAttention.FULL_NO_ROPE for i in range(self.NUM_LAYERS))
        config.attention_chunk_size = self.ATTENTION_CHUNK_SIZE
        config.qk_l2_norm = True
        config.query_temperature_floor = self.ATTN_FLOOR_SCALE
        config.query_temperature_scale = self.ATTN_SCALE
        return config


LLAMA4_EXPERIMENTS = (Llama4Scout17B16E,)

# Under the family's table in docs/experiments.md.
CATALOGUE_NOTE = """\
Planned with XLA's GPU compiler (`python -m paxlite plan --fdl_config=Llama4Scout17B16E
--devices=N --target=h100|h200 [--fdl.X=Y ...]`, compile-only on a 2-core CPU host, 2026-12-07;
peaks per device, against 79.11 GiB for an H100 and 141.00 GiB for an H200). On its 8 devices,
at the defaults: 340.49 GiB on H100s, 261.38 GiB short (the CPU compiler's plan said 331.50). Its
train state alone (107.8 billion parameters x 16 bytes: float32 weights, gradients and both Adam
moments; 1,606 GiB) is 200.8 GiB a device on 8, more than an H200 holds too (8 H200s not
compiled). More nodes (fsdp across them, `--fdl.DCN_MESH_SHAPE=[1,NODES,1]`) shrink mostly the
state: with one 8,192-token row a device the temporaries besides the gradients stay over 100 GiB
(32 H100s with `--fdl.ADAM_MU_DTYPE=bfloat16`: 150.82 GiB, 71.71 short). Four settings shrink them:
`MOE_GROUPED_MATMUL=tiled` (the default ragged_dot, which XLA:GPU expands to every row for every
expert), `LOSS_CHUNK_SIZE=1024`, `MAX_SEQ_LEN=4096` (the einsum attention's float32 logits are
10 GiB a layer at 8,192, 2.5 at 4,096) and `ADAM_MU_DTYPE=bfloat16` (2 bytes a parameter less);
below, "the four" are all of them, "the three" all but MAX_SEQ_LEN:

- H100s: 64 (8 nodes) with the four and fsdp 2 x expert 4 within each node
  (`--fdl.ICI_MESH_SHAPE=[1,2,1,4] --fdl.DCN_MESH_SHAPE=[1,8,1]`): 77.80 GiB, fits with 1.31 GiB
  to spare. 32 (`--fdl.DCN_MESH_SHAPE=[1,4,1]`, fsdp 32) with the four: 123.98 GiB, 44.87 short.
- H200s: 32 (4 nodes, `--fdl.DCN_MESH_SHAPE=[1,4,1]`, fsdp 32) with the four: 120.34 GiB, fits
  with 20.66 GiB to spare. At the full 8,192 tokens with the three: 147.88 GiB, 6.88 short (with
  expert 4, `--fdl.ICI_MESH_SHAPE=[1,2,1,4]`: 162.41 GiB, 21.41 short).

LoRA (`--fdl.USE_LORA=true --fdl.LORA_TARGET_LAYERS=attention`, which keeps only the frozen
weights' 4 bytes a parameter) was not planned.
"""
