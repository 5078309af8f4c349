"""Lambada: Pax's passage split, the JSONL reader, unpacked target-only batches and acc_strict."""

from __future__ import annotations

import io
import json
import random

import jax
import numpy as np
import pytest
import sentencepiece as spm

from paxlite.data.lambada import BATCH_KEYS, lambada_batches, read_lambada, split_lambada
from paxlite.eval.lambada import acc_strict
from paxlite.train.losses import per_example_scores

_WORDS = (
    "the cat sat on a mat and looked at dog who ran down road with big red ball while old man sang"
).split()


@pytest.fixture(scope="module")
def sp() -> spm.SentencePieceProcessor:
    """A real BPE SentencePiece model (vocab 300, byte fallback, pad 0 / eos 1 / unk 2, no BOS)."""
    rng = random.Random(0)
    lines = [" ".join(rng.choice(_WORDS) for _ in range(12)) for _ in range(400)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=300,
        byte_fallback=True,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    assert (processor.pad_id(), processor.eos_id(), processor.unk_id()) == (0, 1, 2)
    return processor


# ---------------------------------------------------------------- split_lambada / read_lambada


@pytest.mark.parametrize(
    "text, expected",
    [
        ("the cat sat on the mat", ("the cat sat on the", " mat")),
        ("  he said   hello  \n", ("he said", " hello")),
        (
            "\u201cCome here,\u201d she said to \u2018Tom\u2019",
            ('"Come here," she said to', " 'Tom'"),
        ),
        ("it\u2019s my dog\u2019s", ("it's my", " dog's")),
        ("alone", ("", " alone")),
        # the last word also occurs earlier: only its final occurrence is the target
        ("dog eat dog", ("dog eat", " dog")),
    ],
)
def test_split_lambada_hand_cases(text: str, expected: tuple[str, str]) -> None:
    assert split_lambada(text) == expected


def test_split_lambada_rejects_empty_passage() -> None:
    with pytest.raises(ValueError, match="at least one word"):
        split_lambada("   \n ")


def _write(tmp_path, name: str, lines: list[str]) -> str:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_read_lambada_both_layouts(tmp_path) -> None:
    openai = _write(
        tmp_path,
        "openai.jsonl",
        [
            json.dumps({"text": "she looked at the \u201cbig\u201d dog"}),
            "",
            json.dumps({"text": "a b c"}),
        ],
    )
    assert read_lambada(openai) == [("she looked at the \"big\"", " dog"), ("a b", " c")]
    pax = _write(
        tmp_path,
        "pax.jsonl",
        [
            json.dumps({"inputs": "  kept as is ", "targets": " word"}),
            json.dumps({"inputs": "x", "targets": "y"}),
        ],
    )
    assert read_lambada(pax) == [("  kept as is ", " word"), ("x", "y")]


@pytest.mark.parametrize(
    "lines, match",
    [
        (['{"text": "fine line"}', "{not json"], r"bad\.jsonl:2: bad Lambada line"),
        (['{"text": "fine line"}', '["a", "list"]'], r"bad\.jsonl:2: .*JSON object"),
        (['{"inputs": "only inputs"}'], r"bad\.jsonl:1: .*missing \['targets'\]"),
        (['{"passage": "x"}'], r"bad\.jsonl:1: .*'text' field"),
        (['{"text": "x", "inputs": "y", "targets": "z"}'], r"bad\.jsonl:1: .*either"),
        (['{"text": 3}'], r"bad\.jsonl:1: .*'text' must be a string"),
        (['{"text": "   "}'], r"bad\.jsonl:1: .*at least one word"),
        (['{"inputs": "a", "targets": " "}'], r"bad\.jsonl:1: .*'targets' must contain a word"),
        (["", "  "], r"holds no examples"),
    ],
)
def test_read_lambada_errors_name_path_and_line(tmp_path, lines: list[str], match: str) -> None:
    path = _write(tmp_path, "bad.jsonl", lines)
    with pytest.raises(ValueError, match=match):
        read_lambada(path)


def test_read_lambada_missing_and_empty_file(tmp_path) -> None:
    with pytest.raises(ValueError, match="nope.jsonl.*does not exist"):
        read_lambada(str(tmp_path / "nope.jsonl"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match="empty.jsonl.*no examples"):
        read_lambada(str(empty))


# ---------------------------------------------------------------- lambada_batches


def test_batch_layout_for_a_hand_checked_example(sp) -> None:
    context = sp.encode("the cat sat")
    target = sp.encode(" down")
    assert [sp.id_to_piece(i) for i in target] == ["\u2581down"]
    (batch,) = list(lambada_batches([("the cat sat", " down")], sp, seq_len=10, batch_size=1))
    assert set(batch) == set(BATCH_KEYS)
    n = len(context) + len(target)
    pad = [0] * (10 - n)
    np.testing.assert_array_equal(batch["targets"][0], context + target + pad)
    np.testing.assert_array_equal(batch["inputs"][0], [0] + context + target[:-1] + pad)
    np.testing.assert_array_equal(
        batch["weights"][0], [0.0] * len(context) + [1.0] * len(target) + [0.0] * len(pad)
    )
    np.testing.assert_array_equal(batch["segment_ids"][0], [1] * n + pad)
    np.testing.assert_array_equal(batch["positions"][0], np.arange(10))
    np.testing.assert_array_equal(batch["example_weights"], [1.0])
    for key in ("inputs", "targets", "positions", "segment_ids"):
        assert batch[key].dtype == np.int32 and batch[key].shape == (1, 10)
    assert batch["weights"].dtype == np.float32 and batch["example_weights"].dtype == np.float32


def test_left_truncation_keeps_the_whole_target(sp) -> None:
    context_text = "the old man sang while the dog ran down the road with a big red ball"
    target_text = " cat"
    context = sp.encode(context_text)
    target = sp.encode(target_text)
    seq_len = len(target) + 5
    assert len(context) > 5
    (batch,) = list(
        lambada_batches([(context_text, target_text)], sp, seq_len=seq_len, batch_size=1)
    )
    # the last 5 context tokens survive: the words nearest the target
    np.testing.assert_array_equal(batch["targets"][0], context[-5:] + target)
    np.testing.assert_array_equal(batch["weights"][0], [0.0] * 5 + [1.0] * len(target))
    assert sp.decode(batch["targets"][0][batch["weights"][0] > 0].tolist()) == "cat"


def test_targets_len_cuts_the_target_and_inputs_fill_the_rest(sp) -> None:
    target = sp.encode(" zzqx")  # byte-fallback pieces: several tokens
    assert len(target) >= 3
    (batch,) = list(
        lambada_batches([("the cat", " zzqx")], sp, seq_len=4, batch_size=1, targets_len=2)
    )
    np.testing.assert_array_equal(batch["targets"][0], sp.encode("the cat")[-2:] + target[:2])
    np.testing.assert_array_equal(batch["weights"][0], [0.0, 0.0, 1.0, 1.0])
    # a row shorter than the default targets_len=64 holds only the start of the target
    (batch,) = list(lambada_batches([("the cat", " zzqx")], sp, seq_len=2, batch_size=1))
    np.testing.assert_array_equal(batch["targets"][0], target[:2])
    np.testing.assert_array_equal(batch["weights"][0], [1.0, 1.0])


def test_padding_rows_and_every_example_once(sp) -> None:
    examples = [(f"the {w} sat on", f" {v}") for w, v in zip(_WORDS[:7], _WORDS[7:14])]
    batches = list(lambada_batches(examples, sp, seq_len=16, batch_size=3))
    assert len(batches) == 3
    example_weights = np.concatenate([b["example_weights"] for b in batches])
    np.testing.assert_array_equal(example_weights, [1.0] * 7 + [0.0] * 2)
    last = batches[-1]
    for key in BATCH_KEYS:
        assert not np.any(last[key][1:]), f"padding rows of {key} must be all zero"
    rows = np.concatenate([b["targets"] for b in batches])
    weights = np.concatenate([b["weights"] for b in batches])
    for i, (_, target) in enumerate(examples):  # in order, each once
        assert sp.decode(rows[i][weights[i] > 0].tolist()) == target.strip()


def test_batches_bad_arguments(sp) -> None:
    with pytest.raises(ValueError, match="targets_len must be >= 1"):
        next(lambada_batches([("a", " b")], sp, seq_len=8, batch_size=1, targets_len=0))
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        next(lambada_batches([("a", " b")], sp, seq_len=8, batch_size=0))
    with pytest.raises(ValueError, match="no Lambada examples"):
        next(lambada_batches([], sp, seq_len=8, batch_size=1))
    with pytest.raises(ValueError, match="example 0 has a target"):
        next(lambada_batches([("a", "")], sp, seq_len=8, batch_size=1))


# ---------------------------------------------------------------- acc_strict and per-example scores


def test_acc_strict_hand_computed() -> None:
    # example 0: 1 target token, right. example 1: 2 target tokens, one wrong -> not correct.
    # example 2: 3 target tokens, all right. row 3: padding, 0 == 0 "correct" but must not count.
    got = acc_strict(
        correct_tokens=np.array([1.0, 1.0, 3.0, 0.0], np.float32),
        target_tokens=np.array([1.0, 2.0, 3.0, 0.0], np.float32),
        example_weights=np.array([1.0, 1.0, 1.0, 0.0], np.float32),
    )
    assert got == pytest.approx(2.0 / 3.0, abs=1e-12)


def test_acc_strict_errors() -> None:
    zeros = np.zeros(2, np.float32)
    with pytest.raises(ValueError, match="at least one real example"):
        acc_strict(correct_tokens=zeros, target_tokens=zeros, example_weights=zeros)
    with pytest.raises(ValueError, match=r"real examples \[1\] have no weighted target"):
        acc_strict(
            correct_tokens=zeros, target_tokens=np.array([1.0, 0.0]), example_weights=np.ones(2)
        )
    with pytest.raises(ValueError, match="1-D arrays of one shape"):
        acc_strict(correct_tokens=zeros, target_tokens=np.ones(3), example_weights=np.ones(2))


def test_per_example_scores_match_float64_numpy() -> None:
    rng = np.random.default_rng(0)
    b, t, v = 3, 5, 7
    logits = rng.normal(size=(b, t, v)).astype(np.float32)
    targets = rng.integers(0, v, size=(b, t)).astype(np.int32)
    weights = rng.integers(0, 2, size=(b, t)).astype(np.float32)
    # make some argmax hits so correct_tokens is not trivially 0
    logits[0, 1, targets[0, 1]] += 10.0
    logits[2, 3, targets[2, 3]] += 10.0
    weights[0, 1] = weights[2, 3] = 1.0
    batch = {"targets": targets, "weights": weights}
    got = jax.jit(per_example_scores)(logits, batch)

    x = logits.astype(np.float64)
    log_z = np.log(np.sum(np.exp(x - x.max(-1, keepdims=True)), -1)) + x.max(-1)
    nll = log_z - np.take_along_axis(x, targets[..., None], -1)[..., 0]
    hits = (x.argmax(-1) == targets).astype(np.float64)
    np.testing.assert_allclose(got["loss_sum"], (nll * weights).sum(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got["correct_tokens"], (hits * weights).sum(-1))
    np.testing.assert_array_equal(got["target_tokens"], weights.sum(-1))
    assert got["correct_tokens"][0] >= 1 and got["correct_tokens"][2] >= 1
    assert all(got[k].dtype == np.float32 and got[k].shape == (b,) for k in got)


def _evaluate(batches, make_logits) -> float:
    scores = jax.jit(per_example_scores)
    correct, total, example_weights = [], [], []
    for index, batch in enumerate(batches):
        out = scores(make_logits(index, batch), batch)
        correct.append(np.asarray(out["correct_tokens"]))
        total.append(np.asarray(out["target_tokens"]))
        example_weights.append(batch["example_weights"])
    return acc_strict(
        correct_tokens=np.concatenate(correct),
        target_tokens=np.concatenate(total),
        example_weights=np.concatenate(example_weights),
    )


def test_end_to_end_oracle_and_one_wrong_token(sp) -> None:
    vocab = sp.vocab_size()
    examples = [
        ("the cat sat on the", " mat"),
        ("a dog ran down the", " road"),
        ("the old man", " sang"),
        ("he looked at a big", " zzqx"),  # several byte-fallback target tokens
        ("while the man sang the", " dog"),
    ]
    batches = list(lambada_batches(examples, sp, seq_len=16, batch_size=2))
    assert sum(int(b["example_weights"].sum()) for b in batches) == len(examples)

    def oracle(index: int, batch) -> np.ndarray:
        rng = np.random.default_rng(index)
        logits = rng.normal(size=batch["targets"].shape + (vocab,)).astype(np.float32)
        rows, cols = np.indices(batch["targets"].shape)
        logits[rows, cols, batch["targets"]] += 10.0
        return logits

    assert _evaluate(batches, oracle) == 1.0

    # example 3 (batch 1, row 1): wrong on just the last of its several target tokens
    assert batches[1]["weights"][1].sum() >= 2

    def one_wrong(index: int, batch) -> np.ndarray:
        logits = oracle(index, batch)
        if index == 1:
            last = int(np.flatnonzero(batch["weights"][1])[-1])
            wrong = (int(batch["targets"][1, last]) + 1) % vocab
            logits[1, last, wrong] += 20.0
        return logits

    assert _evaluate(batches, one_wrong) == pytest.approx((len(examples) - 1) / len(examples))
