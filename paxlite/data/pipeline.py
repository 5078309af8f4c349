"""The input pipeline: Grain over ArrayRecord shards -> tokens -> packed or padded rows -> batches.

The features follow SeqIO's LM feature converter, which is what Pax's `the_pile_lm` task fed: every
document gets EOS appended; packed rows concatenate documents and split them at `seq_len` (a
document that does not fit continues in the next row as a new segment, so nothing is dropped and no
row is padded); `inputs` are the targets shifted right *within each segment* with 0 at every
segment start, so no token is ever predicted from the previous document. Concat-then-split was
chosen over first-fit packing because it wastes no tokens on padding (first-fit left ~8% padding
with 32 bins on 10..1500-token documents), keeps documents longer than `seq_len` without a separate
chunking step, and was ~20% faster.

Each process reads only its slice `[process_index::process_count]` of the records, before shuffling,
so processes never see the same document and need not talk to each other; each returns its own
`global_batch_size // process_count` rows of every global batch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator
from typing import Any

import grain
import numpy as np

from paxlite.data import records
from paxlite.data import tokenizer as tokenizer_lib

_STATE_VERSION = 1
# Reading happens in the calling thread: with the GIL, reader threads made pre-tokenized packing
# slower (4.0M tokens/s with 0 threads, 3.0M with 2, 1.5M with 16, on 2 shared cores, for documents of
# a few thousand tokens; short documents are bound by a per-document cost, see docs/performance.md).
_READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextDataConfig:
    """Where the prepared dataset lives and how to turn it into rows.

    Attributes:
        data_dir: a directory written by `paxlite.data.prepare` (manifest + ArrayRecord shards).
        vocab_path: the SentencePiece model; required for "text" datasets, optional for "tokens"
            ones (then checked against the manifest's sha256).
        vocab_size: the model's embedding size; the tokenizer must not emit ids beyond it.
        seq_len: tokens per row.
        packed: concatenate documents into full rows (Pax PACKED_INPUT), or one padded document
            per row.
        shuffle: shuffle documents, reshuffled every epoch from `seed`.
        seed: the shuffle seed (0 <= seed < 2**32).
        train_split, eval_split: split names in the manifest; `eval_split=None` means no eval data.
    """

    data_dir: str
    vocab_path: str | None
    vocab_size: int
    seq_len: int
    packed: bool = True
    shuffle: bool = True
    seed: int = 0
    train_split: str = "train"
    eval_split: str | None = "validation"

    def __post_init__(self):
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")


class _EncodeDocument:
    """One record's bytes -> int32 token ids with EOS appended (the SeqIO LM convention)."""

    def __init__(self, *, kind: str, tokenizer: tokenizer_lib.Tokenizer | None, eos_id: int):
        self._kind = kind
        self._tokenizer = tokenizer
        self._eos = np.asarray([eos_id], dtype=np.int32)

    def __call__(self, record: bytes) -> np.ndarray:
        doc = records.decode_record(self._kind, record)
        if isinstance(doc, str):
            assert self._tokenizer is not None  # guaranteed by TextData's validation
            ids = np.asarray(self._tokenizer.encode(doc), dtype=np.int32)
        else:
            ids = np.asarray(doc, dtype=np.int32)
        return np.concatenate([ids, self._eos])


class _UnpackedRow:
    """One record -> one row of `seq_len`: truncated, right-padded with 0 (segment 0, weight 0)."""

    def __init__(self, encode: _EncodeDocument, *, seq_len: int):
        self._encode = encode
        self._seq_len = seq_len

    def __call__(self, record: bytes) -> dict[str, np.ndarray]:
        ids = self._encode(record)
        n = min(ids.shape[0], self._seq_len)
        targets = np.zeros(self._seq_len, dtype=np.int32)
        targets[:n] = ids[:n]
        segment_ids = np.zeros(self._seq_len, dtype=np.int32)
        segment_ids[:n] = 1
        positions = np.zeros(self._seq_len, dtype=np.int32)
        positions[:n] = np.arange(n, dtype=np.int32)
        return {"targets": targets, "segment_ids": segment_ids, "positions": positions}


class _PackInput:
    """One record -> the single-feature element that Grain's concat-then-split packs.

    One map stage rather than two: Grain's per-element overhead is comparable to reading a record.
    """

    def __init__(self, encode: _EncodeDocument):
        self._encode = encode

    def __call__(self, record: bytes) -> dict[str, np.ndarray]:
        return {"targets": self._encode(record)}


def _packed_features(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Grain's concat-then-split feature names -> the row keys used here, for a whole batch."""
    return _lm_features(
        {
            "targets": rows["targets"],
            "segment_ids": rows["targets_segment_ids"],
            "positions": rows["targets_positions"],
        }
    )


def _lm_features(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """[B, L] targets/segment_ids/positions -> the full batch; vectorised, no per-token Python."""
    targets = rows["targets"].astype(np.int32, copy=False)
    positions = rows["positions"].astype(np.int32, copy=False)
    segment_ids = rows["segment_ids"].astype(np.int32, copy=False)
    inputs = np.zeros_like(targets)
    inputs[:, 1:] = targets[:, :-1]
    # Every segment (and all padding) starts at position 0: nothing is predicted across documents.
    inputs[positions == 0] = 0
    return {
        "inputs": inputs,
        "targets": targets,
        "weights": (segment_ids > 0).astype(np.float32),
        "positions": positions,
        "segment_ids": segment_ids,
    }


def _json_roundtrip(state: Any) -> Any:
    return json.loads(json.dumps(state))


def _restore_tuples(state: Any) -> Any:
    """Undoes JSON's tuple -> list for Grain's concat-then-split slices (it compares to tuples)."""
    if isinstance(state, dict):
        return {
            key: (
                {k: tuple(v) for k, v in value.items()}
                if key == "remainder_slices"
                else _restore_tuples(value)
            )
            for key, value in state.items()
        }
    return state


class TrainIterator:
    """Infinite iterator over this process's rows of each global training batch, resumable.

    `get_state()` is plain JSON (it goes into the checkpoint next to the train state) and records
    how the stream was built, so restoring it into a differently configured pipeline fails loudly
    instead of silently yielding other data.
    """

    def __init__(self, iterator: grain.DatasetIterator, *, meta: dict[str, Any]):
        self._iterator = iterator
        self._meta = meta

    def __iter__(self) -> TrainIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._iterator)

    def get_state(self) -> dict:
        return {
            "version": _STATE_VERSION,
            **self._meta,
            "grain": _json_roundtrip(self._iterator.get_state()),
        }

    def set_state(self, state: dict) -> None:
        if (
            not isinstance(state, dict)
            or state.get("version") != _STATE_VERSION
            or "grain" not in state
        ):
            raise ValueError(
                f"not a paxlite TrainIterator state (version {_STATE_VERSION} with a 'grain' "
                f"entry): {str(state)[:200]}"
            )
        for key, expected in self._meta.items():
            if state.get(key) != expected:
                raise ValueError(
                    f"data iterator state was saved with {key}={state.get(key)!r} but this "
                    f"pipeline has {key}={expected!r}; resume with the same data settings"
                )
        self._iterator.set_state(_restore_tuples(state["grain"]))


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Split:
    name: str
    source: grain.sources.ArrayRecordDataSource


class TextData:
    """Host-side batches for one process.

    Everything that can be checked cheaply is checked here, before any training starts: the
    directory, the manifest, the splits, the tokenizer and its fit to `vocab_size`, and the batch
    split over processes.
    """

    def __init__(
        self,
        config: TextDataConfig,
        *,
        global_batch_size: int,
        process_index: int = 0,
        process_count: int = 1,
    ):
        if process_count < 1 or not 0 <= process_index < process_count:
            raise ValueError(
                f"process_index must be in [0, process_count), got process_index={process_index}, "
                f"process_count={process_count}"
            )
        if global_batch_size < 1 or global_batch_size % process_count:
            raise ValueError(
                f"global_batch_size {global_batch_size} must be a positive multiple of the process "
                f"count {process_count}"
            )
        self.config = config
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // process_count
        self.process_index = process_index
        self.process_count = process_count

        data_dir = os.path.abspath(os.path.expanduser(config.data_dir))
        if not os.path.isdir(data_dir):
            raise records.DatasetError(f"dataset directory {data_dir!r} does not exist")
        self.info = records.read_info(data_dir)
        self._data_dir = data_dir
        # Every process needs training documents; for eval, a process past the end just pads.
        self._train = self._open_split(config.train_split, min_records=process_count)
        self._eval = (
            None
            if config.eval_split is None
            else self._open_split(config.eval_split, min_records=1)
        )
        self._encode = self._make_encoder()

    def _open_split(self, split: str, *, min_records: int) -> _Split:
        if split not in self.info.splits:
            raise records.DatasetError(
                f"dataset {self._data_dir!r} has no split {split!r}; it has "
                f"{sorted(self.info.splits)}"
            )
        paths = records.shard_paths(self.info, split)
        for path in paths:
            if not os.path.isfile(path):
                raise records.DatasetError(f"split {split!r} shard {path!r} does not exist")
        source = grain.sources.ArrayRecordDataSource(paths)
        if len(source) < min_records:
            raise records.DatasetError(
                f"split {split!r} of {self._data_dir!r} has {len(source)} documents; it needs at "
                f"least {min_records} ({self.process_count} processes)"
            )
        return _Split(name=split, source=source)

    def _make_encoder(self) -> _EncodeDocument:
        config, info = self.config, self.info
        manifest_tok = info.tokenizer
        tok = None
        if config.vocab_path is not None:
            vocab_path = os.path.abspath(os.path.expanduser(config.vocab_path))
            if not os.path.isfile(vocab_path):
                raise tokenizer_lib.VocabError(f"tokenizer file {vocab_path!r} does not exist")
            tok = tokenizer_lib.Tokenizer(vocab_path)
        if info.kind == "text":
            if tok is None:
                raise tokenizer_lib.VocabError(
                    f"dataset {self._data_dir!r} holds raw text: set vocab_path to the "
                    "SentencePiece model that should tokenise it"
                )
        else:
            missing = [
                k for k in ("sha256", "vocab_size", "eos_id") if k not in (manifest_tok or {})
            ]
            if missing:
                raise records.DatasetError(
                    f"tokens dataset {self._data_dir!r}: the manifest's tokenizer entry lacks "
                    f"{missing}"
                )
            if tok is not None and tok.sha256() != manifest_tok["sha256"]:
                raise tokenizer_lib.VocabError(
                    f"tokenizer {tok.path!r} (sha256 {tok.sha256()}) is not the one that tokenised "
                    f"{self._data_dir!r} ({manifest_tok.get('path')!r}, "
                    f"sha256 {manifest_tok['sha256']})"
                )
        if tok is not None:
            tokenizer_lib.check_vocab_fits(tok, vocab_size=config.vocab_size)
            eos_id = tok.eos_id
        else:
            manifest_vocab = int(manifest_tok["vocab_size"])
            if manifest_vocab > config.vocab_size:
                raise tokenizer_lib.VocabError(
                    f"dataset {self._data_dir!r} was tokenised with {manifest_vocab} pieces but "
                    f"the model's vocab_size is {config.vocab_size}; set vocab_size to at least "
                    f"{manifest_vocab}"
                )
            eos_id = int(manifest_tok["eos_id"])
        if eos_id < 0:
            raise tokenizer_lib.VocabError(
                f"tokenizer for {self._data_dir!r} defines no EOS id; the LM pipeline appends EOS"
            )
        return _EncodeDocument(
            kind=info.kind, tokenizer=tok if info.kind == "text" else None, eos_id=eos_id
        )

    def _documents(self, split: _Split) -> grain.MapDataset:
        """This process's records, in file order: the slice is taken before any shuffle."""
        return grain.MapDataset.source(split.source)[self.process_index :: self.process_count]

    def train_iterator(self) -> TrainIterator:
        """Infinite stream of this process's training rows, reshuffled every epoch from the seed."""
        config = self.config
        docs = self._documents(self._train)
        if config.shuffle:
            docs = docs.shuffle(seed=config.seed)
        # reseed_each_epoch hands the shuffle indices past the first epoch, which it reshuffles.
        docs = docs.repeat(reseed_each_epoch=True)
        if config.packed:
            stream = grain.experimental.ConcatThenSplitIterDataset(
                docs.map(_PackInput(self._encode)).to_iter_dataset(_READ_OPTIONS),
                length_struct={"targets": config.seq_len},
            )
            finish = _packed_features
        else:
            rows = docs.map(_UnpackedRow(self._encode, seq_len=config.seq_len))
            stream, finish = rows.to_iter_dataset(_READ_OPTIONS), _lm_features
        stream = stream.batch(self.local_batch_size, drop_remainder=True).map(finish)
        meta = {
            "split": config.train_split,
            "packed": config.packed,
            "shuffle": config.shuffle,
            "seed": config.seed,
            "seq_len": config.seq_len,
            "global_batch_size": self.global_batch_size,
            "process_index": self.process_index,
            "process_count": self.process_count,
        }
        return TrainIterator(iter(stream), meta=meta)

    def num_eval_batches(self) -> int:
        """Global batches that hold the whole eval split once (the same on every process)."""
        if self._eval is None:
            raise ValueError("this TextData has no eval split (config.eval_split is None)")
        return math.ceil(len(self._eval.source) / self.global_batch_size)

    def eval_batches(self, num_batches: int) -> Iterator[dict[str, np.ndarray]]:
        """The first `num_batches` eval batches (-1: the whole split once), as Pax evaluates.

        Deterministic, unshuffled and unpacked. Every process yields the same number of batches
        (derived from the global record count) so multi-process eval steps stay in lockstep; rows
        past the end of a process's slice are all zero, with weight 0.
        """
        total = self.num_eval_batches()
        if num_batches == -1:
            count = total
        elif num_batches >= 1:
            count = min(num_batches, total)
        else:
            raise ValueError(f"num_batches must be -1 (whole split) or >= 1, got {num_batches}")
        rows = self._documents(self._eval).map(
            _UnpackedRow(self._encode, seq_len=self.config.seq_len)
        )
        return self._padded_batches(iter(rows.to_iter_dataset(_READ_OPTIONS)), count=count)

    def _padded_batches(
        self, rows: Iterator[dict[str, np.ndarray]], *, count: int
    ) -> Iterator[dict[str, np.ndarray]]:
        shape = (self.local_batch_size, self.config.seq_len)
        for _ in range(count):
            batch = {
                key: np.zeros(shape, dtype=np.int32)
                for key in ("targets", "segment_ids", "positions")
            }
            # range first: zip stops before pulling a row that would not fit this batch.
            for i, row in zip(range(self.local_batch_size), rows, strict=False):
                for key, value in row.items():
                    batch[key][i] = value
            yield _lm_features(batch)
