"""The input pipeline on tiny real datasets: ArrayRecord shards + manifest written here, a real
SentencePiece model.

Expected rows are written by hand or rebuilt with plain Python loops, independently of the
pipeline's vectorised NumPy.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import random

import numpy as np
import pytest
import sentencepiece as spm
from array_record.python import array_record_module

from paxlite.data import records
from paxlite.data import tokenizer as tokenizer_lib
from paxlite.data.pipeline import TextData, TextDataConfig

EOS = 1
KEYS = {
    "inputs": np.int32,
    "targets": np.int32,
    "weights": np.float32,
    "positions": np.int32,
    "segment_ids": np.int32,
}
_VOCABULARY_TEXT = (
    "the a of to and in is was for on that with as by at from it his her an were are which this be "
    "paxlite jax grain token shard record model train batch pack row segment position weight data "
    "river mountain cloud quiet bright yellow seven eleven north window music über café"
)
_WORDS = _VOCABULARY_TEXT.split()


def write_dataset(
    directory,
    splits: dict[str, list],
    *,
    kind: str = "tokens",
    tokenizer: dict | None = None,
    num_shards: int = 1,
) -> str:
    """A dataset directory per the shared format.

    Shards hold contiguous runs of `splits[name]`, so file order is list order.
    """
    os.makedirs(directory, exist_ok=True)
    manifest_splits = {}
    for split, docs in splits.items():
        shards = []
        for s in range(num_shards):
            name = f"{split}-{s:05d}-of-{num_shards:05d}.array_record"
            writer = array_record_module.ArrayRecordWriter(
                os.path.join(directory, name), "group_size:1"
            )
            for doc in docs[s * len(docs) // num_shards : (s + 1) * len(docs) // num_shards]:
                if kind == "text":
                    writer.write(doc.encode("utf-8"))
                else:
                    writer.write(np.asarray(doc, "<i4").tobytes())
            writer.close()
            shards.append(name)
        tokens = None if kind == "text" else int(sum(len(d) for d in docs))
        manifest_splits[split] = {"shards": shards, "documents": len(docs), "tokens": tokens}
    manifest = {
        "format_version": 1,
        "kind": kind,
        "splits": manifest_splits,
        "tokenizer": tokenizer,
        "sources": ["/test/generated"],
    }
    with open(os.path.join(directory, "paxlite_dataset.json"), "w") as f:
        json.dump(manifest, f, sort_keys=True, indent=2)
    return str(directory)


def token_manifest(vocab_size: int = 64) -> dict:
    """A manifest tokenizer entry for hand-made token ids (only vocab_size/eos_id are read)."""
    return {
        "path": "/absent/hand.model",
        "sha256": "0" * 64,
        "vocab_size": vocab_size,
        "eos_id": EOS,
        "pad_id": 0,
    }


def random_docs(n: int, *, seed: int, max_len: int = 20) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 60, size=int(rng.integers(1, max_len))).tolist() for _ in range(n)]


def make_data(data_dir, *, seq_len: int, batch: int, vocab_path=None, vocab_size=64, **kwargs):
    counts = {k: kwargs.pop(k) for k in ("process_index", "process_count") if k in kwargs}
    config = TextDataConfig(
        data_dir=data_dir, vocab_path=vocab_path, vocab_size=vocab_size, seq_len=seq_len, **kwargs
    )
    return TextData(config, global_batch_size=batch, **counts)


def take(iterator, n: int) -> list[dict[str, np.ndarray]]:
    return [next(iterator) for _ in range(n)]


def reference_inputs(targets: np.ndarray, segment_ids: np.ndarray) -> np.ndarray:
    """Shift right within segments, by loops."""
    out = np.zeros_like(targets)
    for r in range(targets.shape[0]):
        for t in range(1, targets.shape[1]):
            same = segment_ids[r, t] == segment_ids[r, t - 1] and segment_ids[r, t] > 0
            out[r, t] = targets[r, t - 1] if same else 0
    return out


def check_batch(batch: dict[str, np.ndarray], shape: tuple[int, int]) -> None:
    assert set(batch) == set(KEYS)
    for key, dtype in KEYS.items():
        assert batch[key].dtype == dtype, key
        assert batch[key].shape == shape, key


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> str:
    """A real BPE SentencePiece model, T5 ids (pad 0, eos 1, unk 2, no BOS), with byte fallback."""
    directory = tmp_path_factory.mktemp("spm")
    rnd = random.Random(0)
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rnd.choices(_WORDS, k=12)) for _ in range(400)))
    prefix = str(directory / "test")
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=prefix,
        model_type="bpe",
        vocab_size=300,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        byte_fallback=True,
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    return prefix + ".model"


def spm_entry(path: str) -> dict:
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    proc = spm.SentencePieceProcessor(model_file=path)
    return {
        "path": path,
        "sha256": sha,
        "vocab_size": proc.get_piece_size(),
        "eos_id": proc.eos_id(),
        "pad_id": proc.pad_id(),
    }


def test_packed_rows_exact(tmp_path):
    data_dir = write_dataset(
        tmp_path,
        {"train": [[5, 6, 7], [8, 9], [10, 11, 12, 13]], "validation": [[5]]},
        tokenizer=token_manifest(),
    )
    data = make_data(data_dir, seq_len=4, batch=3, shuffle=False)
    batch, again = take(data.train_iterator(), 2)
    check_batch(batch, (3, 4))
    expected = {
        "targets": [[5, 6, 7, 1], [8, 9, 1, 10], [11, 12, 13, 1]],
        "inputs": [[0, 5, 6, 7], [0, 8, 9, 0], [0, 11, 12, 13]],
        "segment_ids": [[1, 1, 1, 1], [1, 1, 1, 2], [1, 1, 1, 1]],
        "positions": [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 2, 3]],
        "weights": [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]],
    }
    for key, value in expected.items():
        np.testing.assert_array_equal(batch[key], np.asarray(value, KEYS[key]), err_msg=key)
        # 12 tokens fill exactly 3 rows, so the unshuffled second epoch repeats them.
        np.testing.assert_array_equal(again[key], batch[key], err_msg=key)


def test_unpacked_rows_padding_and_weights(tmp_path):
    data_dir = write_dataset(
        tmp_path,
        {"train": [[5, 6, 7], [8, 9], [10, 11, 12, 13]], "validation": [[5]]},
        tokenizer=token_manifest(),
    )
    data = make_data(data_dir, seq_len=4, batch=3, shuffle=False, packed=False)
    (batch,) = take(data.train_iterator(), 1)
    check_batch(batch, (3, 4))
    expected = {
        "targets": [[5, 6, 7, 1], [8, 9, 1, 0], [10, 11, 12, 13]],
        "inputs": [[0, 5, 6, 7], [0, 8, 9, 0], [0, 10, 11, 12]],
        "segment_ids": [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]],
        "positions": [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 2, 3]],
        "weights": [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]],
    }
    for key, value in expected.items():
        np.testing.assert_array_equal(batch[key], np.asarray(value, KEYS[key]), err_msg=key)


def test_packed_epoch_loses_and_duplicates_nothing(tmp_path):
    docs = random_docs(40, seed=1)  # lengths 1..19, many longer than seq_len
    data_dir = write_dataset(
        tmp_path, {"train": docs, "validation": [[5]]}, tokenizer=token_manifest(), num_shards=3
    )
    seq_len, batch = 8, 4
    data = make_data(data_dir, seq_len=seq_len, batch=batch, seed=3)
    total = sum(len(d) + 1 for d in docs)
    batches = take(data.train_iterator(), -(-total // (seq_len * batch)))
    for b in batches:
        check_batch(b, (batch, seq_len))
        np.testing.assert_array_equal(b["inputs"], reference_inputs(b["targets"], b["segment_ids"]))
        np.testing.assert_array_equal(b["weights"], np.ones((batch, seq_len), np.float32))
    stream = np.concatenate([b["targets"].reshape(-1) for b in batches])[:total].tolist()
    assert stream[-1] == EOS
    seen, doc = [], []
    for token in stream:
        if token == EOS:
            seen.append(tuple(doc))
            doc = []
        else:
            doc.append(token)
    assert collections.Counter(seen) == collections.Counter(tuple(d) for d in docs)
    assert seen != [tuple(d) for d in docs]  # shuffled


def test_unpacked_epoch_only_truncates(tmp_path):
    docs = random_docs(24, seed=2)
    data_dir = write_dataset(
        tmp_path, {"train": docs, "validation": [[5]]}, tokenizer=token_manifest(), num_shards=2
    )
    seq_len = 8
    data = make_data(data_dir, seq_len=seq_len, batch=4, packed=False, seed=5)
    rows = []
    for b in take(data.train_iterator(), 6):
        np.testing.assert_array_equal(b["inputs"], reference_inputs(b["targets"], b["segment_ids"]))
        for r in range(4):
            n = int(b["weights"][r].sum())
            np.testing.assert_array_equal(b["positions"][r, :n], np.arange(n))
            assert not b["targets"][r, n:].any() and not b["segment_ids"][r, n:].any()
            rows.append(tuple(b["targets"][r, :n].tolist()))
    expected = [tuple((d + [EOS])[:seq_len]) for d in docs]
    assert collections.Counter(rows) == collections.Counter(expected)


def test_eval_batches_whole_split_padded_and_deterministic(tmp_path):
    evals = [[3 + i] * (i + 1) for i in range(5)]
    data_dir = write_dataset(
        tmp_path,
        {"train": [[5, 6], [7]], "validation": evals},
        tokenizer=token_manifest(),
        num_shards=2,
    )
    data = make_data(data_dir, seq_len=4, batch=2, packed=True, shuffle=True)
    batches = list(data.eval_batches(-1))
    assert len(batches) == 3 == data.num_eval_batches()
    targets = np.concatenate([b["targets"] for b in batches])
    weights = np.concatenate([b["weights"] for b in batches])
    for i, doc in enumerate(evals):  # file order, unpacked, truncated, EOS appended
        row = (doc + [EOS])[:4]
        np.testing.assert_array_equal(targets[i], row + [0] * (4 - len(row)))
        np.testing.assert_array_equal(weights[i], [1.0] * len(row) + [0.0] * (4 - len(row)))
    for key in KEYS:  # the padding row of the last batch is all zero
        assert not batches[-1][key][1].any(), key
    again = list(data.eval_batches(-1))
    first_two = list(data.eval_batches(2))
    assert len(first_two) == 2
    for a, b in zip(batches, again, strict=True):
        for key in KEYS:
            np.testing.assert_array_equal(a[key], b[key])
    for a, b in zip(batches[:2], first_two, strict=True):
        for key in KEYS:
            np.testing.assert_array_equal(a[key], b[key])
    # Two processes: the same number of batches each, disjoint rows covering the split.
    per_process = [
        list(
            make_data(data_dir, seq_len=4, batch=2, process_index=p, process_count=2).eval_batches(
                -1
            )
        )
        for p in range(2)
    ]
    assert [len(b) for b in per_process] == [3, 3]
    rows = [tuple(b["targets"][0].tolist()) for bs in per_process for b in bs if b["weights"].any()]
    assert sorted(rows) == sorted(tuple(t) for t in targets[:5].tolist())
    with pytest.raises(ValueError, match="-1"):
        next(data.eval_batches(0))


def test_text_kind_equals_tokens_kind(tmp_path, spm_model):
    rnd = random.Random(1)
    texts = [" ".join(rnd.choices(_WORDS, k=rnd.randint(1, 30))) for _ in range(30)]
    texts += ["", "ünï ✓"]
    proc = spm.SentencePieceProcessor(model_file=spm_model)
    ids = [proc.encode(t, out_type=int) for t in texts]
    entry = spm_entry(spm_model)
    text_dir = write_dataset(
        tmp_path / "text", {"train": texts, "validation": texts[:3]}, kind="text", num_shards=2
    )
    tok_dir = write_dataset(
        tmp_path / "tok", {"train": ids, "validation": ids[:3]}, tokenizer=entry, num_shards=2
    )
    for packed in (True, False):
        from_text = make_data(
            text_dir,
            vocab_path=spm_model,
            vocab_size=320,
            seq_len=16,
            batch=4,
            packed=packed,
            seed=7,
        )
        # vocab_path is optional for tokens; given, it must be the manifest's model (it is).
        from_ids = [
            make_data(
                tok_dir, vocab_path=path, vocab_size=320, seq_len=16, batch=4, packed=packed, seed=7
            )
            for path in (None, spm_model)
        ]
        streams = [take(d.train_iterator(), 12) for d in [from_text, *from_ids]]
        for key in KEYS:
            for other in streams[1:]:
                for a, b in zip(streams[0], other, strict=True):
                    np.testing.assert_array_equal(a[key], b[key], err_msg=key)
        evals = [list(d.eval_batches(-1)) for d in (from_text, from_ids[0])]
        for a, b in zip(*evals, strict=True):
            np.testing.assert_array_equal(a["targets"], b["targets"])
    assert any(int(t) > 258 for b in streams[0] for t in b["targets"].reshape(-1))  # merged pieces


def test_shuffle_seeded_and_reshuffled_each_epoch(tmp_path):
    docs = [[3 + i] for i in range(16)]
    data_dir = write_dataset(
        tmp_path, {"train": docs, "validation": [[5]]}, tokenizer=token_manifest(), num_shards=2
    )

    def epochs(seed: int) -> list[list[int]]:
        data = make_data(data_dir, seq_len=2, batch=16, packed=False, seed=seed)
        return [b["targets"][:, 0].tolist() for b in take(data.train_iterator(), 2)]

    first, second = epochs(0)
    assert sorted(first) == sorted(second) == [3 + i for i in range(16)]
    assert first != second  # each epoch reshuffled
    assert epochs(0) == [first, second]  # seed-determined
    assert epochs(1)[0] != first  # a different seed, a different order
    unshuffled = make_data(data_dir, seq_len=2, batch=16, packed=False, shuffle=False)
    assert next(unshuffled.train_iterator())["targets"][:, 0].tolist() == [3 + i for i in range(16)]


@pytest.mark.parametrize("packed", [True, False])
def test_iterator_state_resumes_exactly(tmp_path, packed):
    docs = random_docs(30, seed=4)
    data_dir = write_dataset(
        tmp_path, {"train": docs, "validation": [[5]]}, tokenizer=token_manifest(), num_shards=3
    )
    kwargs = {"seq_len": 8, "batch": 2, "packed": packed, "seed": 11}
    iterator = make_data(data_dir, **kwargs).train_iterator()
    for k in (1, 2, 5, 13):  # spans epochs and remainders of split documents
        take(iterator, k)
        state = json.loads(json.dumps(iterator.get_state()))
        expected = take(iterator, 4)
        fresh = make_data(data_dir, **kwargs).train_iterator()
        fresh.set_state(state)
        for a, b in zip(expected, take(fresh, 4), strict=True):
            for key in KEYS:
                np.testing.assert_array_equal(a[key], b[key], err_msg=f"{key} after {k}")
    other = make_data(data_dir, **{**kwargs, "seed": 12}).train_iterator()
    with pytest.raises(ValueError, match="seed=11"):
        other.set_state(iterator.get_state())


def test_process_slices_are_disjoint_and_cover_the_split(tmp_path):
    docs = [[3 + i, 3 + i] for i in range(12)]
    data_dir = write_dataset(
        tmp_path, {"train": docs, "validation": [[5]]}, tokenizer=token_manifest(), num_shards=2
    )
    seen = []
    for p in range(2):
        data = make_data(
            data_dir, seq_len=4, batch=4, packed=False, process_index=p, process_count=2
        )
        batches = take(data.train_iterator(), 3)  # 6 documents per process: one epoch
        assert batches[0]["targets"].shape == (2, 4)
        seen.append({int(t) for b in batches for t in b["targets"][:, 0]})
    assert len(seen[0]) == len(seen[1]) == 6
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == {3 + i for i in range(12)}


def test_errors_name_the_problem(tmp_path, spm_model):
    missing = tmp_path / "nope"
    with pytest.raises(records.DatasetError, match=str(missing)):
        make_data(str(missing), seq_len=4, batch=2)

    no_manifest = tmp_path / "empty_dir"
    no_manifest.mkdir()
    with pytest.raises(records.DatasetError, match=str(no_manifest)):
        make_data(str(no_manifest), seq_len=4, batch=2)

    empty = write_dataset(
        tmp_path / "empty_split", {"train": [], "validation": [[5]]}, tokenizer=token_manifest()
    )
    with pytest.raises(records.DatasetError, match="'train'"):
        make_data(empty, seq_len=4, batch=2)

    tokens = write_dataset(
        tmp_path / "tokens",
        {"train": [[5, 6]], "validation": [[5]]},
        tokenizer=token_manifest(vocab_size=300),
    )
    with pytest.raises(records.DatasetError, match="'test'.*train"):
        make_data(tokens, seq_len=4, batch=1, vocab_size=320, train_split="test")
    with pytest.raises(records.DatasetError, match="'train'.*1 documents.*2"):
        make_data(tokens, seq_len=4, batch=2, vocab_size=320, process_count=2)
    with pytest.raises(tokenizer_lib.VocabError, match="300.*100"):
        make_data(tokens, seq_len=4, batch=1, vocab_size=100)
    with pytest.raises(tokenizer_lib.VocabError, match="sha256"):
        make_data(tokens, seq_len=4, batch=1, vocab_size=320, vocab_path=spm_model)
    with pytest.raises(ValueError, match="3.*2"):
        make_data(tokens, seq_len=4, batch=3, process_count=2)

    text = write_dataset(
        tmp_path / "text", {"train": ["hello"], "validation": ["bye"]}, kind="text"
    )
    with pytest.raises(tokenizer_lib.VocabError, match="vocab_path"):
        make_data(text, seq_len=4, batch=1, vocab_size=320)
    # a tokenizer larger than the model is refused only at a text holding an id past its rows
    larger = make_data(text, seq_len=4, batch=1, vocab_size=100, vocab_path=spm_model)
    with pytest.raises(tokenizer_lib.VocabError, match=r"\(id \d+\).*0\.\.99"):
        take(larger.train_iterator(), 1)
    absent_model = str(tmp_path / "absent.model")
    with pytest.raises(tokenizer_lib.VocabError, match=absent_model):
        make_data(text, seq_len=4, batch=1, vocab_size=320, vocab_path=absent_model)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_documents_start_with_bos_where_the_tokenizer_has_one(tmp_path, spm_model, packed):
    """document_start='bos': every segment's first input is the tokenizer's BOS (as a Hugging Face
    model trains); everything else is the 'zero' run's. A tokenizer without BOS starts with 0."""
    from paxlite.data.packing import DocumentStart

    prefix = str(tmp_path / "with_bos")
    corpus = tmp_path / "corpus.txt"
    rnd = random.Random(3)
    corpus.write_text("\n".join(" ".join(rnd.choices(_WORDS, k=12)) for _ in range(300)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=prefix, model_type="bpe",
                                   vocab_size=300, pad_id=0, eos_id=1, unk_id=2, bos_id=3,
                                   byte_fallback=True, num_threads=1, minloglevel=2)
    texts = [" ".join(rnd.choices(_WORDS, k=rnd.randint(1, 20))) for _ in range(20)]
    text_dir = write_dataset(tmp_path / "text", {"train": texts, "validation": texts[:5]},
                             kind="text")

    def batches(vocab, start):
        data = make_data(text_dir, vocab_path=vocab, vocab_size=320, seq_len=16, batch=4,
                         packed=packed, shuffle=False, document_start=start)
        return take(data.train_iterator(), 3) + list(data.eval_batches(-1))

    zero, bos = batches(prefix + ".model", "zero"), batches(prefix + ".model", DocumentStart.BOS)
    starts = 0
    for a, b in zip(zero, bos, strict=True):
        first = a["positions"] == 0
        np.testing.assert_array_equal(a["inputs"][first], 0)
        np.testing.assert_array_equal(b["inputs"][first], 3)
        np.testing.assert_array_equal(a["inputs"][~first], b["inputs"][~first])
        for key in ("targets", "weights", "positions", "segment_ids"):
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
        starts += int(np.count_nonzero(first & (a["weights"] > 0)))
    assert starts > 12  # documents (and continued rows) do start in these batches
    for a, b in zip(batches(spm_model, "zero"), batches(spm_model, "bos"), strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])  # no BOS: 0, as evaluation
    ids_dir = write_dataset(tmp_path / "ids", {"train": [[5, 6], [7]], "validation": [[5]]},
                            tokenizer=token_manifest())
    with pytest.raises(tokenizer_lib.VocabError, match="no tokenizer is given: set vocab_path"):
        make_data(ids_dir, vocab_path=None, seq_len=4, batch=2, document_start="bos")
