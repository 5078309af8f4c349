"""End-to-end training loop on 8 devices: learning, exact resume, corrupted-checkpoint fallback, NaN
stop."""

import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from paxlite.experiments.build import build_run_config
from paxlite.train import optimizer as optimizer_lib
from paxlite.train import run_build
from paxlite.train.loop import Run, RunContext, TrainingDivergedError
from paxlite.train.step_timer import StepTimer

N = 4  # steps before the interruption


def _run(job_dir, overrides=(), *, name="TinySynthetic", saving=True):
    _, config = build_run_config(name, list(overrides))
    with Run(config, RunContext(job_dir=str(job_dir), enable_checkpoint_saving=saving)) as run:
        state = run.train()
        return jax.device_get(state)


def _train_lines(job_dir):
    with open(os.path.join(job_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    return [line for line in lines if "loss" in line]


def _eval_lines(job_dir):
    with open(os.path.join(job_dir, "metrics.jsonl")) as f:
        return [line for line in map(json.loads, f) if "eval/loss" in line]


# One layer: nothing here depends on the depth (the scanned-stack test keeps TinySynthetic's two),
# and each of the file's ~20 runs traces, lowers and compiles about a third less (this file:
# 70 -> 48 CPU-s).
ONE_LAYER = ["NUM_LAYERS=1"]
# A learning rate and a 2-step warmup at which 20 steps take the permutation task's loss from
# about ln(256) = 5.5 to about a quarter of that (2026-12-07), where TinySynthetic's own rate and
# warmup take 80 (on 8 fake devices each step costs about 70 ms of CPU).
FAST_RATE = ["LEARNING_RATE=1e-2", "LR_COS_WARMUP=2"]
# The model and optimizer settings of the learning test and of every run below that needs no
# particular ones: they all run the one train step this program compiles (the learning test and
# the resume tests used to compile one each). Dropout: resume must also reproduce the dropout
# masks, and the learning test learns with it.
FAST = [*ONE_LAYER, *FAST_RATE, "DROPOUT_PROB=0.1"]
# The resume tests' loop settings: a summary of every step (each step's loss and learning rate
# compared), a checkpoint every N. The learning rate changes at every one of their 2N steps (the
# warmup's 2, then the cosine decay's).
COMMON = [
    *FAST,
    "SUMMARY_INTERVAL_STEPS=1",
    f"CHECKPOINT_EVERY_N_STEPS={N}",
    "EVAL_INTERVAL_STEPS=1000",
    "EVAL_LOOP_NUM_BATCHES=1",
]


def test_loss_falls_on_learnable_synthetic_task(tmp_path):
    _run(tmp_path, FAST + ["MAX_STEPS=20", "SUMMARY_INTERVAL_STEPS=4", "EVAL_INTERVAL_STEPS=10",
                           "CHECKPOINT_EVERY_N_STEPS=10"])
    lines = _train_lines(tmp_path)
    assert [line["step"] for line in lines] == list(range(4, 21, 4))
    first, last = lines[0]["loss"], lines[-1]["loss"]
    # Untrained: about ln(256) = 5.55. The permutation task is learnable: loss must fall far below
    # it.
    assert first > 4.5 and last < 0.5 * first, (first, last)
    evals = _eval_lines(tmp_path)
    assert [e["step"] for e in evals] == [10, 20]
    assert evals[1]["eval/loss"] < evals[0]["eval/loss"] < 5.0
    assert evals[1]["eval/log_pplx"] == evals[1]["eval/loss"]
    for line in lines:
        assert set(line) >= {
            "step",
            "loss",
            "learning_rate",
            "grad_norm",
            "step_time_s",
            "tokens_per_s",
            "mfu",
        }
        assert line["mfu"] is None  # CPU: no known peak
    assert lines[-1]["tokens_per_s"] > 0
    # global batch = PERCORE_BATCH_SIZE (2) x 8 devices; 64 tokens per row
    assert lines[-1]["tokens_per_s"] == pytest.approx(16 * 64 / lines[-1]["step_time_s"])
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [
        "checkpoint_00000010",
        "checkpoint_00000020",
    ]
    assert os.listdir(tmp_path / "summaries" / "train") and os.listdir(
        tmp_path / "summaries" / "eval"
    )


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """2N steps without interruption: the reference for resume tests."""
    job = tmp_path_factory.mktemp("straight")
    state = _run(job, COMMON + [f"MAX_STEPS={2 * N}"])
    return job, state, _train_lines(job)


def _assert_same_state(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) > 10
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_resume_is_bit_exact(tmp_path, straight_run):
    _, straight_state, straight_lines = straight_run
    _run(tmp_path, COMMON + [f"MAX_STEPS={N}"])
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [f"checkpoint_{N:08d}"]
    resumed_state = _run(tmp_path, COMMON + [f"MAX_STEPS={2 * N}"])
    lines = _train_lines(tmp_path)
    assert [line["step"] for line in lines] == list(range(1, 2 * N + 1))
    assert [line["loss"] for line in lines] == [line["loss"] for line in straight_lines]
    assert [line["grad_norm"] for line in lines] == [line["grad_norm"] for line in straight_lines]
    assert int(resumed_state.step) == 2 * N
    _assert_same_state(resumed_state, straight_state)


def test_corrupted_latest_checkpoint_falls_back_to_previous(tmp_path, straight_run, caplog):
    straight_dir, straight_state, straight_lines = straight_run
    shutil.copytree(straight_dir, tmp_path / "job")
    job = tmp_path / "job"
    latest = job / "checkpoints" / f"checkpoint_{2 * N:08d}"
    # Damage the latest checkpoint: truncate every data file of its state.
    damaged = 0
    for root, _, files in os.walk(latest / "state"):
        for name in files:
            if os.path.basename(root) == "d":  # OCDBT data files
                with open(os.path.join(root, name), "r+b") as f:
                    f.truncate(3)
                damaged += 1
    assert damaged
    state = _run(job, COMMON + [f"MAX_STEPS={2 * N}"])
    # The damaged directory was kept, not deleted, and reported.
    assert (job / "checkpoints_corrupted" / latest.name).is_dir()
    assert any(latest.name in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    # Training resumed from step N and reproduced the uninterrupted run exactly.
    lines = _train_lines(job)
    assert [line["step"] for line in lines] == list(range(1, 2 * N + 1)) + list(
        range(N + 1, 2 * N + 1)
    )
    assert [line["loss"] for line in lines[2 * N:]] == [line["loss"] for line in straight_lines[N:]]
    _assert_same_state(state, straight_state)
    assert sorted(os.listdir(job / "checkpoints")) == [
        f"checkpoint_{N:08d}",
        f"checkpoint_{2 * N:08d}",
    ]


def test_nan_loss_stops_without_saving(tmp_path):
    with pytest.raises(TrainingDivergedError, match=r"at step \d+|after step \d+") as info:
        _run(tmp_path, [*ONE_LAYER, "MAX_STEPS=20", "LEARNING_RATE=1e30", "LR_SCHEDULE=constant",
                        "CLIP_GRADIENT_NORM_TO_VALUE=0.0", "CHECKPOINT_EVERY_N_STEPS=1",
                        "SUMMARY_INTERVAL_STEPS=1"])
    message = str(info.value)
    bad_step = int(message.split("step ")[1].split()[0].rstrip(";"))
    saved = sorted(int(name.split("_")[1]) for name in os.listdir(tmp_path / "checkpoints"))
    assert all(step < bad_step for step in saved), (saved, message)
    assert saved, "the finite steps before the divergence are checkpointed as usual"
    logged = [line["step"] for line in _train_lines(tmp_path)]
    assert bad_step not in logged


def test_disabled_checkpoint_saving_writes_none_and_mfu_uses_the_given_peak(tmp_path):
    overrides = FAST + ["MAX_STEPS=3", "CHECKPOINT_EVERY_N_STEPS=1", "PEAK_TFLOPS=0.5"]
    _run(tmp_path, overrides, saving=False)
    assert not os.path.exists(tmp_path / "checkpoints") or not os.listdir(tmp_path / "checkpoints")
    lines = _train_lines(tmp_path)
    assert len(lines) == 1  # the final step is always summarised
    experiment, _ = build_run_config("TinySynthetic", overrides)
    # MFU = tokens/s x FLOPs per token / (peak x devices), with the peak from --fdl.PEAK_TFLOPS.
    expected = lines[0]["tokens_per_s"] * experiment.flops_per_token() / (0.5e12 * 8)
    assert lines[0]["mfu"] == pytest.approx(expected, rel=1e-9)


def test_bfloat16_scanned_stack_with_dropout_trains(tmp_path):
    """The GPT5B-style path: bf16 compute over fp32 parameters, scanned layers with remat, input
    dropout. 12 steps (summaries at 4, 8 and 12), with FAST_RATE's 2-step warmup: the loss at 12
    is about 0.6 of the loss at 4 (2026-12-07; 20 steps with TinySynthetic's warmup of 10
    before)."""
    state = _run(
        tmp_path,
        [
            *FAST_RATE,
            "MAX_STEPS=12",
            "SUMMARY_INTERVAL_STEPS=4",
            "FPROP_DTYPE=bfloat16",
            "USE_REPEATED_LAYER=true",
            "CHECKPOINT_POLICY=SAVE_DOT_WITH_NO_BATCH_DIM",
            "INPUT_DROPOUT_PROB=0.1",
            "EVAL_INTERVAL_STEPS=1000",
        ],
        saving=False,  # the last step's checkpoint: nothing here reads it
    )
    losses = [line["loss"] for line in _train_lines(tmp_path)]
    assert losses[-1] < 0.75 * losses[0], losses
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(state.params))
    # scanned: leading layers axis
    assert state.params["layers"]["mlp"]["wi"]["kernel"].shape[0] == 2


def test_fractional_percore_batch_with_tensor_parallelism(tmp_path):
    """Pax: PERCORE_BATCH_SIZE=0.5 with tensor=2 is one row per model replica; global = 0.5 x 8
    devices = 4."""
    overrides = [
        *ONE_LAYER,
        "MAX_STEPS=2",
        "SUMMARY_INTERVAL_STEPS=1",
        "PERCORE_BATCH_SIZE=0.5",
        "ICI_MESH_SHAPE=[2,2,2]",
        "EVAL_INTERVAL_STEPS=1000",
        "CHECKPOINT_EVERY_N_STEPS=1000",
    ]
    _, config = build_run_config("TinySynthetic", overrides)
    # no checkpoint of the last step: nothing here reads it
    context = RunContext(job_dir=str(tmp_path / "job"), enable_checkpoint_saving=False)
    with Run(config, context) as run:
        assert run.global_batch_size == 4 and run.tokens_per_step == 4 * config.model.max_seq_len
        run.train()
    lines = _train_lines(tmp_path / "job")
    assert [line["step"] for line in lines] == [1, 2] and all(
        np.isfinite(line["loss"]) for line in lines
    )
    _, bad = build_run_config("TinySynthetic", ["PERCORE_BATCH_SIZE=0.3", "ICI_MESH_SHAPE=[2,2,2]"])
    with pytest.raises(Exception, match=r"0.3 x 8 devices = 2.4 is not a positive whole global "
                                        r"batch"):
        Run(bad, RunContext(job_dir=str(tmp_path / "bad")))


_OFF = ["WEIGHT_DECAY=0.0", "CLIP_GRADIENT_NORM_TO_VALUE=0.0", "ADAM_CLIP_THRESHOLD=-1.0",
        "ADAM_MU_DTYPE=float32"]
_ON = ["WEIGHT_DECAY=0.1", "CLIP_GRADIENT_NORM_TO_VALUE=1.0", "ADAM_CLIP_THRESHOLD=1.0",
       "ADAM_MU_DTYPE=bfloat16"]


@pytest.mark.parametrize(("first", "second"), [(_OFF, _ON), (_ON, _OFF)], ids=["off_on", "on_off"])
def test_resume_after_toggling_optimizer_settings(tmp_path, first, second):
    """Clipping, the Adam RMS cap and weight decay switched between 0 and > 0 across a restart,
    and Adam's first moment between float32 and bfloat16 (the restore casts it)."""
    # COMMON's settings: the _OFF run is the program the earlier-layout test resumes with.
    short = COMMON + ["CHECKPOINT_EVERY_N_STEPS=2"]
    stopped = _run(tmp_path, short + first + ["MAX_STEPS=2"])
    # restores step 2 as a run that saves would; step 3's checkpoint is read by nothing here
    resumed = _run(tmp_path, short + second + ["MAX_STEPS=3"], saving=False)
    assert int(resumed.step) == 3
    assert [line["step"] for line in _train_lines(tmp_path)] == [1, 2, 3]  # resumed, not restarted
    # Step 3 started from step 2's state: the Adam count continued (an init would restart at 1).
    counts = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(resumed.opt_state)[0]
              if "count" in jax.tree_util.keystr(path)]
    assert counts and all(int(c) == 3 for c in counts)
    assert int(stopped.step) == 2
    mu_dtype = jnp.dtype(second[-1].removeprefix("ADAM_MU_DTYPE="))
    assert {leaf.dtype for leaf in jax.tree.leaves(resumed.opt_state[1].mu)} == {mu_dtype}
    assert {leaf.dtype for leaf in jax.tree.leaves(stopped.opt_state[1].mu)} != {mu_dtype}


def _earlier_make_optimizer(config, schedule):
    """`make_optimizer` as it was before every stage was always present: disabled ones left out."""
    stages = []
    if config.clip_gradient_norm_to_value > 0:
        stages.append(optimizer_lib._clip_by_global_norm(config.clip_gradient_norm_to_value))
    stages.append(optax.scale_by_adam(b1=config.beta1, b2=config.beta2, eps=config.epsilon,
                                      eps_root=config.epsilon_root))
    if config.clip_threshold > 0:
        stages.append(optimizer_lib._cap_update_rms(config.clip_threshold))
    if config.weight_decay > 0:
        stages.append(optax.add_decayed_weights(config.weight_decay))
    stages.append(optax.scale_by_learning_rate(schedule))
    return optax.chain(*stages)


# TinySynthetic clips and decays: [clip, adam, decay, lr]; with _OFF the chain is [adam, lr].
@pytest.mark.parametrize(("settings", "stages", "adam"), [([], 4, 1), (_OFF, 2, 0)],
                         ids=["clip_decay", "adam_only"])
def test_resume_from_checkpoint_of_the_earlier_optimizer_layout(
        tmp_path, monkeypatch, caplog, settings, stages, adam):
    """A job checkpointed by the earlier chain resumes as the earlier code would have resumed it."""
    stop = 2  # steps before the interruption: the stop and the resume need no more
    overrides = COMMON + [f"CHECKPOINT_EVERY_N_STEPS={stop}", *settings]
    with monkeypatch.context() as patch:
        patch.setattr(run_build, "make_optimizer", _earlier_make_optimizer)
        # its metrics are the reference; its checkpoints are read by nothing here
        reference = _run(tmp_path / "reference", overrides + [f"MAX_STEPS={2 * stop}"],
                         saving=False)
        stopped = _run(tmp_path / "job", overrides + [f"MAX_STEPS={stop}"])
    assert len(stopped.opt_state) == len(reference.opt_state) == stages  # the earlier layout
    resumed = _run(tmp_path / "job", overrides + [f"MAX_STEPS={2 * stop}"])
    lines, want = _train_lines(tmp_path / "job"), _train_lines(tmp_path / "reference")
    # resumed, not restarted
    assert [line["step"] for line in lines] == list(range(1, 2 * stop + 1))
    for key in ("loss", "grad_norm", "learning_rate"):
        assert [line[key] for line in lines] == [line[key] for line in want], key
    assert int(resumed.step) == 2 * stop and len(resumed.opt_state) == 5
    _assert_same_state(resumed.params, reference.params)
    _assert_same_state((resumed.opt_state[1], resumed.opt_state[4].count),
                       (reference.opt_state[adam], reference.opt_state[-1].count))
    assert any("earlier layout" in r.getMessage() and f"({stages} stages" in r.getMessage()
               for r in caplog.records if r.levelname == "WARNING")
    assert sorted(os.listdir(tmp_path / "job" / "checkpoints")) == [
        f"checkpoint_{stop:08d}", f"checkpoint_{2 * stop:08d}"]
    assert not os.path.exists(tmp_path / "job" / "checkpoints_corrupted")


def test_checkpoint_of_another_model_is_a_named_mismatch(tmp_path):
    from paxlite.checkpointing.checkpoint import CheckpointMismatchError

    _run(tmp_path, FAST + ["MAX_STEPS=1", "EVAL_INTERVAL_STEPS=1000", "EVAL_LOOP_NUM_BATCHES=1"])
    before = sorted(os.listdir(tmp_path / "checkpoints"))
    with pytest.raises(CheckpointMismatchError) as info:
        _run(tmp_path, FAST + ["MAX_STEPS=2", "HIDDEN_DIMS=128"])
    message = str(info.value)
    assert "params/layers_0/mlp/wi/kernel: checkpoint shape (64, 256), this run's shape (64, 128)" \
        in message
    assert (
        "opt_state/1/mu/layers_0/mlp/wi/kernel" in message and "CHECKPOINT_RESTORE_PATH" in message
    )
    assert sorted(os.listdir(tmp_path / "checkpoints")) == before
    assert not os.path.exists(tmp_path / "checkpoints_corrupted")


def _tree_bytes(directory):
    return {os.path.relpath(os.path.join(root, name), directory):
            open(os.path.join(root, name), "rb").read()
            for root, _, files in os.walk(directory) for name in files}


def test_eval_mode_leaves_a_damaged_checkpoint_in_place(tmp_path, straight_run, caplog):
    straight_dir, _, _ = straight_run
    job = tmp_path / "job"
    shutil.copytree(straight_dir, job, ignore=shutil.ignore_patterns("metrics.jsonl"))
    latest = job / "checkpoints" / f"checkpoint_{2 * N:08d}"
    os.remove(latest / "state" / "manifest.ocdbt")
    before = _tree_bytes(job / "checkpoints")
    _, config = build_run_config("TinySynthetic", COMMON + [f"MAX_STEPS={2 * N}"])
    with Run(config, RunContext(job_dir=str(job), training=False)) as run:
        run.run_eval()
    assert _tree_bytes(job / "checkpoints") == before  # nothing written, renamed or moved
    assert not os.path.exists(job / "checkpoints_corrupted")
    # It evaluated the newest intact step and said which one, and why.
    assert [line["step"] for line in _eval_lines(job)] == [N]
    assert any(f"evaluates step {N}" in r.getMessage() and "left in place" in r.getMessage()
               for r in caplog.records if r.levelname == "WARNING")


def test_step_timer_times_counted_steps_and_leaves_out_excluded_host_work():
    """train/step_timer.py on its own: two steps that each wait WAIT_S for a batch, plus half a
    second of excluded host work (a profile trace), time as two steps of about WAIT_S, nearly all
    of it input wait."""
    wait_s, excluded_s = 0.05, 0.5

    def slow_batches():
        while True:
            time.sleep(wait_s)
            yield "batch"

    timer = StepTimer(tokens_per_step=1000, flops_per_token=6, peak_flops_per_device=1e6,
                      num_devices=2)
    batches = slow_batches()
    for _ in range(2):
        assert timer.next_batch(batches) == "batch"
        timer.count_step()
    time.sleep(excluded_s)
    timer.exclude(excluded_s)
    summary = timer.summary()
    assert list(summary) == ["step_time_s", "tokens_per_s", "mfu", "input_wait_fraction"]
    # Not excluded, the half second would make each step at least 0.3 s.
    assert wait_s <= summary["step_time_s"] < (2 * wait_s + excluded_s) / 2, summary
    assert summary["tokens_per_s"] == 1000 / summary["step_time_s"]
    assert summary["mfu"] == pytest.approx(summary["tokens_per_s"] * 6 / (1e6 * 2), rel=1e-12)
    assert 0.5 < summary["input_wait_fraction"] <= 1.0, summary
    timer.restart()  # a new window has no timed step yet
    assert timer.summary() == dict.fromkeys(summary)
