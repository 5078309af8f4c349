"""Preference rows `{"prompt", "chosen", "rejected"}` as pairs of examples, one pair a row.

DPO compares the log-probability the model gives the chosen completion of a prompt with the one
it gives the rejected completion, so each side is an example of its own, learned where a
fine-tuning example is (chat_rows.py's conventions):

- All three strings: each side is the prompt/completion row (prompt, side): the prompt tokenised
  as plain text (BOS first where the tokenizer adds one), the side without special tokens, then
  EOS; the side and its EOS are learned.
- All three lists of messages (TRL's conversational format; a side is usually one assistant
  message): a side's ids are the prompt's messages followed by the side's, rendered with the chat
  template and tokenised as `apply_chat_template(prompt + side, tokenize=True)` does; learned is
  every token after `apply_chat_template(prompt, add_generation_prompt=True)`, which must be a
  prefix of the side's ids (else the row is refused, naming the side). Nothing is appended: the
  end of turn the template writes after the side is the end the model learns.
- Anything else (mixed strings and lists, a missing key, an empty side, a side with no learned
  token) is a bad row.

THE BATCH CONTRACT (what the DPO loss reads; `pair_batch`): one pair per row. The chosen example
from the start of the row (segment_ids 1, positions from 0), then the rejected example
(segment_ids 2, positions from 0), then padding (segment_ids 0). The features are
`next_token_batch`'s: `inputs` (the tokens), `targets` (at t, the next token of the same
example), `weights` (float32, 1.0 where that next token is learned), `positions`, `segment_ids`,
all [B, T] in transformers' causal-LM layout. A row that holds no pair (the end of an evaluation
file) is padding throughout, segment 0; there is no per-row [B] array (a sequence-sharded batch
layout would not fit one), and the loss tells pairs by their segments. So the chosen
log-probability of row b is the sum over t with segment_ids == 1 of weights * log p(targets), and
the rejected one the same with 2.

A pair longer than a row (len(chosen) + len(rejected) > seq_len) is cut, where it is kept, so
that each side keeps its first L tokens, L the largest with min(len(chosen), L) +
min(len(rejected), L) <= seq_len: both sides keep the same prefix length, so neither is favoured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from paxlite.data.chat_rows import (
    PROMPT_KEY,
    ChatExample,
    PackedRow,
    RowBuilder,
    RowEncoder,
    check_messages,
    learned_example,
    next_token_batch,
)
from paxlite.data.chat_template import BadRowError

CHOSEN_KEY, REJECTED_KEY = "chosen", "rejected"
SIDES = (CHOSEN_KEY, REJECTED_KEY)
PAIR_KEYS = (PROMPT_KEY, *SIDES)
CHOSEN_SEGMENT, REJECTED_SEGMENT = 1, 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreferencePair:
    chosen: ChatExample
    rejected: ChatExample

    @property
    def length(self) -> int:
        """Tokens the pair needs in a row."""
        return self.chosen.ids.shape[0] + self.rejected.ids.shape[0]


def _type_name(value: Any) -> str:
    return "missing" if value is None else f"a {type(value).__name__}"


def needs_template(row: Any) -> bool:
    """Whether the row is in the conversational form, which only a chat template renders."""
    return isinstance(row, Mapping) and any(isinstance(row.get(key), list) for key in PAIR_KEYS)


def bad_pair_reason(row: Any, *, where: str) -> str:
    """The short reason a skipped row is counted under (CHAT_BAD_ROWS=skip)."""
    del where
    if not isinstance(row, Mapping) or any(row.get(key) is None for key in PAIR_KEYS):
        return "not a prompt/chosen/rejected row"
    return "bad conversational pair" if needs_template(row) else "bad prompt/completion pair"


def encode_pair(encoder: RowEncoder, row: Any, *, where: str) -> PreferencePair:
    """The two examples of one preference row (the module docstring's conventions); `where`
    names the row in errors (a file and row number)."""
    if not isinstance(row, Mapping):
        raise BadRowError(f"{where}: a row is a JSON object, got {type(row).__name__}")
    missing = [key for key in PAIR_KEYS if row.get(key) is None]
    if missing:
        raise BadRowError(
            f"{where}: a preference row holds {PROMPT_KEY!r}, {CHOSEN_KEY!r} and {REJECTED_KEY!r} "
            f"(strings, or lists of messages); this one lacks {missing} (keys "
            f"{sorted(map(str, row))})")
    values = [row[key] for key in PAIR_KEYS]
    if all(isinstance(value, str) for value in values):
        return _encode_strings(encoder, row, where=where)
    if all(isinstance(value, list) for value in values):
        return _encode_conversations(encoder, row, where=where)
    kinds = ", ".join(f"{key} {_type_name(row[key])}" for key in PAIR_KEYS)
    raise BadRowError(f"{where}: {PROMPT_KEY!r}, {CHOSEN_KEY!r} and {REJECTED_KEY!r} must be all "
                      f"strings or all lists of messages; got {kinds}")


def _check_side(example: ChatExample, *, side: str, where: str) -> ChatExample:
    if not example.loss.any():
        raise BadRowError(f"{where}: {side!r} adds no token to learn after the prompt")
    return example


def _encode_strings(encoder: RowEncoder, row: Mapping[str, Any], *,
                    where: str) -> PreferencePair:
    for side in SIDES:
        if not row[side]:
            raise BadRowError(f"{where}: an empty {side!r}, so nothing to learn")
    chosen, rejected = (_check_side(encoder.encode_prompt_completion(
        prompt=row[PROMPT_KEY], completion=row[side], where=where), side=side, where=where)
        for side in SIDES)
    return PreferencePair(chosen=chosen, rejected=rejected)


def _encode_conversations(encoder: RowEncoder, row: Mapping[str, Any], *,
                          where: str) -> PreferencePair:
    prompt = row[PROMPT_KEY]
    check_messages(prompt, where=where, key=PROMPT_KEY, needs_assistant=False)
    for side in SIDES:
        check_messages(row[side], where=where, key=side, needs_assistant=False)
    before = encoder.conversation_ids(prompt, add_generation_prompt=True, where=where)
    sides = []
    for side in SIDES:
        ids = encoder.conversation_ids([*prompt, *row[side]], add_generation_prompt=False,
                                       where=where)
        if ids[:len(before)] != before:
            origin = encoder.template.origin if encoder.template is not None else None
            raise BadRowError(
                f"{where}: {side!r}: the prompt with the generation prompt is not a prefix of the "
                f"prompt followed by {side!r} (in tokens), so the tokens of {side!r} are not "
                f"known; the chat template ({origin}) cannot mark them")
        loss = np.zeros(len(ids), dtype=bool)
        loss[len(before):] = True
        sides.append(_check_side(learned_example(ids, loss), side=side, where=where))
    chosen, rejected = sides
    return PreferencePair(chosen=chosen, rejected=rejected)


def side_length(pair: PreferencePair, *, seq_len: int) -> int:
    """L, the tokens each side keeps in a row of `seq_len`: the largest with
    min(len(chosen), L) + min(len(rejected), L) <= seq_len (unbounded when the pair fits)."""
    shorter, longer = sorted((pair.chosen.ids.shape[0], pair.rejected.ids.shape[0]))
    if shorter + longer <= seq_len:
        return longer
    # the shorter side whole and the rest to the longer one, when that leaves the longer one
    # at least as long; else both cut to half the row
    return seq_len - shorter if 2 * shorter <= seq_len else seq_len // 2


def truncate_pair(pair: PreferencePair, *, seq_len: int) -> PreferencePair:
    """The pair as a row of `seq_len` holds it: each side's first `side_length` tokens."""
    keep = side_length(pair, seq_len=seq_len)
    return PreferencePair(
        **{side: ChatExample(ids=example.ids[:keep], loss=example.loss[:keep])
           for side, example in ((CHOSEN_KEY, pair.chosen), (REJECTED_KEY, pair.rejected))})


def pair_row(pair: PreferencePair, *, seq_len: int, index: int) -> PackedRow:
    """The row of pair number `index` (its first_example; next_example index + 1), cut to
    `seq_len` if it is longer (counted in the row's `truncated`)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    cut = pair.length > seq_len
    kept = truncate_pair(pair, seq_len=seq_len) if cut else pair
    builder = RowBuilder(first_example=index, parts=[kept.chosen, kept.rejected],
                         used=kept.length, truncated=int(cut))
    return builder.row(seq_len=seq_len, next_example=index + 1)


def pair_batch(rows: Sequence[PackedRow]) -> dict[str, np.ndarray]:
    """The batch contract of the module docstring: `next_token_batch`'s features."""
    return next_token_batch(rows)
