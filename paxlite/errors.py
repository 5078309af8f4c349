"""The two kinds of failure a user is shown without a traceback.

`UserError`: something the user can change (a flag, a hyperparameter, a file, a job directory) and the
message alone says what. The entry points print `paxlite: error: <message>` and exit with status 2.
`RunStoppedError`: the job was set up correctly but could not go on (a diverged loss, an unreachable
coordinator); one line too, but exit status 1, since nothing on the command line was wrong.

Everything else is a bug in paxlite or a library, and keeps its traceback (exit status 1). So a type
raised for a user-facing condition must derive from one of these two; the built-in type it also
derives from (ValueError, FileNotFoundError, ...) keeps Python callers' `except` clauses working.
This module imports nothing, so every layer of the package can import it (docs/architecture.md).
"""


class UserError(Exception):
    """A mistake the user can fix; its message names the bad value and what would be valid."""


class SettingError(UserError, ValueError):
    """A setting that cannot work, found below config/ (where ConfigError is out of reach): when the
    run's parts meet the devices, the data or the checkpoints."""


class RunStoppedError(Exception):
    """A correctly configured job that cannot go on; reported in one line, exit status 1."""


class NotFoundError(UserError, FileNotFoundError):
    """A file or directory the user named, or that a job directory should hold, is not there."""


class ExistsError(UserError, FileExistsError):
    """Writing here would overwrite something the user saved; nothing is overwritten."""
