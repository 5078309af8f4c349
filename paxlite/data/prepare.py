"""Turn corpora into a paxlite dataset directory: `python -m paxlite.data.prepare`.

Inputs: text, JSONL (plain, .gz, .zst), Parquet and `save_to_disk` folders (paxlite.data.inputs),
or a Hugging Face hub dataset through `datasets.load_dataset` (`--hf_dataset`, when `datasets` is
installed and the hub reachable; imported only then).

With `--vocab_path` the documents are tokenized once here (kind "tokens"), so training never spends
host CPU on tokenization; without it the records hold raw text (kind "text") and the pipeline
tokenizes on the fly. User mistakes (missing or empty input, a non-empty output directory) end with
exit status 2 and one `prepare: error: ...` line, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator, Sequence

from paxlite.data.inputs import iter_documents, list_input_files
from paxlite.data.records import DatasetError, DatasetInfo, Kind, shard_paths, write_dataset
from paxlite.data.row_files import BadRows, Column, check_row, is_dataset_dict
from paxlite.data.tokenizer import Tokenizer, VocabError
from paxlite.errors import exit_status
from paxlite.paths import UnsupportedPathError, require_local_path


def prepare(
    inputs: Sequence[str | os.PathLike],
    output_dir: str | os.PathLike,
    *,
    vocab_path: str | os.PathLike | None = None,
    num_shards: int | None = None,
    validation_fraction: float = 0.01,
    seed: int = 0,
    text_field: str = "text",
    document_per_file: bool = False,
    split: str | None = None,
    hf_dataset: str | None = None,
    progress: bool = False,
) -> DatasetInfo:
    """Reads `inputs` (or the hub dataset `hf_dataset`, NAME[:CONFIG], when `inputs` is empty)
    and writes a dataset into the new or empty `output_dir`.

    `text_field` is the JSONL field or the table column holding the text (--text_column);
    `split` chooses the split of `hf_dataset` or of DatasetDict folders among `inputs`.
    """
    if inputs and hf_dataset is not None:
        raise DatasetError("give --input or --hf_dataset, not both")
    for path in inputs:
        require_local_path(path, setting="--input")
    require_local_path(output_dir, setting="--output_dir")
    if vocab_path is not None:
        require_local_path(vocab_path, setting="--vocab_path")
    if vocab_path is not None and not os.path.exists(os.fspath(vocab_path)):
        raise VocabError(f"tokenizer file {os.fspath(vocab_path)!r} (--vocab_path) does not exist")
    tokenizer = Tokenizer(vocab_path) if vocab_path is not None else None
    if hf_dataset is not None:
        documents = hub_documents(hf_dataset, split=split, text_column=text_field)
        sources = [f"hf_dataset={hf_dataset} split={split}"]
    else:
        if split is not None and not any(
                os.path.isdir(p) and is_dataset_dict(p) for p in list_input_files(inputs)):
            raise DatasetError(f"--split={split} chooses the split of --hf_dataset or of a "
                               "DatasetDict folder, and no --input is one")
        documents = iter_documents(inputs, text_field=text_field,
                                   document_per_file=document_per_file, split=split,
                                   text_setting="--text_column")
        sources = [os.path.abspath(os.fspath(p)) for p in inputs]
    return write_dataset(
        output_dir,
        documents,
        kind=Kind.TEXT.value if tokenizer is None else Kind.TOKENS.value,
        tokenizer=tokenizer,
        num_shards=num_shards,
        validation_fraction=validation_fraction,
        seed=seed,
        sources=sources,
        progress=progress,
    )


def hub_documents(spec: str, *, split: str | None, text_column: str) -> Iterator[str]:
    """The `text_column` values of split `split` of the hub dataset `spec` (NAME[:CONFIG]),
    loaded by `datasets.load_dataset` (cached by it); empty ones are skipped, as in files."""
    if split is None:
        raise DatasetError(f"--hf_dataset={spec} needs --split (e.g. --split=train)")
    try:
        import datasets
    except ImportError as e:
        raise DatasetError("--hf_dataset needs the datasets package: pip install datasets") from e
    name, _, config = spec.partition(":")
    try:
        dataset = datasets.load_dataset(name, config or None, split=split)
    except (FileNotFoundError, ConnectionError, ValueError) as e:
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DatasetError(f"--hf_dataset={spec} --split={split}: {first_line}") from e
    column = Column(text_column, (str,), "a string", may_be_empty=True,
                    hint="; choose the column with --text_column")
    if text_column in dataset.column_names:
        dataset = dataset.select_columns([text_column])

    def generate() -> Iterator[str]:
        for number, row in enumerate(dataset):
            where = f"{spec} split {split}:row {number}"
            check_row(where, row, columns=[column], on_bad_row=BadRows.RAISE, skipped=None)
            if row[text_column].strip():
                yield row[text_column]

    return generate()


VALIDATION_SPLIT = "validation"


def no_validation_warning(info: DatasetInfo) -> str:
    """Why the dataset has no validation split, and what training on it will do."""
    documents = sum(split.documents for split in info.splits.values())
    why = ("the corpus has a single document" if documents < 2
           else "--validation_fraction is 0")
    return (
        f"prepare: warning: no validation split written ({why}); training on {info.directory} "
        "runs without evaluation (it says so in its log) unless --fdl.EVAL_TASK names another "
        "task; --validation_fraction=0.01 (and at least 2 documents) writes one"
    )


def summary(info: DatasetInfo, *, seconds: float) -> str:
    """A small table of what was written: documents, tokens, shards and bytes per split."""
    lines = [f"prepared {info.kind} dataset in {seconds:.1f} s: {info.directory}"]
    if info.tokenizer is not None:
        lines.append(
            f"  tokenizer {info.tokenizer['path']} (vocab_size {info.tokenizer['vocab_size']})"
        )
    lines.append(f"  {'split':<12}{'documents':>12}{'tokens':>14}{'shards':>8}{'bytes':>16}")
    total = 0
    for name, split in info.splits.items():
        nbytes = sum(os.path.getsize(p) for p in shard_paths(info, name))
        total += nbytes
        tokens = "-" if split.tokens is None else f"{split.tokens:,}"
        lines.append(
            f"  {name:<12}{split.documents:>12,}{tokens:>14}{len(split.shards):>8}{nbytes:>16,}"
        )
    lines.append(f"  total bytes {total:,}")
    return "\n".join(lines)


def _fraction(value: str) -> float:
    number = float(value)
    if not 0.0 <= number < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return number


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return number


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m paxlite.data.prepare",
        description="Write text/JSONL/Parquet corpora or save_to_disk folders as a paxlite "
                    "dataset (ArrayRecord + manifest).",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", nargs="+", metavar="PATH",
                        help=".txt/.jsonl/.json files (optionally .gz/.zst), .parquet files, "
                             "save_to_disk folders, or directories of them")
    source.add_argument("--hf_dataset", default=None, metavar="NAME[:CONFIG]",
                        help="a Hugging Face hub dataset, loaded by datasets.load_dataset "
                             "(needs the datasets package and the hub; with --split)")
    parser.add_argument("--split", default=None,
                        help="the split of --hf_dataset or of DatasetDict folders")
    parser.add_argument("--output_dir", required=True, metavar="DIR",
                        help="new or empty directory to write")
    parser.add_argument("--vocab_path", default=None, metavar="PATH",
                        help="tokenizer (SentencePiece or tiktoken .model, tokenizer.json, or a "
                             "directory holding one): store token ids (default: store raw text)")
    parser.add_argument("--num_shards", type=_positive, default=None,
                        help="train shards (default: about one per 64 MiB)")
    parser.add_argument("--validation_fraction", type=_fraction, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text_column", "--text_field", dest="text_column", default="text",
                        help="JSONL field or Parquet/Arrow column holding the text")
    parser.add_argument("--document_per_file", action="store_true",
                        help="each .txt file is one document (default: blank-line paragraphs)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    try:
        info = prepare(
            args.input or [],
            args.output_dir,
            vocab_path=args.vocab_path,
            num_shards=args.num_shards,
            validation_fraction=args.validation_fraction,
            seed=args.seed,
            text_field=args.text_column,
            document_per_file=args.document_per_file,
            split=args.split,
            hf_dataset=args.hf_dataset,
            progress=True,
        )
    except (DatasetError, VocabError, FileNotFoundError, UnsupportedPathError) as e:
        return exit_status(e, user_errors=(FileNotFoundError,), program="prepare")
    print(summary(info, seconds=time.perf_counter() - start))
    if VALIDATION_SPLIT not in info.splits:
        print(no_validation_warning(info), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
