"""Gradient accumulation: one optimizer step over a global batch taken as K microbatches.

Apart from the step (train/step.py) because how a batch is cut into microbatches, laid out over the
devices and summed back into the one-batch gradient is its own set of rules (token-weighted sums, a
strided split that moves no rows between devices, FP8 state merged by max), and a microbatch
schedule (pipeline parallelism) belongs with it. `microbatch_size` also checks the setting before
anything compiles (train/run_build.py, planner/search.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from paxlite.errors import SettingError
from paxlite.models import sown
from paxlite.train.losses import forward_scores

PyTree = Any
Batch = Mapping[str, jax.Array]


def _identity(tree: PyTree) -> PyTree:
    return tree


def _max_merge(acc: PyTree, new: PyTree) -> PyTree:
    """FP8 state "gradients" of several microbatches combine by max, never by sum: every
    microbatch starts from the same state, so the scales agree and the histories differ only in
    slot 0 (this step's max|x|), whose max over microbatches is the whole batch's."""
    return jax.tree.map(jnp.maximum, acc, new)


def check_accum_steps(value: object, *, name: str) -> int:
    """`value` if it is an integer >= 1 (a number of microbatches); else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 (1: no accumulation), got {value!r}")
    return value


def microbatch_size(*, global_batch_size: int, grad_accum_steps: int, batch_split: int) -> int:
    """Rows per microbatch; a ValueError naming the numbers and the valid choices if none fits.

    Each microbatch must itself split evenly over the data x fsdp x expert devices (`batch_split`
    ways), so `global_batch_size` must be a multiple of `grad_accum_steps * batch_split`.
    """
    k = check_accum_steps(grad_accum_steps, name="GRAD_ACCUM_STEPS")
    if global_batch_size % (k * batch_split) == 0:
        return global_batch_size // k
    per_split = global_batch_size // batch_split if global_batch_size % batch_split == 0 else 0
    valid = ", ".join(str(v) for v in range(1, per_split + 1) if per_split % v == 0) or "none"
    raise SettingError(
        f"GRAD_ACCUM_STEPS={k} does not fit the global batch of {global_batch_size} rows "
        f"(PERCORE_BATCH_SIZE x devices) split over data x fsdp x expert = {batch_split} ways: "
        f"each microbatch of {global_batch_size}/{k} rows must be a multiple of {batch_split}. "
        f"Valid GRAD_ACCUM_STEPS here: {valid}; or make the global batch a multiple of "
        f"{k} x {batch_split} = {k * batch_split}"
    )


def pipeline_microbatches(pipeline: Any, *, global_batch_size: int, grad_accum_steps: int,
                          batch_split: int) -> int:
    """The pipeline's microbatch count for each forward pass; a SettingError naming the numbers
    when the rows of one pass (global / GRAD_ACCUM_STEPS) do not split into microbatches that each
    divide over data x fsdp x expert. Called before anything compiles."""
    rows = global_batch_size // grad_accum_steps
    try:
        micro = pipeline.microbatches(rows)
    except ValueError as e:
        raise SettingError(f"{e} (the global batch {global_batch_size} / GRAD_ACCUM_STEPS="
                           f"{grad_accum_steps})") from None
    if (rows // micro) % batch_split:
        raise SettingError(
            f"pipeline microbatches of {rows // micro} rows ({rows} rows / {micro} microbatches) "
            f"do not divide over data x fsdp x expert = {batch_split} ways: choose fewer "
            "microbatches (NUM_MICROBATCHES) or a larger batch")
    return micro


def split_microbatches(batch: Batch, num_microbatches: int) -> Batch:
    """Every [B, ...] array -> [K, B/K, ...]; microbatch k holds global rows k, k + K, k + 2K, ...

    Why strided rather than contiguous blocks: the feed lays a global batch out over the
    n = data x fsdp x expert devices in contiguous blocks (device d holds rows [d B/n, (d+1) B/n)).
    Reshaping to [B/K, K, ...] leaves that leading dimension block-sharded exactly as before (each
    device's B/n rows are whole groups of K when B/K is a multiple of n), and moving K to the front
    is a local transpose. So every microbatch takes B/(nK) rows from every device: no rows cross
    devices and no device idles. With contiguous blocks ([K, B/K] directly) microbatch k would live
    on only n/K of the devices, and spreading it out again would cost an all-to-all per step.
    """
    def split(x: jax.Array) -> jax.Array:
        if x.shape[0] % num_microbatches:
            raise ValueError(
                f"batch of {x.shape[0]} rows does not split into {num_microbatches} microbatches"
            )
        x = x.reshape(x.shape[0] // num_microbatches, num_microbatches, *x.shape[1:])
        x = jnp.moveaxis(x, 1, 0)  # [K, B/K, ...]
        axes = (None, "activation_batch") + (None,) * (x.ndim - 2)
        return nn.with_logical_constraint(x, axes)

    return {key: split(value) for key, value in batch.items()}


def accumulated_loss_and_grads(
    params: PyTree,
    batch: Batch,
    *,
    model: nn.Module,
    dropout_rng: jax.Array,
    deterministic: bool,
    num_microbatches: int,
    combine: Callable[[PyTree], PyTree] = _identity,
    z_loss_weight: float = 0.0,
    loss_chunk_size: int | None = None,
    fp8: PyTree | None = None,
) -> tuple[jax.Array, jax.Array, PyTree, dict[str, jax.Array], PyTree]:
    """Loss, accuracy, gradients and model summaries of the whole batch, one microbatch at a time.

    The loss of the batch is (sum of weighted token losses) / (number of weighted tokens), and
    microbatches may hold different numbers of weighted tokens; so each microbatch contributes the
    gradient of its loss *sum*, and the total is divided once by the whole batch's token count.
    The result is the gradient of the batch's mean loss, not a mean of microbatch means. Terms that
    are per-batch means already (sown auxiliary losses) enter each microbatch's sum weighted by its
    token count, so they too average over the batch's tokens; summaries are averaged over
    microbatches. `lax.scan` keeps one microbatch's activations alive at a time. Gradients are taken
    with respect to `params`, which `combine` completes into the model's parameters (frozen ones
    added).

    With FP8 state (`fp8`), each microbatch's objective is divided by the batch's token count
    before differentiating (the same gradient in exact arithmetic), so the output gradients each
    FP8 matmul quantises, and their amax histories, are those of the one-batch step; the new FP8
    state is the max over microbatches (`_max_merge`) and is returned last.
    """
    num_tokens = jnp.sum(batch["weights"].astype(jnp.float32))
    denom = jnp.maximum(num_tokens, 1.0)

    def sums(p: PyTree, f: PyTree, mb: Batch, rng: jax.Array):
        scores, z_sum, aux_loss, summaries = forward_scores(
            model, combine(p), mb, dropout_rng=rng, deterministic=deterministic,
            loss_chunk_size=loss_chunk_size, fp8=f)
        loss_sum = jnp.sum(scores["loss_sum"])
        objective = loss_sum + aux_loss * jnp.sum(scores["target_tokens"])
        if z_loss_weight:
            objective = objective + z_loss_weight * z_sum
            summaries = {**summaries, "moe/z_loss": z_sum}  # a sum here; divided below
        return objective, ({"loss_sum": loss_sum,
                            "correct_tokens": jnp.sum(scores["correct_tokens"])}, summaries)

    metric_sums, grads, summary_sums, new_fp8 = accumulated_sums_and_grads(
        params, batch, sums_fn=sums, denom=denom, dropout_rng=dropout_rng,
        num_microbatches=num_microbatches, fp8=fp8)
    summaries = sown.microbatch_means(summary_sums, num_microbatches)
    if "moe/z_loss" in summaries:  # summed over tokens: a mean over the batch's tokens
        summaries["moe/z_loss"] = summary_sums["moe/z_loss"] / denom
    return (metric_sums["loss_sum"] / denom, metric_sums["correct_tokens"] / denom, grads,
            summaries, new_fp8)


# (params, fp8 state, microbatch, dropout key) -> (objective as a sum, (metric sums, summaries))
SumsFn = Callable[[PyTree, PyTree, Batch, jax.Array],
                  tuple[jax.Array, tuple[dict[str, jax.Array], dict[str, jax.Array]]]]


def accumulated_sums_and_grads(
    params: PyTree,
    batch: Batch,
    *,
    sums_fn: SumsFn,
    denom: jax.Array,
    dropout_rng: jax.Array,
    num_microbatches: int,
    fp8: PyTree | None = None,
) -> tuple[dict[str, jax.Array], PyTree, dict[str, jax.Array], PyTree]:
    """(metric sums over the batch, gradient of the batch's objective sum / `denom`, summaries
    summed over microbatches, new FP8 state), one microbatch of `batch` at a time.

    `sums_fn` gives a microbatch's objective as a sum (a cross-entropy sum over tokens, a DPO loss
    sum over pairs) and the sums its metrics are made of; `denom` (the batch's tokens, or pairs) is
    known before the first microbatch, so the result is the gradient of the whole batch's mean.
    """
    micro = split_microbatches(batch, num_microbatches)
    fp8 = fp8 or {}
    prescale = 1.0 / denom if fp8 else 1.0

    def scaled(p: PyTree, f: PyTree, mb: Batch, rng: jax.Array):
        objective, aux = sums_fn(p, f, mb, rng)
        return objective * prescale, aux

    grad_fn = jax.value_and_grad(scaled, argnums=(0, 1), has_aux=True)
    abstract_metrics, abstract_summaries = jax.eval_shape(
        lambda p, mb: sums_fn(p, fp8, mb, dropout_rng)[1], params,
        jax.tree.map(lambda x: x[0], micro))

    Carry = tuple[PyTree, dict[str, jax.Array], dict[str, jax.Array], PyTree]

    def body(carry: Carry, xs: tuple[jax.Array, Batch]) -> tuple[Carry, None]:
        grads_acc, metrics_acc, summaries_acc, fp8_acc = carry
        index, mb = xs
        mb = {  # each microbatch spread over data x fsdp x expert, as the whole batch was
            key: nn.with_logical_constraint(x, ("activation_batch",) + (None,) * (x.ndim - 1))
            for key, x in mb.items()
        }
        # A different dropout mask per microbatch, and a function of (step, microbatch) only.
        (_, (metrics, summaries)), (grads, new_fp8) = grad_fn(
            params, fp8, mb, jax.random.fold_in(dropout_rng, index))
        grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
        metrics_acc = jax.tree.map(jnp.add, metrics_acc, metrics)
        summaries_acc = jax.tree.map(jnp.add, summaries_acc, summaries)
        fp8_acc = _max_merge(fp8_acc, new_fp8)
        return (grads_acc, metrics_acc, summaries_acc, fp8_acc), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    zero = jnp.zeros((), jnp.float32)
    lowest = jax.tree.map(lambda f: jnp.full(f.shape, -jnp.inf, f.dtype), fp8)
    # Summaries are scalars, except the routers' counts (a tree of [E] arrays: models/sown.py).
    summary_zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), abstract_summaries)
    init = (zeros, {k: zero for k in abstract_metrics}, summary_zeros, lowest)
    (grad_sums, metric_sums, summary_sums, new_fp8), _ = jax.lax.scan(
        body, init, (jnp.arange(num_microbatches), micro)
    )
    grad_denom = 1.0 if fp8 else denom  # already divided before differentiating
    grads = jax.tree.map(lambda g, p: (g / grad_denom).astype(p.dtype), grad_sums, params)
    return metric_sums, grads, summary_sums, new_fp8
