"""Pax's PROFILER_* settings: one JAX profiler trace of a few training steps, on process 0.

Pax's open-source Profiler is a stub (traces come from a profiler server there), so the semantics
here follow Pax's documented ones: the trace starts right before step `capture_step` (steps count
from 1, as metrics.jsonl does), covers `num_steps` steps, and is extended over further steps until
at least `min_duration_sec` have been captured (Pax: "used when the estimated step duration times
profiler_num_steps is smaller than this value"), never past the run's last step. Device work is
asynchronous, so the duration is judged after blocking on the last traced step's outputs, which
must be finished before the trace stops anyway.

Only process 0 traces (as MaxText): one trace says what every process does in an SPMD program, and
a file per host would multiply the cost. Every step is wrapped in StepTraceAnnotation("train",
step_num=step), as Pax does, so the profile viewer splits the trace by step; outside a trace the
annotation costs about a microsecond.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import jax
from absl import logging


class StepProfiler:
    """Starts and stops the trace around the loop's steps; all host-side, nothing compiled."""

    def __init__(self, *, log_dir: str, capture_step: int | None, num_steps: int,
                 min_duration_sec: float, first_step: int, last_step: int,
                 enabled: bool | None = None):
        self.log_dir = log_dir
        self.num_steps = num_steps
        self.min_duration_sec = min_duration_sec
        self.last_step = last_step
        if enabled is None:
            enabled = jax.process_index() == 0
        self.capture_step: int | None = capture_step if enabled else None
        if capture_step is not None and capture_step < first_step:
            logging.info("PROFILER_CAPTURE_STEP=%d: this run starts at step %d (a resume), past "
                         "it, so nothing is profiled; the trace, if the earlier run made one, is "
                         "in %s",
                         capture_step, first_step, log_dir)
            self.capture_step = None
        self._started_at: float | None = None
        self._traced_steps = 0

    @property
    def active(self) -> bool:
        return self._started_at is not None

    def step(self, step: int) -> contextlib.AbstractContextManager:
        """The context one step runs in: starts the trace first where `step` is the capture step."""
        if step == self.capture_step and not self.active:
            os.makedirs(self.log_dir, exist_ok=True)
            jax.profiler.start_trace(self.log_dir)
            self._started_at = time.perf_counter()
            self._traced_steps = 0
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def after_step(self, step: int, outputs: Any) -> float:
        """Stops the trace once enough has been captured (after `outputs` are computed). Returns
        the seconds spent writing the trace, for the loop to leave out of its step times."""
        if not self.active:
            return 0.0
        self._traced_steps += 1
        if self._traced_steps < self.num_steps and step < self.last_step:
            return 0.0
        jax.block_until_ready(outputs)
        elapsed = time.perf_counter() - self._started_at
        if elapsed < self.min_duration_sec and step < self.last_step:
            return 0.0
        stop_start = time.perf_counter()
        self._stop()
        writing = time.perf_counter() - stop_start
        logging.info(
            "Profiled steps %d to %d (%.2f s) into %s: view it in TensorBoard's Profile tab "
            "(tensorboard --logdir %s) or with `xprof --port 8791 %s`",
            step - self._traced_steps + 1, step, elapsed, self.log_dir, self.log_dir, self.log_dir)
        return writing

    def close(self) -> None:
        """A run that stops mid-trace (an error, a diverged loss) still writes what was traced."""
        if self.active:
            self._stop()
            logging.info("Training stopped during the profile; the partial trace is in %s",
                         self.log_dir)

    def _stop(self) -> None:
        self._started_at = None
        self.capture_step = None
        jax.profiler.stop_trace()
