"""The two kinds of failure a user is shown without a traceback.

`UserError`: something the user can change (a flag, a hyperparameter, a file, a job directory)
and the message alone says what. The entry points print `paxlite: error: <message>` and exit with
status 2 (`exit_status`, the one place that prints it; `report_errors` and `exit_usage` call it).
`RunStoppedError`: the job was set up correctly but could not go on (a diverged loss, an unreachable
coordinator); one line too, but exit status 1, since nothing on the command line was wrong. Its
`StorageFaultError` (a full disk, a quota, a read-only or removed job directory) and its
`PeerLostError` (another process of the run died or froze) exit with 75, EX_TEMPFAIL, so that a
launcher can tell "fix it, or just rerun the same command" from a failed job.

Everything else is a bug in paxlite or a library, and keeps its traceback (exit status 1). So a type
raised for a user-facing condition must derive from one of these two; the built-in type it also
derives from (ValueError, FileNotFoundError, ...) keeps Python callers' `except` clauses working.
This module imports only the standard library, so every layer of the package can import it
(docs/architecture.md).
"""

import logging
import sys
from collections.abc import Callable
from typing import NoReturn


class UserError(Exception):
    """A mistake the user can fix; its message names the bad value and what would be valid."""


class SettingError(UserError, ValueError):
    """A setting that cannot work, found below config/ (where ConfigError is out of reach): when the
    run's parts meet the devices, the data or the checkpoints."""


class RunStoppedError(Exception):
    """A correctly configured job that cannot go on; reported in one line, exit status 1."""


USER_ERROR_EXIT_STATUS = 2  # as argparse and absl exit after a bad command line

# sysexits.h's EX_TEMPFAIL: a temporary failure, the same command succeeds once storage is fixed
# (or, for a lost peer, once the scheduler gives the job its hosts again).
STORAGE_FAULT_EXIT_STATUS = 75


class StorageFaultError(RunStoppedError, OSError):
    """Storage refused a write (no space, quota, file size, read-only, permissions, a removed
    directory); the message names the path, the OS's words and what to do. Exit status 75."""


class PeerLostError(RunStoppedError):
    """Another process of the run died or froze (train/peer_liveness.py); the message names it,
    the step and the last complete checkpoint. Exit status 75: the same command resumes."""


class NotFoundError(UserError, FileNotFoundError):
    """A file or directory the user named, or that a job directory should hold, is not there."""


class ExistsError(UserError, FileExistsError):
    """Writing here would overwrite something the user saved; nothing is overwritten."""


class UsageError(UserError, ValueError):
    """A bad command line (not a bad hyperparameter)."""


def line_status(error: UserError | RunStoppedError) -> int:
    """The exit status that goes with a one-line failure: 2 for a user's mistake, 75 for a storage
    fault or a lost peer, 1 for another stopped run."""
    if isinstance(error, UserError):
        return USER_ERROR_EXIT_STATUS
    temporary = isinstance(error, (StorageFaultError, PeerLostError))
    return STORAGE_FAULT_EXIT_STATUS if temporary else 1


def exit_status(error: BaseException, *, user_errors: tuple[type[BaseException], ...] = (),
                program: str = "paxlite") -> int:
    """The status a command exits with after `error`, its one line `PROGRAM: error: MESSAGE`
    printed on stderr: 2 for a user's mistake (a UserError, or one of `user_errors`: what a
    library raises for a bad value the user gave, e.g. argparse's ValueError), 1 for a run that
    stopped (a RunStoppedError), 75 for one whose storage refused a write (a StorageFaultError) or
    whose peer was lost (a PeerLostError).
    Anything else is a bug and is raised again, traceback and all.

    The only place that prints such a line (tests/test_errors.py checks), so that every entry
    point words and numbers its failures alike. A stopped run is also logged where logging is set
    up (absl's handler in a training job), so that the job's log says why it ended; with nothing
    set up Python would print the message a second time."""
    if isinstance(error, RunStoppedError):
        log = logging.getLogger(__name__)
        if log.hasHandlers():
            log.error("%s", error)
    if isinstance(error, (UserError, RunStoppedError)):
        status = line_status(error)
    elif isinstance(error, user_errors):
        status = USER_ERROR_EXIT_STATUS
    else:
        raise error
    print(f"{program}: error: {error}", file=sys.stderr)
    return status


def report_errors(run: Callable[[], int], *,
                  user_errors: tuple[type[BaseException], ...] = ()) -> int:
    """`run()`'s status, or exit_status's for the user's mistake or stopped run it raised; a bug
    keeps its traceback. Every `paxlite` entry point ends this way."""
    try:
        return run()
    except (UserError, RunStoppedError, *user_errors) as error:
        return exit_status(error, user_errors=user_errors)


def exit_usage(error: Exception) -> NoReturn:
    """A command line that does not parse (absl's flags.Error, a malformed --fdl.X): its message
    on one line and exit status 2, where absl itself prints a two-line FATAL and exits 1."""
    sys.exit(exit_status(UsageError(" ".join(str(error).split()))))
