"""Pax's TFDS datasets (The Pile, Lambada, BoolQ, C4), built and read without TensorFlow.

Pax's GPU scripts stored The Pile as TFDS `the_pile:1.0.0`, Lambada as `my_lambada:1.0.0` and BoolQ
as `super_glue/boolq`, under one `--tfds_data_dir`. paxlite writes the same names, versions and
features, so a directory made by either tool serves both. Two things differ from Pax on purpose:

* The original Pile host has been gone since October 2023 and SuperGLUE's zip may be unreachable
  from a cluster, so every builder also takes local files in the original formats.
* The default storage format is ArrayRecord, which TFDS reads as a random-access `data_source`
  without TensorFlow; that is what paxlite's Grain path needs (it shuffles by index and resumes from
  a position). `file_format="tfrecord"` (needs TensorFlow) writes what Pax wrote, for SeqIO readers
  that need it.

`tensorflow_datasets` is imported only inside functions: the rest of paxlite never pays for it.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import json
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from paxlite.data.errors import DatasetError
from paxlite.data.inputs import iter_documents
from paxlite.data.lambada import read_lambada

FILE_FORMATS = ("array_record", "tfrecord")
PILE_URL = "https://the-eye.eu/public/AI/pile/"
LAMBADA_URL = "https://raw.githubusercontent.com/cybertronai/bflm/master/lambada_test.jsonl"
BOOLQ_URL = "https://dl.fbaipublicfiles.com/glue/superglue/data/v2/BoolQ.zip"
TFDS_DATA_DIR_ENV = "TFDS_DATA_DIR"


@dataclasses.dataclass(frozen=True)
class TfdsName:
    """`name[/config]:version` as TFDS and SeqIO spell it, e.g. `super_glue/boolq:1.0.2`."""

    name: str
    config: str | None
    version: str

    @classmethod
    def parse(cls, text: str) -> TfdsName:
        base, sep, version = text.partition(":")
        name, _, config = base.partition("/")
        if not sep or not name or not version or version.count(".") != 2:
            raise DatasetError(
                f"TFDS dataset {text!r} must be spelled name[/config]:X.Y.Z, e.g. 'the_pile:1.0.0' "
                "or 'c4/en:3.0.1'"
            )
        return cls(name=name, config=config or None, version=version)

    def __str__(self) -> str:
        config = f"/{self.config}" if self.config else ""
        return f"{self.name}{config}:{self.version}"

    def directory(self, data_dir: str) -> str:
        """Where TFDS keeps this version: <data_dir>/<name>[/<config>]/<version>."""
        parts = [data_dir, self.name] + ([self.config] if self.config else []) + [self.version]
        return os.path.join(*parts)


THE_PILE = TfdsName.parse("the_pile:1.0.0")
LAMBADA = TfdsName.parse("my_lambada:1.0.0")
BOOLQ = TfdsName.parse("super_glue/boolq:1.0.2")
C4 = TfdsName.parse("c4/en:3.0.1")
# The datasets whose text feature paxlite trains a language model on, and that feature's name.
LM_TEXT_FEATURES = {THE_PILE.name: "text", C4.name: "text"}
DOWNLOAD_SCRIPTS = {
    THE_PILE.name: "scripts_gpu/download_the_pile.py",
    LAMBADA.name: "scripts_gpu/download_lambada.py",
    BOOLQ.name: "scripts_gpu/download_boolq.py",
}


def _tfds():
    """tensorflow_datasets, or an error that says how to get it (it is an extra, not a core
    dependency)."""
    try:
        import tensorflow_datasets
    except ImportError as e:
        raise DatasetError(
            f"TFDS datasets need tensorflow_datasets ({e}): pip install 'paxlite[tfds]' (no "
            "TensorFlow) or 'paxlite[seqio]'"
        ) from e
    return tensorflow_datasets


def resolve_data_dir(data_dir: str | None) -> str:
    """The flag's value, else the TFDS_DATA_DIR environment variable (as TFDS and Pax's scripts
    read)."""
    chosen = data_dir or os.environ.get(TFDS_DATA_DIR_ENV)
    if not chosen:
        raise DatasetError(
            "no TFDS data directory: pass --tfds_data_dir=DIR (or --data_dir=DIR) or set "
            "TFDS_DATA_DIR"
        )
    return os.path.abspath(os.path.expanduser(chosen))


# --------------------------------------------------------------------------------------------------
# Reading.


def check_prepared(spec: TfdsName, data_dir: str) -> str:
    """The dataset's version directory, or an error that says which script makes it."""
    if not os.path.isdir(data_dir):
        raise DatasetError(f"TFDS data directory {data_dir!r} does not exist")
    directory = spec.directory(data_dir)
    if not os.path.isfile(os.path.join(directory, "dataset_info.json")):
        script = DOWNLOAD_SCRIPTS.get(spec.name)
        how = f"; make it with python {script} --data_dir={data_dir}" if script else ""
        found = sorted(
            n for n in os.listdir(data_dir) if not n.startswith(".") and n != "downloads"
        )
        raise DatasetError(
            f"TFDS dataset {spec} is not in {data_dir!r} (no {directory}/dataset_info.json; the "
            f"directory holds {found}){how}"
        )
    return directory


def _file_format(directory: str) -> str:
    with open(os.path.join(directory, "dataset_info.json")) as f:
        info = json.load(f)
    return info.get("fileFormat", "tfrecord")


def split_sizes(spec: TfdsName, data_dir: str) -> dict[str, int]:
    """Examples per split, from dataset_info.json (no TFDS import)."""
    with open(os.path.join(check_prepared(spec, data_dir), "dataset_info.json")) as f:
        info = json.load(f)
    return {
        split["name"]: sum(int(n) for n in split.get("shardLengths", []))
        for split in info.get("splits", [])
    }


def open_split(spec: TfdsName, data_dir: str, split: str):
    """A random-access TFDS data source (decoded dicts, bytes for text) of one split."""
    directory = check_prepared(spec, data_dir)
    file_format = _file_format(directory)
    if file_format != "array_record":
        raise DatasetError(
            f"TFDS dataset {spec} in {data_dir!r} is stored as {file_format}, which can only be "
            "streamed through TensorFlow: use --fdl.INPUT_PIPELINE=seqio (pip install "
            "'paxlite[seqio]'), or rebuild it as array_record with "
            f"{DOWNLOAD_SCRIPTS.get(spec.name, 'the download script')}"
        )
    sizes = split_sizes(spec, data_dir)
    if split not in sizes:
        raise DatasetError(f"TFDS dataset {spec} in {data_dir!r} has no split {split!r}; it has "
                           f"{sorted(sizes)}")
    return _tfds().builder_from_directory(directory).as_data_source(split=split)


# ArrayRecord's words for a file that is not there (removed, or its filesystem unmounted)
_MISSING_FILE = re.compile(r"open\(\) failed: No such file or directory; opening (\S+)")


class TextFeatureSource:
    """One text feature of a TFDS split as UTF-8 bytes: the record interface paxlite's text pipeline
    reads."""

    def __init__(self, source, *, feature: str):
        self._source = source
        self._feature = feature

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> bytes:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[bytes]:
        try:
            examples = self._source.__getitems__(list(indices))
        except RuntimeError as error:  # ArrayRecord opens each file at its first read
            found = _MISSING_FILE.search(str(error))
            if found is None:
                raise
            # Python's error naming the file: the loop reports it in one line with the step
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT),
                                    found.group(1)) from error
        return [example[self._feature] for example in examples]


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def read_lambada_examples(data_dir: str, *, split: str = "test") -> list[tuple[str, str]]:
    """(inputs, target) pairs of `my_lambada`, in TFDS's stored order (the same on every run).

    A TFRecord copy (what Pax's script wrote) is streamed through TensorFlow, which then must be
    installed.
    """
    directory = check_prepared(LAMBADA, data_dir)
    if _file_format(directory) == "array_record":
        source = open_split(LAMBADA, data_dir, split)
        rows = source.__getitems__(range(len(source)))
    else:
        import importlib.util

        if importlib.util.find_spec("tensorflow") is None:  # TFDS streams TFRecord files through it
            raise DatasetError(
                f"TFDS dataset {LAMBADA} in {data_dir!r} is stored as TFRecord, which needs "
                "TensorFlow (pip install 'paxlite[seqio]'), or rebuild it with "
                "scripts_gpu/download_lambada.py"
            )
        rows = _tfds().builder_from_directory(directory).as_dataset(split=split).as_numpy_iterator()
    examples = [(_text(ex["inputs"]), _text(ex["targets"])) for ex in rows]
    if not examples:
        raise DatasetError(f"TFDS dataset {LAMBADA} in {data_dir!r}: split {split!r} is empty")
    return examples


# --------------------------------------------------------------------------------------------------
# Building (the download scripts).


def _pile_files(local_dir: str) -> dict[str, list[str]]:
    """The Pile's own layout: train/NN.jsonl.zst, val.jsonl.zst, test.jsonl.zst (test optional)."""
    if not os.path.isdir(local_dir):
        raise DatasetError(f"--local_dir {local_dir!r} is not a directory")
    patterns = {
        "train": [
            os.path.join(local_dir, "train", "*.jsonl*"),
            os.path.join(local_dir, "train*.jsonl*"),
        ],
        "validation": [os.path.join(local_dir, "val*.jsonl*")],
        "test": [os.path.join(local_dir, "test*.jsonl*")],
    }
    files = {
        split: sorted({p for g in globs for p in glob.glob(g)}) for split, globs in patterns.items()
    }
    if not files["train"]:
        raise DatasetError(
            f"{local_dir!r} holds no training shards: expected The Pile's layout "
            "train/00.jsonl.zst ... plus val.jsonl.zst (and test.jsonl.zst)"
        )
    if not files["validation"]:
        raise DatasetError(f"{local_dir!r} holds no val.jsonl.zst (The Pile's validation split)")
    return {split: paths for split, paths in files.items() if paths}


def _pile_examples(paths: Sequence[str]) -> Iterator[tuple[str, dict[str, str]]]:
    for index, text in enumerate(
        iter_documents(list(paths), text_field="text", document_per_file=False)
    ):
        yield f"{index:012d}", {"text": text}


def _boolq_examples(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                label = row.get("label")
                example = {
                    "idx": int(row["idx"]),
                    "passage": str(row["passage"]),
                    "question": str(row["question"]),
                    # SuperGLUE's test file has no labels; TFDS stores -1 there.
                    "label": -1 if label is None else int(bool(label)),
                }
            except (ValueError, KeyError, TypeError) as e:
                raise DatasetError(
                    f"{path}:{number}: not a BoolQ line with idx, passage, question (and label): "
                    f"{e}"
                ) from e
            yield example["idx"], example


def _boolq_files(local_dir: str) -> dict[str, str]:
    names = {"train": "train.jsonl", "validation": "val.jsonl", "test": "test.jsonl"}
    files = {
        s: os.path.join(local_dir, n)
        for s, n in names.items()
        if os.path.isfile(os.path.join(local_dir, n))
    }
    if "train" not in files or "validation" not in files:
        raise DatasetError(
            f"{local_dir!r} must hold BoolQ's train.jsonl and val.jsonl (SuperGLUE's BoolQ.zip, "
            "unpacked); found "
            f"{sorted(os.listdir(local_dir)) if os.path.isdir(local_dir) else 'no such directory'}"
        )
    return files


def _builder_classes():
    """The three builders; defined on demand because their base class comes from
    tensorflow_datasets."""
    import numpy as np

    tfds = _tfds()

    class ThePile(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        """`the_pile:1.0.0`: one `text` feature; splits train, validation (and test)."""

        VERSION = tfds.core.Version(THE_PILE.version)

        def __init__(self, *, local_dir: str | None, **kwargs):
            self._local_dir = local_dir
            super().__init__(**kwargs)

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
                homepage="https://pile.eleuther.ai/")

        def _split_generators(self, dl_manager):
            if self._local_dir is None:
                urls = {
                    "train": [f"{PILE_URL}train/{i:02d}.jsonl.zst" for i in range(30)],
                    "validation": [f"{PILE_URL}val.jsonl.zst"],
                    "test": [f"{PILE_URL}test.jsonl.zst"],
                }
                try:
                    files = dl_manager.download(urls)
                except Exception as e:  # network errors come in many types; all mean the same here
                    raise DatasetError(
                        f"could not download The Pile from {PILE_URL} ({type(e).__name__}: {e}); "
                        "its original host has been unavailable since October 2023: pass "
                        "--local_dir=DIR holding train/NN.jsonl.zst and val.jsonl.zst") from e
                files = {split: [os.fspath(p) for p in paths] for split, paths in files.items()}
            else:
                files = _pile_files(self._local_dir)
            return {split: self._generate_examples(paths) for split, paths in files.items()}

        def _generate_examples(self, paths):
            return _pile_examples(paths)

    class MyLambada(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        """`my_lambada:1.0.0`: the OpenAI Lambada test set split into `inputs` and `targets` (' ' +
        last word)."""

        VERSION = tfds.core.Version(LAMBADA.version)

        def __init__(self, *, local_file: str | None, **kwargs):
            self._local_file = local_file
            super().__init__(**kwargs)

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                {"inputs": tfds.features.Text(), "targets": tfds.features.Text()}))

        def _split_generators(self, dl_manager):
            path = self._local_file
            if path is None:
                try:
                    path = os.fspath(dl_manager.download(LAMBADA_URL))
                except Exception as e:
                    raise DatasetError(
                        f"could not download {LAMBADA_URL} ({type(e).__name__}: {e}); pass "
                        "--local_file=lambada_test.jsonl") from e
            return {"test": self._generate_examples(path)}

        def _generate_examples(self, path):
            try:
                examples = read_lambada(path)
            except ValueError as e:
                raise DatasetError(str(e)) from e
            for index, (inputs, targets) in enumerate(examples):
                yield index, {"inputs": inputs, "targets": targets}

    class SuperGlue(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        """`super_glue/boolq:1.0.2`, with the features of TFDS's own SuperGLUE builder (label -1 =
        none)."""

        VERSION = tfds.core.Version(BOOLQ.version)
        BUILDER_CONFIGS: ClassVar[list] = [
            tfds.core.BuilderConfig(name="boolq", description="BoolQ yes/no questions")
        ]

        def __init__(self, *, local_dir: str | None, **kwargs):
            self._local_dir = local_dir
            super().__init__(config="boolq", **kwargs)

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
                "question": tfds.features.Text(), "passage": tfds.features.Text(),
                "idx": tfds.features.Scalar(dtype=np.int32),
                "label": tfds.features.ClassLabel(names=["False", "True"]),
            }))

        def _split_generators(self, dl_manager):
            local_dir = self._local_dir
            if local_dir is None:
                try:
                    local_dir = os.path.join(
                        os.fspath(dl_manager.download_and_extract(BOOLQ_URL)), "BoolQ"
                    )
                except Exception as e:
                    raise DatasetError(
                        f"could not download {BOOLQ_URL} ({type(e).__name__}: {e}); pass "
                        "--local_dir=DIR holding BoolQ's train.jsonl and val.jsonl"
                    ) from e
            return {
                split: self._generate_examples(path)
                for split, path in _boolq_files(local_dir).items()
            }

        def _generate_examples(self, path):
            return _boolq_examples(path)

    return {THE_PILE.name: ThePile, LAMBADA.name: MyLambada, BOOLQ.name: SuperGlue}


def build(
    spec: TfdsName, *, data_dir: str, file_format: str = "array_record", **sources: str | None
) -> str:
    """Writes `spec` under `data_dir` from local files (`sources`) or its original URL; returns its
    directory.

    A dataset that is already there is left alone (TFDS never rebuilds a finished version), so
    rerunning a download script is safe.
    """
    if file_format not in FILE_FORMATS:
        raise DatasetError(f"--file_format={file_format!r}: valid formats are {list(FILE_FORMATS)}")
    builders = _builder_classes()
    if spec.name not in builders:
        raise DatasetError(f"paxlite builds {sorted(builders)}, not {spec.name!r}")
    os.makedirs(data_dir, exist_ok=True)
    builder = builders[spec.name](data_dir=data_dir, file_format=file_format, **sources)
    directory = spec.directory(data_dir)
    if os.path.isfile(os.path.join(directory, "dataset_info.json")):
        existing = _file_format(directory)
        if existing != file_format:
            raise DatasetError(
                f"{directory} already holds {spec} as {existing}; remove it first to rebuild it as "
                f"{file_format}"
            )
    builder.download_and_prepare()
    return directory


def download_main(
    spec: TfdsName, *, source_flag: str, source_help: str, argv: Sequence[str] | None = None
) -> int:
    """The command line the three download scripts share (Pax's scripts read TFDS_DATA_DIR; so do
    these)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        description=f"Write TFDS {spec} under --data_dir (default: $TFDS_DATA_DIR), as Pax's "
                    "scripts did.")
    parser.add_argument("--data_dir", default=None, help="TFDS data directory (default: "
                                                         "$TFDS_DATA_DIR)")
    parser.add_argument(f"--{source_flag}", default=None, help=source_help)
    parser.add_argument("--file_format", default="array_record", choices=FILE_FORMATS,
                        help="array_record (random access, no TensorFlow needed) or tfrecord (what "
                             "Pax wrote)")
    args = parser.parse_args(argv)
    try:
        data_dir = resolve_data_dir(args.data_dir)
        source = getattr(args, source_flag)
        if source is not None and not os.path.exists(source):
            raise DatasetError(f"--{source_flag} {source!r} does not exist")
        directory = build(
            spec, data_dir=data_dir, file_format=args.file_format, **{source_flag: source}
        )
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sizes = split_sizes(spec, data_dir)
    print(
        f"{spec} is in {directory}: "
        + ", ".join(f"{split} {n:,} examples" for split, n in sizes.items())
    )
    return 0
