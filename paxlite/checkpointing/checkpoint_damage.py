"""Whether a checkpoint that failed to restore is damaged, or only unreadable now.

Apart from the checkpointer (checkpoint.py) because this judgement decides what happens to a
user's files, and other readers make it too (pretrained.py): a *damaged* checkpoint (no commit
marker, garbled metadata, missing or truncated array files, failed integrity checks) may be walked
past and set aside, while any other failure (permissions, a transient I/O error) must stop the run
and move nothing. With several processes each one classifies its own failure and the worst outcome
over all of them decides, so every process restores the same step or stops.
"""

from __future__ import annotations

import enum
import json

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from paxlite.errors import UserError

_COMMIT_MARKER = "commit_success.txt"  # written by Orbax when a save is finalised
_STEP_METADATA = "_CHECKPOINT_METADATA"
# TensorStore status codes that mean "the bytes are not there or not what was written".
_DAMAGE_CODES = ("NOT_FOUND", "OUT_OF_RANGE", "DATA_LOSS")


# The on-disk format paxlite writes (the step metadata's custom_metadata), so that a later paxlite
# that changes it can be told from this one: a checkpoint of a newer format is refused in one line
# rather than misread. Checkpoints without the key predate it and are format 1.
FORMAT_KEY = "paxlite_checkpoint_format"
FORMAT_VERSION = 1


class CheckpointDamagedError(RuntimeError):
    """A checkpoint's files are incomplete or unreadable as written (it may be set aside)."""


class CheckpointFormatError(UserError, ValueError):
    """A checkpoint written in a newer paxlite format than this one reads."""


def newer_format(step_dir: epath.Path) -> str | None:
    """Why this paxlite must not read `step_dir` (a format newer than FORMAT_VERSION), or None.
    Unreadable metadata is left to `incomplete` and the restore to judge."""
    try:
        metadata = json.loads((step_dir / _STEP_METADATA).read_text())
    except (FileNotFoundError, ValueError):
        return None
    custom = metadata.get("custom_metadata") if isinstance(metadata, dict) else None
    version = custom.get(FORMAT_KEY, 1) if isinstance(custom, dict) else 1
    if isinstance(version, int) and not isinstance(version, bool) and version <= FORMAT_VERSION:
        return None
    return (f"{step_dir} was written in paxlite checkpoint format {version!r}, and this paxlite "
            f"reads format {FORMAT_VERSION} and older: read it with the paxlite that wrote it (its "
            "job's config.json names the version), or point at another checkpoint")


def incomplete(step_dir: epath.Path) -> str | None:
    """Why `step_dir` is not a finished checkpoint, or None.

    Finished: a commit marker, or (checkpoints of Orbax versions without one) step metadata with
    a commit time. FileNotFoundError counts as "missing"; any other OSError propagates.
    """
    if (step_dir / _COMMIT_MARKER).exists():
        return None
    try:
        metadata = json.loads((step_dir / _STEP_METADATA).read_text())
    except FileNotFoundError:
        return f"no {_COMMIT_MARKER} and no {_STEP_METADATA}: the save or copy did not finish"
    except ValueError as error:
        return f"{_STEP_METADATA} is not valid JSON ({error})"
    if not isinstance(metadata, dict) or not metadata.get("commit_timestamp_nsecs"):
        return f"no {_COMMIT_MARKER} and no commit time in {_STEP_METADATA}: not finished"
    return None


def passes_first_look(step_dir: epath.Path, *, item: str) -> bool:
    """What a restore checks before it reads any array: the step is finished, in a format this
    paxlite reads, and its `item`'s metadata parses. False for a step a restore would walk past or
    refuse; damage only the arrays show is left to the restore."""
    import orbax.checkpoint as ocp

    if incomplete(step_dir) is not None or newer_format(step_dir) is not None:
        return False
    handler = ocp.StandardCheckpointHandler()
    try:
        handler.metadata(step_dir / item)
    except Exception:  # noqa: BLE001  TensorStore and Orbax raise bare Exception for bad files
        return False
    finally:
        handler.close()
    return True


def _causes(error: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    while error is not None and error not in chain and len(chain) < 10:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def is_damage(error: BaseException) -> bool:
    """Whether `error` proves the checkpoint's bytes are missing or wrong (not merely unreadable
    now).

    Damage: a missing file, garbled JSON metadata, TensorStore's NOT_FOUND / OUT_OF_RANGE (a
    truncated file) / DATA_LOSS (failed checksum), or our own integrity check. Not damage: any other
    OSError (permissions, EIO, a stale network mount), other TensorStore codes, and anything
    unknown.
    """
    chain = _causes(error)
    if any(isinstance(e, OSError) and not isinstance(e, FileNotFoundError) for e in chain):
        return False
    for e in chain:
        if isinstance(e, (CheckpointDamagedError, FileNotFoundError, json.JSONDecodeError)):
            return True
        text = str(e).lstrip()
        if any(text.startswith(f"{code}:") for code in _DAMAGE_CODES):
            return True
    return False


class Outcome(enum.IntEnum):
    """One process's result for one step; the worst over processes decides (all agree)."""

    RESTORED = 0
    DAMAGED = 1
    FATAL = 2


def short_error(error: BaseException) -> str:
    """First line of an error, capped: TensorStore errors embed a page-long spec."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = f"{type(error).__name__}: {first_line}"
    return text if len(text) <= 400 else text[:400] + "..."


def worst_over_processes(outcome: Outcome) -> Outcome:
    """The worst outcome over all processes, so every process restores the same step or stops."""
    if jax.process_count() == 1:
        return outcome
    codes = multihost_utils.process_allgather(np.array(int(outcome), dtype=np.int32))
    return Outcome(int(np.max(codes)))


def move_aside(path: epath.Path, *, directory: epath.Path) -> epath.Path:
    """Renames `path` into `<directory>_corrupted/`, adding .1, .2, ... on a name clash."""
    target_dir = directory.parent / f"{directory.name}_corrupted"
    target_dir.mkdir(parents=True, exist_ok=True)
    target = target_dir / path.name
    suffix = 0
    while target.exists():
        suffix += 1
        target = target_dir / f"{path.name}.{suffix}"
    path.rename(target)
    return target
