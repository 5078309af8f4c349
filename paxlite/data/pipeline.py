"""The input pipeline: ArrayRecord shards -> tokens -> packed or padded rows -> batches.

The features follow SeqIO's LM feature converter, which is what Pax's `the_pile_lm` task fed: every
document gets EOS appended; packed rows concatenate documents and split them at `seq_len` (a
document that does not fit continues in the next row as a new segment, so nothing is dropped and no
row is padded); `inputs` are the targets shifted right *within each segment* with 0 at every
segment start, so no token is ever predicted from the previous document. Concat-then-split was
chosen over first-fit packing because it wastes no tokens on padding (first-fit left ~8% padding
with 32 bins on 10..1500-token documents), keeps documents longer than `seq_len` without a separate
chunking step, and was ~20% faster. Training rows are cut by `packing.DocumentStream` (chunked
reads, numpy packing, a three-number position); evaluation, which reads each document once, goes
through Grain.

Each process reads only its slice `[process_index::process_count]` of the records, before shuffling,
so processes never see the same document and need not talk to each other; each returns its own
`global_batch_size // process_count` rows of every global batch.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from paxlite.data import records
from paxlite.data import tokenizer as tokenizer_lib
from paxlite.data.feeding import ProcessShare, check_vocab_and_seed
from paxlite.data.packing import (
    DocumentStart,
    DocumentStream,
    ShardedRecords,
    lm_features,
    text_chunk_encoder,
    token_chunk_encoder,
    unpacked_row,
)

DEFAULT_EVAL_SPLIT = "validation"  # what python -m paxlite.data.prepare writes
_STATE_VERSION = 2  # 2: position = (epoch, cursor, offset) of the document stream
if TYPE_CHECKING:
    import grain

# Grain (and the Orbax it imports, ~0.25 s) is imported where a dataset is read, not with this
# module: the experiments import the config classes here for every command, `show` and synthetic
# runs included.


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextDataConfig:
    """Where the prepared dataset lives and how to turn it into rows.

    Attributes:
        data_dir: a directory written by `paxlite.data.prepare` (manifest + ArrayRecord shards).
        vocab_path: the tokenizer (any path `tokenizer.Tokenizer` opens); required for "text"
            datasets, optional for "tokens" ones (then checked against the manifest's sha256).
        vocab_size: the model's embedding size; the tokenizer must not emit ids beyond it.
        seq_len: tokens per row.
        packed: concatenate documents into full rows (Pax PACKED_INPUT), or one padded document
            per row.
        shuffle: shuffle documents, reshuffled every epoch from `seed`.
        seed: the shuffle seed (0 <= seed < 2**32).
        train_split, eval_split: split names in the manifest; `eval_split=None` means no eval data.
        tfds_name: when set (e.g. "the_pile:1.0.0"), `data_dir` is a TFDS data directory and this
            dataset's text feature is read from its ArrayRecord files (no TensorFlow needed).
        document_start: each document's (and each row's) first input, from which its first token
            is predicted: 0 (SeqIO's and Pax's), or the tokenizer's BOS (DocumentStart).
    """

    data_dir: str
    vocab_path: str | None
    vocab_size: int
    seq_len: int
    packed: bool = True
    shuffle: bool = True
    seed: int = 0
    train_split: str = "train"
    eval_split: str | None = DEFAULT_EVAL_SPLIT
    tfds_name: str | None = None
    document_start: DocumentStart = DocumentStart.ZERO

    def __post_init__(self):
        object.__setattr__(self, "document_start", DocumentStart(self.document_start))
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        check_vocab_and_seed(vocab_size=self.vocab_size, seed=self.seed)


class _EncodeDocument:
    """One record's bytes -> int32 token ids with EOS appended (the SeqIO LM convention);
    `start_id` is what each document's first input is (lm_features)."""

    def __init__(self, *, kind: str, tokenizer: tokenizer_lib.Tokenizer | None, eos_id: int,
                 start_id: int = 0):
        self._kind = kind
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.start_id = start_id
        self._eos = np.asarray([eos_id], dtype=np.int32)

    def __call__(self, record: bytes) -> np.ndarray:
        doc = records.decode_record(self._kind, record)
        if isinstance(doc, str):
            assert self.tokenizer is not None  # guaranteed by TextData's validation
            ids = np.asarray(self.tokenizer.encode(doc), dtype=np.int32)
        else:
            ids = np.asarray(doc, dtype=np.int32)
        return np.concatenate([ids, self._eos])


class _UnpackedRow:
    """One record -> one unpacked row (a Grain map for evaluation)."""

    def __init__(self, encode: _EncodeDocument, *, seq_len: int):
        self._encode = encode
        self._seq_len = seq_len

    def __call__(self, record: bytes) -> dict[str, np.ndarray]:
        return unpacked_row(self._encode(record), self._seq_len)


class TrainIterator:
    """Infinite iterator over this process's rows of each global training batch, resumable.

    `get_state()` is plain JSON (it goes into the checkpoint next to the train state) and records
    how the stream was built, so restoring it into a differently configured pipeline fails loudly
    instead of silently yielding other data.
    """

    def __init__(self, stream: DocumentStream, *, meta: dict[str, Any]):
        self._stream = stream
        self._meta = meta

    def __iter__(self) -> TrainIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._stream)

    def get_state(self) -> dict:
        return {"version": _STATE_VERSION, **self._meta, "position": self._stream.get_state()}

    def set_state(self, state: dict) -> None:
        if isinstance(state, dict) and "names" in state and "streams" in state:
            raise records.DatasetError(
                f"the checkpoint's data position was saved by a DATA_MIXTURE run of sources "
                f"{state['names']}; this run reads one source: resume with the same DATA_MIXTURE"
            )
        if (
            not isinstance(state, dict)
            or state.get("version") != _STATE_VERSION
            or "position" not in state
        ):
            raise records.DatasetError(
                f"not a paxlite TrainIterator state (version {_STATE_VERSION} with a 'position' "
                f"entry): {str(state)[:200]}"
            )
        for key, expected in self._meta.items():
            if state.get(key) != expected:
                raise records.DatasetError(
                    f"data iterator state was saved with {key}={state.get(key)!r} but this "
                    f"pipeline has {key}={expected!r}; resume with the same data settings"
                )
        self._stream.set_state(state["position"])


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Split:
    name: str
    source: Any  # random access: __len__, __getitem__, __getitems__ -> record bytes


class TextData(ProcessShare):
    """Host-side batches for one process.

    Everything that can be checked cheaply is checked here, before any training starts: the
    directory, the manifest, the splits, the tokenizer and its fit to `vocab_size`, and the batch
    split over processes.
    """

    config: TextDataConfig

    def _open(self) -> None:
        config = self.config
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
        self._train = self._open_split(config.train_split, min_records=self.process_count)
        self._eval = (
            None
            if config.eval_split is None or self._lacks_default_eval_split(config.eval_split)
            else self._open_split(config.eval_split, min_records=1)
        )
        self._encode = self._make_encoder()

    def _lacks_default_eval_split(self, split: str) -> bool:
        """A prepared dataset written without its validation split (prepare --validation_fraction 0,
        or a one-document corpus) trains without evaluation; the loop says so in its log. Any other
        missing split is an error when it is opened."""
        if self._tfds is not None or split != DEFAULT_EVAL_SPLIT:
            return False
        found = self.info.splits.get(split)
        return found is None or found.documents == 0

    @property
    def has_eval_data(self) -> bool:
        return self._eval is not None

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
                f"TFDS dataset {self._tfds} has no known text feature to train a language model "
                f"on; paxlite trains on {sorted(tfds_datasets.LM_TEXT_FEATURES)}"
            )
        return tfds_datasets.TextFeatureSource(
            tfds_datasets.open_split(self._tfds, self._data_dir, split), feature=feature
        )

    def _open_record_split(self, split: str) -> ShardedRecords:
        if split not in self.info.splits:
            raise records.DatasetError(
                f"dataset {self._data_dir!r} has no split {split!r}; it has "
                f"{sorted(self.info.splits)}"
            )
        paths = records.shard_paths(self.info, split)
        for path in paths:
            if not os.path.isfile(path):
                raise records.DatasetError(f"split {split!r} shard {path!r} does not exist")
        opened = ShardedRecords(paths)
        expected = self.info.splits[split].documents
        if len(opened) != expected:  # every shard read as the manifest says, or none
            raise records.DatasetError(
                f"split {split!r} of {self._data_dir} holds {len(opened):,} records and its "
                f"manifest says {expected:,}: a shard was changed after `prepare` wrote it; "
                "prepare the dataset again")
        return opened

    def _make_encoder(self) -> _EncodeDocument:
        config, info = self.config, self.info
        manifest_tok = info.tokenizer
        tok = None
        if config.vocab_path is not None:
            vocab_path = os.path.abspath(os.path.expanduser(config.vocab_path))
            if not os.path.exists(vocab_path):
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
            tokenizer_lib.bind_model_vocab(tok, vocab_size=config.vocab_size)
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
            kind=info.kind, tokenizer=tok if info.kind == "text" else None, eos_id=eos_id,
            start_id=self._start_id(tok),
        )

    def _start_id(self, tok: tokenizer_lib.Tokenizer | None) -> int:
        """Each document's first input: 0, or (DocumentStart.BOS) the tokenizer's BOS where it
        defines one; a tokenizer without BOS (Qwen's) starts with 0, as evaluation and `generate`
        add no BOS for it."""
        if self.config.document_start is DocumentStart.ZERO:
            return 0
        if tok is None:
            raise tokenizer_lib.VocabError(
                f"document_start='bos' starts every document of {self._data_dir!r} with the "
                "tokenizer's BOS, and no tokenizer is given: set vocab_path (VOCAB_PATH) to the "
                "tokenizer that tokenised it")
        return 0 if tok.bos_id is None or tok.bos_id < 0 else int(tok.bos_id)

    def _documents(self, split: _Split) -> grain.MapDataset:
        """This process's records, in file order: the slice is taken before any shuffle."""
        import grain

        return grain.MapDataset.source(split.source)[self.process_index :: self.process_count]

    def train_iterator(self) -> TrainIterator:
        """Infinite stream of this process's training rows, reshuffled every epoch from the seed."""
        config = self.config
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
        return TrainIterator(self.document_stream(), meta=meta)

    @property
    def eos_id(self) -> int:
        return self._encode.eos_id

    def document_stream(self) -> DocumentStream:
        """This process's training documents cut into rows (`local_batch_size` per `next`, any
        number per `take`): what `train_iterator` wraps, and what a mixture draws each source
        from."""
        config = self.config
        encode = self._encode
        chunk_encoder = (
            text_chunk_encoder(encode.tokenizer, eos_id=encode.eos_id)
            if encode.tokenizer is not None
            else token_chunk_encoder(eos_id=encode.eos_id)
        )
        return DocumentStream(
            source=self._train.source,
            # This process's records, in file order: the slice is taken before any shuffle.
            indices=np.arange(self.process_index, len(self._train.source), self.process_count),
            encode=chunk_encoder,
            shuffle=config.shuffle,
            seed=config.seed,
            seq_len=config.seq_len,
            rows=self.local_batch_size,
            packed=config.packed,
            start_id=encode.start_id,
        )

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
        import grain

        # evaluation reads in the calling thread: with the GIL, Grain's reader threads were slower
        read_options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        return self._padded_batches(iter(rows.to_iter_dataset(read_options)), count=count)

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
            yield lm_features(batch, start_id=self._encode.start_id)
