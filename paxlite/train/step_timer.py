"""The training loop's clock: how fast the steps of one summary window ran, for metrics.jsonl.

A window runs from the end of the previous boundary's host work (summaries, evaluation, a
checkpoint) to the next summary, so that work is not charged to the steps; the run's first step
compiles, and its window starts once that step is computed. Writing a profile trace is left out too.
The summary is taken after the boundary has read the window's metrics back from the devices, so it
times the devices' work, not just the host dispatching steps ahead of them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TypeVar

from paxlite.train import flops as flops_lib

_Item = TypeVar("_Item")


class StepTimer:
    """Step time, tokens/s, MFU and the share of time spent waiting for input, per window."""

    def __init__(self, *, tokens_per_step: int, flops_per_token: float,
                 peak_flops_per_device: float | None, num_devices: int):
        self._tokens_per_step = tokens_per_step
        self._flops_per_token = flops_per_token
        self._peak_flops_per_device = peak_flops_per_device
        self._num_devices = num_devices
        self.restart()

    def restart(self) -> None:
        """A new window from now, with no steps in it yet."""
        self._start = time.perf_counter()
        self._steps = 0
        self._input_wait = 0.0  # seconds spent in `next_batch` since `_start`

    def next_batch(self, batches: Iterator[_Item]) -> _Item:
        """The producer's next item; the time this thread waits for it is input wait (an
        input-bound run waits for most of each step)."""
        started = time.perf_counter()
        item = next(batches)
        self._input_wait += time.perf_counter() - started
        return item

    def exclude(self, seconds: float) -> None:
        """Leaves `seconds` of host work that is no step's (writing a profile trace) out of the
        window."""
        self._start += seconds

    def count_step(self) -> None:
        self._steps += 1

    def summary(self) -> dict[str, float | None]:
        """metrics.jsonl's timing keys for the window so far, in the order they are written; each
        None when the window has no timed step (or the model FLOPs or the peak are unknown: mfu)."""
        elapsed = time.perf_counter() - self._start
        step_time = elapsed / self._steps if self._steps else None
        wait_fraction = self._input_wait / elapsed if self._steps and elapsed > 0 else None
        tokens_per_s = self._tokens_per_step / step_time if step_time else None
        mfu = None
        if tokens_per_s is not None:
            mfu = flops_lib.model_flops_utilization(
                tokens_per_s=tokens_per_s,
                flops_per_token=self._flops_per_token,
                peak_flops_per_device=self._peak_flops_per_device,
                num_devices=self._num_devices,
            )
        return {
            "step_time_s": step_time,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            # share of the window this thread was blocked obtaining batches (input-bound if large)
            "input_wait_fraction": wait_fraction,
        }
