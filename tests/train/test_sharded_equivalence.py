"""Losses and gradients on every supported mesh layout equal the one-device run.

XLA:CPU has silently computed wrong gradients for FSDP x tensor sharded matmul chains on a
(2,2,2) mesh; this test is the guard against that class of bug, on the real model and train
step.
"""

import fiddle as fdl
import jax
import numpy as np
import pytest

from paxlite.experiments.build import load_experiment
from paxlite.models.transformer import Transformer
from paxlite.parallel.mesh import MeshConfig, build_mesh
from paxlite.train.optimizer import make_optimizer
from paxlite.train.schedules import make_schedule
from paxlite.train.step import compile_steps
from tests.host_params import random_host_params
from tests.train.train_step_gradients import loss_grads_and_losses

GLOBAL_BATCH = 8
MESHES = [(2, 2, 2), (1, 8, 1), (8, 1, 1), (1, 1, 8)]


def _setup(experiment_name: str, overrides=()):
    experiment = load_experiment(experiment_name, list(overrides))
    run = fdl.build(experiment.run_config())
    return run


def _loss_grads_and_losses(run, mesh, num_steps: int = 3, params=None):
    """Parameters and the loss and gradients at initialisation, then the losses of `num_steps`
    train steps (tests/train/train_step_gradients.py). `params`: None for `compile_steps`'s init,
    or a function of the abstract parameters returning host arrays to start from instead (with the
    optimizer's initial state)."""
    return loss_grads_and_losses(run, mesh, global_batch=GLOBAL_BATCH, num_steps=num_steps,
                                 initial_params=params)


def _rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


# The mesh cases' model: TinySynthetic with one layer, which has every kind of parameter and every
# sharded matmul of the stack (a second layer repeats them, and costs a third more to compile).
MESH_CASE_OVERRIDES = ("NUM_LAYERS=1",)


@pytest.fixture(scope="module")
def one_device_reference():
    run = _setup("TinySynthetic", MESH_CASE_OVERRIDES)
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1)), devices=jax.devices()[:1])
    return run, _loss_grads_and_losses(run, mesh)


# (ICI, DCN) as the experiments lay them out, one process standing in for the nodes: FSDP in nodes
# and data across them (the multi-node default), FSDP across nodes (GPT5B/175B: DCN [1,N,1]), tensor
# in nodes and data across them.
HYBRID_MESHES = [
    ((1, 4, 1), (2, 1, 1)),
    ((1, 2, 1), (1, 4, 1)),
    ((1, 2, 2), (2, 1, 1)),
    ((2, 1, 2), (1, 1, 2)),
    # the expert axis (4th entry) in nodes: for a dense model one more batch axis
    ((1, 2, 1, 2), (2, 1, 1)),
]


@pytest.mark.parametrize(
    "ici,dcn",
    [(shape, (1, 1, 1)) for shape in MESHES] + HYBRID_MESHES,
    ids=lambda s: "x".join(map(str, s)),
)
def test_mesh_matches_one_device(ici, dcn, one_device_reference):
    run, (params_ref, loss_ref, grads_ref, losses_ref) = one_device_reference
    mesh = build_mesh(MeshConfig(ici_mesh_shape=ici, dcn_mesh_shape=dcn))
    padded = [tuple(s) + (1,) * (4 - len(s)) for s in (ici, dcn)]  # a 3-entry shape has expert 1
    shape = tuple(i * d for i, d in zip(*padded))
    assert dict(mesh.shape) == {
        **dict(zip(("data", "fsdp", "tensor", "expert"), shape)),
        "pipeline": 1,
        "seq": 1,
    }
    params, loss, grads, losses = _loss_grads_and_losses(run, mesh)
    # Initialisation is a function of the seed only, not of the mesh.
    jax.tree.map(np.testing.assert_array_equal, params, params_ref)
    assert abs(loss - loss_ref) / abs(loss_ref) < 1e-5
    flat_ref = jax.tree_util.tree_leaves_with_path(grads_ref)
    flat = jax.tree.leaves(grads)
    assert len(flat) == len(flat_ref) > 10
    for (path, ref), got in zip(flat_ref, flat):
        assert _rel_err(got, ref) < 1e-5, (f"gradient {jax.tree_util.keystr(path)} differs on "
                                           f"{shape}")
    # Three optimizer steps later the losses still agree. (Parameters are not compared leaf by leaf:
    # Adam normalises gradients that are zero in exact arithmetic, such as the key bias's, so
    # round-off decides them.)
    np.testing.assert_allclose(losses, losses_ref, rtol=1e-5)


@pytest.mark.slow  # scanned steps on a 2x2x2 mesh and one device, several steps (~30 s on 2 cores)
def test_repeated_layers_on_2x2x2_match_one_device():
    """From the same random parameters on both (init's mesh invariance is tested above)."""
    run = _setup("TinySyntheticRepeated")
    one = build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1)), devices=jax.devices()[:1])
    _, loss_ref, grads_ref, losses_ref = _loss_grads_and_losses(
        run, one, num_steps=2, params=random_host_params
    )
    _, loss, grads, losses = _loss_grads_and_losses(
        run,
        build_mesh(MeshConfig(ici_mesh_shape=(2, 2, 2))),
        num_steps=2,
        params=random_host_params,
    )
    assert abs(loss - loss_ref) / abs(loss_ref) < 1e-5
    for (path, ref), got in zip(
        jax.tree_util.tree_leaves_with_path(grads_ref), jax.tree.leaves(grads)
    ):
        assert _rel_err(got, ref) < 1e-5, jax.tree_util.keystr(path)
    np.testing.assert_allclose(losses, losses_ref, rtol=1e-5)


def test_parameters_are_actually_sharded():
    """The equality above must not come from everything being replicated."""
    run = _setup("TinySynthetic", MESH_CASE_OVERRIDES)
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(1, 2, 4)))
    with jax.set_mesh(mesh):
        steps = compile_steps(
            model=Transformer(run.model),
            optimizer=make_optimizer(run.optimizer, make_schedule(run.schedule)),
            schedule=make_schedule(run.schedule),
            mesh=mesh,
            seq_len=run.data.seq_len,
            seed=0,
            deterministic=True,
        )
        state = steps.init()
    qkv = state.params["layers_0"]["attention"]["qkv"]["kernel"]  # [embed, 3, heads, kv]
    assert qkv.sharding.spec == jax.sharding.PartitionSpec("fsdp", None, "tensor", None)
    assert qkv.addressable_shards[0].data.shape == (32, 3, 2, 8)
    # Adam moments follow the parameters.
    mu_leaves = [
        leaf for leaf in jax.tree.leaves(state.opt_state)
        if getattr(leaf, "shape", None) == qkv.shape
    ]
    assert mu_leaves and all(leaf.sharding.spec == qkv.sharding.spec for leaf in mu_leaves)
