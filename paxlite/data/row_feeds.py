"""Feeds of conversation-style rows: what chat SFT (chat_pipeline.py) and DPO (dpo_pipeline.py)
share. A file's rows become items (a chat example, a preference pair) and the items become packed
rows (chat_rows.PackedRow); the two pipelines differ only in those two steps.

Reading: a file is read once, when its feed opens, before anything compiles, so that a bad row,
a missing template or a tokenizer that does not fit is said before the first step: every row is
rendered and tokenised in file order and kept as token ids (about 5 bytes per token). Every
process reads the whole file (the counts of bad, dropped and truncated rows are then the same on
every process, and a bad row stops every process with the same line); each trains on its own
share of the items.

Training order: the items longer than MAX_SEQ_LEN are dropped first (CHAT_OVERLONG=drop; with
`truncate` they are cut when laid into a row); each epoch then visits the kept items in a
permutation drawn from (SEED, epoch), as the text pipeline shuffles its documents, and feed f of
F (feeding.py: the processes that supply distinct rows of the batch) takes the items at f, f+F,
f+2F, ... of that order and lays them into its rows. An epoch's last row may be short (padding);
the next epoch starts a new row. The position is (epoch, next item) per process, saved with every
checkpoint, so a resumed run consumes exactly the batches the uninterrupted run would.

The template clock: a template may write today's date (`strftime_now`, LLaMA-3.1's system turn).
The instant a training run's feed first opened is saved with its position; a resumed run renders
the file again at that instant when the template read the clock, so it trains on the same text.
Evaluation renders at the instant its feed opened.

Evaluation: every item of the file once, in file order, none dropped (one longer than MAX_SEQ_LEN
is cut and counted). Every process lays out the same global batches, padded at the end with empty
rows, and supplies its rows of them, so the score does not depend on the mesh or the number of
processes.
"""

from __future__ import annotations

import abc
import dataclasses
import datetime
import enum
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Generic, TypeVar

import jax
import numpy as np
from absl import logging
from jax.sharding import Sharding

from paxlite.data.chat_rows import Overlong, PackedRow, RowBuilder, RowEncoder, prompt_bos_id
from paxlite.data.chat_template import BadRowError, ChatTemplateError, chat_template_for
from paxlite.data.errors import DatasetError
from paxlite.data.feeding import FeedPlan, global_batch
from paxlite.data.row_files import BadRows, SkippedRows, iter_rows
from paxlite.parallel.multihost import allgather_json

Item = TypeVar("Item")
_STATE_VERSION = 1
SPLIT_SETTING = "--fdl.CHAT_SPLIT"


class ChatBadRows(str, enum.Enum):
    """CHAT_BAD_ROWS: what a row that cannot become an item does (chat and DPO rows alike)."""

    ERROR = "error"  # one line naming the file and row, before anything compiles
    SKIP = "skip"  # skipped and counted (log, data/<task>/skipped_rows)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowSourceConfig:
    """What every config of chat-style rows says: the rows (`path`: a JSONL file, plain, .gz or
    .zst, a Parquet file, a save_to_disk folder or a folder of them; `split`: a DatasetDict
    folder's split), the tokenizer, the row length, the chat template and what a bad row does."""

    path: str
    vocab_path: str
    vocab_size: int
    seq_len: int
    split: str | None = None
    template_file: str | None = None  # None: the tokenizer's own template
    template_name: str | None = None
    bad_rows: ChatBadRows = ChatBadRows.ERROR


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowFormat(Generic[Item]):
    """How one kind of row becomes an item."""

    encode: Callable[..., Item]  # (encoder, row, *, where) -> item, or BadRowError
    needs_template: Callable[[Any], bool]  # a row only a chat template can render
    bad_reason: Callable[..., str]  # (row, *, where) -> the short reason a skipped row counts under


class _FixedClock:
    """A template's clock stopped at one instant, which remembers whether it was read."""

    def __init__(self, instant: datetime.datetime):
        self.instant = instant
        self.read = False

    def __call__(self) -> datetime.datetime:
        self.read = True
        return self.instant


def now() -> datetime.datetime:
    """The template clock's instant for a feed opened now (whole seconds: it is saved as text)."""
    return datetime.datetime.now().replace(microsecond=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowFile(Generic[Item]):
    """A file's items in file order, and what reading it skipped."""

    items: list[Item]
    skipped: SkippedRows
    clock_read: bool  # the template wrote the clock's time into some row


def read_row_file(config: RowSourceConfig, *, instant: datetime.datetime,
                  row_format: RowFormat[Item]) -> RowFile[Item]:
    """Every row of `config.path` as an item (the template's clock at `instant`); a bad row raises
    its one line, or is skipped and counted (CHAT_BAD_ROWS=skip)."""
    from paxlite.data.tokenizer import Tokenizer, bind_model_vocab

    tokenizer = Tokenizer(config.vocab_path)
    bind_model_vocab(tokenizer, vocab_size=config.vocab_size)
    clock = _FixedClock(instant)
    try:
        template = chat_template_for(tokenizer, template_file=config.template_file,
                                     template_name=config.template_name, clock=clock)
        no_template = None
    except ChatTemplateError as e:
        if config.template_file is not None or config.template_name is not None:
            raise
        # the tokenizer's own: string rows need none, so it is said at the first row that does
        template, no_template = None, e
    encoder = RowEncoder(tokenizer=tokenizer, template=template,
                         bos_id=prompt_bos_id(tokenizer))
    on_bad_row = BadRows.SKIP if config.bad_rows is ChatBadRows.SKIP else BadRows.RAISE
    skipped = SkippedRows()
    items = []
    for where, row in iter_rows(config.path, split=config.split, split_setting=SPLIT_SETTING,
                                on_bad_row=on_bad_row, skipped=skipped):
        if no_template is not None and row_format.needs_template(row):
            raise ChatTemplateError(f"{where} is a chat row, and {no_template}")
        try:
            items.append(row_format.encode(encoder, row, where=where))
        except BadRowError as e:
            if on_bad_row is BadRows.RAISE:
                raise
            skipped.add(reason=row_format.bad_reason(row, where=where), message=str(e))
    if not items:
        raise DatasetError(f"{config.path} holds no usable rows"
                           + (f" ({skipped.summary()})" if skipped.total else ""))
    return RowFile(items=items, skipped=skipped, clock_read=clock.read)


class RowTrainFeed(abc.ABC, Generic[Item]):
    """Training rows of a file of items (module docstring), with an exact saved position.

    A subclass says how its file is read and how items become rows and batches; the class
    attributes name its task in positions, summaries and messages.
    """

    metric_prefix = ""
    # No validation split of its own: EVAL_TASK=<task> with its own file evaluates.
    has_eval_data = False
    task: ClassVar[str]  # TRAIN_TASK, the position's kind, data/<task>/ summaries
    data_setting: ClassVar[str]  # the setting naming the training rows
    eval_setting: ClassVar[str]  # the one naming the evaluation rows
    unit: ClassVar[str]  # what an item is called ("examples", "pairs")
    row_format: ClassVar[RowFormat]  # how a row of the file becomes an item

    def __init__(self, config: Any, *, plan: FeedPlan):
        self._config = config
        self._plan = plan
        self._load(now())
        self._next_index = 0  # batches built
        self._epoch, self._cursor = 0, 0
        self._rows: Iterator[tuple[int, PackedRow]] | None = None

    def _read(self, instant: datetime.datetime) -> RowFile[Item]:
        """The file's items, the template's clock at `instant`."""
        return read_row_file(self._config, instant=instant, row_format=self.row_format)

    @abc.abstractmethod
    def _length(self, item: Item) -> int:
        """Tokens the item needs in a row (over MAX_SEQ_LEN: dropped or truncated)."""

    @abc.abstractmethod
    def _kept_tokens(self, item: Item) -> tuple[int, int]:
        """(tokens, learned tokens) of the item as laid into a row."""

    @abc.abstractmethod
    def _rows_from(self, items: Sequence[Item], *, first: int) -> Iterator[PackedRow]:
        """The rows of `items`, the first numbered `first` (rows' first/next_example count
        items)."""

    @abc.abstractmethod
    def _batch(self, rows: Sequence[PackedRow]) -> dict[str, np.ndarray]:
        """The host batch of this process's rows."""

    def _layout_meta(self) -> dict[str, Any]:
        """Settings beyond the common ones that change how rows are laid out."""
        return {}

    def _load(self, instant: datetime.datetime) -> None:
        config = self._config
        read = self._read(instant)
        self._instant = instant
        self._clock_read = read.clock_read
        overlong = sum(self._length(item) > config.seq_len for item in read.items)
        drop = config.overlong is Overlong.DROP
        self._items = ([item for item in read.items if self._length(item) <= config.seq_len]
                       if drop else read.items)
        self.dropped = overlong if drop else 0
        self.truncated = 0 if drop else overlong
        self.skipped_rows = read.skipped.total
        if len(self._items) < self._plan.num_feeds:
            raise DatasetError(
                f"{self.data_setting} {config.path}: {len(self._items)} {self.unit} fit "
                f"MAX_SEQ_LEN={config.seq_len} ({self.dropped} longer ones dropped), fewer than "
                f"the {self._plan.num_feeds} processes that read it: give more rows, a longer "
                "MAX_SEQ_LEN or --fdl.CHAT_OVERLONG=truncate")
        kept = [self._kept_tokens(item) for item in self._items]
        tokens, learned = sum(t for t, _ in kept), sum(n for _, n in kept)
        self._fingerprint = {self.unit: len(self._items), "tokens": tokens,
                             "learned_tokens": learned}
        self._order_cache: tuple[int, np.ndarray] | None = None
        logging.info(
            "%s %s: %d %s, %d longer than MAX_SEQ_LEN=%d %s; %d tokens (%d learned) an epoch; "
            "%d bad rows skipped%s", self.data_setting, config.path, len(read.items), self.unit,
            overlong, config.seq_len, "dropped" if drop else "truncated", tokens, learned,
            self.skipped_rows, f" ({read.skipped.summary()})" if self.skipped_rows else "")

    def _order(self, epoch: int) -> np.ndarray:
        """This feed's items in epoch `epoch`, in the order it lays them into rows."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            n = len(self._items)
            permutation = np.random.default_rng([self._config.seed, epoch]).permutation(n)
            self._order_cache = (epoch, permutation[self._plan.feed_index::self._plan.num_feeds])
        return self._order_cache[1]

    def _row_stream(self, epoch: int, cursor: int) -> Iterator[tuple[int, PackedRow]]:
        """(epoch, row) from `cursor` of `epoch`'s order on, epoch after epoch."""
        while True:
            order = self._order(epoch)
            for row in self._rows_from([self._items[i] for i in order[cursor:]], first=cursor):
                yield epoch, row
            epoch, cursor = epoch + 1, 0

    def _advance(self, epoch: int, row: PackedRow) -> None:
        if row.next_example == len(self._order(epoch)):
            self._epoch, self._cursor = epoch + 1, 0
        else:
            self._epoch, self._cursor = epoch, row.next_example

    def train_batch(self, index: int, sharding: Sharding) -> dict[str, jax.Array]:
        if index != self._next_index:
            raise RuntimeError(f"{self.task} batches are read in order: asked for batch {index}, "
                               f"next is {self._next_index}")
        if self._rows is None:
            self._rows = self._row_stream(self._epoch, self._cursor)
        rows = []
        for _ in range(self._plan.local_batch_size):
            epoch, row = next(self._rows)
            self._advance(epoch, row)
            rows.append(row)
        self._next_index += 1
        return global_batch(self._batch(rows), sharding, self._plan)

    def eval_batches(self, num_batches: int, sharding: Sharding) -> Iterator[dict[str, jax.Array]]:
        raise DatasetError(f"TRAIN_TASK={self.task} has no validation split of its own: evaluate "
                           f"with --fdl.EVAL_TASK={self.task} --fdl.{self.eval_setting}=PATH")

    def summaries(self) -> dict[str, float]:
        """`data/<task>/dropped|truncated|skipped_rows`: the items of the file each epoch drops
        or cuts, and its bad rows skipped."""
        prefix = f"data/{self.task}/"
        return {f"{prefix}dropped": self.dropped, f"{prefix}truncated": self.truncated,
                f"{prefix}skipped_rows": self.skipped_rows}

    def _meta(self) -> dict[str, Any]:
        config, plan = self._config, self._plan
        return {"version": _STATE_VERSION, "kind": self.task, **self._fingerprint,
                "seq_len": config.seq_len, **self._layout_meta(), "seed": config.seed,
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
                f"this job has {jax.process_count()}: each process's {self.task} position cannot "
                "be split or merged")
        if record["batches_consumed"] != step:
            raise DatasetError(f"the checkpoint at step {step} records "
                               f"{record['batches_consumed']} batches consumed")
        saved = processes[jax.process_index()]
        if not isinstance(saved, dict) or saved.get("kind") != self.task:
            raise DatasetError(f"the checkpoint at step {step} holds the position of another "
                               f"input pipeline (not TRAIN_TASK={self.task}): resume with the "
                               "same data settings")
        instant = datetime.datetime.fromisoformat(saved["template_time"])
        if instant != self._instant and self._clock_read:
            logging.info("The chat template writes the date: rendering %s again at the job's "
                         "template clock %s", self.data_setting, instant.isoformat())
            self._load(instant)
        self._instant = instant
        for key, expected in self._meta().items():
            if saved.get(key) != expected:
                raise DatasetError(
                    f"the {self.task} data position was saved with {key}={saved.get(key)!r} but "
                    f"this run has {key}={expected!r}; resume with the same {self.data_setting} "
                    "and data settings")
        self._epoch, self._cursor = int(saved["epoch"]), int(saved["cursor"])
        self._rows = None
        self._next_index = step


class RowEvalFeed(abc.ABC):
    """Every item of an evaluation file once, laid into `rows` (module docstring)."""

    metric_prefix = ""
    has_eval_data = True
    row_format: ClassVar[RowFormat]  # how a row of the file becomes an item
    unit: ClassVar[str]  # what an item is called ("examples", "pairs")
    # The file's items, of them those longer than MAX_SEQ_LEN (scored cut), and its bad rows
    # skipped: set by the subclass from `_read_file`.
    items: int
    truncated: int
    skipped_rows: int

    @classmethod
    def _read_file(cls, config: RowSourceConfig) -> RowFile:
        """The file's items, the template's clock at the instant the feed opens."""
        return read_row_file(config, instant=now(), row_format=cls.row_format)

    def counts(self, prefix: str) -> dict[str, float]:
        """`<prefix><unit>`, `<prefix>truncated`, `<prefix>skipped_rows` (eval/... metrics)."""
        return {f"{prefix}{self.unit}": self.items, f"{prefix}truncated": self.truncated,
                f"{prefix}skipped_rows": self.skipped_rows}

    def __init__(self, *, seq_len: int, plan: FeedPlan, rows: list[PackedRow]):
        self._seq_len = seq_len
        self._plan = plan
        self._rows = rows  # the global rows, laid out once: the same on every process

    @abc.abstractmethod
    def _batch(self, rows: Sequence[PackedRow]) -> dict[str, np.ndarray]:
        """The host batch of this process's rows (padding rows hold no item)."""

    def eval_batches(self, num_batches: int, sharding: Sharding) -> Iterator[dict[str, jax.Array]]:
        """The whole file, whatever `num_batches` asks (the settings refuse a number)."""
        del num_batches
        size = self._plan.global_batch_size
        empty = RowBuilder(first_example=0).row(seq_len=self._seq_len, next_example=0)
        for start in range(0, len(self._rows), size):
            rows = self._rows[start:start + size]
            rows = [*rows, *[empty] * (size - len(rows))][self._plan.rows]
            yield global_batch(self._batch(rows), sharding, self._plan)
