"""From host batches to global device batches, for the training loop.

A feed hides where batches come from (synthetic, or a prepared text dataset) behind four calls the loop
needs: the batch for an optimizer step, the evaluation batches, and saving/restoring its position. Each
process feeds only the rows its devices hold; `jax.make_array_from_process_local_data` assembles the global
batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Sharding

from paxlite.data.synthetic import SyntheticData, SyntheticDataConfig
from paxlite.parallel.multihost import allgather_json

Batch = dict[str, jax.Array]


class Feed(Protocol):
    def train_batch(self, index: int, sharding: Sharding) -> Batch:
        """The global batch consumed by optimizer step `index + 1`."""

    def eval_batches(self, num_batches: int, sharding: Sharding) -> Iterator[Batch]:
        """A fresh pass over the evaluation data (the same batches every time)."""

    def state(self) -> Any:
        """JSON record of the position (gathered from every process), or None when stateless."""

    def restore(self, record: Any, *, step: int) -> None:
        """Continue after `step` optimizer steps from a record written by `state()`."""


class SyntheticFeed:
    """Synthetic batches are a function of the step: nothing to save."""

    def __init__(self, config: SyntheticDataConfig, *, global_batch_size: int):
        self._data = SyntheticData(config, global_batch_size=global_batch_size)

    def train_batch(self, index: int, sharding: Sharding) -> Batch:
        return self._data.train_batch(index, sharding)

    def eval_batches(self, num_batches: int, sharding: Sharding) -> Iterator[Batch]:
        for index in range(num_batches):
            yield self._data.eval_batch(index, sharding)

    def state(self) -> None:
        return None

    def restore(self, record: Any, *, step: int) -> None:
        del record, step


def _to_global(local: dict[str, np.ndarray], sharding: Sharding) -> Batch:
    return {key: jax.make_array_from_process_local_data(sharding, value) for key, value in local.items()}


class TextFeed:
    """Batches from a prepared dataset; the iterator position is saved in every checkpoint."""

    def __init__(self, config, *, global_batch_size: int):
        from paxlite.data.pipeline import TextData  # grain and SentencePiece only on this path

        self._data = TextData(
            config,
            global_batch_size=global_batch_size,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
        self._iterator = self._data.train_iterator()
        self._next_index = 0

    def train_batch(self, index: int, sharding: Sharding) -> Batch:
        if index != self._next_index:
            raise RuntimeError(
                f"text batches are read in order: asked for batch {index}, next is {self._next_index}"
            )
        self._next_index += 1
        return _to_global(next(self._iterator), sharding)

    def eval_batches(self, num_batches: int, sharding: Sharding) -> Iterator[Batch]:
        for local in self._data.eval_batches(num_batches):
            yield _to_global(local, sharding)

    def state(self) -> dict:
        return {
            "batches_consumed": self._next_index,
            "processes": allgather_json(self._iterator.get_state()),
        }

    def restore(self, record: Any, *, step: int) -> None:
        if record is None:
            raise ValueError(
                f"the checkpoint at step {step} has no input-pipeline position, so the batches after it "
                "cannot be reproduced; it was written for other data (e.g. synthetic)"
            )
        processes = record["processes"]
        if len(processes) != jax.process_count():
            raise ValueError(
                f"the checkpoint at step {step} was written by {len(processes)} process(es) and this job has "
                f"{jax.process_count()}: each process's input position cannot be split or merged"
            )
        if record["batches_consumed"] != step:
            raise ValueError(
                f"the checkpoint at step {step} records {record['batches_consumed']} batches consumed"
            )
        self._iterator.set_state(processes[jax.process_index()])
        self._next_index = step


def make_feed(config, *, global_batch_size: int) -> Feed:
    if isinstance(config, SyntheticDataConfig):
        return SyntheticFeed(config, global_batch_size=global_batch_size)
    return TextFeed(config, global_batch_size=global_batch_size)
