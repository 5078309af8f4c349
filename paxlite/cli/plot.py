"""`python -m paxlite plot JOB_DIR [--output=PNG]`: a job's train and validation loss curves."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job_log_dir")
    parser.add_argument("--output", default=None,
                        help="PNG path (default: JOB_LOG_DIR/loss.png)")


def run(args: argparse.Namespace, assignments: Sequence[str]) -> int:
    del assignments  # refused by the command line: a plot has no experiment to override
    from paxlite.train.plot import plot_losses

    print(plot_losses(args.job_log_dir, args.output))
    return 0
