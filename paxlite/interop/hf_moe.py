"""The mixture-of-experts side of Hugging Face conversion: Mixtral and Qwen3-MoE.

Both are LLaMA's layout (hf_config.py reads and writes their attention and dense parts) with some
feed-forward blocks replaced by paxlite's dropless top-k MoE of SwiGLU experts
(models/moe_config.py). What differs, and lives here:

- Routing. Softmax over all experts in float32, top-k; Mixtral always divides the k weights by
  their sum, Qwen3-MoE only with ``norm_topk_prob`` (``MoeConfig.renormalize_top_k``).
- Which layers are sparse. Mixtral: all. Qwen3-MoE: layer i unless it is in ``mlp_only_layers``
  or ``(i + 1) % decoder_sparse_step != 0``; paxlite's MoE layers are every n-th from layer 0
  (``moe_layer_interval``), so a Qwen3-MoE converts when its sparse layers are exactly those, and
  is refused in one line otherwise. Its dense layers use ``intermediate_size``, its experts
  ``moe_intermediate_size`` (``expert_hidden_dims``).
- The load-balancing loss (`aux_loss_weight`), the same formula in both families.
- The tensor names (`ExpertNaming`, read and written by layouts.py).

This module imports nothing of hf_config.py (which dispatches here), so that the two stay acyclic.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from paxlite.interop.errors import UnsupportedCheckpointError, refuse_if
from paxlite.models.activations import Activation
from paxlite.models.moe_config import MoeConfig, MoeRouting
from paxlite.models.transformer_config import TransformerConfig

# MixtralConfig's and Qwen3MoeConfig's router_aux_loss_coef when config.json has none.
DEFAULT_AUX_LOSS_COEF: float = 0.001
# Qwen3MoeConfig's norm_topk_prob when config.json has none (its published models say true).
QWEN3_MOE_DEFAULT_NORM_TOPK_PROB: bool = False


# ---------------------------------------------------------------- tensor names
@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertNaming:
    """One family's on-disk names of a sparse layer's router and experts (torch Linear weights,
    [out, in]), and the config.json fields that give their sizes (for errors)."""

    what: str
    router: str  # [E, D]; format(i=layer)
    expert: str  # format(i=layer, e=expert, w=one of gate, up, down)
    gate: str
    up: str
    down: str
    experts_field: str
    hidden_field: str


# transformers 5.x's in-memory names, the experts fused per layer (a state_dict saved raw); both
# families convert them back to their per-expert names on save_pretrained.
FUSED_ROUTER = "model.layers.{i}.mlp.gate.weight"  # [E, D]
FUSED_GATE_UP = "model.layers.{i}.mlp.experts.gate_up_proj"  # [E, 2F, D]: gate rows | up rows
FUSED_DOWN = "model.layers.{i}.mlp.experts.down_proj"  # [E, D, F]

# What the Hub's checkpoints hold and transformers (4.x and 5.x) writes.
MIXTRAL_EXPERTS = ExpertNaming(
    what="Hugging Face Mixtral checkpoint",
    router="model.layers.{i}.block_sparse_moe.gate.weight",
    expert="model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight",
    gate="w1", up="w3", down="w2",
    experts_field="num_local_experts", hidden_field="intermediate_size",
)
QWEN3_MOE_EXPERTS = ExpertNaming(
    what="Hugging Face Qwen3-MoE checkpoint",
    router="model.layers.{i}.mlp.gate.weight",
    expert="model.layers.{i}.mlp.experts.{e}.{w}.weight",
    gate="gate_proj", up="up_proj", down="down_proj",
    experts_field="num_experts", hidden_field="moe_intermediate_size",
)


def expert_naming(config: TransformerConfig) -> ExpertNaming:
    """The names of an MoE model's experts by hf_config.family_of_config's rule: Qwen3-MoE's
    attention normalises q and k, Mixtral's never does."""
    return QWEN3_MOE_EXPERTS if config.qk_norm else MIXTRAL_EXPERTS


# ---------------------------------------------------------------- the load-balancing loss
def aux_loss_weight(hf: Mapping[str, Any], *, experts_per_token: int, moe_layers: int) -> float:
    """paxlite's per-layer ``load_balancing_weight`` for HF's ``router_aux_loss_coef``.

    HF adds ``coef * E * sum_e(density_e * proxy_e)`` once, over the tokens of its M sparse layers
    pooled, and only with ``output_router_logits``; paxlite adds
    ``weight * (E / K) * sum_e(...)`` per MoE layer. ``weight = coef * K / M`` gives the same loss
    when the layers are equally balanced.
    """
    if not hf.get("output_router_logits", False):
        return 0.0
    coef = hf.get("router_aux_loss_coef", DEFAULT_AUX_LOSS_COEF)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
        raise UnsupportedCheckpointError(
            f"config.json router_aux_loss_coef={coef!r} must be a number >= 0")
    return float(coef) * experts_per_token / moe_layers


def aux_loss_coef(config: TransformerConfig, *, read: float | None) -> float:
    """Inverse of `aux_loss_weight` for writing; without a weight, the coefficient ``read`` from
    HF (or HF's default) is written back, inactive (``output_router_logits: false``)."""
    moe = config.moe
    assert moe is not None
    if not moe.load_balancing_weight:
        return DEFAULT_AUX_LOSS_COEF if read is None else float(read)
    coef = moe.load_balancing_weight * moe.num_moe_layers(config.num_layers) / moe.experts_per_token
    if read is not None and math.isclose(coef, read, rel_tol=1e-9):
        return float(read)  # the value read, not its float round trip
    return coef


# ---------------------------------------------------------------- Qwen3-MoE's config.json
def _count(hf: Mapping[str, Any], *names: str) -> int:
    """The positive integer config.json gives under any of ``names`` (they must agree)."""
    given = {name: hf[name] for name in names if hf.get(name) is not None}
    if not given:
        raise UnsupportedCheckpointError(
            f"config.json has no {' or '.join(map(repr, names))}; it is required for "
            f"model_type={hf.get('model_type')!r}")
    if len(set(given.values())) > 1:
        raise UnsupportedCheckpointError(f"config.json gives {given}: they must agree")
    name, value = next(iter(given.items()))
    refuse_if(isinstance(value, bool) or not isinstance(value, int) or value < 1, name, value,
              "it must be a positive integer")
    return value


def qwen3_moe_attention_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's attention is Qwen3's (q/k RMSNorm per head), on every layer, without a window."""
    use = hf.get("use_sliding_window", False)
    refuse_if(bool(use), "use_sliding_window", use,
              "paxlite's Qwen3-MoE attends to the whole context (use_sliding_window must be false)")
    bias = hf.get("attention_bias", False)
    refuse_if(bool(bias), "attention_bias", bias,
              "Qwen3-MoE's attention_bias also puts a bias on the output projection, which "
              "paxlite has only together with MLP biases")
    return {"qk_norm": True}


def sparse_layer_interval(hf: Mapping[str, Any], *, num_layers: int) -> int:
    """paxlite's ``moe_layer_interval`` for Qwen3-MoE's sparse layers (module docstring)."""
    step = hf.get("decoder_sparse_step", 1)
    refuse_if(isinstance(step, bool) or not isinstance(step, int) or step < 1,
              "decoder_sparse_step", step, "it must be a positive integer")
    dense = set(hf.get("mlp_only_layers") or ())
    sparse = [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]
    for interval in range(1, num_layers + 1):
        if sparse == list(range(0, num_layers, interval)):
            return interval
    raise UnsupportedCheckpointError(
        f"config.json decoder_sparse_step={step}, mlp_only_layers={sorted(dense)} make layers "
        f"{sparse} of {num_layers} mixture-of-experts layers, which paxlite cannot hold: its MoE "
        "layers are every n-th layer from layer 0 (0, n, 2n, ...), i.e. decoder_sparse_step=1 "
        "with the layers in between in mlp_only_layers")


def qwen3_moe_config(hf: Mapping[str, Any], *, dense: TransformerConfig) -> TransformerConfig:
    """``dense`` (the attention, norms, embeddings and dense MLP, read as for LLaMA with
    `qwen3_moe_attention_fields`) with Qwen3-MoE's experts."""
    experts = _count(hf, "num_experts", "num_local_experts")  # 4.x's name, and 5.x's
    k = _count(hf, "num_experts_per_tok")
    refuse_if(k > experts, "num_experts_per_tok", k,
              f"it must be between 1 and num_experts={experts}")
    renormalize = hf.get("norm_topk_prob", QWEN3_MOE_DEFAULT_NORM_TOPK_PROB)
    refuse_if(not isinstance(renormalize, bool), "norm_topk_prob", renormalize,
              "it must be true or false")
    interval = sparse_layer_interval(hf, num_layers=dense.num_layers)
    moe = MoeConfig(
        num_experts=experts,
        experts_per_token=k,
        routing=MoeRouting.DROPLESS_TOPK,
        moe_layer_interval=interval,
        expert_hidden_dims=_count(hf, "moe_intermediate_size"),
        gated_experts=True,
        expert_activation=Activation.SILU,
        renormalize_top_k=renormalize,
    )
    weight = aux_loss_weight(hf, experts_per_token=k,
                             moe_layers=moe.num_moe_layers(dense.num_layers))
    return dataclasses.replace(dense, moe=dataclasses.replace(moe, load_balancing_weight=weight))


def qwen3_moe_fields(config: TransformerConfig, *, router_aux_loss_coef: float | None
                     ) -> dict[str, Any]:
    """What Qwen3MoeConfig writes in place of LLaMA's fields (None: left out). The experts'
    count under 5.x's ``num_local_experts`` and 4.x's ``num_experts``, as the RoPE base is written
    in both forms; the sparse layers as ``mlp_only_layers`` with ``decoder_sparse_step`` 1."""
    moe = config.moe
    assert moe is not None
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "mlp_bias": None,
        "pretraining_tp": None,
        "use_sliding_window": False,
        "sliding_window": None,
        "intermediate_size": config.hidden_dims,
        "moe_intermediate_size": moe.expert_hidden_dims or config.hidden_dims,
        "num_local_experts": moe.num_experts,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.experts_per_token,
        "norm_topk_prob": moe.renormalize_top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(config.num_layers) if not moe.is_moe_layer(i)],
        "output_router_logits": bool(moe.load_balancing_weight),
        "router_aux_loss_coef": aux_loss_coef(config, read=router_aux_loss_coef),
    }


# ---------------------------------------------------------------- which layout a model fits
def _dropless_swiglu(moe: MoeConfig) -> dict[str, tuple[Any, Any]]:
    return {
        "moe.routing": (moe.routing, MoeRouting.DROPLESS_TOPK),
        "moe.gated_experts": (moe.gated_experts, True),
        "moe.expert_activation": (moe.expert_activation, Activation.SILU),
    }


def mixtral_requirements(config: TransformerConfig) -> dict[str, tuple[Any, Any]]:
    """Mixtral's fields beyond LLaMA's, each as (the model's value, the value Mixtral needs)."""
    moe = config.moe
    out: dict[str, tuple[Any, Any]] = {"moe": ("set" if moe else None, "set")}
    if moe is not None:
        out.update(_dropless_swiglu(moe))
        out.update({"moe.moe_layer_interval": (moe.moe_layer_interval, 1),
                    "moe.renormalize_top_k": (moe.renormalize_top_k, True)})
    return out


def qwen3_moe_requirements(config: TransformerConfig) -> dict[str, tuple[Any, Any]]:
    """Qwen3-MoE's fields beyond LLaMA's (any moe_layer_interval, renormalised or not)."""
    moe = config.moe
    out: dict[str, tuple[Any, Any]] = {"qk_norm": (config.qk_norm, True),
                                       "moe": ("set" if moe else None, "set")}
    if moe is not None:
        out.update(_dropless_swiglu(moe))
    return out
