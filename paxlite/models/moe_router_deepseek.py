"""DeepSeek's routers (V2 and V3), beside the softmax top-k of models/moe_gating.py.

V3 (``ScoreFunction.SIGMOID``, ``ExpertChoice.NOAUX_TC``): each expert's score is the sigmoid of
its logit; the *choice* adds the per-expert ``score_correction_bias`` (DeepSeek's
``e_score_correction_bias``, a checkpoint tensor that the auxiliary-loss-free balancing moves
between steps, never a gradient); the experts form ``num_groups`` equal groups, each group is
scored by the sum of its two best biased scores, the ``top_groups`` best groups are kept and the
top-k experts among theirs are chosen. The weights are the chosen experts' scores without the
bias, divided by their sum (plus 1e-20) when the config renormalises, times ``routed_scaling``.

V2 (``ScoreFunction.SOFTMAX``): the scores are the softmax over all experts; ``GREEDY`` takes the
top-k of all; ``GROUP_LIMITED_GREEDY`` scores each group by its best expert, keeps the
``top_groups`` best groups and takes the top-k of their experts (the others' scores set to 0). The
weights are the chosen scores times ``routed_scaling``, never renormalised (V2's modeling has no
renormalisation).

The bias is kept as a parameter (``moe/score_correction_bias`` [E]) that the train step never
trains (``is_frozen_path``): so it loads, converts and checkpoints with the parameters, and the
optimizer never touches it. ``bias_update_speed`` > 0 moves it as the DeepSeek-V3 report's
auxiliary-loss-free balancing does: after each train step, ``bias += speed * sign(mean load -
load_e)``, where load_e counts the tokens of the step's whole batch (padding excluded) routed to
expert e; the layer sows the counts (models/sown.py) and train/router_bias.py moves the bias inside
the jitted step. 0 (the default, for fine-tuning) leaves the bias as loaded.

Einsum letters: N tokens, E experts, G groups, K experts per token.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp

# The parameter name of the choice bias under an MoE layer (moe/score_correction_bias).
SCORE_BIAS_NAME = "score_correction_bias"


class ScoreFunction(str, enum.Enum):
    SIGMOID = "sigmoid"  # V3
    SOFTMAX = "softmax"  # V2


class ExpertChoice(str, enum.Enum):
    """How the k experts are chosen from the scores; the values are DeepSeek's ``topk_method``."""

    NOAUX_TC = "noaux_tc"  # V3: biased scores, groups by their two best, top-k of kept groups
    GREEDY = "greedy"  # V2: top-k of all experts
    GROUP_LIMITED_GREEDY = "group_limited_greedy"  # V2: groups by their best, top-k of kept ones


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepseekRouter:
    """``MoeConfig.deepseek_router``: the routing of DeepSeek's MoE layers (module docstring).

    ``MoeConfig.renormalize_top_k`` says whether V3's weights are renormalised; V2 refuses it.
    """

    score: ScoreFunction = ScoreFunction.SIGMOID
    choice: ExpertChoice = ExpertChoice.NOAUX_TC
    num_groups: int = 1
    top_groups: int = 1
    routed_scaling: float = 1.0
    bias_update_speed: float = 0.0

    def __post_init__(self) -> None:
        for field, enum_cls in (("score", ScoreFunction), ("choice", ExpertChoice)):
            value = getattr(self, field)
            try:
                object.__setattr__(self, field, enum_cls(value))
            except ValueError:
                valid = ", ".join(repr(m.value) for m in enum_cls)
                raise ValueError(f"DeepseekRouter.{field}={value!r} is not valid; expected one "
                                 f"of {valid}") from None
        problems = []
        for name in ("num_groups", "top_groups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r} must be a positive integer")
        if not problems and self.top_groups > self.num_groups:
            problems.append(f"top_groups={self.top_groups} must be <= num_groups="
                            f"{self.num_groups}")
        scaling = self.routed_scaling
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not scaling > 0:
            problems.append(f"routed_scaling={scaling!r} must be a positive number")
        problems += bias_speed_problems(self.bias_update_speed, name="bias_update_speed")
        if not problems and self.bias_update_speed and self.choice is not ExpertChoice.NOAUX_TC:
            problems.append(f"bias_update_speed={self.bias_update_speed!r} with choice="
                            f"{self.choice.value!r}: only 'noaux_tc' (DeepSeek-V3) routes by a "
                            "choice bias; use 0")
        if (self.score is ScoreFunction.SIGMOID) != (self.choice is ExpertChoice.NOAUX_TC):
            problems.append(f"score={self.score.value!r} with choice={self.choice.value!r}: "
                            "DeepSeek pairs sigmoid with 'noaux_tc' (V3) and softmax with "
                            "'greedy' / 'group_limited_greedy' (V2)")
        if problems:
            raise ValueError("DeepseekRouter: " + "; ".join(problems))

    @property
    def uses_bias(self) -> bool:
        return self.choice is ExpertChoice.NOAUX_TC


def bias_speed_problems(speed: object, *, name: str) -> list[str]:
    """``speed`` as a choice-bias update speed: a finite number >= 0 (0: the bias stays as
    loaded); else one clause naming it as ``name``."""
    if (isinstance(speed, bool) or not isinstance(speed, (int, float))
            or not math.isfinite(speed) or speed < 0):
        clause = (f"{name}={speed!r} must be a finite number >= 0 (0: the choice bias stays as "
                  "loaded; DeepSeek-V3's pretraining used 0.001)")
        return [clause]
    return []


def router_problems(router: DeepseekRouter, *, num_experts: object,
                    renormalize_top_k: object) -> list[str]:
    """What the rest of an MoeConfig cannot be with this router (clauses in MoeConfig's names)."""
    problems = []
    if isinstance(num_experts, int) and num_experts % router.num_groups:
        problems.append(f"num_experts={num_experts} must be a multiple of deepseek_router."
                        f"num_groups={router.num_groups}")
    elif (isinstance(num_experts, int) and router.choice is ExpertChoice.NOAUX_TC
          and num_experts // router.num_groups < 2):
        problems.append(f"num_experts={num_experts} in {router.num_groups} groups: 'noaux_tc' "
                        "scores a group by its two best experts, so each needs at least 2")
    if router.score is ScoreFunction.SOFTMAX and renormalize_top_k is True:
        problems.append("renormalize_top_k=True with DeepSeek-V2's softmax router: its weights "
                        "are never renormalised (use False)")
    return problems


def _group_mask(choice_scores: jax.Array, router: DeepseekRouter, *, top_in_group: int
                ) -> jax.Array:
    """bool [N, E]: the experts of each token's ``top_groups`` best groups, a group scored by the
    sum of its ``top_in_group`` best ``choice_scores``."""
    n, e = choice_scores.shape
    grouped = choice_scores.reshape(n, router.num_groups, e // router.num_groups)  # [N, G, E/G]
    group_scores = jnp.sum(jax.lax.top_k(grouped, top_in_group)[0], axis=-1)  # [N, G]
    _, kept = jax.lax.top_k(group_scores, router.top_groups)  # [N, top_groups]
    keep = jnp.sum(jax.nn.one_hot(kept, router.num_groups, dtype=jnp.int32), axis=1) > 0
    return jnp.repeat(keep, e // router.num_groups, axis=1)  # [N, E]


def deepseek_routing(logits: jax.Array, bias: jax.Array | None, router: DeepseekRouter, *,
                     k: int, renormalize: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits [N, E] float32, bias [E] (V3's choice bias; None for V2) -> weights [N, K] float32,
    experts [N, K] int32, probs [N, E] (the scores as a distribution, for the load-balancing
    loss)."""
    logits = logits.astype(jnp.float32)
    if router.score is ScoreFunction.SIGMOID:
        scores = jax.nn.sigmoid(logits)  # [N, E]
        choice = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))[None, :]
        if router.num_groups > 1:
            choice = jnp.where(_group_mask(choice, router, top_in_group=2), choice, -jnp.inf)
        _, experts = jax.lax.top_k(choice, k)  # [N, K]
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        if renormalize:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
        probs = scores
        if router.choice is ExpertChoice.GROUP_LIMITED_GREEDY and router.num_groups > 1:
            scores = jnp.where(_group_mask(scores, router, top_in_group=1), scores, 0.0)
        weights, experts = jax.lax.top_k(scores, k)
    return weights * router.routed_scaling, experts.astype(jnp.int32), probs


def is_frozen_path(path: str | Iterable[Any]) -> bool:
    """Whether a parameter path ('/'-joined or its parts) is state the train step keeps out of
    training: DeepSeek-V3's choice bias."""
    parts = path.split("/") if isinstance(path, str) else [getattr(p, "key", p) for p in path]
    return bool(parts) and parts[-1] == SCORE_BIAS_NAME


def trainable_paths(config: Any) -> Any:
    """The train step's ``trainable`` predicate for a TransformerConfig: LoRA trains only its
    adapters (Pax bprop_variable_inclusion=[r"^.*lora.*$"]); a DeepSeek-V3 router's bias never
    trains; None (everything trains) otherwise."""
    from paxlite.models.lora import is_lora_path

    moe = config.moe
    frozen_bias = (moe is not None and moe.deepseek_router is not None
                   and moe.deepseek_router.uses_bias)
    if config.lora_rank is not None:
        return is_lora_path  # adapters only: the bias is not one
    return (lambda path: not is_frozen_path(path)) if frozen_bias else None
