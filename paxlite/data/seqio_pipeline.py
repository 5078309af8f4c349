"""Pax's SeqIO tasks and their batches in paxlite's format (the `seqio` extra).

Pax's GPU configs read The Pile, C4, Lambada and BoolQ through SeqIO tasks over TFDS datasets. This
module re-creates those tasks with Pax's semantics (our own code) so a run can be compared with Pax
token for token, and maps SeqIO's LM feature converter output onto paxlite's batch names.

TensorFlow and SeqIO are heavy (2+ GB) and optional: they are imported only inside the functions
that need them, so `import paxlite.data.seqio_pipeline` works without them. TensorFlow is kept off
the GPUs, which belong to JAX (Pax did the same).

The LM tasks (`the_pile_lm`, `c4_lm_v301_gpt`): text -> tokens -> the token ids of every 128
consecutive documents concatenated -> pieces of `seq_len - 1` -> EOS appended to each piece -> rows,
packed (`packed=True`) by SeqIO's greedy packer or one piece per row. The pieces are shuffled with a
100,000-example buffer for training, as in Pax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import hashlib
import json
import math
import os
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from paxlite.data import tokenizer as tokenizer_lib
from paxlite.data.errors import DatasetError
from paxlite.data.feeding import local_batch_size

THE_PILE_TASK = "the_pile_lm"
C4_TASK = "c4_lm_v301_gpt"
LAMBADA_TASK = "lambada_eval"
BOOLQ_TASK = "boolq"
CONCAT_GROUP_SIZE = 128  # documents whose tokens reduce_concat_tokens joins (Pax/T5)
TRAIN_SHUFFLE_BUFFER = 100_000  # Pax's shuffle_buffer_size for the LM tasks
SEQIO_EXTRA = "pip install 'paxlite[seqio]'"
_STATE_VERSION = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class _TfdsSource:
    """A TFDS dataset Pax's tasks read, and how a user gets it."""

    tfds_name: str  # name[/config]:version, as SeqIO wants it
    how_to_get: str

    def directory(self, tfds_data_dir: str) -> str:
        """TFDS's layout: <data_dir>/<name>[/<config>]/<version>."""
        base, _, version = self.tfds_name.partition(":")
        return os.path.join(tfds_data_dir, *base.split("/"), version)


def _script_hint(script: str) -> str:
    return f"run `python scripts_gpu/{script} --data_dir=DIR --file_format=tfrecord`"


_SOURCES = types.MappingProxyType({
    THE_PILE_TASK: _TfdsSource(tfds_name="the_pile:1.0.0",
                               how_to_get=_script_hint("download_the_pile.py")),
    C4_TASK: _TfdsSource(tfds_name="c4/en:3.0.1",
                         how_to_get="build it with `tfds build c4/en:3.0.1 --data_dir=DIR`"),
    LAMBADA_TASK: _TfdsSource(tfds_name="my_lambada:1.0.0",
                              how_to_get=_script_hint("download_lambada.py")),
    BOOLQ_TASK: _TfdsSource(tfds_name="super_glue/boolq:1.0.2",
                            how_to_get=_script_hint("download_boolq.py")),
})
LM_TASKS = (THE_PILE_TASK, C4_TASK)  # the tasks SeqIOData trains and evaluates on


def task_for_dataset(tfds_name: str) -> str:
    """The Pax LM task over a TFDS dataset name (an experiment's TFDS_DATASET)."""
    for task in LM_TASKS:
        if _SOURCES[task].tfds_name == tfds_name:
            return task
    known = {_SOURCES[t].tfds_name: t for t in LM_TASKS}
    raise ValueError(f"no Pax SeqIO task reads {tfds_name!r}; tasks exist for {known}")


def _import_seqio() -> tuple[Any, Any]:
    """(seqio, tensorflow), imported on first use; TensorFlow is hidden from the GPUs."""
    try:
        import seqio
        import tensorflow as tf
    except ImportError as e:
        message = f"the SeqIO input pipeline needs the seqio extra: {SEQIO_EXTRA} ({e})"
        raise ImportError(message) from e
    # RuntimeError: TensorFlow had initialised its devices already (an earlier call hid the GPUs).
    with contextlib.suppress(RuntimeError):
        tf.config.set_visible_devices([], "GPU")
    return seqio, tf


def reduce_concat_tokens(ds: Any, *, batch_size: int = CONCAT_GROUP_SIZE) -> Any:
    """Joins the 'targets' ids of every `batch_size` consecutive examples into one example.

    No separator is inserted (each document has no EOS yet; EOS is appended after splitting), the
    last group may be smaller, and every other feature is dropped. As in Pax/T5, id 0 is removed
    from the joined tokens along with the batch padding: 0 is the padding id for SeqIO, so a real
    token with id 0 could not survive packing anyway.
    """
    _, tf = _import_seqio()
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    ds = ds.map(lambda x: {"targets": x["targets"]}, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.padded_batch(batch_size, padded_shapes={"targets": [-1]})

    def concat(x: dict[str, Any]) -> dict[str, Any]:
        tokens = tf.reshape(x["targets"], [-1])
        return {"targets": tf.boolean_mask(tokens, tf.not_equal(tokens, 0))}

    return ds.map(concat, num_parallel_calls=tf.data.AUTOTUNE)


def split_tokens_to_targets_length(
    ds: Any, *, sequence_length: Mapping[str, int], output_features: Mapping[str, Any]
) -> Any:
    """Splits each example's 'targets' into pieces of the targets length (less one for EOS).

    With `add_eos` on the targets feature the pieces hold `seq_len - 1` tokens, so
    `append_eos_after_trim` can add EOS without cutting anything; the last piece may be shorter,
    and an empty example yields no piece. Other features are dropped.
    """
    _, tf = _import_seqio()
    piece = int(sequence_length["targets"]) - (1 if output_features["targets"].add_eos else 0)
    if piece < 1:
        raise ValueError(
            f"the targets length {sequence_length['targets']} leaves no room for tokens beside EOS"
        )

    def split(x: dict[str, Any]) -> dict[str, Any]:
        tokens = x["targets"]
        size = tf.size(tokens)
        count = (size + piece - 1) // piece
        rows = tf.reshape(tf.pad(tokens, [[0, count * piece - size]]), [count, piece])
        lengths = tf.minimum(piece, size - tf.range(count) * piece)
        return {"targets": rows, "length": lengths}

    ds = ds.map(split, num_parallel_calls=tf.data.AUTOTUNE).unbatch()
    return ds.map(
        lambda x: {"targets": x["targets"][: x["length"]]}, num_parallel_calls=tf.data.AUTOTUNE
    )


def boolq_prompt(*, passage: str, question: str, label: int) -> tuple[str, str]:
    """(inputs, targets) strings of one BoolQ example, exactly as the `boolq` task builds them."""
    return f"{passage}\nquestion: {question}?\nanswer:", "yes" if label > 0 else "no"


def _boolq_strings(ds: Any) -> Any:
    """The TensorFlow twin of `boolq_prompt` (tested to agree with it)."""
    _, tf = _import_seqio()

    def to_strings(x: dict[str, Any]) -> dict[str, Any]:
        inputs = tf.strings.join([x["passage"], "\nquestion: ", x["question"], "?\nanswer:"])
        targets = tf.where(x["label"] > 0, tf.constant("yes"), tf.constant("no"))
        return {"inputs": inputs, "targets": targets}

    return ds.map(to_strings, num_parallel_calls=tf.data.AUTOTUNE)


def register_tasks(*, vocab_path: str, tfds_data_dir: str | None,
                   shuffle_buffer_size: int = TRAIN_SHUFFLE_BUFFER) -> None:
    """(Re)registers the four Pax tasks with this vocabulary and TFDS directory.

    SeqIO binds the vocabulary when a task is registered (Pax asserted VOCAB_PATH at import for
    that reason); here a later call replaces the tasks, so the last call's settings always win.
    `tfds_data_dir` becomes SeqIO's global TFDS override, as Pax's `--tfds_data_dir` did (None
    clears a previous override: TFDS's default directory then). The sources are read-only: a
    missing dataset is an error, never a download. `shuffle_buffer_size` is the LM tasks' own (what a
    `seqio.Mixture` of them shuffles with; reading a task directly passes its size anyway).
    """
    seqio, tf = _import_seqio()
    vocab_path = os.path.abspath(os.path.expanduser(vocab_path))
    if not os.path.isfile(vocab_path):
        raise tokenizer_lib.VocabError(f"tokenizer file {vocab_path!r} does not exist")
    if tfds_data_dir is not None:
        tfds_data_dir = os.path.abspath(os.path.expanduser(tfds_data_dir))
    seqio.set_tfds_data_dir_override(tfds_data_dir)
    vocabulary = seqio.SentencePieceVocabulary(vocab_path)

    def source(task: str) -> Any:
        # No per-source directory: with the override it would only log a warning per read.
        return seqio.TfdsDataSource(tfds_name=_SOURCES[task].tfds_name, read_only=True)

    lm_features = {"targets": seqio.Feature(vocabulary=vocabulary, add_eos=True, dtype=tf.int32)}
    lm_preprocessors = [
        functools.partial(seqio.preprocessors.rekey, key_map={"targets": "text"}),
        seqio.preprocessors.tokenize,
        reduce_concat_tokens,
        split_tokens_to_targets_length,
        seqio.preprocessors.append_eos_after_trim,
    ]
    # Pax declared add_eos=True for Lambada but never appended EOS; add_eos=False says so honestly.
    eval_features = {
        key: seqio.Feature(vocabulary=vocabulary, add_eos=False, dtype=tf.int32)
        for key in ("inputs", "targets")
    }
    tasks: dict[str, dict[str, Any]] = {
        THE_PILE_TASK: dict(preprocessors=lm_preprocessors, output_features=lm_features,
                            shuffle_buffer_size=shuffle_buffer_size),
        C4_TASK: dict(preprocessors=lm_preprocessors, output_features=lm_features,
                      shuffle_buffer_size=shuffle_buffer_size),
        LAMBADA_TASK: dict(preprocessors=[seqio.preprocessors.tokenize],
                           output_features=eval_features),
        BOOLQ_TASK: dict(preprocessors=[_boolq_strings, seqio.preprocessors.tokenize],
                         output_features=eval_features),
    }
    registered = set(seqio.TaskRegistry.names())
    for name, kwargs in tasks.items():
        if name in registered:
            seqio.TaskRegistry.remove(name)
        seqio.TaskRegistry.add(name, source=source(name), metric_fns=[], **kwargs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SeqIODataConfig:
    """Which Pax LM task to read and how to cut it into rows.

    Attributes:
        task: 'the_pile_lm' or 'c4_lm_v301_gpt'; None when `mixture` is given.
        mixture: instead of `task` (DATA_MIXTURE): the name of a registered SeqIO mixture or task
            (e.g. one the experiment's module registers), or ((registered name, weight), ...), which
            is registered as a `seqio.Mixture` under a name derived from it (`mixture_name`).
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
                raise ValueError(f"a SeqIO mixture needs (name, weight > 0) pairs, got {self.mixture}")
        if self.task is not None and self.task not in LM_TASKS:
            close = difflib.get_close_matches(self.task, LM_TASKS + (LAMBADA_TASK, BOOLQ_TASK), n=1)
            hint = f"; did you mean {close[0]!r}?" if close and close[0] in LM_TASKS else ""
            eval_only = (
                f" ({self.task!r} is an evaluation task, not a training stream)"
                if self.task in _SOURCES else ""
            )
            raise ValueError(
                f"unknown SeqIO LM task {self.task!r}{eval_only}; valid: {list(LM_TASKS)}{hint}"
            )
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (tokens plus EOS), got {self.seq_len}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
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


def _read_dataset_info(source: _TfdsSource, tfds_data_dir: str) -> dict[str, Any]:
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
        if self._numpy is None:
            self._numpy = self._make_dataset().skip(self._consumed).as_numpy_iterator()
        try:
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
        self._numpy = None  # rebuilt, and the consumed batches skipped, on the next batch


def mixture_name(mixture: str | tuple[tuple[str, float], ...]) -> str:
    """The SeqIO name a DATA_MIXTURE reads: the name itself, or for (name, weight) pairs a derived
    `paxlite_mixture_<12 hex digits of their sha256>` (the same pairs, the same name)."""
    if isinstance(mixture, str):
        return mixture
    digest = hashlib.sha256(json.dumps([list(pair) for pair in mixture]).encode()).hexdigest()[:12]
    return f"paxlite_mixture_{digest}"


def resolve_mixture(mixture: str | tuple[tuple[str, float], ...]) -> str:
    """Checks every name DATA_MIXTURE uses is a registered SeqIO task or mixture (one error listing
    what is registered, with the closest names), registers the pairs form as a `seqio.Mixture`, and
    returns the name to read."""
    seqio, _ = _import_seqio()
    registered = sorted(set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names()))
    for name in [mixture] if isinstance(mixture, str) else [n for n, _ in mixture]:
        if name not in registered:
            close = difflib.get_close_matches(name, registered, n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise DatasetError(
                f"DATA_MIXTURE names {name!r}, which is no registered SeqIO task or mixture{hint} "
                f"(registered: {registered}; register yours in the experiment's module)")
    name = mixture_name(mixture)
    if not isinstance(mixture, str):
        if name in seqio.MixtureRegistry.names():
            seqio.MixtureRegistry.remove(name)
        seqio.MixtureRegistry.add(name, list(mixture))
    return name


class SeqIOData:
    """Host-side batches of a Pax SeqIO LM task for one process.

    Everything cheap is checked before any dataset is built: the TFDS directory, the dataset's
    version directory, its file format and splits, and the tokenizer and its fit to `vocab_size`.
    Each process reads its own shard (`seqio.ShardInfo(process_index, process_count)`): whole files
    when the split has at least `process_count` of them, else every `process_count`-th example.
    """

    has_eval_data = True  # Pax's tasks always have their validation split

    def __init__(
        self,
        config: SeqIODataConfig,
        *,
        global_batch_size: int,
        process_index: int = 0,
        process_count: int = 1,
    ):
        self.config = config
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size(
            global_batch_size=global_batch_size, process_index=process_index, process_count=process_count
        )
        self.process_index = process_index
        self.process_count = process_count
        self._eval_batch_count: int | None = None

        tfds_data_dir = os.path.abspath(os.path.expanduser(config.tfds_data_dir))
        if not os.path.isdir(tfds_data_dir):
            raise DatasetError(f"TFDS data directory {tfds_data_dir!r} does not exist")
        if config.task is not None:  # a mixture's tasks read what their registrations say
            source = _SOURCES[config.task]
            info = _read_dataset_info(source, tfds_data_dir)
            splits = sorted(split["name"] for split in info.get("splits", []))
            for split in (config.train_split, config.eval_split):
                if split is not None and split not in splits:
                    raise DatasetError(
                        f"TFDS dataset {source.tfds_name} in {tfds_data_dir!r} has no split {split!r}; "
                        f"it has {splits}"
                    )
        vocab_path = os.path.abspath(os.path.expanduser(config.vocab_path))
        if not os.path.isfile(vocab_path):
            raise tokenizer_lib.VocabError(f"tokenizer file {vocab_path!r} does not exist")
        tokenizer = tokenizer_lib.Tokenizer(vocab_path)
        tokenizer_lib.check_vocab_fits(tokenizer, vocab_size=config.vocab_size)
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
        seqio, _ = _import_seqio()
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
        for _ in range(count):
            features = next(batches, None)
            padded = {}
            for key in ("decoder_target_tokens", "decoder_input_tokens", "decoder_loss_weights"):
                padded[key] = np.zeros(shape, dtype=np.int32)
                if features is not None:
                    padded[key][: len(features[key])] = features[key]
            yield _paxlite_batch(padded)
