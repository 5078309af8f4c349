"""A hang watchdog: when no step completes for a while, say where every thread is; later, end the
process.

A hung collective (a dead peer, a network partition) or a stuck input pipeline leaves a job holding
its accelerators forever, silently. After WATCHDOG_TIMEOUT_SECONDS without progress the watchdog
logs every thread's stack, which is usually enough to tell a stuck input thread from a stuck
collective; after CRASH_ON_HANG_TIMEOUT_SECONDS it exits with HANG_EXIT_CODE so the scheduler can
restart the job, which then resumes from its last checkpoint. The clock starts when the first step
completes: that step compiles, which takes as long as it takes, and a restarted job would only
compile again. (AXLearn's --trainer_watchdog_timeout_seconds and
--trainer_crash_on_hang_timeout_seconds.) The loop's cost is one clock read per step.

Progress is not only steps: the loop beats after every evaluation batch too, so a long evaluation is
not a hang. Two stretches are judged differently. While something compiles (`compiling()`: the first
evaluation batch) nothing is reported: a compile takes as long as it takes. While a checkpoint
commits (`committing()`: a save that waits for the previous one, the wait for the last one) a stall
is still reported, but the process is never ended: killing a commit in progress throws away the very
step a restart would resume from, and a slow network filesystem is not a hang. (A commit that never
ends is then only reported; a dead peer still ends the job through JAX's distributed heartbeat.)
Either stretch counts as progress when it ends.
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
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


class Phase(enum.Enum):
    """What the loop is doing, as far as the watchdog is concerned."""

    STEPPING = "stepping"  # training or evaluating: a stall is reported, then the process ended
    COMPILING = "compiling"  # not timed at all
    COMMITTING = "committing"  # a stall is reported, the process is never ended


def _exit_process(code: int) -> None:
    sys.stderr.flush()
    os._exit(code)


class Watchdog:
    """Started by the training loop; `beat()` marks progress (a context manager; None timeouts:
    off)."""

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
        self._phase = Phase.STEPPING
        self.beats = 0

    @property
    def phase(self) -> Phase:
        return self._phase

    def beat(self) -> None:
        self._last = self._clock()
        self.beats += 1

    @contextlib.contextmanager
    def _in_phase(self, phase: Phase) -> Iterator[None]:
        previous, self._phase = self._phase, phase
        try:
            yield
        finally:
            self._phase = previous
            self.beat()  # the stretch ended: that is progress, and the clock restarts from here

    def compiling(self) -> contextlib.AbstractContextManager[None]:
        """Nothing inside is timed (a first evaluation batch compiles its program)."""
        return self._in_phase(Phase.COMPILING)

    def committing(self) -> contextlib.AbstractContextManager[None]:
        """A checkpoint commits inside: a stall is logged with every stack, never ends the
        process."""
        return self._in_phase(Phase.COMMITTING)

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
            last, phase = self._last, self._phase
            if last is None or phase is Phase.COMPILING:
                continue
            stalled = self._clock() - last
            if (phase is Phase.STEPPING and self._crash_timeout is not None
                    and stalled >= self._crash_timeout):
                logging.error("No training step completed in %.0f s "
                              "(CRASH_ON_HANG_TIMEOUT_SECONDS=%g): exiting with status %d so that "
                              "the job can be restarted; it resumes from its last checkpoint. "
                              "Where each thread is:\n%s", stalled,
                              self._crash_timeout, HANG_EXIT_CODE, thread_stacks())
                logging.flush()
                self._exit_process(HANG_EXIT_CODE)
                return
            # In a commit the crash timeout only makes the report due (when the first is off).
            report_after = min(
                t for t in (self._timeout, self._crash_timeout, math.inf) if t is not None
            )
            if stalled >= report_after:
                if self._reported_at != last:
                    self._reported_at = last
                    during = (" while a checkpoint commits (the process is not ended during a "
                              "commit)"
                              if phase is Phase.COMMITTING else "")
                    logging.warning(
                        "No training step completed in %.0f s%s "
                        "(WATCHDOG_TIMEOUT_SECONDS=%s); where each thread is:\n%s",
                        stalled,
                        during,
                        "None" if self._timeout is None else f"{self._timeout:g}",
                        thread_stacks(),
                    )
            elif self._reported_at is not None and self._reported_at != last:
                logging.info("Training steps complete again")
                self._reported_at = None
