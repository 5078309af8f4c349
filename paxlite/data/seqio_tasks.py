"""Pax's SeqIO tasks, re-created with Pax's semantics (the `seqio` extra).

Pax's GPU configs read The Pile, C4, Lambada and BoolQ through SeqIO tasks over TFDS datasets. This
module re-creates those tasks (our own code) so a run can be compared with Pax token for token, and
registers the mixtures a DATA_MIXTURE names; `seqio_pipeline` turns what they yield into paxlite's
batches. It is its own module so the tasks, their preprocessors and the BoolQ prompt can be used
(by the BoolQ reader, the benchmarks, an experiment's own tasks) without the pipeline.

TensorFlow and SeqIO are heavy (2+ GB) and optional: they are imported only inside the functions
that need them (`import_seqio`), so `import paxlite.data.seqio_tasks` works without them. TensorFlow
is kept off the GPUs, which belong to JAX (Pax did the same).

The LM tasks (`the_pile_lm`, `c4_lm_v301_gpt`): text -> tokens -> the token ids of every 128
consecutive documents concatenated -> pieces of `seq_len - 1` -> EOS appended to each piece. The
pipeline then packs the pieces into rows or puts one per row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import hashlib
import json
import os
import types
from collections.abc import Mapping
from typing import Any

from paxlite.data import tokenizer as tokenizer_lib
from paxlite.data.errors import DatasetError

THE_PILE_TASK = "the_pile_lm"
C4_TASK = "c4_lm_v301_gpt"
LAMBADA_TASK = "lambada_eval"
BOOLQ_TASK = "boolq"
CONCAT_GROUP_SIZE = 128  # documents whose tokens reduce_concat_tokens joins (Pax/T5)
TRAIN_SHUFFLE_BUFFER = 100_000  # Pax's shuffle_buffer_size for the LM tasks
SEQIO_EXTRA = "pip install 'paxlite[seqio]'"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TfdsSource:
    """A TFDS dataset Pax's tasks read, and how a user gets it."""

    tfds_name: str  # name[/config]:version, as SeqIO wants it
    how_to_get: str

    def directory(self, tfds_data_dir: str) -> str:
        """TFDS's layout: <data_dir>/<name>[/<config>]/<version>."""
        base, _, version = self.tfds_name.partition(":")
        return os.path.join(tfds_data_dir, *base.split("/"), version)


def _script_hint(script: str) -> str:
    return f"run `python scripts_gpu/{script} --data_dir=DIR --file_format=tfrecord`"


SOURCES = types.MappingProxyType({
    THE_PILE_TASK: TfdsSource(tfds_name="the_pile:1.0.0",
                              how_to_get=_script_hint("download_the_pile.py")),
    C4_TASK: TfdsSource(tfds_name="c4/en:3.0.1",
                        how_to_get="build it with `tfds build c4/en:3.0.1 --data_dir=DIR`"),
    LAMBADA_TASK: TfdsSource(tfds_name="my_lambada:1.0.0",
                             how_to_get=_script_hint("download_lambada.py")),
    BOOLQ_TASK: TfdsSource(tfds_name="super_glue/boolq:1.0.2",
                           how_to_get=_script_hint("download_boolq.py")),
})
LM_TASKS = (THE_PILE_TASK, C4_TASK)  # the tasks SeqIOData trains and evaluates on


def task_for_dataset(tfds_name: str) -> str:
    """The Pax LM task over a TFDS dataset name (an experiment's TFDS_DATASET)."""
    for task in LM_TASKS:
        if SOURCES[task].tfds_name == tfds_name:
            return task
    known = {SOURCES[t].tfds_name: t for t in LM_TASKS}
    raise ValueError(f"no Pax SeqIO task reads {tfds_name!r}; tasks exist for {known}")


def import_seqio() -> tuple[Any, Any]:
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
    _, tf = import_seqio()
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
    _, tf = import_seqio()
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
    _, tf = import_seqio()

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
    missing dataset is an error, never a download. `shuffle_buffer_size` is the LM tasks' own (what
    a `seqio.Mixture` of them shuffles with; reading a task directly passes its size anyway).
    """
    seqio, tf = import_seqio()
    vocab_path = os.path.abspath(os.path.expanduser(vocab_path))
    if not os.path.isfile(vocab_path):
        raise tokenizer_lib.VocabError(f"tokenizer file {vocab_path!r} does not exist")
    if tfds_data_dir is not None:
        tfds_data_dir = os.path.abspath(os.path.expanduser(tfds_data_dir))
    seqio.set_tfds_data_dir_override(tfds_data_dir)
    vocabulary = seqio.SentencePieceVocabulary(vocab_path)

    def source(task: str) -> Any:
        # No per-source directory: with the override it would only log a warning per read.
        return seqio.TfdsDataSource(tfds_name=SOURCES[task].tfds_name, read_only=True)

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
    seqio, _ = import_seqio()
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
