"""Which rows of the global batch each process must read: Pax's infeed hosts, derived from the mesh.

Pax feeds `PERCORE_BATCH_SIZE x local devices` rows per process when that is at least one; with a
fractional PERCORE_BATCH_SIZE (tensor parallelism makes that legal) only `num_infeed_hosts` of the
processes feed and the others' devices get the same rows. JAX asks more of us: every process must
supply the rows its own devices hold (`make_array_from_process_local_data`), so a process cannot
stay silent. The plan therefore reads the batch sharding itself: processes whose devices hold the
same rows form one feed and read the same slice of the data; distinct row blocks are the feeds,
numbered in row order. With PERCORE_BATCH_SIZE >= 1 every process is its own feed (Pax's "all
processes feed"); with a tensor axis across processes, processes share a feed (Pax's subset of
infeed hosts).
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from paxlite.errors import SettingError


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeedPlan:
    """This process's part in assembling each global batch.

    Attributes:
        feed_index: which slice of the data this process reads (processes with equal values read the
            same documents, in the same order).
        num_feeds: how many distinct slices the data is split into.
        row_start, row_stop: the global batch rows this process supplies.
        global_batch_size: rows in one global batch.
    """

    feed_index: int
    num_feeds: int
    row_start: int
    row_stop: int
    global_batch_size: int

    @property
    def local_batch_size(self) -> int:
        return self.row_stop - self.row_start

    @property
    def rows(self) -> slice:
        return slice(self.row_start, self.row_stop)


def global_batch(local: dict[str, np.ndarray], sharding: NamedSharding,
                 plan: FeedPlan) -> dict[str, jax.Array]:
    """This process's rows (`plan.rows`) into global arrays; per-example arrays ([B]) use the batch
    axes only."""
    return {
        key: jax.make_array_from_process_local_data(
            NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[: value.ndim])),
            value,
            (plan.global_batch_size, *value.shape[1:]),
        )
        for key, value in local.items()
    }


def local_batch_size(*, global_batch_size: int, process_index: int, process_count: int) -> int:
    """Rows one of `process_count` feeds supplies; a ValueError naming the numbers when they do not
    split."""
    if process_count < 1 or not 0 <= process_index < process_count:
        raise SettingError(
            f"process_index must be in [0, process_count), got process_index={process_index}, "
            f"process_count={process_count}"
        )
    if global_batch_size < 1 or global_batch_size % process_count:
        raise SettingError(
            f"global_batch_size {global_batch_size} must be a positive multiple of the process "
            f"count {process_count}"
        )
    return global_batch_size // process_count


class ProcessShare(abc.ABC):
    """Base of the host-side batch sources: this process's share of the global batch is worked out
    and checked before the source is opened, so a batch that does not split over the processes
    fails before any file is read. A subclass opens and checks its source in `_open`."""

    def __init__(self, config, *, global_batch_size: int, process_index: int = 0,
                 process_count: int = 1):
        self.config = config
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size(
            global_batch_size=global_batch_size,
            process_index=process_index,
            process_count=process_count,
        )
        self.process_index = process_index
        self.process_count = process_count
        self._open()

    @abc.abstractmethod
    def _open(self) -> None:
        """Open this process's share of the source and check it against the config."""


def check_vocab_and_seed(*, vocab_size: int, seed: int) -> None:
    """What the configs of both host-side sources (the text pipeline's and SeqIO's) ask of the
    tokenizer and the seed: two token ids at least, and a seed numpy's generators take."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")


def plan_feeding(
    sharding: Sharding,
    *,
    global_batch_size: int,
    seq_len: int = 1,
    process_index: int | None = None,
    process_of: Callable[[jax.Device], int] = lambda device: device.process_index,
) -> FeedPlan:
    """The feed plan of `process_index` (default: this process) for [global_batch_size, seq_len]
    batches.

    `process_of` maps a device to its process; tests use it to lay out several processes over one
    process's devices.
    """
    process_index = jax.process_index() if process_index is None else process_index
    blocks: dict[int, set[tuple[int, int]]] = {}
    for device, index in sharding.devices_indices_map((global_batch_size, seq_len)).items():
        start, stop, _ = index[0].indices(global_batch_size)
        blocks.setdefault(process_of(device), set()).add((start, stop))
    spans: dict[int, tuple[int, int]] = {}
    for process, ranges in blocks.items():
        ordered = sorted(ranges)
        if any(a[1] != b[0] for a, b in itertools.pairwise(ordered)):
            raise SettingError(
                f"process {process} holds non-contiguous batch rows {ordered}: order the mesh so "
                "each process's devices hold one contiguous block of the batch"
            )
        spans[process] = (ordered[0][0], ordered[-1][1])
    if process_index not in spans:
        raise SettingError(f"process {process_index} holds no device of the batch sharding")
    distinct = sorted(set(spans.values()))
    sizes = {stop - start for start, stop in distinct}
    covered = sum(stop - start for start, stop in distinct)
    if len(sizes) != 1 or covered != global_batch_size:
        raise SettingError(
            f"processes hold batch rows {distinct}: these must be equal, non-overlapping blocks "
            f"that cover all {global_batch_size} rows"
        )
    start, stop = spans[process_index]
    return FeedPlan(
        feed_index=distinct.index((start, stop)),
        num_feeds=len(distinct),
        row_start=start,
        row_stop=stop,
        global_batch_size=global_batch_size,
    )
