"""AXLearn-style entry point: `python -m paxlite.launch_trainer_main --module=text.gpt.c4_trainer
--config=fuji-7B-v2 --trainer_dir=DIR --data_dir=DIR|FAKE --jax_backend=gpu|cpu [...]`.

AXLearn's `launch_trainer_main` flags, mapped onto paxlite's Fuji experiments, so a job moves by
changing the container and at most the module path (docs/migrating_from_axlearn.md has the table):

- `--module` (alias `--config_module`): `text.gpt.c4_trainer`, the module of the Fuji configs.
- `--config`: an AXLearn Fuji name (`fuji-7B-v2-flash`; a miss gets "did you mean").
- `--trainer_dir`: the job directory; checkpoints in DIR/checkpoints and summaries in
  DIR/summaries, as AXLearn lays them out; process 0 also writes DIR/trainer_config and
  DIR/launch_trainer_flags, as AXLearn's `run_trainer` does.
- `--data_dir`: None -> $DATA_DIR -> ~/tensorflow_datasets; `FAKE` is SYNTHETIC_DATA=true. A
  directory holding the experiment's TFDS dataset (c4/en/3.0.1) becomes TFDS_DATA_DIR, one made by
  `python -m paxlite.data.prepare` becomes DATA_DIR; anything else is an error.
- `--jax_backend` (required): cpu, gpu or tpu, checked against every device JAX finds; cpu makes
  JAX use the CPU. AXLearn's `proxy` (Pathways) is refused.
- `--mesh_selector`: AXLearn's Fuji mesh rules (experiments/fuji_mesh.py).
- `--distributed_coordinator`, `--num_processes`, `--process_id` (or DISTRIBUTED_COORDINATOR,
  NUM_PROCESSES, PROCESS_ID); `--initialization_timeout`.
- `--trainer_prng_seed` (SEED), `--trace_at_steps` / `--n_steps_for_each_trace`
  (PROFILER_CAPTURE_STEP / PROFILER_NUM_STEPS), `--trainer_watchdog_timeout_seconds`,
  `--trainer_crash_on_hang_timeout_seconds`, `--trainer_log_every_n_steps`
  (SUMMARY_INTERVAL_STEPS), `--jax_profiler_port`.
- `--fdl.NAME=VALUE`: any hyperparameter, with paxlite.main's syntax and checks.

AXLearn flags with no paxlite meaning are defined so that using one is one clear error rather than
absl's "unknown flag" or a value silently ignored. Every user mistake is one line and exit status
2, found before JAX touches a device (a --jax_backend that does not match the devices is found
when they are first listed).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from absl import app, flags, logging

from paxlite.cli.launch_plan import (
    BACKENDS,
    CONFIG_MODULES,
    DEFAULTS,
    FLAG_NAMES,
    REFUSED,
    LaunchError,
    LaunchFlags,
    LaunchPlan,
    parse_launch,
    split_fdl_args,
)
from paxlite.errors import exit_usage, report_errors

FLAGS = flags.FLAGS

# AXLearn's flags that paxlite maps (module docstring): name, absl's definer, help; the defaults
# are launch_plan.DEFAULTS.
_FLAGS = (
    ("module", flags.DEFINE_string, f"AXLearn's config module: {', '.join(CONFIG_MODULES)}."),
    ("config", flags.DEFINE_string, "AXLearn config name, e.g. fuji-7B-v2-flash."),
    ("trainer_dir", flags.DEFINE_string,
     "Job directory: checkpoints/, summaries/, metrics, configs."),
    ("data_dir", flags.DEFINE_string, ("TFDS directory or paxlite dataset; FAKE: synthetic "
                                       "data. Default $DATA_DIR, else ~/tensorflow_datasets.")),
    ("jax_backend", flags.DEFINE_string,
     f"Required: {', '.join(BACKENDS)} (checked against the devices)."),
    ("mesh_selector", flags.DEFINE_string,
     "Picks a Fuji mesh rule, e.g. gpu-p5.48xlarge-256, tpu-v5p-512."),
    ("distributed_coordinator", flags.DEFINE_string,
     "HOST:PORT of process 0 (default $DISTRIBUTED_COORDINATOR)."),
    ("num_processes", flags.DEFINE_integer, "Processes in the job (default $NUM_PROCESSES)."),
    ("process_id", flags.DEFINE_integer, "This process's index (default $PROCESS_ID)."),
    ("initialization_timeout", flags.DEFINE_integer,
     "Seconds to wait for every process to join (default PAXLITE_INIT_TIMEOUT_S, 300)."),
    ("trainer_prng_seed", flags.DEFINE_integer, "Seed of the run (SEED)."),
    ("trace_at_steps", flags.DEFINE_list, "Step at which to start a profiler trace (one step)."),
    ("n_steps_for_each_trace", flags.DEFINE_integer, "Steps in the trace (PROFILER_NUM_STEPS)."),
    ("trainer_watchdog_timeout_seconds", flags.DEFINE_float,
     "No step for this long: log every thread's stack (WATCHDOG_TIMEOUT_SECONDS)."),
    ("trainer_crash_on_hang_timeout_seconds", flags.DEFINE_float,
     "No step for this long: exit non-zero (CRASH_ON_HANG_TIMEOUT_SECONDS)."),
    ("trainer_log_every_n_steps", flags.DEFINE_integer,
     "Summary interval (SUMMARY_INTERVAL_STEPS)."),
    ("jax_profiler_port", flags.DEFINE_integer, "Start JAX's profiler server on this port."),
)
for _name, _define, _help in _FLAGS:
    _define(_name, DEFAULTS[_name], _help)
flags.DEFINE_alias("config_module", "module")
for _name, _why in REFUSED.items():
    flags.DEFINE_string(_name, None, f"AXLearn's flag; refused here: {_why}.")


def _absl_flags(fdl) -> LaunchFlags:
    return LaunchFlags(values={name: FLAGS[name].value for name in FLAG_NAMES},
                       present=frozenset(name for name in FLAG_NAMES if FLAGS[name].present),
                       fdl=tuple(fdl))


def _write_trainer_files(plan: LaunchPlan, experiment, tree) -> None:
    """DIR/trainer_config (readable) and DIR/launch_trainer_flags (JSON), as AXLearn's
    run_trainer."""
    from fiddle import printing

    os.makedirs(plan.trainer_dir, exist_ok=True)
    lines = [f"# {plan.config_name}: {type(experiment).__module__}.{type(experiment).__qualname__}",
             (f"# mesh: {plan.describe_mesh()} -> ICI_MESH_SHAPE={experiment.ICI_MESH_SHAPE}, "
              f"DCN_MESH_SHAPE={experiment.DCN_MESH_SHAPE}"),
             *(f"{name} = {value!r}" for name, value in experiment.hparams().items()),
             "", printing.as_str_flattened(tree)]
    with open(os.path.join(plan.trainer_dir, "trainer_config"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(plan.trainer_dir, "launch_trainer_flags"), "w") as f:
        json.dump(plan.flags_record(), f, indent=2, sort_keys=True)
        f.write("\n")


def run(plan: LaunchPlan, *, argv: Sequence[str]) -> int:
    """Join the job, check the devices, resolve the mesh and train (paxlite.cli.job.run_job)."""
    import jax

    from paxlite.cli.job import Mode, preemption_exit_code, run_job
    from paxlite.experiments.build import build_tree, run_tree
    from paxlite.parallel import distributed

    preemption_exit_code()  # a bad PAXLITE_PREEMPTION_EXIT_CODE is reported before joining
    if plan.backend == "cpu":
        jax.config.update("jax_platforms", "cpu")
    distributed.initialize(plan.launch, timeouts=plan.timeouts)
    plan.check_devices(jax.devices())
    if plan.flags["jax_profiler_port"] is not None:
        jax.profiler.start_server(plan.flags["jax_profiler_port"])
    experiment = plan.experiment(num_devices=jax.device_count(), num_processes=jax.process_count())
    if plan.mesh is not None and plan.mesh.rule is None and plan.mesh.selector:
        logging.warning("%s", plan.no_rule_warning())
    elif plan.mesh is not None and plan.mesh.rule is not None and plan.mesh.rule.not_reproduced:
        logging.warning("Mesh rule %r: AXLearn's rule also sets %s; paxlite does not",
                        plan.mesh.rule.pattern, plan.mesh.rule.not_reproduced)
    logging.info("%s: %s -> ICI_MESH_SHAPE=%s, DCN_MESH_SHAPE=%s", plan.config_name,
                 plan.describe_mesh(), experiment.ICI_MESH_SHAPE, experiment.DCN_MESH_SHAPE)
    tree = run_tree(experiment)
    run_config = build_tree(tree)
    if jax.process_index() == 0:
        _write_trainer_files(plan, experiment, tree)
    return run_job(experiment, tree, run_config, job_dir=plan.trainer_dir, mode=Mode.TRAIN,
                   enable_checkpoint_saving=True, argv=argv)


def main(argv: Sequence[str], *, fdl: Sequence[str] = ()) -> int:
    """0; 2 with one line for a user's mistake; 1 with one line for a run that stopped."""
    def launch() -> int:
        if len(argv) > 1:
            raise LaunchError(f"unexpected positional arguments {list(argv[1:])}; flags look like "
                              "--name=value")
        plan = parse_launch(_absl_flags(fdl), os.environ)
        return run(plan, argv=sys.argv)

    return report_errors(launch)


def run_main() -> None:
    fdl_assignments: list[str] = []

    def parser(argv: list[str]) -> list[str]:
        try:
            rest, found = split_fdl_args(argv)
            fdl_assignments.extend(found)
            return FLAGS(rest)
        except (LaunchError, flags.Error) as e:  # one line and exit 2, not absl's FATAL and exit 1
            exit_usage(e)

    app.run(lambda argv: sys.exit(main(argv, fdl=fdl_assignments)), flags_parser=parser)


if __name__ == "__main__":
    run_main()
