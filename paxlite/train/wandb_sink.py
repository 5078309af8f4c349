"""Weights & Biases: the scalars metrics.jsonl gets, at its steps, and the run's hyperparameters.

A sink of `MetricsWriter` (train/metrics.py), which hands it each record exactly as it appends it
to metrics.jsonl (the same keys, `eval/...` and `lm_eval/...` included, non-finite values already
None), so W&B never has keys or values of its own; None values are left out. Records of one step
(training, evaluation, lm_eval) become one W&B history row at that step.

Built on process 0 only, when the run starts and before anything compiles, so that a missing
`wandb` package or a W&B that refuses the run (a bad API key, an unknown entity) is said before
the hours of a compile. A job directory keeps its W&B run: the id is written once to
DIR/wandb_run_id (an existing file is never replaced, and an id written there before the first run
is used), and every start of the same job continues that run (resume="allow": the run is made
where W&B does not have it yet). W&B keeps the first value of a step: steps that a resumed job
trains again (those after its last checkpoint) stay as first logged, where metrics.jsonl gets them
twice. The W&B files go to DIR/wandb unless WANDB_DIR says where; WANDB_MODE=offline keeps the run
on disk for `wandb sync`.
"""

from __future__ import annotations

import os
import secrets
import string
import sys
from collections.abc import Mapping

from paxlite.errors import RunStoppedError, SettingError, UserError
from paxlite.train.run_config import WandbConfig

RUN_ID_FILE = "wandb_run_id"
WANDB_EXTRA = "pip install 'paxlite[wandb]'"
# What W&B refuses in a run id (besides whitespace)
_RUN_ID_FORBIDS = ":;,#?/'"
_NEW_RUN_ID_CHARS = string.ascii_lowercase + string.digits  # as W&B makes them


class MissingWandbError(UserError, ImportError):
    """WANDB_PROJECT is set and the wandb package is not installed."""


def import_wandb():
    """The wandb package, or one error saying how to install it."""
    try:
        import wandb
    except ImportError as e:
        raise MissingWandbError(
            f"WANDB_PROJECT is set, and Weights & Biases is not installed ({e}): "
            f"{WANDB_EXTRA}") from None
    return wandb


def job_run_id(job_dir: str) -> str:
    """The W&B run id of the job in `job_dir`: the one its wandb_run_id file holds, else a new one,
    written there first (exclusively: a file another start wrote meanwhile wins)."""
    path = os.path.join(job_dir, RUN_ID_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            run_id = f.read().strip()
    except FileNotFoundError:
        run_id = "".join(secrets.choice(_NEW_RUN_ID_CHARS) for _ in range(8))
        try:
            with open(path, "x", encoding="utf-8") as f:
                f.write(run_id + "\n")
        except FileExistsError:
            return job_run_id(job_dir)
    if not run_id or any(c in _RUN_ID_FORBIDS or c.isspace() for c in run_id):
        raise SettingError(
            f"{path} holds {run_id!r}, not a Weights & Biases run id (no whitespace, none of "
            f"{_RUN_ID_FORBIDS!r}): write the id of the W&B run to continue, or delete the file "
            "to start a new one")
    return run_id


class WandbSink:
    """One W&B run for one start of a job: `write` logs a metrics.jsonl record, `close` finishes.

    Args:
        config: The run's WANDB_* settings and hyperparameters.
        job_dir: The job directory (its name is the default run name; it keeps the run id).
    """

    def __init__(self, config: WandbConfig, *, job_dir: str) -> None:
        wandb = import_wandb()
        job_dir = os.path.abspath(job_dir)
        os.makedirs(job_dir, exist_ok=True)
        offline = "WANDB_MODE=offline logs to disk without an account or network"
        try:
            self._run = wandb.init(
                project=config.project,
                entity=config.entity,
                name=config.run_name or os.path.basename(job_dir),
                tags=list(config.tags) or None,
                config=dict(config.hparams),
                id=job_run_id(job_dir),
                resume="allow",
                dir=None if os.environ.get("WANDB_DIR") else job_dir,
            )
        # The user's to fix (no API key, a bad one, a setting wandb refuses): one line, exit 2
        except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as e:
            raise SettingError(f"Weights & Biases did not start the run: {e} ({offline})") from None
        except wandb.errors.CommError as e:  # W&B unreachable: nothing on the command line wrong
            raise RunStoppedError(
                f"Weights & Biases could not be reached: {e} ({offline})") from None

    def write(self, step: int, record: Mapping[str, int | float | None]) -> None:
        """Logs one metrics.jsonl record (without its "step") at `step`; None values are left
        out."""
        if self._run is None:
            raise ValueError("the W&B run is finished")
        self._run.log({key: value for key, value in record.items() if value is not None},
                      step=step)

    def close(self) -> None:
        """Finishes the W&B run; safe to call twice. Called while an exception is on its way out
        (a diverged loss, a bug), the run is marked failed (exit code 1), as wandb marks a process
        that ends on one; the exception itself goes on."""
        if self._run is None:
            return
        run, self._run = self._run, None
        run.finish(exit_code=0 if sys.exception() is None else 1)
