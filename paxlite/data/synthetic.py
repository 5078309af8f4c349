"""Synthetic token batches: no I/O, deterministic in (seed, step), independent of the mesh.

Every row follows a fixed random permutation of the vocabulary (token t+1 = perm[token t]) from a random start,
so a model can learn it and the loss must fall, yet the shapes are exactly those of a real run. The global batch
for a step is a pure function of the seed and the step: one device or many, one process or many, each row is the
same, and each process computes only the rows its devices hold.
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


class SyntheticData:
    """Global batches {inputs, targets, weights} of shape [global_batch, seq_len] for any step."""

    def __init__(self, config: SyntheticDataConfig, *, global_batch_size: int):
        self.config = config
        self.global_batch_size = global_batch_size
        self._perm = np.random.default_rng([config.seed, 7]).permutation(config.vocab_size)

    def _starts(self, stream: int, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.config.seed, stream, index])
        return rng.integers(0, self.config.vocab_size, size=self.global_batch_size)

    def rows(self, stream: int, index: int, rows: slice) -> dict[str, np.ndarray]:
        """Host arrays for rows `rows` of batch `index` in `stream`."""
        starts = self._starts(stream, index)[rows]
        seq = np.empty((starts.shape[0], self.config.seq_len + 1), dtype=np.int32)
        seq[:, 0] = starts
        for t in range(1, self.config.seq_len + 1):
            seq[:, t] = self._perm[seq[:, t - 1]]
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
