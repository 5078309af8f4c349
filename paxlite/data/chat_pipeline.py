"""Chat SFT data for training (TRAIN_TASK=chat) and evaluation (EVAL_TASK=chat): rows read from
CHAT_DATA / CHAT_EVAL_DATA, rendered with the chat template, tokenised with their loss masks and
packed into rows (chat_rows.py's conventions), as feeds of the training loop (feed.py).

Reading, training order, per-process shares, exact resume, the template clock and evaluation's
layout are those of every feed of conversation-style rows (row_feeds.py), with an example as the
item. Packing: each process packs its share of an epoch's examples greedily into its rows
(PACKED_INPUT=false: one example a row).

The batch layout is transformers' causal-LM one, not the text pipeline's: the model reads each
example's own tokens from position 0 (nothing prepended; the text pipeline's `inputs` start with
a 0 that a model converted from transformers never saw), and position t is scored on token t+1 of
the same example where that token is learned. So the loss is the one transformers computes for
the same ids and labels, and an example of n tokens fills n positions of its row.

Evaluation: every example of the file once, in file order, none dropped: an example longer than
MAX_SEQ_LEN is scored on its first MAX_SEQ_LEN tokens and counted (`eval/chat/truncated`).
Examples are packed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from absl import logging

from paxlite.data.chat_rows import (
    MESSAGES_KEY,
    ChatExample,
    Overlong,
    PackedRow,
    RowEncoder,
    next_token_batch,
    pack_examples,
    row_kind,
)
from paxlite.data.chat_template import BadRowError
from paxlite.data.feeding import FeedPlan
from paxlite.data.row_feeds import (
    ChatBadRows,
    RowEvalFeed,
    RowFormat,
    RowSourceConfig,
    RowTrainFeed,
)

__all__ = ["ChatBadRows", "ChatEvalConfig", "ChatEvalFeed", "ChatTrainConfig", "ChatTrainFeed",
           "chat_eval_metrics", "chat_train_summaries", "make_chat_feed"]

EVAL_METRIC_PREFIX = "chat/"  # eval/chat/... in metrics.jsonl


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatTrainConfig(RowSourceConfig):
    """TRAIN_TASK=chat: conversations or prompt/completion rows to fine-tune on (module
    docstring)."""

    packed: bool = True
    seed: int = 0
    overlong: Overlong = Overlong.DROP


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatEvalConfig(RowSourceConfig):
    """EVAL_TASK=chat: the loss over the learned tokens of every example of `path` once."""


def _bad_row_reason(row: Any, *, where: str) -> str:
    try:
        kind = row_kind(row, where=where)
    except BadRowError:
        return "neither messages nor prompt/completion"
    return f"bad {kind.value} row"


CHAT_ROWS = RowFormat(encode=RowEncoder.encode, needs_template=lambda row: MESSAGES_KEY in row,
                      bad_reason=_bad_row_reason)


class ChatTrainFeed(RowTrainFeed[ChatExample]):
    """Packed chat rows for training (module docstring), with an exact saved position."""

    task, data_setting, eval_setting, unit = "chat", "CHAT_DATA", "CHAT_EVAL_DATA", "examples"
    row_format = CHAT_ROWS


    def _length(self, item: ChatExample) -> int:
        return item.ids.shape[0]

    def _kept_tokens(self, item: ChatExample) -> tuple[int, int]:
        seq_len = self._config.seq_len
        return min(item.ids.shape[0], seq_len), int(item.loss[:seq_len].sum())

    def _rows_from(self, items: Sequence[ChatExample], *, first: int) -> Iterator[PackedRow]:
        config = self._config
        if config.packed:
            return pack_examples(items, seq_len=config.seq_len, overlong=config.overlong,
                                 first_example=first)
        return (row for k, example in enumerate(items)
                for row in pack_examples([example], seq_len=config.seq_len,
                                         overlong=config.overlong, first_example=first + k))

    def _batch(self, rows: Sequence[PackedRow]) -> dict[str, np.ndarray]:
        return next_token_batch(rows)

    def _layout_meta(self) -> dict[str, Any]:
        return {"packed": self._config.packed}


class ChatEvalFeed(RowEvalFeed):
    """Every example of CHAT_EVAL_DATA once (module docstring); reported as eval/chat/..."""

    row_format, unit = CHAT_ROWS, "examples"

    def __init__(self, config: ChatEvalConfig, *, plan: FeedPlan):
        read = self._read_file(config)
        self.items = len(read.items)
        self.truncated = sum(e.ids.shape[0] > config.seq_len for e in read.items)
        self.skipped_rows = read.skipped.total
        super().__init__(seq_len=config.seq_len, plan=plan, rows=list(pack_examples(
            read.items, seq_len=config.seq_len, overlong=Overlong.TRUNCATE)))
        logging.info("CHAT_EVAL_DATA %s: %d examples in %d rows, %d truncated to MAX_SEQ_LEN=%d; "
                     "%d bad rows skipped", config.path, self.items, len(self._rows),
                     self.truncated, config.seq_len, self.skipped_rows)

    def _batch(self, rows: Sequence[PackedRow]) -> dict[str, np.ndarray]:
        return next_token_batch(rows)


def chat_train_summaries(feed: Any) -> dict[str, float]:
    """`data/chat/dropped|truncated|skipped_rows` of a chat training feed: the examples of
    CHAT_DATA each epoch drops or cuts, and its bad rows skipped; {} for any other feed."""
    return feed.summaries() if isinstance(feed, ChatTrainFeed) else {}


def chat_eval_metrics(feed: Any, metrics: dict[str, float]) -> dict[str, float]:
    """`chat/loss` (the summed cross entropy of the learned tokens over their number, the whole
    file), `chat/tokens` (that number), `chat/examples`, `chat/truncated`, `chat/skipped_rows`
    of a chat evaluation feed, from its evaluation's `metrics`; {} for any other feed."""
    if not isinstance(feed, ChatEvalFeed):
        return {}
    return {f"{EVAL_METRIC_PREFIX}loss": metrics["loss"],
            f"{EVAL_METRIC_PREFIX}tokens": metrics["num_tokens"], **feed.counts(EVAL_METRIC_PREFIX)}


def make_chat_feed(config: ChatTrainConfig | ChatEvalConfig, *,
                   plan: FeedPlan) -> ChatTrainFeed | ChatEvalFeed:
    if isinstance(config, ChatTrainConfig):
        return ChatTrainFeed(config, plan=plan)
    return ChatEvalFeed(config, plan=plan)
