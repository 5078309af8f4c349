"""Stopping on SIGTERM/SIGINT without losing a step: finish it, checkpoint it, exit.

Schedulers preempt by signalling (Slurm, Kubernetes, a user's Ctrl-C) and killing a grace period later. The
first signal asks the loop to stop after the step in flight; the loop then writes a checkpoint of that step,
waits for it to commit and returns, so the next run resumes exactly there. A second signal means "now": the
process exits at once with 128 + the signal's number, as a process killed by it would report (a second
copy of the first signal within DUPLICATE_WINDOW_S is not a second request). That cannot
damage the last committed checkpoint: a save in flight is written under Orbax's temporary name and renamed only
when complete (train/checkpoint.py), so an interrupted one is never mistaken for a step.

Several processes must stop at the same step (each saves its part of the one checkpoint), yet the signal may
reach one of them only (a drained node). Each step, every process contributes its own flag to a tiny global
maximum on the devices; the loop decides on the flag of the step `lag` steps back, which the loop already waits
for (it never runs more than `lag` steps ahead), so the decision costs no extra wait and every process reads the
same value, for the same step. One process decides on its own flag at once.
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
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Signals this soon after the first are the same request arriving twice: Slurm and a terminal signal every
# process of the job, and the run_*.sh scripts forward what they receive to paxlite, so one preemption
# can reach the process twice within milliseconds. A person's second Ctrl-C comes later than this.
DUPLICATE_WINDOW_S = 1.0


class Preemption:
    """Signal handlers for one training loop, and the agreed decision to stop (a context manager)."""

    def __init__(self, *, lag: int):
        self._lag = lag
        self.signal_number: int | None = None  # the first stop signal received
        self._first_at = 0.0
        self._previous: dict[int, object] = {}
        self._votes: collections.deque[tuple[int, jax.Array]] = collections.deque()
        self._multiprocess = jax.process_count() > 1
        if self._multiprocess:
            devices = np.array(jax.devices())
            flags_sharding = NamedSharding(Mesh(devices, ("all",)), PartitionSpec("all"))
            self._flags_sharding = flags_sharding
            self._num_local = len(jax.local_devices())
            self._any = jax.jit(jnp.max, out_shardings=NamedSharding(flags_sharding.mesh, PartitionSpec()))

    @property
    def signal_name(self) -> str | None:
        return None if self.signal_number is None else signal.Signals(self.signal_number).name

    def __enter__(self) -> Self:
        if threading.current_thread() is not threading.main_thread():
            logging.warning("Training runs outside the main thread: SIGTERM/SIGINT keep their default "
                            "behaviour (no checkpoint on preemption)")
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
        if self.signal_number is not None and time.monotonic() - self._first_at < DUPLICATE_WINDOW_S:
            return  # the same request, delivered twice (to the process group and forwarded by a script)
        if self.signal_number is not None:
            sys.stderr.write(f"paxlite: second stop signal ({name}): exiting at once; the last committed "
                             "checkpoint is kept as it is\n")
            sys.stderr.flush()
            os._exit(128 + number)
        self.signal_number, self._first_at = number, time.monotonic()
        logging.warning("%s received: stopping after the current step, with a checkpoint (a second signal "
                        "exits at once)", name)

    def should_stop(self, step: int) -> bool:
        """Whether to stop after `step` (every process gets the same answer for the same step)."""
        requested = self.signal_number is not None
        if not self._multiprocess:
            return requested
        local = np.full((self._num_local,), int(requested), np.int32)
        flags = jax.make_array_from_process_local_data(self._flags_sharding, local,
                                                       (self._flags_sharding.mesh.size,))
        self._votes.append((step, self._any(flags)))
        if len(self._votes) <= self._lag:
            return False
        _, vote = self._votes.popleft()
        return bool(vote)
