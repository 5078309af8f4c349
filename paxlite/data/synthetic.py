"""Synthetic token batches: no I/O, deterministic in (seed, step), independent of the mesh.

Every row follows a fixed random permutation of the vocabulary (token t+1 = perm[token t]) from a
random start, so a model can learn it and the loss must fall, yet the shapes are exactly those of a
real run. The global batch for a step is a pure function of the seed and the step: one device or
many, one process or many, each row is the same, and each process computes only the rows its devices
hold.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Sharding

# Separate random streams for training and evaluation batches.
_TRAIN_STREAM = 0
_EVAL_STREAM = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticDataConfig:
    vocab_size: int
    seq_len: int
    seed: int = 0

    def __post_init__(self):
        if self.vocab_size < 2 or self.seq_len < 1:
            raise ValueError(
                f"synthetic data needs vocab_size >= 2 and seq_len >= 1, got "
                f"vocab_size={self.vocab_size}, seq_len={self.seq_len}"
            )


def _cycle_tables(perm: np.ndarray) -> tuple[np.ndarray, ...]:
    """The permutation's cycles laid end to end, and for every token v: where its cycle starts in
    that array, the cycle's length and v's place in it. Then perm^t(v) is one gather,
    cycles[start[v] + (pos[v] + t) % length[v]], so a batch needs no loop over its positions.
    Built once per dataset, in O(vocab)."""
    n = perm.shape[0]
    cycles = np.empty(n, dtype=np.int64)
    start = np.empty(n, dtype=np.int64)
    length = np.empty(n, dtype=np.int64)
    pos = np.empty(n, dtype=np.int64)
    seen = np.zeros(n, dtype=bool)
    filled = 0
    for first in range(n):
        if seen[first]:
            continue
        members = []
        v = first
        while not seen[v]:
            seen[v] = True
            members.append(v)
            v = int(perm[v])
        k = len(members)
        cycles[filled:filled + k] = members
        start[members] = filled
        length[members] = k
        pos[members] = np.arange(k)
        filled += k
    return cycles, start, length, pos


class SyntheticData:
    """Global batches {inputs, targets, weights} of shape [global_batch, seq_len] for any step."""

    def __init__(self, config: SyntheticDataConfig, *, global_batch_size: int):
        self.config = config
        self.global_batch_size = global_batch_size
        self._perm = np.random.default_rng([config.seed, 7]).permutation(config.vocab_size)
        self._cycles, self._cycle_start, self._cycle_len, self._cycle_pos = _cycle_tables(
            self._perm
        )

    def _starts(self, stream: int, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.config.seed, stream, index])
        return rng.integers(0, self.config.vocab_size, size=self.global_batch_size)

    def rows(self, stream: int, index: int, rows: slice) -> dict[str, np.ndarray]:
        """Host arrays for rows `rows` of batch `index` in `stream`."""
        starts = self._starts(stream, index)[rows]
        # Token t of a row is perm applied t times to its start: a step of t along the start's
        # cycle.
        steps = np.arange(self.config.seq_len + 1, dtype=np.int64)  # [T + 1]
        offset = (self._cycle_pos[starts][:, None] + steps) % self._cycle_len[starts][:, None]
        # [R, T + 1]
        seq = self._cycles[self._cycle_start[starts][:, None] + offset].astype(np.int32)
        return {
            "inputs": seq[:, :-1],
            "targets": seq[:, 1:],
            "weights": np.ones(seq[:, 1:].shape, dtype=np.float32),
        }

    def _global(self, stream: int, index: int, sharding: Sharding) -> dict[str, jax.Array]:
        shape = (self.global_batch_size, self.config.seq_len)
        cache: dict[tuple[int, int], dict[str, np.ndarray]] = {}

        def local_rows(idx) -> dict[str, np.ndarray]:
            start, stop, _ = idx[0].indices(shape[0])
            if (start, stop) not in cache:
                cache[(start, stop)] = self.rows(stream, index, slice(start, stop))
            return cache[(start, stop)]

        return {
            key: jax.make_array_from_callback(
                shape, sharding, lambda idx, key=key: local_rows(idx)[key][:, idx[1]]
            )
            for key in ("inputs", "targets", "weights")
        }

    def train_batch(self, step: int, sharding: Sharding) -> dict[str, jax.Array]:
        """The batch consumed by optimizer step `step + 1` (0-based batch index)."""
        return self._global(_TRAIN_STREAM, step, sharding)

    def eval_batch(self, index: int, sharding: Sharding) -> dict[str, jax.Array]:
        return self._global(_EVAL_STREAM, index, sharding)
