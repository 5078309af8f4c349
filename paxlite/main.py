"""Pax-compatible entry point:
`python -m paxlite.main --fdl_config=NAME --fdl.X=V --job_log_dir=DIR`.

Flags follow paxml/main.py. Fiddle's absl integration defines `--fdl_config` and `--fdl_set` and
rewrites `--fdl.X=V` into `--fdl_set=X=V`; paxlite reads those two flags itself so that every name
and value is validated (Fiddle's own override path silently accepts misspelled names). Configuration
mistakes are reported before JAX touches a device.
"""

from __future__ import annotations

import logging as logging_std
import os
import sys

from absl import app, flags, logging
from fiddle import absl_flags  # noqa: F401  defines --fdl_config, --fdl_set, ... (parsed in _parse_flags)

from paxlite.cli.job import Mode, run_job
from paxlite.errors import UsageError, exit_usage, report_errors

FLAGS = flags.FLAGS


flags.DEFINE_string("job_log_dir", None, "Directory for checkpoints, summaries, metrics and "
                                         "configs.")
flags.DEFINE_enum("mode", Mode.TRAIN.value, [m.value for m in Mode], "What to run.")
flags.DEFINE_bool("enable_checkpoint_saving", True, "Write checkpoints (restoring works either "
                                                    "way).")
flags.DEFINE_string("tfds_data_dir", None,
                    "TFDS data directory (Pax's flag): sets --fdl.TFDS_DATA_DIR unless that is "
                    "given.")
flags.DEFINE_bool("multiprocess_gpu", False,
                  "Join a multi-process job (as in Pax) with --server_addr, --num_hosts and "
                  "--host_idx. Without it SLURM (SLURM_NTASKS > 1) and "
                  "PAXLITE_COORDINATOR_ADDRESS / PAXLITE_NUM_PROCESSES (Kubernetes Indexed Jobs) "
                  "are detected; see docs/parallelism.md.")
flags.DEFINE_string("server_addr", None,
                    "HOST:PORT of process 0, where the coordinator listens (--multiprocess_gpu).")
flags.DEFINE_integer("num_hosts", None,
                     "Number of processes in the job, usually one per node (--multiprocess_gpu).")
flags.DEFINE_integer("host_idx", None,
                     "This process's index, 0..num_hosts-1; 0 runs the coordinator "
                     "(--multiprocess_gpu).")

class _LibraryInfoFilter(logging_std.Filter):
    """Orbax logs dozens of INFO lines per checkpoint; keep its warnings, drop its chatter from the
    job log."""

    _QUIET = (f"{os.sep}orbax{os.sep}", f"{os.sep}jax{os.sep}_src{os.sep}")

    def filter(self, record: logging_std.LogRecord) -> bool:
        return record.levelno >= logging_std.WARNING or not any(
            part in record.pathname for part in self._QUIET
        )


def quiet_library_logs() -> None:
    logging.get_absl_handler().addFilter(_LibraryInfoFilter())


def parse_job(argv) -> tuple:
    """Validate everything that can be validated without devices; returns (experiment, tree,
    run_config)."""

    from paxlite.experiments.build import build_tree, load_experiment, run_tree

    if len(argv) > 1:
        raise UsageError(
            f"unexpected positional arguments {argv[1:]}; flags look like --name=value"
        )
    unsupported = [f"--{name}" for name in ("fdl_config_file", "fiddler", "fdl_tags_set")
                   if FLAGS[name].present]
    if unsupported:
        raise UsageError(
            f"{', '.join(unsupported)} are Fiddle flags paxlite does not apply; select the "
            "experiment with --fdl_config=NAME and set hyperparameters with --fdl.NAME=VALUE"
        )
    if not FLAGS.job_log_dir:
        raise UsageError("--job_log_dir is required (checkpoints, summaries and metrics are "
                         "written there)")
    from paxlite.paths import require_local_path

    require_local_path(FLAGS.job_log_dir, setting="--job_log_dir")  # a ValueError: exit 2, as above
    assignments = list(FLAGS.fdl_set or [])
    if FLAGS.tfds_data_dir and not any(
        a.split("=", 1)[0].strip() == "TFDS_DATA_DIR" for a in assignments
    ):
        assignments.append(f"TFDS_DATA_DIR={FLAGS.tfds_data_dir!r}")
    if Mode(FLAGS.mode) is Mode.DRY_RUN and not any(a.split("=", 1)[0].strip() == "SYNTHETIC_DATA"
                                                    for a in assignments):
        # The planner compiles on shapes only: no dataset or tokenizer is needed, or opened.
        assignments.append("SYNTHETIC_DATA=true")
    experiment = load_experiment(FLAGS.fdl_config or "", assignments)
    if Mode(FLAGS.mode) is Mode.TRAIN and experiment.MAX_STEPS == 0:
        # Pax's evaluation-only configs (the LLaMA ones) have MAX_STEPS=0: zero means "no training",
        # so say so here, before a checkpoint is read, a step compiled or the job directory made.
        where = ("--fdl.MAX_STEPS=0" if "MAX_STEPS" in experiment.overridden
                 else f"MAX_STEPS=0 ({experiment.name}'s value, as in Pax's evaluation-only "
                      "configs)")
        raise UsageError(
            f"{where} with --mode=train trains nothing; pass --fdl.MAX_STEPS=N (N >= 1) to train, "
            "or --mode=eval to evaluate the job's latest checkpoint (or CHECKPOINT_RESTORE_PATH)")
    tree = run_tree(experiment)
    run_config = build_tree(tree)
    return experiment, tree, run_config


def main(argv) -> int:
    """0, or 2 with one line for a user's mistake (any UserError), or 1 with one line for a run that
    stopped (RunStoppedError); any other exception is a bug and keeps its traceback."""
    quiet_library_logs()
    return report_errors(lambda: _run_job(argv))


def _run_job(argv) -> int:
    experiment, tree, run_config = parse_job(argv)
    if Mode(FLAGS.mode) is Mode.DRY_RUN:
        from paxlite.planner.plan import dry_run

        return dry_run(experiment, job_log_dir=os.path.abspath(FLAGS.job_log_dir), argv=sys.argv)
    from paxlite.cli.job import preemption_exit_code
    from paxlite.parallel import distributed

    preemption_exit_code()  # PAXLITE_PREEMPTION_EXIT_CODE checked before joining other processes
    # Pax's --multiprocess_gpu flags, else SLURM / Kubernetes from the environment
    distributed.setup(multiprocess_gpu=FLAGS.multiprocess_gpu, server_addr=FLAGS.server_addr,
                      num_hosts=FLAGS.num_hosts, host_idx=FLAGS.host_idx)
    return run_job(experiment, tree, run_config, job_dir=FLAGS.job_log_dir, mode=Mode(FLAGS.mode),
                   enable_checkpoint_saving=FLAGS.enable_checkpoint_saving, argv=sys.argv)


def _rewrite_fdl_args(argv: list[str]) -> list[str]:
    """`--fdl.NAME=VALUE` -> `--fdl_set=NAME=VALUE` and `--fdl_tag.` -> `--fdl_tags_set=`, the
    rewrite Fiddle's flags_parser makes before absl parses."""
    rewritten = []
    for arg in argv:
        for prefix, flag in (("--fdl.", "fdl_set"), ("--fdl_tag.", "fdl_tags_set")):
            if arg.startswith(prefix):
                if "=" not in arg:
                    raise UsageError(f"{arg}: a setting looks like {prefix}NAME=VALUE")
                arg = f"--{flag}={arg[len(prefix):]}"
                break
        rewritten.append(arg)
    return rewritten


def _parse_flags(argv: list[str]) -> list[str]:
    """As Fiddle's flags_parser, but an unknown or malformed flag is one line and exit 2 (absl's
    own report is a two-line FATAL and exit 1)."""
    try:
        return FLAGS(_rewrite_fdl_args(argv))
    except (flags.Error, UsageError) as e:
        exit_usage(e)


def run_main() -> None:
    app.run(lambda argv: sys.exit(main(argv)), flags_parser=_parse_flags)


if __name__ == "__main__":
    run_main()
