"""The chunked reader and packer against plain-Python references, on random document lengths."""

import numpy as np
import pytest
from array_record.python import array_record_module

from paxlite.data.errors import DatasetError
from paxlite.data.packing import DocumentStream, ShardedRecords, join_with_eos, token_chunk_encoder

EOS = 1


def _docs(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 100, size=int(rng.integers(1, 40)), dtype=np.int32) for _ in range(n)]


class ListSource:
    def __init__(self, docs):
        self._records = [d.astype("<i4").tobytes() for d in docs]

    def __len__(self):
        return len(self._records)

    def __getitems__(self, indices):
        return [self._records[i] for i in indices]


def test_sharded_records_read_any_indices_in_request_order(tmp_path):
    records = [f"record {i}".encode() * (i % 3 + 1) for i in range(23)]
    paths = []
    for shard, (start, stop) in enumerate([(0, 7), (7, 8), (8, 23)]):
        path = str(tmp_path / f"s{shard}.array_record")
        writer = array_record_module.ArrayRecordWriter(
            path, "group_size:1,uncompressed" if shard else "group_size:1"
        )
        for record in records[start:stop]:
            writer.write(record)
        writer.close()
        paths.append(path)
    source = ShardedRecords(paths)
    order = [22, 0, 7, 8, 6, 7, 15, 3]
    assert len(source) == 23 and source.__getitems__(order) == [records[i] for i in order]
    assert source[9] == records[9]
    with pytest.raises(IndexError, match=r"\[0, 23\)"):
        source.__getitems__([23])


def test_join_with_eos_matches_a_loop():
    docs = _docs(9)
    tokens, lengths = join_with_eos(docs, eos_id=EOS)
    expected = [t for d in docs for t in [*d.tolist(), EOS]]
    assert tokens.tolist() == expected and lengths.tolist() == [len(d) + 1 for d in docs]
    with pytest.raises(DatasetError, match="not a multiple of 4"):
        token_chunk_encoder(eos_id=EOS)([b"abc"])


def _reference_rows(docs, order, *, seq_len, rows, count):
    """Concat-then-split by hand: per token, its document and its position in that document's
    piece."""
    stream = [(t, k) for k in order for t in [*docs[k].tolist(), EOS]]
    out = []
    for b in range(count):
        window = stream[b * rows * seq_len : (b + 1) * rows * seq_len]
        targets, segments, positions = [], [], []
        for r in range(rows):
            row = window[r * seq_len : (r + 1) * seq_len]
            seg, pos, prev = 0, 0, None
            for t, k in row:
                if k != prev:
                    seg, pos, prev = seg + 1, 0, k
                targets.append(t)
                segments.append(seg)
                positions.append(pos)
                pos += 1
        out.append((targets, segments, positions))
    return out


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_packed_rows_and_resume_from_every_step(chunk):
    docs = _docs(60, seed=1)
    seq_len, rows = 16, 3
    make = lambda: DocumentStream(
        source=ListSource(docs),
        indices=np.arange(60),
        encode=token_chunk_encoder(eos_id=EOS),
        shuffle=False,
        seed=0,
        seq_len=seq_len,
        rows=rows,
        packed=True,
        chunk=chunk,
    )
    total = sum(len(d) + 1 for d in docs)
    count = total // (seq_len * rows)
    expected = _reference_rows(docs, range(60), seq_len=seq_len, rows=rows, count=count)
    stream = make()
    for step in range(count):
        state = stream.get_state()
        batch = next(stream)
        targets, segments, positions = expected[step]
        assert batch["targets"].reshape(-1).tolist() == targets, step
        assert batch["segment_ids"].reshape(-1).tolist() == segments, step
        assert batch["positions"].reshape(-1).tolist() == positions, step
        resumed = make()
        resumed.set_state(state)
        np.testing.assert_array_equal(next(resumed)["targets"], batch["targets"])


def test_unpacked_rows_truncate_and_pad():
    docs = _docs(10, seed=2)
    stream = DocumentStream(
        source=ListSource(docs),
        indices=np.arange(10),
        encode=token_chunk_encoder(eos_id=EOS),
        shuffle=False,
        seed=0,
        seq_len=20,
        rows=4,
        packed=False,
        chunk=3,
    )
    batch = next(stream)
    for r in range(4):
        ids = [*docs[r].tolist(), EOS][:20]
        assert batch["targets"][r, : len(ids)].tolist() == ids
        assert batch["weights"][r].sum() == len(ids) and not batch["targets"][r, len(ids):].any()
    assert stream.get_state() == {"epoch": 0, "cursor": 4, "offset": 0}


def test_the_stream_reads_only_a_chunk_ahead():
    """Reading ahead is bounded: one chunk past what the rows need (a wasteful read is invisible in
    the rows)."""
    docs = _docs(400, seed=3)
    source = ListSource(docs)
    fetched = []
    original = source.__getitems__
    source.__getitems__ = lambda indices: (fetched.append(len(indices)), original(indices))[1]
    stream = DocumentStream(
        source=source,
        indices=np.arange(400),
        encode=token_chunk_encoder(eos_id=EOS),
        shuffle=True,
        seed=0,
        seq_len=16,
        rows=2,
        packed=True,
        chunk=10,
    )
    next(stream)
    # upper bound, any order
    needed = int(np.searchsorted(np.cumsum([len(d) + 1 for d in docs]), 32)) + 1
    assert fetched and all(n == 10 for n in fetched) and sum(fetched) < needed + 40
