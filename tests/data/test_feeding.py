"""Feed plans: which global-batch rows each process supplies, on 8 devices split into 2 pretend
processes."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from paxlite.data.feeding import plan_feeding
from paxlite.parallel.rules import batch_sharding


def _sharding(data: int, fsdp: int, tensor: int, order=None):
    devices = sorted(jax.devices(), key=lambda d: d.id)
    if order is not None:
        devices = [devices[i] for i in order]
    return batch_sharding(
        Mesh(np.array(devices).reshape(data, fsdp, tensor), ("data", "fsdp", "tensor"))
    )


def _plans(sharding, batch, process_of):
    return [
        plan_feeding(
            sharding, global_batch_size=batch, seq_len=16, process_index=p, process_of=process_of
        )
        for p in (0, 1)
    ]


def by_block(device):  # devices 0-3 on process 0, 4-7 on process 1 (one process per node)
    return device.id // 4


def test_whole_rows_per_process_every_process_feeds():
    p0, p1 = _plans(_sharding(4, 2, 1), 16, by_block)
    assert (p0.feed_index, p0.num_feeds, p0.rows, p0.local_batch_size) == (0, 2, slice(0, 8), 8)
    assert (p1.feed_index, p1.num_feeds, p1.rows) == (1, 2, slice(8, 16))


def test_fractional_percore_with_tensor_inside_a_process():
    """PERCORE_BATCH_SIZE=0.25 with tensor=4 inside each process: one row per process, both feed."""
    p0, p1 = _plans(_sharding(2, 1, 4), 2, by_block)
    assert [(p.feed_index, p.num_feeds, p.row_start, p.row_stop) for p in (p0, p1)] == [
        (0, 2, 0, 1),
        (1, 2, 1, 2),
    ]


def test_tensor_across_processes_makes_them_share_one_feed():
    """Pax's subset of infeed hosts: both processes hold the same rows, so they read the same data
    slice."""
    alternate = lambda device: device.id % 2  # tensor pairs straddle the two processes
    p0, p1 = _plans(_sharding(4, 1, 2), 4, alternate)
    assert (p0.num_feeds, p0.rows) == (1, slice(0, 4)) and (p1.feed_index, p1.rows) == (
        0,
        slice(0, 4),
    )
    p0, p1 = _plans(_sharding(1, 1, 8), 1, by_block)  # PERCORE_BATCH_SIZE=0.125: one row in all
    assert (p0.num_feeds, p0.local_batch_size, p1.feed_index) == (1, 1, 0)


def test_a_process_with_scattered_rows_is_refused():
    with pytest.raises(ValueError, match=r"process 0 holds non-contiguous batch rows"):
        _plans(_sharding(8, 1, 1), 8, lambda device: device.id % 2)


def test_this_process_plan_matches_what_jax_assembles():
    """On one real process the plan covers the batch, and the array built from it has the expected
    rows."""
    sharding = _sharding(2, 2, 2)
    plan = plan_feeding(sharding, global_batch_size=8, seq_len=3)
    assert (plan.feed_index, plan.num_feeds, plan.rows) == (0, 1, slice(0, 8))
    rows = np.arange(24, dtype=np.int32).reshape(8, 3)
    array = jax.make_array_from_process_local_data(sharding, rows[plan.rows], (8, 3))
    np.testing.assert_array_equal(np.asarray(array), rows)
