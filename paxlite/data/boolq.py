"""BoolQ's examples and unpacked batches as Pax builds them (scored by `paxlite.eval.boolq`).

Pax (`boolq` SeqIO task, `CustomMetricsLM` with `eval_task='boolq'`) asks the model a yes/no
question about a passage. The prompt is `passage + '\\nquestion: ' + question + '?\\nanswer:'` and
the target is `yes` or `no` with no EOS (`paxlite.data.seqio_tasks.boolq_prompt`, the one
definition). Each row carries the pair of answer tokens, because the score compares the right
answer's logit with the other answer's only.

Each example sits alone in one row (`pack=False`), only the target token carries weight, and the
last batch is filled with all-zero rows whose example weight is 0 so that they never count; the
whole validation split is read once, in order (`eval_loop_num_batches=-1`, `shuffle=False`).

Truncation. Pax gives the inputs `MAX_SEQ_LEN - 64` tokens and the target 64, and SeqIO trims an
over-long feature by keeping its *start*, which would cut off the question and `answer:` of a
passage longer than the row. paxlite instead keeps the *end* of the inputs (the passage loses its
beginning), as its Lambada does: the question is what the target answers. At Pax's length (4096) no
BoolQ passage comes near either limit, so both choices score the same; they differ only on short
test rows.

Pax assumes `yes` and `no` are each one token (`TRUE_TOKEN = spm.encode('yes')`); paxlite checks it
and says which pieces a tokenizer splits them into when it does not hold.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable, Iterator
from typing import Protocol

import numpy as np

from paxlite.data.errors import DatasetError
from paxlite.data.jsonl import read_jsonl_examples
from paxlite.data.lambada import BATCH_KEYS as LM_BATCH_KEYS
from paxlite.data.lambada import TextEncoder, empty_batch, example_batches
from paxlite.data.seqio_tasks import boolq_prompt

# The per-row pair of answer tokens (yes_id, no_id) that `paxlite.train.step.eval_step` scores.
CHOICE_KEY = "yn_tokens"
BATCH_KEYS: tuple[str, ...] = (*LM_BATCH_KEYS, CHOICE_KEY)
TFDS_SPLIT = "validation"  # Pax evaluates BoolQ on SuperGLUE's validation split (val.jsonl)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BoolQExample:
    passage: str
    question: str
    label: bool  # True: the answer is yes


class PieceEncoder(TextEncoder, Protocol):
    """A tokenizer that can also name its pieces (paxlite Tokenizer or SentencePiece)."""

    def id_to_piece(self, token_id: int) -> str: ...


def _label(value: object) -> bool:
    """SuperGLUE writes true/false; TFDS stores 0/1 (and -1 for the unlabelled test split)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(
        f"'label' must be true/false (SuperGLUE) or 0/1 (TFDS), got {value!r}; unlabelled examples "
        "(SuperGLUE's test split) cannot be scored"
    )


def _parse_line(line: str) -> BoolQExample:
    record = json.loads(line)
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    missing = [key for key in ("passage", "question", "label") if key not in record]
    if missing:
        raise ValueError(
            f"missing {missing}; a BoolQ line has passage, question and label (and idx), got keys "
            f"{sorted(record)}"
        )
    passage, question = record["passage"], record["question"]
    if not isinstance(passage, str) or not isinstance(question, str):
        raise ValueError("'passage' and 'question' must be strings")
    return BoolQExample(passage=passage, question=question, label=_label(record["label"]))


def read_boolq(path: str) -> list[BoolQExample]:
    """Examples of a SuperGLUE BoolQ JSONL file (e.g. val.jsonl), in file order; blank lines
    skipped.

    A bad line is an error, not a skipped example: a silently smaller set changes the accuracy.
    """
    return read_jsonl_examples(
        path, _parse_line, what="BoolQ",
        expected="SuperGLUE's val.jsonl: one JSON object with passage, question, label per line")


def read_boolq_tfds(data_dir: str, *, split: str = TFDS_SPLIT) -> list[BoolQExample]:
    """Examples of TFDS `super_glue/boolq:1.0.2` (ArrayRecord, from scripts_gpu/download_boolq.py).

    Read as a random-access data source, without TensorFlow, in the stored order.
    """
    from paxlite.data.tfds_datasets import BOOLQ, open_split

    source = open_split(BOOLQ, data_dir, split)
    rows = source.__getitems__(range(len(source)))

    def text(value: object) -> str:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)

    examples = []
    for index, row in enumerate(rows):
        try:
            label = _label(int(row["label"]))
        except ValueError as e:
            raise DatasetError(f"TFDS {BOOLQ} in {data_dir!r}, {split} example {index}: {e}") from e
        examples.append(BoolQExample(passage=text(row["passage"]), question=text(row["question"]),
                                     label=label))
    if not examples:
        raise DatasetError(f"TFDS dataset {BOOLQ} in {data_dir!r}: split {split!r} is empty")
    return examples


def yes_no_token_ids(tokenizer: PieceEncoder) -> tuple[int, int]:
    """(yes_id, no_id): `tokenizer.encode('yes')` and `encode('no')`, each exactly one token.

    Pax's score compares two single logits; a tokenizer that splits either word cannot be scored
    this way, so it is refused with the pieces it produced.
    """
    ids = {}
    for word in ("yes", "no"):
        pieces = list(tokenizer.encode(word))
        if len(pieces) != 1:
            names = [tokenizer.id_to_piece(i) for i in pieces]
            raise DatasetError(
                f"BoolQ scoring needs {word!r} to be one token, as Pax assumes; this tokenizer "
                f"encodes it as {len(pieces)} pieces {names} (ids {pieces}). Use a vocabulary "
                "with single pieces for yes and no (LLaMA's has '\u2581yes' and '\u2581no')"
            )
        ids[word] = pieces[0]
    if ids["yes"] == ids["no"]:
        raise DatasetError(f"'yes' and 'no' encode to the same token {ids['yes']}")
    return ids["yes"], ids["no"]


def _empty_batch(
    *, batch_size: int, seq_len: int, yes_no: tuple[int, int]
) -> dict[str, np.ndarray]:
    batch = empty_batch(batch_size=batch_size, seq_len=seq_len)
    # Every row, padding included, names the pair: padding rows have no weight, so never count.
    batch[CHOICE_KEY] = np.tile(np.asarray(yes_no, dtype=np.int32), (batch_size, 1))  # [B, 2]
    return batch


def _check_sizes(*, seq_len: int, batch_size: int) -> None:
    if seq_len < 2 or batch_size < 1:
        raise ValueError(
            f"BoolQ rows need seq_len >= 2 (prompt and answer) and batch_size >= 1, got "
            f"seq_len={seq_len}, batch_size={batch_size}"
        )


def tokenize_boolq(
    examples: Iterable[BoolQExample],
    tokenizer: PieceEncoder,
    *,
    seq_len: int,
) -> list[np.ndarray]:
    """Each example's row tokens (int32 [L], L <= seq_len): the prompt's, then the answer token.

    Prompts longer than `seq_len - 1` tokens keep their end (see the module docstring). A pure
    function of the text and the row length: feeds tokenise once and rebuild batches from these.
    """
    _check_sizes(seq_len=seq_len, batch_size=1)
    yes_no = yes_no_token_ids(tokenizer)
    tokenized = []
    for example in examples:
        inputs, _ = boolq_prompt(passage=example.passage, question=example.question,
                                 label=int(example.label))
        target = yes_no[0] if example.label else yes_no[1]
        input_ids = list(tokenizer.encode(inputs))
        input_ids = input_ids[max(0, len(input_ids) - (seq_len - 1)):]
        tokenized.append(np.asarray(input_ids + [target], dtype=np.int32))
    return tokenized


def boolq_token_batches(
    tokenized: Iterable[np.ndarray],
    *,
    yes_no: tuple[int, int],
    seq_len: int,
    batch_size: int,
) -> Iterator[dict[str, np.ndarray]]:
    """Unpacked [batch_size, seq_len] batches (keys BATCH_KEYS) of `tokenize_boolq`'s rows.

    A row is the tokens (`targets`), the same shifted right by one with 0 first (`inputs`, SeqIO's
    LM convention), weight 1 on the answer (the last token) only.
    """
    _check_sizes(seq_len=seq_len, batch_size=batch_size)
    yield from example_batches(
        tokenized, batch_size=batch_size,
        empty=functools.partial(_empty_batch, batch_size=batch_size, seq_len=seq_len,
                                yes_no=yes_no),
        fill_row=_fill_row, dataset="BoolQ")


def _fill_row(batch: dict[str, np.ndarray], row: int, tokens: np.ndarray) -> None:
    length = tokens.shape[0]
    batch["targets"][row, :length] = tokens
    batch["inputs"][row, 1:length] = tokens[:-1]
    batch["positions"][row] = np.arange(batch["positions"].shape[1], dtype=np.int32)
    batch["segment_ids"][row, :length] = 1
    batch["weights"][row, length - 1] = 1.0
    batch["example_weights"][row] = 1.0


def boolq_batches(
    examples: Iterable[BoolQExample],
    tokenizer: PieceEncoder,
    *,
    seq_len: int,
    batch_size: int,
) -> Iterator[dict[str, np.ndarray]]:
    """Unpacked [batch_size, seq_len] batches (keys BATCH_KEYS), one example per row, each once
    (`tokenize_boolq`, then `boolq_token_batches`)."""
    _check_sizes(seq_len=seq_len, batch_size=batch_size)
    yes_no = yes_no_token_ids(tokenizer)
    yield from boolq_token_batches(tokenize_boolq(examples, tokenizer, seq_len=seq_len),
                                   yes_no=yes_no, seq_len=seq_len, batch_size=batch_size)
