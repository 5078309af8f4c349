"""Two processes, one signalled: both stop at the same step, save one checkpoint, and resume from it."""

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
    flags = [*EXPERIMENT, "--fdl.CHECKPOINT_EVERY_N_STEPS=100000"]
    procs = _start_pair(job, [*flags, "--fdl.MAX_STEPS=100000"], tmp_path)
    try:
        deadline = time.monotonic() + 180
        while not (job / "metrics.jsonl").exists() or len(_train_losses(job)) < 3:
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
    assert max(_train_losses(job)) == stop

    procs = _start_pair(job, [*flags, f"--fdl.MAX_STEPS={stop + 2}"], tmp_path)
    _finish(procs, logs, timeout=240)
    assert all(f"Resumed from checkpoint step {stop}" in log.read_text() for log in logs)
    assert sorted(_train_losses(job)) == list(range(1, stop + 3))
