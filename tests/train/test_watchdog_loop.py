"""The hang watchdog in a real training loop: a long evaluation and a slow checkpoint commit are
progress, a stuck evaluation feed is a hang. In process, with tiny timeouts (the hyperparameters
themselves) and a watchdog that records the exit instead of ending pytest."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator

from paxlite.experiments.build import build_run_config
from paxlite.train.loop import Run, RunContext
from paxlite.train.watchdog import HANG_EXIT_CODE, Watchdog

# An evaluation of 8 batches at step 2 (the run's first: it compiles), every step summarised.
OVERRIDES = [
    "NUM_LAYERS=1",
    "MAX_STEPS=2",
    "SUMMARY_INTERVAL_STEPS=1",
    "EVAL_INTERVAL_STEPS=2",
    "EVAL_LOOP_NUM_BATCHES=8",
    "CHECKPOINT_EVERY_N_STEPS=1",
    "WATCHDOG_TIMEOUT_SECONDS=0.5",
    "CRASH_ON_HANG_TIMEOUT_SECONDS=1.0",
]


class _SlowEvalFeed:
    """The run's own evaluation feed, its batches made `delays[i]` seconds late (a slow input
    pipeline)."""

    def __init__(self, feed, delays: list[float]):
        self._feed, self._delays = feed, delays

    def __getattr__(self, name):
        return getattr(self._feed, name)

    def eval_batches(self, num_batches: int, sharding) -> Iterator:
        for index, batch in enumerate(self._feed.eval_batches(num_batches, sharding)):
            time.sleep(self._delays[index])
            yield batch


def _train(job, *, eval_delays: list[float], commit_delay: float = 0.0) -> list[int]:
    """Trains the run; returns the exit statuses its watchdog asked for (none: it never fired)."""
    _, config = build_run_config("TinySynthetic", OVERRIDES)
    exits: list[int] = []
    with Run(config, RunContext(job_dir=str(job))) as run:
        run.eval_data = _SlowEvalFeed(run.eval_data, eval_delays)
        if commit_delay:
            commit = run.checkpointer.wait_until_finished

            def slow_commit() -> None:  # a filesystem slow to take the last save
                time.sleep(commit_delay)
                commit()

            run.checkpointer.wait_until_finished = slow_commit
        loop = config.loop
        run.train(
            watchdog=Watchdog(
                timeout_s=loop.watchdog_timeout_seconds,
                crash_timeout_s=loop.crash_on_hang_timeout_seconds,
                exit_process=exits.append,
            )
        )
    return exits


def _eval_line(job) -> dict:
    lines = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if any(key.startswith("eval") for key in line)][-1]


# The first of these tests in a session compiles the tiny model (~10 s on 2 cores); the others read
# the session's compilation cache.
def test_a_long_evaluation_that_makes_progress_batch_by_batch_is_not_a_hang(tmp_path):
    # 8 batches 0.3 s apart: 2.4 s in all, more than twice CRASH_ON_HANG_TIMEOUT_SECONDS
    assert _train(tmp_path, eval_delays=[0.3] * 8) == []
    assert _eval_line(tmp_path)["step"] == 2
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [
        "checkpoint_00000001",
        "checkpoint_00000002",
    ]


def test_a_stuck_evaluation_feed_is_still_a_hang(tmp_path):
    # the sixth batch comes 3 s late: nothing is computed meanwhile (its wait starts after the
    # first, compiling batch: the feed builds two batches ahead)
    assert _train(tmp_path, eval_delays=[0, 0, 0, 0, 0, 3.0, 0, 0]) == [HANG_EXIT_CODE]


def test_a_slow_commit_is_reported_and_never_ended(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    assert _train(tmp_path, eval_delays=[0] * 8, commit_delay=2.0) == []
    assert [r for r in caplog.records if "while a checkpoint commits" in r.getMessage()]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [
        "checkpoint_00000001",
        "checkpoint_00000002",
    ]
