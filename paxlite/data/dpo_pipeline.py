"""DPO preference data for training (TRAIN_TASK=dpo) and evaluation (EVAL_TASK=dpo): rows
`{"prompt", "chosen", "rejected"}` read from DPO_DATA / DPO_EVAL_DATA, each a pair of examples
(dpo_rows.py's conventions), laid out one pair a row (dpo_rows.py's batch contract), as feeds of
the training loop (feed.py).

Reading, training order, per-process shares, exact resume, the template clock and evaluation's
layout are those of every feed of conversation-style rows (row_feeds.py), with a pair as the
item: the chat template, CHAT_SPLIT, CHAT_BAD_ROWS and CHAT_OVERLONG apply as they do to chat
rows. A pair longer than MAX_SEQ_LEN is dropped in training, or cut (CHAT_OVERLONG=truncate;
dpo_rows.truncate_pair); evaluation cuts it and counts it. PACKED_INPUT does not apply: a row
holds one pair.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from absl import logging

from paxlite.data.chat_rows import Overlong, PackedRow
from paxlite.data.dpo_rows import (
    PreferencePair,
    bad_pair_reason,
    encode_pair,
    needs_template,
    pair_batch,
    pair_row,
    truncate_pair,
)
from paxlite.data.feeding import FeedPlan
from paxlite.data.row_feeds import (
    RowEvalFeed,
    RowFormat,
    RowSourceConfig,
    RowTrainFeed,
)

EVAL_METRIC_PREFIX = "dpo/"  # eval/dpo/... in metrics.jsonl
PAIR_ROWS = RowFormat(encode=encode_pair, needs_template=needs_template,
                      bad_reason=bad_pair_reason)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DpoTrainConfig(RowSourceConfig):
    """TRAIN_TASK=dpo: preference rows to train on (module docstring)."""

    seed: int = 0
    overlong: Overlong = Overlong.DROP


@dataclasses.dataclass(frozen=True, kw_only=True)
class DpoEvalConfig(RowSourceConfig):
    """EVAL_TASK=dpo: every pair of `path` once."""


class DpoTrainFeed(RowTrainFeed[PreferencePair]):
    """One pair a row for training (module docstring), with an exact saved position."""

    task, data_setting, eval_setting, unit = "dpo", "DPO_DATA", "DPO_EVAL_DATA", "pairs"
    row_format = PAIR_ROWS


    def _length(self, item: PreferencePair) -> int:
        return item.length

    def _kept_tokens(self, item: PreferencePair) -> tuple[int, int]:
        kept = truncate_pair(item, seq_len=self._config.seq_len)
        return kept.length, int(kept.chosen.loss.sum() + kept.rejected.loss.sum())

    def _rows_from(self, items: Sequence[PreferencePair], *,
                   first: int) -> Iterator[PackedRow]:
        seq_len = self._config.seq_len
        return (pair_row(pair, seq_len=seq_len, index=first + k) for k, pair in enumerate(items))

    def _batch(self, rows: Sequence[PackedRow]) -> dict[str, np.ndarray]:
        return pair_batch(rows)


class DpoEvalFeed(RowEvalFeed):
    """Every pair of DPO_EVAL_DATA once, in file order, one a row, padded at the end with rows
    of segment 0; reported as eval/dpo/..."""

    metric_prefix = EVAL_METRIC_PREFIX
    row_format, unit = PAIR_ROWS, "pairs"

    def __init__(self, config: DpoEvalConfig, *, plan: FeedPlan):
        read = self._read_file(config)
        self.items = len(read.items)
        self.truncated = sum(pair.length > config.seq_len for pair in read.items)
        self.skipped_rows = read.skipped.total
        super().__init__(seq_len=config.seq_len, plan=plan, rows=[
            pair_row(pair, seq_len=config.seq_len, index=index)
            for index, pair in enumerate(read.items)])
        logging.info("DPO_EVAL_DATA %s: %d pairs, %d truncated to MAX_SEQ_LEN=%d; %d bad rows "
                     "skipped", config.path, self.items, self.truncated, config.seq_len,
                     self.skipped_rows)

    def _batch(self, rows: Sequence[PackedRow]) -> dict[str, np.ndarray]:
        return pair_batch(rows)


def dpo_train_summaries(feed: Any) -> dict[str, float]:
    """`data/dpo/dropped|truncated|skipped_rows` of a DPO training feed: the pairs of DPO_DATA
    each epoch drops or cuts, and its bad rows skipped; {} for any other feed."""
    return feed.summaries() if isinstance(feed, DpoTrainFeed) else {}


def dpo_eval_counts(feed: Any) -> dict[str, float]:
    """`dpo/pairs`, `dpo/truncated` (of them, those longer than MAX_SEQ_LEN, scored cut),
    `dpo/skipped_rows` of a DPO evaluation feed (eval/dpo/... in metrics.jsonl, beside the
    loss and rewards the evaluation step sums); {} for any other feed."""
    return feed.counts(EVAL_METRIC_PREFIX) if isinstance(feed, DpoEvalFeed) else {}


def make_dpo_feed(config: DpoTrainConfig | DpoEvalConfig, *,
                  plan: FeedPlan) -> DpoTrainFeed | DpoEvalFeed:
    if isinstance(config, DpoTrainConfig):
        return DpoTrainFeed(config, plan=plan)
    return DpoEvalFeed(config, plan=plan)
