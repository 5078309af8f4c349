"""Lambada's examples and unpacked eval batches, as Pax builds them (scored in
paxlite.eval.lambada).

Pax (`lambada_eval`, `CustomMetricsLM` with `eval_task='lambada'`) scores a passage as correct
only when *every* token of its last word is the model's greedy (argmax) prediction. The target is
`' ' + last word`, the context is the rest of the passage, curly quotes are made ASCII first, and
no EOS is appended to the target. Each example sits alone in one row (`pack=False`), only target
tokens carry weight (`weights_on_targets_only=True`), and the last batch is filled with all-zero
rows whose example weight is 0 so that they never count; the whole test set is read once, in
order (`eval_loop_num_batches=-1`, `shuffle=False`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, TypeVar

import numpy as np

from paxlite.data.jsonl import read_jsonl_examples

# Pax's TFDS builder replaces exactly these four characters before splitting.
_QUOTE_TRANSLATION = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})

BATCH_KEYS: tuple[str, ...] = (
    "inputs",
    "targets",
    "weights",
    "positions",
    "segment_ids",
    "example_weights",
)
Example = TypeVar("Example")  # one row's worth, as example_batches' fill_row takes it


class TextEncoder(Protocol):
    """What the batcher needs from a tokenizer (paxlite Tokenizer or SentencePiece)."""

    def encode(self, text: str) -> list[int]: ...


def split_lambada(text: str) -> tuple[str, str]:
    """(inputs, target) of one OpenAI `lambada_test.jsonl` passage, as Pax's `MyLambada` makes it.

    The target keeps a leading space because, in running text, the last word follows a space; the
    tokenizer then sees the same word boundary the model saw in training.
    """
    normalized = text.translate(_QUOTE_TRANSLATION)
    words = normalized.split()
    if not words:
        raise ValueError(f"a Lambada passage needs at least one word, got {text!r}")
    last_word = words[-1]
    inputs = normalized[: normalized.rfind(last_word)].strip()
    return inputs, " " + last_word


def _parse_line(line: str) -> tuple[str, str]:
    record = json.loads(line)
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    has_text = "text" in record
    has_pair = "inputs" in record or "targets" in record
    if has_text and not has_pair:
        if not isinstance(record["text"], str):
            raise ValueError(f"'text' must be a string, got {type(record['text']).__name__}")
        return split_lambada(record["text"])
    if has_pair and not has_text:
        missing = [key for key in ("inputs", "targets") if key not in record]
        if missing:
            raise ValueError(f"'inputs' and 'targets' go together; missing {missing}")
        inputs, targets = record["inputs"], record["targets"]
        if not isinstance(inputs, str) or not isinstance(targets, str):
            raise ValueError("'inputs' and 'targets' must be strings")
        if not targets.strip():
            raise ValueError(f"'targets' must contain a word, got {targets!r}")
        return inputs, targets
    raise ValueError(
        f"expected either a 'text' field (OpenAI lambada_test.jsonl) or 'inputs' and 'targets' "
        f"(Pax MyLambada), got keys {sorted(record)}"
    )


def read_lambada(path: str) -> list[tuple[str, str]]:
    """(inputs, target) pairs from a JSONL file, in file order; blank lines are ignored.

    Any unreadable line is an error rather than a skipped example: a silently shorter test set
    would change the reported accuracy without anyone noticing.
    """
    return read_jsonl_examples(path, _parse_line, what="Lambada",
                               expected="a JSONL file")


def empty_batch(*, batch_size: int, seq_len: int) -> dict[str, np.ndarray]:
    """An unpacked LM batch of zeros: a row nothing fills keeps example weight 0, so it never
    counts."""
    batch = {
        key: np.zeros((batch_size, seq_len), dtype=np.int32)
        for key in ("inputs", "targets", "positions", "segment_ids")
    }
    batch["weights"] = np.zeros((batch_size, seq_len), dtype=np.float32)
    batch["example_weights"] = np.zeros((batch_size,), dtype=np.float32)
    return batch


def _fill_row(
    batch: dict[str, np.ndarray],
    row: int,
    *,
    input_ids: list[int],
    target_ids: list[int],
) -> None:
    tokens = np.asarray(input_ids + target_ids, dtype=np.int32)  # [L]
    length = tokens.shape[0]
    batch["targets"][row, :length] = tokens
    # SeqIO's LM convention: the model reads the targets shifted right by one, 0 first.
    batch["inputs"][row, 1:length] = tokens[:-1]
    batch["positions"][row] = np.arange(batch["positions"].shape[1], dtype=np.int32)
    batch["segment_ids"][row, :length] = 1
    batch["weights"][row, len(input_ids) : length] = 1.0
    batch["example_weights"][row] = 1.0


def _check_sizes(*, seq_len: int, batch_size: int, targets_len: int) -> None:
    if seq_len < 1 or batch_size < 1:
        raise ValueError(
            f"seq_len and batch_size must be >= 1, got seq_len={seq_len}, batch_size={batch_size}"
        )
    if targets_len < 1:
        raise ValueError(f"targets_len must be >= 1, got {targets_len}")


def tokenize_lambada(
    examples: Iterable[tuple[str, str]],
    tokenizer: TextEncoder,
    *,
    seq_len: int,
    targets_len: int = 64,
) -> list[tuple[list[int], list[int]]]:
    """(context ids, target ids) per example, already cut to fit a `seq_len` row.

    The target is cut to `min(targets_len, seq_len)` tokens first and the context is then cut
    *from the left* to fill the rest of the row, so the words right before the target, which
    decide it, are kept. The result depends on nothing but the text and the row length, so an
    evaluation feed tokenises its set once and rebuilds batches from these ids.
    """
    _check_sizes(seq_len=seq_len, batch_size=1, targets_len=targets_len)
    # A row shorter than targets_len (tiny test models) holds as much of the target as fits.
    target_cap = min(targets_len, seq_len)
    tokenized = []
    for index, (inputs, target) in enumerate(examples):
        target_ids = list(tokenizer.encode(target))[:target_cap]
        if not target_ids:
            raise ValueError(f"Lambada example {index} has a target {target!r} with no tokens")
        room = seq_len - len(target_ids)
        input_ids = list(tokenizer.encode(inputs))
        input_ids = input_ids[max(0, len(input_ids) - room) :] if room > 0 else []
        tokenized.append((input_ids, target_ids))
    return tokenized


def lambada_token_batches(
    tokenized: Iterable[tuple[list[int], list[int]]],
    *,
    seq_len: int,
    batch_size: int,
) -> Iterator[dict[str, np.ndarray]]:
    """Unpacked [batch_size, seq_len] batches of `tokenize_lambada`'s examples, each exactly
    once."""
    _check_sizes(seq_len=seq_len, batch_size=batch_size, targets_len=1)
    yield from example_batches(
        tokenized, batch_size=batch_size,
        empty=functools.partial(empty_batch, batch_size=batch_size, seq_len=seq_len),
        fill_row=lambda batch, row, ids: _fill_row(batch, row, input_ids=ids[0],
                                                   target_ids=ids[1]),
        dataset="Lambada")


def example_batches(
    examples: Iterable[Example],
    *,
    batch_size: int,
    empty: Callable[[], dict[str, np.ndarray]],
    fill_row: Callable[[dict[str, np.ndarray], int, Example], None],
    dataset: str,
) -> Iterator[dict[str, np.ndarray]]:
    """Every example once, in order, one a row and `batch_size` rows a batch, as the zero-shot
    tasks (Lambada, BoolQ) are scored: the last batch's unused rows stay as `empty` made them."""
    batch, row = empty(), 0
    num_examples = 0
    for example in examples:
        fill_row(batch, row, example)
        num_examples += 1
        row += 1
        if row == batch_size:
            yield batch
            batch, row = empty(), 0
    if num_examples == 0:
        raise ValueError(f"no {dataset} examples to batch")
    if row > 0:
        yield batch


def lambada_batches(
    examples: Iterable[tuple[str, str]],
    tokenizer: TextEncoder,
    *,
    seq_len: int,
    batch_size: int,
    targets_len: int = 64,
) -> Iterator[dict[str, np.ndarray]]:
    """Unpacked [batch_size, seq_len] batches, one example per row, every example exactly once
    (`tokenize_lambada`, then `lambada_token_batches`)."""
    _check_sizes(seq_len=seq_len, batch_size=batch_size, targets_len=targets_len)
    tokenized = tokenize_lambada(examples, tokenizer, seq_len=seq_len, targets_len=targets_len)
    yield from lambada_token_batches(tokenized, seq_len=seq_len, batch_size=batch_size)
