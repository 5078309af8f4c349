"""Pax's PROFILER_* settings: a JAX trace of the chosen steps under summaries/profile, on process
0."""

import glob
import logging
import os

import jax
import jax.numpy as jnp
import pytest
from absl import logging as absl_logging

from paxlite.config.errors import ConfigError
from paxlite.experiments.build import build_run_config, load_experiment
from paxlite.train.loop import Run, RunContext
from paxlite.train.profiling import StepProfiler
from tests.in_process import paxlite_main

SMALL = ["SUMMARY_INTERVAL_STEPS=1", "CHECKPOINT_EVERY_N_STEPS=100", "EVAL_INTERVAL_STEPS=1000",
         "EVAL_LOOP_NUM_BATCHES=1", "LR_COS_WARMUP=2", "LR_COS_DECAY_END=8"]


def _traces(job_dir):
    """The trace files jax.profiler writes: LOG_DIR/plugins/profile/<run>/<host>.xplane.pb."""
    return glob.glob(os.path.join(job_dir, "summaries", "profile", "plugins", "profile", "*",
                                  "*.xplane.pb"))


def _train(job_dir, overrides):
    _, config = build_run_config("TinySynthetic", SMALL + list(overrides))
    with Run(config, RunContext(job_dir=str(job_dir))) as run:
        run.train()


@pytest.fixture
def absl_caplog(caplog):
    """absl's records, which do not propagate to the root logger in every setup."""
    logger = absl_logging.get_absl_logger()
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO)
    yield caplog
    logger.removeHandler(caplog.handler)


def test_capture_step_writes_a_trace_of_the_chosen_steps(tmp_path, absl_caplog):
    _train(tmp_path, ["MAX_STEPS=4", "PROFILER_CAPTURE_STEP=2", "PROFILER_NUM_STEPS=2",
                      "PROFILER_MIN_DURATION_SEC=0"])
    traces = _traces(tmp_path)
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 0, traces
    profile_dir = str(tmp_path / "summaries" / "profile")
    assert "Profiled steps 2 to 3" in absl_caplog.text
    assert f"xprof --port 8791 {profile_dir}" in absl_caplog.text
    # the run itself is unaffected: every step logged, with a step time
    with open(tmp_path / "metrics.jsonl") as f:
        lines = [line for line in f if '"loss"' in line]
    assert len(lines) == 4 and all('"step_time_s": null' not in line for line in lines[1:])


def test_no_trace_without_the_setting_nor_on_a_resume_past_the_capture_step(tmp_path, absl_caplog):
    _train(tmp_path, ["MAX_STEPS=2"])
    assert not (tmp_path / "summaries" / "profile").exists()
    absl_caplog.clear()
    _train(tmp_path, ["MAX_STEPS=3", "PROFILER_CAPTURE_STEP=1"])  # resumes at step 3
    assert not (tmp_path / "summaries" / "profile").exists()
    assert "PROFILER_CAPTURE_STEP=1: this run starts at step 3" in absl_caplog.text


def _step(profiler, step, x):
    with profiler.step(step):
        y = x * 2.0
    return profiler.after_step(step, y)


def test_trace_extends_past_num_steps_until_min_duration_but_not_past_the_last_step(tmp_path):
    log_dir = str(tmp_path / "profile")
    profiler = StepProfiler(log_dir=log_dir, capture_step=2, num_steps=1, min_duration_sec=1e6,
                            first_step=1, last_step=5, enabled=True)
    x = jnp.ones(4)
    for step in range(1, 6):
        _step(profiler, step, x)
        # inactive before step 2; then kept open (duration not reached) until the last step
        assert profiler.active == (2 <= step < 5), step
    assert len(glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.xplane.pb"))) == 1


def test_other_processes_do_not_trace_and_a_stopped_run_still_writes_its_trace(tmp_path):
    off = StepProfiler(log_dir=str(tmp_path / "off"), capture_step=1, num_steps=2,
                       min_duration_sec=0.0, first_step=1, last_step=4, enabled=False)
    _step(off, 1, jnp.ones(2))
    assert not off.active and not (tmp_path / "off").exists()
    on = StepProfiler(log_dir=str(tmp_path / "on"), capture_step=1, num_steps=3,
                      min_duration_sec=0.0, first_step=1, last_step=4, enabled=True)
    _step(on, 1, jnp.ones(2))
    assert on.active
    on.close()  # as the loop does when a step raises
    assert not on.active
    assert glob.glob(str(tmp_path / "on" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    jax.profiler.start_trace(str(tmp_path / "again"))  # no trace left running
    jax.profiler.stop_trace()


@pytest.mark.parametrize("settings, message", [
    (["PROFILER_CAPTURE_STEP=0"], "PROFILER_CAPTURE_STEP must be a step from 1 to MAX_STEPS=100"),
    (["PROFILER_CAPTURE_STEP=101"], "PROFILER_CAPTURE_STEP must be a step from 1 to MAX_STEPS=100"),
    (["PROFILER_CAPTURE_STEP=5", "PROFILER_NUM_STEPS=0"], "PROFILER_NUM_STEPS must be >= 1, got 0"),
    (["PROFILER_CAPTURE_STEP=5", "PROFILER_MIN_DURATION_SEC=-1.0"],
     "PROFILER_MIN_DURATION_SEC must be >= 0, got -1.0"),
    (["PROFILER_NUM_STEPS=3"], "PROFILER_NUM_STEPS set but PROFILER_CAPTURE_STEP is None"),
    (["PROFILER_MIN_DURATION_SEC=5"],
     "PROFILER_MIN_DURATION_SEC set but PROFILER_CAPTURE_STEP is None"),
])
def test_bad_profiler_settings_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        load_experiment("TinySynthetic", settings)  # MAX_STEPS=100


def test_bad_profiler_setting_exits_2_through_the_cli(tmp_path, monkeypatch, capfd):
    # in this process (tests/in_process.py): the setting is refused before JAX starts any work
    job = tmp_path / "job"
    with paxlite_main(monkeypatch, capfd) as run:
        result = run("--fdl_config=TinySynthetic", "--fdl.PROFILER_NUM_STEPS=4",
                     f"--job_log_dir={job}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "PROFILER_NUM_STEPS set but PROFILER_CAPTURE_STEP is None" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (job / "checkpoints").exists()
