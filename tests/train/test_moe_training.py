"""Tiny GLaM and Mixtral train from the command line: the loss falls and the MoE metrics are logged.

One subprocess per model, as users run it (`python -m paxlite.main --fdl_config=...`), on one CPU
device; the metrics are read back from metrics.jsonl and the TensorBoard event files.
"""

import json
import math
import os
import subprocess

import pytest

from tests.fork_server import paxlite_python
from tests.train.test_metrics import _scalars
from tests.xla_test_flags import COMPILE_FLAGS

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
ENV["XLA_FLAGS"] = COMPILE_FLAGS  # one CPU device, as on a plain machine
MOE_KEYS = {"moe/aux_loss", "moe/dropped_fraction", "moe/expert_load_min", "moe/expert_load_max"}
# The fewest layers that keep each family's stack: GLaM's MoE layer and its dense one, Mixtral's
# (every layer MoE) one; each subprocess compiles ~1.3 CPU-s less than with 4 and 2 layers.
NUM_LAYERS = {"TinyGLaM": 2, "TinyMixtral": 1}


@pytest.fixture(scope="module", params=["TinyGLaM", "TinyMixtral"])
def trained(request, tmp_path_factory):
    job = tmp_path_factory.mktemp(request.param) / "job"
    flags = [f"--fdl_config={request.param}", f"--job_log_dir={job}", "--fdl.MAX_STEPS=40",
             "--fdl.SUMMARY_INTERVAL_STEPS=10", "--fdl.Z_LOSS_WEIGHT=0.0001",
             f"--fdl.NUM_LAYERS={NUM_LAYERS[request.param]}",
             "--enable_checkpoint_saving=false"]  # nothing here reads a checkpoint
    result = subprocess.run([paxlite_python(), "-m", "paxlite.main", *flags], capture_output=True,
                            text=True, env=ENV, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    return request.param, job, [line for line in lines if "loss" in line]


def test_loss_falls(trained):
    name, _, train = trained
    assert [line["step"] for line in train] == [10, 20, 30, 40]
    first, last = train[0]["loss"], train[-1]["loss"]
    vocab = {"TinyGLaM": 256, "TinyMixtral": 512}[name]
    assert first < math.log(vocab) + 0.5  # a sane start near ln(vocab)...
    assert last < 0.85 * first, f"{name}: loss {first} -> {last}"  # ...that learns the permutation


def test_moe_metrics_in_jsonl_and_tensorboard(trained):
    name, job, train = trained
    for line in train:
        assert MOE_KEYS | {"moe/z_loss"} <= set(line), sorted(line)
        assert line["moe/expert_load_min"] <= 1 / 8 <= line["moe/expert_load_max"] <= 1.0
        assert 0.5 < line["moe/aux_loss"] < 8.0  # 1.0 when perfectly uniform, 8 = E if collapsed
        assert line["moe/z_loss"] > 0
        if name == "TinyMixtral":
            assert line["moe/dropped_fraction"] == 0.0
        else:
            assert 0.0 <= line["moe/dropped_fraction"] < 1.0
    tags = {tag for _, tag, _ in _scalars(job / "summaries" / "train")}
    assert MOE_KEYS | {"moe/z_loss"} <= tags, sorted(tags)


def test_gradient_accumulation_with_moe_losses():
    """K=2 microbatches: cross entropy and the z-loss (token means) equal the whole batch's; the
    MoE summaries are the mean of the two microbatches' own (routing statistics are per batch).

    Dropless routing, whose outputs do not depend on which tokens share a batch; GShard's do (each
    microbatch forms its own groups, so capacity and drops differ: docs/moe.md)."""
    import functools

    import jax
    import numpy as np
    import optax

    from paxlite.models.moe_config import MoeConfig, MoeRouting
    from paxlite.models.transformer import Transformer, TransformerConfig
    from paxlite.parallel.mesh import MeshConfig, build_mesh
    from paxlite.train.grad_accum import split_microbatches
    from paxlite.train.losses import loss_fn
    from paxlite.train.step import TrainState, compile_steps
    from tests.host_params import random_host_params

    config = TransformerConfig(
        vocab_size=64, num_layers=2, model_dims=16, num_heads=2, dims_per_head=8, hidden_dims=32,
        max_seq_len=8, moe=MoeConfig(num_experts=4, routing=MoeRouting.DROPLESS_TOPK,
                                     moe_layer_interval=2, load_balancing_weight=0.01))
    model = Transformer(config)
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1)), devices=jax.devices()[:1])
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, size=(4, 9), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "weights": (rng.random((4, 8)) > 0.2).astype(np.float32)}
    metrics, params = {}, None
    optimizer = optax.sgd(0.0)
    with jax.set_mesh(mesh):
        for k in (1, 2):
            steps = compile_steps(model=model, optimizer=optimizer,
                                  schedule=optax.constant_schedule(0.0), mesh=mesh, seq_len=8,
                                  seed=0, deterministic=True, grad_accum_steps=k,
                                  z_loss_weight=1e-3)
            # Seeded host parameters, not an init (its threefry sampler is slow to compile on
            # CPU); a fresh device copy for each step, which donates its state.
            params = params or random_host_params(steps.abstract_state.params)
            state = jax.device_put(
                TrainState(step=np.zeros((), np.int32), params=params,
                           opt_state=optimizer.init(params)), steps.state_shardings)
            _, metrics[k] = steps.train(state, jax.device_put(batch, steps.batch_sharding))
        halves = split_microbatches({key: jax.numpy.asarray(v) for key, v in batch.items()}, 2)
        half_loss = jax.jit(functools.partial(loss_fn, model=model, z_loss_weight=1e-3))  # 1 trace
        per_half = [half_loss(params, jax.tree.map(lambda x, i=i: x[i], halves))[1]["summaries"]
                    for i in range(2)]
    one, two = metrics[1], metrics[2]
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-6)
    np.testing.assert_allclose(two["moe/z_loss"], one["moe/z_loss"], rtol=1e-6)
    want = (per_half[0]["moe/aux_loss"] + per_half[1]["moe/aux_loss"]) / 2
    np.testing.assert_allclose(two["moe/aux_loss"], want, rtol=1e-6)
    assert abs(float(two["moe/aux_loss"]) - float(one["moe/aux_loss"])) > 1e-7  # really per batch
