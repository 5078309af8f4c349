"""paxlite/compat.py: each private API of JAX, Orbax and Grain still behaves as paxlite relies on.

A private name can move or change in any release; these tests fail when an upgrade moves one, and
when a pin in constraints.txt moves past the versions the couplings were checked against.
"""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import re
import subprocess
import sys
import threading

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest

from paxlite import compat
from paxlite.checkpointing.stream_write import CheckpointWriter
from paxlite.data.mixture import grain_proportions

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line.strip())
        if match:
            pins[match[1].lower()] = match[2]
    return pins


@pytest.mark.parametrize(("package", "version"), compat.CHECKED_VERSIONS)
def test_the_couplings_were_checked_against_the_pinned_versions(package, version):
    """A new pin means re-checking compat.py's couplings (and then updating CHECKED_VERSIONS)."""
    assert _pins()[package] == version, (
        f"constraints.txt pins {package}=={_pins()[package]}, but paxlite/compat.py was checked "
        f"against {version}: re-check its private APIs, then update CHECKED_VERSIONS")


def test_thread_cache_min_compile_time_is_thread_local_and_restored():
    import jax
    from jax._src import config as jax_config

    setting = jax_config.persistent_cache_min_compile_time_secs
    before = setting.value
    seen_by_another_thread = []
    with compat.thread_cache_min_compile_time(float("inf")):
        assert setting.value == float("inf")
        assert jax.config.jax_persistent_cache_min_compile_time_secs == float("inf")
        other = threading.Thread(target=lambda: seen_by_another_thread.append(setting.value))
        other.start()
        other.join()
    assert seen_by_another_thread == [before]
    assert setting.value == before


_CACHE_PROBE = """
import json, os, sys
import jax, jax.numpy as jnp
from paxlite.compat import thread_cache_min_compile_time

jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
with thread_cache_min_compile_time(float("inf")):
    jax.jit(lambda x: x * 3 + 1)(jnp.ones(3)).block_until_ready()
inside = len(os.listdir(sys.argv[1]))
jax.jit(lambda x: x * 5 - 2)(jnp.ones(3)).block_until_ready()
print(json.dumps([inside, len(os.listdir(sys.argv[1]))]))
"""


def test_thread_cache_min_compile_time_keeps_a_compile_out_of_the_cache(tmp_path):
    """What train/step.py relies on: a program compiled in the context is never written to the
    persistent cache, and one compiled after it is (a fresh process: the cache binds its directory
    once)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    result = subprocess.run([sys.executable, "-c", _CACHE_PROBE, str(tmp_path)], cwd=ROOT,
                            env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    inside, after = json.loads(result.stdout.strip().splitlines()[-1])
    assert (inside, after) == (0, 1)


def test_orbax_names_its_standard_handler_as_the_stream_writer_does():
    assert ocp.StandardCheckpointHandler.typestr() == compat.ORBAX_STANDARD_HANDLER_TYPESTR


def test_orbax_restores_a_stream_written_checkpoint_by_the_handler_it_names(tmp_path):
    """Restored with no arguments, Orbax picks the item's handler by the name the writer recorded;
    a name it does not know leaves the item unrestorable."""
    writer = CheckpointWriter(str(tmp_path), step=0)
    weights = np.arange(6, dtype=np.float32).reshape(2, 3)
    writer.write(("params", "w"), weights)
    step_dir = writer.close()
    with open(os.path.join(step_dir, "_CHECKPOINT_METADATA")) as f:
        assert json.load(f)["item_handlers"] == {"state": compat.ORBAX_STANDARD_HANDLER_TYPESTR}
    options = ocp.CheckpointManagerOptions(step_prefix="checkpoint", step_format_fixed_length=8,
                                           create=False)
    with ocp.CheckpointManager(str(tmp_path / "checkpoints"), options=options) as manager:
        restored = manager.restore(0)
    np.testing.assert_array_equal(np.asarray(restored["state"]["params"]["w"]), weights)


def test_orbax_writes_an_async_save_in_threads_of_its_own_classes(tmp_path, monkeypatch):
    """The threads started by an asynchronous save: those compat.is_orbax_writer names include the
    one Orbax finalizes the save in (the step directory is renamed from its temporary name there),
    and every other one is a plain thread (a pool's worker)."""
    started = []
    start = threading.Thread.start

    def recording_start(thread):
        started.append(thread)
        return start(thread)

    monkeypatch.setattr(threading.Thread, "start", recording_start)
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=True,
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
    with ocp.CheckpointManager(str(tmp_path), options=options) as manager:
        manager.save(1, args=ocp.args.StandardSave({"x": np.arange(8.0)}))
        writers = [thread for thread in started if compat.is_orbax_writer(thread)]
        manager.wait_until_finished()
    assert writers, [type(thread) for thread in started]
    assert {type(thread).__name__ for thread in writers} <= {"_FinalizeThread", "_SignalingThread"}
    assert all(type(thread) is threading.Thread for thread in started if thread not in writers)
    assert not any(thread.is_alive() for thread in writers)
    assert sorted(os.listdir(tmp_path)) == ["1"]


def test_one_process_saves_each_replicated_array_from_one_whole_shard(tmp_path, monkeypatch):
    """A replicated array on 8 devices: Orbax's replica-parallel handler slices each replica's
    shard (8 slices), the handler `save_replicas_whole_in_one_process` registers slices none, and
    the array restores equal from both saves. With 2 processes the registry is left alone."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from orbax.checkpoint._src.metadata import array_metadata_store

    sliced = []
    slice_in_dim = jax.lax.slice_in_dim
    monkeypatch.setattr(jax.lax, "slice_in_dim",
                        lambda *a, **k: sliced.append(a[0].shape) or slice_in_dim(*a, **k))
    mesh = jax.make_mesh((8,), ("data",))
    value = jax.device_put(np.arange(64, dtype=np.float32).reshape(16, 4),
                           NamedSharding(mesh, PartitionSpec()))
    target = {"w": jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=value.sharding)}

    def save_and_restore(name: str) -> np.ndarray:
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp_path / name, {"w": value})
            checkpointer.wait_until_finished()
            return np.asarray(checkpointer.restore(tmp_path / name, target)["w"])

    replica_parallel = ocp.type_handlers.ArrayHandler(
        use_replica_parallel=True, array_metadata_store=array_metadata_store.Store())
    ocp.type_handlers.register_type_handler(jax.Array, replica_parallel, override=True)
    np.testing.assert_array_equal(save_and_restore("replica_parallel"), np.asarray(value))
    assert sliced == [(16, 4)] * 8

    with monkeypatch.context() as two_processes:
        two_processes.setattr(jax, "process_count", lambda: 2)
        compat.save_replicas_whole_in_one_process()
        assert ocp.type_handlers.get_type_handler(jax.Array) is replica_parallel

    sliced.clear()
    compat.save_replicas_whole_in_one_process()
    assert ocp.type_handlers.get_type_handler(jax.Array) is not replica_parallel
    np.testing.assert_array_equal(save_and_restore("whole"), np.asarray(value))
    assert sliced == []


def test_grain_scales_the_smallest_proportion_to_the_constant():
    from grain._src.python.dataset.transformations import mix

    scale = inspect.signature(mix._float_to_int_proportions).parameters["scale_min_to"]
    assert scale.default == compat.GRAIN_SMALLEST_PROPORTION
    # Integer proportions whose smallest is already the constant pass through unchanged.
    proportions = grain_proportions([1.0, 2.5, 0.333])
    assert min(proportions) == compat.GRAIN_SMALLEST_PROPORTION
    assert list(mix._float_to_int_proportions(proportions)) == list(proportions)
    assert list(mix._float_to_int_proportions([2, 5])) == [100, 250]


def test_grain_mixes_float_weights_as_the_scaled_integer_proportions():
    """The public side of the same rule: Grain mixes weights 1 : 1.2345 exactly as the integer
    proportions `grain_proportions` reports for them, 100 : 123 (a finer scale, 1000 : 1234, would
    give source 1 about 12318 of the first 22300 rows, not 12300)."""
    def order(proportions) -> list[int]:
        sources = [grain.MapDataset.range(i, 10**6, 2) for i in range(2)]
        mixed = grain.MapDataset.mix(sources, proportions)
        return [mixed[k] % 2 for k in range(22_300)]

    weights = [1.0, 1.2345]
    assert grain_proportions(weights) == (100, 123)
    mixed = order(weights)
    assert mixed == order(list(grain_proportions(weights)))
    assert sum(mixed) == 100 * 123  # each period of 100 + 123 rows holds 123 of source 1


def test_the_distributed_client_is_none_in_one_process_and_has_the_store_calls():
    """One process: no client (train/peer_faults.py then does nothing). The client type XLA builds
    for several processes has the key-value calls peer_faults.py makes, with their arguments."""
    from jax._src.lib import _jax

    assert compat.distributed_client() is None
    client = _jax.DistributedRuntimeClient
    for name, arguments in (("key_value_set", "(self, key: str, value: str"),
                            ("key_value_try_get", "(self, key: str)"),
                            ("key_value_dir_get", "(self, key: str)")):
        assert getattr(client, name).__doc__.startswith(f"{name}{arguments}"), name
