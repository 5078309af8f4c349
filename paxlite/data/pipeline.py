"""The input pipeline: ArrayRecord shards -> tokens -> packed or padded rows -> batches.

The features follow SeqIO's LM feature converter, which is what Pax's `the_pile_lm` task fed: every
document gets EOS appended; packed rows concatenate documents and split them at `seq_len` (a
document that does not fit continues in the next row as a new segment, so nothing is dropped and no
row is padded); `inputs` are the targets shifted right *within each segment* with 0 at every
segment start, so no token is ever predicted from the previous document. Concat-then-split was
chosen over first-fit packing because it wastes no tokens on padding (first-fit left ~8% padding
with 32 bins on 10..1500-token documents), keeps documents longer than `seq_len` without a separate
chunking step, and was ~20% faster. Training rows are cut by `_DocumentStream` (chunked reads, numpy
packing, a three-number position); evaluation, which reads each document once, goes through Grain.

Each process reads only its slice `[process_index::process_count]` of the records, before shuffling,
so processes never see the same document and need not talk to each other; each returns its own
`global_batch_size // process_count` rows of every global batch.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
from collections.abc import Iterator
from typing import Any

import grain
import numpy as np

from paxlite.data import records
from paxlite.data import tokenizer as tokenizer_lib

_STATE_VERSION = 2  # 2: position = (epoch, cursor, offset) of the document stream
# Evaluation reads in the calling thread: with the GIL, Grain's reader threads were slower.
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
        tfds_name: when set (e.g. "the_pile:1.0.0"), `data_dir` is a TFDS data directory and this
            dataset's text feature is read from its ArrayRecord files (no TensorFlow needed).
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
    tfds_name: str | None = None

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


def _unpacked_row(ids: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """One document -> one row of `seq_len`: truncated, right-padded with 0 (segment 0, weight 0)."""
    n = min(ids.shape[0], seq_len)
    targets = np.zeros(seq_len, dtype=np.int32)
    targets[:n] = ids[:n]
    segment_ids = np.zeros(seq_len, dtype=np.int32)
    segment_ids[:n] = 1
    positions = np.zeros(seq_len, dtype=np.int32)
    positions[:n] = np.arange(n, dtype=np.int32)
    return {"targets": targets, "segment_ids": segment_ids, "positions": positions}


class _UnpackedRow:
    """One record -> one unpacked row (a Grain map for evaluation)."""

    def __init__(self, encode: _EncodeDocument, *, seq_len: int):
        self._encode = encode
        self._seq_len = seq_len

    def __call__(self, record: bytes) -> dict[str, np.ndarray]:
        return _unpacked_row(self._encode(record), self._seq_len)


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


class _DocumentStream:
    """This process's documents, epoch after epoch, cut into rows, with a small exact position.

    Why not Grain's per-element iterators: on short documents their Python overhead per element
    (~150 us) made the pipeline slower than one GPU's appetite. Here documents are read in chunks
    and rows are cut with numpy; the position is (epoch, index in that epoch's order, tokens of that
    document already emitted), so saving and restoring it costs nothing.

    Packed rows follow concat-then-split: documents (EOS appended) are concatenated and cut every
    `seq_len` tokens; the piece of a document inside a row is one segment, numbered from 1, whose
    positions start at 0. Unpacked rows hold one document each, truncated and right-padded.
    """

    def __init__(self, *, source, indices: np.ndarray, encode: _EncodeDocument, shuffle: bool,
                 seed: int, seq_len: int, rows: int, packed: bool, chunk: int = 256):
        self._source, self._indices, self._encode = source, indices, encode
        self._shuffle, self._seed = shuffle, seed
        self._seq_len, self._rows, self._packed, self._chunk = seq_len, rows, packed, chunk
        self._set(epoch=0, cursor=0, offset=0)

    def _order(self, epoch: int) -> np.ndarray:
        if not self._shuffle:
            return self._indices
        return self._indices[np.random.default_rng([self._seed, epoch]).permutation(len(self._indices))]

    def _set(self, *, epoch: int, cursor: int, offset: int) -> None:
        self._epoch, self._cursor = epoch, cursor  # the next document to read
        self._order_cache = (epoch, self._order(epoch))
        self._docs: collections.deque[tuple[int, int, np.ndarray]] = collections.deque()
        self._buffered = 0  # tokens in _docs not yet emitted
        self._head_offset = 0  # tokens of the first buffered document already emitted
        if offset:
            self._read(1)
            self._head_offset = offset
            self._buffered -= offset

    def _read(self, count: int) -> None:
        """Appends the next `count` documents (crossing into new epochs) to the buffer."""
        wanted: list[tuple[int, int, int]] = []
        while len(wanted) < count:
            epoch, order = self._order_cache
            if epoch != self._epoch:
                self._order_cache = (self._epoch, self._order(self._epoch))
                epoch, order = self._order_cache
            take = order[self._cursor : self._cursor + count - len(wanted)]
            wanted += [(self._epoch, self._cursor + i, int(r)) for i, r in enumerate(take)]
            self._cursor += len(take)
            if self._cursor == len(order):
                self._epoch, self._cursor = self._epoch + 1, 0
        payloads = self._source.__getitems__([r for _, _, r in wanted])
        for (epoch, cursor, _), payload in zip(wanted, payloads):
            ids = self._encode(payload)
            self._docs.append((epoch, cursor, ids))
            self._buffered += len(ids)

    def get_state(self) -> dict[str, int]:
        if not self._docs:
            return {"epoch": self._epoch, "cursor": self._cursor, "offset": 0}
        epoch, cursor, _ = self._docs[0]
        return {"epoch": epoch, "cursor": cursor, "offset": self._head_offset}

    def set_state(self, state: dict[str, int]) -> None:
        self._set(epoch=int(state["epoch"]), cursor=int(state["cursor"]), offset=int(state["offset"]))

    def __next__(self) -> dict[str, np.ndarray]:
        return self._next_packed() if self._packed else self._next_unpacked()

    def _next_unpacked(self) -> dict[str, np.ndarray]:
        if len(self._docs) < self._rows:
            self._read(max(self._chunk, self._rows - len(self._docs)))
        docs = [self._docs.popleft()[2] for _ in range(self._rows)]
        self._buffered -= sum(len(ids) for ids in docs)
        rows = [_unpacked_row(ids, self._seq_len) for ids in docs]
        return _lm_features({key: np.stack([row[key] for row in rows]) for key in rows[0]})

    def _next_packed(self) -> dict[str, np.ndarray]:
        need = self._rows * self._seq_len
        while self._buffered < need:
            self._read(self._chunk)
        pieces, lengths, taken = [], [], 0
        while taken < need:
            epoch, cursor, ids = self._docs[0]
            piece = ids[self._head_offset : self._head_offset + need - taken]
            pieces.append(piece)
            lengths.append(len(piece))
            taken += len(piece)
            if self._head_offset + len(piece) == len(ids):
                self._docs.popleft()
                self._head_offset = 0
            else:
                self._head_offset += len(piece)
        self._buffered -= need
        targets = np.concatenate(pieces).reshape(self._rows, self._seq_len)
        doc = np.repeat(np.arange(len(lengths)), lengths).reshape(self._rows, self._seq_len)
        starts = np.ones(targets.shape, dtype=bool)
        starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
        columns = np.broadcast_to(np.arange(self._seq_len, dtype=np.int32), targets.shape)
        last_start = np.maximum.accumulate(np.where(starts, columns, 0), axis=1)
        return _lm_features({
            "targets": targets,
            "segment_ids": np.cumsum(starts, axis=1, dtype=np.int32),
            "positions": (columns - last_start).astype(np.int32),
        })


class TrainIterator:
    """Infinite iterator over this process's rows of each global training batch, resumable.

    `get_state()` is plain JSON (it goes into the checkpoint next to the train state) and records
    how the stream was built, so restoring it into a differently configured pipeline fails loudly
    instead of silently yielding other data.
    """

    def __init__(self, stream: _DocumentStream, *, meta: dict[str, Any]):
        self._stream = stream
        self._meta = meta

    def __iter__(self) -> TrainIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._stream)

    def get_state(self) -> dict:
        return {"version": _STATE_VERSION, **self._meta, "position": self._stream.get_state()}

    def set_state(self, state: dict) -> None:
        if (
            not isinstance(state, dict)
            or state.get("version") != _STATE_VERSION
            or "position" not in state
        ):
            raise ValueError(
                f"not a paxlite TrainIterator state (version {_STATE_VERSION} with a 'position' "
                f"entry): {str(state)[:200]}"
            )
        for key, expected in self._meta.items():
            if state.get(key) != expected:
                raise ValueError(
                    f"data iterator state was saved with {key}={state.get(key)!r} but this "
                    f"pipeline has {key}={expected!r}; resume with the same data settings"
                )
        self._stream.set_state(state["position"])


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Split:
    name: str
    source: Any  # random access: __len__, __getitem__, __getitems__ -> record bytes


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
        self._data_dir = data_dir
        self._tfds = None
        if config.tfds_name is not None:
            from paxlite.data import tfds_datasets  # tensorflow_datasets only on this path

            self._tfds = tfds_datasets.TfdsName.parse(config.tfds_name)
            tfds_datasets.check_prepared(self._tfds, data_dir)
            self.info = records.DatasetInfo(
                directory=data_dir, kind=records.Kind.TEXT.value, tokenizer=None, splits={},
                sources=(str(self._tfds),),
            )
        else:
            self.info = records.read_info(data_dir)
        # Every process needs training documents; for eval, a process past the end just pads.
        self._train = self._open_split(config.train_split, min_records=process_count)
        self._eval = (
            None
            if config.eval_split is None
            else self._open_split(config.eval_split, min_records=1)
        )
        self._encode = self._make_encoder()

    def _open_split(self, split: str, *, min_records: int) -> _Split:
        if self._tfds is not None:
            source = self._open_tfds_split(split)
        else:
            source = self._open_record_split(split)
        if len(source) < min_records:
            raise records.DatasetError(
                f"split {split!r} of {self._data_dir!r} has {len(source)} documents; it needs at "
                f"least {min_records} ({self.process_count} processes)"
            )
        return _Split(name=split, source=source)

    def _open_tfds_split(self, split: str):
        from paxlite.data import tfds_datasets

        feature = tfds_datasets.LM_TEXT_FEATURES.get(self._tfds.name)
        if feature is None:
            raise records.DatasetError(
                f"TFDS dataset {self._tfds} has no known text feature to train a language model on; "
                f"paxlite trains on {sorted(tfds_datasets.LM_TEXT_FEATURES)}"
            )
        return tfds_datasets.TextFeatureSource(
            tfds_datasets.open_split(self._tfds, self._data_dir, split), feature=feature
        )

    def _open_record_split(self, split: str) -> grain.sources.ArrayRecordDataSource:
        if split not in self.info.splits:
            raise records.DatasetError(
                f"dataset {self._data_dir!r} has no split {split!r}; it has "
                f"{sorted(self.info.splits)}"
            )
        paths = records.shard_paths(self.info, split)
        for path in paths:
            if not os.path.isfile(path):
                raise records.DatasetError(f"split {split!r} shard {path!r} does not exist")
        return grain.sources.ArrayRecordDataSource(paths)

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
        stream = _DocumentStream(
            source=self._train.source,
            # This process's records, in file order: the slice is taken before any shuffle.
            indices=np.arange(self.process_index, len(self._train.source), self.process_count),
            encode=self._encode,
            shuffle=config.shuffle,
            seed=config.seed,
            seq_len=config.seq_len,
            rows=self.local_batch_size,
            packed=config.packed,
        )
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
        return TrainIterator(stream, meta=meta)

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
