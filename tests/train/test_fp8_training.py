"""FP8 training (USE_FP8) on CPU: the scaling state is train state, not a parameter.

Checked against independent references: the same run without weight decay or clipping (the state
must not care), a one-device run (sharding), one big batch (gradient accumulation), a bfloat16 run
(the loss curve), and the state read back from an Orbax checkpoint.
"""

from __future__ import annotations

import functools

import fiddle as fdl
import jax
import numpy as np
import optax
import pytest
from flax import traverse_util

from paxlite.checkpointing.checkpoint import Checkpointer
from paxlite.config.errors import ConfigError
from paxlite.data.synthetic import SyntheticData
from paxlite.experiments.build import load_experiment
from paxlite.models.transformer import Transformer
from paxlite.parallel.mesh import MeshConfig, build_mesh
from paxlite.train.optimizer import make_optimizer
from paxlite.train.schedules import make_schedule
from paxlite.train.step import compile_steps
from tests.train.train_step_gradients import recording_gradients

GLOBAL_BATCH = 8
# TinySynthetic shrunk further (and bf16 compute, as FP8 runs are): cheap on 2 CPU cores. One layer:
# an FP8 step costs seconds to compile on the CPU, a third less with one layer than with two; the
# tests of the state's per-layer structure add a second (TWO_LAYERS).
TWO_LAYERS = "NUM_LAYERS=2"
TINY = ("NUM_LAYERS=1", "MODEL_DIMS=32", "HIDDEN_DIMS=64", "NUM_HEADS=2", "DIMS_PER_HEAD=16",
        "VOCAB_SIZE=64", "MAX_SEQ_LEN=16", "FPROP_DTYPE=bfloat16", "LEARNING_RATE=3e-3",
        "LR_COS_WARMUP=5", "LR_COS_DECAY_END=100", "FP8_AMAX_HISTORY_LENGTH=16")
FP8 = (*TINY, "USE_FP8=true")
BF16 = tuple(o for o in TINY if not o.startswith("FP8_"))


def _run(overrides, experiment="TinySynthetic"):
    return fdl.build(load_experiment(experiment, list(overrides)).run_config())


def _steps(run, mesh, *, optimizer=None, grad_accum_steps=1):
    schedule = make_schedule(run.schedule)
    return compile_steps(
        model=Transformer(run.model),
        optimizer=optimizer or make_optimizer(run.optimizer, schedule),
        schedule=schedule,
        mesh=mesh,
        seq_len=run.data.seq_len,
        seed=0,
        deterministic=True,
        grad_accum_steps=grad_accum_steps,
    )


def _mesh(shape=(1, 1, 1)):
    n = int(np.prod(shape))
    return build_mesh(MeshConfig(ici_mesh_shape=tuple(shape)), devices=jax.devices()[:n])


def _train(overrides, *, num_steps, mesh_shape=(1, 1, 1), optimizer=None, grad_accum_steps=1,
           checkpoint_dir=None):
    """(losses, host states after each of the first two steps, the first step's metrics); with
    `checkpoint_dir`, also the state after the last step as restored from a checkpoint of it."""
    run = _run(overrides)
    mesh = _mesh(mesh_shape)
    data = SyntheticData(run.data, global_batch_size=GLOBAL_BATCH)
    with jax.set_mesh(mesh):
        steps = _steps(run, mesh, optimizer=optimizer, grad_accum_steps=grad_accum_steps)
        state = steps.init()
        losses, states, first = [], [], None
        for index in range(num_steps):
            state, metrics = steps.train(state, data.train_batch(index, steps.batch_sharding))
            losses.append(float(metrics["loss"]))
            first = first or jax.device_get(metrics)
            if index < 2:
                states.append(jax.device_get(state))
        restored = None
        if checkpoint_dir is not None:
            with Checkpointer(checkpoint_dir, save_interval_steps=1, max_to_keep=1) as ckpt:
                ckpt.save(num_steps, state, force=True)
                ckpt.wait_until_finished()
                step, restored = ckpt.restore_latest(steps.abstract_state)
                assert step == num_steps
            restored = (jax.device_get(state), jax.device_get(restored))
        return losses, states, first, restored


def _flat(tree):
    return traverse_util.flatten_dict(tree, sep="/")


@functools.cache
def _reference():
    """FP8 on one device, 50 steps: the reference of every comparison below."""
    return _train(FP8, num_steps=50)


def test_fp8_state_is_train_state_replicated_and_per_matmul():
    run = _run((*FP8, TWO_LAYERS))
    mesh = _mesh((1, 4, 2))
    with jax.set_mesh(mesh):
        steps = _steps(run, mesh)
        traced = steps.init.eval_shape()  # what init returns; abstract_state is built without it
    assert jax.tree.structure(traced) == jax.tree.structure(steps.abstract_state)
    for got, want in zip(jax.tree.leaves(steps.abstract_state), jax.tree.leaves(traced),
                         strict=True):
        assert (got.shape, got.dtype) == (want.shape, want.dtype)
    fp8 = _flat(steps.abstract_state.fp8)
    matmuls = {k.rsplit("/", 2)[0] for k in fp8}
    # qkv, out, wi, wo of each of the 2 layers; the softmax (tied embedding) stays out
    assert len(matmuls) == 8, sorted(matmuls)
    assert all(leaf.sharding.is_fully_replicated for leaf in fp8.values())
    assert {leaf.shape for leaf in fp8.values()} == {(1,), (16,)}
    opt_paths = [jax.tree_util.keystr(p) for p, _ in
                 jax.tree_util.tree_leaves_with_path(steps.abstract_state.opt_state)]
    assert opt_paths and not any("fp8" in p or "amax" in p for p in opt_paths)


def test_fp8_state_ignores_weight_decay_clipping_and_grad_norm():
    _, (first, second), metrics, _ = _reference()
    # AdamW with heavy decay behind a clip threshold every gradient exceeds, instead of the
    # experiment's optimizer: the FP8 state after one step is not the optimizer's business...
    # (recording_gradients keeps the gradients the optimizer was given, for grad_norm below)
    tx = optax.chain(optax.clip_by_global_norm(1e-6), optax.adamw(1e-3, weight_decay=10.0))
    _, (other,), _, _ = _train(FP8, num_steps=1, optimizer=recording_gradients(tx))
    assert _flat(first.fp8).keys() == _flat(other.fp8).keys()
    for name, value in _flat(first.fp8).items():
        np.testing.assert_array_equal(value, _flat(other.fp8)[name], err_msg=name)
    # ... and it moved: each matmul's histories hold this step's amax; scales are still 1
    assert all(np.max(v) > 0 for k, v in _flat(first.fp8).items() if "amax_history" in k)
    # step 2's scales come from step 1's amax (delayed scaling), so they left 1.0
    assert all(v[0] != 1.0 for k, v in _flat(second.fp8).items() if k.endswith("input_scale"))
    # grad_norm: the norm of the parameter gradients alone (the first step's, at the same init and
    # batch as the reference's), recomputed here in float64; the FP8 "gradient" is not among them
    grads = _flat(other.opt_state[1])
    assert grads.keys() == _flat(first.params).keys()
    norm = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in grads.values()))
    np.testing.assert_allclose(metrics["grad_norm"], norm, rtol=1e-5)


def test_sharded_fp8_step_equals_one_device_and_checkpoint_restores_it(tmp_path):
    # float32 around the FP8 dots: in bfloat16 the sharded reductions round differently (the
    # amax of an output gradient moved by 3 bfloat16 ulps), which would hide a real difference
    f32 = [o for o in FP8 if not o.startswith("FPROP_DTYPE")] + ["FPROP_DTYPE=float32"]
    _, (one,), m1, _ = _train(f32, num_steps=1)
    _, (sharded,), m8, (saved, restored) = _train(
        f32, num_steps=1, mesh_shape=(1, 4, 2), checkpoint_dir=str(tmp_path / "ckpt"))
    np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=1e-5)
    for name, value in _flat(one.fp8).items():
        np.testing.assert_allclose(_flat(sharded.fp8)[name], value, rtol=1e-4, err_msg=name)
    for name, value in _flat(one.params).items():
        np.testing.assert_allclose(_flat(sharded.params)[name], value, rtol=1e-3, atol=1e-5,
                                   err_msg=name)
    want, got = _flat(saved.fp8), _flat(restored.fp8)
    assert want and want.keys() == got.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_checkpoint_without_fp8_field_restores_into_a_run_without_fp8(tmp_path):
    """Checkpoints written before the state had an `fp8` field still resume a BF16 run."""
    run = _run(BF16)
    mesh = _mesh()
    with jax.set_mesh(mesh):
        steps = _steps(run, mesh)
        state = steps.init()
        old = {"step": state.step, "params": state.params, "opt_state": state.opt_state}
        with Checkpointer(str(tmp_path / "ckpt"), save_interval_steps=1, max_to_keep=1) as ckpt:
            ckpt.save(3, old, force=True)
            ckpt.wait_until_finished()
            step, restored = ckpt.restore_latest(steps.abstract_state)
    assert step == 3 and restored.fp8 == {}
    assert type(restored) is type(state)


def test_grad_accumulation_max_accumulates_the_fp8_state():
    _, (one, _), m1, _ = _reference()
    _, (accum,), m2, _ = _train(FP8, num_steps=1, grad_accum_steps=2)
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-3)
    for name, value in _flat(one.fp8).items():
        # summed, slot 0 of each history would be about twice the one-batch amax; max gives it
        np.testing.assert_allclose(_flat(accum.fp8)[name], value, rtol=1e-2, err_msg=name)


def test_fp8_loss_curve_follows_bfloat16():
    fp8, _, _, _ = _reference()
    bf16, _, _, _ = _train(BF16, num_steps=50)
    assert fp8[-1] < fp8[0] - 0.5  # it trains
    # the same curve within 3% of the loss at every step (FP8 e4m3 keeps 3 mantissa bits)
    np.testing.assert_allclose(fp8, bf16, rtol=0.03)


def test_fp8_with_dropless_routing_is_refused():
    with pytest.raises(ConfigError, match=r"USE_FP8=true with MOE_ROUTING='dropless_topk'.*"
                                          r"gshard_top2"):
        load_experiment("TinyMixtral", ["USE_FP8=true"])


def test_fp8_amax_history_without_fp8_is_refused():
    with pytest.raises(ConfigError, match="FP8_AMAX_HISTORY_LENGTH set but USE_FP8 is false"):
        load_experiment("TinySynthetic", ["FP8_AMAX_HISTORY_LENGTH=16"])


def test_a_job_trains_evaluates_and_resumes_with_fp8_scanned_layers(tmp_path, monkeypatch):
    """The whole loop: scanned + remat'd layers, eval with the FP8 state, resume restores it, and
    MFU asks for the FP8 peak."""
    from paxlite.experiments.build import build_run_config
    from paxlite.train import flops as flops_lib
    from paxlite.train.loop import Run, RunContext

    asked = []
    real_peak = flops_lib.peak_flops_per_device

    def peak(kind, **kwargs):
        asked.append(kwargs.get("fp8"))
        return real_peak(kind, **kwargs)

    monkeypatch.setattr(flops_lib, "peak_flops_per_device", peak)
    common = [*FP8, TWO_LAYERS, "USE_REPEATED_LAYER=true", "CHECKPOINT_POLICY=SAVE_NOTHING",
              "EVAL_INTERVAL_STEPS=2", "EVAL_LOOP_NUM_BATCHES=1", "CHECKPOINT_EVERY_N_STEPS=2",
              "SUMMARY_INTERVAL_STEPS=1"]
    states = []
    for max_steps in (2, 3):
        _, config = build_run_config("TinySynthetic", [*common, f"MAX_STEPS={max_steps}"])
        with Run(config, RunContext(job_dir=str(tmp_path), enable_checkpoint_saving=True)) as run:
            if max_steps == 3:  # the resumed state is the saved one, FP8 state included
                restored = jax.device_get(run.restore_or_init())
                for name, value in _flat(states[0].fp8).items():
                    np.testing.assert_array_equal(_flat(restored.fp8)[name], value, err_msg=name)
            states.append(jax.device_get(run.train()))
    assert asked and all(fp8 is True for fp8 in asked)
    history = _flat(states[-1].fp8)["layers/attention/qkv/fp8_einsum/input_amax_history"]
    assert history.shape == (2, 16)  # one history per layer
    assert np.all(np.count_nonzero(history, axis=1) == 3)  # three steps recorded, resume included
    with open(tmp_path / "metrics.jsonl") as f:
        assert any("eval/loss" in line for line in f)
