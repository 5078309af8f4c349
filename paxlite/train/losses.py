"""From a model and a batch to the losses and per-example counts of one step.

Apart from the steps (train/step.py) because the one-batch train step, the gradient accumulation of
train/grad_accum.py and the evaluation step all score a forward pass the same way: weighted cross
entropy, the softmax z-loss, greedy token accuracy, whatever auxiliary losses the model sows, and
BoolQ's two-way choice, with or without a chunked loss (train/chunked_loss.py). Everything here is a
pure function of arrays; nothing is jitted or sharded here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from paxlite.models import sown
from paxlite.models.linear import FP8_COLLECTION
from paxlite.models.te_layer import fp8_state_collections
from paxlite.train.chunked_loss import chunked_row_sums
from paxlite.train.dpo import pair_mask, pair_sums, side_logps

PyTree = Any
Batch = Mapping[str, jax.Array]


def fp8_collection(model: nn.Module) -> str:
    """The collection ``TrainState.fp8`` holds: Transformer Engine's FP8 collection when TE runs
    FP8 (ENABLE_TE + ENABLE_FP8, models/te_layer.py), else native FP8's (models/linear.py). Both
    follow the same rule (state overwritten by its gradient); a model has one or the other."""
    te = fp8_state_collections(model.config)
    return te[0] if te else FP8_COLLECTION


def _variables(model: nn.Module, params: PyTree, fp8: PyTree | None) -> dict[str, PyTree]:
    """The model's variables: parameters, plus the FP8 state when there is any."""
    return {"params": params, **({fp8_collection(model): fp8} if fp8 else {})}


def apply_model(model: nn.Module, params, batch: Batch, *, dropout_rng, deterministic: bool,
                collect: bool = False, return_hidden: bool = False, fp8: PyTree | None = None):
    """The model's logits (with ``return_hidden``: its final hidden states, for a chunked loss);
    with ``collect``, (that, sown auxiliary loss, sown summaries by name, plus the routers' counts
    under ``sown.ROUTER_LOAD_KEY`` when any sowed them) for training (models/sown.py)."""
    rngs = {} if deterministic else {"dropout": dropout_rng}
    out = model.apply(
        _variables(model, params, fp8),
        batch["inputs"],
        positions=batch.get("positions"),
        segment_ids=batch.get("segment_ids"),
        deterministic=deterministic,
        rngs=rngs,
        mutable=list(sown.COLLECTIONS) if collect else False,
        **({"return_hidden": True} if return_hidden else {}),
    )
    if not collect:
        return out
    logits, state = out
    return logits, sown.total_aux_loss(state), sown.collected_summaries(state)


def projection(model: nn.Module) -> Callable[[PyTree, jax.Array], jax.Array]:
    """The model's final projection, hidden states -> logits (a chunked loss applies it per
    block)."""
    return lambda params, hidden: model.apply({"params": params}, hidden, method="project")


def _train_row_scores(logits: jax.Array, pos: Batch) -> dict[str, jax.Array]:
    """`per_example_scores` plus each row's z-loss sum: what one loss block contributes."""
    log_z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)  # [B, c]
    z_rows = jnp.sum(jnp.square(log_z) * pos["weights"].astype(jnp.float32), axis=-1)
    return {**per_example_scores(logits, pos), "z_loss_sum": z_rows}


def pair_side_logps(logits: jax.Array, pos: Batch) -> dict[str, jax.Array]:
    """Each row's chosen and rejected log-probabilities [B] of `logits` (a DPO pair a row:
    train/dpo.py); `pos` may be one block of a chunked loss."""
    return side_logps(-token_losses(logits, pos["targets"]), pos)


def _pair_row_scores(logits: jax.Array, pos: Batch) -> dict[str, jax.Array]:
    """`per_example_scores` plus `pair_side_logps`."""
    return {**per_example_scores(logits, pos), **pair_side_logps(logits, pos)}


def _pair_train_row_scores(logits: jax.Array, pos: Batch) -> dict[str, jax.Array]:
    return {**_train_row_scores(logits, pos), **pair_side_logps(logits, pos)}


def forward_scores(model: nn.Module, params, batch: Batch, *, dropout_rng, deterministic: bool,
                   loss_chunk_size: int | None, fp8: PyTree | None = None, pairs: bool = False):
    """(per-row scores as `per_example_scores`, z-loss sum, sown auxiliary loss, summaries); with
    `pairs` (a DPO batch), each row's `chosen_logp` and `rejected_logp` too.

    With `loss_chunk_size` the model stops at its final hidden states and the scores are summed
    over blocks of that many positions (train/chunked_loss.py): the [B, T, V] logits never exist.
    """
    chunked = loss_chunk_size is not None
    head, aux_loss, summaries = apply_model(
        model, params, batch, dropout_rng=dropout_rng, deterministic=deterministic, collect=True,
        return_hidden=chunked, fp8=fp8)
    if not chunked:
        scores = (_pair_row_scores if pairs else per_example_scores)(head, batch)
        return scores, z_loss_sum(head, batch["weights"]), aux_loss, summaries
    per_position = {"targets": batch["targets"], "weights": batch["weights"],
                    **({"segment_ids": batch["segment_ids"]} if pairs else {})}
    scores = chunked_row_sums(
        params, head, per_position, project=projection(model),
        score_fn=_pair_train_row_scores if pairs else _train_row_scores,
        chunk_size=loss_chunk_size)
    return scores, jnp.sum(scores.pop("z_loss_sum")), aux_loss, summaries


def pair_logps(model: nn.Module, params, batch: Batch, *, loss_chunk_size: int | None,
               fp8: PyTree | None = None) -> dict[str, jax.Array]:
    """Each row's chosen and rejected log-probabilities [B] under `params`, forward only and
    without dropout: the DPO reference's (train/dpo.py). No gradient flows through them."""
    head = apply_model(model, params, batch, dropout_rng=None, deterministic=True,
                       return_hidden=loss_chunk_size is not None, fp8=fp8)
    if loss_chunk_size is None:
        scores = pair_side_logps(head, batch)
    else:
        scores = chunked_row_sums(
            params, head, {key: batch[key] for key in ("targets", "weights", "segment_ids")},
            project=projection(model),
            score_fn=pair_side_logps,
            chunk_size=loss_chunk_size)
    return jax.lax.stop_gradient(scores)


def pair_objective_sum(params, batch: Batch, *, model: nn.Module, reference: dict[str, jax.Array],
                       beta: float, tokens_per_pair: jax.Array, dropout_rng, deterministic: bool,
                       z_loss_weight: float, loss_chunk_size: int | None,
                       fp8: PyTree | None = None):
    """The DPO objective of `batch` as a sum over its pairs, and (metric sums, summaries).

    A sum, so that microbatches add up to the batch's (train/grad_accum.py) and one division by the
    batch's pairs makes the mean: the DPO loss summed over pairs, the auxiliary losses (per-batch
    means) weighted by the pairs, and the z-loss (a mean over tokens) scaled by
    `tokens_per_pair` (the whole batch's weighted tokens / its pairs). `reference`: the reference's
    `pair_logps` of the same rows."""
    scores, z_sum, aux_loss, summaries = forward_scores(
        model, params, batch, dropout_rng=dropout_rng, deterministic=deterministic,
        loss_chunk_size=loss_chunk_size, fp8=fp8, pairs=True)
    sums = pair_sums(scores, reference, rows=pair_mask(batch), beta=beta)
    objective = sums["dpo_loss_sum"] + aux_loss * sums["pairs"]
    if z_loss_weight:
        objective = objective + z_loss_weight * z_sum / tokens_per_pair
        summaries = {**summaries, "moe/z_loss": z_sum}  # a sum; the step divides by the tokens
    metric_sums = {**sums, "correct_tokens": jnp.sum(scores["correct_tokens"]),
                   "target_tokens": jnp.sum(scores["target_tokens"])}
    return objective, (metric_sums, summaries)


def token_losses(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-token cross entropy in float32: [B, T, V], [B, T] -> [B, T]."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return log_z - target_logit


def z_loss_sum(logits: jax.Array, weights: jax.Array) -> jax.Array:
    """Sum over weighted tokens of logsumexp(logits)^2 (Pax's softmax z-loss before its weight)."""
    log_z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)  # [B, T]
    return jnp.sum(jnp.square(log_z) * weights.astype(jnp.float32))


def _loss_and_metrics(scores: dict[str, jax.Array]):
    """Batch means of the per-example sums that evaluation reports too."""
    num_tokens = jnp.sum(scores["target_tokens"])
    denom = jnp.maximum(num_tokens, 1.0)
    loss = jnp.sum(scores["loss_sum"]) / denom
    return loss, {"accuracy": jnp.sum(scores["correct_tokens"]) / denom, "num_tokens": num_tokens}


def loss_fn(
    params: PyTree,
    batch: Batch,
    *,
    model: nn.Module,
    dropout_rng: jax.Array | None = None,
    deterministic: bool = True,
    z_loss_weight: float = 0.0,
    loss_chunk_size: int | None = None,
    fp8: PyTree | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The training objective and its parts: mean weighted cross entropy (aux ``loss``), plus
    ``z_loss_weight`` x the mean z-loss and whatever auxiliary losses the model sows (MoE load
    balancing); token accuracy and the model's summaries ride along in the aux dict. A
    `loss_chunk_size` computes the same from blocks of that many positions (`forward_scores`).
    `fp8`: the model's FP8 state (its gradient is the updated state)."""
    scores, z_sum, aux_loss, summaries = forward_scores(
        model, params, batch, dropout_rng=dropout_rng, deterministic=deterministic,
        loss_chunk_size=loss_chunk_size, fp8=fp8)
    loss, metrics = _loss_and_metrics(scores)
    objective = loss + aux_loss
    if z_loss_weight:
        z_loss = z_sum / jnp.maximum(metrics["num_tokens"], 1.0)
        summaries = {**summaries, "moe/z_loss": z_loss}
        objective = objective + z_loss_weight * z_loss
    return objective, {**metrics, "loss": loss, "summaries": summaries}


def per_example_scores(logits: jax.Array, batch: Batch) -> dict[str, jax.Array]:
    """Per-row sums [B] over weighted positions: greedy hits, weighted token count, cross entropy.

    Sums rather than means, so rows and batches of any size combine exactly, and whole-example
    metrics (Pax's Lambada acc_strict: every target token right) can be formed on the host.
    """
    logits = logits.astype(jnp.float32)  # [B, T, V]
    targets = batch["targets"]  # [B, T]
    weights = batch["weights"].astype(jnp.float32)  # [B, T]
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)  # [B, T]
    return {
        "correct_tokens": jnp.sum(correct * weights, axis=-1),
        "target_tokens": jnp.sum(weights, axis=-1),
        "loss_sum": jnp.sum(token_losses(logits, targets) * weights, axis=-1),
    }


def choice_correct(logits: jax.Array, batch: Batch) -> jax.Array:
    """Per-row weighted count [B] of target positions where the label beats the other choice.

    Pax's BoolQ score (`CustomMetricsLM`, eval_task='boolq'): each row names its two answer tokens
    in `yn_tokens` [B, 2]; at a target position holding one of them, the other is their sum minus
    the label, and the position counts when logit[label] - logit[other] > 0 (a tie loses).
    """
    logits = logits.astype(jnp.float32)  # [B, T, V]
    targets = batch["targets"]  # [B, T]
    weights = batch["weights"].astype(jnp.float32)  # [B, T]
    pair_sum = jnp.sum(batch["yn_tokens"].astype(jnp.int32), axis=-1, keepdims=True)  # [B, 1]
    # Off-target positions (weight 0) may hold any token; clipping keeps their gather in range.
    other = jnp.clip(pair_sum - targets, 0, logits.shape[-1] - 1)  # [B, T]
    label_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [B, T]
    other_logit = jnp.take_along_axis(logits, other[..., None], axis=-1)[..., 0]  # [B, T]
    won = (label_logit - other_logit > 0).astype(jnp.float32)
    return jnp.sum(won * weights, axis=-1)
