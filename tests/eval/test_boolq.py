"""BoolQ: the reader, Pax's prompt in unpacked answer-only batches, the pairwise score and
boolq_acc, and `python -m paxlite.main --mode=eval --fdl.EVAL_TASK=boolq` end to end (JSONL and
TFDS)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import jax
import numpy as np
import pytest
import sentencepiece as spm

from paxlite.config.errors import ConfigError
from paxlite.data.boolq import BATCH_KEYS, BoolQExample, boolq_batches, read_boolq, yes_no_token_ids
from paxlite.data.seqio_tasks import boolq_prompt
from paxlite.data.tokenizer import Tokenizer
from paxlite.eval.boolq import boolq_acc
from paxlite.experiments.build import build_run_config
from paxlite.models.transformer import Transformer
from paxlite.train.loop import Run, RunContext
from paxlite.train.losses import choice_correct
from tests.in_process import paxlite_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_LLAMA = "paxlite.experiments.tiny.TinyLLaMA"
_WORDS = (
    "the river ran past a town where old men sang of rain is it true does sun rise every day "
    "can fish swim under ice"
).split()


def _train_spm(prefix: str, *, single_yes_no: bool) -> str:
    """A real BPE model (pad 0 / eos 1 / unk 2, no BOS); '▁yes' and '▁no' are pieces only if
    asked."""
    rng = random.Random(0)
    # Without the answer words in the text BPE learns no piece for them, and 'yes' falls apart.
    ending = "?\nanswer: yes no" if single_yes_no else "?\nanswer:"
    lines = [" ".join(rng.choice(_WORDS) for _ in range(12)) + ending for _ in range(300)]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=prefix, model_type="bpe", vocab_size=150,
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, num_threads=1, minloglevel=2,
        user_defined_symbols=["\u2581yes", "\u2581no"] if single_yes_no else [],
    )
    return prefix + ".model"


@pytest.fixture(scope="module")
def vocab(tmp_path_factory) -> str:
    return _train_spm(str(tmp_path_factory.mktemp("spm") / "boolq"), single_yes_no=True)


@pytest.fixture(scope="module")
def tok(vocab) -> Tokenizer:
    return Tokenizer(vocab)


def _examples(n: int, *, seed: int = 0) -> list[BoolQExample]:
    rng = random.Random(seed)
    return [
        BoolQExample(passage=" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 25))),
                     question=" ".join(rng.choice(_WORDS) for _ in range(4)), label=bool(i % 3))
        for i in range(n)
    ]


def _write_jsonl(path, examples: list[BoolQExample]) -> str:
    rows = [{"question": e.question, "passage": e.passage, "idx": i, "label": e.label}
            for i, e in enumerate(examples)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------- the score


def _numpy_choice_correct(logits, targets, weights, yn) -> np.ndarray:
    """Pax's formula position by position in float64: s = yes + no; won iff l[label] - l[s -
    label] > 0."""
    out = np.zeros(targets.shape[0])
    for b in range(targets.shape[0]):
        s = int(yn[b].sum())
        for t in range(targets.shape[1]):
            if weights[b, t] == 0:
                continue
            label = int(targets[b, t])
            diff = np.float64(logits[b, t, label]) - np.float64(logits[b, t, s - label])
            out[b] += weights[b, t] * float(diff > 0)
    return out


def test_choice_correct_hand_cases_and_numpy_reference() -> None:
    yes, no, vocab = 3, 5, 8
    targets = np.zeros((5, 4), np.int32)  # off-target tokens 0: s - 0 = 8 is out of range (clipped)
    weights = np.zeros((5, 4), np.float32)
    logits = np.random.default_rng(0).normal(size=(5, 4, vocab)).astype(np.float32)
    cases = [  # (row, label, logit[yes], logit[no], an unrelated token's logit)
        (0, yes, 2.0, 1.0, 0.0),  # yes beats no: won
        (1, no, 1.5, 1.5, 0.0),  # tie: lost
        (2, yes, 1.0, 0.5, 9.0),  # yes beats no although token 7 is the argmax: won (pairwise)
        (3, no, 3.0, 2.0, 0.0),  # label no, yes higher: lost
    ]
    for row, label, l_yes, l_no, l_other in cases:
        targets[row, 2] = label
        weights[row, 2] = 1.0
        logits[row, 2, [yes, no, 7]] = (l_yes, l_no, l_other)
    # row 4: a padding row, nothing weighted, even where the target token would win
    targets[4, 2] = yes
    logits[4, 2, yes] = 10.0
    yn = np.tile([yes, no], (5, 1)).astype(np.int32)
    batch = {"targets": targets, "weights": weights, "yn_tokens": yn}
    got = np.asarray(jax.jit(choice_correct)(logits, batch))
    np.testing.assert_array_equal(got, [1.0, 0.0, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(got, _numpy_choice_correct(logits, targets, weights, yn))
    example_weights = np.array([1, 1, 1, 1, 0], np.float32)
    assert boolq_acc(choice_correct=got, example_weights=example_weights) == 0.5


def test_choice_correct_random_against_numpy() -> None:
    rng = np.random.default_rng(1)
    b, t, v = 6, 7, 11
    logits = rng.normal(size=(b, t, v)).astype(np.float32)
    yn = np.tile([4, 9], (b, 1)).astype(np.int32)
    targets = rng.integers(0, v, size=(b, t)).astype(np.int32)
    weights = np.zeros((b, t), np.float32)
    for row in range(b):  # one or two answer positions per row, with weights 1 and 0.5
        for col, w in zip(rng.choice(t, size=1 + row % 2, replace=False), (1.0, 0.5)):
            targets[row, col] = rng.choice([4, 9])
            weights[row, col] = w
    batch = {"targets": targets, "weights": weights, "yn_tokens": yn}
    got = np.asarray(jax.jit(choice_correct)(logits, batch))
    want = _numpy_choice_correct(logits, targets, weights, yn)
    np.testing.assert_array_equal(got, want)
    assert 0 < want.sum() < weights.sum()  # neither all won nor all lost


def test_boolq_acc_errors() -> None:
    with pytest.raises(ValueError, match="at least one real example"):
        boolq_acc(choice_correct=np.zeros(2), example_weights=np.zeros(2))
    with pytest.raises(ValueError, match="1-D arrays of one shape"):
        boolq_acc(choice_correct=np.zeros(3), example_weights=np.ones(2))


def test_yes_and_no_must_be_single_tokens(tmp_path, tok) -> None:
    assert [tok.id_to_piece(i) for i in yes_no_token_ids(tok)] == ["\u2581yes", "\u2581no"]
    split = Tokenizer(_train_spm(str(tmp_path / "split"), single_yes_no=False))
    pieces = [split.id_to_piece(i) for i in split.encode("yes")]
    assert len(pieces) > 1
    with pytest.raises(ValueError, match=r"'yes' to be one token.*" + r".*".join(map(str, pieces))):
        yes_no_token_ids(split)
    with pytest.raises(ValueError, match="'yes' to be one token"):
        next(boolq_batches(_examples(1), split, seq_len=16, batch_size=1))


# ---------------------------------------------------------------- reading and batching


def test_read_boolq_superglue_and_tfds_labels(tmp_path) -> None:
    path = tmp_path / "val.jsonl"
    path.write_text("\n".join([
        json.dumps({"question": "is it so", "passage": "It is.", "idx": 0, "label": True}),
        "",
        json.dumps({"question": "q", "passage": "p", "idx": 1, "label": 0}),
    ]) + "\n")
    assert read_boolq(str(path)) == [
        BoolQExample(passage="It is.", question="is it so", label=True),
        BoolQExample(passage="p", question="q", label=False),
    ]


@pytest.mark.parametrize("line, match", [
    ('{"passage": "p", "question": "q"}', r"bad\.jsonl:1: .*missing \['label'\]"),
    ('{"passage": "p", "question": "q", "label": -1}', r"bad\.jsonl:1: .*cannot be scored"),
    ('{"passage": 3, "question": "q", "label": true}', r"bad\.jsonl:1: .*must be strings"),
    ("{nope", r"bad\.jsonl:1: bad BoolQ line"),
])
def test_read_boolq_errors(tmp_path, line: str, match: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=match):
        read_boolq(str(path))


def test_read_boolq_missing_file(tmp_path) -> None:
    with pytest.raises(ValueError, match="nope.jsonl.*does not exist"):
        read_boolq(str(tmp_path / "nope.jsonl"))


def test_batch_rows_hold_pax_prompt_and_answer_only_weights(tok) -> None:
    examples = _examples(5)
    yes, no = yes_no_token_ids(tok)
    batches = list(boolq_batches(examples, tok, seq_len=48, batch_size=2))
    assert len(batches) == 3 and all(set(b) == set(BATCH_KEYS) for b in batches)
    rows = {key: np.concatenate([b[key] for b in batches]) for key in BATCH_KEYS}
    np.testing.assert_array_equal(rows["example_weights"], [1, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(rows["yn_tokens"], np.tile([yes, no], (6, 1)))
    for i, example in enumerate(examples):  # in order, each once
        inputs, answer = boolq_prompt(passage=example.passage, question=example.question,
                                      label=int(example.label))
        prompt = tok.encode(inputs)
        assert len(prompt) < 47  # fits: no truncation here
        expected = prompt + [yes if answer == "yes" else no]
        n = len(expected)
        np.testing.assert_array_equal(rows["targets"][i], expected + [0] * (48 - n))
        np.testing.assert_array_equal(rows["inputs"][i], [0] + expected[:-1] + [0] * (48 - n))
        np.testing.assert_array_equal(rows["weights"][i], [0] * (n - 1) + [1] + [0] * (48 - n))
        np.testing.assert_array_equal(rows["segment_ids"][i], [1] * n + [0] * (48 - n))
        np.testing.assert_array_equal(rows["positions"][i], np.arange(48))
    for key in ("inputs", "targets", "weights", "segment_ids", "positions"):
        assert not np.any(rows[key][5]), f"the padding row of {key} must be all zero"


def test_long_prompt_keeps_its_end(tok) -> None:
    example = BoolQExample(passage=" ".join(_WORDS * 3), question="does it rain", label=False)
    prompt = tok.encode(
        boolq_prompt(passage=example.passage, question=example.question, label=0)[0]
    )
    assert len(prompt) > 15
    (batch,) = list(boolq_batches([example], tok, seq_len=16, batch_size=1))
    np.testing.assert_array_equal(batch["targets"][0], prompt[-15:] + [yes_no_token_ids(tok)[1]])
    assert tok.decode(prompt[-15:]).endswith("answer:")  # the question and its cue survive
    np.testing.assert_array_equal(batch["weights"][0], [0.0] * 15 + [1.0])


def test_batches_bad_arguments(tok) -> None:
    with pytest.raises(ValueError, match="seq_len >= 2"):
        next(boolq_batches(_examples(1), tok, seq_len=1, batch_size=1))
    with pytest.raises(ValueError, match="no BoolQ examples"):
        next(boolq_batches([], tok, seq_len=8, batch_size=1))


# ---------------------------------------------------------------- end to end


def _reference_acc(params, run_config, examples, tok) -> tuple[float, float]:
    """boolq_acc from Transformer.apply's logits on the same rows, scored in float64 NumPy; and the
    smallest |logit[yes] - logit[no]| (a near-tie could flip between differently compiled
    forwards)."""
    model = Transformer(run_config.model)
    forward = jax.jit(lambda p, b: model.apply({"params": p}, b["inputs"], positions=b["positions"],
                                               segment_ids=b["segment_ids"]))
    yes, no = yes_no_token_ids(tok)
    won, real, margins = 0.0, 0.0, []
    for batch in boolq_batches(examples, tok, seq_len=run_config.model.max_seq_len, batch_size=16):
        logits = np.asarray(forward(params, batch), np.float64)
        won += _numpy_choice_correct(logits, batch["targets"], batch["weights"],
                                     batch["yn_tokens"]).sum()
        real += batch["example_weights"].sum()
        rows, cols = np.nonzero(batch["weights"])
        margins.extend(np.abs(logits[rows, cols, yes] - logits[rows, cols, no]).tolist())
    return won / real, min(margins)


def _eval_lines(job_dir) -> list[dict]:
    with open(os.path.join(job_dir, "metrics.jsonl")) as f:
        return [line for line in map(json.loads, f) if "eval/boolq_acc" in line]


def test_end_to_end_eval_matches_an_independent_computation(tmp_path, vocab, tok, monkeypatch,
                                                            capfd) -> None:
    examples = _examples(20, seed=3)
    val = _write_jsonl(tmp_path / "val.jsonl", examples)
    job = tmp_path / "job"
    # Train two steps on synthetic tokens; an explicit EVAL_TASK=boolq scores BoolQ at the last
    # step.
    overrides = [
        "SYNTHETIC_DATA=true",
        "EVAL_TASK='boolq'",
        f"BOOLQ_PATH={val!r}",
        f"VOCAB_PATH={vocab!r}",
        "MAX_STEPS=2",
    ]
    _, config = build_run_config(TINY_LLAMA, overrides)
    with Run(config, RunContext(job_dir=str(job), async_checkpointing=False)) as run:
        assert run.global_batch_size == 16  # 20 examples: a full batch and one with 12 padding rows
        params = jax.device_get(run.train().params)
    want, margin = _reference_acc(params, config, examples, tok)
    assert margin > 1e-4 and 0.0 < want < 1.0
    (during_training,) = _eval_lines(job)
    assert during_training["step"] == 2
    assert during_training["eval/boolq_acc"] == pytest.approx(want, abs=1e-12)

    # --mode=eval from the command line, on the same checkpoint: once from the JSONL file ...
    # The command line runs in this process (tests/in_process.py), on the eight devices the
    # checkpoint was written on: its eval step is the training run's program, read back from the
    # session's compile cache, where a process of its own would start JAX and compile it again.
    for name in ("TFDS_DATA_DIR", "VOCAB_PATH"):  # the flags alone name the data and vocabulary
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(ROOT)
    flags = [
        f"--fdl_config={TINY_LLAMA}",
        "--mode=eval",
        f"--job_log_dir={job}",
        "--fdl.EVAL_TASK=boolq",
        f"--fdl.VOCAB_PATH={vocab}",
    ]
    with paxlite_main(monkeypatch, capfd) as main:
        result = main(*flags, f"--fdl.BOOLQ_PATH={val}")
    assert result.returncode == 0, result.stderr[-3000:]
    # ... and once from TFDS super_glue/boolq:1.0.2 written by the download script (ArrayRecord).
    raw = tmp_path / "BoolQ"
    raw.mkdir()
    _write_jsonl(raw / "train.jsonl", _examples(3, seed=9))
    _write_jsonl(raw / "val.jsonl", examples)
    tfds_dir = tmp_path / "tfds"
    made = subprocess.run([sys.executable, os.path.join(ROOT, "scripts_gpu", "download_boolq.py"),
                           f"--data_dir={tfds_dir}", f"--local_dir={raw}"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT}, check=False)
    assert made.returncode == 0, made.stderr[-3000:]
    with paxlite_main(monkeypatch, capfd) as main:
        result = main(*flags, f"--tfds_data_dir={tfds_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = _eval_lines(job)
    assert [line["step"] for line in lines] == [2, 2, 2]
    for line in lines:
        assert line["eval/boolq_acc"] == pytest.approx(want, abs=1e-12)
        assert "eval/boolq_acc_strict" not in line and "eval/log_pplx" in line


def test_missing_boolq_data_or_vocab_names_what_to_pass(monkeypatch, vocab) -> None:
    monkeypatch.delenv("TFDS_DATA_DIR", raising=False)
    monkeypatch.delenv("VOCAB_PATH", raising=False)
    with pytest.raises(
        ConfigError, match=r"--fdl.BOOLQ_PATH=.*download_boolq.py.*--fdl.VOCAB_PATH"
    ):
        build_run_config(TINY_LLAMA, [])
    with pytest.raises(ConfigError, match=r"VOCAB_PATH=None"):
        build_run_config(TINY_LLAMA, ["BOOLQ_PATH='val.jsonl'"])
    # SYNTHETIC_DATA=true asks for no data files: evaluation falls back to synthetic batches
    _, config = build_run_config(TINY_LLAMA, ["SYNTHETIC_DATA=true"])
    assert config.eval_task is None and config.loop.eval_num_batches == 10
    _, config = build_run_config(TINY_LLAMA, [f"VOCAB_PATH={vocab!r}", "BOOLQ_PATH='val.jsonl'"])
    assert config.eval_task.path == "val.jsonl" and config.loop.eval_num_batches == -1


# ---------------------------------------------------------------- BoolQ as training data
# (TRAIN_TASK=boolq)


def _train_feed(path: str, vocab: str, *, rows: slice, global_batch: int, seed: int = 7):
    from paxlite.data.feed import BoolQTrainConfig, BoolQTrainFeed
    from paxlite.data.feeding import FeedPlan

    plan = FeedPlan(feed_index=0, num_feeds=1, row_start=rows.start, row_stop=rows.stop,
                    global_batch_size=global_batch)
    return BoolQTrainFeed(
        BoolQTrainConfig(vocab_path=vocab, seq_len=64, seed=seed, path=path), plan=plan
    )


def test_training_feed_epochs_order_rows_and_weights(tmp_path, vocab, tok) -> None:
    examples = _examples(10, seed=5)
    path = _write_jsonl(tmp_path / "train.jsonl", examples)
    feed = _train_feed(path, vocab, rows=slice(0, 4), global_batch=4)
    # 10 examples, 4 rows per step: steps 0..4 cover two epochs; each epoch visits every example
    # exactly once.
    order = np.concatenate([feed.example_indices(i) for i in range(5)])
    assert sorted(order[:10]) == list(range(10)) and sorted(order[10:20]) == list(range(10))
    assert list(order[:10]) != list(order[10:20])  # a fresh permutation per epoch
    # A pure function of (seed, step): a new feed gives the same rows; another seed does not.
    again = _train_feed(path, vocab, rows=slice(0, 4), global_batch=4)
    assert np.array_equal(again.example_indices(3), feed.example_indices(3))
    other = _train_feed(path, vocab, rows=slice(0, 4), global_batch=4, seed=8)
    assert not np.array_equal(
        np.concatenate([other.example_indices(i) for i in range(3)]), order[:12]
    )
    # A process that owns rows 2..4 of the same global batch gets exactly those rows.
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    whole = jax.device_get(feed.train_batch(1, sharding))
    assert set(whole) == {"inputs", "targets", "weights", "positions", "segment_ids"}
    yes, no = yes_no_token_ids(tok)
    for row, example_index in enumerate(feed.example_indices(1)):
        example = examples[example_index]
        (weighted,) = np.nonzero(whole["weights"][row])
        # loss on the answer only
        assert whole["targets"][row, weighted[0]] == (yes if example.label else no)
        prompt = tok.encode(boolq_prompt(passage=example.passage, question=example.question,
                                         label=int(example.label))[0])
        assert list(whole["targets"][row, :weighted[0]]) == list(prompt)


def test_train_task_boolq_needs_data_and_a_boolq_eval(tmp_path, vocab) -> None:
    path = _write_jsonl(tmp_path / "train.jsonl", _examples(4))
    base = [f"VOCAB_PATH={vocab!r}", "TRAIN_TASK='boolq'"]
    with pytest.raises(ConfigError, match="EVAL_TASK=boolq"):
        build_run_config(
            TINY_LLAMA, base + [f"BOOLQ_TRAIN_PATH={path!r}", "EVAL_TASK='validation'"]
        )
    with pytest.raises(ConfigError, match="BOOLQ_TRAIN_PATH"):
        build_run_config(TINY_LLAMA, base + ["EVAL_TASK='boolq'", f"BOOLQ_PATH={path!r}"])
    _, config = build_run_config(
        TINY_LLAMA,
        base + [f"BOOLQ_TRAIN_PATH={path!r}", "EVAL_TASK='boolq'", f"BOOLQ_PATH={path!r}"],
    )
    assert type(config.data).__name__ == "BoolQTrainConfig" and config.data.path == path
