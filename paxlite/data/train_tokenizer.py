"""Train a SentencePiece tokenizer with LLM defaults: `python -m paxlite.data.train_tokenizer`.

The defaults follow LLaMA-style models (BPE, byte fallback so no text is ever unknown, digits split
so numbers tokenize uniformly, identity normalization so decode(encode(x)) == x) with T5/Pax special
ids (pad 0, eos 1, unk 2, no BOS), which is what paxlite's data pipeline expects. Lines are sampled
with a seeded reservoir: a uniform sample of the whole corpus, however large it is.
"""

from __future__ import annotations

import argparse
import enum
import os
import random
import sys
import time
from collections.abc import Iterable, Sequence

import sentencepiece as spm

from paxlite.data.errors import DatasetError
from paxlite.data.inputs import Progress, iter_documents
from paxlite.errors import exit_status

# SentencePiece drops longer sentences (in bytes); sampling skips them so the count is exact.
MAX_SENTENCE_BYTES = 16384


class ModelType(str, enum.Enum):
    BPE = "bpe"
    UNIGRAM = "unigram"


def _fits(line: str) -> bool:
    return len(line) * 4 <= MAX_SENTENCE_BYTES or len(line.encode("utf-8")) <= MAX_SENTENCE_BYTES


def sample_sentences(
    documents: Iterable[str], *, max_sentences: int, seed: int, progress: bool = False
) -> list[str]:
    """A uniform random sample of at most `max_sentences` non-blank lines (reservoir sampling)."""
    if max_sentences < 1:
        raise ValueError(f"max_sentences must be >= 1, got {max_sentences}")
    rng = random.Random(seed)
    status = Progress(enabled=progress)
    sample: list[str] = []
    seen = 0
    try:
        for document in documents:
            for line in document.split("\n"):
                if not line.strip() or not _fits(line):
                    continue
                if seen < max_sentences:
                    sample.append(line)
                else:
                    slot = rng.randrange(seen + 1)
                    if slot < max_sentences:
                        sample[slot] = line
                seen += 1
            status.update(f"sampling: {seen:,} lines read, {len(sample):,} kept")
    finally:
        status.close()
    return sample


def train_from_sentences(
    sentences: Sequence[str],
    output_prefix: str | os.PathLike,
    *,
    vocab_size: int = 32000,
    model_type: str = ModelType.BPE.value,
    seed: int = 0,
    overwrite: bool = False,
) -> str:
    """Trains on `sentences` and writes PREFIX.model and PREFIX.vocab; returns the .model path."""
    try:
        model_type = ModelType(model_type).value
    except ValueError:
        valid = [t.value for t in ModelType]
        raise ValueError(f"unknown model_type {model_type!r}; valid: {valid}") from None
    if not sentences:
        raise DatasetError("no text to train the tokenizer on: the inputs hold no non-blank lines")
    prefix = os.path.abspath(os.fspath(output_prefix))
    outputs = [prefix + ".model", prefix + ".vocab"]
    existing = [path for path in outputs if os.path.exists(path)]
    if existing and not overwrite:
        raise FileExistsError(
            f"{', '.join(existing)} already exist(s); pass --overwrite (overwrite=True) to replace"
        )
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_prefix=prefix,
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=True,
            split_digits=True,
            pad_id=0,
            eos_id=1,
            unk_id=2,
            bos_id=-1,
            character_coverage=0.9995,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            max_sentence_length=MAX_SENTENCE_BYTES,
            input_sentence_size=0,  # already sampled
            shuffle_input_sentence=False,
            num_threads=os.cpu_count() or 1,
            minloglevel=1,
        )
    except RuntimeError as e:
        raise ValueError(f"SentencePiece training with vocab_size={vocab_size} failed: {e}") from e
    return outputs[0]


def train_tokenizer(
    inputs: Sequence[str | os.PathLike],
    output_prefix: str | os.PathLike,
    *,
    vocab_size: int = 32000,
    model_type: str = ModelType.BPE.value,
    max_sentences: int = 1_000_000,
    seed: int = 0,
    text_field: str = "text",
    document_per_file: bool = False,
    overwrite: bool = False,
    progress: bool = False,
) -> str:
    """Trains a tokenizer on files/directories `inputs`; returns the path of PREFIX.model."""
    prefix = os.path.abspath(os.fspath(output_prefix))
    existing = [p for p in (prefix + ".model", prefix + ".vocab") if os.path.exists(p)]
    if existing and not overwrite:  # fail before reading a large corpus
        raise FileExistsError(
            f"{', '.join(existing)} already exist(s); pass --overwrite (overwrite=True) to replace"
        )
    documents = iter_documents(inputs, text_field=text_field, document_per_file=document_per_file)
    sentences = sample_sentences(
        documents, max_sentences=max_sentences, seed=seed, progress=progress
    )
    return train_from_sentences(
        sentences, prefix, vocab_size=vocab_size, model_type=model_type, seed=seed,
        overwrite=overwrite,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m paxlite.data.train_tokenizer",
        description="Train a SentencePiece tokenizer (byte fallback, split digits, pad 0 / eos 1 / "
        "unk 2, no BOS) on text or JSONL files.",
    )
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help=".txt/.jsonl/.json files (optionally .gz/.zst) or directories")
    parser.add_argument("--output", required=True, metavar="PREFIX",
                        help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--model_type", choices=[t.value for t in ModelType], default="bpe")
    parser.add_argument("--max_sentences", type=int, default=1_000_000,
                        help="lines sampled uniformly from the input for training")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text_field", default="text", help="JSONL field holding the text")
    parser.add_argument("--document_per_file", action="store_true",
                        help="each .txt file is one document (default: blank-line paragraphs)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing PREFIX.* files")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    try:
        prefix = os.path.abspath(args.output)
        existing = [p for p in (prefix + ".model", prefix + ".vocab") if os.path.exists(p)]
        if existing and not args.overwrite:
            raise FileExistsError(f"{', '.join(existing)} already exist(s); pass --overwrite")
        documents = iter_documents(
            args.input, text_field=args.text_field, document_per_file=args.document_per_file
        )
        sentences = sample_sentences(
            documents, max_sentences=args.max_sentences, seed=args.seed, progress=True
        )
        model = train_from_sentences(
            sentences, prefix, vocab_size=args.vocab_size, model_type=args.model_type,
            seed=args.seed, overwrite=args.overwrite,
        )
    except (ValueError, FileExistsError) as e:
        return exit_status(e, user_errors=(ValueError, FileExistsError), program="train_tokenizer")
    processor = spm.SentencePieceProcessor(model_file=model)
    print(
        f"trained {args.model_type} tokenizer: vocab_size {processor.get_piece_size()}, "
        f"{len(sentences):,} sentences, {time.perf_counter() - start:.1f} s\n"
        f"  {model}\n  {prefix}.vocab"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
