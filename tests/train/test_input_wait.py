"""metrics.jsonl's input_wait_fraction: the share of the timed window the training thread spent blocked in
train_batch. A feed that sleeps a known time per batch is the independent reference."""

import json
import time

import pytest

from paxlite.experiments.build import build_run_config
from paxlite.train.loop import Run, RunContext

SLEEP_S = 0.2


class _SlowFeed:
    """Delegates to the run's own feed and sleeps before each training batch (a slow input pipeline)."""

    def __init__(self, feed):
        self._feed = feed

    def train_batch(self, index, sharding):
        time.sleep(SLEEP_S)
        return self._feed.train_batch(index, sharding)

    def __getattr__(self, name):
        return getattr(self._feed, name)


def test_input_wait_fraction_measures_blocking_in_train_batch(tmp_path):
    _, config = build_run_config("TinySynthetic", ["MAX_STEPS=4", "SUMMARY_INTERVAL_STEPS=2",
                                                    "EVAL_INTERVAL_STEPS=1000"])
    with Run(config, RunContext(job_dir=str(tmp_path), enable_checkpoint_saving=False)) as run:
        run.data = _SlowFeed(run.data)
        run.train()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [line for line in lines if "loss" in line]
    assert [line["step"] for line in train] == [2, 4]
    for line in train:
        # every timed step waited SLEEP_S for its batch; the tiny step itself is far shorter
        assert line["input_wait_fraction"] == pytest.approx(SLEEP_S / line["step_time_s"], rel=0.15)
        assert 0.5 < line["input_wait_fraction"] <= 1.0
