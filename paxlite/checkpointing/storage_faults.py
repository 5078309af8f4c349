"""Storage that refuses a write or a read: which failures are the disk's, and keeping Orbax quiet
about them.

A full disk, a quota, a file-size limit, a read-only or unmounted filesystem, lost permissions or
a job directory removed under a running job are not bugs: the user frees space or fixes the mount
and runs the same command again. So they are recognised here, from Python's OSError or from the
`[os_error_code='N']` TensorStore puts in its messages, and reported in one line naming the path,
the OS's words and, where TensorStore says it, the bytes it was writing. An input file that
vanishes under a running job (a removed shard, an unmounted data filesystem) is the same kind of
fault, read instead of written: `unreadable_input` names the file and the step.

Orbax reports such a failure several times before it reaches the thread that waits for the save:
each of its worker threads logs it with a traceback, the write callbacks still in flight raise
"Event loop is closed" into the event loop Orbax already closed, and the abandoned write coroutines
raise again when the interpreter destroys them at exit (often "sys.meta_path is None").
`QuietStorageFaults` drops exactly those echoes of a storage fault (and asyncio's "Task exception
was never retrieved" for Orbax's failed write task) from when a checkpointer opens to the end of
the process once a fault was seen (echoes come until then); any other error of Orbax's, and
anything after an unknown error, is shown as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import logging
import os
import re
import shutil
import sys
import threading
import time
import traceback
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Self

from paxlite import compat
from paxlite.errors import StorageFaultError

# What the user can do about each errno that storage answers with.
_REMEDIES = types.MappingProxyType({
    errno.ENOSPC: "free space on that filesystem",
    errno.EDQUOT: "free space or raise the disk quota",
    errno.EFBIG: "raise the file-size limit (ulimit -f) or free space",
    errno.EROFS: "remount the filesystem read-write",
    errno.EACCES: "make the directory writable for this user again",
    errno.EPERM: "make the directory writable for this user again",
    errno.ENOENT: "restore the directory (or remount its filesystem)",
})
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
_WRITING_BYTES = re.compile(r"Failed to write (\d+) bytes")
_ORBAX_SOURCE = f"{os.sep}orbax{os.sep}"
_CLOSED_LOOP = "Event loop is closed"


@dataclasses.dataclass(frozen=True, kw_only=True)
class StorageFault:
    """What storage refused: the errno, the file it named (if any), the bytes being written."""

    code: int
    path: str | None = None
    bytes_writing: int | None = None

    @property
    def words(self) -> str:
        """The OS's words with the errno's name, e.g. 'No space left on device (ENOSPC)'."""
        return f"{os.strerror(self.code)} ({errno.errorcode.get(self.code, self.code)})"

    @property
    def remedy(self) -> str:
        return _REMEDIES[self.code]

    def describe(self) -> str:
        """'File too large (EFBIG) while writing 779771 bytes'."""
        if self.bytes_writing is None:
            return self.words
        return f"{self.words} while writing {self.bytes_writing} bytes"


def _chain(error: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in chain and len(chain) < 20:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def storage_fault(error: BaseException) -> StorageFault | None:
    """The storage fault behind `error` (anywhere in its chain of causes), or None."""
    for link in _chain(error):
        if isinstance(link, OSError) and link.errno in _REMEDIES:
            path = link.filename if isinstance(link.filename, str) else None
            return StorageFault(code=link.errno, path=path)
        text = str(link)
        code = _OS_ERROR_CODE.search(text)
        if code is not None and int(code.group(1)) in _REMEDIES:
            writing = _WRITING_BYTES.search(text)
            return StorageFault(code=int(code.group(1)),
                                bytes_writing=int(writing.group(1)) if writing else None)
    return None


def vanished(path: str | os.PathLike) -> StorageFault:
    """A file or directory removed while the job was writing to it."""
    return StorageFault(code=errno.ENOENT, path=os.fspath(path))


def check_not_removed(path: str | os.PathLike, file: Any) -> None:
    """FileNotFoundError if the open `file` (at `path`) was removed, e.g. with its job directory:
    writes to it would still succeed, into a file nobody can read."""
    if os.fstat(file.fileno()).st_nlink == 0:
        raise FileNotFoundError(errno.ENOENT, f"{os.strerror(errno.ENOENT)} (removed)",
                                os.fspath(path))


@contextlib.contextmanager
def _faults_as_one_line(line: Callable[[StorageFault], str]) -> Iterator[None]:
    """A storage fault inside (an OSError of the kinds above) becomes one StorageFaultError saying
    `line(fault)`; any other error, or a StorageFaultError already made, propagates as it is."""
    try:
        yield
    except StorageFaultError:
        raise
    except OSError as error:
        fault = storage_fault(error)
        if fault is None:
            raise
        raise StorageFaultError(line(fault)) from error


def refused_writes(path: str | os.PathLike) -> contextlib.AbstractContextManager[None]:
    """A storage fault inside becomes one StorageFaultError line naming `path`."""
    return _faults_as_one_line(lambda fault: (
        f"could not write {os.fspath(path)}: {fault.describe()}; {fault.remedy} and run the same "
        "command again (it resumes from the last complete checkpoint)"))


# What the user can do about an input file that cannot be read (removed, unmounted, unreadable).
_READ_REMEDIES = types.MappingProxyType({
    errno.ENOENT: "put it back (or remount its filesystem)",
    errno.EACCES: "make it readable for this user again",
    errno.EPERM: "make it readable for this user again",
})


def reading_inputs(*, step: int,
                   complete: Callable[[], int | None]) -> contextlib.AbstractContextManager[None]:
    """An input file storage would not give while the batch (or the evaluation) of `step` is read
    (removed, its filesystem unmounted) becomes one StorageFaultError line naming the file and the
    step, instead of the reader's traceback. `complete()`: the newest complete checkpoint, which
    the same command resumes from once the file is back."""
    def line(fault: StorageFault) -> str:
        newest = complete()
        return (f"could not read {fault.path or 'an input file'} for step {step}: {fault.words}; "
                f"{_READ_REMEDIES.get(fault.code, fault.remedy)} and run the same command again "
                f"to resume from {'the beginning' if newest is None else f'step {newest}'}")
    return _faults_as_one_line(line)


def newest_complete(manager: Any) -> int | None:
    """The newest committed step an Orbax CheckpointManager finds on disk now (no collective: for
    one process's error message), None if there is none or the directory cannot be read."""
    try:
        manager.reload()
        return max(manager.all_steps(), default=None)
    except OSError:
        return None


def remove_refused_save(leftover: Any, *, timeout_s: float = 60) -> None:
    """Removes the unfinished directory `leftover` (an epath.Path) of a refused save, once Orbax's
    writers of it have ended (at most `timeout_s`; without the directory, storage refused to make
    it and nothing writes in it). A writer still running may make it again: the caller removes it
    once more at the end of the run."""
    if leftover.exists() and not wait_for_orbax_writers(timeout_s=timeout_s):
        logging.getLogger("absl").warning(
            "Orbax still writes the refused save %s after %d s; it is removed at the end",
            leftover, timeout_s)
    shutil.rmtree(leftover, ignore_errors=True)


def wait_for_orbax_writers(*, timeout_s: float) -> bool:
    """Waits (at most `timeout_s`) for Orbax's writer threads of a failed save to end; whether they
    all did. Orbax reports a save's first failure while its other writers still run: a directory
    removed under them makes TensorStore create it again (the leftover stays) and fail with
    NOT_FOUND, which names no storage fault (its errors would be shown). Orbax's threads are the
    ones compat.is_orbax_writer names; its thread pools' idle workers are not waited for."""
    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and compat.is_orbax_writer(thread):
            # threading's own join: Orbax's raises the thread's error, which is the fault's echo
            threading.Thread.join(thread, timeout=max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                return False
    return True


class CheckpointSaveError(StorageFaultError):
    """Storage refused a checkpoint save (checkpoint.py). `failure`: what failed and what is kept
    (the message without the advice, for a run that goes on); `step`, `fault`: which save, why."""

    def __init__(self, message: str, *, failure: str, step: int, fault: StorageFault) -> None:
        super().__init__(message)
        self.failure, self.step, self.fault = failure, step, fault


def refused_save(*, step: int, directory: str, fault: StorageFault,
                 complete: int | None) -> CheckpointSaveError:
    """The error for a checkpoint save of `step` under `directory` that storage refused;
    `complete`: the newest complete step."""
    where = f" ({fault.path})" if fault.path and fault.path != directory else ""
    kept = (f"the last complete checkpoint, step {complete}, is untouched" if complete is not None
            else "there is no complete checkpoint to keep")
    failure = (f"checkpoint step {step} was not saved in {directory}: {fault.describe()}{where}; "
               f"{kept}")
    resume = f"step {complete}" if complete is not None else "the beginning"
    return CheckpointSaveError(
        f"{failure}; {fault.remedy} and run the same command again to resume from {resume}",
        failure=failure, step=step, fault=fault)


class QuietStorageFaults(logging.Filter):
    """While entered: Orbax's log records of a storage fault are dropped (the run reports it once,
    itself), and so are its echoes: "Event loop is closed" from TensorStore callbacks of the failed
    save (printed through sys.excepthook or the unraisable hook), errors of Orbax's abandoned write
    coroutines and futures as they are destroyed. An echo can come before the fault is known (the
    failing threads race the one that reports it), so one that comes first is held, dropped once a
    storage fault is seen, and printed on exit otherwise: nothing else is hidden. On exit after a
    fault, the coroutines are collected while the interpreter still runs, so they cannot raise
    again at its shutdown."""

    def __init__(self) -> None:
        super().__init__(name="paxlite-storage-faults")
        self._seen = threading.Event()
        self._lock = threading.Lock()
        self._held: list[str] = []  # echoes that came before any fault, formatted
        self._previous_hook: Any = None
        self._previous_excepthook: Any = None
        # absl's: Orbax logs there; asyncio's: a failed task or future of Orbax's nobody awaited
        self._loggers = (logging.getLogger("absl"), logging.getLogger("asyncio"))
        # Called once, with the first storage fault seen, in whichever thread sees it.
        self.on_fault: Callable[[StorageFault], None] | None = None

    def report_refusals(self, report: Callable[[CheckpointSaveError], None], *,
                        step: Callable[[], int | None], directory: str,
                        complete: Callable[[], int | None]) -> None:
        """From now on the first storage fault seen, in whichever thread, is also given to
        `report` as the refused save of `step()` under `directory` (`complete()`: the newest
        complete step), unless no save was started."""
        def refused(fault: StorageFault) -> None:
            saving = step()
            if saving is None:
                return
            try:
                newest = complete()
            except Exception:  # noqa: BLE001  the same storage may refuse the listing too
                newest = None
            report(refused_save(step=saving, directory=directory, fault=fault, complete=newest))

        self.on_fault = refused

    def note(self, fault: StorageFault | None) -> None:
        """A storage fault the caller found itself: its echoes are dropped from now on."""
        if fault is not None:
            first = not self._seen.is_set()
            self._seen.set()
            with self._lock:
                self._held.clear()
            if first and self.on_fault is not None:
                self.on_fault(fault)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        error = record.exc_info[1] if record.exc_info else None
        from_asyncio = record.name == "asyncio"  # "... exception was never retrieved"
        if not (from_asyncio or _ORBAX_SOURCE in record.pathname
                or _ORBAX_SOURCE in record.getMessage()):
            return True
        fault = storage_fault(error) if error is not None else None
        if fault is None and _OS_ERROR_CODE.search(record.getMessage()):
            fault = storage_fault(RuntimeError(record.getMessage()))
        self.note(fault)
        return fault is None

    def _hold_or_drop(self, text: str) -> None:
        with self._lock:
            if not self._seen.is_set():
                self._held.append(text)

    def _unraisable(self, unraisable: Any) -> None:
        if not self._is_echo(unraisable.exc_value, getattr(unraisable.object, "cr_code", None)):
            self._previous_hook(unraisable)
            return
        # formatted now: the hook's arguments must not outlive it (they may resurrect objects)
        self._hold_or_drop("".join(traceback.format_exception(
            unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback)))

    def _excepthook(self, exc_type: Any, value: BaseException, tb: Any) -> None:
        if not self._is_echo(value, None):
            self._previous_excepthook(exc_type, value, tb)
            return
        self._hold_or_drop("".join(traceback.format_exception(exc_type, value, tb)))

    @staticmethod
    def _is_echo(value: BaseException | None, code: Any) -> bool:
        if isinstance(value, RuntimeError) and str(value) == _CLOSED_LOOP:
            return True
        return code is not None and _ORBAX_SOURCE in code.co_filename

    def __enter__(self) -> Self:
        for logger in self._loggers:
            logger.addFilter(self)
        self._previous_hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        return self

    def __exit__(self, *exc: object) -> None:
        if self._seen.is_set():  # its echoes may come until the process ends: stay installed
            with warnings.catch_warnings():  # Orbax's abandoned writes, collected here
                warnings.filterwarnings("ignore", message="coroutine '.*' was never awaited",
                                        category=RuntimeWarning)
                gc.collect()
            return
        with self._lock:
            held, self._held = self._held, []
        for text in held:  # no fault explained them: shown, as they would have been
            sys.stderr.write(text)
        if sys.unraisablehook == self._unraisable:
            sys.unraisablehook = self._previous_hook
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_excepthook
        for logger in self._loggers:
            logger.removeFilter(self)


def close_keeping(close: Callable[[], None], *, ending: type[BaseException] | None) -> None:
    """`close()`; while an error is ending the block (`ending`), one of close's own is logged in a
    line and not raised: Orbax's close raises a failed save's error again (a disk full when the
    save started), which would replace the one line already made of it with its traceback."""
    if ending is None:
        close()
        return
    try:
        close()
    except Exception as error:  # noqa: BLE001  the error in flight is the one to report
        first = str(error).splitlines()[0] if str(error) else ""
        logging.getLogger("absl").warning("While closing after %s: %s: %s", ending.__name__,
                                          type(error).__name__, first[:300])
