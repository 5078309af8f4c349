"""dual_chunk_swap order (data/context_order.py): the permutation, its inverse, equal causal work
per shard, a batch reordered field by field so every token keeps its true position (positions added
where a batch has none), the divisibility check, and the reorder applied to every training batch
where the loop takes it from its feed (data/feed.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from paxlite.data.context_order import (
    balance_for_seq,
    check_seq_divides,
    dual_chunk_swap_order,
    inverse_order,
    reorder_batch,
)
from paxlite.data.feed import SyntheticFeed, prefetch_train_batches
from paxlite.data.synthetic import SyntheticDataConfig
from paxlite.errors import SettingError
from paxlite.parallel.rules import batch_sharding


def test_order_gives_shard_i_chunks_i_and_mirror() -> None:
    # 8 tokens, 2 shards: chunks [0 1] [2 3] [4 5] [6 7]; shard 0 gets chunks 0 and 3, shard 1 1
    # and 2.
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
        "inputs": targets - 100,
        "targets": targets,
        "weights": (segment_ids > 0).astype(np.float32),
        "positions": positions,
        "segment_ids": segment_ids,
        "row_id": np.array([7, 9]),
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


def _unpacked_batch(rows: int = 2, length: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 50, size=(rows, length + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "weights": (rng.random((rows, length)) < 0.7).astype(np.float32)}


def test_balance_for_seq_adds_true_positions_and_moves_every_field() -> None:
    batch = _unpacked_batch()
    got = balance_for_seq(batch, seq_shards=2)
    order = dual_chunk_swap_order(8, 2)
    assert set(got) == {"inputs", "targets", "weights", "positions"}
    assert got["positions"].dtype == np.int32
    np.testing.assert_array_equal(got["positions"], np.broadcast_to(order, (2, 8)))
    for name in ("inputs", "targets", "weights"):
        np.testing.assert_array_equal(got[name], batch[name][:, order])
    # Each slot's (position, input, target, weight) is the original token at that position.
    for b in range(2):
        for slot in range(8):
            p = got["positions"][b, slot]
            assert (got["inputs"][b, slot], got["targets"][b, slot], got["weights"][b, slot]) == (
                batch["inputs"][b, p], batch["targets"][b, p], batch["weights"][b, p])
    # A weighted sum over tokens (what a loss is) is the same sum.
    per_token = batch["targets"] * 0.37 + 1.0
    np.testing.assert_allclose((got["weights"] * (got["targets"] * 0.37 + 1.0)).sum(),
                               (batch["weights"] * per_token).sum(), rtol=1e-6)


def test_balance_for_seq_keeps_given_positions_and_is_deterministic() -> None:
    batch = _unpacked_batch()
    batch["positions"] = np.array([[0, 1, 2, 0, 1, 2, 3, 0], np.arange(8)], np.int32)
    batch["segment_ids"] = np.array([[1, 1, 1, 2, 2, 2, 2, 0], [1] * 8], np.int32)
    first, again = balance_for_seq(batch, seq_shards=4), balance_for_seq(batch, seq_shards=4)
    order = dual_chunk_swap_order(8, 4)
    for name, value in batch.items():
        np.testing.assert_array_equal(first[name], value[:, order])
        np.testing.assert_array_equal(again[name], first[name])
    assert balance_for_seq(batch, seq_shards=1) == batch  # one shard: nothing to balance
    assert "positions" not in balance_for_seq(_unpacked_batch(), seq_shards=1)


def test_balance_for_seq_under_jit_equals_numpy() -> None:
    batch = _unpacked_batch(length=16)
    want = balance_for_seq(batch, seq_shards=4)
    got = jax.jit(lambda b: balance_for_seq(b, seq_shards=4))(
        {k: jnp.asarray(v) for k, v in batch.items()})
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), want[name], name)


@pytest.mark.parametrize("seq_len,shards,balanced,message", [
    (12, 8, False, (r"sequence length 12 does not divide over the seq mesh axis of size 8: each "
                    r"of the 8 shards holds an equal slice of every row; use a sequence length "
                    r"that is a multiple of 8")),
    (12, 4, True, (r"sequence length 12 does not divide over the seq mesh axis of size 4: load "
                   r"balancing \(dual_chunk_swap\) cuts each row into 2 \* 4 = 8 equal chunks; "
                   r"use a sequence length that is a multiple of 8, or a seq axis size that "
                   r"divides it, or turn load balancing off$")),
    (10, 4, True, r"multiple of 8, or a seq axis size that divides it$"),
])
def test_check_seq_divides_names_the_numbers(seq_len, shards, balanced, message) -> None:
    with pytest.raises(SettingError, match=message):
        check_seq_divides(seq_len=seq_len, seq_shards=shards, load_balance=balanced)
    if balanced:  # the per-batch step refuses the same batch with the same words
        with pytest.raises(SettingError, match=message):
            balance_for_seq(_unpacked_batch(length=seq_len), seq_shards=shards)


@pytest.mark.parametrize("seq_len,shards,balanced", [(16, 8, True), (12, 4, False), (7, 1, True)])
def test_check_seq_divides_accepts_what_splits(seq_len, shards, balanced) -> None:
    check_seq_divides(seq_len=seq_len, seq_shards=shards, load_balance=balanced)


def test_check_seq_divides_refuses_a_bad_count() -> None:
    with pytest.raises(SettingError, match="seq_shards=0: expected a positive integer"):
        check_seq_divides(seq_len=8, seq_shards=0, load_balance=True)


def test_train_batches_come_balanced_and_keep_their_sharding() -> None:
    """prefetch_train_batches(balance_seq_shards=C): every training batch is the feed's batch in
    dual_chunk_swap order with positions added, each field sharded as the feed sharded it."""
    mesh = jax.make_mesh(
        (1, 2, 1, 4, 1, 1),
        ("pipeline", "data", "fsdp", "seq", "tensor", "expert"),
        axis_types=(AxisType.Auto,) * 6,
    )
    sharding = batch_sharding(mesh)
    feed = SyntheticFeed(SyntheticDataConfig(vocab_size=97, seq_len=16, seed=2),
                         global_batch_size=4)
    with prefetch_train_batches(feed, start=1, stop=3, sharding=sharding,
                                balance_seq_shards=4) as batches:
        got = list(batches)
    assert len(got) == 2
    for index, (batch, _) in zip((1, 2), got, strict=True):
        plain = jax.device_get(feed.train_batch(index, sharding))
        want = balance_for_seq(plain, seq_shards=4)
        assert set(batch) == set(want) == {"inputs", "targets", "weights", "positions"}
        for name, value in want.items():
            assert batch[name].sharding == sharding, name
            np.testing.assert_array_equal(jax.device_get(batch[name]), value, name)
    with prefetch_train_batches(feed, start=1, stop=2, sharding=sharding) as batches:
        (batch, _), = list(batches)
    assert "positions" not in batch  # balance_seq_shards 1 (default): the feed's batch as it is
