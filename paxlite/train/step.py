"""Pure train and eval steps, and their jitted, sharded forms.

`train_step` and `eval_step` are plain functions of (state, batch); `compile_steps` jits them once with explicit
input/output shardings (parameters and optimizer state by the logical-axis rules, batches over data x fsdp x
expert, metrics replicated) and donates the train state, so a step updates parameters in place.

With a `trainable` predicate over parameter paths (LoRA: only the adapters, Pax's
`bprop_variable_inclusion`), the step differentiates with respect to the trainable subtree only
and the optimizer state holds only its leaves; the other parameters pass through unchanged.

FP8 models (TransformerConfig.fp8) carry their scales and amax histories in `TrainState.fp8` (the
model's `_overwrite_with_gradient` collection): differentiated beside the parameters, because
Flax's FP8 ops return each new scale / history as its "gradient", and overwritten with it; never
seen by the optimizer, weight decay, clipping or the reported grad norm (docs/fp8.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from paxlite.errors import SettingError
from paxlite.models import sown
from paxlite.models.linear import FP8_COLLECTION
from paxlite.models.te_layer import fp8_state_collections
from paxlite.parallel import rules as rules_lib
from paxlite.train.chunked_loss import check_chunk_size, chunked_row_sums
from paxlite.train.optimizer import global_norm

PyTree = Any
Batch = Mapping[str, jax.Array]
# Which parameters train, by '/'-joined path (e.g. "layers_0/mlp/wi/lora_a"); None: all of them.
Trainable = Callable[[str], bool] | None
_SEP = "/"


def split_trainable(params: PyTree, trainable: Callable[[str], bool]) -> tuple[PyTree, PyTree]:
    """(trainable, frozen): two nested dicts of the parameters whose '/'-joined path `trainable`
    accepts, and of the rest. Works on arrays, abstract arrays and shardings alike."""
    flat = traverse_util.flatten_dict(params, sep=_SEP)
    chosen = {k: v for k, v in flat.items() if trainable(k)}
    rest = {k: v for k, v in flat.items() if not trainable(k)}
    return (traverse_util.unflatten_dict(chosen, sep=_SEP),
            traverse_util.unflatten_dict(rest, sep=_SEP))


def _identity(tree: PyTree) -> PyTree:
    return tree


def join_params(trainable: PyTree, frozen: PyTree) -> PyTree:
    """The inverse of `split_trainable`."""
    flat = traverse_util.flatten_dict(frozen, sep=_SEP)
    flat.update(traverse_util.flatten_dict(trainable, sep=_SEP))
    return traverse_util.unflatten_dict(flat, sep=_SEP)


@flax.struct.dataclass
class TrainState:
    """`step` counts optimizer steps already applied (0 before the first); `fp8` is the FP8
    scaling state (empty without FP8): replicated, checkpointed with the parameters, not trained."""

    step: jax.Array
    params: PyTree
    opt_state: PyTree
    fp8: PyTree = flax.struct.field(default_factory=dict)


def fp8_collection(model: nn.Module) -> str:
    """The collection ``TrainState.fp8`` holds: Transformer Engine's FP8 collection when TE runs
    FP8 (ENABLE_TE + ENABLE_FP8, models/te_layer.py), else native FP8's (models/linear.py). Both
    follow the same rule (state overwritten by its gradient); a model has one or the other."""
    te = fp8_state_collections(model.config)
    return te[0] if te else FP8_COLLECTION


def _variables(model: nn.Module, params: PyTree, fp8: PyTree | None) -> dict[str, PyTree]:
    """The model's variables: parameters, plus the FP8 state when there is any."""
    return {"params": params, **({fp8_collection(model): fp8} if fp8 else {})}


def _max_merge(acc: PyTree, new: PyTree) -> PyTree:
    """FP8 state "gradients" of several microbatches combine by max, never by sum: every
    microbatch starts from the same state, so the scales agree and the histories differ only in
    slot 0 (this step's max|x|), whose max over microbatches is the whole batch's."""
    return jax.tree.map(jnp.maximum, acc, new)


def _apply(model: nn.Module, params, batch: Batch, *, dropout_rng, deterministic: bool,
           collect: bool = False, return_hidden: bool = False, fp8: PyTree | None = None):
    """The model's logits (with ``return_hidden``: its final hidden states, for a chunked loss);
    with ``collect``, (that, sown auxiliary loss, sown summaries by name) for training
    (models/sown.py)."""
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
    return logits, sown.total_aux_loss(state), sown.summary_means(state)


def _project(model: nn.Module) -> Callable[[PyTree, jax.Array], jax.Array]:
    return lambda params, hidden: model.apply({"params": params}, hidden, method="project")


def _train_row_scores(logits: jax.Array, pos: Batch) -> dict[str, jax.Array]:
    """`per_example_scores` plus each row's z-loss sum: what one loss block contributes."""
    log_z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)  # [B, c]
    z_rows = jnp.sum(jnp.square(log_z) * pos["weights"].astype(jnp.float32), axis=-1)
    return {**per_example_scores(logits, pos), "z_loss_sum": z_rows}


def _forward_scores(model: nn.Module, params, batch: Batch, *, dropout_rng, deterministic: bool,
                    loss_chunk_size: int | None, fp8: PyTree | None = None):
    """(per-row scores as `per_example_scores`, z-loss sum, sown auxiliary loss, summaries).

    With `loss_chunk_size` the model stops at its final hidden states and the scores are summed
    over blocks of that many positions (train/chunked_loss.py): the [B, T, V] logits never exist.
    """
    chunked = loss_chunk_size is not None
    head, aux_loss, summaries = _apply(
        model, params, batch, dropout_rng=dropout_rng, deterministic=deterministic, collect=True,
        return_hidden=chunked, fp8=fp8)
    if not chunked:
        return (per_example_scores(head, batch), z_loss_sum(head, batch["weights"]), aux_loss,
                summaries)
    scores = chunked_row_sums(
        params, head, {"targets": batch["targets"], "weights": batch["weights"]},
        project=_project(model), score_fn=_train_row_scores, chunk_size=loss_chunk_size)
    return scores, jnp.sum(scores.pop("z_loss_sum")), aux_loss, summaries


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
    `loss_chunk_size` computes the same from blocks of that many positions (`_forward_scores`).
    `fp8`: the model's FP8 state (its gradient is the updated state)."""
    scores, z_sum, aux_loss, summaries = _forward_scores(
        model, params, batch, dropout_rng=dropout_rng, deterministic=deterministic,
        loss_chunk_size=loss_chunk_size, fp8=fp8)
    loss, metrics = _loss_and_metrics(scores)
    objective = loss + aux_loss
    if z_loss_weight:
        z_loss = z_sum / jnp.maximum(metrics["num_tokens"], 1.0)
        summaries = {**summaries, "moe/z_loss": z_loss}
        objective = objective + z_loss_weight * z_loss
    return objective, {**metrics, "loss": loss, "summaries": summaries}


def _check_accum_steps(value: object, *, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 (1: no accumulation), got {value!r}")
    return value


def microbatch_size(*, global_batch_size: int, grad_accum_steps: int, batch_split: int) -> int:
    """Rows per microbatch; a ValueError naming the numbers and the valid choices if none fits.

    Each microbatch must itself split evenly over the data x fsdp x expert devices (`batch_split`
    ways), so `global_batch_size` must be a multiple of `grad_accum_steps * batch_split`.
    """
    k = _check_accum_steps(grad_accum_steps, name="GRAD_ACCUM_STEPS")
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


def _accumulated_loss_and_grads(
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
    micro = split_microbatches(batch, num_microbatches)
    num_tokens = jnp.sum(batch["weights"].astype(jnp.float32))
    denom = jnp.maximum(num_tokens, 1.0)
    fp8 = fp8 or {}
    prescale = 1.0 / denom if fp8 else 1.0

    def sums(p: PyTree, f: PyTree, mb: Batch, rng: jax.Array):
        scores, z_sum, aux_loss, summaries = _forward_scores(
            model, combine(p), mb, dropout_rng=rng, deterministic=deterministic,
            loss_chunk_size=loss_chunk_size, fp8=f)
        loss_sum = jnp.sum(scores["loss_sum"])
        objective = loss_sum + aux_loss * jnp.sum(scores["target_tokens"])
        if z_loss_weight:
            objective = objective + z_loss_weight * z_sum
            summaries = {**summaries, "moe/z_loss": z_sum}  # a sum here; divided below
        return objective * prescale, (loss_sum, jnp.sum(scores["correct_tokens"]), summaries)

    grad_fn = jax.value_and_grad(sums, argnums=(0, 1), has_aux=True)
    abstract_summaries = jax.eval_shape(
        lambda p, mb: sums(p, fp8, mb, dropout_rng)[1][2], params,
        jax.tree.map(lambda x: x[0], micro))

    Carry = tuple[PyTree, jax.Array, jax.Array, dict[str, jax.Array], PyTree]

    def body(carry: Carry, xs: tuple[jax.Array, Batch]) -> tuple[Carry, None]:
        grads_acc, loss_acc, correct_acc, summaries_acc, fp8_acc = carry
        index, mb = xs
        mb = {  # each microbatch spread over data x fsdp x expert, as the whole batch was
            key: nn.with_logical_constraint(x, ("activation_batch",) + (None,) * (x.ndim - 1))
            for key, x in mb.items()
        }
        # A different dropout mask per microbatch, and a function of (step, microbatch) only.
        (_, (loss_sum, correct, summaries)), (grads, new_fp8) = grad_fn(
            params, fp8, mb, jax.random.fold_in(dropout_rng, index))
        grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
        summaries_acc = jax.tree.map(jnp.add, summaries_acc, summaries)
        fp8_acc = _max_merge(fp8_acc, new_fp8)
        return (grads_acc, loss_acc + loss_sum, correct_acc + correct, summaries_acc, fp8_acc), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    zero = jnp.zeros((), jnp.float32)
    lowest = jax.tree.map(lambda f: jnp.full(f.shape, -jnp.inf, f.dtype), fp8)
    init = (zeros, zero, zero, {k: zero for k in abstract_summaries}, lowest)
    (grad_sums, loss_sum, correct, summary_sums, new_fp8), _ = jax.lax.scan(
        body, init, (jnp.arange(num_microbatches), micro)
    )
    grad_denom = 1.0 if fp8 else denom  # already divided before differentiating
    grads = jax.tree.map(lambda g, p: (g / grad_denom).astype(p.dtype), grad_sums, params)
    summaries = {k: v / num_microbatches for k, v in summary_sums.items()}
    if "moe/z_loss" in summaries:  # summed over tokens: a mean over the batch's tokens
        summaries["moe/z_loss"] = summary_sums["moe/z_loss"] / denom
    return loss_sum / denom, correct / denom, grads, summaries, new_fp8


def train_step(
    state: TrainState,
    batch: Batch,
    *,
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    dropout_key: jax.Array,
    deterministic: bool,
    grad_accum_steps: int = 1,
    trainable: Trainable = None,
    z_loss_weight: float = 0.0,
    loss_chunk_size: int | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on a global batch.

    With `grad_accum_steps` = K > 1 the batch is processed as K microbatches of B/K rows (see
    `split_microbatches`); the update and the metrics are still the whole batch's. With `trainable`,
    only those parameters are differentiated and updated (`state.opt_state` covers only them); the
    others are returned as they came, and `grad_norm` is the norm of the trainable gradients.
    `loss` is the cross entropy (what eval/loss measures); the gradient is that of the whole
    objective (plus z-loss and the model's auxiliary losses), and the model's summaries are
    returned as metrics beside it (``moe/aux_loss``, ...). The FP8 state is overwritten with its
    "gradient" (the updated scales and histories) and enters neither the optimizer nor the norm.
    """
    dropout_rng = jax.random.fold_in(dropout_key, state.step)
    train_params, combine = state.params, _identity
    if trainable is not None:
        train_params, frozen = split_trainable(state.params, trainable)
        combine = functools.partial(join_params, frozen=frozen)

    if grad_accum_steps == 1:
        (_, aux), (grads, new_fp8) = jax.value_and_grad(
            lambda p, f: loss_fn(
                combine(p),
                batch=batch,
                model=model,
                dropout_rng=dropout_rng,
                deterministic=deterministic,
                z_loss_weight=z_loss_weight,
                loss_chunk_size=loss_chunk_size,
                fp8=f,
            ),
            argnums=(0, 1),
            has_aux=True,
        )(train_params, state.fp8)
        loss, accuracy, summaries = aux["loss"], aux["accuracy"], aux["summaries"]
    else:
        loss, accuracy, grads, summaries, new_fp8 = _accumulated_loss_and_grads(
            train_params,
            batch,
            model=model,
            dropout_rng=dropout_rng,
            deterministic=deterministic,
            num_microbatches=grad_accum_steps,
            combine=combine,
            z_loss_weight=z_loss_weight,
            loss_chunk_size=loss_chunk_size,
            fp8=state.fp8,
        )
    updates, opt_state = optimizer.update(grads, state.opt_state, train_params)
    params = combine(optax.apply_updates(train_params, updates))
    metrics = {
        **summaries,
        "loss": loss,
        "accuracy": accuracy,
        "grad_norm": global_norm(grads),
        "learning_rate": jnp.asarray(schedule(state.step), jnp.float32),
    }
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state, fp8=new_fp8), metrics


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

    Pax's BoolQ score (`CustomMetricsLM`, eval_task='boolq'): each row names its two answer tokens in
    `yn_tokens` [B, 2]; at a target position holding one of them, the other is their sum minus the
    label, and the position counts when logit[label] - logit[other] > 0 (a tie loses).
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


def eval_step(params: PyTree, batch: Batch, *, model: nn.Module,
              loss_chunk_size: int | None = None, fp8: PyTree | None = None) -> dict[str, jax.Array]:
    def row_scores(logits: jax.Array, pos: Batch) -> dict[str, jax.Array]:
        scores = per_example_scores(logits, pos)
        if "yn_tokens" in batch:  # a two-way choice per row (BoolQ): Pax's boolq_acc numerator
            scores["choice_correct"] = choice_correct(logits, {**pos, "yn_tokens": batch["yn_tokens"]})
        return scores

    head = _apply(model, params, batch, dropout_rng=None, deterministic=True,
                  return_hidden=loss_chunk_size is not None, fp8=fp8)
    if loss_chunk_size is None:
        scores = row_scores(head, batch)
    else:
        scores = chunked_row_sums(
            params, head, {"targets": batch["targets"], "weights": batch["weights"]},
            project=_project(model), score_fn=row_scores, chunk_size=loss_chunk_size)
    if "example_weights" in batch:  # which rows are real examples (0: padding that fills a batch)
        scores["example_weights"] = batch["example_weights"].astype(jnp.float32)
    return scores


@dataclasses.dataclass(frozen=True)
class CompiledSteps:
    """The jitted functions of one run and the shardings they were built for."""

    init: Callable[[], TrainState]
    train: Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]
    # train_voting(state, batch, votes) -> (state, metrics, stop): `train` that also reduces the
    # processes' stop flags (int32 [devices], laid out by vote_sharding) to their maximum, inside the
    # same program; a multi-process loop runs it instead of `train` (train/preemption.py).
    train_voting: Callable[[TrainState, Batch, jax.Array], tuple[TrainState, dict[str, jax.Array], jax.Array]]
    vote_sharding: jax.sharding.NamedSharding
    # eval(params, batch, fp8=state.fp8): an FP8 model needs its scaling state to run forward.
    eval: Callable[..., dict[str, jax.Array]]
    all_finite: Callable[[PyTree], jax.Array]  # True when every parameter is finite (checked before saving)
    state_shardings: TrainState
    abstract_state: TrainState  # ShapeDtypeStructs carrying the shardings (checkpoint restore target)
    batch_sharding: jax.sharding.NamedSharding


def _with_rules(fn, logical_rules, *, name: str):
    """Trace `fn` under the logical-axis rules; `name` is what compile logs and profiles show."""

    def wrapped(*args, **kwargs):
        with nn.logical_axis_rules(logical_rules):
            return fn(*args, **kwargs)

    wrapped.__name__ = wrapped.__qualname__ = name
    return wrapped


def compile_steps(
    *,
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    mesh: Mesh,
    seq_len: int,
    seed: int,
    deterministic: bool,
    logical_rules: rules_lib.LogicalRules = rules_lib.DEFAULT_RULES,
    grad_accum_steps: int = 1,
    trainable: Trainable = None,
    z_loss_weight: float = 0.0,
    loss_chunk_size: int | None = None,
) -> CompiledSteps:
    """Build the sharded init/train/eval functions. Call the results inside `jax.set_mesh(mesh)`.

    `grad_accum_steps` > 1 makes each train step accumulate gradients over that many microbatches of
    its global batch (whose size must then divide by grad_accum_steps x data x fsdp x expert;
    see `microbatch_size`). `trainable` (a predicate over '/'-joined parameter paths) freezes every
    parameter it rejects: no gradient, no optimizer state, passed through each step unchanged.
    `loss_chunk_size` (positions per block; None: all) computes the loss of train and eval steps
    without materialising the [B, T, V] logits (train/chunked_loss.py).
    """
    _check_accum_steps(grad_accum_steps, name="grad_accum_steps")
    check_chunk_size(loss_chunk_size)
    params_key = jax.random.key(seed)
    dropout_key = jax.random.fold_in(jax.random.key(seed), 1)
    dummy_tokens = jnp.zeros((1, seq_len), jnp.int32)

    def boxed_variables():
        variables = model.init({"params": params_key}, dummy_tokens)
        return variables["params"], dict(variables.get(fp8_collection(model), {}))

    with nn.logical_axis_rules(logical_rules):
        abstract_boxed, abstract_fp8 = jax.eval_shape(boxed_variables)
    param_shardings = rules_lib.logical_to_shardings(
        nn.get_partition_spec(abstract_boxed), mesh, logical_rules
    )
    abstract_params = nn.meta.unbox(abstract_boxed)
    rules_lib.check_divisible(abstract_params, param_shardings, mesh)
    replicated = rules_lib.replicated(mesh)
    # FP8 scales and histories are tiny and read whole by every matmul: replicated, no logical axes.
    fp8_shardings = jax.tree.map(lambda _: replicated, abstract_fp8)

    def trained(params: PyTree) -> PyTree:
        return params if trainable is None else split_trainable(params, trainable)[0]

    if not jax.tree.leaves(trained(abstract_params)):
        raise ValueError("the trainable-parameter filter accepts no parameter: nothing would train")
    opt_shardings = optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        jax.eval_shape(optimizer.init, trained(abstract_params)),
        trained(param_shardings),
        transform_non_params=lambda _: replicated,
    )
    state_shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings,
                                 fp8=fp8_shardings)

    def init_state() -> TrainState:
        boxed, fp8 = boxed_variables()
        params = nn.meta.unbox(boxed)
        return TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(trained(params)),
            fp8=fp8,
        )

    init = jax.jit(
        _with_rules(init_state, logical_rules, name="init_state"), out_shardings=state_shardings
    )
    abstract_state = jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        jax.eval_shape(init_state),
        state_shardings,
    )
    batch_sharding = rules_lib.batch_sharding(mesh)
    step_fn = functools.partial(
        train_step,
        model=model,
        optimizer=optimizer,
        schedule=schedule,
        dropout_key=dropout_key,
        deterministic=deterministic,
        grad_accum_steps=grad_accum_steps,
        trainable=trainable,
        z_loss_weight=z_loss_weight,
        loss_chunk_size=loss_chunk_size,
    )
    train = jax.jit(
        _with_rules(step_fn, logical_rules, name="train_step"),
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, replicated),
        donate_argnums=(0,),
    )
    # One element per device, over every mesh axis: each process fills its own devices' elements.
    vote_sharding = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))

    def step_and_vote(state: TrainState, batch: Batch, votes: jax.Array):
        new_state, metrics = step_fn(state, batch)
        return new_state, metrics, jnp.max(votes)  # [devices] -> []: any process asked to stop

    train_voting = jax.jit(
        _with_rules(step_and_vote, logical_rules, name="train_step"),
        in_shardings=(state_shardings, batch_sharding, vote_sharding),
        out_shardings=(state_shardings, replicated, replicated),
        donate_argnums=(0,),
    )
    evaluate_jit = jax.jit(
        _with_rules(lambda params, batch, fp8: eval_step(
            params, batch, model=model, loss_chunk_size=loss_chunk_size, fp8=fp8),
                    logical_rules, name="eval_step"),
        # Batches arrive as global arrays already laid out by the feed (rows over data x fsdp x
        # expert).
        in_shardings=(param_shardings, None, fp8_shardings),
        out_shardings=replicated,
    )

    def evaluate(params: PyTree, batch: Batch, fp8: PyTree | None = None) -> dict[str, jax.Array]:
        if fp8 is None:
            if jax.tree.leaves(abstract_fp8):
                raise ValueError("this model runs FP8 matmuls: pass its scaling state, "
                                 "eval(params, batch, fp8=state.fp8)")
            fp8 = {}
        return evaluate_jit(params, batch, fp8)
    all_finite = jax.jit(
        lambda params: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)])),
        in_shardings=(param_shardings,),
        out_shardings=replicated,
    )
    return CompiledSteps(
        init=init,
        train=train,
        train_voting=train_voting,
        vote_sharding=vote_sharding,
        eval=evaluate,
        all_finite=all_finite,
        state_shardings=state_shardings,
        abstract_state=abstract_state,
        batch_sharding=batch_sharding,
    )
