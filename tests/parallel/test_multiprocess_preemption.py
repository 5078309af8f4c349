"""Two processes, one signalled: both stop at the same step, save one checkpoint, and resume from
it.

The first run summarises every third step only, so most steps decide on the vote of the step two
back (train/preemption.py), as a long run between its boundaries does."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.parallel.test_multiprocess import EXPERIMENT, _finish, _start_pair, _train_losses


def _stopped_at(text: str) -> int:
    line = [line for line in text.splitlines() if "stopped after step" in line][-1]
    return int(line.split("stopped after step ", 1)[1].split()[0])


@pytest.mark.slow  # two processes trained, signalled and restarted (~35 s on 2 cores)
@pytest.mark.multiprocess
def test_a_signal_to_one_process_stops_both_at_the_same_step(tmp_path):
    job = tmp_path / "job"
    logs = [tmp_path / "process0.log", tmp_path / "process1.log"]
    # fsdp over each process's 2 devices (_start_pair), data over the processes
    mesh = ("--fdl.ICI_MESH_SHAPE=", "--fdl.DCN_MESH_SHAPE=")
    flags = [*(f for f in EXPERIMENT if not f.startswith(mesh)), "--fdl.ICI_MESH_SHAPE=[1,2,1]",
             "--fdl.DCN_MESH_SHAPE=[2,1,1]", "--fdl.CHECKPOINT_EVERY_N_STEPS=100000"]
    sparse = [f for f in flags if not f.startswith("--fdl.SUMMARY_INTERVAL_STEPS=")]
    procs = _start_pair(job, [*sparse, "--fdl.SUMMARY_INTERVAL_STEPS=3", "--fdl.MAX_STEPS=100000"],
                        tmp_path, devices_per_process=2)
    try:
        deadline = time.monotonic() + 180
        while not (job / "metrics.jsonl").exists() or len(_train_losses(job)) < 2:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "\n".join(
                log.read_text()[-3000:] for log in logs)
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGTERM)  # not the coordinator's process, and only this one
    finally:
        _finish(procs, logs, timeout=120)  # both exit 0
    texts = [log.read_text() for log in logs]
    assert "SIGTERM received" in texts[1] and "SIGTERM received" not in texts[0]
    stop = _stopped_at(texts[0])
    assert _stopped_at(texts[1]) == stop
    assert os.listdir(job / "checkpoints") == [f"checkpoint_{stop:08d}"]
    first = sorted(_train_losses(job))
    assert first == list(range(3, stop + 1, 3)), (first, stop)  # nothing summarised past the stop

    procs = _start_pair(job, [*flags, f"--fdl.MAX_STEPS={stop + 2}"], tmp_path,
                        devices_per_process=2)
    _finish(procs, logs, timeout=240)
    assert all(f"Resumed from checkpoint step {stop}" in log.read_text() for log in logs)
    assert sorted(_train_losses(job)) == [*first, stop + 1, stop + 2]
