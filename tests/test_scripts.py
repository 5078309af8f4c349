"""scripts_gpu/run_*.sh with Pax's positional arguments, run for real on a tiny model and dataset (CPU)."""

import json
import os
import random
import subprocess
import sys

import pytest

from paxlite.data.prepare import prepare
from paxlite.data.train_tokenizer import train_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--fdl.NUM_LAYERS=1", "--fdl.MODEL_DIMS=32", "--fdl.NUM_HEADS=4", "--fdl.DIMS_PER_HEAD=8",
        "--fdl.HIDDEN_DIMS=64", "--fdl.VOCAB_SIZE=512", "--fdl.MAX_SEQ_LEN=32"]


def _env():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PATH": os.path.dirname(sys.executable) + ":" + os.environ["PATH"]}
    env.pop("XLA_FLAGS", None)
    return env


def _script(name, *args):
    return subprocess.run(["bash", os.path.join(ROOT, "scripts_gpu", name), *args], capture_output=True,
                          text=True, env=_env(), timeout=600)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    rng = random.Random(0)
    words = "a king rode out to the sea and the queen sang of rain and gold".split()
    (root / "c.txt").write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(30)) for _ in range(80)))
    vocab = train_tokenizer([str(root / "c.txt")], str(root / "spm"), vocab_size=280)
    prepare([str(root / "c.txt")], str(root / "data"), vocab_path=vocab, validation_fraction=0.05)
    (root / "lambada").mkdir()
    (root / "lambada" / "lambada_test.jsonl").write_text(
        "".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(12))}) + "\n" for _ in range(5)))
    return root, vocab


def test_pile_then_lambada_singlenode(tmp_path, assets):
    root, vocab = assets
    log_dir = tmp_path / "logs"
    trained = _script("run_pile_singlenode.sh", str(root / "data"), vocab, "float32", "1", "2", str(log_dir),
                      *TINY, "--fdl.MAX_STEPS=2", "--fdl.CHECKPOINT_EVERY_N_STEPS=2")
    assert trained.returncode == 0, trained.stdout[-3000:]
    assert "Run succeeded!" in trained.stdout
    assert (log_dir / "pile_output.log").exists()
    config = json.loads((log_dir / "config.json").read_text())
    assert config["experiment"] == "Pile126M" and config["hparams"]["PERCORE_BATCH_SIZE"] == 2.0
    assert config["hparams"]["ICI_MESH_SHAPE"] == [1, 1, 1]

    evaluated = _script("run_lambada_singlenode.sh", str(root / "lambada"), vocab, "float32", "1", "2",
                        str(log_dir), *TINY)
    assert evaluated.returncode == 0, evaluated.stdout[-3000:]
    lines = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 2 and "eval/lambada_acc_strict" in lines[-1]


def test_failure_is_reported(tmp_path, assets):
    _, vocab = assets
    result = _script("run_pile_singlenode.sh", str(tmp_path / "no_data"), vocab, "float32", "1", "2",
                     str(tmp_path / "logs"), *TINY)
    assert result.returncode == 2
    assert "Run failed" in result.stdout and "no_data" in result.stdout


def test_pile_and_lambada_from_a_pax_tfds_data_dir(tmp_path, assets):
    """Pax's layout: one TFDS_DATA_DIR made by the download scripts, passed as the first argument to both."""
    from paxlite.data import tfds_datasets

    root, vocab = assets
    pile = tmp_path / "pile"
    (pile / "train").mkdir(parents=True)
    texts = (root / "c.txt").read_text().split("\n\n")
    (pile / "train" / "00.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:70]))
    (pile / "val.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[70:]))
    tfds_dir = str(tmp_path / "tfds")
    tfds_datasets.build(tfds_datasets.THE_PILE, data_dir=tfds_dir, local_dir=str(pile))
    tfds_datasets.build(tfds_datasets.LAMBADA, data_dir=tfds_dir,
                        local_file=str(root / "lambada" / "lambada_test.jsonl"))
    log_dir = tmp_path / "logs"
    trained = _script("run_pile_singlenode.sh", tfds_dir, vocab, "float32", "1", "2", str(log_dir),
                      *TINY, "--fdl.MAX_STEPS=2", "--fdl.CHECKPOINT_EVERY_N_STEPS=2")
    assert trained.returncode == 0, trained.stdout[-3000:]
    config = json.loads((log_dir / "config.json").read_text())
    assert config["hparams"]["TFDS_DATA_DIR"] == tfds_dir and config["hparams"]["DATA_DIR"] is None
    assert "data.tfds_name: str | None = 'the_pile:1.0.0'" in (log_dir / "config.txt").read_text()
    evaluated = _script("run_lambada_singlenode.sh", tfds_dir, vocab, "float32", "1", "2", str(log_dir), *TINY)
    assert evaluated.returncode == 0, evaluated.stdout[-3000:]
    lines = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 2 and "eval/lambada_acc_strict" in lines[-1]
