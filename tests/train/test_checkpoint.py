"""Checkpointer on real Orbax, on a mesh over the 8 fake CPU devices."""

import logging
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from paxlite.checkpointing.checkpoint import (
    Checkpointer,
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointReadError,
    NoRestorableCheckpointError,
)


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((4, 2), ("fsdp", "tensor"))


def _state(scale: int) -> dict:
    """A small train state whose values identify the step that wrote it."""
    mesh = _mesh()
    w = jnp.arange(32, dtype=jnp.float32).reshape(8, 4) * scale + 0.25
    b = (jnp.arange(4, dtype=jnp.float32) * scale - 1.5).astype(jnp.bfloat16)
    return {
        "params": {
            "w": jax.device_put(w, NamedSharding(mesh, P("fsdp", "tensor"))),
            "b": jax.device_put(b, NamedSharding(mesh, P())),
        },
        "step": jax.device_put(jnp.int32(scale), NamedSharding(mesh, P())),
    }


def _abstract() -> dict:
    """Restore targets; `w` gets a different sharding than it was saved with (resharding)."""
    mesh = _mesh()
    return {
        "params": {
            "w": jax.ShapeDtypeStruct(
                (8, 4), jnp.float32, sharding=NamedSharding(mesh, P("tensor", "fsdp"))
            ),
            "b": jax.ShapeDtypeStruct((4,), jnp.bfloat16, sharding=NamedSharding(mesh, P())),
        },
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())),
    }


def _assert_state_equal(got: dict, want: dict, abstract: dict) -> None:
    leaves = zip(
        jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(abstract), strict=True
    )
    for g, w, a in leaves:
        assert g.dtype == w.dtype and g.shape == w.shape
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes()  # bit-equal
        assert g.sharding == a.sharding


def _names(directory: pathlib.Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _save_steps(directory: pathlib.Path, steps: list[int], **kwargs: object) -> None:
    with Checkpointer(directory, save_interval_steps=1, max_to_keep=None, **kwargs) as ckpt:
        for step in steps:
            assert ckpt.save(step, _state(step))


def test_round_trip_bit_equal_with_shardings(tmp_path: pathlib.Path) -> None:
    directory = tmp_path / "checkpoints"
    with Checkpointer(directory, save_interval_steps=100, max_to_keep=None) as ckpt:
        assert ckpt.save(100, _state(100))
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [100]
    assert _names(directory) == ["checkpoint_00000100"]
    assert (directory / "checkpoint_00000100" / "state").is_dir()
    with Checkpointer(directory, save_interval_steps=100, max_to_keep=None) as ckpt:
        step, restored = ckpt.restore_latest(_abstract())
    assert step == 100
    _assert_state_equal(restored, _state(100), _abstract())


def test_relative_directory(tmp_path: pathlib.Path, monkeypatch) -> None:
    """Orbax's async save needs absolute paths; users type relative ones (`--job_log_dir=run1`)."""
    monkeypatch.chdir(tmp_path)
    with Checkpointer("run1/checkpoints", save_interval_steps=1, max_to_keep=None) as ckpt:
        assert ckpt.save(1, _state(1))
        ckpt.wait_until_finished()
    assert _names(tmp_path / "run1" / "checkpoints") == ["checkpoint_00000001"]
    with Checkpointer("run1/checkpoints", save_interval_steps=1, max_to_keep=None) as ckpt:
        step, restored = ckpt.restore_latest(_abstract())
    assert step == 1
    _assert_state_equal(restored, _state(1), _abstract())


def test_empty_directory_restores_nothing(tmp_path: pathlib.Path) -> None:
    with Checkpointer(tmp_path / "c", save_interval_steps=1, max_to_keep=None) as ckpt:
        assert ckpt.restore_latest(_abstract()) is None


def test_max_to_keep(tmp_path: pathlib.Path) -> None:
    with Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=2) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, _state(step))
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [3, 4]
    assert _names(tmp_path) == ["checkpoint_00000003", "checkpoint_00000004"]


def test_should_save_and_force(tmp_path: pathlib.Path) -> None:
    with Checkpointer(tmp_path, save_interval_steps=10, max_to_keep=None) as ckpt:
        assert [s for s in range(25) if ckpt.should_save(s)] == [0, 10, 20]
        assert not ckpt.save(5, _state(5))
        assert ckpt.save(10, _state(10))
        assert ckpt.save(7, _state(7), force=True)
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [7, 10]


def test_disabled_saving_never_writes_but_restores(tmp_path: pathlib.Path) -> None:
    empty = tmp_path / "never"
    with Checkpointer(empty, save_interval_steps=1, max_to_keep=None, enable_saving=False) as ckpt:
        assert not ckpt.should_save(1)
        assert not ckpt.save(1, _state(1), force=True)
        assert ckpt.restore_latest(_abstract()) is None
    assert not empty.exists()
    _save_steps(tmp_path / "c", [3])
    with Checkpointer(
        tmp_path / "c", save_interval_steps=1, max_to_keep=1, enable_saving=False
    ) as ckpt:
        assert not ckpt.save(4, _state(4), force=True)
        step, restored = ckpt.restore_latest(_abstract())
    assert step == 3
    _assert_state_equal(restored, _state(3), _abstract())
    assert _names(tmp_path / "c") == ["checkpoint_00000003"]


def _delete_manifest(step_dir: pathlib.Path) -> None:
    (step_dir / "state" / "manifest.ocdbt").unlink()


def _truncate_data(step_dir: pathlib.Path) -> None:
    files = (step_dir / "state").rglob("*")
    data_files = [p for p in files if p.is_file() and p.parent.name == "d"]
    assert data_files
    for path in data_files:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)


def _garble_metadata(step_dir: pathlib.Path) -> None:
    (step_dir / "state" / "_METADATA").write_text('{"tree_metadata": {"params": [oops')


@pytest.mark.parametrize("corrupt", [_delete_manifest, _truncate_data, _garble_metadata])
def test_corrupted_latest_falls_back_and_is_moved_aside(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, corrupt
) -> None:
    directory = tmp_path / "checkpoints"
    _save_steps(directory, [1, 2, 3])
    corrupt(directory / "checkpoint_00000003")
    with (caplog.at_level(logging.WARNING),
          Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as ckpt):
        step, restored = ckpt.restore_latest(_abstract())
        assert step == 2
        _assert_state_equal(restored, _state(2), _abstract())
        assert ckpt.all_steps() == [1, 2]
        # The step can be saved again without colliding with the corrupted copy.
        assert ckpt.save(3, _state(3))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(directory / "checkpoint_00000003") in m and "Error" in m for m in warnings)
    aside = tmp_path / "checkpoints_corrupted" / "checkpoint_00000003"
    assert aside.is_dir() and (aside / "state").is_dir()
    # A second corruption of the same step gets a numeric suffix instead of clobbering the first.
    corrupt(directory / "checkpoint_00000003")
    with Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as ckpt:
        assert ckpt.restore_latest(_abstract())[0] == 2
    assert _names(aside.parent) == [
        "checkpoint_00000003",
        "checkpoint_00000003.1",
    ]


def test_leftover_tmp_directory_is_ignored(tmp_path: pathlib.Path) -> None:
    _save_steps(tmp_path, [1])
    leftover = tmp_path / "checkpoint_00000009.orbax-checkpoint-tmp"
    (leftover / "state").mkdir(parents=True)
    (leftover / "state" / "partial").write_bytes(b"\x00" * 10)
    with Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=None) as ckpt:
        assert ckpt.all_steps() == [1]
        step, _restored = ckpt.restore_latest(_abstract())
        assert step == 1
        assert (leftover / "state" / "partial").exists()
        # Saving that step later keeps the leftover, moved aside rather than deleted by Orbax.
        assert ckpt.save(9, _state(9))
    kept = tmp_path.parent / f"{tmp_path.name}_corrupted" / leftover.name / "state" / "partial"
    assert kept.read_bytes() == b"\x00" * 10
    with Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=None) as ckpt:
        assert ckpt.restore_latest(_abstract())[0] == 9


def test_all_corrupt_raises_and_moves_nothing(tmp_path: pathlib.Path) -> None:
    _save_steps(tmp_path, [1, 2])
    _delete_manifest(tmp_path / "checkpoint_00000001")
    _garble_metadata(tmp_path / "checkpoint_00000002")
    with (Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=None) as ckpt,
          pytest.raises(NoRestorableCheckpointError) as info):
        ckpt.restore_latest(_abstract())
    message = str(info.value)
    assert "checkpoint_00000001" in message and "checkpoint_00000002" in message
    assert _names(tmp_path) == ["checkpoint_00000001", "checkpoint_00000002"]
    assert not (tmp_path.parent / f"{tmp_path.name}_corrupted").exists()


def _snapshot(directory: pathlib.Path) -> dict[str, bytes]:
    files = [p for p in directory.rglob("*") if p.is_file()]
    return {str(p.relative_to(directory)): p.read_bytes() for p in files}


def test_existing_step_is_an_error(tmp_path: pathlib.Path) -> None:
    _save_steps(tmp_path, [5])
    before = _snapshot(tmp_path / "checkpoint_00000005")
    with Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=None) as ckpt:
        with pytest.raises(CheckpointExistsError, match="checkpoint_00000005"):
            ckpt.save(5, _state(6))
        assert ckpt.save(6, _state(6))
        with pytest.raises(CheckpointExistsError, match="checkpoint_00000006"):
            ckpt.save(6, _state(7))  # still in flight or just committed
        step, restored = ckpt.restore_latest(_abstract())
    assert step == 6
    _assert_state_equal(restored, _state(6), _abstract())
    assert _snapshot(tmp_path / "checkpoint_00000005") == before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(save_interval_steps=0, max_to_keep=None), "save_interval_steps"),
        (dict(save_interval_steps=1, max_to_keep=0), "max_to_keep"),
    ],
)
def test_invalid_arguments(tmp_path: pathlib.Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Checkpointer(tmp_path, **kwargs)


def test_data_state_is_saved_beside_the_train_state(tmp_path: pathlib.Path) -> None:
    directory = tmp_path / "checkpoints"
    record = {"process_count": 1, "states": [{"epoch": 2, "grain": {"next_index": 17}}]}
    with Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as ckpt:
        assert ckpt.save(1, _state(1))  # synthetic data: nothing to record
        assert ckpt.save(2, _state(2), data_state=record)
        ckpt.wait_until_finished()
    with Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as ckpt:
        step, restored = ckpt.restore_latest(_abstract())
        assert step == 2
        assert ckpt.restore_data(2) == record
        assert ckpt.restore_data(1) is None
    _assert_state_equal(restored, _state(2), _abstract())


def _fail_restore_of(monkeypatch, step: int, error: BaseException) -> None:
    """The read of one step raises `error` (as a flaky or locked-down file system would)."""
    original = ocp.CheckpointManager.restore

    def restore(self, s, *args, **kwargs):
        if s == step:
            raise error
        return original(self, s, *args, **kwargs)

    monkeypatch.setattr("orbax.checkpoint.CheckpointManager.restore", restore)


@pytest.mark.parametrize(
    "error",
    [OSError(5, "Input/output error"), PermissionError(13, "Permission denied"),
     ValueError('PERMISSION_DENIED: Error opening "zarr" driver: ... local file'),
     ValueError("UNAVAILABLE: the storage did not answer")],
    ids=["EIO", "EACCES", "tensorstore_permission", "tensorstore_unavailable"],
)
def test_read_error_that_is_not_damage_stops_and_moves_nothing(
    tmp_path: pathlib.Path, monkeypatch, error: BaseException
) -> None:
    directory = tmp_path / "checkpoints"
    _save_steps(directory, [1, 2, 3])
    before = _snapshot(directory)
    _fail_restore_of(monkeypatch, 3, error)
    with (Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as ckpt,
          pytest.raises(CheckpointReadError, match="checkpoint_00000003.*nothing was moved")):
        ckpt.restore_latest(_abstract())
    assert _snapshot(directory) == before
    assert not (tmp_path / "checkpoints_corrupted").exists()


def test_missing_commit_marker_is_damage(tmp_path: pathlib.Path) -> None:
    """A step directory copied (or saved) only in part: no marker, no commit time."""
    directory = tmp_path / "checkpoints"
    _save_steps(directory, [1, 2])
    (directory / "checkpoint_00000002" / "commit_success.txt").unlink()
    (directory / "checkpoint_00000002" / "_CHECKPOINT_METADATA").unlink()
    with Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as ckpt:
        step, restored = ckpt.restore_latest(_abstract())
    assert step == 1
    _assert_state_equal(restored, _state(1), _abstract())
    assert (tmp_path / "checkpoints_corrupted" / "checkpoint_00000002").is_dir()


def test_intact_checkpoint_of_another_shape_names_the_entries(tmp_path: pathlib.Path) -> None:
    directory = tmp_path / "checkpoints"
    _save_steps(directory, [1, 2])
    before = _snapshot(directory)
    abstract = _abstract()
    mesh = _mesh()
    abstract["params"]["w"] = jax.ShapeDtypeStruct((8, 6), jnp.float32,
                                                   sharding=NamedSharding(mesh, P()))
    abstract["params"]["extra"] = jax.ShapeDtypeStruct((3,), jnp.float32,
                                                       sharding=NamedSharding(mesh, P()))
    del abstract["params"]["b"]
    with (Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as ckpt,
          pytest.raises(CheckpointMismatchError) as info):
        ckpt.restore_latest(abstract)
    message = str(info.value)
    assert "checkpoint_00000002" in message and "3 entries" in message
    assert "params/w: checkpoint shape (8, 4), this run's shape (8, 6)" in message
    assert "params/b: in the checkpoint (4,), not in this run" in message
    assert "params/extra: expected by this run (3,), not in the checkpoint" in message
    assert "CHECKPOINT_RESTORE_PATH" in message
    assert _snapshot(directory) == before  # not walked back, not moved


def test_data_record_walks_back_with_the_state(tmp_path: pathlib.Path) -> None:
    directory = tmp_path / "checkpoints"
    with Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as ckpt:
        for step in (1, 2):
            assert ckpt.save(step, _state(step), data_state={"next_index": 10 * step})
    data_files = [p for p in (directory / "checkpoint_00000002" / "data").rglob("*") if p.is_file()]
    assert data_files
    for path in data_files:
        path.write_text('{"next_index": 2')  # garbled: the newest step's data record is damaged
    with Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as ckpt:
        step, restored, data = ckpt.restore_latest_with_data(_abstract())
    assert (step, data) == (1, {"next_index": 10})
    _assert_state_equal(restored, _state(1), _abstract())
    assert (tmp_path / "checkpoints_corrupted" / "checkpoint_00000002").is_dir()


def test_read_only_never_moves_a_damaged_step(tmp_path: pathlib.Path) -> None:
    directory = tmp_path / "checkpoints"
    _save_steps(directory, [1, 2])
    _delete_manifest(directory / "checkpoint_00000002")
    before = _snapshot(directory)
    with Checkpointer(directory, save_interval_steps=1, max_to_keep=None,
                      enable_saving=False) as ckpt:
        assert ckpt.restore_latest(_abstract())[0] == 1
    assert _snapshot(directory) == before
    assert not (tmp_path / "checkpoints_corrupted").exists()


def _opt_state(stages: tuple[str, ...], scale: int, params: dict) -> tuple:
    """An optax chain state: "adam" (count, mu, nu over `params`), "lr" (the schedule's count),
    "empty" (a stage without state); the values identify `scale` and the stage."""
    entries = {
        "adam": lambda: optax.ScaleByAdamState(
            count=jnp.int32(scale), mu=jax.tree.map(lambda p: p * 2, params),
            nu=jax.tree.map(lambda p: p * 3, params)),
        "lr": lambda: optax.ScaleByScheduleState(count=jnp.int32(scale + 1)),
        "empty": optax.EmptyState,
    }
    return tuple(entries[stage]() for stage in stages)


_CURRENT = ("empty", "adam", "empty", "empty", "lr")


def _abstract_with_opt_state() -> dict:
    """The run's state in the current layout; all optimizer arrays replicated (resharded)."""
    abstract = _abstract()
    replicated = NamedSharding(_mesh(), P())
    abstract["opt_state"] = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=replicated),
        _opt_state(_CURRENT, 1, _state(1)["params"]))
    return abstract


@pytest.mark.parametrize(
    "earlier",
    [
        ("adam", "lr"),
        ("empty", "adam", "lr"),
        ("adam", "empty", "lr"),
        ("empty", "adam", "empty", "lr"),
    ],
)
def test_optimizer_state_of_the_earlier_layout_is_mapped(
    tmp_path: pathlib.Path, earlier: tuple[str, ...], caplog
) -> None:
    """Checkpoints of the chain that left disabled stages out restore into the five-stage one."""
    directory = tmp_path / "checkpoints"
    state = _state(3)
    with Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as ckpt:
        assert ckpt.save(3, {**state, "opt_state": _opt_state(earlier, 3, state["params"])})
    before = _snapshot(directory)
    abstract = _abstract_with_opt_state()
    with (caplog.at_level(logging.WARNING),
          Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as ckpt):
        step, restored = ckpt.restore_latest(abstract)
    assert step == 3
    assert jax.tree.structure(restored) == jax.tree.structure(abstract)
    want = {**state, "opt_state": _opt_state(_CURRENT, 3, state["params"])}
    _assert_state_equal(restored, want, abstract)  # bit-equal, with the run's shardings
    logged = [r.getMessage() for r in caplog.records if "earlier layout" in r.getMessage()]
    message = (
        f"Checkpoint {directory / 'checkpoint_00000003'} holds the optimizer state of the earlier "
        f"layout ({len(earlier)} stages, disabled ones left out); its Adam state and schedule "
        "count were mapped into the current 5-stage layout.")
    assert logged == [message]
    assert _snapshot(directory) == before


@pytest.mark.parametrize("saved", [("adam", "adam", "lr"), ("empty", "empty", "adam", "lr"),
                                   ("lr", "adam"), ("adam", "lr", "empty")])
def test_other_optimizer_layouts_stay_a_mismatch(
        tmp_path: pathlib.Path, saved: tuple[str, ...]) -> None:
    directory = tmp_path / "checkpoints"
    state = _state(3)
    with Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as ckpt:
        assert ckpt.save(3, {**state, "opt_state": _opt_state(saved, 3, state["params"])})
    before = _snapshot(directory)
    with (Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as ckpt,
          pytest.raises(CheckpointMismatchError, match="opt_state/")):
        ckpt.restore_latest(_abstract_with_opt_state())
    assert _snapshot(directory) == before


def test_earlier_layout_of_another_model_stays_a_mismatch(tmp_path: pathlib.Path) -> None:
    """The earlier layout is mapped only when everything else fits: here the params do not."""
    directory = tmp_path / "checkpoints"
    state = _state(3)
    with Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as ckpt:
        assert ckpt.save(3, {**state, "opt_state": _opt_state(("adam", "lr"), 3, state["params"])})
    abstract = _abstract_with_opt_state()
    replicated = NamedSharding(_mesh(), P())
    abstract["params"]["w"] = jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=replicated)
    abstract["opt_state"][1].mu["w"] = abstract["opt_state"][1].nu["w"] = abstract["params"]["w"]
    with (Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as ckpt,
          pytest.raises(CheckpointMismatchError, match=r"params/w: checkpoint shape \(8, 4\)")):
        ckpt.restore_latest(abstract)


def test_scanned_layer_stacks_are_chunked_one_layer_per_chunk(tmp_path: pathlib.Path) -> None:
    """A ``layers`` stack (params and the moments that mirror it) is saved one layer per chunk, so a
    converter reading one layer decodes only that layer; other leaves keep Orbax's chunks; the
    round trip is unchanged."""
    from paxlite.checkpointing.stream_read import CheckpointReader

    # One device: Orbax would write each leaf as one chunk (a sharded or replicated save may split
    # the first axis on its own).
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    stack = jnp.arange(3 * 8 * 4, dtype=jnp.float32).reshape(3, 8, 4)
    state = {
        "params": {"layers": {"w": jax.device_put(stack, one)},
                   "embed": jax.device_put(jnp.ones((8, 4)), one)},
        "opt_state": {"mu": {"layers": {"w": jax.device_put(stack * 2, one)}}},
        "step": jax.device_put(jnp.int32(5), one),
    }
    directory = tmp_path / "checkpoints"
    with Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as ckpt:
        assert ckpt.save(5, state)
        ckpt.wait_until_finished()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            state)
    with Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as ckpt:
        _, restored = ckpt.restore_latest(abstract)
    _assert_state_equal(restored, state, abstract)
    reader = CheckpointReader(directory / "checkpoint_00000005", scratch_dir=None)
    assert reader._open(("layers", "w")).chunk_layout.read_chunk.shape == (1, 8, 4)
    assert reader._open(("embed",)).chunk_layout.read_chunk.shape == (8, 4)
    import tensorstore as ts  # the optimizer's copy of the stack too

    moment = ts.open({"driver": "zarr", "kvstore": {
        "driver": "ocdbt", "base": f"file://{directory}/checkpoint_00000005/state/",
        "path": "opt_state.mu.layers.w"}}, open=True, read=True).result()
    assert moment.chunk_layout.read_chunk.shape == (1, 8, 4)
    np.testing.assert_array_equal(reader.read(("layers", "w"), 2), np.asarray(stack[2]))


def test_a_checkpoint_of_a_newer_format_is_refused_in_one_line(tmp_path: pathlib.Path) -> None:
    """Each save records paxlite's checkpoint format; one of a newer format is refused (a user
    error: one line, exit 2) by the run's restore and by CHECKPOINT_RESTORE_PATH, before anything
    is read, and nothing is moved aside as damaged."""
    import json

    from paxlite.checkpointing.checkpoint_damage import (
        FORMAT_KEY,
        FORMAT_VERSION,
        CheckpointFormatError,
    )
    from paxlite.checkpointing.pretrained import find_checkpoint
    from paxlite.errors import UserError

    directory = tmp_path / "checkpoints"
    _save_steps(directory, [1, 2])
    metadata_file = directory / "checkpoint_00000002" / "_CHECKPOINT_METADATA"
    metadata = json.loads(metadata_file.read_text())
    assert metadata["custom_metadata"] == {FORMAT_KEY: FORMAT_VERSION}
    assert find_checkpoint(tmp_path) == (2, directory / "checkpoint_00000002")
    metadata["custom_metadata"][FORMAT_KEY] = FORMAT_VERSION + 1
    metadata_file.write_text(json.dumps(metadata))
    expected = (f"{directory / 'checkpoint_00000002'} was written in paxlite checkpoint format "
                f"{FORMAT_VERSION + 1}, and this paxlite reads format {FORMAT_VERSION} and older")
    with (Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as ckpt,
          pytest.raises(CheckpointFormatError) as raised):
        ckpt.restore_latest(_abstract())
    assert isinstance(raised.value, UserError) and str(raised.value).startswith(expected)
    assert "\n" not in str(raised.value)
    assert _names(directory) == ["checkpoint_00000001", "checkpoint_00000002"]  # nothing moved
    with pytest.raises(CheckpointFormatError, match="reads format"):
        find_checkpoint(tmp_path)
    # a checkpoint from before the format was recorded reads as format 1
    del metadata["custom_metadata"][FORMAT_KEY]
    metadata_file.write_text(json.dumps(metadata))
    with Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as ckpt:
        step, restored = ckpt.restore_latest(_abstract())
    assert step == 2
    _assert_state_equal(restored, _state(2), _abstract())


def test_both_writers_save_replicated_arrays_without_slicing_them(tmp_path, monkeypatch):
    """The checkpointer and the pretrained-model writer install the one-process handler themselves
    (compat.save_replicas_whole_in_one_process): each saves an array replicated over 8 devices
    without a slice of it, after Orbax's replica-parallel handler was put back in the registry."""
    from orbax.checkpoint._src.metadata import array_metadata_store

    from paxlite.checkpointing.pretrained import save_params

    sliced = []
    slice_in_dim = jax.lax.slice_in_dim
    monkeypatch.setattr(jax.lax, "slice_in_dim",
                        lambda *a, **k: sliced.append(a[0].shape) or slice_in_dim(*a, **k))
    replicated = jax.device_put(jnp.arange(16.0).reshape(8, 2),
                                NamedSharding(jax.make_mesh((8,), ("data",)), P()))

    def replica_parallel_registered():
        ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(
            use_replica_parallel=True, array_metadata_store=array_metadata_store.Store()),
            override=True)

    replica_parallel_registered()
    checkpointer = Checkpointer(tmp_path / "ckpt", save_interval_steps=1, max_to_keep=None)
    checkpointer.save(1, {"w": replicated})
    checkpointer.close()
    replica_parallel_registered()
    save_params(tmp_path / "pretrained", {"w": replicated})
    assert sliced == []
