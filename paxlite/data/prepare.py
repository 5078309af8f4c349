"""Turn text/JSONL corpora into a paxlite dataset directory: `python -m paxlite.data.prepare`.

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
from collections.abc import Sequence

from paxlite.data.inputs import iter_documents
from paxlite.data.records import DatasetError, DatasetInfo, Kind, shard_paths, write_dataset
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
    progress: bool = False,
) -> DatasetInfo:
    """Reads `inputs` and writes a dataset into the new or empty `output_dir`."""
    for path in inputs:
        require_local_path(path, setting="--input")
    require_local_path(output_dir, setting="--output_dir")
    if vocab_path is not None:
        require_local_path(vocab_path, setting="--vocab_path")
    if vocab_path is not None and not os.path.exists(os.fspath(vocab_path)):
        raise VocabError(f"tokenizer file {os.fspath(vocab_path)!r} (--vocab_path) does not exist")
    tokenizer = Tokenizer(vocab_path) if vocab_path is not None else None
    documents = iter_documents(inputs, text_field=text_field, document_per_file=document_per_file)
    return write_dataset(
        output_dir,
        documents,
        kind=Kind.TEXT.value if tokenizer is None else Kind.TOKENS.value,
        tokenizer=tokenizer,
        num_shards=num_shards,
        validation_fraction=validation_fraction,
        seed=seed,
        sources=[os.path.abspath(os.fspath(p)) for p in inputs],
        progress=progress,
    )


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
        description="Write text/JSONL corpora as a paxlite dataset (ArrayRecord + manifest).",
    )
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help=".txt/.jsonl/.json files (optionally .gz/.zst) or directories")
    parser.add_argument("--output_dir", required=True, metavar="DIR",
                        help="new or empty directory to write")
    parser.add_argument("--vocab_path", default=None, metavar="PATH",
                        help="tokenizer (SentencePiece or tiktoken .model, tokenizer.json, or a "
                             "directory holding one): store token ids (default: store raw text)")
    parser.add_argument("--num_shards", type=_positive, default=None,
                        help="train shards (default: about one per 64 MiB)")
    parser.add_argument("--validation_fraction", type=_fraction, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text_field", default="text", help="JSONL field holding the text")
    parser.add_argument("--document_per_file", action="store_true",
                        help="each .txt file is one document (default: blank-line paragraphs)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    try:
        info = prepare(
            args.input,
            args.output_dir,
            vocab_path=args.vocab_path,
            num_shards=args.num_shards,
            validation_fraction=args.validation_fraction,
            seed=args.seed,
            text_field=args.text_field,
            document_per_file=args.document_per_file,
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
