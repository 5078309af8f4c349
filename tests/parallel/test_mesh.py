import jax
import pytest

from paxlite.parallel.mesh import MeshConfig, MeshError, build_mesh, global_batch_size


def test_mesh_is_ici_times_dcn():
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(1, 2, 2), dcn_mesh_shape=(2, 1, 1)))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_default_puts_every_device_on_data():
    mesh = build_mesh(MeshConfig())
    assert dict(mesh.shape) == {"data": 8, "fsdp": 1, "tensor": 1}


def test_wrong_device_count_names_both_numbers():
    with pytest.raises(MeshError, match=r"needs 64 devices, but this job has 8") as info:
        build_mesh(MeshConfig(ici_mesh_shape=(8, 1, 1), dcn_mesh_shape=(8, 1, 1)))
    assert "ICI_MESH_SHAPE=[8,1,1]" in str(info.value).replace(" ", "")


@pytest.mark.parametrize("shape", [(1, 2), (0, 8, 1), (1, 8, -1), (1.0, 8, 1)])
def test_bad_shape(shape):
    with pytest.raises(MeshError, match="3 positive integers"):
        MeshConfig(ici_mesh_shape=shape)


def test_global_batch_pax_semantics():
    # PERCORE x devices regardless of the parallelism; fractional with tensor parallelism.
    assert global_batch_size(percore_batch_size=4, num_devices=8, batch_split=8) == 32
    assert global_batch_size(percore_batch_size=0.5, num_devices=8, batch_split=4) == 4
    with pytest.raises(MeshError, match="not a positive whole global batch"):
        global_batch_size(percore_batch_size=0.3, num_devices=8, batch_split=1)
    with pytest.raises(MeshError, match="does not divide over data x fsdp = 8"):
        global_batch_size(percore_batch_size=0.5, num_devices=8, batch_split=8)


def test_indivisible_parameter_is_named_before_compiling():
    from paxlite.config.build import build_run_config
    from paxlite.models.transformer import Transformer
    from paxlite.train.optimizer import make_optimizer
    from paxlite.train.schedules import make_schedule
    from paxlite.train.step import compile_steps

    _, run = build_run_config("TinySynthetic", ["NUM_HEADS=4", "DIMS_PER_HEAD=16"])
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 8)))
    schedule = make_schedule(run.schedule)
    with jax.set_mesh(mesh), pytest.raises(MeshError, match=r"qkv.*dimension 4 over tensor=8"):
        compile_steps(model=Transformer(run.model), optimizer=make_optimizer(run.optimizer, schedule),
                      schedule=schedule, mesh=mesh, seq_len=64, seed=0, deterministic=True)
