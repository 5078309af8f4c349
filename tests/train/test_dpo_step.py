"""The DPO train and eval steps (train/dpo.py, train/step.py) on hand-made pair batches.

The reference is a DPO loss written out here from the model's logits: log-softmax, the learned
positions of each side summed by segment, -log sigmoid(beta x ((pi_c - ref_c) - (pi_r - ref_r))),
its gradient by jax.grad; the metrics in float64 NumPy. Plain SGD with rate 1, so comparing updates
compares gradients. Then: gradient accumulation, a data x fsdp x tensor mesh and the LoRA
adapters-off reference each give the same step.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from paxlite.models.lora import is_lora_path
from paxlite.models.transformer import Transformer, TransformerConfig, abstract_variables
from paxlite.parallel.mesh import MeshConfig, build_mesh
from paxlite.train import losses
from paxlite.train.dpo import DpoConfig, DpoSteps
from paxlite.train.step import TrainState, compile_steps, split_trainable

SEQ = 16
ROWS = 8
BETA = 0.3
CFG = TransformerConfig(vocab_size=32, num_layers=1, model_dims=16, num_heads=2, dims_per_head=8,
                        hidden_dims=32, max_seq_len=SEQ)


def _pair_batch(*, seed: int) -> dict[str, np.ndarray]:
    """One pair a row: chosen (segment 1) then rejected (segment 2), each with a prompt whose
    positions are not learned; the last row is padding (segment 0 throughout)."""
    rng = np.random.default_rng(seed)
    batch = {key: np.zeros((ROWS, SEQ), np.int32) for key in
             ("inputs", "targets", "positions", "segment_ids")}
    batch["weights"] = np.zeros((ROWS, SEQ), np.float32)
    for row in range(ROWS - 1):
        start = 0
        for segment in (1, 2):
            length = int(rng.integers(3, SEQ // 2 + 1))
            prompt = int(rng.integers(1, length - 1))
            ids = rng.integers(1, CFG.vocab_size, length)
            stop = start + length
            batch["inputs"][row, start:stop] = ids
            batch["targets"][row, start:stop - 1] = ids[1:]
            batch["weights"][row, start + prompt - 1:stop - 1] = 1.0  # the completion's tokens
            batch["positions"][row, start:stop] = np.arange(length)
            batch["segment_ids"][row, start:stop] = segment
            start = stop
    return batch


@functools.cache
def _params(seed: int, config: TransformerConfig = CFG):
    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        noise = rng.normal(size=shape.shape)
        return (1.0 + 0.1 * noise if path[-1].key == "scale" else 0.3 * noise).astype(np.float32)

    return jax.tree_util.tree_map_with_path(
        leaf, nn.meta.unbox(abstract_variables(config))["params"])


def _side_logps(params, batch, model):
    """[B] chosen and rejected log-probabilities, written out independently of paxlite's."""
    logits = model.apply({"params": params}, batch["inputs"], positions=batch["positions"],
                         segment_ids=batch["segment_ids"])
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)),
                               batch["targets"][..., None], axis=-1)[..., 0] * batch["weights"]
    return [jnp.sum(jnp.where(batch["segment_ids"] == s, logp, 0.0), axis=-1) for s in (1, 2)]


def _reference_loss(params, reference, batch, model):
    pc, pr = _side_logps(params, batch, model)
    rc, rr = (jax.lax.stop_gradient(x) for x in _side_logps(reference, batch, model))
    losses = -jax.nn.log_sigmoid(BETA * ((pc - rc) - (pr - rr)))
    rows = jnp.arange(ROWS) < ROWS - 1  # the last row is padding
    return jnp.sum(jnp.where(rows, losses, 0.0)) / (ROWS - 1)


def _steps(mesh, *, config=CFG, grad_accum_steps=1, trainable=None, separate=True,
           loss_chunk_size=None):
    schedule = optax.constant_schedule(1.0)
    return compile_steps(
        model=Transformer(config), optimizer=optax.sgd(schedule), schedule=schedule, mesh=mesh,
        seq_len=SEQ, seed=3, deterministic=True, grad_accum_steps=grad_accum_steps,
        trainable=trainable, loss_chunk_size=loss_chunk_size,
        dpo=DpoSteps(beta=BETA, train=True, eval=True, separate_reference=separate))


def _run(mesh, batch, params, reference, **kwargs):
    """(params after one step, train metrics, eval scores), on the host."""
    with jax.set_mesh(mesh):
        steps = _steps(mesh, **kwargs)
        if reference is not None:
            steps = steps.with_reference(jax.device_put(reference, steps.state_shardings.params))
        trainable = kwargs.get("trainable")
        train_params = params if trainable is None else split_trainable(params, trainable)[0]
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                           opt_state=optax.sgd(optax.constant_schedule(1.0)).init(train_params))
        state = jax.device_put(state, steps.state_shardings)
        scores = jax.device_get(steps.eval(state.params, batch))
        state, metrics = steps.train(state, batch)
        return jax.device_get(state.params), jax.device_get(metrics), scores


@pytest.fixture(scope="module")
def one_device():
    return build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1), dcn_mesh_shape=(1, 1, 1)),
                      devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def case(one_device):
    batch = _pair_batch(seed=0)
    params, reference = _params(1), _params(2)
    return batch, params, reference, _run(one_device, batch, params, reference)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _assert_same_tree(got, want, tol):
    flat_got = jax.tree_util.tree_leaves_with_path(got)
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want))
    assert len(flat_got) == len(flat_want)
    for path, leaf in flat_got:
        assert _rel(leaf, flat_want[path]) < tol, jax.tree_util.keystr(path)


def test_loss_metrics_and_gradient_equal_the_written_out_dpo_loss(case):
    batch, params, reference, (updated, metrics, scores) = case
    model = Transformer(CFG)
    pc, pr = (np.asarray(x, np.float64) for x in _side_logps(params, batch, model))
    rc, rr = (np.asarray(x, np.float64) for x in _side_logps(reference, batch, model))
    rows = np.arange(ROWS) < ROWS - 1  # the last row is padding
    chosen, rejected = BETA * (pc - rc)[rows], BETA * (pr - rr)[rows]
    margin = chosen - rejected
    want = {"dpo/loss": np.mean(np.logaddexp(0.0, -margin)), "dpo/rewards_chosen": chosen.mean(),
            "dpo/rewards_rejected": rejected.mean(), "dpo/accuracy": np.mean(chosen > rejected),
            "dpo/margin": margin.mean()}
    assert 0.1 < want["dpo/accuracy"] < 0.9  # both outcomes occur: the comparison is not trivial
    for key, value in want.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert metrics["loss"] == pytest.approx(want["dpo/loss"], rel=1e-5)
    # the eval step's per-row terms sum to the same
    assert scores["pairs"].sum() == rows.sum()
    assert scores["dpo_loss_sum"].sum() / rows.sum() == pytest.approx(want["dpo/loss"], rel=1e-5)
    assert scores["margin_sum"].sum() / rows.sum() == pytest.approx(want["dpo/margin"], rel=1e-5)
    # SGD with rate 1: params - updated is the gradient
    grads = jax.jit(jax.grad(_reference_loss), static_argnums=3)(params, reference, batch, model)
    _assert_same_tree(jax.tree.map(np.subtract, params, updated), grads, 1e-4)


def test_accumulated_microbatches_equal_the_one_batch_step(case, one_device):
    batch, params, reference, (updated, metrics, _) = case
    got, got_metrics, _ = _run(one_device, batch, params, reference, grad_accum_steps=2)
    _assert_same_tree(got, updated, 1e-5)
    for key in ("loss", "dpo/loss", "dpo/margin", "dpo/accuracy", "accuracy"):
        assert got_metrics[key] == pytest.approx(metrics[key], rel=1e-5), key


def test_a_sharded_step_equals_one_device(case):
    batch, params, reference, (updated, metrics, scores) = case
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(2, 2, 2), dcn_mesh_shape=(1, 1, 1)))
    got, got_metrics, got_scores = _run(mesh, batch, params, reference)
    _assert_same_tree(got, updated, 1e-5)
    for key in ("loss", "dpo/loss", "dpo/rewards_chosen", "dpo/rewards_rejected", "dpo/margin"):
        assert got_metrics[key] == pytest.approx(metrics[key], rel=1e-5), key
    np.testing.assert_allclose(got_scores["dpo_loss_sum"], scores["dpo_loss_sum"], rtol=1e-5)


def test_the_chunked_loss_equals_the_whole_logits_step(case, one_device, monkeypatch):
    """LOSS_CHUNK_SIZE: both sides' log-probabilities, of the policy and of the reference, from
    blocks of positions (no [B, T, V] logits) give the same step and scores."""
    batch, params, reference, (updated, metrics, scores) = case
    chunked = []  # the traced calls of the chunked sums: the reference's, the policy's
    real = losses.chunked_row_sums
    monkeypatch.setattr(losses, "chunked_row_sums",
                        lambda *a, **k: chunked.append(k["chunk_size"]) or real(*a, **k))
    got, got_metrics, got_scores = _run(one_device, batch, params, reference, loss_chunk_size=4)
    assert chunked and set(chunked) == {4}
    _assert_same_tree(got, updated, 1e-5)
    for key in ("loss", "dpo/loss", "dpo/rewards_chosen", "dpo/rewards_rejected", "dpo/margin",
                "dpo/accuracy"):
        assert got_metrics[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key
    np.testing.assert_allclose(got_scores["dpo_loss_sum"], scores["dpo_loss_sum"], rtol=1e-5)


def test_lora_reference_is_the_base_model_without_adapters(one_device):
    """LoRA with the adapters off as the reference equals passing the base parameters (adapters
    zero) as a reference of its own; and the adapters are nonzero, so the policy differs."""
    config = dataclasses.replace(CFG, lora_rank=2)
    batch = _pair_batch(seed=1)
    params = _params(4, config)  # random adapters: lora_b is not zero as at initialisation
    base = jax.tree_util.tree_map_with_path(
        lambda path, x: np.zeros_like(x) if is_lora_path(path) else x, params)
    adapters = jax.tree.leaves(split_trainable(params, is_lora_path)[0])
    assert adapters and all(np.abs(x).max() > 0 for x in adapters)
    inside, inside_metrics, _ = _run(one_device, batch, params, None, config=config,
                                     trainable=is_lora_path, separate=False)
    passed, passed_metrics, _ = _run(one_device, batch, params, base, config=config,
                                     trainable=is_lora_path, separate=True)
    _assert_same_tree(inside, passed, 1e-6)
    assert inside_metrics["dpo/loss"] == pytest.approx(passed_metrics["dpo/loss"], rel=1e-6)
    assert abs(inside_metrics["dpo/margin"]) > 1e-4  # the adapters move the policy


def test_beta_must_be_positive():
    with pytest.raises(ValueError, match="DPO_BETA must be a number > 0"):
        DpoConfig(beta=0.0)
