"""A hang watchdog: when no step completes for a while, say where every thread is; later, end the process.

A hung collective (a dead peer, a network partition) or a stuck input pipeline leaves a job holding its
accelerators forever, silently. After WATCHDOG_TIMEOUT_SECONDS without progress the watchdog logs every
thread's stack, which is usually enough to tell a stuck input thread from a stuck collective; after
CRASH_ON_HANG_TIMEOUT_SECONDS it exits with HANG_EXIT_CODE so the scheduler can restart the job, which then
resumes from its last checkpoint. The clock starts when the first step completes: that step compiles,
which takes as long as it takes, and a restarted job would only compile again. (AXLearn's --trainer_watchdog_timeout_seconds and
--trainer_crash_on_hang_timeout_seconds.) The loop's cost is one clock read per step.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Self

from absl import logging

HANG_EXIT_CODE = 124  # as `timeout` reports a command that ran out of time


def thread_stacks() -> str:
    """Every thread's current Python stack, named."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f'Thread "{names.get(ident, "?")}" ({ident}):\n{stack}')
    return "\n".join(parts)


def _exit_process(code: int) -> None:
    sys.stderr.flush()
    os._exit(code)


class Watchdog:
    """Started by the training loop; `beat()` marks progress (a context manager; None timeouts: off)."""

    def __init__(self, *, timeout_s: float | None, crash_timeout_s: float | None,
                 exit_process: Callable[[int], None] = _exit_process,
                 clock: Callable[[], float] = time.monotonic):
        self._timeout = timeout_s
        self._crash_timeout = crash_timeout_s
        self._exit_process = exit_process
        self._clock = clock
        self._last: float | None = None  # None: no step completed yet (the first one compiles)
        self._reported_at: float | None = None  # when stacks were last logged for the current stall
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.beats = 0

    def beat(self) -> None:
        self._last = self._clock()
        self.beats += 1

    def __enter__(self) -> Self:
        limits = [t for t in (self._timeout, self._crash_timeout) if t is not None]
        if limits:
            self._thread = threading.Thread(target=self._watch, args=(min(limits) / 4,),
                                            name="paxlite-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self, poll_s: float) -> None:
        while not self._stop.wait(min(poll_s, 10.0)):
            last = self._last
            if last is None:
                continue
            stalled = self._clock() - last
            if self._crash_timeout is not None and stalled >= self._crash_timeout:
                logging.error("No training step completed in %.0f s (CRASH_ON_HANG_TIMEOUT_SECONDS=%g): "
                              "exiting with status %d so that the job can be restarted; it resumes from "
                              "its last checkpoint. Where each thread is:\n%s", stalled,
                              self._crash_timeout, HANG_EXIT_CODE, thread_stacks())
                logging.flush()
                self._exit_process(HANG_EXIT_CODE)
                return
            if self._timeout is not None and stalled >= self._timeout:
                if self._reported_at != last:
                    self._reported_at = last
                    logging.warning("No training step completed in %.0f s (WATCHDOG_TIMEOUT_SECONDS=%g); "
                                    "where each thread is:\n%s", stalled, self._timeout, thread_stacks())
            elif self._reported_at is not None and self._reported_at != last:
                logging.info("Training steps complete again")
                self._reported_at = None
