"""Local paths only, and outputs that a killed writer cannot leave half-written in place.

Every path a user gives paxlite (hyperparameters such as DATA_DIR or CHECKPOINT_RESTORE_PATH,
`--job_log_dir`, the `--input`/`--output` of `convert`, `export_merged` and `prepare`) goes through
`require_local_path`. The readers and writers use `os.path`, which would turn `gs://bucket/x` into
the relative directory `./gs:/bucket/x` and write there; so an object-store URL is refused by name,
before any device work, rather than half-working. Mounted buckets (gcsfuse, s3fs) are local paths.

`check_output_dir` and `staged_output` are the one way a command writes a directory that holds a
model: every precondition is checked before the input is read, the files are written into
`<output>.partial` and renamed into place at the end, so an interrupted run leaves a directory a
rerun recognises (by its marker file) and replaces, never one that blocks it.

The bottom layer: the standard library only, so that data/, train/, interop/ and the commands can
all use it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from collections.abc import Iterator, Sequence

from paxlite.errors import UserError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
PARTIAL_SUFFIX = ".partial"
# Written first into every staging directory: only a directory holding it is ever deleted by a
# rerun.
PARTIAL_MARKER = ".paxlite-partial"

_log = logging.getLogger(__name__)


class UnsupportedPathError(UserError, ValueError):
    """A path paxlite cannot use as given (an object-store URL such as gs://...)."""


class OutputPathError(UserError, ValueError):
    """An output directory that cannot be written as asked (its parent is not writable, it is the
    input, or it is a file)."""


class OutputExistsError(OutputPathError, FileExistsError):
    """An output directory that already holds files: nothing a user saved is overwritten."""


def require_local_path(value: str | os.PathLike, *, setting: str) -> str:
    """`value` as a string, or UnsupportedPathError naming `setting` when it is a `scheme://`
    URL."""
    text = os.fspath(value)
    match = _SCHEME.match(text)
    if match:
        raise UnsupportedPathError(
            f"{setting}={text!r}: {match.group(1)}:// paths are not supported; paxlite reads and "
            "writes local or mounted paths only (copy the data locally, or mount the bucket, e.g. "
            "with gcsfuse, and pass the mount's path)"
        )
    return text


def partial_dir(output: str | os.PathLike) -> str:
    """Where `staged_output` writes before renaming: the output's sibling `<output>.partial`."""
    return os.path.abspath(os.fspath(output)).rstrip(os.sep) + PARTIAL_SUFFIX


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


NOT_EMPTY = "exists and is not empty"
NOT_A_DIRECTORY = "exists and is not a directory"


def output_dir_problem(path: str) -> str | None:
    """Why `path` cannot be written as a new output directory (NOT_A_DIRECTORY, NOT_EMPTY), or
    None when it does not exist or is an empty directory: nothing a user saved is overwritten."""
    if not os.path.exists(path):
        return None
    if not os.path.isdir(path):
        return NOT_A_DIRECTORY
    return NOT_EMPTY if os.listdir(path) else None


def check_output_dir(
    output: str | os.PathLike, *, setting: str, inputs: Sequence[str | os.PathLike] = ()
) -> str:
    """Checks, before anything is read, that `output` can be written; returns its absolute path.

    Refused: a URL, an existing file, a non-empty directory, the input itself (or a directory
    holding it), a staging directory that paxlite did not make, and an unwritable parent.
    """
    path = os.path.abspath(require_local_path(output, setting=setting))
    for given in inputs:
        source = os.path.realpath(os.path.abspath(os.fspath(given)))
        if _inside(source, os.path.realpath(path)):
            raise OutputPathError(
                f"{setting}={os.fspath(output)!r} is (or holds) the input {os.fspath(given)!r}; "
                "write to a new directory")
    if problem := output_dir_problem(path):
        error = OutputExistsError if problem == NOT_EMPTY else OutputPathError
        raise error(f"{setting}={path!r} {problem}" + (
            "; refusing to overwrite it (choose a new or empty directory)"
            if problem == NOT_EMPTY else ""))
    staging = partial_dir(path)
    if os.path.exists(staging) and not os.path.exists(os.path.join(staging, PARTIAL_MARKER)):
        raise OutputExistsError(
            f"{staging!r} exists and was not written by paxlite (no {PARTIAL_MARKER} in it); "
            f"it would be the staging directory of {setting}={path!r}: move it away, or choose "
            "another output")
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"{setting}={path!r}: cannot create it, {parent!r} is not writable")
    return path


@contextlib.contextmanager
def staged_output(output: str | os.PathLike, *, setting: str) -> Iterator[str]:
    """Yields `<output>.partial` to write into; renames it to `output` when the block succeeds.

    A staging directory left by a killed run (it holds the marker) is removed first, with a log
    line; one without the marker is refused. An exception inside the block removes the staging
    directory again, so only a killed process ever leaves one behind.
    """
    path = check_output_dir(output, setting=setting)
    staging = partial_dir(path)
    if os.path.exists(staging):
        _log.warning("Removing %s, left by an interrupted run writing %s", staging, path)
        shutil.rmtree(staging)
    os.makedirs(staging)
    with open(os.path.join(staging, PARTIAL_MARKER), "w") as f:
        f.write(f"incomplete output for {path}; a rerun replaces this directory\n")
    try:
        yield staging
        os.remove(os.path.join(staging, PARTIAL_MARKER))
        if os.path.isdir(path):
            os.rmdir(path)  # empty (checked above); rename cannot replace a directory otherwise
        os.replace(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
