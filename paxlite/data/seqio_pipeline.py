"""Batches of Pax's SeqIO tasks in paxlite's format (the `seqio` extra).

The tasks themselves live in `seqio_tasks`; this module reads them the way Pax's input
configuration does and maps SeqIO's LM feature converter output onto paxlite's batch names, with
resumable training iterators and padded evaluation batches. It is separate from the tasks because
it is the part a run's feed needs: config checks, per-process sharding and iterator state.

TensorFlow and SeqIO are heavy (2+ GB) and optional: they are imported only inside the functions
that need them (through `seqio_tasks.import_seqio`), so `import paxlite.data.seqio_pipeline` works
without them.

Training rows are the tasks' pieces, packed (`packed=True`) by SeqIO's greedy packer or one piece
per row, and shuffled with a 100,000-example buffer, as in Pax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import errno
import functools
import json
import math
import os
import re
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from paxlite.data import tokenizer as tokenizer_lib
from paxlite.data.errors import DatasetError
from paxlite.data.feeding import ProcessShare, check_vocab_and_seed
from paxlite.data.seqio_tasks import (
    BOOLQ_TASK,
    LAMBADA_TASK,
    LM_TASKS,
    SOURCES,
    TRAIN_SHUFFLE_BUFFER,
    TfdsSource,
    import_seqio,
    register_tasks,
    resolve_mixture,
)

_STATE_VERSION = 1
# TensorFlow names the file it could not open first: "{...} PATH; No such file or directory [Op:..."
_TF_MISSING_FILE = re.compile(r"(?:^|\s)(\S+); No such file or directory")


@functools.cache
def _tf_not_found() -> type[Exception]:
    """TensorFlow's NotFoundError, looked up once (import_seqio also sets TensorFlow's devices)."""
    _, tf = import_seqio()
    return tf.errors.NotFoundError


@contextlib.contextmanager
def _tf_reads() -> Iterator[None]:
    """A file tf.data cannot find (removed, or its filesystem unmounted, after the run started) as
    Python's FileNotFoundError naming it, which the training loop reports in one line with the
    step; TensorFlow's own NotFoundError would end the run with a traceback. Other errors pass."""
    try:
        yield
    except _tf_not_found() as error:
        # TensorFlow's frames in the error's traceback hold the tf.data iterator: their locals go,
        # so the iterator (and its reader threads) is released with its owner, not whenever the
        # garbage collector frees the error. Names and line numbers stay.
        traceback.clear_frames(error.__traceback__)
        found = _TF_MISSING_FILE.search(str(error))
        path = found.group(1) if found else None
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path) from error


@dataclasses.dataclass(frozen=True, kw_only=True)
class SeqIODataConfig:
    """Which Pax LM task to read and how to cut it into rows.

    Attributes:
        task: 'the_pile_lm' or 'c4_lm_v301_gpt'; None when `mixture` is given.
        mixture: instead of `task` (DATA_MIXTURE): the name of a registered SeqIO mixture or task
            (e.g. one the experiment's module registers), or ((registered name, weight), ...), which
            is registered as a `seqio.Mixture` under a name derived from it
            (`seqio_tasks.mixture_name`).
        tfds_data_dir: the directory holding the TFDS datasets (Pax's --tfds_data_dir).
        vocab_path: the SentencePiece model (its id 0 is padding and its EOS must be > 0, as SeqIO
            assumes).
        vocab_size: the model's embedding size; the tokenizer's pieces must fit.
        seq_len: tokens per row.
        packed: pack several pieces per row (Pax PACKED_INPUT) or one piece per padded row.
        seed: the shuffle seed (Pax TRAIN_INPUT_RANDOM_SEED). Evaluation is unshuffled, so Pax's
            eval seed 4321 has no effect there and is not needed.
        train_split, eval_split: TFDS split names; `eval_split=None` means no eval data.
        shuffle_buffer_size: examples in the training shuffle buffer (Pax: 100,000).
    """

    task: str | None
    tfds_data_dir: str
    vocab_path: str
    vocab_size: int
    seq_len: int
    packed: bool = True
    seed: int = 0
    train_split: str = "train"
    eval_split: str | None = "validation"
    shuffle_buffer_size: int = TRAIN_SHUFFLE_BUFFER
    mixture: str | tuple[tuple[str, float], ...] | None = None

    def __post_init__(self):
        if (self.task is None) == (self.mixture is None):
            raise ValueError(f"give exactly one of task={self.task!r} and mixture={self.mixture!r}")
        if isinstance(self.mixture, list | tuple):
            object.__setattr__(self, "mixture", tuple((str(n), float(w)) for n, w in self.mixture))
            if not self.mixture or any(not math.isfinite(w) or w <= 0 for _, w in self.mixture):
                raise ValueError("a SeqIO mixture needs (name, weight > 0) pairs, got "
                                 f"{self.mixture}")
        if self.task is not None and self.task not in LM_TASKS:
            close = difflib.get_close_matches(self.task, LM_TASKS + (LAMBADA_TASK, BOOLQ_TASK), n=1)
            hint = f"; did you mean {close[0]!r}?" if close and close[0] in LM_TASKS else ""
            eval_only = (
                f" ({self.task!r} is an evaluation task, not a training stream)"
                if self.task in SOURCES else ""
            )
            raise ValueError(
                f"unknown SeqIO LM task {self.task!r}{eval_only}; valid: {list(LM_TASKS)}{hint}"
            )
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (tokens plus EOS), got {self.seq_len}")
        check_vocab_and_seed(vocab_size=self.vocab_size, seed=self.seed)
        if self.shuffle_buffer_size < 1:
            raise ValueError(f"shuffle_buffer_size must be >= 1, got {self.shuffle_buffer_size}")


def _paxlite_batch(features: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """SeqIO LM converter output [B, L] -> paxlite's inputs/targets/weights/positions/segment_ids.

    Packed batches carry SeqIO's segment ids and positions. Unpacked rows hold one example from
    column 0, so they are segment 1 on their real tokens. SeqIO shifts inputs within segments
    already; zeroing every position-0 input also clears the one place it differs from paxlite's
    convention: the first padding slot of an unpacked row, where SeqIO leaves the row's last token.
    """
    targets = np.asarray(features["decoder_target_tokens"], dtype=np.int32)
    weights = np.asarray(features["decoder_loss_weights"], dtype=np.float32)
    if "decoder_segment_ids" in features:
        segment_ids = np.asarray(features["decoder_segment_ids"], dtype=np.int32)
        positions = np.asarray(features["decoder_positions"], dtype=np.int32)
    else:
        real = targets != 0
        segment_ids = real.astype(np.int32)
        columns = np.arange(targets.shape[1], dtype=np.int32)
        positions = np.where(real, columns, 0).astype(np.int32)
    inputs = np.where(positions == 0, 0, features["decoder_input_tokens"]).astype(np.int32)
    return {"inputs": inputs, "targets": targets, "weights": weights, "positions": positions,
            "segment_ids": segment_ids}


def _read_dataset_info(source: TfdsSource, tfds_data_dir: str) -> dict[str, Any]:
    directory = source.directory(tfds_data_dir)
    info_path = os.path.join(directory, "dataset_info.json")
    if not os.path.isfile(info_path):
        raise DatasetError(
            f"TFDS dataset {source.tfds_name} is not prepared: {info_path!r} does not exist; "
            f"{source.how_to_get.replace('DIR', tfds_data_dir)}"
        )
    with open(info_path) as f:
        info = json.load(f)
    file_format = info.get("fileFormat", "tfrecord")
    if file_format != "tfrecord":
        raise DatasetError(
            f"TFDS dataset {source.tfds_name} in {directory!r} is stored as {file_format!r}; SeqIO "
            "reads through tf.data, which TFDS supports only for TFRecord. "
            f"Rebuild it as TFRecord ({source.how_to_get.replace('DIR', tfds_data_dir)}), or read "
            "this copy with paxlite's default (Grain) input pipeline"
        )
    return info


class SeqIOTrainIterator:
    """Infinite iterator over this process's rows of each global training batch.

    SeqIO's tf.data iterators cannot be saved without TensorFlow checkpoints, so the state is only
    the number of batches consumed; `set_state` rebuilds the same deterministic pipeline (fixed
    seed) and skips that many batches. Resuming therefore costs O(batches consumed) reading and
    preprocessing (in TensorFlow's C++ runtime), unlike paxlite's constant-time Grain resume.
    """

    def __init__(self, make_dataset: Callable[[], Any], *, meta: dict[str, Any]):
        self._make_dataset = make_dataset
        self._meta = meta
        self._consumed = 0
        self._numpy: Iterator[dict[str, np.ndarray]] | None = None

    def __iter__(self) -> SeqIOTrainIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        try:
            with _tf_reads():
                if self._numpy is None:
                    self._numpy = self._make_dataset().skip(self._consumed).as_numpy_iterator()
                features = next(self._numpy)
        except StopIteration:
            raise DatasetError(
                f"SeqIO task {self._meta['task']!r} gave process {self._meta['process_index']} of "
                f"{self._meta['process_count']} no full batch: its shard of the training split is "
                "empty or too small"
            ) from None
        self._consumed += 1
        return _paxlite_batch(features)

    def get_state(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, **self._meta, "batches_consumed": self._consumed}

    def set_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise DatasetError(
                f"not a SeqIOTrainIterator state (version {_STATE_VERSION}): {str(state)[:200]}"
            )
        for key, expected in self._meta.items():
            if state.get(key) != expected:
                raise DatasetError(
                    f"SeqIO iterator state was saved with {key}={state.get(key)!r} but this "
                    f"pipeline has {key}={expected!r}; resume with the same data settings"
                )
        consumed = state.get("batches_consumed")
        if not isinstance(consumed, int) or consumed < 0:
            raise DatasetError(f"batches_consumed must be an int >= 0, got {consumed!r}")
        self._consumed = consumed
        self.close()  # rebuilt, and the consumed batches skipped, on the next batch

    def close(self) -> None:
        """Release the tf.data iterator and its reader threads now. Left to Python's garbage
        collector (a Run is freed in a collection), the iterator's destructor runs at some later
        moment, on whatever thread triggers that collection, and waits there for its threads."""
        self._numpy = None


class SeqIOData(ProcessShare):
    """Host-side batches of a Pax SeqIO LM task for one process.

    Everything cheap is checked before any dataset is built: the TFDS directory, the dataset's
    version directory, its file format and splits, and the tokenizer and its fit to `vocab_size`.
    Each process reads its own shard (`seqio.ShardInfo(process_index, process_count)`): whole files
    when the split has at least `process_count` of them, else every `process_count`-th example.
    """

    has_eval_data = True  # Pax's tasks always have their validation split

    config: SeqIODataConfig

    def _open(self) -> None:
        config = self.config
        self._eval_batch_count: int | None = None

        tfds_data_dir = os.path.abspath(os.path.expanduser(config.tfds_data_dir))
        if not os.path.isdir(tfds_data_dir):
            raise DatasetError(f"TFDS data directory {tfds_data_dir!r} does not exist")
        if config.task is not None:  # a mixture's tasks read what their registrations say
            source = SOURCES[config.task]
            info = _read_dataset_info(source, tfds_data_dir)
            splits = sorted(split["name"] for split in info.get("splits", []))
            for split in (config.train_split, config.eval_split):
                if split is not None and split not in splits:
                    raise DatasetError(
                        f"TFDS dataset {source.tfds_name} in {tfds_data_dir!r} has no split "
                        f"{split!r}; it has {splits}"
                    )
        vocab_path = os.path.abspath(os.path.expanduser(config.vocab_path))
        if not os.path.exists(vocab_path):
            raise tokenizer_lib.VocabError(f"tokenizer file {vocab_path!r} does not exist")
        tokenizer = tokenizer_lib.Tokenizer(vocab_path)
        if tokenizer.format is not tokenizer_lib.TokenizerFormat.SENTENCEPIECE:
            raise tokenizer_lib.VocabError(
                f"SeqIO's tasks read a SentencePiece model and {tokenizer.path} is a "
                f"{tokenizer.format.value} tokenizer: prepare the text with `python -m "
                "paxlite.data.prepare` and train from DATA_DIR instead")
        if tokenizer.vocab_size > config.vocab_size:  # SeqIO encodes with its own vocabulary,
            # past paxlite's per-text check, so a larger tokenizer is refused here as a whole
            raise tokenizer_lib.VocabError(
                f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} pieces but the model's "
                f"VOCAB_SIZE is {config.vocab_size}; SeqIO's tasks can emit every piece, so set "
                f"--fdl.VOCAB_SIZE to at least {tokenizer.vocab_size}")
        if tokenizer.eos_id < 1:
            raise tokenizer_lib.VocabError(
                f"tokenizer {tokenizer.path} has eos_id {tokenizer.eos_id}; SeqIO needs an EOS id "
                "> 0 (id 0 is its padding)"
            )
        register_tasks(vocab_path=tokenizer.path, tfds_data_dir=tfds_data_dir,
                       shuffle_buffer_size=config.shuffle_buffer_size)
        self._name = config.task if config.mixture is None else resolve_mixture(config.mixture)
        self._lengths = {"targets": config.seq_len}

    def _dataset(self, *, split: str, shard_index: int, train: bool) -> Any:
        """Batched converter output: shuffled, packed as configured and repeated for training;
        unshuffled, unpacked, one pass, last batch short for evaluation."""
        seqio, _ = import_seqio()
        config = self.config
        provider = seqio.get_mixture_or_task(self._name)
        # A seqio.Mixture shuffles each task with that task's own buffer (it takes no size).
        buffer = {} if isinstance(provider, seqio.Mixture) else {
            "shuffle_buffer_size": config.shuffle_buffer_size if train else None}
        ds = provider.get_dataset(
            self._lengths,
            split=split,
            use_cached=False,
            shuffle=train,
            **buffer,
            seed=config.seed if train else None,
            shard_info=seqio.ShardInfo(index=shard_index, num_shards=self.process_count),
            num_epochs=None if train else 1,
        )
        converter = seqio.DecoderFeatureConverter(pack=config.packed and train)
        return converter(ds, self._lengths).batch(self.local_batch_size, drop_remainder=train)

    def train_iterator(self) -> SeqIOTrainIterator:
        """Infinite stream of this process's training rows (each epoch reshuffled from the seed)."""
        config = self.config
        make = functools.partial(
            self._dataset, split=config.train_split, shard_index=self.process_index, train=True
        )
        meta = {"task": self._name, "seed": config.seed, "seq_len": config.seq_len,
                "packed": config.packed, "global_batch_size": self.global_batch_size,
                "process_index": self.process_index, "process_count": self.process_count}
        return SeqIOTrainIterator(make, meta=meta)

    def num_eval_batches(self) -> int:
        """Batches that hold the whole eval split once, the same on every process.

        Counts the rows of every process's shard (a pass over the eval split per process, once per
        SeqIOData): shards can differ in size and every process must run the same number of eval
        steps.
        """
        self._check_eval_split()
        if self._eval_batch_count is None:
            counts = []
            for shard in range(self.process_count):
                ds = self._dataset(split=self.config.eval_split, shard_index=shard, train=False)
                with _tf_reads():
                    rows = ds.unbatch().reduce(np.int64(0), lambda count, _: count + 1)
                counts.append(int(rows))
            self._eval_batch_count = max(math.ceil(n / self.local_batch_size) for n in counts)
        return self._eval_batch_count

    def eval_batches(self, num_batches: int) -> Iterator[dict[str, np.ndarray]]:
        """`num_batches` eval batches (-1: the whole split once, counted first), as Pax evaluates.

        Unshuffled, unpacked and padded. Rows past the end of this process's shard are all zero
        with weight 0, so every process yields exactly the same number of batches; a positive
        `num_batches` is not capped at the split's length (no counting pass is needed for it).
        """
        self._check_eval_split()
        if num_batches != -1 and num_batches < 1:
            raise ValueError(f"num_batches must be -1 (whole split) or >= 1, got {num_batches}")
        count = self.num_eval_batches() if num_batches == -1 else num_batches
        return self._padded_eval_batches(count)

    def _check_eval_split(self) -> None:
        if self.config.eval_split is None:
            raise ValueError("this SeqIOData has no eval split (config.eval_split is None)")

    def _padded_eval_batches(self, count: int) -> Iterator[dict[str, np.ndarray]]:
        split = self.config.eval_split
        assert split is not None  # checked by eval_batches
        ds = self._dataset(split=split, shard_index=self.process_index, train=False)
        batches = ds.as_numpy_iterator()
        shape = (self.local_batch_size, self.config.seq_len)
        try:
            for _ in range(count):
                with _tf_reads():
                    features = next(batches, None)
                padded = {}
                for key in ("decoder_target_tokens", "decoder_input_tokens",
                            "decoder_loss_weights"):
                    padded[key] = np.zeros(shape, dtype=np.int32)
                    if features is not None:
                        padded[key][: len(features[key])] = features[key]
                yield _paxlite_batch(padded)
        finally:  # an error's traceback keeps this frame: release the reader threads now
            batches = None
