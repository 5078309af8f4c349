"""Stopping on SIGTERM/SIGINT without losing a step: finish it, checkpoint it, exit.

Schedulers preempt by signalling (Slurm, Kubernetes, a user's Ctrl-C) and killing a grace period
later. The first signal asks the loop to stop after the step in flight; the loop then writes a
checkpoint of that step, waits for it to commit and returns, so the next run resumes exactly there.
A second signal means "now": the process exits at once with 128 + the signal's number, as a process
killed by it would report (a second copy of the first signal within DUPLICATE_WINDOW_S is not a
second request). That cannot damage the last committed checkpoint: a save in flight is written under
Orbax's temporary name and renamed only when complete (checkpointing/checkpoint.py), so an
interrupted one is never mistaken for a step.

Several processes must stop at the same step (each saves its part of the one checkpoint), yet the
signal may reach one of them only (a drained node). So they vote, and the vote rides in the train
step: each process gives the step its own flag on each of its devices (`votes`, an array made once
per flag value, so no transfer per step), and the compiled step returns the maximum over all devices
beside its metrics. No program, launch or host-to-device copy is added to a step, and no collective
of its own: the maximum is one tiny all-reduce inside the step's program. What is left per step is
reading back one scalar the loop already waited for.

Every process then decides after step k on the vote of one and the same step, d(k):
- k itself where the loop waits for step k anyway (the first step, which compiles; a summary,
  evaluation or checkpoint boundary, whose metrics are read);
- else k - `lag`, which the loop has already waited for (it never runs more than `lag` steps ahead),
  so the decision costs no extra wait.
Flags only ever go from 0 to 1, so a vote that has seen a signal stays seen, and d(k) is the same on
every process: all stop after the same step. The first step dispatched after the signal carries it,
so a run stops at most `lag` + 1 steps after the step that was in flight when the signal came (after
that first step, if the loop waits for it), and a
signal that comes before the first step (while the run compiles) stops it after that step. One
process decides on its own flag at once, without voting.
"""

from __future__ import annotations

import collections
import os
import signal
import sys
import threading
import time
from typing import Self

import jax
import numpy as np
from absl import logging
from jax.sharding import NamedSharding

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Signals this soon after the first are the same request arriving twice: Slurm and a terminal signal
# every process of the job, and the run_*.sh scripts forward what they receive to paxlite, so one
# preemption can reach the process twice within milliseconds. A person's second Ctrl-C comes later
# than this.
DUPLICATE_WINDOW_S = 1.0


class Preemption:
    """Signal handlers for one training loop, and the agreed decision to stop (a context
    manager)."""

    def __init__(self, *, lag: int, voting: bool | None = None):
        """`voting`: whether the processes vote (default: when there are several); a single process
        may vote too (tests do), over its own devices."""
        self._lag = lag
        self.voting = jax.process_count() > 1 if voting is None else voting
        self.signal_number: int | None = None  # the first stop signal received
        self._first_at = 0.0
        self._previous: dict[int, object] = {}
        # Steps whose agreed vote has not been read yet, oldest first: (step, the step's vote
        # output).
        self._pending: collections.deque[tuple[int, jax.Array]] = collections.deque()
        self._vote_inputs: dict[tuple[NamedSharding, int], jax.Array] = {}

    @property
    def signal_name(self) -> str | None:
        return None if self.signal_number is None else signal.Signals(self.signal_number).name

    def __enter__(self) -> Self:
        if threading.current_thread() is not threading.main_thread():
            logging.warning("Training runs outside the main thread: SIGTERM/SIGINT keep their "
                            "default behaviour (no checkpoint on preemption)")
            return self
        for number in STOP_SIGNALS:
            self._previous[number] = signal.signal(number, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _on_signal(self, number: int, frame) -> None:
        name = signal.Signals(number).name
        if (
            self.signal_number is not None
            and time.monotonic() - self._first_at < DUPLICATE_WINDOW_S
        ):
            # the same request, delivered twice (to the process group and forwarded by a script)
            return
        if self.signal_number is not None:
            sys.stderr.write(f"paxlite: second stop signal ({name}): exiting at once; the last "
                             "committed checkpoint is kept as it is\n")
            sys.stderr.flush()
            os._exit(128 + number)
        self.signal_number, self._first_at = number, time.monotonic()
        logging.warning("%s received: stopping after the current step, with a checkpoint (a second "
                        "signal exits at once)", name)

    def votes(self, sharding: NamedSharding) -> jax.Array:
        """This process's flag on each of its devices: the vote input of the next train step, int32
        [devices] laid out by `sharding` (one element per device). Made once per flag value and
        reused, so a step's vote costs no transfer."""
        flag = int(self.signal_number is not None)
        key = (sharding, flag)
        if key not in self._vote_inputs:
            size = sharding.mesh.devices.size
            self._vote_inputs[key] = jax.make_array_from_callback(
                (size,),
                sharding,
                lambda index: np.full((len(range(size)[index[0]]),), flag, np.int32),
            )
        return self._vote_inputs[key]

    def should_stop(
        self, step: int, *, vote: jax.Array | None = None, synced: bool = False
    ) -> bool:
        """Whether to stop after `step`: every process gets the same answer for the same step.

        Voting, `vote` is the step's agreed maximum (the train step's output) and `synced` says that
        the loop waits for this step anyway (so its own vote is read now); else the vote of the step
        `lag` back is read, which the loop has already waited for."""
        if not self.voting:
            return self.signal_number is not None
        if vote is None:
            raise ValueError("a voting Preemption needs each step's vote (the train step's output)")
        self._pending.append((step, vote))
        if synced:
            _, newest = self._pending.pop()
            self._pending.clear()
            return bool(newest)
        if len(self._pending) <= self._lag:
            return False
        _, oldest = self._pending.popleft()
        return bool(oldest)
