"""The `prepare` and `train_tokenizer` command-line tools, run as a user would (subprocesses)."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from array_record.python import array_record_module

from paxlite.data.records import MANIFEST, read_info, shard_paths
from paxlite.data.tokenizer import Tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run(
        [sys.executable, "-m", f"paxlite.data.{module}", *map(str, args)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )


def corpus(root) -> list[str]:
    docs = [
        f"Document {i} says {'hello world ' * (i % 5 + 1)}and counts {i * 37}." for i in range(120)
    ]
    (root / "part1.txt").write_text("\n\n".join(docs[:60]) + "\n")
    (root / "part2.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[60:]))
    return docs


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("cli_tok")
    corpus(root)
    result = run("train_tokenizer", "--input", root, "--output", root / "spm", "--vocab_size",
                 "300", "--max_sentences", "100", "--seed", "3")
    assert result.returncode == 0, result.stderr
    assert "vocab_size 300" in result.stdout and "100 sentences" in result.stdout
    return str(root / "spm.model")


def test_train_tokenizer_cli_makes_a_loadable_model_and_refuses_to_overwrite(model):
    tok = Tokenizer(model)
    assert (tok.vocab_size, tok.pad_id, tok.eos_id, tok.bos_id) == (300, 0, 1, None)
    assert tok.decode(tok.encode("Document 7 says hello")) == "Document 7 says hello"
    assert os.path.isfile(model[: -len(".model")] + ".vocab")
    before = pathlib.Path(model).read_bytes()
    again = run("train_tokenizer", "--input", os.path.dirname(model), "--output",
                model[: -len(".model")], "--vocab_size", "280")
    assert again.returncode == 2
    assert again.stderr.startswith("train_tokenizer: error:") and "--overwrite" in again.stderr
    assert pathlib.Path(model).read_bytes() == before


def test_prepare_tokens_success(tmp_path, model):
    docs = corpus(tmp_path)
    out = tmp_path / "ds"
    result = run("prepare", "--input", tmp_path / "part1.txt", tmp_path / "part2.jsonl",
                 "--output_dir", out, "--vocab_path", model, "--num_shards", "3",
                 "--validation_fraction", "0.1", "--seed", "4")
    assert result.returncode == 0, result.stderr
    info = read_info(out)
    assert info.kind == "tokens"
    assert (info.splits["train"].documents, info.splits["validation"].documents) == (108, 12)
    assert info.sources == (str(tmp_path / "part1.txt"), str(tmp_path / "part2.jsonl"))
    # The summary names the directory and each split's counts.
    assert str(out) in result.stdout
    lines = result.stdout.splitlines()
    train_line = next(line for line in lines if line.strip().startswith("train"))
    assert "108" in train_line and f"{info.splits['train'].tokens:,}" in train_line
    assert "validation" in result.stdout and "total bytes" in result.stdout
    tok = Tokenizer(model)
    records = []
    for split in info.splits:
        for path in shard_paths(info, split):
            reader = array_record_module.ArrayRecordReader(path)
            records += reader.read_all()
            reader.close()
    assert sorted(records) == sorted(
        np.asarray(tok.encode(d), "<i4").tobytes() for d in docs
    )


def test_prepare_text_default_shards(tmp_path):
    corpus(tmp_path)
    result = run("prepare", "--input", tmp_path, "--output_dir", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    info = read_info(tmp_path / "out")
    assert info.kind == "text" and info.tokenizer is None
    assert len(info.splits["train"].shards) == 1  # tiny input: one shard per 64 MiB -> 1
    assert info.splits["train"].documents + info.splits["validation"].documents == 120
    assert info.splits["validation"].documents == 1  # round(0.01 * 120) = 1


@pytest.mark.parametrize("case", ["empty_input", "non_empty_output", "missing_input", "bad_vocab"])
def test_prepare_user_errors_exit_2_with_one_line(tmp_path, case):
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    (tmp_path / "good.txt").write_text("some text\n")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "keep.txt").write_text("keep me")
    args = {
        "empty_input": ["--input", tmp_path / "empty.txt", "--output_dir", tmp_path / "o"],
        "non_empty_output": ["--input", tmp_path / "good.txt", "--output_dir", tmp_path / "used"],
        "missing_input": ["--input", tmp_path / "nope.jsonl", "--output_dir", tmp_path / "o"],
        "bad_vocab": ["--input", tmp_path / "good.txt", "--output_dir", tmp_path / "o",
                      "--vocab_path", tmp_path / "nope.model"],
    }[case]
    expected = {
        "empty_input": "no documents", "non_empty_output": "not empty",
        "missing_input": "nope.jsonl does not exist", "bad_vocab": "nope.model",
    }[case]
    result = run("prepare", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prepare: error:") and expected in lines[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "o").exists()
    assert os.listdir(tmp_path / "used") == ["keep.txt"]
    assert MANIFEST not in os.listdir(tmp_path / "used")


@pytest.mark.parametrize("documents, fraction, why", [
    (3, "0", "--validation_fraction is 0"), (1, "0.01", "the corpus has a single document")])
def test_prepare_warns_when_it_writes_no_validation_split(
    tmp_path, capsys, documents, fraction, why
):
    from paxlite.data import prepare

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"document number {i}" for i in range(documents)) + "\n")
    assert prepare.main(["--input", str(corpus), "--output_dir", str(tmp_path / "out"),
                         "--validation_fraction", fraction]) == 0
    err = capsys.readouterr().err
    assert f"prepare: warning: no validation split written ({why})" in err
    assert "runs without evaluation" in err
    assert set(read_info(tmp_path / "out").splits) == {"train"}
