"""The DPO part of the train step (train/step.py): the gradient of the preference loss of a batch
of pairs, with the reference's log-probabilities computed beside the policy's (train/dpo.py has
the loss and its conventions)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from paxlite.models import sown
from paxlite.train.dpo import pair_mask, pair_metrics
from paxlite.train.grad_accum import accumulated_sums_and_grads
from paxlite.train.losses import pair_logps, pair_objective_sum

PyTree = Any
Batch = Mapping[str, jax.Array]


def pair_loss_and_grads(state, batch: Batch, train_params: PyTree, *, combine,
                        model: nn.Module, reference: PyTree, beta: float, dropout_rng: jax.Array,
                        deterministic: bool, grad_accum_steps: int, z_loss_weight: float,
                        loss_chunk_size: int | None):
    """`train_step`'s DPO objective: (loss, accuracy, gradients, summaries, new FP8 state), with
    the reference's log-probabilities computed microbatch by microbatch beside the policy's
    (`state`: the TrainState, whose FP8 state both forward passes read)."""
    tokens = jnp.sum(batch["weights"].astype(jnp.float32))
    pairs = jnp.maximum(jnp.sum(pair_mask(batch)), 1.0)
    tokens_per_pair = jnp.maximum(tokens, 1.0) / pairs

    def sums(p: PyTree, f: PyTree, mb: Batch, rng: jax.Array):
        ref = pair_logps(model, reference, mb, loss_chunk_size=loss_chunk_size, fp8=state.fp8)
        return pair_objective_sum(
            combine(p), mb, model=model, reference=ref, beta=beta,
            tokens_per_pair=tokens_per_pair, dropout_rng=rng, deterministic=deterministic,
            z_loss_weight=z_loss_weight, loss_chunk_size=loss_chunk_size, fp8=f)

    def batch_mean(p: PyTree, f: PyTree):
        objective, aux = sums(p, f, batch, dropout_rng)
        return objective / pairs, aux

    if grad_accum_steps == 1:
        (_, (metric_sums, summaries)), (grads, new_fp8) = jax.value_and_grad(
            batch_mean, argnums=(0, 1), has_aux=True)(train_params, state.fp8)
    else:
        metric_sums, grads, summary_sums, new_fp8 = accumulated_sums_and_grads(
            train_params, batch, sums_fn=sums, denom=pairs, dropout_rng=dropout_rng,
            num_microbatches=grad_accum_steps, fp8=state.fp8)
        summaries = sown.microbatch_means(summary_sums, grad_accum_steps)
        if "moe/z_loss" in summaries:
            summaries["moe/z_loss"] = summary_sums["moe/z_loss"]
    if "moe/z_loss" in summaries:  # summed over tokens: a mean over the batch's tokens
        summaries["moe/z_loss"] = summaries["moe/z_loss"] / jnp.maximum(tokens, 1.0)
    loss = metric_sums["dpo_loss_sum"] / pairs
    accuracy = metric_sums["correct_tokens"] / jnp.maximum(metric_sums["target_tokens"], 1.0)
    return loss, accuracy, grads, {**summaries, **pair_metrics(metric_sums)}, new_fp8
