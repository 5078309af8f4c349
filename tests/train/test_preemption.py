"""Preemption (SIGTERM/SIGINT -> finish the step, checkpoint, exit), the hang watchdog, the
compilation cache.

Real processes, real signals: a training process is started, signalled while it trains, and
restarted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from paxlite.cli.job import PREEMPTED_UNSAVED_EXIT_CODE, preemption_exit_code
from paxlite.errors import SettingError
from paxlite.train.preemption import DUPLICATE_WINDOW_S
from tests.fork_server import served_python
from tests.in_process import paxlite_main, train_in_this_process

# Steps are milliseconds long, so a run reaches any step long before it would finish.
TRAIN = [
    "--fdl_config=TinySynthetic",
    "--fdl.NUM_LAYERS=1",
    "--fdl.MAX_STEPS=100000",
    "--fdl.SUMMARY_INTERVAL_STEPS=1",
    "--fdl.EVAL_INTERVAL_STEPS=100000",
    "--fdl.CHECKPOINT_EVERY_N_STEPS=100000",
]
_CLUSTER_VARS = ("SLURM_", "PAXLITE_", "OMPI_", "PMI_")


def _env(*, own_cache: bool = False, **extra: str) -> dict[str, str]:
    """The test's environment without cluster variables; ``own_cache``: without the suite's shared
    compilation cache too (conftest.py), so that the job's own cache settings are what is tested.
    The suite's own PAXLITE_TEST_* variables stay: without the fork server's directory among them
    the client paxlite_python() gives would start the real interpreter (tests/fork_server.py)."""
    env = {k: v for k, v in os.environ.items()
           if (k.startswith("PAXLITE_TEST_") or not k.startswith(_CLUSTER_VARS))
           and k != "JOB_COMPLETION_INDEX"
           and not (own_cache and k == "JAX_COMPILATION_CACHE_DIR")}
    env.update(JAX_PLATFORMS="cpu", **extra)
    return env


def _start(job: Path, log: Path, flags=(), *, stoppable: bool = False,
           **env: str) -> subprocess.Popen:
    """A training process, forked by the suite's server (tests/fork_server.py, which passes the
    signals sent to it on); with `stoppable`, the real interpreter (SIGSTOP cannot be passed on)."""
    environment = _env(**env)
    python = sys.executable if stoppable else served_python(environment)
    with open(log, "ab") as out:
        return subprocess.Popen(
            [python, "-m", "paxlite.main", f"--job_log_dir={job}", *TRAIN, *flags],
            env=environment,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _losses(job: Path) -> dict[int, tuple[float, float]]:
    lines = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: (line["loss"], line["grad_norm"]) for line in lines if "loss" in line}


def _wait_for_step(
    proc: subprocess.Popen, job: Path, log: Path, step: int, *, timeout: float = 180
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (job / "metrics.jsonl").exists() and max(_losses(job), default=0) >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode} before step "
                                 f"{step}:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no step {step} within {timeout} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen, *signals: int, timeout: float = 120) -> int:
    for number in signals:
        proc.send_signal(number)
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()


def _stopped_at(log: Path) -> int:
    line = [line for line in log.read_text().splitlines() if "stopped after step" in line][-1]
    return int(line.split("stopped after step ", 1)[1].split()[0])


def test_a_signal_checkpoints_the_step_and_the_restart_continues_bit_exactly(tmp_path):
    job, ref = tmp_path / "job", tmp_path / "ref"
    logs = [tmp_path / f"run{i}.log" for i in range(2)]
    # SIGTERM, with the exit status a Kubernetes Job would be told to treat as "retry"
    first = _start(job, logs[0], PAXLITE_PREEMPTION_EXIT_CODE="143")
    _wait_for_step(first, job, logs[0], 3)
    assert _stop(first, signal.SIGTERM) == 143, logs[0].read_text()[-3000:]
    stop1 = _stopped_at(logs[0])
    assert os.listdir(job / "checkpoints") == [f"checkpoint_{stop1:08d}"]
    assert max(_losses(job)) == stop1  # the stop step was trained and logged, nothing after it

    second = _start(job, logs[1])  # Ctrl-C this time; the default exit status is 0
    _wait_for_step(second, job, logs[1], stop1 + 5)
    assert _stop(second, signal.SIGINT) == 0, logs[1].read_text()[-3000:]
    assert f"Resumed from checkpoint step {stop1}" in logs[1].read_text()
    stop2 = _stopped_at(logs[1])
    assert sorted(os.listdir(job / "checkpoints")) == [
        f"checkpoint_{stop1:08d}",
        f"checkpoint_{stop2:08d}",
    ]

    # never interrupted
    train_in_this_process(ref, [*TRAIN, f"--fdl.MAX_STEPS={stop2}"], save_checkpoints=False)
    got, want = _losses(job), _losses(ref)
    assert sorted(got) == list(range(1, stop2 + 1))
    assert {s: got[s] for s in got} == {s: want[s] for s in got}  # loss and grad norm, bit for bit


def _wait_for_log(proc: subprocess.Popen, log: Path, text: str, *, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.02)


def test_a_second_signal_exits_at_once_and_leaves_the_committed_checkpoints_intact(
        tmp_path, monkeypatch, capfd):
    job, log = tmp_path / "job", tmp_path / "run.log"
    # the job's committed checkpoint, step 4 (same devices and compile flags as a started run)
    train_in_this_process(job, [*TRAIN, "--fdl.MAX_STEPS=4"])
    proc = _start(job, log, stoppable=True)
    # the handlers are in place; the run is being built
    _wait_for_log(proc, log, "Compilation cache:")
    proc.send_signal(signal.SIGTERM)
    _wait_for_log(proc, log, "SIGTERM received")
    # Frozen within ~20 ms of taking the first signal, so it cannot finish its step and stop of its
    # own accord before the second (with the cache warm that takes well under a second on a fast
    # machine).
    proc.send_signal(signal.SIGSTOP)
    assert proc.poll() is None, log.read_text()[-3000:]  # stopped mid-build, not exited
    # past the window in which a copy of the first signal counts as the same request (the monotonic
    # clock runs on while the process is stopped); the second signal is taken as it resumes
    time.sleep(DUPLICATE_WINDOW_S + 0.5)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGCONT)
    assert _stop(proc) == 128 + signal.SIGINT, log.read_text()[-3000:]
    assert "second stop signal (SIGINT): exiting at once" in log.read_text()
    assert "stopped after step" not in log.read_text()
    # The run may have got as far as saving step 5 for the first signal (its build is quick with the
    # compilation cache warm): that save, cut short, is left under Orbax's temporary name.
    left = sorted(os.listdir(job / "checkpoints"))
    assert left in (["checkpoint_00000004"],
                    ["checkpoint_00000004", "checkpoint_00000005.orbax-checkpoint-tmp"]), left
    # The same command again resumes from them: in this process (tests/in_process.py), as it is sent
    # no signal, with the environment _env() gives a started one.
    for name in list(os.environ):
        if name.startswith(_CLUSTER_VARS) or name == "JOB_COMPLETION_INDEX":
            monkeypatch.delenv(name)
    with paxlite_main(monkeypatch, capfd) as run:
        rerun = run(f"--job_log_dir={job}", *TRAIN, "--fdl.MAX_STEPS=6")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "Resumed from checkpoint step 4" in rerun.stderr


def test_a_signal_while_the_run_is_built_stops_after_the_first_step(tmp_path):
    job, log = tmp_path / "job", tmp_path / "run.log"
    proc = _start(job, log)
    _wait_for_log(proc, log, "Compilation cache:")  # the handlers are in place
    assert _stop(proc, signal.SIGTERM) == 0, log.read_text()[-3000:]
    assert "Training TinySynthetic from step 0" in log.read_text().split("SIGTERM received", 1)[1]
    assert _stopped_at(log) == 1 and os.listdir(job / "checkpoints") == ["checkpoint_00000001"]


@pytest.mark.parametrize("raw", ["abc", "256", "-1"])
def test_bad_preemption_exit_code(raw):
    with pytest.raises(SettingError, match=f"PAXLITE_PREEMPTION_EXIT_CODE='{raw}' must be an exit "
                                           "status 0..255"):
        preemption_exit_code({"PAXLITE_PREEMPTION_EXIT_CODE": raw})
    assert (
        preemption_exit_code({}) == 0
        and preemption_exit_code({"PAXLITE_PREEMPTION_EXIT_CODE": "143"}) == 143
    )


def test_bad_preemption_exit_code_is_one_line_before_any_work(tmp_path, monkeypatch, capfd):
    # in this process (tests/in_process.py): the setting is refused before any device work
    monkeypatch.setenv("PAXLITE_PREEMPTION_EXIT_CODE", "sigterm")
    with paxlite_main(monkeypatch, capfd) as run:
        out = run(f"--job_log_dir={tmp_path / 'job'}", *TRAIN)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "paxlite: error: PAXLITE_PREEMPTION_EXIT_CODE='sigterm' must be an exit status 0..255 "
        "(e.g. 143, what a process killed by SIGTERM reports)")
    assert not (tmp_path / "job").exists()


# A training process whose main thread hangs in the middle of step 5 (as in a collective whose peer
# died).
_HANG = textwrap.dedent("""
    import sys, time
    from paxlite.train import device_metrics

    _add = device_metrics.StepMetrics.add

    def injected_hang():
        while True:
            time.sleep(1)

    def add(self, step, metrics):
        if step == 5:
            injected_hang()
        return _add(self, step, metrics)

    device_metrics.StepMetrics.add = add
    from paxlite.main import run_main
    run_main()
""")


def test_the_watchdog_logs_every_stack_then_exits_so_the_job_can_restart(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(_HANG)
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(script), f"--job_log_dir={tmp_path / 'job'}", *TRAIN,
         "--fdl.WATCHDOG_TIMEOUT_SECONDS=1", "--fdl.CRASH_ON_HANG_TIMEOUT_SECONDS=4"],
        check=False, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 124, out.stderr[-3000:]
    warning, _, crash = out.stderr.partition("CRASH_ON_HANG_TIMEOUT_SECONDS=4")
    assert "No training step completed in" in warning and "WATCHDOG_TIMEOUT_SECONDS=1" in warning
    assert 'Thread "MainThread"' in warning and "injected_hang" in warning  # where it hangs, named
    assert "exiting with status 124" in crash and "injected_hang" in crash
    assert time.monotonic() - start < 200


def test_watchdog_timeouts_are_checked():
    from paxlite.config.errors import ConfigError
    from paxlite.experiments.build import load_experiment

    with pytest.raises(ConfigError, match=r"CRASH_ON_HANG_TIMEOUT_SECONDS=10.0 must be >= "
                                          r"WATCHDOG_TIMEOUT_SECONDS=20"):
        load_experiment(
            "TinySynthetic", ["WATCHDOG_TIMEOUT_SECONDS=20", "CRASH_ON_HANG_TIMEOUT_SECONDS=10.0"]
        )
    with pytest.raises(ConfigError, match=r"WATCHDOG_TIMEOUT_SECONDS must be > 0 seconds or None "
                                          r"\(never\), got 0"):
        load_experiment("TinySynthetic", ["WATCHDOG_TIMEOUT_SECONDS=0"])
    load_experiment(
        "TinySynthetic", ["WATCHDOG_TIMEOUT_SECONDS=None", "CRASH_ON_HANG_TIMEOUT_SECONDS=None"]
    )


# slow: two training processes, the first compiling into an empty cache of its own (~25 s)
@pytest.mark.slow
def test_a_second_run_of_the_same_job_compiles_nothing_new(tmp_path, monkeypatch, capfd):
    cache = tmp_path / "cache"
    runs = []
    env = _env(own_cache=True)
    # Both runs forked from one server of this environment (it has imported JAX without the
    # suite's cache directory, and compiles nothing itself): each is a process of its own, with
    # its own backend and its own in-memory caches, so the second finds only what the first wrote.
    python = served_python(env)
    for name in ("a", "b"):
        out = subprocess.run(
            [python, "-m", "paxlite.main", f"--job_log_dir={tmp_path / name}", *TRAIN,
             "--fdl.MAX_STEPS=3", f"--fdl.COMPILATION_CACHE_DIR='{cache}'",
             "--enable_checkpoint_saving=false"],  # the steps' programs are the point, not a save
            check=False, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(sorted(os.listdir(cache)))
    assert any(name.startswith("jit_train_step") for name in runs[0]), runs[0]
    assert runs[1] == runs[0]  # every executable of the second run came from the cache
    assert not (tmp_path / "a" / "compilation_cache").exists()
    # The cache off: no directory of the job's own. In this process (tests/in_process.py), whose
    # compiles the session's cache serves (the job leaves JAX's settings as they are when off),
    # without the variable, so that the directory would be the job's own if the setting were
    # ignored.
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    with paxlite_main(monkeypatch, capfd) as run:
        off = run(f"--job_log_dir={tmp_path / 'c'}", *TRAIN, "--fdl.MAX_STEPS=1",
                  "--fdl.COMPILATION_CACHE=False")
    assert off.returncode == 0 and not (tmp_path / "c" / "compilation_cache").exists()


def test_the_axlearn_style_launcher_stops_the_same_way(tmp_path):
    trainer_dir, log = tmp_path / "trainer", tmp_path / "launcher.log"
    env = _env(PAXLITE_PREEMPTION_EXIT_CODE="143")
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [
                served_python(env),
                "-m",
                "paxlite.launch_trainer_main",
                "--module=text.gpt.c4_trainer",
                "--config=fuji-test-v1",
                f"--trainer_dir={trainer_dir}",
                "--data_dir=FAKE",
                "--jax_backend=cpu",
                "--trainer_log_every_n_steps=1",
                "--fdl.MAX_STEPS=1000000",
                "--fdl.EVAL_INTERVAL_STEPS=1000000",
                "--fdl.CHECKPOINT_EVERY_N_STEPS=1000000",
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    _wait_for_step(proc, trainer_dir, log, 2)
    assert _stop(proc, signal.SIGTERM) == 143, log.read_text()[-3000:]
    stop = _stopped_at(log)
    assert os.listdir(trainer_dir / "checkpoints") == [f"checkpoint_{stop:08d}"]


def test_a_signal_with_checkpoint_saving_off_says_so_and_does_not_ask_for_a_retry(tmp_path):
    """Nothing was saved, so the status a scheduler reads as "rerun to resume" would be a lie."""
    job, log = tmp_path / "job", tmp_path / "run.log"
    proc = _start(
        job, log, ["--enable_checkpoint_saving=false"], PAXLITE_PREEMPTION_EXIT_CODE="143"
    )
    _wait_for_step(proc, job, log, 2)
    assert _stop(proc, signal.SIGTERM) == PREEMPTED_UNSAVED_EXIT_CODE == 3, log.read_text()[-3000:]
    text = log.read_text()
    assert "committed" not in text and "run the same command again to resume" not in text
    line = [line for line in text.splitlines() if "stopped after step" in line][-1]
    assert "WITHOUT a checkpoint: saving is off (--enable_checkpoint_saving=false)" in line
    assert line.endswith("the same command would start again from the beginning (there is no "
                         "checkpoint)")
    assert not (job / "checkpoints").exists() or not os.listdir(job / "checkpoints")


def test_the_unsaved_status_cannot_be_the_preemption_status():
    with pytest.raises(SettingError, match="PAXLITE_PREEMPTION_EXIT_CODE='3': 3 is the status of a "
                                           "run stopped without a checkpoint"):
        preemption_exit_code({"PAXLITE_PREEMPTION_EXIT_CODE": "3"})


# ---------------------------------------------------------------- the processes' vote, in one
# process (Preemption(voting=True) votes over this process's 8 devices exactly as several processes
# vote over theirs.)
RUN_OVERRIDES = [
    "NUM_LAYERS=1",
    "MAX_STEPS=50",
    "SUMMARY_INTERVAL_STEPS=1000",
    "EVAL_INTERVAL_STEPS=1000",
    "CHECKPOINT_EVERY_N_STEPS=1000",
]


def _train_signalled_before_the_first_step(
    job: Path, *, voting: bool, caplog
) -> tuple[int, set[str]]:
    """(the step a run signalled while it is built stops after, the programs lowered while it
    trains)."""
    import logging

    from paxlite.experiments.build import build_run_config
    from paxlite.train.loop import Run, RunContext, stop_signals

    _, config = build_run_config("TinySynthetic", RUN_OVERRIDES)
    with (
        stop_signals(voting=voting) as preemption,
        Run(config, RunContext(job_dir=str(job))) as run,
    ):
        signal.raise_signal(signal.SIGTERM)  # handled at once, in this (the main) thread
        assert preemption.signal_name == "SIGTERM"
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="jax._src.interpreters.pxla"):
            run.train(preemption=preemption)
        lowered = {r.args[0] for r in caplog.records if r.getMessage().startswith("Compiling ")}
        assert run.preempted_saved
        return run.preempted_at, lowered


def test_the_vote_rides_in_the_train_step_and_a_signal_while_building_stops_after_step_one(
    tmp_path, caplog
):
    """Several processes stop after their first step too (job.py), and voting adds no program to a
    step: the programs a voting run lowers are among those of a run that does not vote."""
    from paxlite.train import run_build

    run_build.clear_compiled_steps()  # what each run lowers, not what an earlier test kept
    alone_at, alone = _train_signalled_before_the_first_step(
        tmp_path / "alone", voting=False, caplog=caplog
    )
    voted_at, voted = _train_signalled_before_the_first_step(
        tmp_path / "voted", voting=True, caplog=caplog
    )
    assert alone_at == voted_at == 1
    assert os.listdir(tmp_path / "voted" / "checkpoints") == ["checkpoint_00000001"]
    assert "jit(train_step)" in voted and voted <= alone, (voted, alone)


def test_every_process_stops_after_the_same_step_within_lag_plus_one_steps():
    """Two processes' Preemptions (one signalled) fed the same agreed votes, as the train step
    computes them: the same decision at every step; at a step the loop waits for anyway (first,
    boundary) the newest vote."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from paxlite.train.loop import MAX_STEPS_AFTER_SIGNAL, stop_signals

    sharding = NamedSharding(Mesh(jax.devices(), ("all",)), PartitionSpec("all"))
    # what max over the processes' devices gives when each holds one flag
    agree = jax.jit(jnp.maximum)
    boundaries = {1, 10, 20}
    for signal_step in range(2, 18):
        quiet, signalled = stop_signals(voting=True), stop_signals(voting=True)
        with signalled:
            stops = []
            for step in range(1, 30):
                vote = jnp.max(agree(quiet.votes(sharding), signalled.votes(sharding)))
                # arrives once `step` is dispatched: the next step carries it
                if step == signal_step:
                    signal.raise_signal(signal.SIGTERM)
                decisions = [
                    p.should_stop(step, vote=vote, synced=step in boundaries)
                    for p in (quiet, signalled)
                ]
                assert decisions[0] == decisions[1], (signal_step, step)
                if decisions[0]:
                    stops.append(step)
                    break
        stop = stops[0]
        assert signal_step < stop <= signal_step + MAX_STEPS_AFTER_SIGNAL, (signal_step, stop)
        if signal_step + 1 in boundaries:
            assert stop == signal_step + 1  # read at once where the loop waits anyway
