"""One process's fault stops every process of a run, each with the same line and exit status.

Why: in a run of several processes a fault may reach one of them only (its disk is full, its input
file vanished), and the others then wait for it in a collective or an Orbax barrier. A checkpoint
save refused on one process leaves the two sides waiting at different Orbax barriers until Orbax's
own timeout, 20 minutes later (docs/troubleshooting.md). So the process that meets the fault
publishes its one line and exit status in the key-value store of JAX's distributed runtime, and a
thread in every process (the publisher too) watches that key: whatever the main thread is waiting
for, the watcher prints the line as `paxlite: error: ...` and ends the process with the status.

Order of the ends: process 0 holds the coordination service, so it ends last: every other process
marks that it has seen the fault, then exits; process 0 waits for those marks (at most
`GRACE_S`), then exits. The end skips Python's clean-up (`os._exit`): a main thread blocked in a
barrier cannot be unwound. What a run saved before is untouched; a save in flight stays under
Orbax's temporary name, which the next start ignores; metrics.jsonl is flushed line by line, while
TensorBoard's last queued events may be lost.

The command's entry point (cli/job.py) starts the watcher before the run is built, so a fault met
while building it (its data opened, its checkpoint read, the job's config written) or while
evaluating (--mode=eval) is told the same way; a mistake only one process can see (an input file
its disk lacks) is a one-line fault too, with its status 2. A bug keeps its traceback and is not
told.

A process that cannot tell anything, because it died or froze, is found by the others' watcher of
signs of life (train/peer_liveness.py), which publishes its loss here as a fault of the run. A
collective that failed in the main thread because of it (gloo's "Connection reset by peer" on CPU)
waits for that verdict (`await_lost_peer`) instead of ending in a traceback.

One process has nothing to tell: there `PeerFaults` does nothing and faults are raised as usual.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Self

import jax
from absl import logging

from paxlite.compat import distributed_client
from paxlite.errors import (
    STORAGE_FAULT_EXIT_STATUS,
    USER_ERROR_EXIT_STATUS,
    PeerLostError,
    RunStoppedError,
    StorageFaultError,
    UserError,
    exit_status,
    line_status,
)
from paxlite.parallel.distributed import timeouts_from_env
from paxlite.train.peer_liveness import (
    LostPeerTracebacks,
    PeerLiveness,
    RunProgress,
    may_be_a_lost_peer,
)

# What a process reports in one line: a stopped run, or a mistake only it found (a file its own
# disk lacks). Anything else is a bug, which ends its process with its traceback.
OneLineError = UserError | RunStoppedError


def fault_record(error: OneLineError, *, lost: Sequence[int] = ()) -> dict[str, Any]:
    """What a process publishes of its fault: its index, the line, the exit status and the
    processes lost (which will never mark that they saw it)."""
    return {"process": jax.process_index(), "status": line_status(error), "line": str(error),
            "lost": list(lost)}


def error_of(record: dict[str, Any]) -> OneLineError:
    """The published fault as an error that every process reports with its line and status."""
    if record.get("lost"):
        return PeerLostError(record["line"])
    kind = {STORAGE_FAULT_EXIT_STATUS: StorageFaultError,
            USER_ERROR_EXIT_STATUS: UserError}.get(record["status"], RunStoppedError)
    return kind(record["line"])


FAULT_KEY = "paxlite/run_fault"
SEEN_KEY = "paxlite/run_fault_seen/"  # + the process index
POLL_S = 0.2
GRACE_S = 10.0  # process 0's wait for the others' marks
PUBLISHER_WAIT_S = 60.0  # the publisher's main thread waits this long for its watcher
VERDICT_MARGIN_S = 30.0  # beyond the heartbeat timeout, a failed collective's wait for the verdict


class PeerFaults:
    """The watcher of one run's processes (a context manager; nothing with one process)."""

    def __init__(self, *, poll_s: float = POLL_S, job_dir: str | None = None,
                 liveness_poll_s: float | None = None) -> None:
        self._client = distributed_client() if jax.process_count() > 1 else None
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._published = threading.Lock()
        # where the run is, for the line of a lost peer (the loop writes it)
        self.progress = RunProgress(job_dir=job_dir)
        self._timeout_s = float(timeouts_from_env(os.environ).heartbeat_s)
        self._tracebacks = LostPeerTracebacks()
        self._liveness = None if self._client is None else PeerLiveness(
            client=self._client, index=jax.process_index(), count=jax.process_count(),
            timeout_s=self._timeout_s, progress=self.progress, on_lost=self._publish_lost,
            end_alone=self._end_alone,
            **({} if liveness_poll_s is None else {"poll_s": liveness_poll_s}))

    @property
    def active(self) -> bool:
        return self._client is not None

    def __enter__(self) -> Self:
        if self.active:
            threading.Thread(target=self._watch, name="paxlite-peer-faults", daemon=True).start()
            self._liveness.start()
            logging.get_absl_handler().addFilter(self._tracebacks)
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self._stop.set()
        if self._liveness is not None:
            self._liveness.stop(finished=kind is None)
            logging.get_absl_handler().removeFilter(self._tracebacks)

    def publish(self, error: OneLineError, *, lost: Sequence[int] = ()) -> None:
        """Tell every process of the run to stop with `error`'s line (the first fault wins)."""
        if not self.active or not self._published.acquire(blocking=False):
            return
        value = json.dumps(fault_record(error, lost=lost))
        try:
            self._client.key_value_set(FAULT_KEY, value)
        except Exception as e:  # noqa: BLE001  another process's fault was published first
            logging.info("A fault of another process was published first (%s)", e)

    def stop_every_process(self, error: OneLineError) -> None:
        """`publish`, then wait for the watcher to end this process; returns (the caller raises
        `error` as usual) only with one process, or if the watcher did not end it in time."""
        if not self.active:
            return
        self.publish(error)
        time.sleep(PUBLISHER_WAIT_S)

    def await_lost_peer(self, error: BaseException) -> None:
        """The main thread's `error` (not a one-line fault) may come from a peer that was lost: a
        collective with a killed process fails at once on CPU. If it reads like one, wait for the
        watchers' verdict, which ends this process with its line; returns (the caller raises
        `error`) if none came within the heartbeat timeout and a margin, or at once for any other
        error (a bug's traceback is not held back)."""
        if not self.active or not may_be_a_lost_peer(error):
            return
        logging.warning("%s: %s; waiting up to %.0f s (PAXLITE_HEARTBEAT_TIMEOUT_S and a margin) "
                        "to learn whether another process of the run was lost",
                        type(error).__name__, str(error).splitlines()[0] if str(error) else "",
                        self._timeout_s + VERDICT_MARGIN_S)
        time.sleep(self._timeout_s + VERDICT_MARGIN_S)

    def _publish_lost(self, error: PeerLostError, lost: list[int]) -> None:
        logging.error("%s", error)
        self.publish(error, lost=lost)

    def _end_alone(self, error: PeerLostError) -> None:
        """Process 0 is lost: nothing can be published; this process prints the line and ends."""
        status = exit_status(error)
        logging.flush()
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(status)

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                value = self._client.key_value_try_get(FAULT_KEY)
            except Exception:  # noqa: BLE001, S112  NOT_FOUND until a fault is published
                continue
            self._end(json.loads(value))

    def _end(self, fault: dict[str, Any]) -> None:
        me = jax.process_index()
        logging.info("Process %d stopped the run:", fault["process"])
        # the line and the status, as every entry point prints and picks them
        status = exit_status(error_of(fault))
        sys.stderr.flush()
        try:
            self._client.key_value_set(f"{SEEN_KEY}{me}", "1")
            if me == 0:
                deadline = time.monotonic() + GRACE_S
                expected = jax.process_count() - len(fault.get("lost", ()))
                while (len(self._client.key_value_dir_get(SEEN_KEY)) < expected
                       and time.monotonic() < deadline):
                    time.sleep(self._poll_s)
        finally:
            logging.flush()
            sys.stdout.flush()
            os._exit(status)
