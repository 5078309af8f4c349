"""The first loss, its gradients and the losses of a few real train steps, for the tests that
compare a sharded run with a one-device run (test_sharded_equivalence.py,
test_pipeline_seq_training.py).

The gradients come out of the train step itself: its optimizer keeps the gradients of its last
update beside its own state. So each side compiles one program, its train step, and not also a
value-and-grad program of the same model, whose tracing and compiling on 8 CPU devices cost about
as much again; and the gradients compared are the ones the optimizer was given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from paxlite.data.context_order import balance_batch_for_seq
from paxlite.data.synthetic import SyntheticData
from paxlite.models.transformer import Transformer
from paxlite.train.optimizer import make_optimizer
from paxlite.train.schedules import make_schedule
from paxlite.train.step import TrainState, compile_steps


def recording_gradients(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
    """`optimizer` with the state (its own state, the gradients of the last update). The gradients
    are a tree of the parameters' shapes, so compile_steps shards them as the parameters."""

    def init(params):
        return optimizer.init(params), optax.tree_utils.tree_zeros_like(params)

    def update(grads, state, params=None):
        updates, inner = optimizer.update(grads, state[0], params)
        return updates, (inner, grads)

    return optax.GradientTransformation(init, update)


def loss_grads_and_losses(
    run: Any,
    mesh: jax.sharding.Mesh,
    *,
    global_batch: int,
    num_steps: int,
    initial_params: Callable[[Any], Any] | None = None,
    seq_shards: int = 1,
) -> tuple[Any, float, Any, list[float]]:
    """(parameters before the first step, its loss and gradients, the losses of `num_steps` steps)
    on host. `initial_params`: None for compile_steps's init, or a function of the abstract
    parameters returning host arrays to start from (with the optimizer's initial state).
    `seq_shards` > 1 feeds the batches in the train loop's load-balanced order for that many."""
    model = Transformer(run.model)
    schedule = make_schedule(run.schedule)
    optimizer = recording_gradients(make_optimizer(run.optimizer, schedule))
    data = SyntheticData(run.data, global_batch_size=global_batch)
    with jax.set_mesh(mesh):
        steps = compile_steps(model=model, optimizer=optimizer, schedule=schedule, mesh=mesh,
                              seq_len=run.data.seq_len, seed=run.loop.seed, deterministic=True,
                              grad_accum_steps=run.loop.grad_accum_steps,
                              loss_chunk_size=run.loop.loss_chunk_size)
        if initial_params is None:
            state = steps.init()
        else:
            host = initial_params(steps.abstract_state.params)
            state = jax.device_put(
                TrainState(step=np.zeros((), np.int32), params=host,
                           # one program, not an eager op (and a compile) per state leaf
                           opt_state=jax.jit(optimizer.init)(host)),
                steps.state_shardings)
        params = jax.device_get(state.params)
        losses, grads = [], None
        for index in range(num_steps):
            batch = balance_batch_for_seq(data.train_batch(index, steps.batch_sharding),
                                          seq_shards=seq_shards)
            state, metrics = steps.train(state, batch)
            losses.append(float(metrics["loss"]))
            if grads is None:  # the first step's: at the parameters above, on the first batch
                grads = jax.device_get(state.opt_state[1])
    return params, losses[0], grads, losses
