"""GPU checks (run with JAX_PLATFORMS=cuda,cpu on a GPU machine; skipped elsewhere)."""

import fiddle as fdl
import jax
import numpy as np
import pytest

from paxlite.data.synthetic import SyntheticData
from paxlite.experiments.build import load_experiment
from paxlite.models.transformer import Transformer
from paxlite.parallel.mesh import MeshConfig, build_mesh
from paxlite.train.optimizer import make_optimizer
from paxlite.train.schedules import make_schedule
from paxlite.train.step import compile_steps


def _losses(devices, overrides, num_steps=3):
    run = fdl.build(load_experiment("TinySynthetic", overrides).run_config())
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1)), devices=devices)
    schedule = make_schedule(run.schedule)
    data = SyntheticData(run.data, global_batch_size=8)
    with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
        steps = compile_steps(model=Transformer(run.model), optimizer=make_optimizer(run.optimizer, schedule),
                              schedule=schedule, mesh=mesh, seq_len=run.data.seq_len, seed=0,
                              deterministic=True)
        state = steps.init()
        losses = []
        for index in range(num_steps):
            state, metrics = steps.train(state, data.train_batch(index, steps.batch_sharding))
            losses.append(float(metrics["loss"]))
    return losses


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, rtol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_gpu_train_steps_match_cpu(dtype, rtol):
    overrides = [f"FPROP_DTYPE={dtype}"]
    gpu = _losses(jax.devices("gpu")[:1], overrides)
    cpu = _losses(jax.devices("cpu")[:1], overrides)
    np.testing.assert_allclose(gpu, cpu, rtol=rtol)
