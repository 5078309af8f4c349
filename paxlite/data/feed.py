"""From host batches to global device batches, for the training loop.

A feed hides where batches come from (synthetic, or a prepared text dataset) behind four calls the
loop needs: the batch for an optimizer step, the evaluation batches, and saving/restoring its
position. Each process feeds only the rows its devices hold;
`jax.make_array_from_process_local_data` assembles the global batch.

Sequence parallelism with load balancing reorders each training batch's tokens where the batch is
taken from its feed (``prefetch_train_batches(..., balance_seq_shards=C)``, on the devices, in the
producer thread): data/context_order.py says why and how.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Sharding

from paxlite.data import chat_pipeline, dpo_pipeline
from paxlite.data.context_order import balance_batch_for_seq
from paxlite.data.errors import DatasetError
from paxlite.data.feeding import FeedPlan
from paxlite.data.feeding import global_batch as _to_global
from paxlite.data.prefetch import DEFAULT_DEPTH, Prefetcher
from paxlite.data.synthetic import SyntheticData, SyntheticDataConfig
from paxlite.parallel.multihost import allgather_json

Batch = dict[str, jax.Array]


class Feed(Protocol):
    def train_batch(self, index: int, sharding: Sharding) -> Batch:
        """The global batch consumed by optimizer step `index + 1`."""

    def eval_batches(self, num_batches: int, sharding: Sharding) -> Iterator[Batch]:
        """A fresh pass over the evaluation data (the same batches every time)."""

    def position(self) -> Any:
        """This process's position after the batches built so far: cheap, local (no communication),
        JSON-able; None when stateless. The prefetching producer records it with every batch, so a
        checkpoint saves where the *consumed* batches end, not where the producer has got to."""

    def state(self, position: Any = None) -> Any:
        """JSON record of `position` (default: the current one), gathered from every process; None
        when stateless. Called on the training thread (it is a collective across processes)."""

    def restore(self, record: Any, *, step: int) -> None:
        """Continue after `step` optimizer steps from a record written by `state()`."""

    # Whether eval_batches has anything to give: False for a prepared dataset written without a
    # validation split (prepare --validation_fraction 0), which then trains without evaluation.
    has_eval_data: bool


class _StatelessFeed:
    """A feed whose batches are a pure function of the step: no position to record, nothing in
    a checkpoint, nothing to restore."""

    def position(self) -> None:
        return None

    def state(self, position: Any = None) -> None:
        del position

    def restore(self, record: Any, *, step: int) -> None:
        del record, step


class SyntheticFeed(_StatelessFeed):
    """Synthetic batches are a function of the step: nothing to save."""

    metric_prefix = ""
    has_eval_data = True

    def __init__(self, config: SyntheticDataConfig, *, global_batch_size: int):
        self._data = SyntheticData(config, global_batch_size=global_batch_size)

    def train_batch(self, index: int, sharding: Sharding) -> Batch:
        return self._data.train_batch(index, sharding)

    def eval_batches(self, num_batches: int, sharding: Sharding) -> Iterator[Batch]:
        for index in range(num_batches):
            yield self._data.eval_batch(index, sharding)


def _require_one_source(config, *, dataset: str) -> None:
    """An evaluation or fine-tuning set is read from a local file or from TFDS, never both: two
    sources would leave it unclear which examples were scored."""
    if (config.path is None) == (config.tfds_data_dir is None):
        raise ValueError(
            f"{dataset} needs exactly one source: path={config.path!r} or "
            f"tfds_data_dir={config.tfds_data_dir!r}"
        )


def _read_boolq_examples(config) -> list:
    """The examples from the config's one source, read and checked now, before compiling."""
    from paxlite.data.boolq import read_boolq, read_boolq_tfds

    if config.path is not None:
        return read_boolq(config.path)
    return read_boolq_tfds(config.tfds_data_dir, split=config.split)


def _global_eval_batches(batches: Iterator[dict[str, np.ndarray]], *, num_batches: int,
                         sharding: Sharding, plan: FeedPlan) -> Iterator[Batch]:
    """The first `num_batches` host batches (all of them for -1) as global batches of this
    process's rows."""
    for index, batch in enumerate(batches):
        if index == num_batches:
            break
        yield _to_global({key: value[plan.rows] for key, value in batch.items()}, sharding, plan)


class TextFeed:
    """Batches from a prepared dataset, TFDS files, a weighted mixture of those (data/mixture.py),
    or a Pax SeqIO task; the iterator position is saved in every checkpoint."""

    metric_prefix = ""

    def __init__(self, config, *, plan: FeedPlan):
        from paxlite.data.mixture import MixtureData, MixtureDataConfig  # grain only on this path
        from paxlite.data.pipeline import TextData  # grain and SentencePiece only on this path
        from paxlite.data.seqio_pipeline import (  # TensorFlow only when used
            SeqIOData,
            SeqIODataConfig,
        )

        self._plan = plan
        reader = (SeqIOData if isinstance(config, SeqIODataConfig)
                  else MixtureData if isinstance(config, MixtureDataConfig) else TextData)
        self._mixture = reader is MixtureData
        self._data = reader(
            config,
            global_batch_size=plan.global_batch_size,
            process_index=plan.feed_index,
            process_count=plan.num_feeds,
        )
        self._iterator = self._data.train_iterator()
        self._next_index = 0

    def train_batch(self, index: int, sharding: Sharding) -> Batch:
        if index != self._next_index:
            raise RuntimeError(
                f"text batches are read in order: asked for batch {index}, next is "
                f"{self._next_index}"
            )
        self._next_index += 1
        return _to_global(next(self._iterator), sharding, self._plan)

    @property
    def has_eval_data(self) -> bool:
        return self._data.has_eval_data

    def eval_batches(self, num_batches: int, sharding: Sharding) -> Iterator[Batch]:
        for local in self._data.eval_batches(num_batches):
            yield _to_global(local, sharding, self._plan)

    def position(self) -> dict:
        return {"batches_consumed": self._next_index, "iterator": self._iterator.get_state()}

    def close(self) -> None:
        """Release the reader threads of SeqIO's tf.data iterator (Grain reads on the calling
        thread: nothing to release)."""
        close = getattr(self._iterator, "close", None)
        if close is not None:
            close()

    def mixture_fractions(self, position: dict | None = None) -> dict[str, float]:
        """A mixture's share of weighted tokens per source name over the batches up to `position`
        (default: the current one), summed over every process (a collective when there are
        several; one process: none). {} for one source."""
        if not self._mixture:
            return {}
        from paxlite.data.mixture import mixture_fractions

        position = self.position() if position is None else position
        return mixture_fractions(allgather_json(position["iterator"]))

    def eval_sources(self) -> dict[str, Feed]:
        """A mixture's per-source evaluation feeds (sources with a validation split), by name; {}
        for one source."""
        if not self._mixture:
            return {}
        return {
            name: _SourceEvalFeed(data, plan=self._plan)
            for name, data in self._data.eval_sources().items()
        }

    def state(self, position: dict | None = None) -> dict:
        position = self.position() if position is None else position
        return {
            "batches_consumed": position["batches_consumed"],
            "processes": allgather_json(position["iterator"]),
        }

    def restore(self, record: Any, *, step: int) -> None:
        if record is None:
            raise DatasetError(
                f"the checkpoint at step {step} has no input-pipeline position, so the batches "
                "after it cannot be reproduced; it was written for other data (e.g. synthetic)"
            )
        processes = record["processes"]
        if len(processes) != jax.process_count():
            raise DatasetError(
                f"the checkpoint at step {step} was written by {len(processes)} process(es) and "
                f"this job has {jax.process_count()}: each process's input position cannot be "
                "split or merged"
            )
        if record["batches_consumed"] != step:
            raise DatasetError(
                f"the checkpoint at step {step} records {record['batches_consumed']} batches "
                "consumed"
            )
        self._iterator.set_state(processes[jax.process_index()])
        self._next_index = step


class _SourceEvalFeed:
    """One mixture source's validation split, evaluated alone (eval/<name>/loss)."""

    metric_prefix = ""
    has_eval_data = True

    def __init__(self, data, *, plan: FeedPlan):
        self._data, self._plan = data, plan

    def eval_batches(self, num_batches: int, sharding: Sharding) -> Iterator[Batch]:
        for local in self._data.eval_batches(num_batches):
            yield _to_global(local, sharding, self._plan)


MIXTURE_METRIC_PREFIX = "data/mixture/"


def mixture_summaries(feed: Feed | None, position: Any) -> dict[str, float]:
    """`data/mixture/<source>`: each source's fraction of the weighted tokens of the batches up to
    `position`, since step 0, over all processes; {} unless `feed` reads a mixture. Every process
    calls it (a collective when there are several)."""
    if not isinstance(feed, TextFeed):
        return {}
    return {
        MIXTURE_METRIC_PREFIX + name: value
        for name, value in feed.mixture_fractions(position).items()
    }


def eval_sources(feed: Feed) -> dict[str, Feed]:
    """Per-source evaluation feeds of a mixture, by source name; {} for any other feed."""
    return feed.eval_sources() if isinstance(feed, TextFeed) else {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LambadaEvalConfig:
    """Zero-shot Lambada (Pax `lambada_eval`): a JSONL file of passages, or TFDS `my_lambada:1.0.0`
    in `tfds_data_dir` (exactly one of the two), and the tokenizer."""

    vocab_path: str
    seq_len: int
    targets_len: int = 64
    path: str | None = None
    tfds_data_dir: str | None = None

    def __post_init__(self):
        _require_one_source(self, dataset="Lambada")


class LambadaFeed:
    """Evaluation only: every example once, in order; reported as lambada_acc_strict."""

    metric_prefix = "lambada_"
    has_eval_data = True

    def __init__(self, config: LambadaEvalConfig, *, plan: FeedPlan):
        from paxlite.data.lambada import read_lambada
        from paxlite.data.tokenizer import Tokenizer

        self._config = config
        if config.path is not None:
            self._examples = read_lambada(config.path)  # read and checked now, before compiling
        else:
            from paxlite.data.tfds_datasets import read_lambada_examples

            self._examples = read_lambada_examples(config.tfds_data_dir)
        self._tokenizer = Tokenizer(config.vocab_path)
        self._plan = plan
        self._tokens: list[tuple[list[int], list[int]]] | None = None

    def _tokenized(self) -> list[tuple[list[int], list[int]]]:
        """The set's token ids, computed at the first evaluation and kept: every later
        evaluation only lays them out in batches."""
        if self._tokens is None:
            from paxlite.data.lambada import tokenize_lambada

            self._tokens = tokenize_lambada(self._examples, self._tokenizer,
                                            seq_len=self._config.seq_len,
                                            targets_len=self._config.targets_len)
        return self._tokens

    def eval_batches(self, num_batches: int, sharding: Sharding) -> Iterator[Batch]:
        """num_batches -1 (Pax's eval_loop_num_batches=-1): the whole set."""
        from paxlite.data.lambada import lambada_token_batches

        plan = self._plan
        batches = lambada_token_batches(self._tokenized(), seq_len=self._config.seq_len,
                                        batch_size=plan.global_batch_size)
        yield from _global_eval_batches(batches, num_batches=num_batches, sharding=sharding,
                                        plan=plan)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BoolQEvalConfig:
    """Zero-shot BoolQ (Pax `boolq`): a SuperGLUE JSONL file (val.jsonl), or TFDS
    `super_glue/boolq:1.0.2` in `tfds_data_dir` (exactly one of the two; its `split`), and the
    tokenizer."""

    vocab_path: str
    seq_len: int
    path: str | None = None
    tfds_data_dir: str | None = None
    split: str = "validation"

    def __post_init__(self):
        _require_one_source(self, dataset="BoolQ")


class _BoolQExamples:
    """What the BoolQ evaluation and training feeds both hold: the config, its examples, the
    tokenizer with its yes/no token pair, and the plan."""

    def __init__(self, config: BoolQEvalConfig | BoolQTrainConfig, *, plan: FeedPlan,
                 examples: list):
        from paxlite.data.boolq import yes_no_token_ids
        from paxlite.data.tokenizer import Tokenizer

        self._config = config
        self._examples = examples
        self._tokenizer = Tokenizer(config.vocab_path)
        # A tokenizer that splits yes/no is refused up front.
        self._yes_no = yes_no_token_ids(self._tokenizer)
        self._plan = plan


class BoolQFeed(_BoolQExamples):
    """Evaluation only: every example once, in order, with its yes/no token pair; reported as
    boolq_acc."""

    metric_prefix = "boolq_"
    has_eval_data = True

    def __init__(self, config: BoolQEvalConfig, *, plan: FeedPlan):
        super().__init__(config, plan=plan, examples=_read_boolq_examples(config))
        self._tokens: list[np.ndarray] | None = None

    def eval_batches(self, num_batches: int, sharding: Sharding) -> Iterator[Batch]:
        """num_batches -1 (Pax's eval_loop_num_batches=-1): the whole set. The examples are
        tokenised at the first evaluation and kept."""
        from paxlite.data.boolq import boolq_token_batches, tokenize_boolq

        plan = self._plan
        if self._tokens is None:
            self._tokens = tokenize_boolq(self._examples, self._tokenizer,
                                          seq_len=self._config.seq_len)
        batches = boolq_token_batches(self._tokens, yes_no=self._yes_no,
                                      seq_len=self._config.seq_len,
                                      batch_size=plan.global_batch_size)
        yield from _global_eval_batches(batches, num_batches=num_batches, sharding=sharding,
                                        plan=plan)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BoolQTrainConfig:
    """Supervised fine-tuning on BoolQ's training split (Pax's LLaMA configs train on the `boolq`
    task): a SuperGLUE JSONL file (train.jsonl) or TFDS `super_glue/boolq:1.0.2` in `tfds_data_dir`,
    and the tokenizer."""

    vocab_path: str
    seq_len: int
    seed: int = 1234
    path: str | None = None
    tfds_data_dir: str | None = None
    split: str = "train"

    def __post_init__(self):
        _require_one_source(self, dataset="BoolQ training")


class BoolQTrainFeed(_BoolQExamples, _StatelessFeed):
    """BoolQ examples as training rows: one example per row, loss on the answer token only.

    The batch of step `index` is a pure function of (seed, index): global row r of that step is
    example `perm_e[k mod N]` with k = index * B + r and perm_e a seeded permutation of the N
    examples for epoch e = k // N. So nothing needs saving for an exact resume, every process can
    build just its own rows, and each epoch visits every example once in a fresh order. Evaluation
    batches are the validation split's (use EVAL_TASK=boolq for boolq_acc).
    """

    metric_prefix = ""
    has_eval_data = False  # no validation-loss split of its own (eval_batches says what to use)

    def __init__(self, config: BoolQTrainConfig, *, plan: FeedPlan):
        examples = _read_boolq_examples(config)
        if not examples:
            raise DatasetError(f"BoolQ training data {config.path or config.tfds_data_dir} has no "
                               "examples")
        super().__init__(config, plan=plan, examples=examples)
        # Example index -> its row tokens: each example is tokenised the first time a step uses
        # it (one epoch's worth at most), never again.
        self._tokens: dict[int, np.ndarray] = {}

    def example_indices(self, index: int) -> np.ndarray:
        """Indices into the examples of the global rows of step `index + 1`, in row order."""
        n, b = len(self._examples), self._plan.global_batch_size
        ks = np.arange(index * b, (index + 1) * b, dtype=np.int64)
        out = np.empty(b, dtype=np.int64)
        for epoch in np.unique(ks // n):
            perm = np.random.default_rng([self._config.seed, int(epoch)]).permutation(n)
            chosen = ks // n == epoch
            out[chosen] = perm[ks[chosen] % n]
        return out

    def train_batch(self, index: int, sharding: Sharding) -> Batch:
        from paxlite.data.boolq import boolq_token_batches, tokenize_boolq

        rows = [int(i) for i in self.example_indices(index)[self._plan.rows]]
        new = sorted({i for i in rows if i not in self._tokens})
        if new:
            tokens = tokenize_boolq([self._examples[i] for i in new], self._tokenizer,
                                    seq_len=self._config.seq_len)
            self._tokens.update(zip(new, tokens, strict=True))
        (local,) = boolq_token_batches([self._tokens[i] for i in rows], yes_no=self._yes_no,
                                       seq_len=self._config.seq_len, batch_size=len(rows))
        train_keys = ("inputs", "targets", "weights", "positions", "segment_ids")
        return _to_global({key: local[key] for key in train_keys}, sharding, self._plan)

    def eval_batches(self, num_batches: int, sharding: Sharding) -> Iterator[Batch]:
        raise DatasetError(
            "BoolQ training has no validation-loss split of its own: evaluate with "
            "--fdl.EVAL_TASK=boolq (boolq_acc on the validation split)"
        )


def prefetch_train_batches(feed: Feed, *, start: int, stop: int, sharding: Sharding,
                           depth: int = DEFAULT_DEPTH,
                           balance_seq_shards: int = 1) -> Prefetcher[tuple[Batch, Any]]:
    """(batch, position after it) for optimizer steps start + 1 .. stop, built `depth` ahead in a
    producer thread: the batch is on its devices (transfer finished) before the step takes it.

    balance_seq_shards: the ``seq`` mesh axis size when its load is balanced: each batch is put in
    the dual_chunk_swap order (``balance_batch_for_seq``); 1: batches as the feed gives them.
    """

    def produce() -> Iterator[tuple[Batch, Any]]:
        for index in range(start, stop):
            batch = balance_batch_for_seq(feed.train_batch(index, sharding),
                                          seq_shards=balance_seq_shards)
            jax.block_until_ready(batch)
            yield batch, feed.position()

    return Prefetcher(produce(), depth=depth, name="train-batches")


def prefetch_eval_batches(feed: Feed, *, num_batches: int, sharding: Sharding,
                          depth: int = DEFAULT_DEPTH) -> Prefetcher[Batch]:
    """`feed.eval_batches` built `depth` ahead in a producer thread."""
    return Prefetcher(feed.eval_batches(num_batches, sharding), depth=depth, name="eval-batches")


def close_feeds(*feeds: Feed | None) -> None:
    """Release what a feed holds besides memory (SeqIO's tf.data reader threads) when its run
    ends, not whenever the garbage collector frees the run."""
    for feed in feeds:
        if isinstance(feed, TextFeed):
            feed.close()


def make_feed(config, *, plan: FeedPlan) -> Feed:
    """The feed for a data or eval-task config; `plan` says which rows this process supplies."""
    if isinstance(config, chat_pipeline.ChatTrainConfig | chat_pipeline.ChatEvalConfig):
        return chat_pipeline.make_chat_feed(config, plan=plan)
    if isinstance(config, dpo_pipeline.DpoTrainConfig | dpo_pipeline.DpoEvalConfig):
        return dpo_pipeline.make_dpo_feed(config, plan=plan)
    if isinstance(config, LambadaEvalConfig):
        return LambadaFeed(config, plan=plan)
    if isinstance(config, BoolQEvalConfig):
        return BoolQFeed(config, plan=plan)
    if isinstance(config, BoolQTrainConfig):
        return BoolQTrainFeed(config, plan=plan)
    if isinstance(config, SyntheticDataConfig):
        return SyntheticFeed(config, global_batch_size=plan.global_batch_size)
    return TextFeed(config, plan=plan)
