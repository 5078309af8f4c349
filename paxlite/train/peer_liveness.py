"""A process of the run that dies or freezes: every survivor stops by itself, with one line.

Why not JAX's own heartbeats alone: its coordination service notices a silent process only at its
heartbeat timeout, and then ends every other process with SIGABRT and a page of C++ and Python
stacks that name no step and no checkpoint; its error callback cannot be replaced from Python
(jaxlib cannot hand the error to a Python function). Before that, on CPU a collective whose peer
was killed fails at once in the main thread (gloo: "Connection reset by peer"), and on GPU it waits
forever. None of it tells the user which host was lost or what to do next.

So the service's key-value store carries signs of life. Every process writes a counter under
`ALIVE_KEY + index` every `poll_s` seconds. Process 0, which holds the service, reads them all, and
when one has not changed for `timeout_s` (PAXLITE_HEARTBEAT_TIMEOUT_S) it publishes the loss as the
run's fault (train/peer_faults.py): every live process prints the same line and exits with status
75, a temporary failure that the launchers rerun. Every other process times its own round trips to
the store: when none has succeeded for `timeout_s`, process 0 itself is lost (frozen, or its host
cut off), and the process stops with a line that says so. JAX's own heartbeat timeout is set above
paxlite's (parallel/distributed.py), so that its abort comes only where this watcher cannot run.

What no watcher can outrun: when process 0 is killed outright, the runtime's error polling in the
other processes fails within milliseconds and ends them (status 134) before any Python runs
(docs/troubleshooting.md).
"""

from __future__ import annotations

import dataclasses
import enum
import logging as logging_std
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from absl import logging

from paxlite.errors import PeerLostError

ALIVE_KEY = "paxlite/alive/"  # + the process index: a counter, rewritten every poll
HOST_KEY = "paxlite/host/"  # + the process index: its host name, written once
FINISHED = "finished"  # a process's last sign: it ended its work, and will say no more
POLL_S = 1.0
_CHECKPOINT_NAME = re.compile(r"checkpoint_(\d+)")


# What a failed collective or coordination call says when its peer is gone: gloo (CPU) and NCCL
# errors, gRPC's words for a closed or silent connection.
_LOST_PEER_WORDS = ("Gloo", "NCCL", "Connection reset", "Connection refused", "Broken pipe",
                    "Socket closed", "UNAVAILABLE", "DEADLINE_EXCEEDED")


def may_be_a_lost_peer(error: BaseException) -> bool:
    """Whether `error` is what a collective or a coordination call raises when a process of the run
    died: worth waiting for the verdict before reporting it as a bug."""
    text = f"{type(error).__name__}: {error}"
    return any(word in text for word in _LOST_PEER_WORDS)


class LostPeerTracebacks(logging_std.Filter):
    """On the job log's handler while the processes are watched: a library's logged error about a
    failed collective (Orbax's save thread logs its own, traceback and all) keeps its line but not
    its traceback, since the verdict's line follows within the heartbeat timeout. Any other record,
    and any other traceback, passes as it is."""

    def filter(self, record: logging_std.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and may_be_a_lost_peer(
                record.exc_info[1]):
            record.msg = f"{record.msg} (traceback left out: a lost process would explain it)"
            record.exc_info, record.exc_text = None, None
        return True


class Activity(enum.Enum):
    """What the run was doing when a peer was lost (said in the line)."""

    BUILDING = "being built (reading its data and checkpoint, compiling its steps)"
    TRAINING = "training"
    EVALUATING = "evaluating"
    SAVING = "saving a checkpoint"
    FINISHING = "waiting for its last checkpoint to commit"


@dataclasses.dataclass
class RunProgress:
    """Where the run is: written by the loop's thread, read by the watcher's when a peer is lost
    (single attribute writes: no lock is needed for a line)."""

    job_dir: str | None = None
    step: int | None = None  # the newest step the loop dispatched
    activity: Activity = Activity.BUILDING

    def describe(self) -> str:
        """'training (step 26)': what the run was doing when the peer was lost."""
        return self.activity.value + ("" if self.step is None else f" (step {self.step})")

    def newest_checkpoint(self) -> str:
        """What the last complete checkpoint is, read from the job directory: Orbax gives a step
        its final name only once every process has written it."""
        if self.job_dir is None:
            return "this command saves no checkpoint"
        directory = os.path.join(self.job_dir, "checkpoints")
        try:
            steps = [int(m.group(1)) for name in os.listdir(directory)
                     if (m := _CHECKPOINT_NAME.fullmatch(name))]
        except OSError:
            steps = []
        if not steps:
            return (f"there is no complete checkpoint in {directory} yet: the same command starts "
                    "again from the beginning")
        return (f"the last complete checkpoint is step {max(steps)} in {directory}: run the same "
                "command again to resume from it")


def lost_line(*, lost: list[int], hosts: dict[int, str], count: int, silent_s: float,
              progress: RunProgress) -> str:
    """The one line every survivor prints when processes `lost` went silent."""
    names = []
    for index in lost:
        where = [hosts[index]] if index in hosts else []
        where += ["the coordinator"] if index == 0 else []
        names.append(f"process {index}" + (f" ({', '.join(where)})" if where else ""))
    return (f"{' and '.join(names)} of {count} gave no sign of life for {silent_s:.0f} s "
            "(PAXLITE_HEARTBEAT_TIMEOUT_S): killed, out of memory, preempted or frozen, while "
            f"this run was {progress.describe()}; {progress.newest_checkpoint()}")


class PeerLiveness:
    """Signs of life in the store, and the judge of them (see the module's doc)."""

    def __init__(self, *, client: Any, index: int, count: int, timeout_s: float,
                 progress: RunProgress, on_lost: Callable[[PeerLostError, list[int]], None],
                 end_alone: Callable[[PeerLostError], None], poll_s: float = POLL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client, self._index, self._count = client, index, count
        self._timeout_s, self._poll_s, self._clock = timeout_s, poll_s, clock
        self._progress = progress
        self._on_lost, self._end_alone = on_lost, end_alone
        self._stop = threading.Event()
        self._hosts: dict[int, str] = {}  # process 0's, once read (the other processes')
        self._last_ok = clock()  # this process's newest good round trip to the store
        self._seen: dict[int, tuple[str | None, float]] = {}  # index -> (counter, when it changed)

    def start(self) -> None:
        self._client.key_value_set(f"{HOST_KEY}{self._index}", socket.gethostname(),
                                   allow_overwrite=True)
        threading.Thread(target=self._beat, name="paxlite-peer-liveness", daemon=True).start()
        if self._index != 0:
            threading.Thread(target=self._read_coordinator_host, name="paxlite-coordinator-host",
                             daemon=True).start()
            threading.Thread(target=self._watch_coordinator, name="paxlite-coordinator-deadline",
                             daemon=True).start()

    def _read_coordinator_host(self) -> None:
        """Process 0's host name, read while it can be: once it is lost, it cannot."""
        try:
            self._hosts[0] = self._client.blocking_key_value_get(f"{HOST_KEY}0", 300_000)
        except Exception:  # noqa: BLE001  never written: the line names the index alone
            return

    def stop(self, *, finished: bool) -> None:
        """No more signs of life from here; `finished`: this process ended its work without an
        error, which process 0 must not take for a loss while the others finish theirs."""
        self._stop.set()
        if finished:
            try:
                self._client.key_value_set(f"{ALIVE_KEY}{self._index}", FINISHED,
                                           allow_overwrite=True)
            except Exception as e:  # noqa: BLE001  the service ended with process 0: nothing to tell
                logging.info("Could not mark process %d finished: %s", self._index, e)

    def _beat(self) -> None:
        beats = 0
        while not self._stop.is_set():
            beats += 1
            try:
                self._client.key_value_set(f"{ALIVE_KEY}{self._index}", str(beats),
                                           allow_overwrite=True)
                if self._index == 0:
                    self._judge(dict(self._client.key_value_dir_get(ALIVE_KEY)))
                self._last_ok = self._clock()
            except Exception as e:  # noqa: BLE001  the store is unreachable: timed by the deadline
                logging.log_every_n_seconds(logging.WARNING, "No answer from process 0's "
                                            "coordination service: %s", 10, e)
            self._stop.wait(self._poll_s)

    def _judge(self, counters: dict[str, str]) -> None:
        """On process 0: which processes' counters stood still for the timeout."""
        now = self._clock()
        lost, silent = [], 0.0
        for index in range(self._count):
            counter = counters.get(f"{ALIVE_KEY}{index}")
            if counter == FINISHED:
                continue
            previous, since = self._seen.get(index, (None, now))
            if counter != previous or index not in self._seen:
                self._seen[index] = (counter, now)
            elif now - since >= self._timeout_s and index != self._index:
                lost.append(index)
                silent = max(silent, now - since)
        if lost:
            self._stop.set()
            hosts = {}
            for index in lost:
                try:
                    hosts[index] = self._client.key_value_try_get(f"{HOST_KEY}{index}")
                except Exception:  # noqa: BLE001, S112  it died before it said its host name
                    continue
            self._on_lost(PeerLostError(lost_line(
                lost=lost, hosts=hosts, count=self._count, silent_s=silent,
                progress=self._progress)), lost)

    def _watch_coordinator(self) -> None:
        """On the other processes: no round trip to the store for the timeout is a lost process 0.
        A thread of its own, as the beat's call may never return (a frozen coordinator)."""
        while not self._stop.wait(self._poll_s):
            silent = self._clock() - self._last_ok
            if silent >= self._timeout_s:
                self._end_alone(PeerLostError(lost_line(
                    lost=[0], hosts=dict(self._hosts), count=self._count, silent_s=silent,
                    progress=self._progress)))
                return
