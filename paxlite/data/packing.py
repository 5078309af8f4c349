"""Reading records fast and cutting them into rows: the hot path of the training input.

Why a module of its own: on short documents (tens of tokens) the per-document cost decides whether
one CPU core keeps a GPU fed. Everything here works on whole chunks of documents at once: records
are read per shard in one call, token ids are joined with one `bytes.join`, EOS is inserted and rows
are cut with vectorised NumPy, so the Python work per document is a handful of list operations.

Rows follow SeqIO's LM feature converter, which is what Pax's `the_pile_lm` task fed (see
pipeline.py): EOS after every document; packed rows concatenate documents and cut every `seq_len`
tokens, a document cut at a row boundary continuing in the next row as a new segment; `inputs` are
the targets shifted right within each segment, with 0 at every segment start.
"""

from __future__ import annotations

import enum
import errno
import itertools
from collections.abc import Callable, Sequence

import numpy as np
from array_record.python import array_record_module

from paxlite.data.errors import DatasetError


class DocumentStart(str, enum.Enum):
    """What each document's first input is (the token its first token is predicted from)."""

    ZERO = "zero"  # id 0, as SeqIO's LM feature converter and Pax feed it
    BOS = "bos"  # the tokenizer's BOS, as Hugging Face models train and are prompted


def lm_features(rows: dict[str, np.ndarray], *, start_id: int = 0) -> dict[str, np.ndarray]:
    """[B, L] targets/segment_ids/positions -> the full batch; vectorised, no per-token Python.

    Each segment's first input is `start_id`, from which its first token is predicted: 0 as
    SeqIO and Pax feed it, or the tokenizer's BOS, as a Hugging Face model is trained
    (`DocumentStart`)."""
    targets = rows["targets"].astype(np.int32, copy=False)
    positions = rows["positions"].astype(np.int32, copy=False)
    segment_ids = rows["segment_ids"].astype(np.int32, copy=False)
    inputs = np.zeros_like(targets)
    inputs[:, 1:] = targets[:, :-1]
    # Every segment (and all padding) starts at position 0: nothing is predicted across documents.
    inputs[positions == 0] = start_id
    return {
        "inputs": inputs,
        "targets": targets,
        "weights": (segment_ids > 0).astype(np.float32),
        "positions": positions,
        "segment_ids": segment_ids,
    }


def unpacked_row(ids: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """One document -> one row of `seq_len`: truncated, right-padded with 0 (segment 0, weight
    0)."""
    n = min(ids.shape[0], seq_len)
    targets = np.zeros(seq_len, dtype=np.int32)
    targets[:n] = ids[:n]
    segment_ids = np.zeros(seq_len, dtype=np.int32)
    segment_ids[:n] = 1
    positions = np.zeros(seq_len, dtype=np.int32)
    positions[:n] = np.arange(n, dtype=np.int32)
    return {"targets": targets, "segment_ids": segment_ids, "positions": positions}


def join_with_eos(docs: Sequence[np.ndarray] | None, *, flat: np.ndarray | None = None,
                  lengths: np.ndarray | None = None, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(all tokens with EOS after each document, each document's length including its EOS).

    Either `docs` (a list of id arrays) or their concatenation `flat` with `lengths`.
    """
    if flat is None:
        lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        flat = (
            np.concatenate(docs).astype(np.int32, copy=False)
            if len(docs)
            else np.zeros(0, np.int32)
        )
    ends = np.cumsum(lengths + 1)
    out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.int32)
    keep = np.ones(out.shape, dtype=bool)
    keep[ends - 1] = False
    out[keep] = flat
    out[ends - 1] = eos_id
    return out, lengths + 1


def _why_unreadable(path: str) -> str:
    """The OS's words for why `path` cannot be opened, or ArrayRecord's finding that it can be
    opened but not read as records."""
    try:
        with open(path, "rb"):
            return "ArrayRecord cannot read it as records"
    except OSError as error:
        return f"{error.strerror} ({errno.errorcode.get(error.errno, error.errno)})"


class ShardedRecords:
    """Random access over ArrayRecord shards, read one shard at a time per request.

    Grain's ArrayRecordDataSource spreads every request over a thread pool; on one core, for records
    of ~150 bytes, that cost ~5x more than the read itself, so the shards are read directly.
    """

    def __init__(self, paths: Sequence[str]):
        self._readers = [
            array_record_module.ArrayRecordReader(p, "readahead_buffer_size:0") for p in paths
        ]
        for path, reader in zip(paths, self._readers, strict=True):
            if not reader.ok():  # ArrayRecord raises nothing: it reports no records
                raise DatasetError(f"shard {path} cannot be read ({_why_unreadable(path)}); make "
                                   "it readable for this user again (or remount its filesystem) "
                                   "and run the same command again")
        counts = [reader.num_records() for reader in self._readers]
        self._offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getitem__(self, index: int) -> bytes:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[bytes]:
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"record indices must be in [0, {len(self)}), got "
                             f"{indices.min()}..{indices.max()}")
        shards = np.searchsorted(self._offsets[1:], indices, side="right")
        out: list[bytes] = [b""] * len(indices)
        for shard in np.unique(shards):
            where = np.flatnonzero(shards == shard)
            records = self._readers[shard].read((indices[where] - self._offsets[shard]).tolist())
            for position, record in zip(where.tolist(), records):
                out[position] = record
        return out


_CHUNK_TOKENS = 1 << 18  # ~1 MiB of int32 ids per read
_MIN_CHUNK, _MAX_CHUNK = 16, 8192

# (payloads) -> (tokens with EOS after each document, lengths including EOS)
ChunkEncoder = Callable[[list[bytes]], tuple[np.ndarray, np.ndarray]]


class DocumentStream:
    """This process's documents, epoch after epoch, cut into rows, with a small exact position.

    The position is (epoch, index in that epoch's order, tokens of that document already emitted),
    so saving and restoring it costs nothing. Buffered documents live in one flat token array with
    their start offsets and (epoch, cursor) keys.
    """

    def __init__(self, *, source, indices: np.ndarray, encode: ChunkEncoder, shuffle: bool,
                 seed: int, seq_len: int, rows: int, packed: bool, chunk: int | None = None,
                 start_id: int = 0):
        self._source, self._indices, self._encode = source, indices, encode
        self.start_id = start_id  # each segment's first input (lm_features)
        self._shuffle, self._seed = shuffle, seed
        self._seq_len, self._rows, self._packed, self._fixed_chunk = seq_len, rows, packed, chunk
        self._read_docs, self._read_tokens = 0, 0
        self._set(epoch=0, cursor=0, offset=0)

    def _order(self, epoch: int) -> np.ndarray:
        if not self._shuffle:
            return self._indices
        return self._indices[
            np.random.default_rng([self._seed, epoch]).permutation(len(self._indices))
        ]

    def _set(self, *, epoch: int, cursor: int, offset: int) -> None:
        self._epoch, self._cursor = epoch, cursor  # the next document to read
        self._order_cache = (epoch, self._order(epoch))
        self._tokens = np.zeros(0, dtype=np.int32)
        # each buffered document's first token in _tokens
        self._starts = np.zeros(0, dtype=np.int64)
        self._keys = np.zeros((0, 2), dtype=np.int64)  # each buffered document's (epoch, cursor)
        self._pos = 0  # tokens of _tokens already emitted
        if offset:
            self._read(1)
            self._pos = offset

    def _read(self, count: int) -> None:
        """Appends the next `count` documents (crossing into new epochs); drops emitted ones."""
        keys, records, wanted = [], [], 0
        while wanted < count:
            epoch, order = self._order_cache
            if epoch != self._epoch:
                self._order_cache = (self._epoch, self._order(self._epoch))
                epoch, order = self._order_cache
            take = order[self._cursor : self._cursor + count - wanted]
            keys.append(
                np.stack(
                    [np.full(len(take), self._epoch), self._cursor + np.arange(len(take))], axis=1
                )
            )
            records.append(take)
            wanted += len(take)
            self._cursor += len(take)
            if self._cursor == len(order):
                self._epoch, self._cursor = self._epoch + 1, 0
        tokens, lengths = self._encode(self._source.__getitems__(np.concatenate(records).tolist()))
        self._read_docs += len(lengths)
        self._read_tokens += len(tokens)
        first = self._first_unfinished()
        base = self._starts[first] if first < len(self._starts) else self._pos
        self._tokens = np.concatenate([self._tokens[base:], tokens])
        self._pos -= base
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) + (len(self._tokens) - len(tokens))
        self._starts = np.concatenate([self._starts[first:] - base, starts])
        self._keys = np.concatenate([self._keys[first:], *keys])

    @property
    def _chunk(self) -> int:
        """Documents per read: fixed if given, else about _CHUNK_TOKENS tokens at the mean length so
        far.

        Large reads amortise the per-request cost of ArrayRecord (per shard) and NumPy; the token
        target keeps memory bounded when documents are long.
        """
        if self._fixed_chunk is not None:
            return self._fixed_chunk
        mean = self._read_tokens / self._read_docs if self._read_docs else 256.0
        return int(np.clip(_CHUNK_TOKENS / mean, _MIN_CHUNK, _MAX_CHUNK))

    def _first_unfinished(self) -> int:
        """Index of the first buffered document with tokens not yet emitted (len(_starts) if
        none)."""
        return int(np.searchsorted(self._starts, self._pos, side="right")) - 1 if self._pos < len(
            self._tokens) else len(self._starts)

    def get_state(self) -> dict[str, int]:
        first = self._first_unfinished()
        if first == len(self._starts):
            return {"epoch": self._epoch, "cursor": self._cursor, "offset": 0}
        epoch, cursor = self._keys[first]
        return {
            "epoch": int(epoch),
            "cursor": int(cursor),
            "offset": int(self._pos - self._starts[first]),
        }

    def set_state(self, state: dict[str, int]) -> None:
        self._set(
            epoch=int(state["epoch"]), cursor=int(state["cursor"]), offset=int(state["offset"])
        )

    def __next__(self) -> dict[str, np.ndarray]:
        return self.take(self._rows)

    def take(self, rows: int, *, features: bool = True) -> dict[str, np.ndarray]:
        """The next `rows` rows ([rows, seq_len] each; 0 gives empty arrays and moves nothing).

        A mixture draws a different number of rows from each source every batch; rows are cut from
        the same token stream whatever the count per call, so any split of N rows into calls yields
        the N rows one call would, and the position stays the same three numbers. features=False:
        only targets/segment_ids/positions, for a caller that joins rows before `lm_features`
        (which works row by row, so joining first changes nothing).
        """
        if rows < 0:
            raise ValueError(f"rows must be >= 0, got {rows}")
        if rows == 0:
            empty = np.zeros((0, self._seq_len), dtype=np.int32)
            cut = {"targets": empty, "segment_ids": empty, "positions": empty}
        else:
            cut = self._next_packed(rows) if self._packed else self._next_unpacked(rows)
        return lm_features(cut, start_id=self.start_id) if features else cut

    def _next_unpacked(self, count: int) -> dict[str, np.ndarray]:
        while len(self._starts) - self._first_unfinished() < count:
            self._read(self._chunk)
        first = self._first_unfinished()
        ends = np.append(self._starts[1:], len(self._tokens))
        rows = [unpacked_row(self._tokens[self._starts[k] : ends[k]], self._seq_len)
                for k in range(first, first + count)]
        self._pos = int(ends[first + count - 1])
        return {key: np.stack([row[key] for row in rows]) for key in rows[0]}

    def _next_packed(self, count: int) -> dict[str, np.ndarray]:
        need = count * self._seq_len
        while len(self._tokens) - self._pos < need:
            self._read(self._chunk)
        start, stop = self._pos, self._pos + need
        targets = self._tokens[start:stop].reshape(count, self._seq_len)
        inside = self._starts[np.searchsorted(self._starts, start, side="right"):]
        inside = inside[inside < stop] - start
        starts = np.zeros(need, dtype=bool)
        starts[inside] = True
        starts = starts.reshape(count, self._seq_len)
        starts[:, 0] = True  # a row starts a segment, even mid-document
        columns = np.broadcast_to(np.arange(self._seq_len, dtype=np.int32), targets.shape)
        last_start = np.maximum.accumulate(np.where(starts, columns, 0), axis=1)
        self._pos = stop
        return {
            "targets": targets,
            "segment_ids": np.cumsum(starts, axis=1, dtype=np.int32),
            "positions": (columns - last_start).astype(np.int32),
        }


def token_chunk_encoder(*, eos_id: int) -> ChunkEncoder:
    """Pre-tokenized records (little-endian int32 ids): one join and one copy per chunk."""

    def encode(payloads: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        for payload in payloads:
            if len(payload) % 4:
                from paxlite.data.errors import DatasetError

                raise DatasetError(f"token record has {len(payload)} bytes, not a multiple of 4 "
                                   "(int32 ids)")
        lengths = np.fromiter(map(len, payloads), dtype=np.int64, count=len(payloads)) // 4
        flat = np.frombuffer(b"".join(payloads), dtype="<i4").astype(np.int32)
        return join_with_eos(None, flat=flat, lengths=lengths, eos_id=eos_id)

    return encode


def text_chunk_encoder(tokenizer, *, eos_id: int) -> ChunkEncoder:
    """Raw UTF-8 text records, tokenised as one SentencePiece batch per chunk."""

    def encode(payloads: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        from paxlite.data.errors import DatasetError

        try:
            texts = [p.decode("utf-8") for p in payloads]
        except UnicodeDecodeError as e:
            raise DatasetError(f"text record is not valid UTF-8: {e}") from e
        ids = tokenizer.encode_batch(texts)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(
            itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum())
        )
        return join_with_eos(None, flat=flat, lengths=lengths, eos_id=eos_id)

    return encode

