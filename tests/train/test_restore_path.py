"""CHECKPOINT_RESTORE_PATH (init from pretrained): Pax's restore order, exact restore, ignore rules,
evaluating the restore path, and errors that come before training."""

import json
import shutil

import jax
import numpy as np
import pytest
from flax import traverse_util

from paxlite.checkpointing import pretrained
from paxlite.checkpointing.pretrained import ignored_by
from paxlite.data.synthetic import SyntheticData
from paxlite.experiments.build import build_run_config
from paxlite.models.transformer import Transformer
from paxlite.train.loop import Run, RunContext

COMMON = ["LR_SCHEDULE=constant", "LEARNING_RATE=3e-3", "SUMMARY_INTERVAL_STEPS=1",
          "EVAL_INTERVAL_STEPS=1000", "EVAL_LOOP_NUM_BATCHES=1", "CHECKPOINT_EVERY_N_STEPS=1000"]
A_STEPS = 4


def _config(overrides=()):
    return build_run_config("TinySynthetic", COMMON + list(overrides))[1]


def _restoring(path, overrides=()):
    return _config([f"CHECKPOINT_RESTORE_PATH={str(path)!r}", *overrides])


def _flat(tree):
    return traverse_util.flatten_dict(jax.device_get(tree), sep="/")


def _lines(job, key):
    lines = [json.loads(x) for x in (job / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if key in x]


@pytest.fixture(scope="module")
def job_a(tmp_path_factory):
    """A trained job: A_STEPS steps, evaluated at the end."""
    job = tmp_path_factory.mktemp("a")
    with Run(_config([f"MAX_STEPS={A_STEPS}"]), RunContext(job_dir=str(job))) as run:
        state = run.train()
        return job, _flat(state.params)


def test_restored_params_are_exact_and_ignored_ones_fresh(tmp_path, job_a):
    job, params_a = job_a
    # One rule in paxlite's '/' spelling, one in Pax's '.' spelling.
    rules = ["layers_1/mlp/.*", r"final_norm\.scale"]
    config = _restoring(job, [f"CHECKPOINT_IGNORE_RULES={rules!r}", "MAX_STEPS=1"])
    with Run(config, RunContext(job_dir=str(tmp_path / "b"))) as run:
        fresh = _flat(run.steps.init().params)
        state = run.restore_or_init()
        restored, opt_state = _flat(state.params), jax.device_get(state.opt_state)
        assert int(state.step) == 0
    ignored = {k for k in params_a if ignored_by(rules, k)}
    assert ignored == {"layers_1/mlp/wi/kernel", "layers_1/mlp/wi/bias", "layers_1/mlp/wo/kernel",
                       "layers_1/mlp/wo/bias", "final_norm/scale"}
    for key, value in params_a.items():
        if key in ignored:
            np.testing.assert_array_equal(restored[key], fresh[key], err_msg=key)
            assert not np.array_equal(value, fresh[key]), key  # training moved it
        else:
            np.testing.assert_array_equal(restored[key], value, err_msg=key)
    # Fresh optimizer state: zero moments, zero count.
    assert all(not np.any(leaf) for leaf in jax.tree.leaves(opt_state))


def test_restored_parameters_are_never_sampled(tmp_path, job_a):
    """The fresh state a restore path starts from (init_with) samples only the parameters the
    checkpoint does not give: with every parameter restored its program draws no random numbers
    (init's does), with ignored ones only theirs; the values are checked above."""
    job, _ = job_a
    with Run(_restoring(job, ["MAX_STEPS=1"]), RunContext(job_dir=str(tmp_path / "b"))) as run:
        abstract = run.steps.abstract_state.params
        with jax.set_mesh(run.mesh):
            everything = run.steps.init_with.lower(abstract).as_text()
            flat = traverse_util.flatten_dict(abstract, sep="/")
            kept = {k: v for k, v in flat.items() if not k.startswith("layers_1/mlp/")}
            partial = run.steps.init_with.lower(
                traverse_util.unflatten_dict(kept, sep="/")).as_text()
            fresh = run.steps.init.lower().as_text()
    sampler = "threefry2x32"
    assert fresh.count(sampler) > partial.count(sampler) > 0
    assert sampler not in everything


def _numpy_loss(model_config, params, batch):
    """Mean weighted cross entropy in float64 from the model's logits: independent of train_step."""
    logits = np.asarray(jax.jit(lambda p, x: Transformer(model_config).apply({"params": p}, x))(
        traverse_util.unflatten_dict(params, sep="/"), batch["inputs"]), np.float64)
    log_z = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    target = np.take_along_axis(logits, np.asarray(batch["targets"])[..., None], -1)[..., 0]
    weights = np.asarray(batch["weights"], np.float64)
    return float(np.sum((log_z - target) * weights) / np.sum(weights))


def test_step_one_loss_is_the_restored_checkpoints_loss(tmp_path, job_a):
    job, params_a = job_a
    config = _restoring(job, ["MAX_STEPS=1"])
    with Run(config, RunContext(job_dir=str(tmp_path / "b"))) as run:
        run.train()
        global_batch = run.global_batch_size
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    batch = SyntheticData(config.data, global_batch_size=global_batch).train_batch(0, device)
    expected = _numpy_loss(config.model, params_a, jax.device_get(batch))
    (line,) = _lines(tmp_path / "b", "loss")
    assert line["step"] == 1
    assert line["loss"] == pytest.approx(expected, rel=1e-5)
    # ... which is not the loss of a fresh initialisation (about ln 256 = 5.5).
    assert expected < 5.0


def test_eval_mode_evaluates_the_restore_path(tmp_path, job_a):
    """Pax's EVAL_ONLY flow (run_llama_boolq.sh): no checkpoint in the job dir, a restore path."""
    job, _ = job_a
    (eval_a,) = _lines(job, "eval/loss")
    assert eval_a["step"] == A_STEPS
    context = RunContext(job_dir=str(tmp_path / "eval"), training=False)
    with Run(_restoring(job), context) as run:
        metrics = run.run_eval()
    assert metrics["loss"] == pytest.approx(eval_a["eval/loss"], rel=1e-6)
    (line,) = _lines(tmp_path / "eval", "eval/loss")
    assert line["step"] == 0


def test_resuming_beats_the_restore_path(tmp_path, job_a):
    job, params_a = job_a
    other = tmp_path / "other"  # a different, valid restore path: all zeros
    pretrained.save_params(other, jax.tree.map(np.zeros_like,
                                               traverse_util.unflatten_dict(params_a, sep="/")))
    shutil.copytree(job, tmp_path / "job")
    config = _restoring(other, [f"MAX_STEPS={A_STEPS}"])
    with Run(config, RunContext(job_dir=str(tmp_path / "job"))) as run:
        state = run.restore_or_init()
        assert int(state.step) == A_STEPS
        resumed = _flat(state.params)
    for key, value in params_a.items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)


def test_errors_come_before_training(tmp_path, job_a):
    job, _ = job_a
    with pytest.raises(pretrained.PretrainedCheckpointError, match="does not exist"):
        Run(_restoring(tmp_path / "missing"), RunContext(job_dir=str(tmp_path / "b1")))
    with pytest.raises(ValueError, match="exclude every parameter"):
        Run(_restoring(job, ["CHECKPOINT_IGNORE_RULES=['.*']"]),
            RunContext(job_dir=str(tmp_path / "b2")))
    # A model of another shape: every mismatched parameter is named, nothing is trained.
    config = _restoring(job, ["HIDDEN_DIMS=128"])
    with (Run(config, RunContext(job_dir=str(tmp_path / "b3"))) as run,
          pytest.raises(pretrained.PretrainedCheckpointError) as err):
        run.train()
    message = str(err.value)
    assert "layers_0/mlp/wi/kernel: checkpoint shape (64, 256), model shape (64, 128)" in message
    assert "layers_1/mlp/wo/kernel" in message and "attention" not in message
    assert not (tmp_path / "b3" / "checkpoints").exists() or not any(
        (tmp_path / "b3" / "checkpoints").iterdir())


def test_ignore_rules_match_both_separators():
    assert ignored_by(["^.*lora.*$"], "layers_0/mlp/wi/lora_a")
    assert ignored_by([r"layers_0\.attention\.qkv\..*"], "layers_0/attention/qkv/kernel")
    assert ignored_by(["layers_0/attention/.*"], "layers_0/attention/qkv/kernel")
    assert not ignored_by(["attention"], "layers_0/attention/qkv/kernel")  # re.match, as Pax
    assert not ignored_by([], "layers_0/attention/qkv/kernel")


def test_checkpoint_parameters_the_model_lacks_are_an_error(tmp_path, job_a):
    """A 2-layer checkpoint must not quietly initialise a 1-layer model ("initialised N of N")."""
    job, _ = job_a
    with pytest.raises(pretrained.PretrainedCheckpointError) as err:
        Run(_restoring(job, ["NUM_LAYERS=1"]), RunContext(job_dir=str(tmp_path / "b")))
    message = str(err.value)
    assert "layers_1/mlp/wi/kernel (64, 256)" in message and "CHECKPOINT_IGNORE_RULES" in message
    assert "layers_0/" not in message
    assert not (tmp_path / "b" / "checkpoints").exists() or not any(
        (tmp_path / "b" / "checkpoints").iterdir())


def test_ignore_rules_opt_in_to_a_partial_restore_loudly(tmp_path, job_a, caplog):
    job, params_a = job_a
    config = _restoring(
        job, ["NUM_LAYERS=1", "CHECKPOINT_IGNORE_RULES=['layers_1/.*']", "MAX_STEPS=1"]
    )
    with caplog.at_level("WARNING"), Run(config, RunContext(job_dir=str(tmp_path / "b"))) as run:
        restored = _flat(run.restore_or_init().params)
    assert not any(k.startswith("layers_1/") for k in restored)
    for key, value in restored.items():
        np.testing.assert_array_equal(value, params_a[key], err_msg=key)
    unread = sorted(k for k in params_a if k.startswith("layers_1/"))
    (line,) = [r.getMessage() for r in caplog.records
               if r.levelname == "WARNING" and "not in this model" in r.getMessage()]
    assert f"{len(unread)} parameters" in line and all(k in line for k in unread)


def _half_copy(job, target):
    """A copy of `job`'s checkpoints whose newest step is still being copied (no commit marker)."""
    shutil.copytree(job / "checkpoints" / f"checkpoint_{A_STEPS:08d}",
                    target / "checkpoints" / "checkpoint_00000002")
    newest = target / "checkpoints" / "checkpoint_00000009"
    shutil.copytree(job / "checkpoints" / f"checkpoint_{A_STEPS:08d}", newest)
    (newest / "commit_success.txt").unlink()
    (newest / "_CHECKPOINT_METADATA").unlink()
    (newest / "state" / "manifest.ocdbt").unlink()
    return newest


def test_restore_path_skips_a_half_copied_newest_step(tmp_path, job_a, caplog):
    job, params_a = job_a
    newest = _half_copy(job, tmp_path / "copy")
    with caplog.at_level("WARNING"):
        step, step_dir = pretrained.find_checkpoint(tmp_path / "copy")
    assert (step, step_dir.name) == (2, "checkpoint_00000002")
    (line,) = [r.getMessage() for r in caplog.records if str(newest) in r.getMessage()]
    assert "not a complete checkpoint" in line
    with Run(_restoring(tmp_path / "copy", ["MAX_STEPS=1"]),
             RunContext(job_dir=str(tmp_path / "b"))) as run:
        restored = _flat(run.restore_or_init().params)
    for key, value in params_a.items():
        np.testing.assert_array_equal(restored[key], value, err_msg=key)
    # Pointing at the half-copied step itself, or at a directory holding only it: a clear error.
    with pytest.raises(pretrained.PretrainedCheckpointError, match="not a complete paxlite "
                                                                   "checkpoint"):
        pretrained.find_checkpoint(newest)
    shutil.rmtree(tmp_path / "copy" / "checkpoints" / "checkpoint_00000002")
    with pytest.raises(pretrained.PretrainedCheckpointError, match="no paxlite checkpoint"):
        Run(_restoring(tmp_path / "copy"), RunContext(job_dir=str(tmp_path / "c")))
