"""Settings that nothing would read, and object-store paths, are refused before any device work."""

import os
import subprocess

import fiddle as fdl
import pytest

from paxlite.config.errors import ConfigError
from paxlite.data import prepare
from paxlite.experiments.build import load_experiment
from tests.fork_server import paxlite_python
from tests.xla_test_flags import COMPILE_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("setting", ["LORA_RANK=16", "LORA_ALPHA=2.0", "LORA_TARGET_LAYERS='mlp'",
                                     "LORA_RANDOM_BASE=true"])
def test_lora_settings_without_use_lora_are_refused(setting):
    name = setting.split("=")[0]
    with pytest.raises(
        ConfigError, match=rf"{name} set but USE_LORA is false.*--fdl.USE_LORA=true"
    ):
        load_experiment("TinySynthetic", [setting])


def test_use_lora_needs_a_restore_path_or_an_explicit_random_base(tmp_path):
    with pytest.raises(
        ConfigError, match="CHECKPOINT_RESTORE_PATH is unset.*LORA_RANDOM_BASE=true"
    ):
        load_experiment("TinySynthetic", ["USE_LORA=true"])
    for extra in (["LORA_RANDOM_BASE=true"], [f"CHECKPOINT_RESTORE_PATH={str(tmp_path)!r}"]):
        model = fdl.build(
            load_experiment("TinySynthetic", ["USE_LORA=true", *extra]).run_config()
        ).model
        assert model.lora_rank == 8  # adapters are really added


@pytest.mark.parametrize(
    "settings, message",
    [
        (["LAMBADA_PATH='/x/lambada.jsonl'"], "LAMBADA_PATH is read only with EVAL_TASK='lambada'"),
        (["BOOLQ_PATH='/x/val.jsonl'"], "BOOLQ_PATH is read only with EVAL_TASK='boolq'"),
        (
            ["BOOLQ_TRAIN_PATH='/x/train.jsonl'"],
            "BOOLQ_TRAIN_PATH is read only with TRAIN_TASK='boolq'",
        ),
        (
            ["DATA_DIR='/x'", "TFDS_DATASET='c4/en:3.0.1'"],
            "TFDS_DATASET='c4/en:3.0.1' is read only without",
        ),
        (
            ["CHECKPOINT_IGNORE_RULES=['^x$']"],
            "CHECKPOINT_IGNORE_RULES set but CHECKPOINT_RESTORE_PATH",
        ),
    ],
)
def test_settings_nothing_reads_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_experiment("TinyShakespeare", settings)


@pytest.mark.parametrize("name", ["DATA_DIR", "VOCAB_PATH", "TFDS_DATA_DIR", "LAMBADA_PATH",
                                  "BOOLQ_PATH", "BOOLQ_TRAIN_PATH", "CHECKPOINT_RESTORE_PATH"])
def test_object_store_paths_are_refused_by_setting(name):
    task = {"LAMBADA_PATH": ["EVAL_TASK='lambada'"], "BOOLQ_PATH": ["EVAL_TASK='boolq'"],
            "BOOLQ_TRAIN_PATH": ["TRAIN_TASK='boolq'", "EVAL_TASK='boolq'"]}.get(name, [])
    with pytest.raises(
        ConfigError, match=rf"{name}='gs://bucket/x': gs:// paths are not supported"
    ):
        load_experiment("TinyShakespeare", [f"{name}='gs://bucket/x'", *task])


def test_object_store_path_in_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv("VOCAB_PATH", "s3://bucket/spm.model")
    with pytest.raises(ConfigError, match="the VOCAB_PATH environment "
                                          "variable='s3://bucket/spm.model'"):
        load_experiment("TinyShakespeare", ["DATA_DIR='/x'"])


def test_job_log_dir_url_is_refused_and_nothing_is_written(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    env["XLA_FLAGS"] = COMPILE_FLAGS
    result = subprocess.run(
        [paxlite_python(), "-m", "paxlite.main", "--fdl_config=TinySynthetic",
         "--job_log_dir=gs://bucket/job"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--job_log_dir='gs://bucket/job': gs:// paths are not supported" in result.stderr
    assert os.listdir(tmp_path) == []  # formerly: ./gs:/bucket/job with a config and checkpoints


def test_prepare_refuses_urls(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("a b c\n\nd e f\n")
    assert prepare.main(["--input", str(corpus), "--output_dir", "s3://bucket/data"]) == 2
    assert (
        "--output_dir='s3://bucket/data': s3:// paths are not supported" in capsys.readouterr().err
    )
    assert sorted(os.listdir(tmp_path)) == ["c.txt"]
