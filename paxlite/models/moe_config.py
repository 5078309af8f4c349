"""The typed configuration of a mixture-of-experts feed-forward layer (GLaM, Mixtral).

A ``TransformerConfig`` with ``moe`` set replaces the dense MLP of every ``moe_layer_interval``-th
layer (starting at layer 0) by ``num_experts`` expert MLPs and a router. The two routings differ in
what they do with a token an expert has no room for:

- ``GSHARD_TOP2`` (GLaM, Praxis ``top2_gating_on_logits``): tokens are split into groups, each
  expert takes at most a fixed *capacity* of assignments per group, and the rest are dropped (a
  fully dropped token passes through the residual). Dispatch and combine are dense einsums, which
  GSPMD turns into the all-to-all of expert parallelism.
- ``DROPLESS_TOPK`` (Mixtral, Qwen3-MoE): every token reaches its top-k experts; tokens are sorted
  by expert and the experts run as one grouped matmul (``GroupedMatmul`` picks its kernel).
"""

from __future__ import annotations

import dataclasses
import enum

from paxlite.models.activations import Activation
from paxlite.models.moe_router_deepseek import DeepseekRouter, router_problems


class MoeRouting(str, enum.Enum):
    """How tokens are assigned to experts."""

    GSHARD_TOP2 = "gshard_top2"  # GLaM: top-2 with a capacity per group; over-capacity tokens drop
    DROPLESS_TOPK = "dropless_topk"  # Mixtral: softmax -> top-k (-> renormalise); nothing drops
    # Llama 4: top-k logits -> sigmoid gates that scale each token's input to its experts;
    # dropless (models/moe_sigmoid_gating.py)
    SIGMOID_TOPK = "sigmoid_topk"


class GroupedMatmul(str, enum.Enum):
    """The kernel of the dropless experts' grouped matmul (tokens sorted by expert).

    ``RAGGED_DOT`` is ``jax.lax.ragged_dot``: on GPUs it lowers to XLA's ragged-dot instruction,
    which XLA:GPU expands to a zero-padded dense array per group ([groups, rows, K]: memory and
    FLOPs x the local experts), on CPU to a masked dense matmul (the same). ``TILED`` pads each
    group to whole tiles of rows and runs one batched matmul over the tiles
    (models/tiled_grouped_matmul.py): memory and FLOPs in proportion to the rows. JAX 0.11 removed
    the Pallas-Triton lowering that an earlier ``PALLAS_TRITON`` value selected.
    """

    RAGGED_DOT = "ragged_dot"
    TILED = "tiled"


def _enum(value: object, enum_cls: type[enum.Enum], *, field: str) -> enum.Enum:
    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(value)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in enum_cls)
        raise ValueError(
            f"MoeConfig.{field}={value!r} is not valid; expected one of {valid}"
        ) from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeConfig:
    """Sizes and switches of the expert layers; defaults follow Pax GLaM.

    Attributes:
        num_experts: experts per MoE layer (Pax NUM_EXPERTS).
        experts_per_token: k of top-k (GShard routing is always top-2).
        routing: see ``MoeRouting``.
        capacity_factor: GShard only: each expert takes ``int(S * capacity_factor / E)``
            assignments per group of S tokens (rounded up to a multiple of 4); 2.0 means room for
            both choices of every token on average (Pax CAPACITY_FACTOR).
        num_groups: GShard only: how many routing groups the tokens of a batch form (Pax
            num_groups). None: one group per batch shard of the mesh in use, as Pax derives it;
            an integer fixes it, so two meshes route identically.
        moe_layer_interval: layer i is an MoE layer when ``i % moe_layer_interval == 0``
            (GLaM 2: every other layer from layer 0; Mixtral 1: every layer), counted from
            ``first_moe_layer``.
        expert_hidden_dims: hidden size of each expert; None: the dense ``hidden_dims``.
        gated_experts: False: ``act(x wi) wo`` (GLaM's experts, ReLU); True:
            ``act(x wi_gate) * (x wi) wo`` (Mixtral's SwiGLU experts).
        expert_activation: the experts' non-linearity.
        load_balancing_weight: weight of each MoE layer's load-balancing loss (Pax
            ``moe_load_balance_loss_weight``: LOAD_BALANCING_WEIGHT / number of MoE layers);
            the per-layer terms are summed.
        router_z_loss_weight: weight of AXLearn's router z-loss ``mean(logsumexp(logits)^2)``
            per layer (0: off).
        grouped_matmul: dropless only: the grouped-matmul kernel.
        renormalize_top_k: dropless only: True divides each token's k routing weights by their
            sum (Mixtral; Qwen3-MoE's ``norm_topk_prob: true``); False keeps them as the softmax
            over all experts gave them, summing to less than 1 (``norm_topk_prob: false``).
            GShard's top-2 always renormalises.
        shared_expert_hidden_dims: the hidden size of a gated MLP (``expert_activation``, no
            biases) that every token passes through beside its routed experts, its output added
            to theirs (DeepSeek's ``n_shared_experts * moe_intermediate_size``, Llama 4's
            ``shared_expert``); None: no shared expert.
        first_moe_layer: the layers before it are dense (DeepSeek's ``first_k_dense_replace``);
            layer i is MoE when ``i >= first_moe_layer`` and
            ``(i - first_moe_layer) % moe_layer_interval == 0``. A stack whose first layers
            differ from the rest has no period to scan or pipeline, so those refuse a value > 0.
        deepseek_router: dropless only: DeepSeek-V2/V3's scores and choice
            (models/moe_router_deepseek.py) instead of the softmax top-k; None: softmax top-k.
        use_bias: dropless only: biases on the router logits and on each expert's wi, wi_gate and
            wo (gpt-oss; models/moe_gpt_oss.py).
        swiglu_limit: dropless gated SiLU experts only: gpt-oss's clamped SwiGLU, gate clamped to
            <= limit and up to [-limit, limit], ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``;
            None: ``silu(gate) * up``.
        swiglu_alpha: the sigmoid's gain in that clamped SwiGLU (gpt-oss: 1.702); read only with
            swiglu_limit.
    """

    num_experts: int
    experts_per_token: int = 2
    routing: MoeRouting = MoeRouting.GSHARD_TOP2
    capacity_factor: float = 2.0
    num_groups: int | None = None
    moe_layer_interval: int = 1
    expert_hidden_dims: int | None = None
    gated_experts: bool = False
    expert_activation: Activation = Activation.RELU
    load_balancing_weight: float = 0.0
    router_z_loss_weight: float = 0.0
    grouped_matmul: GroupedMatmul = GroupedMatmul.RAGGED_DOT
    renormalize_top_k: bool = True
    shared_expert_hidden_dims: int | None = None
    first_moe_layer: int = 0
    deepseek_router: DeepseekRouter | None = None
    use_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        for field, enum_cls in (("routing", MoeRouting), ("expert_activation", Activation),
                                ("grouped_matmul", GroupedMatmul)):
            object.__setattr__(self, field, _enum(getattr(self, field), enum_cls, field=field))
        if isinstance(self.deepseek_router, dict):  # read back from JSON
            object.__setattr__(self, "deepseek_router", DeepseekRouter(**self.deepseek_router))
        problems = moe_problems(**{f.name: getattr(self, f.name)
                                   for f in dataclasses.fields(self)})
        if problems:
            raise ValueError("MoeConfig: " + "; ".join(problems))

    def is_moe_layer(self, layer: int) -> bool:
        offset = layer - self.first_moe_layer
        return offset >= 0 and offset % self.moe_layer_interval == 0

    def num_moe_layers(self, num_layers: int) -> int:
        return sum(1 for i in range(num_layers) if self.is_moe_layer(i))


def _is_count(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def moe_problems(**fields: object) -> list[str]:
    """What the values given cannot be, one clause each in MoeConfig's field names: the rules a
    config is refused by when it is made, which an experiment reports for its settings before it
    builds one. Only the fields given are checked; ``routing`` as a value or its name."""
    problems = []
    for name in ("num_experts", "experts_per_token", "moe_layer_interval"):
        if name in fields and not _is_count(fields[name]):
            problems.append(f"{name}={fields[name]!r} must be a positive integer")
    for name, none_means in (("num_groups", "one group per batch shard"),
                             ("expert_hidden_dims", "the dense MLP's hidden size"),
                             ("shared_expert_hidden_dims", "no shared expert")):
        value = fields.get(name)
        if value is not None and not _is_count(value):
            problems.append(f"{name}={value!r} must be a positive integer or None ({none_means})")
    experts, k = fields.get("num_experts"), fields.get("experts_per_token")
    counts_valid = _is_count(experts) and _is_count(k)
    if counts_valid and k > experts:
        problems.append(
            f"experts_per_token={k} is larger than num_experts={experts}: a token cannot pick "
            f"more experts than there are (valid: 1..{experts})")
    routing = fields.get("routing")
    if routing in tuple(MoeRouting) and MoeRouting(routing) is MoeRouting.GSHARD_TOP2:
        # (top-2 and at most num_experts per token: at least 2 experts)
        if _is_count(k) and k != 2 and not (counts_valid and k > experts):
            problems.append(f"experts_per_token={k}: routing='gshard_top2' is top-2; use "
                            "routing='dropless_topk' for another k")
        cf = fields.get("capacity_factor")
        if "capacity_factor" in fields and not (
                not isinstance(cf, bool) and isinstance(cf, (int, float)) and cf > 0):
            problems.append(f"capacity_factor={cf!r} must be > 0 with routing='gshard_top2' "
                            "(GLaM: 2.0, room for both choices of every token)")
    for name in ("load_balancing_weight", "router_z_loss_weight"):
        value = fields.get(name, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            problems.append(f"{name}={value!r} must be >= 0 (0: off)")
    first = fields.get("first_moe_layer", 0)
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        problems.append(f"first_moe_layer={first!r} must be an integer >= 0 (0: MoE layers from "
                        "layer 0)")
    router = fields.get("deepseek_router")
    if router is not None:
        if not isinstance(router, DeepseekRouter):
            problems.append(f"deepseek_router={router!r} must be None or a DeepseekRouter")
        else:
            if routing is not None and MoeRouting(routing) is not MoeRouting.DROPLESS_TOPK:
                problems.append("deepseek_router needs routing='dropless_topk'")
            problems += router_problems(router, num_experts=experts,
                                        renormalize_top_k=fields.get("renormalize_top_k"))
    for name in ("gated_experts", "renormalize_top_k"):
        if name in fields and not isinstance(fields[name], bool):
            problems.append(f"{name}={fields[name]!r} must be True or False")
    if (fields.get("renormalize_top_k") is False and routing in tuple(MoeRouting)
            and MoeRouting(routing) is MoeRouting.GSHARD_TOP2):
        problems.append("renormalize_top_k=False with routing='gshard_top2': GShard's top-2 "
                        "always renormalises its two gates; use routing='dropless_topk'")
    if (fields.get("renormalize_top_k") is True and routing in tuple(MoeRouting)
            and MoeRouting(routing) is MoeRouting.SIGMOID_TOPK):
        problems.append("renormalize_top_k=True with routing='sigmoid_topk': its sigmoid gates "
                        "are never renormalised; set renormalize_top_k=False")
    return problems + _gpt_oss_problems(fields)


def _gpt_oss_problems(fields: dict[str, object]) -> list[str]:
    """use_bias, swiglu_limit and swiglu_alpha (gpt-oss's experts)."""
    problems = []
    if "use_bias" in fields and not isinstance(fields["use_bias"], bool):
        problems.append(f"use_bias={fields['use_bias']!r} must be True or False")
    for name in ("swiglu_limit", "swiglu_alpha"):
        value = fields.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not value > 0):
            problems.append(f"{name}={value!r} must be a positive number"
                            + (" or None (silu(gate) * up)" if name == "swiglu_limit" else ""))
    routing = fields.get("routing")
    gshard = routing in tuple(MoeRouting) and MoeRouting(routing) is MoeRouting.GSHARD_TOP2
    for name, on in (("use_bias", fields.get("use_bias") is True),
                     ("swiglu_limit", fields.get("swiglu_limit") is not None)):
        if on and gshard:
            problems.append(f"{name} with routing='gshard_top2': gpt-oss's experts are dropless; "
                            "use routing='dropless_topk'")
    if fields.get("swiglu_limit") is not None and not (
            fields.get("gated_experts") is True
            and fields.get("expert_activation") in (Activation.SILU, Activation.SILU.value)):
        problems.append("swiglu_limit (the clamped SwiGLU) needs gated_experts=True and "
                        "expert_activation='silu'")
    return problems
