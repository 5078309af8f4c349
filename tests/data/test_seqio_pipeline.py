"""Pax's SeqIO tasks on tiny TFDS datasets and a tiny tokenizer, both made here.

Needs the `seqio` extra (CI installs it). The references are plain Python/NumPy over SentencePiece
ids of the stored documents, read straight from the TFRecord files (not through SeqIO).
SeqIO, TensorFlow and TFDS are imported where they are used: importing them takes seconds, and
every pytest worker imports this module to collect it, while only one runs it.
"""

import functools
import glob
import itertools
import json
import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece as spm

from paxlite.data import seqio_pipeline as sp
from paxlite.data import seqio_tasks as st
from paxlite.data.errors import DatasetError
from paxlite.data.tokenizer import VocabError
from paxlite.data.train_tokenizer import train_from_sentences

WORDS = (
    "the of and to in is was he for it with as his on be at by had not are but from or have an "
    "they which one you were her all she there would their we him been has when who will more"
).split()
VOCAB = 400  # 259 byte/special pieces, the characters, and a merge for most words
GROUP = st.CONCAT_GROUP_SIZE
LAMBADA = [("He opened the door and saw", " her"), ("They sat by the", " fire"),
           ("When all was said, she had not", " gone")]
BOOLQ = {  # split -> (passage, question, label)
    "train": [("The sky is blue.", "is the sky blue", 1), ("Ice is hot.", "is ice hot", 0)],
    "validation": [("Cats purr.", "do cats purr", 1), ("Fish walk.", "do fish walk", 0),
                   ("It rains.", "does it rain", 1)],
}


def documents(count: int, *, seed: int) -> list[str]:
    """Short documents (1-3 words, a few with a number): 128 of them make ~350 ids, so rows of
    700 hold two groups and packing has segments to separate."""
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.1:
            words.append(str(rng.randint(0, 99)))
        docs.append(" ".join(words))
    return docs


def c4_validation() -> list[str]:
    """One long document makes its file's shard much longer than the other."""
    return documents(45, seed=4) + [" ".join(WORDS * 3)]


def keyed(examples: list) -> list:
    return list(enumerate(examples))


def text_features():
    """TFDS features of a dataset of documents: one "text" field."""
    import tensorflow_datasets as tfds

    return tfds.features.FeaturesDict({"text": tfds.features.Text()})


@pytest.fixture(scope="session")
def vocab(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("spm")
    return train_from_sentences(documents(2000, seed=99), root / "tok", vocab_size=VOCAB)


@pytest.fixture(scope="session")
def spm_model(vocab) -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=vocab)


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory) -> str:
    """the_pile (1 file per split), c4/en (2 files per split), my_lambada, super_glue/boolq."""
    import tensorflow_datasets as tfds

    root = str(tmp_path_factory.mktemp("tfds"))
    text = text_features()
    store = tfds.dataset_builders.store_as_tfds_dataset
    store(name="the_pile", version="1.0.0", features=text, data_dir=root, file_format="tfrecord",
          split_datasets={"train": keyed([{"text": d} for d in documents(300, seed=1)]),
                          "validation": keyed([{"text": d} for d in documents(40, seed=2)])})
    store(name="c4", config="en", version="3.0.1", features=text, data_dir=root,
          file_format="tfrecord", download_config=tfds.download.DownloadConfig(num_shards=2),
          split_datasets={"train": keyed([{"text": d} for d in documents(200, seed=3)]),
                          "validation": keyed([{"text": d} for d in c4_validation()])})
    store(name="my_lambada", version="1.0.0", data_dir=root, file_format="tfrecord",
          features=tfds.features.FeaturesDict(
              {"inputs": tfds.features.Text(), "targets": tfds.features.Text()}),
          split_datasets={"test": keyed([{"inputs": i, "targets": t} for i, t in LAMBADA])})
    boolq_features = tfds.features.FeaturesDict({
        "passage": tfds.features.Text(), "question": tfds.features.Text(),
        "label": tfds.features.ClassLabel(num_classes=2), "idx": np.int32,
    })
    store(name="super_glue", config="boolq", version="1.0.2", data_dir=root,
          file_format="tfrecord", features=boolq_features,
          split_datasets={
              split: keyed([{"passage": p, "question": q, "label": y, "idx": i}
                            for i, (p, q, y) in enumerate(rows)])
              for split, rows in BOOLQ.items()})
    return root


@functools.cache
def stored_texts(directory: str, split: str) -> tuple[tuple[str, ...], ...]:
    """Each TFRecord file's documents in stored order, decoded without SeqIO (one tuple per file).
    Cached: the files are written once per session, and decoding them runs eager TF ops per
    record."""
    import tensorflow as tf
    import tensorflow_datasets as tfds

    features = tfds.builder_from_directory(directory).info.features
    files = sorted(glob.glob(os.path.join(directory, f"*-{split}.tfrecord-*")))
    return tuple(tuple(features.deserialize_example(record)["text"].numpy().decode() for record in
                       tf.data.TFRecordDataset(path)) for path in files)


def lm_pieces(texts: list[str], model, *, seq_len: int, epochs: int) -> list[list[int]]:
    """Pax's LM preprocessing by hand: 128 documents' ids joined (0 dropped), cut into pieces of
    seq_len - 1, EOS appended; the documents repeat `epochs` times as one stream."""
    stream = [text for _ in range(epochs) for text in texts]
    encoded = {text: [t for t in model.encode(text) if t != 0] for text in set(texts)}
    pieces = []
    for start in range(0, len(stream), GROUP):
        ids = [t for text in stream[start : start + GROUP] for t in encoded[text]]
        cuts = range(0, len(ids), seq_len - 1)
        pieces += [ids[i : i + seq_len - 1] + [model.eos_id()] for i in cuts]
    return pieces


def train_epochs(texts: list[str], *, seq_len: int) -> int:
    """Epochs of `texts` that hold SeqIO's first packing group (seq_len pieces, >= 1 per 128
    documents) completely, so the reference's first rows are exact."""
    return 1 + math.ceil(seq_len * GROUP / len(texts))


def rows_of(pieces: list[list[int]], *, seq_len: int, packed: bool) -> list[list[list[int]]]:
    """Rows as lists of segments. Packed follows SeqIO's documented greedy packer: pieces are taken
    seq_len at a time; a piece joins the open row if it fits, else the row is closed; the open row
    is closed at the end of each group."""
    if not packed:
        return [[piece] for piece in pieces]
    rows = []
    for start in range(0, len(pieces), seq_len):
        row: list[list[int]] = []
        for piece in pieces[start : start + seq_len]:
            if row and sum(map(len, row)) + len(piece) > seq_len:
                rows.append(row)
                row = []
            row.append(piece)
        rows.append(row)
    return rows


def features_of(rows: list[list[list[int]]], *, seq_len: int) -> dict[str, np.ndarray]:
    """paxlite's batch features of segment rows, built element by element."""
    out = {key: np.zeros((len(rows), seq_len), np.int32)
           for key in ("inputs", "targets", "positions", "segment_ids")}
    for r, row in enumerate(rows):
        col = 0
        for segment, piece in enumerate(row, start=1):
            for position, token in enumerate(piece):
                out["targets"][r, col] = token
                out["inputs"][r, col] = piece[position - 1] if position else 0
                out["positions"][r, col] = position
                out["segment_ids"][r, col] = segment
                col += 1
    out["weights"] = (out["segment_ids"] > 0).astype(np.float32)
    return out


def config(tfds_dir: str, vocab: str, **overrides) -> sp.SeqIODataConfig:
    values = dict(task=st.THE_PILE_TASK, tfds_data_dir=tfds_dir, vocab_path=vocab,
                  vocab_size=VOCAB, seq_len=16, shuffle_buffer_size=1)
    return sp.SeqIODataConfig(**(values | overrides))


def take(iterator, count: int) -> dict[str, np.ndarray]:
    batches = list(itertools.islice(iterator, count))
    return {key: np.concatenate([b[key] for b in batches]) for key in batches[0]}


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


@pytest.mark.parametrize("seq_len,packed", [(16, False), (16, True), (700, True)])
def test_the_pile_rows_match_a_hand_reference(tfds_dir, vocab, spm_model, seq_len, packed):
    # shuffle_buffer_size=1 and one file: SeqIO's order is the stored order, repeated.
    data = sp.SeqIOData(config(tfds_dir, vocab, seq_len=seq_len, packed=packed),
                        global_batch_size=4)
    batches = 5
    got = take(data.train_iterator(), batches)
    (texts,) = stored_texts(os.path.join(tfds_dir, "the_pile", "1.0.0"), "train")
    pieces = lm_pieces(texts, spm_model, seq_len=seq_len,
                       epochs=train_epochs(texts, seq_len=seq_len))
    rows = rows_of(pieces, seq_len=seq_len, packed=packed)[: 4 * batches]
    assert_same(got, features_of(rows, seq_len=seq_len))
    dtypes = {"inputs": np.int32, "targets": np.int32, "weights": np.float32,
              "positions": np.int32, "segment_ids": np.int32}
    assert {key: value.dtype for key, value in got.items()} == dtypes
    if seq_len == 700:  # 128 documents hold fewer ids than a row: several segments per row
        assert got["segment_ids"].max() >= 2 and got["weights"].min() == 0
        seg, pos = got["segment_ids"], got["positions"]
        assert np.all(got["inputs"][pos == 0] == 0)  # the shift stops at segment starts
        inside = pos[:, 1:] > 0
        np.testing.assert_array_equal(got["inputs"][:, 1:][inside], got["targets"][:, :-1][inside])
        np.testing.assert_array_equal(seg[:, 1:][inside], seg[:, :-1][inside])


@pytest.mark.parametrize("task", [st.C4_TASK, st.THE_PILE_TASK])
def test_two_processes_read_disjoint_shards(tfds_dir, vocab, spm_model, task):
    if task == st.C4_TASK:  # one file per process: SeqIO shards by file
        shards = stored_texts(os.path.join(tfds_dir, "c4", "en", "3.0.1"), "train")
        assert len(shards) == 2
    else:  # one file for two processes: SeqIO takes every other example
        (texts,) = stored_texts(os.path.join(tfds_dir, "the_pile", "1.0.0"), "train")
        shards = [texts[0::2], texts[1::2]]
    for index in range(2):
        data = sp.SeqIOData(config(tfds_dir, vocab, task=task), global_batch_size=4,
                            process_index=index, process_count=2)
        got = take(data.train_iterator(), 3)
        assert got["targets"].shape == (6, 16)
        epochs = train_epochs(shards[index], seq_len=16)
        rows = rows_of(lm_pieces(shards[index], spm_model, seq_len=16, epochs=epochs), seq_len=16,
                       packed=True)
        assert_same(got, features_of(rows[:6], seq_len=16))  # only this process's shard


def test_two_process_eval_covers_the_split_once_in_equal_steps(tfds_dir, vocab, spm_model):
    files = stored_texts(os.path.join(tfds_dir, "c4", "en", "3.0.1"), "validation")
    per_process = [
        list(sp.SeqIOData(config(tfds_dir, vocab, task=st.C4_TASK), global_batch_size=4,
                          process_index=i, process_count=2).eval_batches(-1))
        for i in range(2)
    ]
    rows = [rows_of(lm_pieces(texts, spm_model, seq_len=16, epochs=1), seq_len=16, packed=False)
            for texts in files]
    expected_batches = max(math.ceil(len(r) / 2) for r in rows)
    # Unequal shards: the longer one sets the step count, more than the global row count needs.
    assert expected_batches > math.ceil((len(rows[0]) + len(rows[1])) / 4)
    assert [len(b) for b in per_process] == [expected_batches, expected_batches]
    for batches, process_rows in zip(per_process, rows):
        got = {key: np.concatenate([b[key] for b in batches]) for key in batches[0]}
        padding = [[] for _ in range(2 * expected_batches - len(process_rows))]
        assert_same(got, features_of(process_rows + padding, seq_len=16))


def test_eval_batches_whole_split_and_fixed_counts(tfds_dir, vocab, spm_model):
    data = sp.SeqIOData(config(tfds_dir, vocab, packed=True), global_batch_size=4)
    (texts,) = stored_texts(os.path.join(tfds_dir, "the_pile", "1.0.0"), "validation")
    rows = rows_of(lm_pieces(texts, spm_model, seq_len=16, epochs=1), seq_len=16, packed=False)
    batches = list(data.eval_batches(-1))  # unpacked even though training packs
    assert len(batches) == data.num_eval_batches() == math.ceil(len(rows) / 4)
    padding = [[] for _ in range(4 * len(batches) - len(rows))]
    assert padding  # the last batch has all-zero rows of weight 0
    got = {key: np.concatenate([b[key] for b in batches]) for key in batches[0]}
    assert_same(got, features_of(rows + padding, seq_len=16))
    longer = list(data.eval_batches(len(batches) + 1))
    assert len(longer) == len(batches) + 1 and not longer[-1]["weights"].any()
    assert len(list(data.eval_batches(1))) == 1
    with pytest.raises(ValueError, match="num_batches"):
        list(data.eval_batches(0))


def test_resume_continues_exactly_and_checks_meta(tfds_dir, vocab):
    cfg = config(tfds_dir, vocab, shuffle_buffer_size=64, seed=7)
    uninterrupted = sp.SeqIOData(cfg, global_batch_size=4).train_iterator()
    first = [next(uninterrupted) for _ in range(3)]
    state = json.loads(json.dumps(uninterrupted.get_state()))  # as a checkpoint stores it
    first += [next(uninterrupted) for _ in range(2)]
    assert state == {"version": 1, "task": "the_pile_lm", "seed": 7, "seq_len": 16, "packed": True,
                     "global_batch_size": 4, "process_index": 0, "process_count": 1,
                     "batches_consumed": 3}
    resumed = sp.SeqIOData(cfg, global_batch_size=4).train_iterator()
    resumed.set_state(state)
    for want in first[3:]:
        assert_same(next(resumed), want)
    unshuffled = next(sp.SeqIOData(config(tfds_dir, vocab), global_batch_size=4).train_iterator())
    assert not np.array_equal(unshuffled["targets"], first[0]["targets"])  # the seed shuffles
    for key, value in (("seq_len", 32), ("seed", 8), ("process_count", 2)):
        with pytest.raises(ValueError, match=f"{key}="):
            resumed.set_state(state | {key: value})
    with pytest.raises(ValueError, match="version"):
        resumed.set_state(state | {"version": 2})


def eval_task_rows(task: str, split: str, lengths: dict[str, int]) -> list[dict[str, list[int]]]:
    import seqio

    ds = seqio.get_mixture_or_task(task).get_dataset(lengths, split=split, shuffle=False)
    return [{key: ex[key].tolist() for key in ("inputs", "targets")}
            for ex in ds.as_numpy_iterator()]


def test_lambada_task_tokenizes_both_features_without_eos(tfds_dir, vocab, spm_model):
    st.register_tasks(vocab_path=vocab, tfds_data_dir=tfds_dir)
    got = eval_task_rows(st.LAMBADA_TASK, "test", {"inputs": 64, "targets": 64})
    want = [{"inputs": spm_model.encode(i), "targets": spm_model.encode(t)} for i, t in LAMBADA]
    assert sorted(map(str, got)) == sorted(map(str, want))  # TFDS stores by key hash


def test_boolq_task_matches_the_python_prompt(tfds_dir, vocab, spm_model):
    assert st.boolq_prompt(passage="Cats purr.", question="do cats purr", label=1) == (
        "Cats purr.\nquestion: do cats purr?\nanswer:", "yes")
    assert st.boolq_prompt(passage="P", question="q", label=0)[1] == "no"
    st.register_tasks(vocab_path=vocab, tfds_data_dir=tfds_dir)
    for split, examples in BOOLQ.items():
        got = eval_task_rows(st.BOOLQ_TASK, split, {"inputs": 128, "targets": 8})
        want = []
        for passage, question, label in examples:
            inputs, targets = st.boolq_prompt(passage=passage, question=question, label=label)
            want.append({"inputs": spm_model.encode(inputs), "targets": spm_model.encode(targets)})
        assert sorted(map(str, got)) == sorted(map(str, want))  # TFDS stores by key hash


def test_register_tasks_replaces_vocabulary_and_data_dir(tfds_dir, vocab, tmp_path):
    import seqio

    other = train_from_sentences(documents(500, seed=5), tmp_path / "other", vocab_size=300)
    st.register_tasks(vocab_path=other, tfds_data_dir=str(tmp_path))
    st.register_tasks(vocab_path=vocab, tfds_data_dir=tfds_dir)
    for name in (st.THE_PILE_TASK, st.C4_TASK, st.LAMBADA_TASK, st.BOOLQ_TASK):
        task = seqio.get_mixture_or_task(name)
        assert task.output_features["targets"].vocabulary.vocab_size == VOCAB
        assert task.source.tfds_dataset.data_dir == tfds_dir


def test_preprocessors_on_hand_made_examples():
    import seqio
    import tensorflow as tf

    ds = tf.data.Dataset.from_generator(
        lambda: iter([[5, 6], [0, 7], [8], [9, 0, 3]]),
        output_signature=tf.TensorSpec([None], tf.int32)).map(lambda t: {"targets": t, "x": 1})
    joined = st.reduce_concat_tokens(ds, batch_size=3)
    assert [x["targets"].tolist() for x in joined.as_numpy_iterator()] == [[5, 6, 7, 8], [9, 3]]
    long = tf.data.Dataset.from_tensor_slices({"targets": [list(range(1, 8))]})
    for add_eos, want in ((True, [[1, 2, 3], [4, 5, 6], [7]]), (False, [[1, 2, 3, 4], [5, 6, 7]])):
        feature = seqio.Feature(vocabulary=seqio.PassThroughVocabulary(10), add_eos=add_eos)
        pieces = st.split_tokens_to_targets_length(
            long, sequence_length={"targets": 4}, output_features={"targets": feature})
        assert [x["targets"].tolist() for x in pieces.as_numpy_iterator()] == want


def test_cheap_checks_fail_before_any_dataset_is_built(tfds_dir, vocab, tmp_path):
    with pytest.raises(ValueError, match="did you mean 'the_pile_lm'"):
        config(tfds_dir, vocab, task="the_pile")
    with pytest.raises(ValueError, match="evaluation task"):
        config(tfds_dir, vocab, task=st.LAMBADA_TASK)

    def build(**overrides):
        return sp.SeqIOData(config(tfds_dir, vocab, **overrides), global_batch_size=4)

    with pytest.raises(DatasetError, match="does not exist"):
        build(tfds_data_dir=str(tmp_path / "nowhere"))
    with pytest.raises(DatasetError, match=r"the_pile/1\.0\.0.*download_the_pile\.py"):
        build(tfds_data_dir=str(tmp_path))
    with pytest.raises(DatasetError, match=r"c4/en/3\.0\.1"):
        build(tfds_data_dir=str(tmp_path), task=st.C4_TASK)
    with pytest.raises(DatasetError, match="no split 'dev'.*'train', 'validation'"):
        build(eval_split="dev")
    with pytest.raises(VocabError, match="VOCAB_SIZE is 100"):
        build(vocab_size=100)
    with pytest.raises(VocabError, match="does not exist"):
        build(vocab_path=str(tmp_path / "missing.model"))
    with pytest.raises(ValueError, match="multiple of the process count"):
        sp.SeqIOData(config(tfds_dir, vocab), global_batch_size=3, process_count=2)


def test_array_record_datasets_are_refused_with_the_reason(tmp_path, vocab):
    # TFDS 4.9.10 reads array_record only as a random-access data source; `as_dataset` (tf.data,
    # which SeqIO uses) raises NotImplementedError for it.
    import tensorflow_datasets as tfds

    builder = tfds.dataset_builders.store_as_tfds_dataset(
        name="the_pile", version="1.0.0", features=text_features(), data_dir=str(tmp_path),
        file_format="array_record",
        split_datasets={"train": keyed([{"text": "a b"}]), "validation": keyed([{"text": "c"}])})
    with pytest.raises(NotImplementedError):
        builder.as_dataset(split="train")
    with pytest.raises(DatasetError, match="'array_record'.*TFRecord.*--file_format=tfrecord"):
        sp.SeqIOData(config(str(tmp_path), vocab), global_batch_size=4)


def test_module_imports_without_tensorflow():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('tensorflow', 'seqio', 'tensorflow_datasets'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from paxlite.data import seqio_pipeline, seqio_tasks as st\n"
        "seqio_pipeline.SeqIODataConfig(task=st.THE_PILE_TASK, tfds_data_dir='d', vocab_path='v',\n"
        "                               vocab_size=8, seq_len=4)\n"
        "print(st.boolq_prompt(passage='p', question='q', label=1))\n"
        "try:\n"
        "    st.register_tasks(vocab_path='x', tfds_data_dir=None)\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=60)
    assert "('p\\nquestion: q?\\nanswer:', 'yes')" in result.stdout
    assert "pip install 'paxlite[seqio]'" in result.stdout
