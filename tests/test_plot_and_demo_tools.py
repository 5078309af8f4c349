import json
import math
from collections import Counter

import pytest

from paxlite.data.prepare import prepare
from paxlite.data.tokenizer import Tokenizer
from paxlite.data.train_tokenizer import train_tokenizer
from paxlite.demo import unigram_entropy
from paxlite.train.plot import plot_losses, read_metrics


def _write_metrics(job, records):
    job.mkdir(exist_ok=True)
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_plot_writes_a_png_and_a_resumed_step_keeps_its_last_value(tmp_path):
    job = tmp_path / "job"
    _write_metrics(job, [
        {"step": 10, "loss": 5.0}, {"step": 20, "loss": 4.0}, {"step": 20, "eval/loss": 4.2},
        {"step": 20, "loss": 3.9},  # the same step again after a resume
        {"step": 30, "loss": 3.0}, {"step": 30, "eval/loss": 3.4},
    ])
    train, evals = read_metrics(str(job))
    assert [(r["step"], r["loss"]) for r in train] == [(10, 5.0), (20, 3.9), (30, 3.0)]
    assert [(r["step"], r["eval/loss"]) for r in evals] == [(20, 4.2), (30, 3.4)]
    png = plot_losses(str(job))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_losses(str(tmp_path))
    _write_metrics(tmp_path / "empty", [])
    with pytest.raises(ValueError, match="no train or eval lines"):
        plot_losses(str(tmp_path / "empty"))


def test_unigram_entropy_matches_a_hand_count(tmp_path):
    docs = [
        "to be or not to be",
        "that is the question",
        "the rest is silence",
        "be all and end all",
    ] * 5
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(docs) + "\n")
    vocab = train_tokenizer([str(corpus)], str(tmp_path / "spm"), vocab_size=280)
    prepare(
        [str(corpus)],
        str(tmp_path / "data"),
        vocab_path=vocab,
        validation_fraction=0.0,
        num_shards=2,
    )
    tokenizer = Tokenizer(vocab)
    counts = Counter(token for doc in docs for token in tokenizer.encode(doc))
    total = sum(counts.values())
    expected = -sum(c / total * math.log(c / total) for c in counts.values())
    assert unigram_entropy(str(tmp_path / "data")) == pytest.approx(expected, rel=1e-12)
