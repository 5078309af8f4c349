"""The background batch producer: order, depth, errors, shutdown; and the positions it records."""

import threading
import time
import traceback

import jax
import numpy as np
import pytest

from paxlite.data.feed import SyntheticFeed, prefetch_train_batches
from paxlite.data.prefetch import DEFAULT_DEPTH, Prefetcher
from paxlite.data.synthetic import SyntheticDataConfig
from paxlite.parallel import rules
from paxlite.parallel.mesh import MeshConfig, build_mesh


class _Counting:
    """An iterator that records how many items were built, and can fail at one of them."""

    def __init__(self, n, *, fail_at=None):
        self.n, self.fail_at, self.built = n, fail_at, 0
        self.lock = threading.Lock()

    def __iter__(self):
        return self

    def __next__(self):
        with self.lock:
            if self.built == self.n:
                raise StopIteration
            if self.built == self.fail_at:
                _explode(self.built)
            self.built += 1
            return self.built - 1


def _explode(index):
    raise OSError(f"shard unreadable at item {index}")


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_items_come_in_order_and_all_of_them():
    with Prefetcher(range(50), depth=3) as items:
        assert list(items) == list(range(50))


@pytest.mark.parametrize("depth", [1, DEFAULT_DEPTH, 5])
def test_producer_never_gets_more_than_depth_items_ahead(depth):
    source = _Counting(100)
    with Prefetcher(source, depth=depth) as items:
        assert _wait_for(lambda: source.built == depth)
        time.sleep(0.2)  # time to overrun, if it could
        assert source.built == depth
        assert [next(items) for _ in range(3)] == [0, 1, 2]
        assert _wait_for(lambda: source.built == depth + 3)
        time.sleep(0.2)
        assert source.built == depth + 3


def test_default_depth_prefetches_at_least_two():
    assert DEFAULT_DEPTH >= 2


def test_producer_error_surfaces_on_the_consumer_with_its_traceback():
    with Prefetcher(_Counting(10, fail_at=4), depth=2, name="unit") as items:
        got = [next(items) for _ in range(4)]  # the items before the failure still arrive
        assert got == [0, 1, 2, 3]
        with pytest.raises(OSError, match="shard unreadable at item 4") as info:
            next(items)
        frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
        assert "_explode" in frames and "_produce" in frames  # raised where it happened
        assert any("producer thread 'unit'" in note for note in info.value.__notes__)
        with pytest.raises(StopIteration):  # stays stopped: no hang, no second error
            next(items)


def test_close_stops_a_blocked_producer():
    source = _Counting(10**9)
    items = Prefetcher(source, depth=2)
    assert _wait_for(lambda: source.built == 2)
    items.close()
    assert not items._thread.is_alive()
    with pytest.raises(StopIteration):
        next(items)


def test_close_closes_a_generator_source_half_way():
    """Closing a half-read source runs its `finally`: a reader it holds is released then, not at
    some later garbage collection."""
    released = []

    def rows():
        try:
            yield from range(10**9)
        finally:
            released.append(True)

    items = Prefetcher(rows(), depth=2)
    assert next(items) == 0
    items.close()
    assert released == [True]


def test_bad_depth_is_one_line():
    with pytest.raises(ValueError, match="depth must be an integer >= 1, got 0"):
        Prefetcher(range(3), depth=0)


def test_train_batches_are_the_feeds_batches_on_their_devices():
    feed = SyntheticFeed(SyntheticDataConfig(vocab_size=97, seq_len=8, seed=1), global_batch_size=8)
    sharding = rules.batch_sharding(build_mesh(MeshConfig(ici_mesh_shape=(2, 2, 2))))
    with prefetch_train_batches(feed, start=3, stop=7, sharding=sharding) as batches:
        got = list(batches)
    assert len(got) == 4
    for index, (batch, position) in zip(range(3, 7), got):
        assert position is None  # synthetic batches are a function of the step
        assert batch["inputs"].sharding == sharding
        want = feed.train_batch(index, sharding)
        for key in want:
            np.testing.assert_array_equal(jax.device_get(batch[key]), jax.device_get(want[key]))
