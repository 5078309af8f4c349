"""Load-balanced token order for sequence (context) parallelism: MaxText's ``dual_chunk_swap``.

Why: with the sequence sharded over C devices of a ``seq`` mesh axis, causal attention gives the
device holding the last slice of the row far more (query, key) pairs to compute than the one holding
the first (about 2C-1 : 1 of the unmasked pairs for contiguous slices). Split the
row into 2·C chunks and give shard i chunks i and 2C-1-i: every shard then holds one early and one
late chunk, and the unmasked pairs per shard are equal. The reorder happens once, where the batch is
formed, on every per-token field together, so ``positions`` and ``segment_ids`` travel with their
token: RoPE, the packed-segment mask and the loss weights keep following each token's true position
while its slot in the row changes. The loss (a weighted sum over tokens) does not depend on the slot
order; attention over a reordered row must mask by positions, not slots
(models/context_parallel.py).

Convention: ``order`` is a permutation of ``range(seq_len)``; the reordered row is
``row[:, order]``, i.e. slot t holds the token that was at ``order[t]``; ``inverse_order(order)``
undoes it (``reordered[:, inverse] == row``).

Where it is applied: ``balance_for_seq`` is the per-batch step (it also adds ``positions`` to a
batch that has none, so the tokens keep their true positions), and data/feed.py's
``prefetch_train_batches(..., balance_seq_shards=C)`` calls it on every training batch.
Evaluation batches are left in their order: sequence-parallel attention is exact in any order,
the reorder only balances the work. ``check_seq_divides`` says before compiling whether a
sequence length splits over the ``seq`` axis at all.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from paxlite.errors import SettingError

POSITIONS_KEY = "positions"  # the batch field the model reads token positions from


def check_seq_divides(*, seq_len: int, seq_shards: int, load_balance: bool) -> None:
    """A SettingError naming the numbers unless rows of ``seq_len`` tokens split evenly over a
    ``seq`` mesh axis of ``seq_shards``: into seq_shards slices, or with ``load_balance`` into
    2 * seq_shards chunks (dual_chunk_swap gives every shard two). Nothing to check for 1 shard.
    """
    for name, value in (("seq_len", seq_len), ("seq_shards", seq_shards)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise SettingError(f"{name}={value!r}: expected a positive integer")
    if seq_shards == 1:
        return
    parts = 2 * seq_shards if load_balance else seq_shards
    if seq_len % parts:
        how = (f"load balancing (dual_chunk_swap) cuts each row into 2 * {seq_shards} = {parts} "
               "equal chunks" if load_balance else f"each of the {seq_shards} shards holds an "
               "equal slice of every row")
        raise SettingError(
            f"sequence length {seq_len} does not divide over the seq mesh axis of size "
            f"{seq_shards}: {how}; use a sequence length that is a multiple of {parts}, or a seq "
            f"axis size that divides it"
            + ("" if not load_balance or seq_len % seq_shards else
               ", or turn load balancing off"))


def dual_chunk_swap_order(seq_len: int, num_shards: int) -> np.ndarray:
    """The permutation [seq_len] (int32) that gives shard i chunks i and 2C-1-i, in that order.

    The row is cut into 2·C equal chunks of seq_len / (2C) tokens; shard i's contiguous slice of
    the reordered row is chunk i followed by chunk 2C-1-i. A seq_len that 2C does not divide is a
    ValueError naming both numbers (the chunks must be equal for the work to balance).
    """
    if not isinstance(num_shards, (int, np.integer)) or num_shards < 1:
        raise ValueError(f"num_shards={num_shards!r}: expected a positive integer (the seq axis "
                         "size)")
    if not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r}: expected a positive integer")
    chunks = 2 * num_shards
    if seq_len % chunks:
        raise ValueError(
            f"seq_len={seq_len} is not divisible by 2 * num_shards = {chunks} (dual_chunk_swap "
            f"cuts the row into 2 equal chunks per shard of the seq axis, num_shards={num_shards})")
    chunk = seq_len // chunks
    starts = [c for i in range(num_shards) for c in (i, chunks - 1 - i)]  # chunk ids in slot order
    return np.concatenate(
        [np.arange(c * chunk, (c + 1) * chunk, dtype=np.int32) for c in starts])


def inverse_order(order: np.ndarray) -> np.ndarray:
    """The permutation that undoes ``order``: ``row[:, order][:, inverse_order(order)] == row``."""
    order = np.asarray(order)
    if order.ndim != 1 or not np.array_equal(np.sort(order), np.arange(order.shape[0])):
        raise ValueError(f"order must be a permutation of range(n), got shape {order.shape}")
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.shape[0], dtype=order.dtype)
    return inverse


def reorder_batch(batch: Mapping[str, Any], order: np.ndarray) -> dict[str, Any]:
    """Every per-token field [B, T, ...] of ``batch`` permuted along T by ``order``.

    inputs, targets, weights, positions and segment_ids move together, so each token keeps its
    true position and document. Fields of rank 1 (one value per row) do not depend on the token
    order and are returned as they are. A field of rank >= 2 whose second axis is not T is a
    ValueError naming it: it is not clear what reordering it would mean. Works on NumPy and JAX
    arrays alike (``x[:, order]``).
    """
    order = np.asarray(order)
    length = order.shape[0]
    out: dict[str, Any] = {}
    for name, value in batch.items():
        shape = np.shape(value)
        if len(shape) < 2:
            out[name] = value
            continue
        if shape[1] != length:
            raise ValueError(
                f"batch field {name!r} has shape {tuple(shape)}: expected [batch, {length}, ...] "
                f"to reorder it with an order of length {length}")
        out[name] = value[:, order]
    return out


def balance_for_seq(batch: Mapping[str, Any], *, seq_shards: int) -> dict[str, Any]:
    """``batch`` in the dual_chunk_swap order for a ``seq`` axis of ``seq_shards``, with positions.

    A batch without ``positions`` first gets them (``arange(T)`` per row, int32): after the
    reorder a token's slot is no longer its position, and RoPE, learned position embeddings and
    the attention mask must read the true one. Then every per-token field moves together
    (``reorder_batch``), so packed segment ids, their restarting positions and the loss weights
    follow their tokens. The loss, a weighted sum over tokens, is the same sum in another order.
    Deterministic (the order depends only on T and seq_shards); NumPy and JAX arrays alike, also
    under ``jax.jit``. seq_shards 1: the batch as it is.
    """
    if seq_shards == 1:
        return dict(batch)
    per_token = [value for value in batch.values() if np.ndim(value) >= 2]
    if not per_token:
        raise ValueError(f"batch has no per-token field [batch, length] to reorder: fields "
                         f"{sorted(batch)}")
    rows, length = np.shape(per_token[0])[:2]
    check_seq_divides(seq_len=length, seq_shards=seq_shards, load_balance=True)
    out = dict(batch)
    if POSITIONS_KEY not in out:
        on_device = any(isinstance(value, jax.Array) for value in per_token)
        xp = jnp if on_device else np
        out[POSITIONS_KEY] = xp.broadcast_to(xp.arange(length, dtype=xp.int32), (rows, length))
    return reorder_batch(out, dual_chunk_swap_order(length, seq_shards))


@functools.cache
def _balancer(seq_shards: int, shardings: tuple[tuple[str, Sharding], ...]):
    """``balance_for_seq`` compiled for one batch layout; each output field keeps its sharding."""
    return jax.jit(functools.partial(balance_for_seq, seq_shards=seq_shards),
                   out_shardings=dict(shardings))


def balance_batch_for_seq(batch: dict[str, jax.Array], *, seq_shards: int) -> dict[str, jax.Array]:
    """A global batch on its devices in the dual_chunk_swap order for a ``seq`` axis of
    ``seq_shards``, positions added where missing (``context_order.balance_for_seq``); every field
    keeps its sharding, and added positions take that of the per-token fields. 1: unchanged."""
    if seq_shards == 1:
        return batch
    shardings = {key: value.sharding for key, value in batch.items()}
    if POSITIONS_KEY not in shardings:
        per_token = [value for value in batch.values() if value.ndim >= 2]
        if per_token:  # none: balance_for_seq names the problem
            shardings[POSITIONS_KEY] = per_token[0].sharding
    return _balancer(seq_shards, tuple(sorted(shardings.items())))(batch)
