"""DeepSeek-V3 and DeepSeek-V2-Lite (Hugging Face `deepseek-ai/DeepSeek-V3`,
`deepseek-ai/DeepSeek-V2-Lite`) at their published sizes, set up for fine-tuning.

The shapes are those of each model's published config.json as transformers 5.24 builds it (no
multi-token-prediction layer: transformers has none): LLaMA's block (RMSNorm eps 1e-6, SwiGLU,
untied head) with multi-head latent attention (models/mla_attention.py) and, from layer
``first_k_dense_replace`` on, MoE layers with a shared expert (models/moe_config.py) routed as
models/moe_router_deepseek.py says; RoPE base 1e4 with YaRN (factor 40 over 4,096 positions, the
softmax scaled by mscale_all_dim's mscale squared). The weights come from a converted checkpoint
(`python -m paxlite convert --from=hf --to=paxlite`, then --fdl.CHECKPOINT_RESTORE_PATH=DIR).

V3's router keeps a per-expert choice bias (``e_score_correction_bias``) in the parameter tree,
where a converted checkpoint carries it, but the train step never trains it (it moves only by
MOE_BIAS_UPDATE_SPEED's rule); transformers keeps it as a buffer, and `list` and `show` count the
parameters as transformers does, without its 58 x 256 = 14,848 entries.
"""

from __future__ import annotations

from typing import Any, ClassVar

import fiddle as fdl

from paxlite.experiments.fine_tuning import FineTuningRecipe
from paxlite.experiments.llama import BaseLLaMA
from paxlite.experiments.model_settings import RotarySettings
from paxlite.experiments.moe_settings import MoeSettings
from paxlite.models.activations import Activation
from paxlite.models.mla_attention import MlaConfig, softmax_scale
from paxlite.models.moe_router_deepseek import DeepseekRouter
from paxlite.models.rotary import RopeScaling
from paxlite.models.transformer import TransformerConfig


def _yarn_scale(*, qk_head_dims: int, factor: float, mscale_all_dim: float) -> float:
    return softmax_scale(qk_head_dims=qk_head_dims, scaling=RopeScaling(
        kind="yarn", factor=factor, original_max_position_embeddings=4096,
        mscale_all_dim=mscale_all_dim))


class BaseDeepSeek(FineTuningRecipe, RotarySettings, MoeSettings, BaseLLaMA):
    """DeepSeek's shared architecture; not registered. The MoE sizes are MoeSettings' (NUM_EXPERTS
    = n_routed_experts, NUM_EXPERTS_PER_TOKEN, EXPERT_HIDDEN_DIMS = moe_intermediate_size); the
    class attributes below are the published config.json's fields that paxlite's settings do not
    name."""

    family_adds_bos = True
    gated_experts = True
    expert_activation = Activation.SILU
    first_moe_layer: ClassVar[int] = 1  # first_k_dense_replace

    q_lora_rank: ClassVar[int | None] = None
    kv_lora_rank: ClassVar[int] = 512
    qk_nope_head_dim: ClassVar[int] = 128
    qk_rope_head_dim: ClassVar[int] = 64
    v_head_dim: ClassVar[int] = 128
    n_shared_experts: ClassVar[int] = 2
    score: ClassVar[str] = "softmax"
    topk_method: ClassVar[str] = "greedy"
    n_group: ClassVar[int] = 1
    topk_group: ClassVar[int] = 1
    routed_scaling: ClassVar[float] = 1.0
    norm_topk_prob: ClassVar[bool] = False
    yarn_mscale: ClassVar[float] = 0.707

    LAYERNORM_EPSILON = 1e-6
    ROPE_THETA = 1e4
    MAX_SEQ_LEN = 4096
    NUM_EXPERTS = 64
    NUM_EXPERTS_PER_TOKEN = 6
    EXPERT_HIDDEN_DIMS = 1408
    MOE_ROUTING = "dropless_topk"
    MOE_GROUPED_MATMUL = "tiled"
    LOAD_BALANCING_WEIGHT = 0.0  # transformers' DeepSeek adds no auxiliary loss
    DIMS_PER_HEAD = 192  # qk_nope_head_dim + qk_rope_head_dim
    PERCORE_BATCH_SIZE = 1
    USE_REPEATED_LAYER = False  # dense first layers: no period to scan (moe_config.py)

    def model_config(self) -> fdl.Config[TransformerConfig]:
        config = super().model_config()
        qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
        config.rope_scaling = RopeScaling(
            kind="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
            beta_slow=1.0, mscale=self.yarn_mscale, mscale_all_dim=self.yarn_mscale)
        config.mla = MlaConfig(
            kv_lora_rank=self.kv_lora_rank, qk_nope_head_dims=self.qk_nope_head_dim,
            qk_rope_head_dims=self.qk_rope_head_dim, v_head_dims=self.v_head_dim,
            q_lora_rank=self.q_lora_rank, softmax_scale=_yarn_scale(
                qk_head_dims=qk_head, factor=40.0, mscale_all_dim=self.yarn_mscale))
        config.moe = self.moe_config()
        return config

    def moe_fields(self) -> dict[str, Any]:
        return {
            **super().moe_fields(),
            "renormalize_top_k": self.norm_topk_prob,
            "shared_expert_hidden_dims": self.n_shared_experts * self.EXPERT_HIDDEN_DIMS,
            "first_moe_layer": self.first_moe_layer,
            "deepseek_router": DeepseekRouter(
                score=self.score, choice=self.topk_method, num_groups=self.n_group,
                top_groups=self.topk_group, routed_scaling=self.routed_scaling,
                bias_update_speed=self.MOE_BIAS_UPDATE_SPEED),
        }


class DeepSeekV2Lite(BaseDeepSeek):
    """DeepSeek-V2-Lite: 27 layers (the first dense, ffn 10944), 16 heads, d_model 2048, MLA
    (kv rank 512, one query projection), 64 routed experts of ffn 1408 (top-6, softmax) and 2
    shared; 15,706,484,224 parameters."""

    hf_ids = ("deepseek-ai/DeepSeek-V2-Lite",)

    VOCAB_SIZE = 102_400
    NUM_LAYERS = 27
    NUM_HEADS = 16
    MODEL_DIMS = 2048
    HIDDEN_DIMS = 10944


class DeepSeekV3(BaseDeepSeek):
    """DeepSeek-V3: 61 layers (the first 3 dense, ffn 18432), 128 heads, d_model 7168, MLA (q rank
    1536, kv rank 512), 256 routed experts of ffn 2048 (top-8 of 4 of 8 groups, sigmoid with a
    choice bias, x2.5) and 1 shared; 671,026,404,352 parameters as transformers counts them."""

    hf_ids = ("deepseek-ai/DeepSeek-V3",)

    q_lora_rank: ClassVar[int | None] = 1536
    n_shared_experts: ClassVar[int] = 1
    first_moe_layer: ClassVar[int] = 3
    score: ClassVar[str] = "sigmoid"
    topk_method: ClassVar[str] = "noaux_tc"
    router_choice_bias = True  # e_score_correction_bias: MOE_BIAS_UPDATE_SPEED moves it
    n_group: ClassVar[int] = 8
    topk_group: ClassVar[int] = 4
    routed_scaling: ClassVar[float] = 2.5
    norm_topk_prob: ClassVar[bool] = True
    yarn_mscale: ClassVar[float] = 1.0

    VOCAB_SIZE = 129_280
    NUM_LAYERS = 61
    NUM_HEADS = 128
    MODEL_DIMS = 7168
    HIDDEN_DIMS = 18432
    NUM_EXPERTS = 256
    NUM_EXPERTS_PER_TOKEN = 8
    EXPERT_HIDDEN_DIMS = 2048


DEEPSEEK_EXPERIMENTS = (DeepSeekV2Lite, DeepSeekV3)
# Under the family's table in docs/experiments.md.
CATALOGUE_NOTE = """\
The parameters are counted as transformers counts them: `DeepSeekV3`'s 58 MoE layers' router
choice biases (58 x 256 = 14,848, `moe/score_correction_bias`, never trained by the optimizer) are
state, as transformers' buffers are, and not among them. Dense first layers
(`first_k_dense_replace`) leave the stack no period to scan, so both run unrolled
(`USE_REPEATED_LAYER=False`) and without a pipeline; `--fdl.CHECKPOINT_POLICY=SAVE_NOTHING`, given
explicitly, recomputes each unrolled layer in the backward pass.

Planned with XLA's GPU compiler (`python -m paxlite plan --fdl_config=NAME --devices=N
--target=h100|h200 [--fdl.X=Y ...]`, compile-only on a 2-core CPU host, 2026-12-07; XLA's
attention, since JAX compiles cuDNN's only up to 128 per head without a GPU; peaks per device,
against 79.11 GiB for an H100 and 141.00 GiB for an H200):

- `DeepSeekV2Lite` on its 8 devices. H100s: at the defaults, which keep every activation of the
  unrolled layers, 139.11 GiB, 60.00 GiB short; with `--fdl.CHECKPOINT_POLICY=SAVE_NOTHING`
  34.13 GiB, fits with 44.98 GiB to spare. H200s: 110.18 GiB at the defaults, fits with 30.82 GiB
  to spare (the same step: XLA's GPU compiler schedules it differently for the two memories).
- `DeepSeekV3`: its train state alone (671.0 billion parameters x 16 bytes: float32 weights,
  gradients and both Adam moments) is 9,999 GiB, 1,250 GiB a device on its 8 devices (not
  compiled): at least 127 H100s or 71 H200s before any activation (arithmetic). One plan was
  tried, 256 H100s (32 nodes: `--fdl.ICI_MESH_SHAPE=[1,1,1,8] --fdl.DCN_MESH_SHAPE=[1,32,1]`,
  expert 8 within each node, fsdp 32 across nodes) with `--fdl.CHECKPOINT_POLICY=SAVE_NOTHING
  --fdl.ADAM_MU_DTYPE=bfloat16`, and it did not finish in 25 minutes: the step was lowered and
  partitioned in 2, then XLA's GPU compiler ran for the rest, the last 9 minutes or more in its
  rematerialization pass (which runs only when a program is over the device's memory). So there
  is no V3 plan, only arithmetic: that run's state is 40.3 GiB a device before any activation (14
  bytes a parameter; the 653.9 billion expert parameters over all 256 devices, the other 17.1
  billion over fsdp 32).
"""
