"""Pax's TFDS datasets built from tiny local files by the download scripts, then read without
TensorFlow."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece as spm
import zstandard

from paxlite.data import tfds_datasets as td
from paxlite.data.errors import DatasetError
from paxlite.data.lambada import split_lambada
from paxlite.data.pipeline import TextData, TextDataConfig
from tests.data.test_pipeline import spm_model  # noqa: F401  (a fixture)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PILE_DOCS = [f"the pile document {i} " + "some words here " * (i % 5) for i in range(30)]
LAMBADA_TEXTS = [
    "she opened the door and saw the \u201cgarden\u201d",
    "he ate an apple",
    "they sailed a ship",
]


def _write_zst(path, docs) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lines = "".join(json.dumps({"text": d, "meta": {"pile_set_name": "test"}}) + "\n" for d in docs)
    with open(path, "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(lines.encode()))


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    """The Pile's own layout, OpenAI's lambada_test.jsonl and SuperGLUE's BoolQ files, tiny."""
    root = tmp_path_factory.mktemp("raw")
    _write_zst(str(root / "pile" / "train" / "00.jsonl.zst"), PILE_DOCS[:15])
    _write_zst(str(root / "pile" / "train" / "01.jsonl.zst"), PILE_DOCS[15:26])
    _write_zst(str(root / "pile" / "val.jsonl.zst"), PILE_DOCS[26:])
    (root / "lambada.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in LAMBADA_TEXTS)
    )
    (root / "boolq").mkdir()
    for name, labels in (
        ("train", [True, False, True]),
        ("val", [False, True]),
        ("test", [None, None]),
    ):
        rows = [{"question": f"is {name} {i} true", "passage": f"passage {i}", "idx": i}
                | ({} if label is None else {"label": label}) for i, label in enumerate(labels)]
        (root / "boolq" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _script(name: str, *args: str, env_dir: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("TFDS_DATA_DIR", None)
    if env_dir is not None:
        env["TFDS_DATA_DIR"] = env_dir
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts_gpu", f"download_{name}.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def tfds_dir(raw, tmp_path_factory) -> str:
    """Built by the three scripts, as a user would (TFDS_DATA_DIR from the environment)."""
    data_dir = str(tmp_path_factory.mktemp("tfds"))
    for name, arg in (
        ("the_pile", f"--local_dir={raw / 'pile'}"),
        ("lambada", f"--local_file={raw / 'lambada.jsonl'}"),
        ("boolq", f"--local_dir={raw / 'boolq'}"),
    ):
        done = _script(name, arg, env_dir=data_dir)
        assert done.returncode == 0, done.stderr[-2000:]
    return data_dir


def test_scripts_write_pax_names_versions_and_split_sizes(tfds_dir):
    assert td.split_sizes(td.THE_PILE, tfds_dir) == {"train": 26, "validation": 4}
    assert td.split_sizes(td.LAMBADA, tfds_dir) == {"test": 3}
    assert td.split_sizes(td.BOOLQ, tfds_dir) == {"train": 3, "validation": 2, "test": 2}
    for rel in ("the_pile/1.0.0", "my_lambada/1.0.0", "super_glue/boolq/1.0.2"):
        assert os.path.isfile(os.path.join(tfds_dir, rel, "dataset_info.json")), rel


def test_pile_documents_are_the_input_documents(tfds_dir):
    source = td.TextFeatureSource(td.open_split(td.THE_PILE, tfds_dir, "train"), feature="text")
    texts = [b.decode() for b in source.__getitems__(range(len(source)))]
    assert collections.Counter(texts) == collections.Counter(PILE_DOCS[:26])
    assert source[3] == source.__getitems__([3])[0]


def test_lambada_examples_are_split_as_pax_does(tfds_dir):
    examples = td.read_lambada_examples(tfds_dir)
    assert sorted(examples) == sorted(split_lambada(t) for t in LAMBADA_TEXTS)
    assert ("she opened the door and saw the", ' "garden"') in examples  # curly quotes made ASCII


def test_boolq_keeps_labels_and_marks_unlabelled_test_rows(tfds_dir):
    by_split = {}
    for split in ("train", "validation", "test"):
        source = td.open_split(td.BOOLQ, tfds_dir, split)
        by_split[split] = sorted((int(e["idx"]), int(e["label"]), e["question"].decode())
                                 for e in source.__getitems__(range(len(source))))
    assert by_split["train"] == [
        (0, 1, "is train 0 true"),
        (1, 0, "is train 1 true"),
        (2, 1, "is train 2 true"),
    ]
    assert [label for _, label, _ in by_split["validation"]] == [0, 1]
    assert [label for _, label, _ in by_split["test"]] == [-1, -1]


def test_rerunning_a_script_keeps_the_dataset(raw, tfds_dir):
    info = os.path.join(tfds_dir, "the_pile", "1.0.0", "dataset_info.json")
    before = os.stat(info).st_mtime_ns
    done = _script("the_pile", f"--local_dir={raw / 'pile'}", f"--data_dir={tfds_dir}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert os.stat(info).st_mtime_ns == before


def test_script_errors_name_the_problem(raw, tmp_path):
    no_dir = _script("the_pile", f"--local_dir={raw / 'pile'}")
    assert no_dir.returncode == 2 and "TFDS_DATA_DIR" in no_dir.stderr
    missing = _script(
        "lambada", f"--local_file={tmp_path / 'nope.jsonl'}", f"--data_dir={tmp_path}"
    )
    assert (
        missing.returncode == 2
        and "nope.jsonl" in missing.stderr
        and "does not exist" in missing.stderr
    )
    (tmp_path / "pile" / "train").mkdir(parents=True)
    _write_zst(str(tmp_path / "pile" / "train" / "00.jsonl.zst"), ["a"])
    no_val = _script(
        "the_pile", f"--local_dir={tmp_path / 'pile'}", f"--data_dir={tmp_path / 'out'}"
    )
    assert no_val.returncode == 2 and "val.jsonl.zst" in no_val.stderr


def test_reading_errors_say_how_to_make_the_dataset(tfds_dir, tmp_path):
    with pytest.raises(DatasetError, match=r"download_the_pile\.py"):
        td.check_prepared(td.THE_PILE, str(tmp_path))
    with pytest.raises(DatasetError, match="has no split 'train'.*'test'"):
        td.open_split(td.LAMBADA, tfds_dir, "train")
    with pytest.raises(DatasetError, match="name\\[/config\\]:X.Y.Z"):
        td.TfdsName.parse("the_pile")
    assert str(td.TfdsName.parse("c4/en:3.0.1")) == "c4/en:3.0.1"


def test_a_tfrecord_dataset_is_refused_with_the_seqio_hint(tfds_dir, tmp_path):
    """Random access needs ArrayRecord; a TFRecord dataset (what Pax wrote) is pointed at the SeqIO
    path."""
    import shutil

    copy = tmp_path / "tf" / "the_pile" / "1.0.0"
    shutil.copytree(os.path.join(tfds_dir, "the_pile", "1.0.0"), copy)
    info = json.loads((copy / "dataset_info.json").read_text())
    info["fileFormat"] = "tfrecord"
    (copy / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(DatasetError, match="INPUT_PIPELINE=seqio"):
        td.open_split(td.THE_PILE, str(tmp_path / "tf"), "train")


def test_text_pipeline_trains_on_the_pile_from_tfds(tfds_dir, spm_model):  # noqa: F811
    """One epoch of packed rows holds exactly every training document's tokens plus its EOS."""
    proc = spm.SentencePieceProcessor(model_file=spm_model)
    expected = collections.Counter()
    total = 0
    for doc in PILE_DOCS[:26]:
        ids = proc.encode(doc) + [1]
        expected.update(ids)
        total += len(ids)
    seq_len, batch = 16, 2
    config = TextDataConfig(
        data_dir=tfds_dir,
        tfds_name="the_pile:1.0.0",
        vocab_path=spm_model,
        vocab_size=300,
        seq_len=seq_len,
        seed=3,
    )
    data = TextData(config, global_batch_size=batch)
    iterator = data.train_iterator()
    got = collections.Counter()
    rows_needed = -(-total // seq_len)
    tokens: list[np.ndarray] = []
    while len(tokens) * batch < rows_needed:
        tokens.append(next(iterator)["targets"])
    flat = np.concatenate(tokens).reshape(-1)[:total]
    got.update(flat.tolist())
    assert got == expected
    assert data.num_eval_batches() == 2  # 4 validation documents, 2 per batch
    eval_targets = [b["targets"][b["weights"] > 0].tolist() for b in data.eval_batches(-1)]
    # unpacked, one document per row, truncated to seq_len
    assert sum(len(t) for t in eval_targets) == sum(
        min(len(proc.encode(d)) + 1, seq_len) for d in PILE_DOCS[26:]
    )
    # resume from the saved position gives the same next batch
    state = iterator.get_state()
    following = next(iterator)
    again = TextData(config, global_batch_size=batch).train_iterator()
    again.set_state(state)
    np.testing.assert_array_equal(next(again)["targets"], following["targets"])


def test_tfds_reading_needs_no_tensorflow(tfds_dir, raw, tmp_path):
    """Build and read with TensorFlow made unimportable: the default path must never need it."""
    code = (
        "import sys\n"
        "from importlib.machinery import PathFinder\n"
        "class NoTensorFlow(PathFinder):  # TensorFlow looks not installed, even to find_spec\n"
        "    @classmethod\n"
        "    def find_spec(cls, name, path=None, target=None):\n"
        "        return None if name.split('.')[0] == 'tensorflow' else super().find_spec(name, "
        "path, target)\nsys.meta_path = [NoTensorFlow if f is PathFinder else f for f in "
        "sys.meta_path]\n"
        "from paxlite.data import tfds_datasets as td\n"
        f"td.build(td.LAMBADA, data_dir={str(tmp_path)!r}, "
        f"local_file={str(raw / 'lambada.jsonl')!r})\n"
        f"print(len(td.read_lambada_examples({str(tmp_path)!r})))\n"
        f"s = td.open_split(td.THE_PILE, {tfds_dir!r}, 'validation'); print(len(s.__getitems__([0, "
        "1])))\nassert 'tensorflow' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=REPO), check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["3", "2"]
