"""Gradient accumulation: K microbatches give the one-batch update exactly, sharded or not.

Rows carry different numbers of weighted tokens, so only the gradient of the batch's mean loss
(sums of token losses over one token count) matches; a naive mean of microbatch means is shown to
differ.
"""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from paxlite.config.errors import ConfigError
from paxlite.experiments.build import build_run_config, load_experiment
from paxlite.models.transformer import Transformer, TransformerConfig, abstract_variables
from paxlite.parallel.mesh import MeshConfig, build_mesh
from paxlite.train.grad_accum import microbatch_size, split_microbatches
from paxlite.train.loop import Run, RunContext
from paxlite.train.losses import loss_fn
from paxlite.train.step import TrainState, compile_steps

SEQ = 8
CFG = TransformerConfig(vocab_size=32, num_layers=1, model_dims=16, num_heads=2, dims_per_head=8,
                        hidden_dims=32, max_seq_len=SEQ)
LR = 1.0  # plain SGD: the update is -LR x gradient, so comparing updates compares gradients


def _batch(rows: int, *, seed: int) -> dict[str, np.ndarray]:
    """Random tokens; row r has (3r mod SEQ) + 1 weighted positions, and two rows none at all."""
    rng = np.random.default_rng(seed)
    lengths = (3 * np.arange(rows)) % SEQ + 1
    lengths[[1, rows - 2]] = 0
    weights = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.float32)
    return {
        "inputs": rng.integers(0, CFG.vocab_size, (rows, SEQ), dtype=np.int32),
        "targets": rng.integers(0, CFG.vocab_size, (rows, SEQ), dtype=np.int32),
        "weights": weights,
    }


@functools.cache
def _params0():
    """Random float32 params (scales near 1, the rest N(0, 0.1)); a real init compiles slowly."""
    rng = np.random.default_rng(7)

    def leaf(path, shape):
        noise = rng.normal(size=shape.shape)
        return (1.0 + 0.1 * noise if path[-1].key == "scale" else 0.1 * noise).astype(np.float32)

    return jax.tree_util.tree_map_with_path(leaf, nn.meta.unbox(abstract_variables(CFG))["params"])


def _one_step(batch, *, mesh, grad_accum_steps: int):
    """(initial params, params after one SGD step, metrics), all on the host."""
    schedule = optax.constant_schedule(LR)
    optimizer = optax.sgd(schedule)
    with jax.set_mesh(mesh):
        steps = compile_steps(
            model=Transformer(CFG), optimizer=optimizer, schedule=schedule, mesh=mesh,
            seq_len=SEQ, seed=3, deterministic=True, grad_accum_steps=grad_accum_steps,
        )
        params0 = _params0()
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params0,
                           opt_state=optimizer.init(params0))
        state, metrics = steps.train(jax.device_put(state, steps.state_shardings), batch)
        return params0, jax.device_get(state.params), jax.device_get(metrics)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _assert_same_update(got, ref, params0) -> None:
    """Updated params to 1e-6 relative, and the updates themselves (the gradients) to 1e-5."""
    flat_ref = jax.tree_util.tree_leaves_with_path(ref)
    flat_got, flat_p0 = jax.tree.leaves(got), jax.tree.leaves(params0)
    assert len(flat_got) == len(flat_ref) > 10
    scale = np.sqrt(sum(np.sum((np.asarray(r) - p) ** 2) for (_, r), p in zip(flat_ref, flat_p0)))
    for (path, r), g, p in zip(flat_ref, flat_got, flat_p0):
        name = jax.tree_util.keystr(path)
        assert _rel(g, r) < 1e-6, name
        # Leaves whose exact gradient is zero (the key bias) are judged against the whole update.
        diff = np.linalg.norm(np.asarray(g, np.float64) - r)
        assert diff < 1e-5 * max(np.linalg.norm(np.asarray(r, np.float64) - p), 1e-2 * scale), name


def _one_device_mesh():
    return build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1)), devices=jax.devices()[:1])


def test_split_is_strided_so_each_microbatch_stays_on_every_device():
    rows = np.arange(8)[:, None] * np.ones((1, 3), np.int32)
    micro = jax.device_get(split_microbatches({"inputs": jnp.asarray(rows)}, 4)["inputs"])
    assert micro.shape == (4, 2, 3)
    np.testing.assert_array_equal(micro[:, :, 0], [[0, 4], [1, 5], [2, 6], [3, 7]])


@pytest.fixture(scope="module")
def one_batch_reference():
    """K = 1 on one device: the reference for every accumulated run below."""
    batch = _batch(8, seed=0)
    return batch, _one_step(batch, mesh=_one_device_mesh(), grad_accum_steps=1)


def test_four_microbatches_equal_one_batch_with_uneven_token_counts(one_batch_reference):
    batch, (params0, ref, ref_metrics) = one_batch_reference
    _, got, metrics = _one_step(batch, mesh=_one_device_mesh(), grad_accum_steps=4)
    _assert_same_update(got, ref, params0)
    for key in ("loss", "accuracy", "grad_norm", "learning_rate"):
        np.testing.assert_allclose(metrics[key], ref_metrics[key], rtol=1e-6, err_msg=key)

    # Independent check that the data would catch a naive mean of microbatch means.
    micro_rows = [np.arange(k, 8, 4) for k in range(4)]  # the strided split's rows
    grad_fn = jax.jit(jax.grad(lambda p, b: loss_fn(p, b, model=Transformer(CFG))[0]))
    naive = jax.tree.map(
        lambda *gs: sum(gs) / 4,
        *[grad_fn(params0, {k: v[rows] for k, v in batch.items()}) for rows in micro_rows],
    )
    true_grad = jax.tree.map(lambda p, r: (p - r) / LR, params0, ref)
    errors = [_rel(n, t) for n, t in zip(jax.tree.leaves(naive), jax.tree.leaves(true_grad))]
    assert max(errors) > 1e-2, "the batch does not discriminate mean-of-means from the true mean"
    # And the token-weighted loss differs from the mean of per-microbatch mean losses.
    weights = batch["weights"]
    assert len({weights[rows].sum() for rows in micro_rows}) > 1


def test_sharded_accumulation_matches_one_device(one_batch_reference):
    """(2,2,2) mesh, params FSDP x tensor sharded: 2 microbatches of 4 rows, a row per batch
    shard."""
    batch, (params0, ref, ref_metrics) = one_batch_reference
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(2, 2, 2)))
    _, got, metrics = _one_step(batch, mesh=mesh, grad_accum_steps=2)
    _assert_same_update(got, ref, params0)
    for key in ("loss", "accuracy", "grad_norm"):
        np.testing.assert_allclose(metrics[key], ref_metrics[key], rtol=1e-6, err_msg=key)


def test_bad_grad_accum_steps_are_refused_with_valid_choices(tmp_path):
    assert microbatch_size(global_batch_size=16, grad_accum_steps=4, batch_split=4) == 4
    with pytest.raises(ValueError, match=r"GRAD_ACCUM_STEPS=3 .* 16 rows .* Valid GRAD_ACCUM_STEPS "
                                         r"here: 1, 2, 4; .* 3 x 4 = 12"):
        microbatch_size(global_batch_size=16, grad_accum_steps=3, batch_split=4)
    with pytest.raises(ValueError, match=r"=8 .* multiple of 4\. Valid .* 1, 2, 4;"):
        microbatch_size(global_batch_size=16, grad_accum_steps=8, batch_split=4)
    with pytest.raises(ValueError, match=r"must be an integer >= 1 \(1: no accumulation\), got 0"):
        microbatch_size(global_batch_size=16, grad_accum_steps=0, batch_split=1)
    with pytest.raises(ValueError, match=r"grad_accum_steps must be an integer >= 1 .*got 0"):
        compile_steps(model=Transformer(CFG), optimizer=optax.sgd(1.0),
                      schedule=optax.constant_schedule(1.0), mesh=_one_device_mesh(), seq_len=SEQ,
                      seed=0, deterministic=True, grad_accum_steps=0)
    with pytest.raises(ConfigError, match="GRAD_ACCUM_STEPS must be >= 1"):
        load_experiment("TinySynthetic", ["GRAD_ACCUM_STEPS=0"])
    # TinySynthetic: global batch 2 x 8 devices = 16 over data = 8: only 1 or 2 microbatches fit.
    _, config = build_run_config("TinySynthetic", ["GRAD_ACCUM_STEPS=4"])
    with pytest.raises(ValueError, match=r"Valid GRAD_ACCUM_STEPS here: 1, 2;"):
        Run(config, RunContext(job_dir=str(tmp_path), enable_checkpoint_saving=False))
    assert not os.listdir(tmp_path)  # refused before anything was compiled or written


def _train_lines(job_dir):
    with open(os.path.join(job_dir, "metrics.jsonl")) as f:
        return [line for line in map(json.loads, f) if "loss" in line]


def test_hyperparameter_reaches_the_run(tmp_path):
    overrides = ["GRAD_ACCUM_STEPS=2", "MAX_STEPS=2", "SUMMARY_INTERVAL_STEPS=1",
                 "EVAL_INTERVAL_STEPS=1000", "EVAL_LOOP_NUM_BATCHES=1",
                 "CHECKPOINT_EVERY_N_STEPS=1000"]
    _, config = build_run_config("TinySynthetic", overrides)
    assert config.loop.grad_accum_steps == 2
    with Run(config, RunContext(job_dir=str(tmp_path), enable_checkpoint_saving=False)) as run:
        run.train()
        with jax.set_mesh(run.mesh):
            state0 = run.steps.init()
            batch = run.data.train_batch(0, run.steps.batch_sharding)
            # TinySynthetic's layers are unrolled: the only loop in the step is the microbatch scan.
            assert "while" in run.steps.train.lower(state0, batch).as_text()
            model = Transformer(run.config.model)
            loss0 = jax.jit(functools.partial(loss_fn, model=model))(state0.params, batch)[0]
    lines = _train_lines(tmp_path)
    # One metrics line per optimizer step, not per microbatch, with the whole batch's loss.
    assert [line["step"] for line in lines] == [1, 2]
    np.testing.assert_allclose(lines[0]["loss"], float(loss0), rtol=1e-5)
