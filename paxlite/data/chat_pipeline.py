"""Chat SFT data for training (TRAIN_TASK=chat) and evaluation (EVAL_TASK=chat): rows read from
CHAT_DATA / CHAT_EVAL_DATA, rendered with the chat template, tokenised with their loss masks and
packed into rows (chat_rows.py's conventions), as feeds of the training loop (feed.py).

Reading: a file is read once, when its feed opens, before anything compiles, so that a bad row,
a missing template or a tokenizer that does not fit is said before the first step: every row is
rendered and tokenised in file order and kept as token ids (about 5 bytes per token). Every
process reads the whole file (the counts of bad, dropped and truncated rows are then the same on
every process, and a bad row stops every process with the same line); each trains on its own
share of the examples.

Training order: the examples longer than MAX_SEQ_LEN are dropped first (CHAT_OVERLONG=drop; with
`truncate` they keep their first MAX_SEQ_LEN tokens); each epoch then visits the kept examples in
a permutation drawn from (SEED, epoch), as the text pipeline shuffles its documents, and feed f of
F (feeding.py: the processes that supply distinct rows of the batch) takes the examples at f, f+F,
f+2F, ... of that order and packs them greedily into its rows (PACKED_INPUT=false: one example a
row). An epoch's last row may be short (padding); the next epoch starts a new row. The position
is (epoch, next example) per process, saved with every checkpoint, so a resumed run consumes
exactly the batches the uninterrupted run would.

The template clock: a template may write today's date (`strftime_now`, LLaMA-3.1's system turn).
The instant a training run's feed first opened is saved with its position; a resumed run renders
the file again at that instant when the template read the clock, so it trains on the same text.
Evaluation renders at the instant its feed opened.

The batch layout is transformers' causal-LM one, not the text pipeline's: the model reads each
example's own tokens from position 0 (nothing prepended; the text pipeline's `inputs` start with
a 0 that a model converted from transformers never saw), and position t is scored on token t+1 of
the same example where that token is learned. So the loss is the one transformers computes for
the same ids and labels, and an example of n tokens fills n positions of its row.

Evaluation: every example of the file once, in file order, none dropped: an example longer than
MAX_SEQ_LEN is scored on its first MAX_SEQ_LEN tokens and counted (`eval/chat/truncated`).
Examples are packed; every process lays out the same global batches and supplies its rows of
them, so the score does not depend on the mesh or the number of processes.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.sharding import Sharding

from paxlite.data.chat_rows import (
    MESSAGES_KEY,
    ChatExample,
    Overlong,
    PackedRow,
    RowEncoder,
    next_token_batch,
    pack_examples,
    prompt_bos_id,
    row_kind,
)
from paxlite.data.chat_template import BadRowError, ChatTemplateError, chat_template_for
from paxlite.data.errors import DatasetError
from paxlite.data.feeding import FeedPlan, global_batch
from paxlite.data.row_files import BadRows, SkippedRows, iter_rows
from paxlite.parallel.multihost import allgather_json

_STATE_VERSION = 1
SPLIT_SETTING = "--fdl.CHAT_SPLIT"
TRAIN_METRIC_PREFIX = "data/chat/"
EVAL_METRIC_PREFIX = "chat/"  # eval/chat/... in metrics.jsonl


class ChatBadRows(str, enum.Enum):
    """CHAT_BAD_ROWS: what a row that cannot become an example does."""

    ERROR = "error"  # one line naming the file and row, before anything compiles
    SKIP = "skip"  # skipped and counted (log, data/chat/skipped_rows)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatTrainConfig:
    """TRAIN_TASK=chat: conversations or prompt/completion rows to fine-tune on (module
    docstring). `path` is a JSONL file (plain, .gz, .zst), a Parquet file, a save_to_disk folder
    or a folder of them; `split` chooses a DatasetDict folder's split."""

    path: str
    vocab_path: str
    vocab_size: int
    seq_len: int
    packed: bool = True
    seed: int = 0
    split: str | None = None
    template_file: str | None = None  # None: the tokenizer's own template
    template_name: str | None = None
    overlong: Overlong = Overlong.DROP
    bad_rows: ChatBadRows = ChatBadRows.ERROR


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatEvalConfig:
    """EVAL_TASK=chat: the loss over the learned tokens of every example of `path` once."""

    path: str
    vocab_path: str
    vocab_size: int
    seq_len: int
    split: str | None = None
    template_file: str | None = None
    template_name: str | None = None
    bad_rows: ChatBadRows = ChatBadRows.ERROR


class _FixedClock:
    """A template's clock stopped at one instant, which remembers whether it was read."""

    def __init__(self, instant: datetime.datetime):
        self.instant = instant
        self.read = False

    def __call__(self) -> datetime.datetime:
        self.read = True
        return self.instant


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatFile:
    """A file's examples in file order, and what reading it skipped."""

    examples: list[ChatExample]
    skipped: SkippedRows
    clock_read: bool  # the template wrote the clock's time into some row


def _bad_row_reason(row: Any, *, where: str) -> str:
    try:
        kind = row_kind(row, where=where)
    except BadRowError:
        return "neither messages nor prompt/completion"
    return f"bad {kind.value} row"


def read_chat_file(config: ChatTrainConfig | ChatEvalConfig, *,
                   instant: datetime.datetime) -> ChatFile:
    """Every row of `config.path` as an example (the template's clock at `instant`); a bad row
    raises its one line, or is skipped and counted (CHAT_BAD_ROWS=skip)."""
    from paxlite.data.tokenizer import Tokenizer, check_vocab_fits

    tokenizer = Tokenizer(config.vocab_path)
    check_vocab_fits(tokenizer, vocab_size=config.vocab_size)
    clock = _FixedClock(instant)
    try:
        template = chat_template_for(tokenizer, template_file=config.template_file,
                                     template_name=config.template_name, clock=clock)
        no_template = None
    except ChatTemplateError as e:
        if config.template_file is not None or config.template_name is not None:
            raise
        # the tokenizer's own: prompt/completion rows need none, so it is said at a chat row
        template, no_template = None, e
    encoder = RowEncoder(tokenizer=tokenizer, template=template,
                         bos_id=prompt_bos_id(tokenizer))
    on_bad_row = BadRows.SKIP if config.bad_rows is ChatBadRows.SKIP else BadRows.RAISE
    skipped = SkippedRows()
    examples = []
    for where, row in iter_rows(config.path, split=config.split, split_setting=SPLIT_SETTING,
                                on_bad_row=on_bad_row, skipped=skipped):
        if no_template is not None and MESSAGES_KEY in row:
            raise ChatTemplateError(f"{where} is a chat row, and {no_template}")
        try:
            examples.append(encoder.encode(row, where=where))
        except BadRowError as e:
            if on_bad_row is BadRows.RAISE:
                raise
            skipped.add(reason=_bad_row_reason(row, where=where), message=str(e))
    if not examples:
        raise DatasetError(f"{config.path} holds no usable rows"
                           + (f" ({skipped.summary()})" if skipped.total else ""))
    return ChatFile(examples=examples, skipped=skipped, clock_read=clock.read)


def _now() -> datetime.datetime:
    return datetime.datetime.now().replace(microsecond=0)


class ChatTrainFeed:
    """Packed chat rows for training (module docstring), with an exact saved position."""

    metric_prefix = ""
    # No validation split of its own: EVAL_TASK=chat with CHAT_EVAL_DATA evaluates.
    has_eval_data = False

    def __init__(self, config: ChatTrainConfig, *, plan: FeedPlan):
        self._config = config
        self._plan = plan
        self._load(_now())
        self._next_index = 0  # batches built
        self._epoch, self._cursor = 0, 0
        self._rows: Iterator[tuple[int, PackedRow]] | None = None
        self._order_cache: tuple[int, np.ndarray] | None = None

    def _load(self, instant: datetime.datetime) -> None:
        config = self._config
        read = read_chat_file(config, instant=instant)
        self._instant = instant
        self._clock_read = read.clock_read
        overlong = sum(example.ids.shape[0] > config.seq_len for example in read.examples)
        drop = config.overlong is Overlong.DROP
        self._examples = ([e for e in read.examples if e.ids.shape[0] <= config.seq_len]
                          if drop else read.examples)
        self.dropped = overlong if drop else 0
        self.truncated = 0 if drop else overlong
        self.skipped_rows = read.skipped.total
        if len(self._examples) < self._plan.num_feeds:
            raise DatasetError(
                f"CHAT_DATA {config.path}: {len(self._examples)} examples fit MAX_SEQ_LEN="
                f"{config.seq_len} ({self.dropped} longer ones dropped), fewer than the "
                f"{self._plan.num_feeds} processes that read it: give more rows, a longer "
                "MAX_SEQ_LEN or --fdl.CHAT_OVERLONG=truncate")
        tokens = sum(min(e.ids.shape[0], config.seq_len) for e in self._examples)
        learned = sum(int(e.loss[:config.seq_len].sum()) for e in self._examples)
        self._fingerprint = {"examples": len(self._examples), "tokens": tokens,
                             "learned_tokens": learned}
        self._order_cache = None
        logging.info(
            "CHAT_DATA %s: %d examples, %d longer than MAX_SEQ_LEN=%d %s; %d tokens (%d learned) "
            "an epoch; %d bad rows skipped%s", config.path, len(read.examples), overlong,
            config.seq_len, "dropped" if drop else "truncated", tokens, learned,
            self.skipped_rows, f" ({read.skipped.summary()})" if self.skipped_rows else "")

    def _order(self, epoch: int) -> np.ndarray:
        """This feed's examples in epoch `epoch`, in the order it packs them."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            n = len(self._examples)
            permutation = np.random.default_rng([self._config.seed, epoch]).permutation(n)
            self._order_cache = (epoch, permutation[self._plan.feed_index::self._plan.num_feeds])
        return self._order_cache[1]

    def _row_stream(self, epoch: int, cursor: int) -> Iterator[tuple[int, PackedRow]]:
        """(epoch, row) from `cursor` of `epoch`'s order on, epoch after epoch."""
        config = self._config
        while True:
            order = self._order(epoch)
            examples = [self._examples[i] for i in order[cursor:]]
            if config.packed:
                rows = pack_examples(examples, seq_len=config.seq_len, overlong=config.overlong,
                                     first_example=cursor)
            else:
                rows = (row for k, example in enumerate(examples)
                        for row in pack_examples([example], seq_len=config.seq_len,
                                                 overlong=config.overlong,
                                                 first_example=cursor + k))
            for row in rows:
                yield epoch, row
            epoch, cursor = epoch + 1, 0

    def _advance(self, epoch: int, row: PackedRow) -> None:
        if row.next_example == len(self._order(epoch)):
            self._epoch, self._cursor = epoch + 1, 0
        else:
            self._epoch, self._cursor = epoch, row.next_example

    def train_batch(self, index: int, sharding: Sharding) -> dict[str, jax.Array]:
        if index != self._next_index:
            raise RuntimeError(f"chat batches are read in order: asked for batch {index}, next "
                               f"is {self._next_index}")
        if self._rows is None:
            self._rows = self._row_stream(self._epoch, self._cursor)
        rows = []
        for _ in range(self._plan.local_batch_size):
            epoch, row = next(self._rows)
            self._advance(epoch, row)
            rows.append(row)
        self._next_index += 1
        return global_batch(next_token_batch(rows), sharding, self._plan)

    def eval_batches(self, num_batches: int, sharding: Sharding) -> Iterator[dict[str, jax.Array]]:
        raise DatasetError("TRAIN_TASK=chat has no validation split of its own: evaluate with "
                           "--fdl.EVAL_TASK=chat --fdl.CHAT_EVAL_DATA=PATH")

    def _meta(self) -> dict[str, Any]:
        config, plan = self._config, self._plan
        return {"version": _STATE_VERSION, "kind": "chat", **self._fingerprint,
                "seq_len": config.seq_len, "packed": config.packed, "seed": config.seed,
                "overlong": config.overlong.value, "global_batch_size": plan.global_batch_size,
                "feed_index": plan.feed_index, "num_feeds": plan.num_feeds}

    def position(self) -> dict:
        return {"batches_consumed": self._next_index,
                "iterator": {**self._meta(), "epoch": self._epoch, "cursor": self._cursor,
                             "template_time": self._instant.isoformat()}}

    def state(self, position: dict | None = None) -> dict:
        position = self.position() if position is None else position
        return {"batches_consumed": position["batches_consumed"],
                "processes": allgather_json(position["iterator"])}

    def restore(self, record: Any, *, step: int) -> None:
        if record is None:
            raise DatasetError(
                f"the checkpoint at step {step} has no input-pipeline position, so the batches "
                "after it cannot be reproduced; it was written for other data (e.g. synthetic)")
        processes = record.get("processes") or []
        if len(processes) != jax.process_count():
            raise DatasetError(
                f"the checkpoint at step {step} was written by {len(processes)} process(es) and "
                f"this job has {jax.process_count()}: each process's chat position cannot be "
                "split or merged")
        if record["batches_consumed"] != step:
            raise DatasetError(f"the checkpoint at step {step} records "
                               f"{record['batches_consumed']} batches consumed")
        saved = processes[jax.process_index()]
        if not isinstance(saved, dict) or saved.get("kind") != "chat":
            raise DatasetError(f"the checkpoint at step {step} holds the position of another "
                               "input pipeline (not TRAIN_TASK=chat): resume with the same data "
                               "settings")
        instant = datetime.datetime.fromisoformat(saved["template_time"])
        if instant != self._instant and self._clock_read:
            logging.info("The chat template writes the date: rendering CHAT_DATA again at the "
                         "job's template clock %s", instant.isoformat())
            self._load(instant)
        self._instant = instant
        for key, expected in self._meta().items():
            if saved.get(key) != expected:
                raise DatasetError(
                    f"the chat data position was saved with {key}={saved.get(key)!r} but this "
                    f"run has {key}={expected!r}; resume with the same CHAT_DATA and data "
                    "settings")
        self._epoch, self._cursor = int(saved["epoch"]), int(saved["cursor"])
        self._rows = None
        self._next_index = step


class ChatEvalFeed:
    """Every example of CHAT_EVAL_DATA once (module docstring); reported as eval/chat/..."""

    metric_prefix = ""
    has_eval_data = True

    def __init__(self, config: ChatEvalConfig, *, plan: FeedPlan):
        self._config = config
        self._plan = plan
        read = read_chat_file(config, instant=_now())
        self.examples = len(read.examples)
        self.truncated = sum(e.ids.shape[0] > config.seq_len for e in read.examples)
        self.skipped_rows = read.skipped.total
        # the global rows, laid out once: the same on every process
        self._rows = list(pack_examples(read.examples, seq_len=config.seq_len,
                                        overlong=Overlong.TRUNCATE))
        logging.info("CHAT_EVAL_DATA %s: %d examples in %d rows, %d truncated to MAX_SEQ_LEN=%d; "
                     "%d bad rows skipped", config.path, self.examples, len(self._rows),
                     self.truncated, config.seq_len, self.skipped_rows)

    def eval_batches(self, num_batches: int, sharding: Sharding) -> Iterator[dict[str, jax.Array]]:
        """The whole file, whatever `num_batches` asks (the settings refuse a number)."""
        del num_batches
        size, seq_len = self._plan.global_batch_size, self._config.seq_len
        empty = PackedRow(targets=np.zeros(seq_len, np.int32), loss=np.zeros(seq_len, bool),
                          segment_ids=np.zeros(seq_len, np.int32),
                          positions=np.zeros(seq_len, np.int32), first_example=0,
                          next_example=0, examples=0, dropped=0, truncated=0)
        for start in range(0, len(self._rows), size):
            rows = self._rows[start:start + size]
            rows = [*rows, *[empty] * (size - len(rows))][self._plan.rows]
            yield global_batch(next_token_batch(rows), sharding, self._plan)


def chat_train_summaries(feed: Any) -> dict[str, float]:
    """`data/chat/dropped|truncated|skipped_rows` of a chat training feed: the examples of
    CHAT_DATA each epoch drops or cuts, and its bad rows skipped; {} for any other feed."""
    if not isinstance(feed, ChatTrainFeed):
        return {}
    return {f"{TRAIN_METRIC_PREFIX}dropped": feed.dropped,
            f"{TRAIN_METRIC_PREFIX}truncated": feed.truncated,
            f"{TRAIN_METRIC_PREFIX}skipped_rows": feed.skipped_rows}


def chat_eval_metrics(feed: Any, metrics: dict[str, float]) -> dict[str, float]:
    """`chat/loss` (the summed cross entropy of the learned tokens over their number, the whole
    file), `chat/tokens` (that number), `chat/examples`, `chat/truncated`, `chat/skipped_rows`
    of a chat evaluation feed, from its evaluation's `metrics`; {} for any other feed."""
    if not isinstance(feed, ChatEvalFeed):
        return {}
    return {f"{EVAL_METRIC_PREFIX}loss": metrics["loss"],
            f"{EVAL_METRIC_PREFIX}tokens": metrics["num_tokens"],
            f"{EVAL_METRIC_PREFIX}examples": feed.examples,
            f"{EVAL_METRIC_PREFIX}truncated": feed.truncated,
            f"{EVAL_METRIC_PREFIX}skipped_rows": feed.skipped_rows}


def make_chat_feed(config: ChatTrainConfig | ChatEvalConfig, *,
                   plan: FeedPlan) -> ChatTrainFeed | ChatEvalFeed:
    if isinstance(config, ChatTrainConfig):
        return ChatTrainFeed(config, plan=plan)
    return ChatEvalFeed(config, plan=plan)
