"""metrics.jsonl's input_wait_fraction: the share of the timed window the training thread spent
waiting for its next batch from the prefetching producer. A feed that sleeps a known time per batch
is the independent reference: once the producer's head start is used up, every step waits for it."""

import json
import time

from paxlite.experiments.build import build_run_config
from paxlite.train.loop import Run, RunContext

SLEEP_S = 0.2


class _SlowFeed:
    """Delegates to the run's own feed and sleeps before each training batch (a slow input
    pipeline)."""

    def __init__(self, feed):
        self._feed = feed

    def train_batch(self, index, sharding):
        time.sleep(SLEEP_S)
        return self._feed.train_batch(index, sharding)

    def __getattr__(self, name):
        return getattr(self._feed, name)


def _train_lines(tmp_path, *, slow: bool) -> list[dict]:
    _, config = build_run_config("TinySynthetic", ["MAX_STEPS=10", "SUMMARY_INTERVAL_STEPS=5",
                                                    "EVAL_INTERVAL_STEPS=1000"])
    with Run(config, RunContext(job_dir=str(tmp_path), enable_checkpoint_saving=False)) as run:
        if slow:
            run.data = _SlowFeed(run.data)
        run.train()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "loss" in line]


def test_input_wait_fraction_measures_waiting_for_a_slow_feed(tmp_path):
    slow = _train_lines(tmp_path / "slow", slow=True)
    assert [line["step"] for line in slow] == [5, 10]
    steady = slow[-1]  # steps 6-10: the producer's head start is spent, each step waits for it
    # the tiny step is far shorter than SLEEP_S, so the step takes about SLEEP_S, nearly all
    # waiting; the producer may start the window up to 2 batches ahead (slow steps before it, on a
    # loaded host), so 5 steps can take as little as 3 x SLEEP_S
    assert 0.55 * SLEEP_S < steady["step_time_s"] < 2.5 * SLEEP_S, steady
    assert 0.6 < steady["input_wait_fraction"] <= 1.0, steady
    fast = _train_lines(tmp_path / "fast", slow=False)[-1]
    assert 0.0 <= fast["input_wait_fraction"] < steady["input_wait_fraction"] - 0.3, (fast, steady)
