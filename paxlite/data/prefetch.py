"""Build batches ahead of the training thread: an iterator run in a background producer thread.

Why: building a batch (reading and packing tokens, or generating synthetic ones) and copying it to
the devices is host work. Done on the training thread it sits between two step dispatches, so on
a small model the device idles while the host works. A producer thread does it ahead of time
instead, at most `depth` items ahead of what the consumer has taken (bounded memory: `depth`
device batches besides the ones the steps are using), strictly in the iterator's order.

An exception in the producer is handed to the consumer and raised there, from the item where it
happened, with the producer's traceback (and a note saying where it came from): the run stops
with the real error instead of hanging on an empty queue or ending early.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Generic, Self, TypeVar

T = TypeVar("T")

DEFAULT_DEPTH = 2  # device batches built ahead of the step that will consume them

_ITEM, _END, _ERROR = "item", "end", "error"


class Prefetcher(Generic[T]):
    """Iterates `items` in a daemon thread, at most `depth` items ahead of `next()`.

    Use as a context manager (or call `close()`): closing stops the producer after the item it is
    building, then closes `items` where it can be closed (a generator's `finally` blocks run), so
    an interrupted run leaves no thread behind, its own or a reader's.
    """

    def __init__(self, items: Iterable[T], *, depth: int = DEFAULT_DEPTH, name: str = "prefetch"):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"prefetch depth must be an integer >= 1, got {depth!r}")
        self.depth = depth
        self.name = name
        self._items = iter(items)
        self._slots = threading.Semaphore(depth)  # items the producer may build before a get
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._produce, name=name, daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        try:
            while True:
                self._slots.acquire()
                if self._stop.is_set():
                    return
                try:
                    item = next(self._items)
                except StopIteration:
                    self._queue.put((_END, None))
                    return
                self._queue.put((_ITEM, item))
        except BaseException as error:  # noqa: BLE001  handed to the consumer, raised there
            self._queue.put((_ERROR, error))

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._finished:
            raise StopIteration
        kind, value = self._queue.get()
        if kind == _ITEM:
            self._slots.release()
            return value
        self._finished = True
        if kind == _END:
            raise StopIteration
        value.add_note(f"(raised in the input producer thread {self.name!r}, which builds batches "
                       "ahead of the training step)")
        raise value

    def close(self) -> None:
        """Stop the producer (it finishes the item in hand, then exits) and wait for it."""
        self._finished = True
        self._stop.set()
        self._slots.release()  # wakes a producer waiting for a free slot
        self._thread.join(timeout=60)
        close = getattr(self._items, "close", None)  # a generator: its `finally` blocks run now
        if close is not None and not self._thread.is_alive():
            close()
        while True:  # drop what was built but never taken
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
