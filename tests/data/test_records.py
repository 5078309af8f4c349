"""Raw-input readers and the dataset directory writer/reader, checked against the on-disk contract.

Shards are read back with ArrayRecordReader directly (and once through grain), not only through
paxlite's own reader, so a writer/reader pair that agreed on a wrong format would still fail.
"""

import collections
import gzip
import hashlib
import io
import json
import os
import random

import grain
import numpy as np
import pytest
import zstandard
from array_record.python import array_record_module

from paxlite.data.inputs import Progress, iter_documents
from paxlite.data.records import (
    MANIFEST,
    DatasetError,
    decode_record,
    read_info,
    shard_paths,
    validation_count,
    write_dataset,
)
from paxlite.data.tokenizer import Tokenizer
from paxlite.data.train_tokenizer import train_tokenizer

WORDS = "alpha beta gamma delta river stone light night sound 42 7 über".split()


def make_documents(n: int, *, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))]
        lines += ["second line"] * (i % 2)
        docs.append("\n".join(lines))
    return docs


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    root = tmp_path_factory.mktemp("tok")
    (root / "c.txt").write_text("\n\n".join(make_documents(400, seed=9)))
    return Tokenizer(train_tokenizer([root / "c.txt"], root / "tiny", vocab_size=300))


def read_shard(path: str) -> list[bytes]:
    reader = array_record_module.ArrayRecordReader(path)
    try:
        return reader.read_all()
    finally:
        reader.close()


# ------------------------------------------------------------------------------------------
# iter_documents


def test_text_files_split_on_blank_lines(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("first doc\nstill first\n\n\n\nsecond\n   \nthird\n\n")
    assert list(iter_documents([path])) == ["first doc\nstill first", "second", "third"]
    assert list(iter_documents([path], document_per_file=True)) == [
        "first doc\nstill first\n\n\n\nsecond\n   \nthird"
    ]


def test_jsonl_plain_gzip_and_zstd(tmp_path):
    rows = [{"text": "one", "id": 1}, {"text": "two\nlines"}, {"text": ""}, {"text": "três ✓"}]
    payload = "\n".join(json.dumps(r) for r in rows) + "\n\n"
    (tmp_path / "a.jsonl").write_text(payload)
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(payload)
    # Two zstd frames, as concatenated or parallel-compressed files have.
    data = payload.encode()
    cctx = zstandard.ZstdCompressor()
    (tmp_path / "c.jsonl.zst").write_bytes(cctx.compress(data[:20]) + cctx.compress(data[20:]))
    expected = ["one", "two\nlines", "três ✓"]  # the empty document is skipped
    for name in ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst"]:
        assert list(iter_documents([tmp_path / name])) == expected, name
    (tmp_path / "d.json").write_text(json.dumps({"body": "custom field"}) + "\n")
    assert list(iter_documents([tmp_path / "d.json"], text_field="body")) == ["custom field"]


def test_directory_is_recursive_sorted_and_filtered(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("from b/z")
    (tmp_path / "a.txt").write_text("from a\n\nfrom a again")
    with gzip.open(tmp_path / "b" / "c.txt.gz", "wt") as f:
        f.write("from b/c")
    (tmp_path / "notes.md").write_text("ignored in a directory")
    assert list(iter_documents([tmp_path])) == ["from a", "from a again", "from b/c", "from b/z"]


def test_bad_inputs_fail_early_with_the_path(tmp_path):
    with pytest.raises(DatasetError, match="missing.txt does not exist"):
        iter_documents([tmp_path / "missing.txt"])  # before any iteration
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DatasetError, match=r"x\.csv.*\.jsonl"):
        iter_documents([tmp_path / "x.csv"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="holds no input files"):
        iter_documents([tmp_path / "empty"])
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(DatasetError, match=r"bad\.jsonl:2: not valid JSON"):
        list(iter_documents([tmp_path / "bad.jsonl"]))
    (tmp_path / "field.jsonl").write_text('{"content": "x"}\n')
    with pytest.raises(DatasetError, match=r"field\.jsonl:1: no 'text' field.*content"):
        list(iter_documents([tmp_path / "field.jsonl"]))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DatasetError, match="latin1.txt is not valid UTF-8"):
        list(iter_documents([tmp_path / "latin1.txt"]))


# ------------------------------------------------------------------------------------------
# write_dataset / read_info


@pytest.mark.parametrize(
    ("n", "fraction", "expected"),
    [(0, 0.1, 0), (1, 0.5, 0), (2, 0.01, 1), (100, 0.0, 0), (100, 0.01, 1), (100, 0.126, 13),
     (1000, 0.1, 100), (3, 0.9, 2)],
)
def test_validation_count(n, fraction, expected):
    assert validation_count(n, fraction) == expected


def test_text_round_trip(tmp_path):
    docs = make_documents(103)
    info = write_dataset(tmp_path / "ds", docs, kind="text", tokenizer=None, num_shards=4,
                         validation_fraction=0.1, seed=0, sources=["/in/a.txt"])
    assert info == read_info(tmp_path / "ds")
    assert info.kind == "text" and info.tokenizer is None and info.sources == ("/in/a.txt",)
    assert info.splits["validation"].documents == 10 and info.splits["train"].documents == 93
    assert info.splits["train"].tokens is None
    assert info.splits["train"].shards == tuple(
        f"train-{i:05d}-of-00004.array_record" for i in range(4)
    )
    got = collections.Counter()
    for split in ["train", "validation"]:
        sizes = []
        for path in shard_paths(info, split):
            records = read_shard(path)
            sizes.append(len(records))
            got.update(r.decode("utf-8") for r in records)
            assert [decode_record("text", r) for r in records] == [r.decode() for r in records]
        assert sum(sizes) == info.splits[split].documents
        assert max(sizes) - min(sizes) <= 1  # round-robin
    assert got == collections.Counter(docs)
    # The manifest is exactly the contract's JSON: sorted keys, indent 2.
    text = (tmp_path / "ds" / MANIFEST).read_text()
    manifest = json.loads(text)
    assert text == json.dumps(manifest, sort_keys=True, indent=2) + "\n"
    assert manifest["format_version"] == 1 and manifest["splits"]["train"]["documents"] == 93
    assert sorted(os.listdir(tmp_path / "ds")) == sorted(
        [MANIFEST] + list(info.splits["train"].shards) + list(info.splits["validation"].shards)
    )
    # grain reads the shards as they are.
    assert len(grain.sources.ArrayRecordDataSource(shard_paths(info, "train"))) == 93


def test_same_seed_same_files_other_seed_other_order(tmp_path):
    docs = make_documents(40)
    kwargs = dict(kind="text", tokenizer=None, num_shards=2, validation_fraction=0.1, sources=[])
    paths = {}
    for name, seed in [("a", 5), ("b", 5), ("c", 6)]:
        info = write_dataset(tmp_path / name, docs, seed=seed, **kwargs)
        paths[name] = [read_shard(p) for p in shard_paths(info, "train")]
    assert paths["a"] == paths["b"]
    assert paths["a"] != paths["c"]
    # Documents are shuffled, not only spread over shards: one shard is not in input order.
    distinct = [f"doc {i}" for i in range(50)]
    info = write_dataset(tmp_path / "one", distinct, seed=0, **{**kwargs, "num_shards": 1})
    records = [r.decode() for r in read_shard(shard_paths(info, "train")[0])]
    assert sorted(records, key=distinct.index) != records


def test_tokens_round_trip(tmp_path, tok):
    docs = make_documents(60, seed=1)
    info = write_dataset(tmp_path / "ds", iter(docs), kind="tokens", tokenizer=tok, num_shards=3,
                         validation_fraction=0.05, seed=1, sources=[])
    expected = collections.Counter(np.asarray(tok.encode(d), "<i4").tobytes() for d in docs)
    got = collections.Counter()
    total_tokens = 0
    for split, split_info in info.splits.items():
        records = [r for p in shard_paths(info, split) for r in read_shard(p)]
        got.update(records)
        ids = [decode_record("tokens", r) for r in records]
        assert all(a.dtype == np.int32 for a in ids)
        assert split_info.tokens == sum(len(a) for a in ids)
        total_tokens += split_info.tokens
    assert got == expected
    assert total_tokens == sum(len(tok.encode(d)) for d in docs)
    assert info.splits["validation"].documents == 3
    with open(tok.path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    assert info.tokenizer == {"path": tok.path, "sha256": sha, "vocab_size": 300, "eos_id": 1,
                              "pad_id": 0}


def test_text_with_tokenizer_counts_tokens(tmp_path, tok):
    docs = make_documents(20, seed=2)
    info = write_dataset(tmp_path / "ds", docs, kind="text", tokenizer=tok, num_shards=1,
                         validation_fraction=0.0, seed=0, sources=[])
    assert list(info.splits) == ["train"]  # no empty validation split
    assert info.splits["train"].tokens == sum(len(tok.encode(d)) for d in docs)
    assert info.tokenizer["sha256"] == tok.sha256()
    with pytest.raises(DatasetError, match=r"no split 'validation'.*\['train'\]"):
        shard_paths(info, "validation")


def test_automatic_shard_count_and_more_shards_than_documents(tmp_path):
    info = write_dataset(tmp_path / "auto", make_documents(10), kind="text", tokenizer=None,
                         num_shards=None, validation_fraction=0.2, seed=0, sources=[])
    assert len(info.splits["train"].shards) == 1 and len(info.splits["validation"].shards) == 1
    info = write_dataset(tmp_path / "many", make_documents(5), kind="text", tokenizer=None,
                         num_shards=64, validation_fraction=0.0, seed=0, sources=[])
    assert len(info.splits["train"].shards) == 5  # never an empty shard


def test_refuses_non_empty_directory_and_keeps_its_files(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "precious.txt").write_text("user data")
    with pytest.raises(DatasetError, match="not empty"):
        write_dataset(tmp_path / "ds", ["doc"], kind="text", tokenizer=None, num_shards=1,
                      validation_fraction=0.0, seed=0, sources=[])
    assert os.listdir(tmp_path / "ds") == ["precious.txt"]
    assert (tmp_path / "ds" / "precious.txt").read_text() == "user data"


def test_failure_midway_leaves_no_manifest(tmp_path):
    def documents():
        yield from make_documents(30)
        raise OSError("disk went away")

    (tmp_path / "ds").mkdir()
    with pytest.raises(OSError, match="disk went away"):
        write_dataset(tmp_path / "ds", documents(), kind="text", tokenizer=None, num_shards=2,
                      validation_fraction=0.1, seed=0, sources=[])
    assert os.listdir(tmp_path / "ds") == []  # scratch files removed, no manifest
    with pytest.raises(DatasetError, match="no paxlite_dataset.json"):
        read_info(tmp_path / "ds")
    with pytest.raises(DatasetError, match="no documents"):
        write_dataset(tmp_path / "new", [], kind="text", tokenizer=None, num_shards=1,
                      validation_fraction=0.0, seed=0, sources=["empty.txt"])
    assert not (tmp_path / "new").exists()


def test_manifest_is_written_after_every_shard(tmp_path):
    info = write_dataset(tmp_path / "ds", make_documents(50), kind="text", tokenizer=None,
                         num_shards=3, validation_fraction=0.1, seed=0, sources=[])
    manifest_time = os.stat(tmp_path / "ds" / MANIFEST).st_mtime_ns
    for split in info.splits:
        for path in shard_paths(info, split):
            assert os.stat(path).st_mtime_ns <= manifest_time


def test_bad_arguments(tmp_path, tok):
    common = dict(documents=["x"], num_shards=1, validation_fraction=0.0, seed=0, sources=[])
    with pytest.raises(DatasetError, match="needs a tokenizer"):
        write_dataset(tmp_path / "a", kind="tokens", tokenizer=None, **common)
    with pytest.raises(DatasetError, match=r"unknown dataset kind 'bytes'.*'text', 'tokens'"):
        write_dataset(tmp_path / "b", kind="bytes", tokenizer=None, **common)
    with pytest.raises(DatasetError, match=r"validation_fraction must be in \[0, 1\), got 1.0"):
        write_dataset(tmp_path / "c", kind="text", tokenizer=None,
                      **{**common, "validation_fraction": 1.0})
    with pytest.raises(DatasetError, match="num_shards must be >= 1"):
        write_dataset(tmp_path / "d", kind="text", tokenizer=None, **{**common, "num_shards": 0})
    with pytest.raises(DatasetError, match="must be str, got bytes"):
        write_dataset(tmp_path / "e", kind="text", tokenizer=None,
                      **{**common, "documents": [b"x"]})
    assert not any((tmp_path / name).exists() for name in "abcde")


def test_read_info_errors(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        read_info(tmp_path / "nowhere")
    info = write_dataset(tmp_path / "ds", make_documents(10), kind="text", tokenizer=None,
                         num_shards=2, validation_fraction=0.2, seed=0, sources=[])
    manifest = tmp_path / "ds" / MANIFEST
    good = manifest.read_text()
    manifest.write_text(good[:-20])
    with pytest.raises(DatasetError, match="cannot read"):
        read_info(tmp_path / "ds")
    manifest.write_text(good.replace('"format_version": 1', '"format_version": 7'))
    with pytest.raises(DatasetError, match="format_version 7"):
        read_info(tmp_path / "ds")
    emptied = json.loads(good)
    emptied["splits"]["validation"] = {"shards": [], "documents": 0, "tokens": None}
    manifest.write_text(json.dumps(emptied))
    with pytest.raises(DatasetError, match="split 'validation' is empty"):
        shard_paths(read_info(tmp_path / "ds"), "validation")  # other splits stay usable
    assert len(shard_paths(read_info(tmp_path / "ds"), "train")) == 2
    manifest.write_text(good)
    os.remove(shard_paths(info, "train")[1])
    with pytest.raises(DatasetError, match="train-00001-of-00002.array_record.*missing"):
        read_info(tmp_path / "ds")


def test_decode_record_errors():
    np.testing.assert_array_equal(
        decode_record("tokens", np.asarray([1, 70000, 3], "<i4").tobytes()), [1, 70000, 3]
    )
    with pytest.raises(DatasetError, match="7 bytes"):
        decode_record("tokens", b"1234567")
    with pytest.raises(DatasetError, match="unknown dataset kind"):
        decode_record("pixels", b"")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_on_a_terminal_and_prints_lines_otherwise():
    tty = _Terminal()
    progress = Progress(enabled=True, stream=tty, interval_s=0.0)
    progress.update("reading: 10 documents")
    progress.update("reading: 9")
    progress.close()
    # The shorter second message is padded to blank out the longer first one (21 characters).
    assert tty.getvalue() == "\rreading: 10 documents" + "\rreading: 9" + " " * 11 + "\n"
    log = io.StringIO()
    progress = Progress(enabled=True, stream=log, interval_s=0.0)
    progress.update("a")
    progress.update("b")
    progress.close()
    assert log.getvalue() == "a\nb\n"
    quiet = io.StringIO()
    Progress(enabled=False, stream=quiet, interval_s=0.0).update("x", force=True)
    assert quiet.getvalue() == ""
