"""The `expert` mesh axis (Pax's USE_EXPERT_PARALLEL): 4-entry mesh shapes, the batch over
data x fsdp x expert, and a dense model on an expert axis training exactly as on one device."""

import fiddle as fdl
import jax
import numpy as np
import pytest

from paxlite.data.feeding import plan_feeding
from paxlite.data.synthetic import SyntheticData
from paxlite.errors import SettingError
from paxlite.experiments.build import load_experiment
from paxlite.models.transformer import Transformer
from paxlite.parallel import rules as rules_lib
from paxlite.parallel.mesh import (
    BATCH_AXES,
    MESH_AXES,
    MeshConfig,
    MeshError,
    build_mesh,
    check_mesh_fits,
    global_batch_size,
)
from paxlite.train.grad_accum import microbatch_size
from paxlite.train.optimizer import make_optimizer
from paxlite.train.schedules import make_schedule
from paxlite.train.step import compile_steps


def _ids(mesh) -> list:
    """Device ids over (data, fsdp, tensor, expert); the pipeline and seq axes must be 1 here."""
    ids = np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices)
    order = [mesh.axis_names.index(a) for a in ("data", "fsdp", "tensor", "expert")]
    rest = [i for i in range(ids.ndim) if i not in order]
    assert all(ids.shape[i] == 1 for i in rest), dict(mesh.shape)
    return np.transpose(ids, order + rest).reshape([ids.shape[i] for i in order]).tolist()


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _hybrid_ids(ici, dcn) -> np.ndarray:
    """The hybrid rule written out index by index, independently of the code under test: granule g
    (devices g*G .. g*G+G-1, G = prod(ici)) sits at DCN position unravel(g, dcn); along every axis
    mesh index = dcn_index * ici_size + ici_index; inside a granule devices go in row-major
    order."""
    ici, dcn = tuple(ici), tuple(dcn)
    per_granule = int(np.prod(ici))
    shape = tuple(i * d for i, d in zip(ici, dcn))
    out = np.empty(shape, dtype=int)
    for index in np.ndindex(*shape):
        dcn_index = tuple(x // i for x, i in zip(index, ici))
        ici_index = tuple(x % i for x, i in zip(index, ici))
        granule = np.ravel_multi_index(dcn_index, dcn)
        out[index] = granule * per_granule + np.ravel_multi_index(ici_index, ici)
    return out


# ------------------------------------------------------------------ shapes and layouts


def test_mesh_always_has_the_four_axes():
    assert MESH_AXES == ("pipeline", "data", "fsdp", "seq", "tensor", "expert")
    assert BATCH_AXES == ("data", "fsdp", "expert")
    three = build_mesh(MeshConfig(ici_mesh_shape=(2, 2, 2)))
    assert three.axis_names == MESH_AXES
    assert dict(three.shape) == {
        "pipeline": 1,
        "data": 2,
        "fsdp": 2,
        "seq": 1,
        "tensor": 2,
        "expert": 1,
    }
    four = build_mesh(MeshConfig(ici_mesh_shape=(2, 1, 1, 4)))
    assert dict(four.shape) == {
        "pipeline": 1,
        "data": 2,
        "fsdp": 1,
        "seq": 1,
        "tensor": 1,
        "expert": 4,
    }
    assert _ids(four) == np.arange(8).reshape(2, 1, 1, 4).tolist()
    default = build_mesh(MeshConfig())
    assert dict(default.shape) == {
        "pipeline": 1,
        "data": 8,
        "fsdp": 1,
        "seq": 1,
        "tensor": 1,
        "expert": 1,
    }


def test_shapes_are_kept_as_given():
    # config.txt/config.json record what the user wrote; padding to all six axes (in MESH_AXES
    # order: pipeline, data, fsdp, seq, tensor, expert) happens on use.
    config = MeshConfig(ici_mesh_shape=(2, 1, 1, 2), dcn_mesh_shape=(2, 1, 1))
    assert config.ici_mesh_shape == (2, 1, 1, 2) and config.dcn_mesh_shape == (2, 1, 1)
    assert config.resolved_ici(4) == (1, 2, 1, 1, 1, 2)
    assert config.resolved_dcn() == (1, 2, 1, 1, 1, 1)
    assert config.shape(4) == (1, 4, 1, 1, 1, 2)
    assert config.axis_sizes(4) == {
        "pipeline": 1,
        "data": 4,
        "fsdp": 1,
        "seq": 1,
        "tensor": 1,
        "expert": 2,
    }
    assert MeshConfig(ici_mesh_shape=(1, 8, 1)).ici_mesh_shape == (1, 8, 1)
    assert MeshConfig().resolved_ici(8) == (1, 8, 1, 1, 1, 1)


@pytest.mark.parametrize(
    ("ici", "dcn", "expected"),
    [
        # Hand-derived: expert across the two stand-in nodes, data inside them. Granule 0 is
        # devices 0-3 laid out [[0, 1], [2, 3]] over (data, expert); granule 1 the same plus 4.
        ((2, 1, 1, 2), (1, 1, 1, 2), [[0, 1, 4, 5], [2, 3, 6, 7]]),
        # expert inside nodes, data across them: granules stacked along data.
        ((1, 1, 1, 4), (2, 1, 1, 1), [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ],
)
def test_hybrid_four_entry_layout_by_hand(ici, dcn, expected):
    mesh = build_mesh(MeshConfig(ici_mesh_shape=ici, dcn_mesh_shape=dcn))
    got = np.asarray(_ids(mesh))
    assert got.shape == tuple(i * d for i, d in zip(ici, dcn))
    assert got.reshape(len(expected), -1).tolist() == expected
    np.testing.assert_array_equal(got, _hybrid_ids(ici, dcn))


@pytest.mark.parametrize(
    ("ici", "dcn"),
    [
        ((1, 2, 1, 2), (2, 1, 1, 1)),
        ((1, 1, 2, 2), (1, 2, 1, 1)),
        ((2, 2, 1, 1), (1, 1, 1, 2)),
        ((1, 2, 1, 2), (2, 1, 1)),  # ici with an expert entry, dcn without: padded with 1
        ((2, 1, 2), (1, 1, 1, 2)),  # and the other way round
    ],
)
def test_hybrid_four_axis_layout_matches_the_rule(ici, dcn):
    mesh = build_mesh(MeshConfig(ici_mesh_shape=ici, dcn_mesh_shape=dcn))
    ici4, dcn4 = tuple(ici) + (1,) * (4 - len(ici)), tuple(dcn) + (1,) * (4 - len(dcn))
    assert mesh.axis_names == MESH_AXES
    np.testing.assert_array_equal(np.asarray(_ids(mesh)), _hybrid_ids(ici4, dcn4))


@pytest.mark.parametrize(
    ("field", "shape"),
    [
        ("ici_mesh_shape", (1, 2, 1, 2, 2, 1, 1)),  # seven entries
        ("ici_mesh_shape", (2, 2, 2, 0)),  # a zero expert axis
        ("dcn_mesh_shape", (1, 0, 1)),
        ("ici_mesh_shape", (2, 1.0, 2, 2)),  # a float among integers
        ("dcn_mesh_shape", (1, 1, 1, True)),  # a bool is not a size
        ("ici_mesh_shape", (8,)),
    ],
)
def test_bad_shapes_are_one_clear_error(field, shape):
    with pytest.raises(MeshError) as info:
        MeshConfig(**{field: shape})
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{field}={list(shape)}: expected 3 to 6 positive integers")
    assert "[data, fsdp, tensor, expert, pipeline, seq]" in message


def test_device_count_errors_count_the_expert_axis():
    with pytest.raises(MeshError, match=r"ICI_MESH_SHAPE=\[2, 1, 1, 8\] x DCN_MESH_SHAPE=\[1, 1, "
                                        r"1\] needs 16 devices, but this job has 8"):
        build_mesh(MeshConfig(ici_mesh_shape=(2, 1, 1, 8)))
    with pytest.raises(MeshError, match=r"DCN_MESH_SHAPE=\[1, 1, 1, 4\] covers 4 processes but "
                                        r"there are 2"):
        check_mesh_fits(MeshConfig(ici_mesh_shape=(1, 1, 1, 4), dcn_mesh_shape=(1, 1, 1, 4)),
                        num_devices=8, num_processes=2)
    check_mesh_fits(MeshConfig(ici_mesh_shape=(2, 1, 1, 2), dcn_mesh_shape=(1, 1, 1, 2)),
                    num_devices=8, num_processes=2)


# ------------------------------------------------------------------ the batch


def test_batch_split_counts_expert():
    assert rules_lib.batch_split(build_mesh(MeshConfig(ici_mesh_shape=(2, 1, 1, 4)))) == 8
    assert rules_lib.batch_split(build_mesh(MeshConfig(ici_mesh_shape=(1, 2, 2, 2)))) == 4
    assert rules_lib.batch_split(build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 8, 1)))) == 1
    with pytest.raises(MeshError, match="does not divide over data x fsdp x expert = 8 ways"):
        global_batch_size(percore_batch_size=0.5, num_devices=8, batch_split=8)
    with pytest.raises(SettingError, match="split over data x fsdp x expert = 8 ways"):
        microbatch_size(global_batch_size=8, grad_accum_steps=2, batch_split=8)


def test_logical_expert_names_map_to_the_expert_axis():
    rules = dict(rules_lib.DEFAULT_RULES)
    assert rules["expert"] == "expert" and rules["activation_exp"] == "expert"
    assert rules["router"] is None
    assert rules["activation_batch"] == ("data", "fsdp", "expert")


@pytest.mark.parametrize(
    ("ici", "dcn"),
    [((2, 1, 1, 4), (1, 1, 1)), ((2, 1, 1, 2), (1, 1, 1, 2)), ((1, 2, 2, 2), (1, 1, 1))],
)
def test_batch_rows_land_on_the_expected_devices(ici, dcn):
    mesh = build_mesh(MeshConfig(ici_mesh_shape=ici, dcn_mesh_shape=dcn))
    sharding = rules_lib.batch_sharding(mesh)
    assert sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp", "expert"), None)
    rows, width = 16, 3
    x = np.arange(rows * width, dtype=np.int32).reshape(rows, width)
    array = jax.device_put(x, sharding)
    sizes = dict(mesh.shape)
    ways = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    per = rows // ways
    ids = np.asarray(_ids(mesh))
    expected = {}  # device id -> its rows: block (d, f, e) in row-major order; tensor replicates
    for d, f, t, e in np.ndindex(*ids.shape):
        block = (d * sizes["fsdp"] + f) * sizes["expert"] + e
        expected[int(ids[d, f, t, e])] = x[block * per : (block + 1) * per]
    assert len(array.addressable_shards) == 8
    for shard in array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.device.id])


def test_feed_blocks_with_expert_across_stand_in_processes():
    # Expert inside the nodes, data across them: each stand-in process holds one contiguous block.
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1, 4), dcn_mesh_shape=(2, 1, 1)))
    plans = [plan_feeding(rules_lib.batch_sharding(mesh), global_batch_size=16, process_index=p,
                          process_of=lambda d: d.id // 4) for p in (0, 1)]
    assert [(p.row_start, p.row_stop) for p in plans] == [(0, 8), (8, 16)]
    # Expert across the nodes with data inside: the batch's innermost axis crosses processes, so a
    # process holds every other block; refused by name, as for fsdp across nodes.
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(2, 1, 1, 2), dcn_mesh_shape=(1, 1, 1, 2)))
    with pytest.raises(SettingError, match="process 0 holds non-contiguous batch rows"):
        plan_feeding(rules_lib.batch_sharding(mesh), global_batch_size=16, process_index=0,
                     process_of=lambda d: d.id // 4)


# ------------------------------------------------------------------ a dense model on an expert axis

GLOBAL_BATCH = 8
NUM_STEPS = 3


def _train(mesh):
    """Initial parameters and per-step losses and final parameters of TinySynthetic on `mesh`.

    ADAM_EPSILON is raised from 1e-6 so that gradients which are zero in exact arithmetic (the key
    bias's: softmax ignores a per-query constant) are not normalised into lr-sized, round-off-
    decided updates; no warm-up, so that every update is far above the tolerances.
    """
    experiment = load_experiment("TinySynthetic", ["ADAM_EPSILON=1e-2", "LR_COS_WARMUP=0"])
    run = fdl.build(experiment.run_config())
    model = Transformer(run.model)
    schedule = make_schedule(run.schedule)
    data = SyntheticData(run.data, global_batch_size=GLOBAL_BATCH)
    with jax.set_mesh(mesh):
        steps = compile_steps(model=model, optimizer=make_optimizer(run.optimizer, schedule),
                              schedule=schedule, mesh=mesh, seq_len=run.data.seq_len,
                              seed=run.loop.seed, deterministic=True)
        state = steps.init()
        params0 = jax.device_get(state.params)
        losses = []
        for index in range(NUM_STEPS):
            state, metrics = steps.train(state, data.train_batch(index, steps.batch_sharding))
            losses.append(float(metrics["loss"]))
        return params0, losses, jax.device_get(state.params), state.params


@pytest.fixture(scope="module")
def one_device():
    return _train(build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1)), devices=jax.devices()[:1]))


def test_dense_model_on_an_expert_axis_matches_one_device(one_device):
    params0_ref, losses_ref, params_ref, _ = one_device
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(2, 1, 1, 4)))
    params0, losses, params, live = _train(mesh)
    # The batch really is split 8 ways (2 data x 4 expert): each device holds one row.
    assert rules_lib.batch_split(mesh) == 8
    jax.tree.map(np.testing.assert_array_equal, params0, params0_ref)
    np.testing.assert_allclose(losses, losses_ref, rtol=1e-5)
    assert losses[-1] < losses[0]  # it trained
    flat_ref = jax.tree_util.tree_leaves_with_path(params_ref)
    flat, flat0 = jax.tree.leaves(params), jax.tree.leaves(params0_ref)
    assert len(flat) == len(flat_ref) > 10
    for (path, ref), got, start in zip(flat_ref, flat, flat0):
        name = jax.tree_util.keystr(path)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6, err_msg=f"parameter {name}")
        # What training changed (over 100x the atol above), compared as a whole.
        update_ref, update = ref - start, got - start
        assert np.max(np.abs(update_ref)) > 1e-4, name
        assert _rel_err(update, update_ref) < 1e-3, name
    # The dense parameters replicate over expert (no rule maps their names to it).
    assert all("expert" not in str(leaf.sharding.spec) for leaf in jax.tree.leaves(live))
