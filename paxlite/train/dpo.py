"""Direct preference optimisation (TRAIN_TASK=dpo, EVAL_TASK=dpo): the loss of a batch of pairs.

A DPO batch holds one preference pair per row (data/dpo_pipeline.py): the chosen example from the
start of the row (segment 1), then the rejected one (segment 2), in transformers' causal-LM layout,
`weights` marking the positions whose next token is learned (the completion and its end). A row
with no segment 1 is padding (the end of an evaluation file) and counts for nothing; the rows are
told apart by their segment ids alone, so a training batch needs no per-row array (whose [B]
shape a sequence-sharded batch layout would not fit). A side's log-probability is the sum of
log p(next token) over its learned positions; with policy (π) and reference (ρ) log-probabilities

    reward_chosen   = β (π_chosen - ρ_chosen)
    reward_rejected = β (π_rejected - ρ_rejected)
    loss            = mean over pairs of -log σ(reward_chosen - reward_rejected)

(the sigmoid loss of Rafailov et al., as TRL's DPOTrainer computes it). Reported beside it, each a
mean over pairs: `rewards_chosen`, `rewards_rejected`, `accuracy` (reward_chosen > reward_rejected)
and `margin` (reward_chosen - reward_rejected).

The reference runs in the same step as the policy, forward only, on the same rows: the step costs
one more forward pass (about a third of a training step's FLOPs) and, with full fine-tuning, a
second copy of the parameters in device memory (the frozen reference, sharded as the parameters
are). With LoRA the reference is the base model: the same parameters with the adapters set to
zero, so there is no second copy. Nothing of the reference is differentiated or checkpointed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from paxlite.errors import SettingError

Batch = Mapping[str, jax.Array]
CHOSEN_SEGMENT, REJECTED_SEGMENT = 1, 2
# Per-row log-probability sums of a forward pass (the policy's and the reference's)
SIDE_KEYS = ("chosen_logp", "rejected_logp")
# Per-pair terms summed over the pairs, and the metric each makes (its sum / the pairs)
METRIC_OF_SUM = {"dpo_loss_sum": "loss", "rewards_chosen_sum": "rewards_chosen",
                 "rewards_rejected_sum": "rewards_rejected", "accuracy_sum": "accuracy",
                 "margin_sum": "margin"}
PAIR_SUM_KEYS = (*METRIC_OF_SUM, "pairs")
METRIC_PREFIX = "dpo/"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DpoConfig:
    """DPO_BETA and DPO_REFERENCE_PATH (None: the parameters training starts from; with LoRA,
    the base model without its adapters)."""

    beta: float = 0.1
    reference_path: str | None = None

    def __post_init__(self):
        beta = self.beta
        if isinstance(beta, bool) or not isinstance(beta, int | float) or not beta > 0:
            raise SettingError(f"DPO_BETA must be a number > 0 (how far the policy may move from "
                               f"the reference; TRL's default is 0.1), got {beta!r}")


def side_logps(token_logp: jax.Array, batch: Batch) -> dict[str, jax.Array]:
    """Per-row sums [B] of the learned positions' log-probabilities [B, T], chosen and rejected.

    `batch` needs `weights` and `segment_ids` (and may be one block of a chunked loss)."""
    weights = batch["weights"].astype(jnp.float32)  # [B, T]
    segment = batch["segment_ids"]  # [B, T]
    learned = token_logp.astype(jnp.float32) * weights
    return {
        "chosen_logp": jnp.sum(jnp.where(segment == CHOSEN_SEGMENT, learned, 0.0), axis=-1),
        "rejected_logp": jnp.sum(jnp.where(segment == REJECTED_SEGMENT, learned, 0.0), axis=-1),
    }


def pair_mask(batch: Batch) -> jax.Array:
    """[B] float32: 1.0 on the rows that hold a pair (a chosen example), 0.0 on padding rows."""
    return jnp.any(batch["segment_ids"] == CHOSEN_SEGMENT, axis=-1).astype(jnp.float32)


def pair_rows(policy: Mapping[str, jax.Array], reference: Mapping[str, jax.Array], *,
              rows: jax.Array, beta: float) -> dict[str, jax.Array]:
    """Each row's per-pair terms [B] (module docstring), 0 where `rows` (`pair_mask`) is 0;
    `pairs` is `rows`. Summed over rows (and batches), each metric is its sum / `pairs`."""
    chosen = beta * (policy["chosen_logp"] - reference["chosen_logp"])  # [B]
    rejected = beta * (policy["rejected_logp"] - reference["rejected_logp"])  # [B]
    margin = chosen - rejected
    return {
        "dpo_loss_sum": -jax.nn.log_sigmoid(margin) * rows,
        "rewards_chosen_sum": chosen * rows,
        "rewards_rejected_sum": rejected * rows,
        "accuracy_sum": (chosen > rejected).astype(jnp.float32) * rows,
        "margin_sum": margin * rows,
        "pairs": rows,
    }


def pair_sums(policy: Mapping[str, jax.Array], reference: Mapping[str, jax.Array], *,
              rows: jax.Array, beta: float) -> dict[str, jax.Array]:
    """`pair_rows` summed over the batch."""
    return {key: jnp.sum(value) for key, value in pair_rows(
        policy, reference, rows=rows, beta=beta).items()}


def pair_metrics(sums: Mapping[str, jax.Array | float]) -> dict[str, jax.Array | float]:
    """dpo/loss, dpo/rewards_chosen, dpo/rewards_rejected, dpo/accuracy, dpo/margin from the sums
    (device arrays in a step, floats on the host after an evaluation)."""
    pairs = sums["pairs"]
    denom = jnp.maximum(pairs, 1.0) if isinstance(pairs, jax.Array) else max(pairs, 1.0)
    return {f"{METRIC_PREFIX}{name}": sums[key] / denom for key, name in METRIC_OF_SUM.items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DpoSteps:
    """What the compiled steps (train/step.py) need of DPO: which of them read preference pairs,
    and whether the reference has parameters of its own (passed to the steps) or is the model
    with its adapters off (LoRA: computed inside the step, no second copy)."""

    beta: float
    train: bool  # TRAIN_TASK=dpo
    eval: bool  # EVAL_TASK=dpo
    separate_reference: bool

    @classmethod
    def of(cls, *, beta: float, reference_path: str | None, train: bool, eval: bool,
           lora: bool) -> DpoSteps:
        """The run's (run_build.dpo_steps) and the planner's: the reference is a model of its
        own unless it is a LoRA model's base (no DPO_REFERENCE_PATH)."""
        return cls(beta=beta, train=train, eval=eval,
                   separate_reference=reference_path is not None or not lora)
