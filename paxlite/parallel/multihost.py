"""Small multi-process helpers built on JAX's own runtime (no extra RPC layer)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from paxlite.errors import RunStoppedError


class ProcessZeroError(RunStoppedError, RuntimeError):
    """Process 0 could not make a decision the other processes were waiting for."""


def allgather_json(value: Any) -> list[Any]:
    """Every process's JSON-serialisable `value`, indexed by process; one process: [value]."""
    if jax.process_count() == 1:
        return [json.loads(json.dumps(value))]
    payload = np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.array([payload.size], np.int64)))
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: payload.size] = payload
    gathered = np.asarray(multihost_utils.process_allgather(padded))
    return [
        json.loads(bytes(row[: int(n)]).decode())
        for row, n in zip(gathered.reshape(len(lengths), -1), lengths.reshape(-1))
    ]


def processes_where(flag: bool) -> list[int]:
    """The indices of the processes whose `flag` is true, on every process (one collective)."""
    if jax.process_count() == 1:
        return [0] if flag else []
    flags = multihost_utils.process_allgather(np.array(int(flag), dtype=np.int32))
    return [int(i) for i in np.flatnonzero(np.asarray(flags).reshape(-1))]


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= 400 else text[:400] + "..."


def decided_by_process_0(decide: Callable[[], Any], *, what: str) -> Any:
    """`decide()`'s JSON-serialisable result, computed on process 0 alone and given to all.

    Why: a question about shared storage (which checkpoints exist, whether one is finished) can get
    a different answer on each host (NFS attribute caching, a rename in flight). Hosts that act on
    their own answers make different numbers of collectives (a hang) or different choices; with this
    they act on one answer. The other processes never call `decide`, and every process makes the
    same two collectives (the answer's length, then the answer) whatever the answer is.

    If `decide` raises on process 0, the others are told and raise ProcessZeroError naming `what`
    and the error, and process 0 raises the error itself: no process is left waiting.
    One process: `decide()` (through JSON, as the others would see it), no collective.
    """
    if jax.process_count() == 1:
        return json.loads(json.dumps(decide()))
    failure: Exception | None = None
    if jax.process_index() == 0:
        try:
            message = json.dumps({"value": decide()})
        except Exception as error:  # noqa: BLE001 - passed on to every process, re-raised below
            failure = error
            message = json.dumps({"error": _first_line(error)})
        encoded = message.encode()
        length = np.array([len(encoded)], np.int32)
    else:
        length = np.zeros(1, np.int32)
    size = int(np.asarray(multihost_utils.broadcast_one_to_all(length))[0])
    # Padded to a power of two, so that answers of similar lengths share one compiled broadcast.
    payload = np.zeros(max(64, 1 << (size - 1).bit_length()), np.uint8)
    if jax.process_index() == 0:
        payload[:size] = np.frombuffer(encoded, dtype=np.uint8)
    received = np.asarray(multihost_utils.broadcast_one_to_all(payload))[:size]
    received = json.loads(received.tobytes().decode())
    if failure is not None:
        raise failure
    if "error" in received:
        raise ProcessZeroError(f"process 0 could not {what} ({received['error']}); see its log")
    return received["value"]
