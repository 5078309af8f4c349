"""Hosts that see different checkpoint listings still restore one step: process 0's choice.

Two real JAX processes (2 CPU devices each, joined by paxlite.parallel.distributed) restore from
two directories holding the same checkpoints, except that process 1's also lists a newer, unfinished
`checkpoint_00000003`: what a host sees when its NFS attribute cache still shows a step that has
since been renamed away, or a save in flight. Every process must use process 0's listing, make the
same collectives, restore the same step, and set nothing aside; a save of step 3, which process 0
finds absent but process 1's Orbax still lists, must stop both with one error rather than hang;
and a failure of process 0's decision must reach process 1 as one line. Before the fix the two
processes' collectives crossed (process 1: "930760747 is not a valid _Outcome") and process 0 hung.

The worker is this module, run as `python -m tests.train.test_checkpoint_hosts PROCESS_ID PORT
DIRECTORY OUT`.
"""

from __future__ import annotations

import collections
import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.parallel.test_multiprocess import _env, _finish, _free_port

REPO = pathlib.Path(__file__).resolve().parents[2]
STEPS = (1, 2)


def _w(step: int) -> np.ndarray:
    """The saved (8, 4) float32 matrix of `step`: its values identify the step."""
    return np.arange(32, dtype=np.float32).reshape(8, 4) * step + 0.25


def _worker(process_id: int, port: int, directory: str, out: str) -> None:
    """One process of the 2-process job: restore, then write what it got to `out` (JSON)."""
    from paxlite.parallel import distributed

    launch = distributed.Launch(source=distributed.LaunchSource.FLAGS, num_processes=2,
                                process_id=process_id, coordinator_address=f"127.0.0.1:{port}")
    distributed.initialize(launch, timeouts=distributed.Timeouts(
        initialization_s=60, heartbeat_s=10, shutdown_s=10))

    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from paxlite.checkpointing.checkpoint import Checkpointer
    from paxlite.parallel import multihost

    # Count paxlite's own collectives (the real functions still run).
    calls: collections.Counter[str] = collections.Counter()
    for name in ("broadcast_one_to_all", "process_allgather"):
        real = getattr(multihost_utils, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        setattr(multihost_utils, name, counted)

    mesh = jax.make_mesh((4,), ("x",))
    abstract = {
        "w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, P("x"))),
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())),
    }
    with Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as ckpt:
        listed = ckpt.all_steps()
        step, state, data = ckpt.restore_latest_with_data(abstract)
        collectives = dict(calls)
        # Step 3 is absent for process 0, but process 1's Orbax still lists it (it would refuse
        # the save there alone): every process stops with one error instead of a hang.
        try:
            ckpt.save(3, state, force=True)
            save_error = None
        except Exception as error:  # noqa: BLE001 - recorded for the test
            save_error = f"{type(error).__name__}: {error}"
    rows = {}
    for shard in state["w"].addressable_shards:
        start = shard.index[0].start or 0
        for offset, row in enumerate(np.asarray(shard.data)):
            rows[start + offset] = row.tolist()

    # Process 0's failure reaches every process, and the next decision is still in step.
    def unreadable() -> None:
        raise PermissionError(13, "Permission denied", f"{directory}/checkpoint_00000002")

    try:
        multihost.decided_by_process_0(unreadable, what="check checkpoint_00000002")
        failure = None
    except Exception as error:  # noqa: BLE001 - recorded for the test
        failure = f"{type(error).__name__}: {error}"
    answer = multihost.decided_by_process_0(lambda: {"from": jax.process_index()},
                                            what="answer")
    with open(out, "w") as f:
        json.dump({"listed": listed, "step": step, "state_step": int(state["step"]),
                   "data": data, "rows": rows, "collectives": collectives,
                   "save_error": save_error,
                   "failure": failure, "answer": answer}, f)


def _save(directory: pathlib.Path) -> None:
    """Steps 1 and 2 with their data records, saved by this (one-process, 8-device) test."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from paxlite.checkpointing.checkpoint import Checkpointer

    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"))
    with Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as ckpt:
        for step in STEPS:
            state = {"w": jax.device_put(jnp.asarray(_w(step)),
                                         NamedSharding(mesh, P("fsdp", "tensor"))),
                     "step": jax.device_put(jnp.int32(step), NamedSharding(mesh, P()))}
            assert ckpt.save(step, state, data_state={"records_read": 10 * step})


@pytest.mark.multiprocess
def test_every_process_restores_process_0s_choice(tmp_path: pathlib.Path) -> None:
    directories = [tmp_path / "host0" / "checkpoints", tmp_path / "host1" / "checkpoints"]
    _save(directories[0])
    shutil.copytree(directories[0], directories[1])
    # Process 1 alone sees a newer step that is not finished (a stale view of a renamed step).
    stale = directories[1] / "checkpoint_00000003"
    shutil.copytree(directories[1] / "checkpoint_00000002", stale)
    (stale / "commit_success.txt").unlink()
    (stale / "_CHECKPOINT_METADATA").unlink()
    before = sorted(p.name for p in directories[0].iterdir())

    port = _free_port()
    outs = [tmp_path / f"process{i}.json" for i in range(2)]
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = []
    for i in range(2):
        with open(logs[i], "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.train.test_checkpoint_hosts", str(i), str(port),
                 str(directories[i]), str(outs[i])],
                cwd=REPO, env=_env(2), stdout=log, stderr=subprocess.STDOUT))
    _finish(procs, logs, timeout=90)

    results = [json.loads(out.read_text()) for out in outs]
    for result in results:
        assert result["listed"] == [1, 2]  # process 0's listing, not process 1's [1, 2, 3]
        assert (result["step"], result["state_step"]) == (2, 2)
        assert result["data"] == {"records_read": 20}
        for row, values in result["rows"].items():
            np.testing.assert_array_equal(np.asarray(values, np.float32), _w(2)[int(row)])
    assert sorted(int(r) for res in results for r in res["rows"]) == list(range(8))
    # The same collectives on both processes, whatever each one's directory listed.
    assert results[0]["collectives"] == results[1]["collectives"]
    # Nothing was judged damaged, so nothing was set aside on either side.
    assert sorted(p.name for p in directories[0].iterdir()) == before
    assert not (tmp_path / "host0" / "checkpoints_corrupted").exists()
    assert stale.is_dir()
    stale_message = (
        "CheckpointViewsDifferError: Process 1 still lists {}/checkpoint_00000003, which "
        "process 0 does not see (a stale network file system cache, or a rename in flight), so "
        "Orbax would refuse the save there alone; nothing was saved. Rerun once the storage agrees."
    )
    assert [r["save_error"] for r in results] == [stale_message.format(d) for d in directories]
    assert not (directories[0] / "checkpoint_00000003").exists()
    assert not list(directories[0].glob("*tmp*")) and not list(directories[1].glob("*tmp*"))
    # A failure on process 0: its own error there, one line naming it on process 1.
    assert results[0]["failure"] == (
        f"PermissionError: [Errno 13] Permission denied: '{directories[0]}/checkpoint_00000002'")
    assert results[1]["failure"] == (
        "ProcessZeroError: process 0 could not check checkpoint_00000002 (PermissionError: "
        f"[Errno 13] Permission denied: '{directories[0]}/checkpoint_00000002'); see its log")
    assert results[0]["answer"] == results[1]["answer"] == {"from": 0}


def test_a_listing_that_fails_on_process_0_is_one_clear_error(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What process 0 fails to decide stops it with CheckpointReadError, not a traceback (the
    others get ProcessZeroError's line: the 2-process test). The listing fails as a locked-down
    file system's would, the way tests/train/test_checkpoint.py fails a read."""
    import orbax.checkpoint as ocp

    from paxlite.checkpointing.checkpoint import Checkpointer, CheckpointReadError

    directory = tmp_path / "checkpoints"

    def reload(self) -> None:
        raise PermissionError(13, "Permission denied", str(directory))

    with Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as ckpt:
        monkeypatch.setattr(ocp.CheckpointManager, "reload", reload)
        with pytest.raises(CheckpointReadError) as info:
            ckpt.restore_latest_with_data({})
    assert str(info.value) == (
        f"Could not list the checkpoints in {directory} (PermissionError: [Errno 13] Permission "
        f"denied: '{directory}'). This is not a sign of damage, so nothing was moved; fix the "
        "cause (permissions, storage) and rerun.")


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
