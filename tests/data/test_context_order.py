"""dual_chunk_swap order (data/context_order.py): the permutation, its inverse, equal causal work per
shard, and a batch reordered field by field so every token keeps its true position."""

import jax.numpy as jnp
import numpy as np
import pytest

from paxlite.data.context_order import dual_chunk_swap_order, inverse_order, reorder_batch


def test_order_gives_shard_i_chunks_i_and_mirror() -> None:
    # 8 tokens, 2 shards: chunks [0 1] [2 3] [4 5] [6 7]; shard 0 gets chunks 0 and 3, shard 1 1 and 2.
    np.testing.assert_array_equal(dual_chunk_swap_order(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
    # 16 tokens, 4 shards: chunks of 2; shard i holds chunks i and 7 - i.
    np.testing.assert_array_equal(
        dual_chunk_swap_order(16, 4),
        [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9])
    np.testing.assert_array_equal(dual_chunk_swap_order(6, 1), np.arange(6))


@pytest.mark.parametrize("seq_len,shards", [(8, 2), (16, 4), (48, 8), (4096, 8)])
def test_inverse_undoes_the_order(seq_len, shards) -> None:
    order = dual_chunk_swap_order(seq_len, shards)
    row = np.random.default_rng(seq_len).integers(0, 1000, size=(3, seq_len))
    np.testing.assert_array_equal(row[:, order][:, inverse_order(order)], row)
    np.testing.assert_array_equal(order[inverse_order(order)], np.arange(seq_len))


def _causal_pairs_per_shard(order: np.ndarray, shards: int) -> np.ndarray:
    """Unmasked (query, key) pairs each shard's queries have: key position <= query position."""
    per_shard = order.reshape(shards, -1)  # the true positions of each shard's slots
    return np.array([sum(int(p) + 1 for p in positions) for positions in per_shard])


@pytest.mark.parametrize("seq_len,shards", [(8, 2), (16, 4), (64, 8), (4096, 8)])
def test_each_shard_gets_equal_causal_work(seq_len, shards) -> None:
    balanced = _causal_pairs_per_shard(dual_chunk_swap_order(seq_len, shards), shards)
    assert (balanced == balanced[0]).all(), balanced
    assert balanced.sum() == seq_len * (seq_len + 1) // 2  # every causal pair, once
    contiguous = _causal_pairs_per_shard(np.arange(seq_len), shards)
    assert contiguous[-1] > contiguous[0]  # what the reorder fixes


@pytest.mark.parametrize("seq_len,shards", [(10, 4), (12, 4), (7, 1)])
def test_refuses_a_length_that_2c_does_not_divide(seq_len, shards) -> None:
    with pytest.raises(ValueError, match=f"seq_len={seq_len} is not divisible by 2 \\* num_shards "
                                         f"= {2 * shards}"):
        dual_chunk_swap_order(seq_len, shards)


def test_refuses_a_bad_shard_count() -> None:
    with pytest.raises(ValueError, match="num_shards=0: expected a positive integer"):
        dual_chunk_swap_order(8, 0)


def test_reorder_batch_moves_every_per_token_field_together() -> None:
    order = dual_chunk_swap_order(8, 2)
    segment_ids = np.array([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1, 1]], np.int32)
    positions = np.array([[0, 1, 2, 0, 1, 2, 3, 0], np.arange(8)], np.int32)
    targets = np.arange(16, dtype=np.int32).reshape(2, 8) + 100
    batch = {
        "inputs": targets - 100, "targets": targets, "weights": (segment_ids > 0).astype(np.float32),
        "positions": positions, "segment_ids": segment_ids, "row_id": np.array([7, 9]),
    }
    got = reorder_batch(batch, order)
    assert set(got) == set(batch)
    for name in ("inputs", "targets", "weights", "positions", "segment_ids"):
        for slot, true_index in enumerate(order):  # slot t holds the token from order[t]
            np.testing.assert_array_equal(got[name][:, slot], batch[name][:, true_index], name)
    # Unpacked row: its positions are now the true positions of each slot's token.
    np.testing.assert_array_equal(got["positions"][1], order)
    np.testing.assert_array_equal(got["row_id"], [7, 9])  # one value per row: unchanged
    on_device = reorder_batch({"positions": jnp.asarray(positions)}, order)["positions"]
    np.testing.assert_array_equal(np.asarray(on_device), got["positions"])  # JAX arrays too
    back = reorder_batch(got, inverse_order(order))
    for name, value in batch.items():
        np.testing.assert_array_equal(back[name], value)


def test_reorder_batch_refuses_a_field_of_another_length() -> None:
    with pytest.raises(ValueError, match=r"batch field 'targets' has shape \(2, 6\): expected "
                                         r"\[batch, 8, \.\.\.\]"):
        reorder_batch({"targets": np.zeros((2, 6))}, dual_chunk_swap_order(8, 2))
