"""GPU checks (run with JAX_PLATFORMS=cuda,cpu on a GPU machine; the `gpu` tests are skipped
elsewhere).

The GPU test trains TinySynthetic for NUM_STEPS steps at a real learning rate on one GPU and
compares the losses *and the trained parameters* with the same training on the CPU backend (same
seed, same initialisation, same batches). At a learning rate near zero, or on losses alone, wrong
gradients go unnoticed; 20 Adam steps at 1e-2 move every parameter by about 0.1, far beyond the
tolerances below.

`train_tiny` and `assert_same_training` are the whole check; the CPU test at the end runs them on
this machine's fake CPU devices (one device against a (2,2,2) sharded mesh), so the GPU test's code
and tolerances are exercised in every test run, not only where a GPU is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

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

NUM_STEPS = 20
GLOBAL_BATCH = 8
# A real schedule: warm-up over 2 steps to 1e-2, then cosine decay past the end of the run.
OVERRIDES = ("LEARNING_RATE=1e-2", "LR_COS_WARMUP=2", "LR_COS_DECAY_END=100", "FPROP_DTYPE=float32")
# The key projection's bias has a zero gradient in exact arithmetic (softmax ignores a constant
# added to every score of a query), so its computed gradient is round-off, and Adam normalises
# round-off into steps of the full learning rate whose sign the backend decides. It does not change
# the model's outputs, so it is left out of the parameter comparison (and checked to be the only
# leaf left out).
KEY_BIAS = (1,)  # index of the key in qkv/bias [3, heads, dims_per_head]


@dataclasses.dataclass(frozen=True)
class Training:
    params0: dict  # the initialisation, as host arrays
    params: dict  # after NUM_STEPS steps
    losses: list[float]  # one per step


def train_tiny(devices: Sequence[jax.Device], *, mesh_shape=(1, 1, 1), num_steps: int = NUM_STEPS,
               overrides: Sequence[str] = OVERRIDES, experiment: str = "TinySynthetic") -> Training:
    """`experiment` trained on `devices` for `num_steps` steps, matmuls at full float32 precision.

    "highest" precision rules out TF32 (the default for float32 matmuls on NVIDIA GPUs since Ampere,
    which keeps 10 mantissa bits and would differ from the CPU by ~1e-3 per matmul).
    """
    run = fdl.build(load_experiment(experiment, list(overrides)).run_config())
    mesh = build_mesh(MeshConfig(ici_mesh_shape=tuple(mesh_shape)), devices=list(devices))
    schedule = make_schedule(run.schedule)
    data = SyntheticData(run.data, global_batch_size=GLOBAL_BATCH)
    with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
        steps = compile_steps(
            model=Transformer(run.model),
            optimizer=make_optimizer(run.optimizer, schedule),
            schedule=schedule,
            mesh=mesh,
            seq_len=run.data.seq_len,
            seed=0,
            deterministic=True,
        )
        state = steps.init()
        params0 = jax.device_get(state.params)
        losses = []
        for index in range(num_steps):
            state, metrics = steps.train(state, data.train_batch(index, steps.batch_sharding))
            losses.append(float(metrics["loss"]))
        return Training(params0=params0, params=jax.device_get(state.params), losses=losses)


def _flat(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path): np.asarray(leaf, np.float64)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def assert_same_training(
    got: Training, want: Training, *, loss_rtol: float, param_rtol: float, init_rtol: float = 0.0
) -> None:
    """Same initialisation (exactly, or within `init_rtol` where the backends' normal samplers
    round differently), the same losses, the same trained parameters (leaf by leaf, relative to
    how far training moved the leaf), and a loss that fell."""
    for name, value in _flat(got.params0).items():  # the start is a function of the seed only
        if init_rtol:
            np.testing.assert_allclose(value, _flat(want.params0)[name], rtol=init_rtol,
                                       atol=0, err_msg=name)
        else:
            np.testing.assert_array_equal(value, _flat(want.params0)[name], err_msg=name)
    np.testing.assert_allclose(got.losses, want.losses, rtol=loss_rtol)
    # it learned (ln 256 = 5.5 at the start)
    assert want.losses[-1] < want.losses[0] - 1.0, want.losses
    start, trained, reference = _flat(want.params0), _flat(got.params), _flat(want.params)
    assert len(reference) > 10 and set(trained) == set(reference)
    skipped = []
    for name, ref in reference.items():
        value, moved = trained[name], ref - start[name]
        if name.endswith("['qkv']['bias']"):
            skipped.append(name)
            value, ref, moved = (np.delete(x, KEY_BIAS, axis=0) for x in (value, ref, moved))
        # Relative to the update: an error as large as the step itself would pass an absolute test
        # on parameters of size ~1 but is what a wrong gradient produces.
        error = np.linalg.norm(value - ref) / np.linalg.norm(moved)
        assert np.linalg.norm(moved) > 0 and error < param_rtol, (f"{name}: relative error "
                                                                  f"{error:.2e}")
    assert len(skipped) == 2, skipped  # one per layer


@pytest.mark.gpu
def test_gpu_training_matches_cpu_parameters_and_losses():
    # Tolerances: at "highest" precision both backends compute in float32 and differ only in the
    # order of their sums (cuBLAS and XLA:GPU's reductions vs XLA:CPU's), ~1e-7 relative per
    # operation, which 20 Adam steps grow (Adam divides by the root of small second moments). One
    # CPU device against a (2,2,2) mesh, which also reorders every sum, agrees to 3e-6 in parameters
    # and 6e-7 in losses (the CPU test, measured);
    # 1e-3 of the distance each parameter travelled leaves room for the GPU's different kernels and
    # is still 1000 times smaller than what a wrong gradient of one leaf does.
    gpu = train_tiny(jax.devices("gpu")[:1])
    cpu = train_tiny(jax.devices("cpu")[:1])
    assert_same_training(gpu, cpu, loss_rtol=1e-4, param_rtol=1e-3)


@pytest.mark.gpu
def test_gpu_bfloat16_losses_follow_float32_cpu():
    # bfloat16 activations (8 mantissa bits, ~4e-3 relative per rounding) cannot match float32
    # parameters leaf by leaf after 20 steps; the losses, averages over 512 tokens, stay within
    # 3e-2.
    overrides = [*OVERRIDES[:-1], "FPROP_DTYPE=bfloat16"]
    gpu = train_tiny(jax.devices("gpu")[:1], overrides=overrides)
    cpu = train_tiny(jax.devices("cpu")[:1], overrides=overrides)
    np.testing.assert_allclose(gpu.losses, cpu.losses, rtol=3e-2)
    assert gpu.losses[-1] < gpu.losses[0] - 1.0, gpu.losses


@pytest.mark.gpu
@pytest.mark.parametrize("experiment", ["TinyGLaM", "TinyMixtral"])
def test_gpu_moe_losses_follow_cpu(experiment):
    # Routing is discontinuous (a near-tie between two experts may break the other way on another
    # backend), so parameters are not compared leaf by leaf; 10 float32 steps' losses agree to 1e-3.
    overrides = ("LEARNING_RATE=3e-3", "FPROP_DTYPE=float32")
    gpu = train_tiny(
        jax.devices("gpu")[:1], num_steps=10, overrides=overrides, experiment=experiment
    )
    cpu = train_tiny(
        jax.devices("cpu")[:1], num_steps=10, overrides=overrides, experiment=experiment
    )
    np.testing.assert_allclose(gpu.losses, cpu.losses, rtol=1e-3)


@pytest.mark.slow
def test_the_gpu_check_runs_on_cpu_devices():
    """The same functions and tolerances, a sharded CPU run against one CPU device: the check runs
    here (where the `gpu` tests skip), and a wrong tolerance or a broken comparison shows up."""
    one = train_tiny(jax.devices("cpu")[:1])
    sharded = train_tiny(jax.devices("cpu")[:8], mesh_shape=(2, 2, 2))
    assert_same_training(sharded, one, loss_rtol=1e-4, param_rtol=1e-3)
