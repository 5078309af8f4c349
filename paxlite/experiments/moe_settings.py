"""The mixture-of-experts hyperparameters (Pax's names) and their mapping to ``MoeConfig``, once.

GLaM (glam.py) and Mixtral (mixtral.py) list `MoeSettings` before their dense base class; the
family says only its architecture (which layers are MoE, gated or plain experts, their activation)
as class attributes, and the mixin checks the settings and builds the ``MoeConfig``. Every
experiment has `ExpertParallelSettings` (base.py): a dense experiment given USE_EXPERT_PARALLEL, an
expert mesh axis or one of the MoE names gets an error saying it is dense, never a silently
ignored setting.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import fiddle as fdl

from paxlite.config.errors import ConfigError
from paxlite.experiments.field_names import in_hparam_names
from paxlite.experiments.parallelism_settings import mesh_layout
from paxlite.models.activations import Activation
from paxlite.models.moe_config import GroupedMatmul, MoeConfig, MoeRouting, moe_problems
from paxlite.models.moe_router_deepseek import bias_speed_problems
from paxlite.parallel.mesh import MeshLayout, named_sizes

# MoeConfig's fields set by hyperparameters -> their names (the mapping and the names its problems
# are reported in); the family's architecture (moe_layer_interval, gated_experts,
# expert_activation) comes from class attributes.
MOE_FIELD_NAMES = {
    "num_experts": "NUM_EXPERTS",
    "experts_per_token": "NUM_EXPERTS_PER_TOKEN",
    "routing": "MOE_ROUTING",
    "capacity_factor": "CAPACITY_FACTOR",
    "num_groups": "NUM_GROUPS",
    "expert_hidden_dims": "EXPERT_HIDDEN_DIMS",
    "load_balancing_weight": "LOAD_BALANCING_WEIGHT",
    "router_z_loss_weight": "ROUTER_Z_LOSS_WEIGHT",
    "grouped_matmul": "MOE_GROUPED_MATMUL",
}


def expert_axis_size(ici: list[int] | None, dcn: list[int],
                     layout: MeshLayout = MeshLayout.PAXLITE) -> int:
    """The `expert` mesh axis: the 4th entry of ICI x DCN (1 where a shape has 3 entries, or in
    Pax's pipelined 4-entry form, which has no expert axis)."""
    return named_sizes(ici, layout)["expert"] * named_sizes(dcn, layout)["expert"]


def mesh_with_expert_hint(shape: list[int] | None) -> str:
    """'[1,8,1,4]'-style hint: the user's 3 entries with an expert entry of 4 appended."""
    base = [1, 1, 1] if shape is None else list(shape[:3])
    return "[" + ",".join(str(d) for d in [*base, 4]) + "]"


class ExpertParallelSettings:
    """Pax's switch for expert parallelism, which every experiment accepts (and a dense one
    refuses with a reason)."""

    # In paxlite the mesh says it (a 4th entry, `expert`, of ICI_MESH_SHAPE / DCN_MESH_SHAPE);
    # true asks for it and is checked against the mesh: an MoE experiment with an expert axis > 1
    # (MoeSettings). A dense model has no experts.
    USE_EXPERT_PARALLEL: bool = False

    @classmethod
    def check_names(cls, names) -> None:
        """An MoE setting (NUM_EXPERTS, ...) on a dense experiment says so, rather than
        'unknown'."""
        names = list(names)
        specs = cls.hparam_specs()
        moe_only = [n for n in names if n in MOE_HPARAM_NAMES and n not in specs]
        if moe_only:
            raise dense_moe_setting_error(cls.__name__, moe_only)
        super().check_names(names)

    def is_moe(self) -> bool:
        """Whether the model has expert layers (MoeSettings says True)."""
        return False

    def dense_mesh_problems(self) -> list[str]:
        """Expert parallelism asked of a dense model (checked before the mesh's own checks)."""
        if self.is_moe():
            return []
        problems = []
        if expert_axis_size(self.ICI_MESH_SHAPE, self.DCN_MESH_SHAPE, mesh_layout(self)) > 1:
            problems.append(
                f"ICI_MESH_SHAPE={self.ICI_MESH_SHAPE}, DCN_MESH_SHAPE={self.DCN_MESH_SHAPE}: the "
                f"4th (expert) entry is > 1, and {self.name} is a dense model with no experts to "
                "split; give 3 entries [data, fsdp, tensor] (or a 4th entry of 1)")
        if self.USE_EXPERT_PARALLEL:
            problems.append(
                f"USE_EXPERT_PARALLEL=true, and {self.name} is a dense model with no experts: drop "
                "it, or run an MoE experiment (GLaM, Mixtral)")
        return problems


class RouterBiasSettings:
    """Mixin: MOE_BIAS_UPDATE_SPEED, for the registered MoE experiments (MoeSettings) and for
    FineTune of a converted DeepSeek-V3 (experiments/finetune.py), each checking it against its
    router."""

    # DeepSeek-V3's auxiliary-loss-free balancing: after each step every MoE layer's choice bias
    # moves by MOE_BIAS_UPDATE_SPEED x sign(mean load - expert's load), the loads counted over the
    # step's batch (models/moe_router_deepseek.py); 0: off, the bias stays as loaded (fine-tuning).
    # Only a router with a choice bias (DeepSeek-V3) reads it; its pretraining used 0.001.
    MOE_BIAS_UPDATE_SPEED: float = 0.0

    def router_bias_problems(self, *, has_choice_bias: bool, router: str) -> list[str]:
        """MOE_BIAS_UPDATE_SPEED's problems: a bad value, or a speed for ``router`` (its name in
        the message) without a choice bias to move."""
        speed = self.MOE_BIAS_UPDATE_SPEED
        problems = bias_speed_problems(speed, name="MOE_BIAS_UPDATE_SPEED")
        if speed and not problems and not has_choice_bias:
            problems.append(f"MOE_BIAS_UPDATE_SPEED={speed!r}: {router} has no choice bias to "
                            "move (only DeepSeek-V3's 'noaux_tc' router has one); drop it")
        return problems


class MoeSettings(RouterBiasSettings):
    """Mixin: the MoE knobs of an experiment (list it before the dense family class).

    Pax's names where Pax has one (NUM_EXPERTS, CAPACITY_FACTOR, NUM_GROUPS,
    LOAD_BALANCING_WEIGHT, Z_LOSS_WEIGHT, USE_EXPERT_PARALLEL); the others are paxlite's.
    """

    # Architecture of the family, not tunable from the command line.
    moe_layer_interval: ClassVar[int] = 1  # layer i is MoE iff i % interval == 0 (GLaM 2)
    gated_experts: ClassVar[bool] = False  # True: SwiGLU experts (Mixtral); False: act(x wi) wo
    expert_activation: ClassVar[Activation] = Activation.RELU
    # Layers before it are dense (DeepSeek's first_k_dense_replace); MoE layers count from it.
    first_moe_layer: ClassVar[int] = 0
    # Whether the router chooses by a per-expert bias that MOE_BIAS_UPDATE_SPEED can move
    # (DeepSeek-V3's 'noaux_tc'); the family's moe_fields passes the speed on.
    router_choice_bias: ClassVar[bool] = False

    NUM_EXPERTS: int = 8
    # k of top-k (Pax has no name for it: GShard routing is always top-2).
    NUM_EXPERTS_PER_TOKEN: int = 2
    # gshard_top2: GLaM's capacity-limited top-2 (tokens over capacity drop); dropless_topk:
    # Mixtral's, nothing drops.
    MOE_ROUTING: Literal["gshard_top2", "dropless_topk", "sigmoid_topk"] = "gshard_top2"
    # gshard_top2 only: each expert takes int(S x CAPACITY_FACTOR / E) assignments per group of S
    # tokens; 2.0 is room for both choices of every token on average (Pax).
    CAPACITY_FACTOR: float = 2.0
    # gshard_top2 only: routing groups per batch; None: one per batch shard of the mesh (Pax
    # derives prod(ICI[:-1]) x prod(DCN[:-1])).
    NUM_GROUPS: int | None = None
    # The load-balancing loss over the whole model: each of the M MoE layers adds
    # LOAD_BALANCING_WEIGHT / M x its own (Pax: 0.01 / (NUM_LAYERS / 2) for GLaM).
    LOAD_BALANCING_WEIGHT: float = 0.01
    # Pax's z-loss on the output logits (logsumexp^2), added in the training loss; 0: off.
    Z_LOSS_WEIGHT: float = 0.0
    # AXLearn's router z-loss per MoE layer; 0: off.
    ROUTER_Z_LOSS_WEIGHT: float = 0.0
    # dropless_topk only: the grouped-matmul kernel the experts run (models/moe_config.py
    # GroupedMatmul): "ragged_dot", jax.lax.ragged_dot, or "tiled", one batched matmul over row
    # tiles, whose memory does not grow with the local experts on GPUs.
    MOE_GROUPED_MATMUL: Literal["ragged_dot", "tiled"] = "ragged_dot"
    # Hidden size of each expert; None: HIDDEN_DIMS.
    EXPERT_HIDDEN_DIMS: int | None = None

    def is_moe(self) -> bool:
        return True

    def num_moe_layers(self) -> int:
        first = self.first_moe_layer
        return sum(1 for i in range(first, self.NUM_LAYERS)
                   if (i - first) % self.moe_layer_interval == 0)

    def moe_problems(self) -> list[str]:
        """Every MoE setting that cannot work, each saying what would (checked before the base
        checks, so a 4-entry mesh is judged here first)."""
        routing = MoeRouting(self.MOE_ROUTING)
        given = set(self.overridden)
        expert = expert_axis_size(self.ICI_MESH_SHAPE, self.DCN_MESH_SHAPE, mesh_layout(self))
        # MoeConfig's own rules (LOAD_BALANCING_WEIGHT as given: the model gets it per layer)
        settings = {field: getattr(self, name) for field, name in MOE_FIELD_NAMES.items()}
        problems = in_hparam_names(moe_problems(**settings), names=MOE_FIELD_NAMES)
        if self.NUM_EXPERTS >= 1 and expert >= 1 and self.NUM_EXPERTS % expert:
            divisors = [d for d in range(1, self.NUM_EXPERTS + 1) if self.NUM_EXPERTS % d == 0]
            problems.append(
                f"NUM_EXPERTS={self.NUM_EXPERTS} does not split over the expert mesh axis of size "
                f"{expert} (4th entry of ICI_MESH_SHAPE x DCN_MESH_SHAPE): each device must hold "
                f"whole experts; valid expert axis sizes: {divisors}")
        if routing is MoeRouting.GSHARD_TOP2:
            if "MOE_GROUPED_MATMUL" in given:
                problems.append(
                    "MOE_GROUPED_MATMUL is read only with MOE_ROUTING='dropless_topk' (GShard "
                    "routing runs dense einsums): drop it, or add --fdl.MOE_ROUTING=dropless_topk")
        else:
            if self.USE_FP8:
                problems.append(
                    "USE_FP8=true with MOE_ROUTING='dropless_topk': the dropless grouped matmul "
                    "has no FP8 form, and its experts would silently stay in "
                    f"{self.FPROP_DTYPE}; use --fdl.MOE_ROUTING=gshard_top2 for FP8 experts, or "
                    "--fdl.USE_FP8=false")
            unused = sorted(given & {"CAPACITY_FACTOR", "NUM_GROUPS"})
            if unused:
                problems.append(
                    f"{', '.join(unused)} read only with MOE_ROUTING='gshard_top2' (dropless "
                    "routing has no capacity and no groups): drop them, or add "
                    "--fdl.MOE_ROUTING=gshard_top2")
        problems += self.router_bias_problems(has_choice_bias=self.router_choice_bias,
                                              router=f"{self.name}'s router")
        if self.Z_LOSS_WEIGHT < 0:  # the loop's (Pax's z-loss on the logits), not MoeConfig's
            problems.append(f"Z_LOSS_WEIGHT={self.Z_LOSS_WEIGHT} must be >= 0 (0: off)")
        if self.USE_EXPERT_PARALLEL and expert == 1:
            problems.append(
                "USE_EXPERT_PARALLEL=true needs an expert mesh axis > 1: give ICI_MESH_SHAPE (or "
                "DCN_MESH_SHAPE) a 4th entry [data, fsdp, tensor, expert], e.g. "
                f"--fdl.ICI_MESH_SHAPE={mesh_with_expert_hint(self.ICI_MESH_SHAPE)}")
        return problems

    def validate(self) -> None:
        problems = self.moe_problems()
        if problems:
            raise ConfigError(f"invalid {self.name} hyperparameters: " + "; ".join(problems))
        super().validate()

    def moe_fields(self) -> dict[str, Any]:
        fields = {field: getattr(self, name) for field, name in MOE_FIELD_NAMES.items()}
        return {
            "num_experts": fields["num_experts"],
            "experts_per_token": fields["experts_per_token"],
            "routing": MoeRouting(fields["routing"]),
            "capacity_factor": fields["capacity_factor"],
            "num_groups": fields["num_groups"],
            "moe_layer_interval": self.moe_layer_interval,
            "expert_hidden_dims": fields["expert_hidden_dims"],
            "gated_experts": self.gated_experts,
            "expert_activation": self.expert_activation,
            "load_balancing_weight": fields["load_balancing_weight"] / self.num_moe_layers(),
            "router_z_loss_weight": fields["router_z_loss_weight"],
            "grouped_matmul": GroupedMatmul(fields["grouped_matmul"]),
        }

    def moe_config(self) -> fdl.Config[MoeConfig]:
        return fdl.Config(MoeConfig, **self.moe_fields())

    def loop_config(self):
        loop = super().loop_config()
        loop.z_loss_weight = self.Z_LOSS_WEIGHT
        return loop


MOE_HPARAM_NAMES: tuple[str, ...] = tuple(
    name for name in MoeSettings.__annotations__ if name.isupper())


def dense_moe_setting_error(experiment_name: str, names: list[str]) -> ConfigError:
    """What a dense experiment says when given MoE settings it has nowhere to apply."""
    return ConfigError(
        f"{', '.join('--fdl.' + n for n in names)}: mixture-of-experts setting(s), and "
        f"{experiment_name} is a dense model (no experts), so nothing would read them; run an MoE "
        "experiment (PileGLaM126M64E, Mixtral8x7B, TinyGLaM, TinyMixtral; `python -m paxlite "
        "list`)")
