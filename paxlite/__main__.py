"""`python -m paxlite COMMAND ...` and the `paxlite` console script: the commands are
paxlite/cli/app.py's (one module of paxlite/cli/ each)."""

import sys

from paxlite.cli.app import main, run

__all__ = ["main", "run"]

if __name__ == "__main__":
    sys.exit(run())
