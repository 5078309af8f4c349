"""Synthetic batches are a function of (seed, step) only: the same numbers on 1 device or 8, any
mesh."""

import os

import jax
import numpy as np
import pytest

from paxlite.data.synthetic import SyntheticData, SyntheticDataConfig
from paxlite.parallel import rules
from paxlite.parallel.mesh import MeshConfig, build_mesh

CONFIG = SyntheticDataConfig(vocab_size=97, seq_len=16, seed=3)


def _global(batch):
    return {k: np.asarray(jax.device_get(v)) for k, v in batch.items()}


def test_same_global_batch_on_every_mesh():
    data = SyntheticData(CONFIG, global_batch_size=8)
    one = build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1)), devices=jax.devices()[:1])
    reference = _global(data.train_batch(5, rules.batch_sharding(one)))
    for shape in [(8, 1, 1), (2, 2, 2), (1, 8, 1), (1, 1, 8), (2, 1, 4)]:
        mesh = build_mesh(MeshConfig(ici_mesh_shape=shape))
        batch = data.train_batch(5, rules.batch_sharding(mesh))
        got = _global(batch)
        for key in reference:
            np.testing.assert_array_equal(got[key], reference[key])
        # rows really are split over data x fsdp
        assert batch["inputs"].addressable_shards[0].data.shape[0] == 8 // (shape[0] * shape[1])


def test_rows_follow_the_permutation_and_differ_by_step():
    data = SyntheticData(CONFIG, global_batch_size=4)
    rows = data.rows(0, 0, slice(0, 4))
    perm = np.random.default_rng([3, 7]).permutation(97)
    np.testing.assert_array_equal(rows["targets"], perm[rows["inputs"]])
    np.testing.assert_array_equal(rows["inputs"][:, 1:], rows["targets"][:, :-1])
    assert rows["inputs"].dtype == np.int32 and rows["weights"].dtype == np.float32
    assert np.all(rows["weights"] == 1.0)
    other_step = data.rows(0, 1, slice(0, 4))
    assert not np.array_equal(rows["inputs"], other_step["inputs"])
    eval_rows = data.rows(1, 0, slice(0, 4))
    assert not np.array_equal(rows["inputs"], eval_rows["inputs"])
    # A slice of rows is the same as those rows of the whole batch (what each process computes).
    np.testing.assert_array_equal(data.rows(0, 0, slice(2, 4))["inputs"], rows["inputs"][2:4])


def test_seed_changes_the_data():
    a = SyntheticData(CONFIG, global_batch_size=4).rows(0, 0, slice(0, 4))
    b = SyntheticData(
        SyntheticDataConfig(vocab_size=97, seq_len=16, seed=4), global_batch_size=4
    ).rows(0, 0, slice(0, 4))
    assert not np.array_equal(a["inputs"], b["inputs"])


def test_bad_config():
    with pytest.raises(ValueError, match="vocab_size=1"):
        SyntheticDataConfig(vocab_size=1, seq_len=4)


GOLDEN = os.path.join(os.path.dirname(__file__), "..", "testdata", "synthetic_golden.npz")


def _stepwise_rows(data, stream, index, rows):
    """The original implementation: one permutation lookup per position."""
    starts = data._starts(stream, index)[rows]
    seq = np.empty((starts.shape[0], data.config.seq_len + 1), dtype=np.int32)
    seq[:, 0] = starts
    for t in range(1, data.config.seq_len + 1):
        seq[:, t] = data._perm[seq[:, t - 1]]
    return seq


def test_vectorised_rows_equal_the_stepwise_walk_and_the_recorded_golden():
    """Recorded with the per-position loop before it was replaced (seeds, vocabularies down to 2,
    a GPT-2 size vocabulary, both streams, several batches)."""
    golden = np.load(GOLDEN)
    assert len(golden.files) == 24
    for name in golden.files:
        seed, vocab, seq, stream, index = (int(part[1:].lstrip("t")) for part in name.split("_"))
        data = SyntheticData(SyntheticDataConfig(vocab_size=vocab, seq_len=seq, seed=seed),
                             global_batch_size=8)
        rows = data.rows(stream, index, slice(0, 8))
        got = np.concatenate([rows["inputs"], rows["targets"][:, -1:]], axis=1)
        np.testing.assert_array_equal(got, golden[name], err_msg=name)
        np.testing.assert_array_equal(got, _stepwise_rows(data, stream, index, slice(0, 8)))
        assert rows["inputs"].dtype == np.int32 and rows["targets"].dtype == np.int32
