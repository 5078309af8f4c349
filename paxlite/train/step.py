"""Pure train and eval steps, and their jitted, sharded forms.

`train_step` and `eval_step` are plain functions of (state, batch); `compile_steps` jits them once
with explicit input/output shardings (parameters and optimizer state by the logical-axis rules,
batches over data x fsdp x expert, metrics replicated) and donates the train state, so a step
updates parameters in place.

With a `trainable` predicate over parameter paths (LoRA: only the adapters, Pax's
`bprop_variable_inclusion`), the step differentiates with respect to the trainable subtree only
and the optimizer state holds only its leaves; the other parameters pass through unchanged.

FP8 models (TransformerConfig.fp8) carry their scales and amax histories in `TrainState.fp8` (the
model's `_overwrite_with_gradient` collection): differentiated beside the parameters, because
Flax's FP8 ops return each new scale / history as its "gradient", and overwritten with it; never
seen by the optimizer, weight decay, clipping or the reported grad norm (docs/fp8.md).

The losses a step computes are in train/losses.py, the gradient accumulation over microbatches in
train/grad_accum.py.
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

from paxlite.parallel import rules as rules_lib
from paxlite.train.chunked_loss import check_chunk_size, chunked_row_sums
from paxlite.train.dpo import (
    SIDE_KEYS,
    DpoSteps,
    pair_mask,
    pair_rows,
)
from paxlite.train.dpo_step import pair_loss_and_grads
from paxlite.train.grad_accum import accumulated_loss_and_grads, check_accum_steps
from paxlite.train.losses import (
    apply_model,
    choice_correct,
    fp8_collection,
    loss_fn,
    pair_logps,
    pair_side_logps,
    per_example_scores,
    projection,
)
from paxlite.train.optimizer import global_norm
from paxlite.train.persistent_cache import cache_safe
from paxlite.train.router_bias import apply_bias_update

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
    dpo_beta: float | None = None,
    reference: PyTree | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on a global batch.

    With `grad_accum_steps` = K > 1 the batch is processed as K microbatches of B/K rows (see
    `grad_accum.split_microbatches`); the update and the metrics are still the whole batch's. With
    `trainable`, only those parameters are differentiated and updated (`state.opt_state` covers only
    them); the others are returned as they came, and `grad_norm` is the norm of the trainable
    gradients. `loss` is the cross entropy (what eval/loss measures); the gradient is that of the
    whole objective (plus z-loss and the model's auxiliary losses), and the model's summaries are
    returned as metrics beside it (``moe/aux_loss``, ...). The FP8 state is overwritten with its
    "gradient" (the updated scales and histories) and enters neither the optimizer nor the norm.

    With `dpo_beta` the batch holds preference pairs and the objective is DPO's (train/dpo.py):
    `loss` is the DPO loss, `accuracy` the token accuracy of both sides, and the `dpo/` metrics
    ride along; `reference` holds the reference parameters (None: the trainable parameters set
    to zero, which for LoRA is the base model).
    """
    dropout_rng = jax.random.fold_in(dropout_key, state.step)
    train_params, combine = state.params, _identity
    if trainable is not None:
        train_params, frozen = split_trainable(state.params, trainable)
        combine = functools.partial(join_params, frozen=frozen)

    if dpo_beta is not None:
        if reference is None:  # the adapters off: no second copy of the base parameters
            reference = combine(jax.tree.map(jnp.zeros_like, train_params))
        loss, accuracy, grads, summaries, new_fp8 = pair_loss_and_grads(
            state, batch, train_params, combine=combine, model=model, reference=reference,
            beta=dpo_beta, dropout_rng=dropout_rng, deterministic=deterministic,
            grad_accum_steps=grad_accum_steps, z_loss_weight=z_loss_weight,
            loss_chunk_size=loss_chunk_size)
    elif grad_accum_steps == 1:
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
        loss, accuracy, grads, summaries, new_fp8 = accumulated_loss_and_grads(
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
    # DeepSeek-V3's choice biases move by the step's routing counts (train/router_bias.py)
    params, summaries = apply_bias_update(params, summaries, model)
    metrics = {
        **summaries,
        "loss": loss,
        "accuracy": accuracy,
        "grad_norm": global_norm(grads),
        "learning_rate": jnp.asarray(schedule(state.step), jnp.float32),
    }
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state, fp8=new_fp8), metrics


def eval_step(
    params: PyTree,
    batch: Batch,
    *,
    model: nn.Module,
    loss_chunk_size: int | None = None,
    fp8: PyTree | None = None,
    dpo_beta: float | None = None,
    reference: PyTree | None = None,
) -> dict[str, jax.Array]:
    """Per-row scores of one evaluation batch; with `dpo_beta` (a batch of preference pairs) each
    row's DPO terms too (train/dpo.py `pair_rows`), against the `reference` parameters."""
    def row_scores(logits: jax.Array, pos: Batch) -> dict[str, jax.Array]:
        scores = per_example_scores(logits, pos)
        if "yn_tokens" in batch:  # a two-way choice per row (BoolQ): Pax's boolq_acc numerator
            scores["choice_correct"] = choice_correct(
                logits, {**pos, "yn_tokens": batch["yn_tokens"]}
            )
        if dpo_beta is not None:
            scores.update(pair_side_logps(logits, pos))
        return scores

    head = apply_model(model, params, batch, dropout_rng=None, deterministic=True,
                       return_hidden=loss_chunk_size is not None, fp8=fp8)
    if loss_chunk_size is None:
        scores = row_scores(head, batch)
    else:
        keys = ("targets", "weights") + (("segment_ids",) if dpo_beta is not None else ())
        scores = chunked_row_sums(
            params, head, {key: batch[key] for key in keys},
            project=projection(model), score_fn=row_scores, chunk_size=loss_chunk_size)
    if dpo_beta is not None:
        policy = {key: scores.pop(key) for key in SIDE_KEYS}
        ref = pair_logps(model, reference, batch, loss_chunk_size=loss_chunk_size, fp8=fp8)
        scores.update(pair_rows(policy, ref, rows=pair_mask(batch), beta=dpo_beta))
    if "example_weights" in batch:  # which rows are real examples (0: padding that fills a batch)
        scores["example_weights"] = batch["example_weights"].astype(jnp.float32)
    return scores


@dataclasses.dataclass(frozen=True)
class CompiledSteps:
    """The jitted functions of one run and the shardings they were built for."""

    init: Callable[[], TrainState]
    # init_with(restored): init()'s state with the parameters of `restored` (a subset of the params
    # tree, sharded as the state's; donated) in place of fresh ones, which are never sampled; the
    # optimizer state is that of the joined parameters.
    init_with: Callable[[PyTree], TrainState]
    train: Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]
    # train_voting(state, batch, votes) -> (state, metrics, stop): `train` that also reduces the
    # processes' stop flags (int32 [devices], laid out by vote_sharding) to their maximum, inside
    # the same program; a multi-process loop runs it instead of `train` (train/preemption.py).
    train_voting: Callable[
        [TrainState, Batch, jax.Array], tuple[TrainState, dict[str, jax.Array], jax.Array]
    ]
    vote_sharding: jax.sharding.NamedSharding
    # eval(params, batch, fp8=state.fp8): an FP8 model needs its scaling state to run forward.
    eval: Callable[..., dict[str, jax.Array]]
    # True when every parameter is finite (checked before saving)
    all_finite: Callable[[PyTree], jax.Array]
    state_shardings: TrainState
    # ShapeDtypeStructs carrying the shardings (checkpoint restore target)
    abstract_state: TrainState
    batch_sharding: jax.sharding.NamedSharding
    # DPO with a reference of its own (train/dpo.py): the reference parameters' abstract arrays,
    # which train, train_voting and eval take as their last argument until `with_reference`
    # binds them; () otherwise.
    abstract_reference: tuple[PyTree, ...] = ()

    def with_reference(self, reference: PyTree) -> CompiledSteps:
        """These steps with the DPO reference parameters bound: called as without DPO."""
        if not self.abstract_reference:
            raise ValueError("these steps take no reference parameters")

        def bind(fn):
            return lambda *args: fn(*args, reference)

        return dataclasses.replace(
            self, train=bind(self.train), train_voting=bind(self.train_voting),
            eval=lambda params, batch, fp8=None: self.eval(params, batch, fp8, reference),
            abstract_reference=())


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
    dpo: DpoSteps | None = None,
) -> CompiledSteps:
    """Build the sharded init/train/eval functions. Call the results inside `jax.set_mesh(mesh)`.

    `grad_accum_steps` > 1 makes each train step accumulate gradients over that many microbatches of
    its global batch (whose size must then divide by grad_accum_steps x data x fsdp x expert;
    see `microbatch_size`). `trainable` (a predicate over '/'-joined parameter paths) freezes every
    parameter it rejects: no gradient, no optimizer state, passed through each step unchanged.
    `loss_chunk_size` (positions per block; None: all) computes the loss of train and eval steps
    without materialising the [B, T, V] logits (train/chunked_loss.py). `dpo`: the train and/or
    eval batches are preference pairs (train/dpo.py); with a reference of its own, the steps take
    its parameters last (`CompiledSteps.with_reference`).
    """
    check_accum_steps(grad_accum_steps, name="grad_accum_steps")
    check_chunk_size(loss_chunk_size)
    # The keys are made inside the traced functions, not here: an eager key is an array on this
    # process's devices, which a compile-only mesh (a GPU or TPU target: parallel/compile_targets/)
    # lacks.
    def params_key() -> jax.Array:
        return jax.random.key(seed)

    def dropout_key() -> jax.Array:
        return jax.random.fold_in(jax.random.key(seed), 1)

    def boxed_variables():
        # One row per batch shard: a kernel run per shard (Pallas attention's shard_map) cannot
        # split a single row over data x fsdp x expert; the parameters do not depend on the rows.
        dummy_tokens = jnp.zeros((rules_lib.batch_split(mesh), seq_len), jnp.int32)
        variables = model.init({"params": params_key()}, dummy_tokens)
        return variables["params"], dict(variables.get(fp8_collection(model), {}))

    with nn.logical_axis_rules(logical_rules):
        abstract_boxed, abstract_fp8 = jax.eval_shape(boxed_variables)
    abstract_params = nn.meta.unbox(abstract_boxed)
    param_shardings = rules_lib.logical_to_shardings(
        nn.get_partition_spec(abstract_boxed), mesh, logical_rules, shapes=abstract_params
    )
    rules_lib.check_divisible(abstract_params, param_shardings, mesh)
    replicated = rules_lib.replicated(mesh)
    # FP8 scales and histories are tiny and read whole by every matmul: replicated, no logical axes.
    fp8_shardings = jax.tree.map(lambda _: replicated, abstract_fp8)

    def trained(params: PyTree) -> PyTree:
        return params if trainable is None else split_trainable(params, trainable)[0]

    if not jax.tree.leaves(trained(abstract_params)):
        raise ValueError("the trainable-parameter filter accepts no parameter: nothing would train")
    abstract_opt_state = jax.eval_shape(optimizer.init, trained(abstract_params))
    opt_shardings = optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        abstract_opt_state,
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

    def init_state_with(restored: PyTree) -> TrainState:
        boxed, fp8 = boxed_variables()
        params = join_params(restored, nn.meta.unbox(boxed))
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=optimizer.init(trained(params)), fp8=fp8)

    # The parameters `restored` gives are never sampled: their initialisers' outputs are unused, so
    # the traced program drops them (a run from CHECKPOINT_RESTORE_PATH compiles and runs the random
    # init of only what the checkpoint does not hold: LoRA adapters, ignored parameters). Donated:
    # the state's parameters are the restored buffers, not copies of them.
    init_with = jax.jit(
        _with_rules(init_state_with, logical_rules, name="init_state"),
        out_shardings=state_shardings, donate_argnums=(0,),
    )
    # From the shapes traced above, not from `init.eval_shape()`: that would trace the model's
    # init a second time, which a plan (it compiles the steps and never runs init) pays for
    # nothing; a run traces init once, when it calls it.
    abstract_state = jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params,
                   opt_state=abstract_opt_state, fp8=abstract_fp8),
        state_shardings,
    )
    batch_sharding = rules_lib.batch_sharding(mesh)
    separate_reference = dpo is not None and dpo.separate_reference
    # The DPO reference's parameters, sharded as the parameters (never donated: every step reads
    # them); none without DPO, or with the adapters-off reference.
    reference_shardings = (param_shardings,) if separate_reference else ()
    train_beta = dpo.beta if dpo is not None and dpo.train else None
    eval_beta = dpo.beta if dpo is not None and dpo.eval else None

    def step_fn(state: TrainState, batch: Batch,
                *reference: PyTree) -> tuple[TrainState, dict[str, jax.Array]]:
        return train_step(
            state, batch, model=model, optimizer=optimizer, schedule=schedule,
            dropout_key=dropout_key(), deterministic=deterministic,
            grad_accum_steps=grad_accum_steps, trainable=trainable, z_loss_weight=z_loss_weight,
            loss_chunk_size=loss_chunk_size, dpo_beta=train_beta,
            reference=reference[0] if reference else None,
        )
    train = jax.jit(
        _with_rules(step_fn, logical_rules, name="train_step"),
        in_shardings=(state_shardings, batch_sharding, *reference_shardings),
        out_shardings=(state_shardings, replicated),
        donate_argnums=(0,),
    )
    # One element per device, over every mesh axis: each process fills its own devices' elements.
    vote_sharding = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))

    def step_and_vote(state: TrainState, batch: Batch, votes: jax.Array, *reference: PyTree):
        new_state, metrics = step_fn(state, batch, *reference)
        return new_state, metrics, jnp.max(votes)  # [devices] -> []: any process asked to stop

    train_voting = jax.jit(
        _with_rules(step_and_vote, logical_rules, name="train_step"),
        in_shardings=(state_shardings, batch_sharding, vote_sharding, *reference_shardings),
        out_shardings=(state_shardings, replicated, replicated),
        donate_argnums=(0,),
    )

    def eval_fn(params: PyTree, batch: Batch, fp8: PyTree, *reference: PyTree):
        if eval_beta is not None and not reference:  # the adapters off (LoRA): the base model
            adapters, frozen = split_trainable(params, trainable)
            reference = (join_params(jax.tree.map(jnp.zeros_like, adapters), frozen),)
        return eval_step(params, batch, model=model, loss_chunk_size=loss_chunk_size, fp8=fp8,
                         dpo_beta=eval_beta, reference=reference[0] if reference else None)

    evaluate_jit = jax.jit(
        _with_rules(eval_fn, logical_rules, name="eval_step"),
        # Batches arrive as global arrays already laid out by the feed (rows over data x fsdp x
        # expert).
        in_shardings=(param_shardings, None, fp8_shardings, *reference_shardings),
        out_shardings=replicated,
    )

    def evaluate(params: PyTree, batch: Batch, fp8: PyTree | None = None,
                 *reference: PyTree) -> dict[str, jax.Array]:
        if fp8 is None:
            if jax.tree.leaves(abstract_fp8):
                raise ValueError("this model runs FP8 matmuls: pass its scaling state, "
                                 "eval(params, batch, fp8=state.fp8)")
            fp8 = {}
        return evaluate_jit(params, batch, fp8, *reference)

    all_finite = jax.jit(
        lambda params: jnp.all(
            jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)])
        ),
        in_shardings=(param_shardings,),
        out_shardings=replicated,
    )
    train, train_voting, evaluate_jit = (
        cache_safe(f, mesh) for f in (train, train_voting, evaluate_jit)
    )
    return CompiledSteps(
        init=init,
        init_with=init_with,
        train=train,
        train_voting=train_voting,
        vote_sharding=vote_sharding,
        eval=evaluate,
        all_finite=all_finite,
        state_shardings=state_shardings,
        abstract_state=abstract_state,
        batch_sharding=batch_sharding,
        abstract_reference=(abstract_state.params,) if separate_reference else (),
    )
