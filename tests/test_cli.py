"""The command line as users type it: `python -m paxlite.main ...` and
`python -m paxlite list|show`."""

import json
import os
import pathlib
import subprocess
from typing import NamedTuple

import pytest

from tests.fork_server import paxlite_python
from tests.in_process import paxlite_command, paxlite_main
from tests.xla_test_flags import COMPILE_FLAGS

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
ENV["XLA_FLAGS"] = COMPILE_FLAGS  # one CPU device, as on a plain machine


def _run(*args, timeout=300, cwd=None):
    return subprocess.run(
        [paxlite_python(), *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
        cwd=cwd,
        check=False,
    )


def _main(*flags, cwd=None):
    return _run("-m", "paxlite.main", *flags, cwd=cwd)


@pytest.fixture
def main_in_process(monkeypatch, capfd):
    """`python -m paxlite.main FLAGS...` in this process (tests/in_process.py), for the checks that
    stop before any work. This process has the eight fake devices of conftest.py, not one."""
    with paxlite_main(monkeypatch, capfd) as run:
        yield run


@pytest.fixture
def paxlite_in_process(monkeypatch, capfd):
    """`python -m paxlite COMMAND ...` in this process (tests/in_process.py)."""
    return paxlite_command(monkeypatch, capfd)


_ONE_DEVICE = "needs 64 devices, but this job has 1"  # a plain machine: run as a process of its own


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--fdl_config=TinySynthetic", "--fdl.NUM_LAYRS=4"], "did you mean 'NUM_LAYERS'"),
        (["--fdl_config=TinySynthetic", "--fdl.NUM_LAYERS=abc"], "expected int"),
        (["--fdl_config=TinySynthetic", "--fdl.FPROP_DTYPE=bf16"], "did you mean 'bfloat16'"),
        (["--fdl_config=Synthetic126m"], "did you mean 'Synthetic126M'"),
        (["--fdl_config=Synthetic126M"], _ONE_DEVICE),
        (["--fdl_config=Pile126M", "--fdl.ICI_MESH_SHAPE=[1,1,1]", "--fdl.DCN_MESH_SHAPE=[1,1,1]"],
         "--fdl.SYNTHETIC_DATA=true"),
    ],
)
def test_bad_input_is_one_clear_error(tmp_path, main_in_process, flags, message):
    job = tmp_path / "job"
    run = _main if message == _ONE_DEVICE else main_in_process  # this process has 8 devices
    result = run(*flags, f"--job_log_dir={job}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (job / "checkpoints").exists()  # stopped before any work


def test_fiddle_flags_that_would_be_ignored_are_refused(tmp_path, main_in_process):
    result = main_in_process("--fdl_config=TinySynthetic", "--fiddler=double_layers",
                             f"--job_log_dir={tmp_path}")
    assert result.returncode == 2 and "--fiddler" in result.stderr


def test_missing_job_log_dir(main_in_process):
    result = main_in_process("--fdl_config=TinySynthetic")
    assert result.returncode == 2 and "--job_log_dir is required" in result.stderr


class _TrainedThenEvaluated(NamedTuple):
    job: pathlib.Path
    trained: subprocess.CompletedProcess
    # what the training run wrote, read before the eval run replaces config.json and config.txt
    config_after_training: dict
    tree_after_training: str
    checkpoints_after_training: list[str]
    metrics_after_training: list[dict]
    evaluated: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def trained_then_evaluated(tmp_path_factory) -> _TrainedThenEvaluated:
    """One job trained 6 steps, then evaluated with --fdl.MAX_STEPS=0 --mode=eval: the two tests
    below check that run (trained once, evaluated once) from their own sides."""
    cwd = tmp_path_factory.mktemp("cli")
    job = cwd / "job"
    trained = _main(
        "--fdl_config=paxml.contrib.gpu.scripts_gpu.configs.TinySynthetic",
        "--fdl.MAX_STEPS=6", "--fdl.SUMMARY_INTERVAL_STEPS=3", "--fdl.CHECKPOINT_EVERY_N_STEPS=3",
        '--fdl.FPROP_DTYPE="float32"', "--fdl.USE_REPEATED_LAYER=True", "--fdl.ADAM_BETA1=0",
        "--job_log_dir=job", "--alsologtostderr",  # relative, as users type it
        cwd=cwd,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    config = json.loads((job / "config.json").read_text())
    tree = (job / "config.txt").read_text()
    checkpoints = sorted(os.listdir(job / "checkpoints"))
    metrics = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    # Zero is the value of Pax's evaluation-only configs: --mode=eval runs with it.
    evaluated = _main("--fdl_config=TinySynthetic", "--fdl.USE_REPEATED_LAYER=True",
                      "--fdl.MAX_STEPS=0", "--mode=eval", f"--job_log_dir={job}")
    return _TrainedThenEvaluated(job=job, trained=trained, config_after_training=config,
                                 tree_after_training=tree, checkpoints_after_training=checkpoints,
                                 metrics_after_training=metrics, evaluated=evaluated)


def test_train_then_eval_writes_the_job_directory(trained_then_evaluated):
    job, result = trained_then_evaluated.job, trained_then_evaluated.trained
    assert "step 6/6 | loss" in result.stderr
    config = trained_then_evaluated.config_after_training
    assert config["experiment"] == "TinySynthetic"
    assert config["hparams"]["ADAM_BETA1"] == 0.0  # zero is a value, not "use the default"
    assert config["hparams"]["USE_REPEATED_LAYER"] is True
    assert set(config["overridden"]) >= {"MAX_STEPS", "ADAM_BETA1", "FPROP_DTYPE"}
    assert config["versions"]["jax"] and config["devices"]["count"] == 1
    assert config["global_batch_size"] == 2
    tree = trained_then_evaluated.tree_after_training
    assert "optimizer.beta1: float = 0.0" in tree and "model.scan_layers: bool = True" in tree
    assert trained_then_evaluated.checkpoints_after_training == [
        "checkpoint_00000003", "checkpoint_00000006"]
    lines = trained_then_evaluated.metrics_after_training
    assert [line["step"] for line in lines if "loss" in line] == [3, 6]

    evaluated = trained_then_evaluated.evaluated
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    lines = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 6 and "eval/loss" in lines[-1]
    # The eval run has other hyperparameters: the training run's config is kept, not overwritten.
    assert (job / "config.previous-1.json").exists()


def test_eval_without_checkpoint_is_an_error_before_anything_is_written(tmp_path,
                                                                        main_in_process):
    result = main_in_process("--fdl_config=TinySynthetic", "--mode=eval",
                             f"--job_log_dir={tmp_path / 'job'}")
    assert result.returncode == 2 and "needs a checkpoint" in result.stderr
    assert "Traceback" not in result.stderr
    # no config.json, metrics.jsonl or compile cache left behind
    assert not (tmp_path / "job").exists()


@pytest.mark.parametrize("flag, message", [
    ("--exp=Pile126M", "paxlite: error: Unknown command line flag 'exp'"),
    ("--fdl.MAX_STEPS", "paxlite: error: --fdl.MAX_STEPS: a setting looks like --fdl.NAME=VALUE"),
])
def test_an_unknown_or_malformed_flag_is_one_line_and_exit_2(tmp_path, main_in_process, flag,
                                                             message):
    # absl's "Did you mean" names near flags of every module imported so far (orbax's, after other
    # tests here): the unknown flag is checked in a fresh process, as users meet it.
    run = _main if flag.startswith("--exp=") else main_in_process
    result = run("--fdl_config=TinySynthetic", flag, f"--job_log_dir={tmp_path / 'job'}")
    assert result.returncode == 2 and result.stderr.strip() == message


def test_listing_into_a_reader_that_stops_early_is_quiet():
    out = subprocess.run(["bash", "-c", (f"set -o pipefail; {paxlite_python()} -m paxlite list "
                                         "| head "
                                        "-n 1")],
                         capture_output=True, text=True, env=ENV, timeout=120, check=False)
    assert out.returncode == 0 and out.stdout.startswith("experiment") and out.stderr == "", (
        out.stderr
    )


@pytest.mark.parametrize("mode", ["train", "dry_run"])
def test_max_steps_zero_trains_nothing_so_it_is_refused_before_any_work(tmp_path, main_in_process,
                                                                        mode):
    job = tmp_path / "job"
    run = _main if mode == "dry_run" else main_in_process  # the dry run compiles: its own process
    result = run("--fdl_config=TinySynthetic", "--fdl.MAX_STEPS=0", f"--mode={mode}",
                 f"--job_log_dir={job}")
    if mode == "dry_run":  # the planner compiles the step for its shapes; MAX_STEPS plays no part
        assert result.returncode == 0, result.stderr[-3000:]
        return
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        ("paxlite: error: --fdl.MAX_STEPS=0 with --mode=train trains nothing; pass "
         "--fdl.MAX_STEPS=N (N >= 1) to train, or --mode=eval to evaluate the job's latest "
         "checkpoint (or CHECKPOINT_RESTORE_PATH)")]
    assert not job.exists()  # no checkpoint read, nothing compiled, no job directory made


def test_max_steps_zero_with_mode_eval_evaluates(trained_then_evaluated):
    """Zero is the value of Pax's evaluation-only configs: --mode=eval runs with it (on the job
    of test_train_then_eval_writes_the_job_directory, trained 6 steps)."""
    job, evaluated = trained_then_evaluated.job, trained_then_evaluated.evaluated
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    lines = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 6 and "eval/loss" in lines[-1]


_BROKEN_MODEL = """
import sys
from paxlite.models import transformer

def broken(self, *args, **kwargs):
    raise ValueError("an internal bug while tracing the model")

transformer.Transformer.__call__ = broken
sys.argv = ["paxlite.main", *sys.argv[1:]]
from paxlite.main import run_main
run_main()
"""


def test_a_bug_while_tracing_keeps_its_traceback(tmp_path):
    """A ValueError inside paxlite is not a user's mistake: it is not turned into one line."""
    result = _run("-c", _BROKEN_MODEL, "--fdl_config=TinySynthetic", "--fdl.MAX_STEPS=2",
                  f"--job_log_dir={tmp_path / 'job'}")
    assert result.returncode == 1, result.stderr[-3000:]
    assert (
        "Traceback" in result.stderr and "an internal bug while tracing the model" in result.stderr
    )
    assert "paxlite: error:" not in result.stderr


def test_list_prints_every_experiment_with_its_size(paxlite_in_process):
    result = paxlite_in_process("list")
    assert result.returncode == 0, result.stderr
    assert "125,262,336" in result.stdout and "174,604,259,328" in result.stdout
    for name in ("Synthetic126M", "Pile5B", "GPT175B", "Lambada126M", "TinySynthetic"):
        assert name in result.stdout


def test_list_and_show_trace_no_model(paxlite_in_process, monkeypatch):
    """Counts come from the configs in closed form: a model traced by `list` (dozens of them) or
    `show` would cost seconds each. Any trace of a Transformer calls its __call__."""
    from paxlite.models.transformer import Transformer

    traced = []

    def refuse(self, *args, **kwargs):
        traced.append(self.config)
        raise AssertionError("`list`/`show` traced a model")

    monkeypatch.setattr(Transformer, "__call__", refuse)
    for command in (
        ("list",),
        ("show", "--fdl_config=LLaMA70B"),
        ("show", "--fdl_config=GLaM64B64E"),
    ):
        result = paxlite_in_process(*command)
        assert result.returncode == 0 and not traced, (command, result.stderr[-2000:])


def test_show_json(paxlite_in_process):
    result = paxlite_in_process("show", "--fdl_config=Synthetic126M", "--fdl.LR_COS_WARMUP=500",
                                "--fdl.ICI_MESH_SHAPE=[1,8,1]", "--fdl.DCN_MESH_SHAPE=[1,2,1]",
                                "--format=json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["experiment"] == "Synthetic126M"
    assert info["num_params"] == 125_262_336
    assert info["flops_per_token"] == 854_654_976
    assert info["mesh"] == {
        "pipeline": 1,
        "data": 1,
        "fsdp": 16,
        "seq": 1,
        "tensor": 1,
        "expert": 1,
    }
    assert info["global_batch_size"] == 4 * 16
    assert info["hparams"]["LR_COS_DECAY_START"] == 501
    assert len(info["hparams"]) > 40


def test_show_rejects_unknown_override(paxlite_in_process):
    result = paxlite_in_process("show", "--fdl_config=GPT5B", "--fdl.LEARNING_RAT=1")
    assert result.returncode == 2 and "LEARNING_RATE" in result.stderr


def test_use_fp8_is_pax_s_switch_and_dropless_fp8_exits_2(paxlite_in_process):
    result = paxlite_in_process(
        "show", "--fdl_config=Pile126M", "--fdl.USE_FP8=True", "--format=json"
    )
    assert result.returncode == 0, result.stderr
    hparams = json.loads(result.stdout)["hparams"]
    assert hparams["USE_FP8"] is True and hparams["FP8_AMAX_HISTORY_LENGTH"] == 1024
    result = paxlite_in_process("show", "--fdl_config=Mixtral8x7B", "--fdl.USE_FP8=true")
    assert result.returncode == 2
    assert "USE_FP8=true with MOE_ROUTING='dropless_topk'" in result.stderr


@pytest.mark.parametrize("command, message", [
    (("list", "--fdl.NUM_LAYERS=2"), "list takes no --fdl.NAME=VALUE overrides"),
    (("plot", "job", "--fdl.NUM_LAYERS=2"), "unrecognized arguments ['--fdl.NUM_LAYERS=2']"),
    (("show", "--fdl_config=TinySynthetic", "--num_layers=2"),
     "unrecognized argument '--num_layers=2'; overrides look like --fdl.NAME=VALUE"),
])
def test_an_argument_a_command_does_not_take_is_a_usage_error(paxlite_in_process, command,
                                                               message):
    result = paxlite_in_process(*command)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == f"python -m paxlite: error: {message}"


def test_every_command_is_a_module_of_cli():
    """`python -m paxlite COMMAND` runs paxlite/cli/'s module of that command, in `--help`'s
    order."""
    from paxlite.cli.app import COMMANDS

    assert [command.name for command in COMMANDS] == [
        "list", "show", "plan", "plot", "convert", "export_merged", "generate", "lm_eval"]
    for command in COMMANDS:
        assert command.module.__name__.startswith("paxlite.cli.")
        assert callable(command.module.add_arguments) and callable(command.module.run)
