"""The loop's host work kept off the step: metrics read at boundaries only, device-side eval sums,
the exact non-finite step, and the host-overhead benchmark's harness."""

import importlib.util
import json
import math
import os
import re

import jax
import numpy as np
import pytest

from paxlite.experiments.build import build_run_config
from paxlite.train import device_metrics
from paxlite.train.loop import Run, RunContext, TrainingDivergedError

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
GOLDEN = os.path.join(ROOT, "tests", "testdata", "loop_metrics_golden.jsonl")
# Intervals that do not divide MAX_STEPS and differ from each other: windows of 3, 1, 1, 1, 1 steps.
GOLDEN_OVERRIDES = ["MAX_STEPS=7", "SUMMARY_INTERVAL_STEPS=3", "EVAL_INTERVAL_STEPS=4",
                    "CHECKPOINT_EVERY_N_STEPS=5", "EVAL_LOOP_NUM_BATCHES=2", "LR_COS_WARMUP=2",
                    "LR_COS_DECAY_END=8"]
TIMING = {"step_time_s", "tokens_per_s", "input_wait_fraction"}  # measured, not recorded


def _lines(job):
    with open(os.path.join(job, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_metrics_jsonl_equals_the_line_by_line_reading_loops_golden(tmp_path):
    """Recorded with the loop that read every step's metrics as it went: same lines, same keys,
    same steps; values to float32 rounding: the golden was recorded on jax 0.10.2, whose XLA rounds
    a few float32 ops differently from today's, and that loop summed each eval batch in float32 on
    the host, this one sums exactly on the device. A value from another step differs by far more."""
    _, config = build_run_config("TinySynthetic", GOLDEN_OVERRIDES)
    with Run(config, RunContext(job_dir=str(tmp_path))) as run:
        run.train()
    with open(GOLDEN) as f:
        golden = [json.loads(line) for line in f]
    got = _lines(tmp_path)
    # checkpoint/save_s (newer than the golden): on the first train line after each save
    assert [line["step"] for line in got if line.pop("checkpoint/save_s", 0) > 0] == [6]
    assert [(line["step"], list(line)) for line in got] == [
        (line["step"], list(line)) for line in golden
    ]
    for new, old in zip(got, golden):
        for key, value in old.items():
            if key in TIMING:
                assert new[key] >= 0 if key == "input_wait_fraction" else new[key] > 0, key
            elif value is None:
                assert new[key] is None, key
            else:
                assert new[key] == pytest.approx(value, rel=2e-6), key
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [
        "checkpoint_00000005",
        "checkpoint_00000007",
    ]


DIVERGING = ["LEARNING_RATE=1e30", "LR_SCHEDULE=constant", "CLIP_GRADIENT_NORM_TO_VALUE=0.0",
             "MAX_STEPS=20", "SUMMARY_INTERVAL_STEPS=10", "CHECKPOINT_EVERY_N_STEPS=10",
             "EVAL_INTERVAL_STEPS=1000"]


def _first_non_finite_step(run) -> int:
    """Reference: the run's compiled step from a fresh state, one step at a time, each step's
    loss read at once."""
    with jax.set_mesh(run.mesh):
        state = run.restore_or_init()
        for index in range(run.config.loop.max_steps):
            state, metrics = run.steps.train(
                state, run.data.train_batch(index, run.steps.batch_sharding)
            )
            host = jax.device_get(metrics)
            if not (math.isfinite(host["loss"]) and math.isfinite(host["grad_norm"])):
                return index + 1
    raise AssertionError("the reference run never diverged")


def test_non_finite_step_between_boundaries_is_named_exactly(tmp_path):
    _, config = build_run_config("TinySynthetic", DIVERGING)
    with Run(config, RunContext(job_dir=str(tmp_path / "job"))) as run:
        with pytest.raises(TrainingDivergedError) as diverged:
            run.train()
        assert not os.path.exists(tmp_path / "job" / "checkpoints") or not os.listdir(
            tmp_path / "job" / "checkpoints")
        # the reference reuses the run's compiled step: nothing was saved, so it starts fresh
        expected = _first_non_finite_step(run)
    assert expected % 10, ("the divergence must fall between boundaries for this test to mean "
                           "anything")
    assert re.search(rf"at step {expected}; stopping without saving", str(diverged.value))
    assert not os.path.exists(tmp_path / "job" / "checkpoints") or not os.listdir(
        tmp_path / "job" / "checkpoints")
    assert not any("loss" in line for line in _lines(tmp_path / "job"))


def test_step_metrics_read_in_power_of_two_chunks_equal_the_kept_values():
    assert device_metrics._power_of_two_chunks(13) == [(0, 8), (8, 12), (12, 13)]
    assert device_metrics._power_of_two_chunks(0) == []
    kept = device_metrics.StepMetrics()
    values = [(1.5 * i, float(i), 0.1 * i) for i in range(13)]
    values[9] = (float("nan"), 2.0, 0.0)
    for i, (loss, norm, lr) in enumerate(values):
        kept.add(i + 1, {"loss": jax.numpy.float32(loss), "grad_norm": jax.numpy.float32(norm),
                         "learning_rate": jax.numpy.float32(lr)})
    steps, host, finite = kept.read()
    assert steps == list(range(1, 14)) and len(kept) == 0
    np.testing.assert_array_equal(host["grad_norm"], np.float32([v[1] for v in values]))
    np.testing.assert_array_equal(finite, [i != 9 for i in range(13)])


def test_device_eval_totals_equal_a_float64_sum():
    """Many batches whose float32 running sum drifts, and token counts past float32's 2**24."""
    rng = np.random.default_rng(0)
    batches = [{"loss_sum": rng.uniform(0, 1e4, 8).astype(np.float32),
                "correct_tokens": np.float32([2**24, 1, 1, 1, 0, 0, 0, 1]),
                "target_tokens": np.full(8, 2**20 + 1, np.float32)} for _ in range(300)]
    totals = device_metrics.eval_totals_init()
    for batch in batches:
        totals = device_metrics.eval_totals_add(totals, batch)
    got = device_metrics.eval_totals_value(jax.device_get(totals))
    for key in device_metrics.EVAL_SUM_KEYS:
        want = sum(float(np.sum(b[key], dtype=np.float64)) for b in batches)
        assert got[key] == pytest.approx(want, rel=1e-13, abs=0), key
    assert got["correct_tokens"] == 300 * (2**24 + 4)  # exact integers
    naive = np.float32(0)
    for b in batches:
        naive = np.float32(naive + np.sum(b["correct_tokens"]))
    assert float(naive) != got["correct_tokens"]  # what a float32 accumulator would have said


def test_evaluate_equals_per_batch_host_sums_in_float64(tmp_path):
    _, config = build_run_config("TinySynthetic", ["EVAL_LOOP_NUM_BATCHES=3"])
    with Run(config, RunContext(job_dir=str(tmp_path), enable_checkpoint_saving=False)) as run:
        state = run.restore_or_init()
        metrics = run.evaluate(state)
        sums = dict.fromkeys(device_metrics.EVAL_SUM_KEYS, 0.0)
        with jax.set_mesh(run.mesh):
            for batch in run.eval_data.eval_batches(3, run.steps.batch_sharding):
                out = jax.device_get(run.steps.eval(state.params, batch))
                for key in sums:
                    sums[key] += float(np.sum(out[key], dtype=np.float64))
    assert metrics["num_tokens"] == sums["target_tokens"] == 3 * 16 * 64
    assert metrics["loss"] == pytest.approx(sums["loss_sum"] / sums["target_tokens"], rel=1e-12)
    assert metrics["accuracy"] == pytest.approx(
        sums["correct_tokens"] / sums["target_tokens"], rel=1e-12
    )


def test_host_overhead_benchmark_runs_in_tiny_mode(capsys):
    spec = importlib.util.spec_from_file_location(
        "host_overhead", os.path.join(ROOT, "benchmarks", "host_overhead.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--tiny"])
    assert result["steps"] == 2 and len(result["bare_ms"]) == len(result["paxlite_ms"]) == 1
    assert result["ratio"] > 0 and result["ratio_prebuilt"] > 0
    assert "goal <= 1.10" in capsys.readouterr().out
