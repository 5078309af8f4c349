import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from paxlite.data.feeding import plan_feeding
from paxlite.parallel.mesh import (
    BATCH_AXES,
    MeshConfig,
    MeshError,
    build_mesh,
    check_mesh_fits,
    global_batch_size,
    hybrid_layout,
)


def test_mesh_is_ici_times_dcn():
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(1, 2, 2), dcn_mesh_shape=(2, 1, 1)))
    assert dict(mesh.shape) == {
        "pipeline": 1,
        "data": 2,
        "fsdp": 2,
        "seq": 1,
        "tensor": 2,
        "expert": 1,
    }
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_default_puts_every_device_on_data():
    mesh = build_mesh(MeshConfig())
    assert dict(mesh.shape) == {
        "pipeline": 1,
        "data": 8,
        "fsdp": 1,
        "seq": 1,
        "tensor": 1,
        "expert": 1,
    }


def test_wrong_device_count_names_both_numbers():
    with pytest.raises(MeshError, match=r"needs 64 devices, but this job has 8") as info:
        build_mesh(MeshConfig(ici_mesh_shape=(8, 1, 1), dcn_mesh_shape=(8, 1, 1)))
    assert "ICI_MESH_SHAPE=[8,1,1]" in str(info.value).replace(" ", "")


@pytest.mark.parametrize("shape", [(1, 2), (0, 8, 1), (1, 8, -1), (1.0, 8, 1)])
def test_bad_shape(shape):
    with pytest.raises(MeshError, match="3 to 6 positive integers"):
        MeshConfig(ici_mesh_shape=shape)


def test_global_batch_pax_semantics():
    # PERCORE x devices regardless of the parallelism; fractional with tensor parallelism.
    assert global_batch_size(percore_batch_size=4, num_devices=8, batch_split=8) == 32
    assert global_batch_size(percore_batch_size=0.5, num_devices=8, batch_split=4) == 4
    with pytest.raises(MeshError, match="not a positive whole global batch"):
        global_batch_size(percore_batch_size=0.3, num_devices=8, batch_split=1)
    with pytest.raises(MeshError, match="does not divide over data x fsdp x expert = 8"):
        global_batch_size(percore_batch_size=0.5, num_devices=8, batch_split=8)


def test_indivisible_parameter_is_named_before_compiling():
    from paxlite.experiments.build import build_run_config
    from paxlite.models.transformer import Transformer
    from paxlite.train.optimizer import make_optimizer
    from paxlite.train.schedules import make_schedule
    from paxlite.train.step import compile_steps

    _, run = build_run_config("TinySynthetic", ["NUM_HEADS=4", "DIMS_PER_HEAD=16"])
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 8)))
    schedule = make_schedule(run.schedule)
    with jax.set_mesh(mesh), pytest.raises(MeshError, match=r"qkv.*dimension 4 over tensor=8"):
        compile_steps(
            model=Transformer(run.model),
            optimizer=make_optimizer(run.optimizer, schedule),
            schedule=schedule,
            mesh=mesh,
            seq_len=64,
            seed=0,
            deterministic=True,
        )


def _ids(mesh) -> list:
    """Device ids over (data, fsdp, tensor, expert); the pipeline and seq axes must be 1 here."""
    ids = np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices)
    order = [mesh.axis_names.index(a) for a in ("data", "fsdp", "tensor", "expert")]
    rest = [i for i in range(ids.ndim) if i not in order]
    assert all(ids.shape[i] == 1 for i in rest), dict(mesh.shape)
    return np.transpose(ids, order + rest).reshape([ids.shape[i] for i in order]).tolist()


@pytest.mark.parametrize(
    ("ici", "dcn", "expected"),
    [
        # Hand-derived from the hybrid rule: granule g = devices 4g..4g+3; along each axis the DCN
        # index is the outer one (mesh index = dcn_index x ici_size + ici_index).
        ((1, 2, 2), (2, 1, 1), [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]),
        ((2, 1, 2), (1, 2, 1), [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]),
        ((2, 2, 1), (1, 1, 2), [[[0, 4], [1, 5]], [[2, 6], [3, 7]]]),
        ((1, 4, 1), (1, 2, 1), [[[0], [1], [2], [3], [4], [5], [6], [7]]]),
    ],
)
def test_one_process_lays_out_dcn_axes_as_a_hybrid_mesh(ici, dcn, expected):
    mesh = build_mesh(MeshConfig(ici_mesh_shape=ici, dcn_mesh_shape=dcn))
    assert mesh.shape["expert"] == 1  # 3-entry shapes: the trailing expert axis has size 1
    assert np.asarray(_ids(mesh))[..., 0].tolist() == expected


def test_hybrid_layout_matches_jax_hybrid_mesh_rule():
    # The rule of mesh_utils.create_hybrid_device_mesh: np.block of per-granule ICI meshes in DCN
    # shape.
    devices = jax.devices()
    ici, dcn = (1, 2, 2), (2, 1, 1)
    granules = [devices[:4], devices[4:]]
    blocks = np.empty(dcn, dtype=object)
    for g, granule in enumerate(granules):
        blocks[np.unravel_index(g, dcn)] = np.asarray(granule, dtype=object).reshape(ici)
    reference = np.block(blocks.tolist())
    got = hybrid_layout(ici, dcn, granules)
    assert got.shape == reference.shape == (2, 2, 2)
    assert [d.id for d in got.flat] == [d.id for d in reference.flat]


@pytest.mark.parametrize(
    ("ici", "dcn"), [((1, 2, 2), (2, 1, 1)), ((1, 4, 1), (1, 2, 1)), ((1, 2, 2), (1, 2, 1))]
)
def test_each_stand_in_process_feeds_one_contiguous_block(ici, dcn):
    # Devices 0-3 stand for process 0, 4-7 for process 1: the batch rows each holds must be one
    # block, the first half for process 0, as the multi-process feed requires.
    mesh = build_mesh(MeshConfig(ici_mesh_shape=ici, dcn_mesh_shape=dcn))
    sharding = NamedSharding(mesh, P(BATCH_AXES))
    plans = [
        plan_feeding(
            sharding, global_batch_size=16, process_index=p, process_of=lambda d: d.id // 4
        )
        for p in (0, 1)
    ]
    assert [(p.row_start, p.row_stop) for p in plans] == [(0, 8), (8, 16)]


@pytest.mark.parametrize(
    ("ici", "dcn", "message"),
    [
        (
            (2, 2, 2),
            (1, 1, 1),
            (r"ICI_MESH_SHAPE=\[2, 2, 2\] covers 8 devices but each process has 4; "
             r"DCN_MESH_SHAPE=\[1, 1, 1\] covers 1 processes but there are 2"),
        ),
        ((1, 2, 2), (1, 1, 1), r"DCN_MESH_SHAPE=\[1, 1, 1\] covers 1 processes but there are 2"),
        (
            (1, 2, 1),
            (2, 1, 1),
            r"ICI_MESH_SHAPE=\[1, 2, 1\] covers 2 devices but each process has 4",
        ),
        ((1, 4, 1), (4, 1, 1), r"DCN_MESH_SHAPE=\[4, 1, 1\] covers 4 processes but there are 2"),
        (
            None,
            (1, 1, 1),
            r"DCN_MESH_SHAPE=\[1, 1, 1\] covers 1 processes.*DCN_MESH_SHAPE=\[2,1,1\]",
        ),
    ],
)
def test_several_processes_need_ici_per_process_and_dcn_per_process_count(ici, dcn, message):
    with pytest.raises(MeshError, match=message):
        check_mesh_fits(
            MeshConfig(ici_mesh_shape=ici, dcn_mesh_shape=dcn), num_devices=8, num_processes=2
        )


@pytest.mark.parametrize(
    ("ici", "dcn"), [((1, 2, 2), (2, 1, 1)), ((4, 1, 1), (1, 1, 2)), (None, (2, 1, 1))]
)
def test_exact_split_over_processes_is_accepted(ici, dcn):
    check_mesh_fits(
        MeshConfig(ici_mesh_shape=ici, dcn_mesh_shape=dcn), num_devices=8, num_processes=2
    )


def test_uneven_devices_per_process():
    with pytest.raises(MeshError, match="7 devices over 2 processes is uneven"):
        check_mesh_fits(MeshConfig(), num_devices=7, num_processes=2)


def test_one_process_keeps_accepting_dcn_when_the_product_matches():
    # One host standing in for two nodes; ICI x DCN must still cover exactly its devices.
    check_mesh_fits(
        MeshConfig(ici_mesh_shape=(1, 2, 2), dcn_mesh_shape=(2, 1, 1)),
        num_devices=8,
        num_processes=1,
    )
    with pytest.raises(MeshError, match=r"needs 16 devices, but this job has 8 \(1 process"):
        check_mesh_fits(
            MeshConfig(ici_mesh_shape=(2, 2, 2), dcn_mesh_shape=(2, 1, 1)),
            num_devices=8,
            num_processes=1,
        )


# ------------------------------------------------------------------ pipeline and seq axes
# (issue 24)


def test_five_and_six_entry_shapes_add_pipeline_and_seq_without_moving_older_axes():
    from paxlite.parallel.mesh import MESH_AXES

    assert MESH_AXES == ("pipeline", "data", "fsdp", "seq", "tensor", "expert")
    five = MeshConfig(ici_mesh_shape=(1, 2, 1, 1, 4))
    assert five.axis_sizes(8) == {
        "pipeline": 4,
        "data": 1,
        "fsdp": 2,
        "seq": 1,
        "tensor": 1,
        "expert": 1,
    }
    six = MeshConfig(ici_mesh_shape=(2, 1, 1, 1, 2, 2))
    assert six.axis_sizes(8) == {
        "pipeline": 2,
        "data": 2,
        "fsdp": 1,
        "seq": 2,
        "tensor": 1,
        "expert": 1,
    }
    # the same sizes in ICI x DCN: element-wise per named axis
    hybrid = MeshConfig(ici_mesh_shape=(1, 2, 1, 1, 1, 2), dcn_mesh_shape=(1, 1, 1, 1, 2))
    assert hybrid.axis_sizes(4) == {
        "pipeline": 2,
        "data": 1,
        "fsdp": 2,
        "seq": 2,
        "tensor": 1,
        "expert": 1,
    }


def test_pax_pipelined_four_entry_form_is_pipeline_data_fsdp_tensor():
    from paxlite.parallel.mesh import MeshLayout

    pax = MeshConfig(ici_mesh_shape=(2, 1, 2, 2), layout=MeshLayout.PAX_PIPELINED)
    assert pax.axis_sizes(8) == {
        "pipeline": 2,
        "data": 1,
        "fsdp": 2,
        "seq": 1,
        "tensor": 2,
        "expert": 1,
    }
    # without the layout the same four numbers mean [data, fsdp, tensor, expert], as ever
    assert MeshConfig(ici_mesh_shape=(2, 1, 2, 2)).axis_sizes(8)["expert"] == 2
    # 3 entries mean [data, fsdp, tensor] in both layouts
    assert (
        MeshConfig(ici_mesh_shape=(2, 2, 2), layout=MeshLayout.PAX_PIPELINED).axis_sizes(8)[
            "pipeline"
        ]
        == 1
    )
    # 5 and 6 entries are paxlite's form in both layouts
    assert (
        MeshConfig(ici_mesh_shape=(1, 1, 1, 1, 8), layout=MeshLayout.PAX_PIPELINED).axis_sizes(8)[
            "pipeline"
        ]
        == 8
    )
    with pytest.raises(MeshError, match=r"ici_mesh_shape=\[1, 1, 1, 1, 1, 1, 8\]: expected 3 to 6 "
                                        r".*; 4 entries are Pax's pipelined \[pipeline, data, "
                                        r"fsdp, tensor\]"):
        MeshConfig(ici_mesh_shape=(1, 1, 1, 1, 1, 1, 8), layout=MeshLayout.PAX_PIPELINED)


def test_pipeline_is_the_outermost_axis_and_seq_sits_before_tensor():
    # One process: row-major over MESH_AXES, so stage s holds devices [4s, 4s+4) (contiguous blocks,
    # the slowest links between stages) and tensor stays innermost of the axes that talk every
    # layer.
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 2, 1, 2, 2)))
    ids = np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices)
    assert mesh.axis_names == ("pipeline", "data", "fsdp", "seq", "tensor", "expert")
    assert ids.shape == (2, 1, 1, 2, 2, 1)
    assert ids[0].ravel().tolist() == [0, 1, 2, 3] and ids[1].ravel().tolist() == [4, 5, 6, 7]
    assert ids[0, 0, 0, :, 0, 0].tolist() == [0, 2] and ids[0, 0, 0, 0, :, 0].tolist() == [0, 1]


def test_pipeline_over_dcn_puts_one_stage_per_stand_in_process():
    # DCN pipeline 2 on one host standing in for two: granule g (devices 4g..4g+3) is stage g.
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(2, 2, 1), dcn_mesh_shape=(1, 1, 1, 1, 2)))
    ids = np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices)
    assert dict(mesh.shape)["pipeline"] == 2
    assert sorted(ids[0].ravel().tolist()) == [0, 1, 2, 3]
    assert sorted(ids[1].ravel().tolist()) == [4, 5, 6, 7]


def test_batch_is_not_split_over_pipeline_or_seq():
    from paxlite.parallel.rules import batch_sharding, batch_split

    mesh = build_mesh(MeshConfig(ici_mesh_shape=(2, 1, 1, 1, 2, 2)))
    assert batch_split(mesh) == 2
    assert batch_sharding(mesh).spec == P(("data", "fsdp", "expert"), None)
