"""Running one parsed job: what `paxlite.main` and `paxlite.launch_trainer_main` share after their
flags.

Each entry point parses its own command line into an experiment (validated before any device is
touched), joins the multi-process runtime, and hands over here: the compilation cache is switched
on, the job directory gets its config files, and the run trains or evaluates. Kept free of absl flag
definitions so that importing it defines no flags an entry point did not ask for (a flag defined but
unused would be a setting silently ignored).
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import platform
from collections.abc import Iterator, Mapping, Sequence
from importlib import metadata

from absl import logging

import paxlite
from paxlite.checkpointing.storage_faults import refused_writes
from paxlite.errors import (
    ExistsError,
    NotFoundError,
    RunStoppedError,
    SettingError,
    UsageError,
    UserError,
)

_VERSIONED = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "fiddle", "grain", "numpy")
# Exit status of a run stopped by SIGTERM/SIGINT after its checkpoint committed
# (train/preemption.py); schedulers that count a 0 as "finished" (Kubernetes Indexed Jobs) set
# another, e.g. 143.
PREEMPTION_EXIT_CODE_ENV = "PAXLITE_PREEMPTION_EXIT_CODE"
# Exit status of a run stopped by SIGTERM/SIGINT with nothing saved
# (--enable_checkpoint_saving=false): never PAXLITE_PREEMPTION_EXIT_CODE, which tells a scheduler to
# rerun the job to resume; a rerun of this one would resume nothing. Not 0 (it did not finish), 1
# (it did not fail), 2 (no mistake) nor 128 + N.
PREEMPTED_UNSAVED_EXIT_CODE = 3


class Mode(str, enum.Enum):
    TRAIN = "train"
    EVAL = "eval"
    DRY_RUN = "dry_run"


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {
        "paxlite": paxlite.__version__,
        "python": platform.python_version(),
    }
    for name in _VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def preemption_exit_code(env: Mapping[str, str] | None = None) -> int:
    """The status a preempted run exits with: PAXLITE_PREEMPTION_EXIT_CODE, else 0."""
    env = os.environ if env is None else env
    raw = env.get(PREEMPTION_EXIT_CODE_ENV, "").strip()
    if not raw:
        return 0
    try:
        code = int(raw)
    except ValueError:
        code = -1
    if not 0 <= code <= 255:
        raise SettingError(f"{PREEMPTION_EXIT_CODE_ENV}={raw!r} must be an exit status 0..255 "
                           "(e.g. 143, what a process killed by SIGTERM reports)")
    if code == PREEMPTED_UNSAVED_EXIT_CODE:
        raise SettingError(f"{PREEMPTION_EXIT_CODE_ENV}={raw!r}: {PREEMPTED_UNSAVED_EXIT_CODE} is "
                           "the status of a run stopped without a checkpoint; pick another status "
                           "0..255 (e.g. 143)")
    return code


def _write_keeping_history(path: str, text: str, *, same_run: bool) -> None:
    """A config from an earlier run with other hyperparameters is kept beside the new one, never
    overwritten."""
    if os.path.exists(path) and not same_run:
        stem, ext = os.path.splitext(path)
        n = 1
        while os.path.exists(f"{stem}.previous-{n}{ext}"):
            n += 1
        with refused_writes(path):  # a read-only job directory: one line
            os.replace(path, f"{stem}.previous-{n}{ext}")
        logging.warning("Hyperparameters differ from the previous run in this directory; kept %s "
                        "as %s",
                        path, f"{stem}.previous-{n}{ext}")
    with refused_writes(path), open(path, "w") as f:  # a full disk: one line
        f.write(text)


def _layout(record: dict) -> str:
    devices = record.get("devices", {})
    processes = devices.get("process_count")
    return (f"{processes} process{'es' if processes != 1 else ''} and {devices.get('count')} "
            f"devices (mesh {record.get('mesh')}, global batch {record.get('global_batch_size')})")


def _say_what_changed(previous: dict, record: dict) -> None:
    """A job resumed on another number of processes or devices (a smaller allocation after a lost
    host): one line on what changed, since its checkpoint is restored onto the new mesh."""
    was = previous.get("devices", {})
    now = record["devices"]
    if not was or (was.get("count"), was.get("process_count")) == (
            now["count"], now["process_count"]):
        return
    logging.warning("This job last ran on %s; it now runs on %s: its latest checkpoint is "
                    "restored onto the new mesh", _layout(previous), _layout(record))


def write_job_configs(job_dir: str, *, experiment, tree, run, argv) -> None:
    """config.json (hyperparameters, command line, versions, devices) and config.txt (the Fiddle
    tree)."""
    import jax
    from fiddle import printing

    devices = jax.devices()
    record = {
        "experiment": experiment.name,
        "hparams": experiment.hparams(),
        "overridden": sorted(experiment.overridden),
        "command_line": list(argv),
        "versions": package_versions(),
        "devices": {
            "count": len(devices),
            "process_count": jax.process_count(),
            "platform": devices[0].platform,
            "kind": devices[0].device_kind,
        },
        "mesh": dict(run.mesh.shape),
        "global_batch_size": run.global_batch_size,
        "flops_per_token": run.config.loop.flops_per_token,
    }
    json_path = os.path.join(job_dir, "config.json")
    same_run = False
    if os.path.exists(json_path):
        try:
            with open(json_path) as f:
                previous = json.load(f)
            same_run = (previous.get("experiment"), previous.get("hparams")) == (
                record["experiment"], record["hparams"])
        except (OSError, ValueError):
            previous, same_run = {}, False
        _say_what_changed(previous, record)
    _write_keeping_history(json_path, json.dumps(record, indent=2, sort_keys=True) + "\n",
                           same_run=same_run)
    _write_keeping_history(os.path.join(job_dir, "config.txt"),
                           printing.as_str_flattened(tree) + "\n", same_run=same_run)


@contextlib.contextmanager
def compilation_cache(run_config, *, job_dir: str) -> Iterator[str | None]:
    """JAX's persistent compilation cache for the run, so that a restarted job does not compile
    again.

    The directory is COMPILATION_CACHE_DIR, else JAX's own JAX_COMPILATION_CACHE_DIR, else
    DIR/compilation_cache (shared by every restart of the job). Every compile is cached, however
    quick: a restart waits on the sum of many small ones too. The process's previous cache settings
    come back afterwards (a process may run several jobs: tests, notebooks). Yields the directory
    (None: off). Off is off even where JAX_COMPILATION_CACHE_DIR is set: JAX would otherwise read
    and write that directory for every compile over its own one-second threshold.
    """
    loop = run_config.loop
    if not loop.compilation_cache:
        with _jax_settings({"jax_enable_compilation_cache": False}):
            yield None
        return
    directory = (loop.compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR")
                 or os.path.join(job_dir, "compilation_cache"))
    from paxlite.paths import require_local_path

    # JAX makes it at the first compile
    require_local_path(directory, setting="COMPILATION_CACHE_DIR")
    logging.info("Compilation cache: %s", directory)
    with _jax_settings({"jax_compilation_cache_dir": directory,
                        "jax_persistent_cache_min_compile_time_secs": 0.0,
                        "jax_persistent_cache_min_entry_size_bytes": 0}):
        yield directory


@contextlib.contextmanager
def _jax_settings(settings: dict[str, object]) -> Iterator[None]:
    """JAX's cache settings for the run, the previous ones back afterwards; the cache is reset on
    both sides (it binds its directory, and whether it is used at all, once)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as jax_cache

    previous = {name: getattr(jax.config, name) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
    jax_cache.reset_cache()
    try:
        yield
    finally:
        for name, value in previous.items():
            jax.config.update(name, value)
        jax_cache.reset_cache()


# What a job directory holds once paxlite has written to it (the checkpoints, the summaries, the
# metrics, the configs).
_JOB_ENTRIES = ("checkpoints", "summaries", "metrics.jsonl", "config.json", "config.txt")


def make_job_dir(job_dir: str) -> None:
    """--job_log_dir made, or found, as a directory: a path that cannot be one is a one-line
    mistake (exit 2), storage that refuses to make it a one-line storage fault (exit 75), both
    before anything is built. A directory of files that are not a job's is trained into with a
    warning, since nothing there is overwritten but the user may have meant another one."""
    if os.path.exists(job_dir) and not os.path.isdir(job_dir):
        raise ExistsError(f"--job_log_dir={job_dir} is a file, not a directory: give the path "
                          "of a directory (a new one is made)")
    above = os.path.dirname(job_dir)
    while above and not os.path.exists(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)
    if above and os.path.exists(above) and not os.path.isdir(above):
        raise UsageError(f"--job_log_dir={job_dir} lies under {above}, which is a file: give the "
                         "path of a directory")
    with refused_writes(job_dir):
        os.makedirs(job_dir, exist_ok=True)
    names = os.listdir(job_dir)
    if names and not any(name in _JOB_ENTRIES for name in names):
        logging.warning("--job_log_dir=%s holds %d entr%s and none of a paxlite job's (%s): the "
                        "run writes its own beside them", job_dir, len(names),
                        "y" if len(names) == 1 else "ies", ", ".join(_JOB_ENTRIES))


def check_checkpoints_writable(job_dir: str) -> None:
    """A job's checkpoints/ that storage will not write to (read-only, its permissions taken) is
    found before the first step, not at the first save: one file made and removed there."""
    directory = os.path.join(job_dir, "checkpoints")
    if not os.path.isdir(directory):
        return
    probe = os.path.join(directory, f".paxlite-write-check-{os.getpid()}")
    with refused_writes(directory):
        open(probe, "w").close()
        os.remove(probe)


def refuse_a_newer_format(job_dir: str) -> None:
    """The job's newest checkpoint written in a format this paxlite does not read: refused before
    anything is written, so that the job's config.json still names the paxlite that wrote it (the
    refusal's line points the user there)."""
    from etils import epath

    from paxlite.checkpointing.checkpoint_damage import CheckpointFormatError, newer_format

    directory = os.path.join(job_dir, "checkpoints")
    names = os.listdir(directory) if os.path.isdir(directory) else []
    steps = [(int(name[len("checkpoint_"):]), name) for name in names
             if name.startswith("checkpoint_") and name[len("checkpoint_"):].isdigit()]
    if steps and (problem := newer_format(epath.Path(directory) / max(steps)[1])):
        raise CheckpointFormatError(problem)


def _require_checkpoints(job_dir: str) -> None:
    directory = os.path.join(job_dir, "checkpoints")
    names = os.listdir(directory) if os.path.isdir(directory) else []
    if not any(
        name.startswith("checkpoint_") and name[len("checkpoint_") :].isdigit() for name in names
    ):
        raise NotFoundError(
            f"--mode=eval needs a checkpoint, and {directory} has none; train first, point "
            "--job_log_dir at a training job's directory, or give --fdl.CHECKPOINT_RESTORE_PATH")


def run_job(
    experiment,
    tree,
    run_config,
    *,
    job_dir: str,
    mode: Mode,
    enable_checkpoint_saving: bool,
    argv: Sequence[str],
) -> int:
    """Train or evaluate a parsed job (after the multi-process runtime is joined); the exit
    status."""
    import jax

    from paxlite.train.loop import Run, RunContext, stop_signals
    from paxlite.train.peer_faults import PeerFaults
    from paxlite.train.peer_liveness import Activity

    exit_code_if_preempted = preemption_exit_code()  # a bad value is reported before any work
    job_dir = os.path.abspath(job_dir)
    training = mode is Mode.TRAIN
    if not training and run_config.loop.checkpoint_restore_path is None:
        _require_checkpoints(job_dir)  # before the run is built and anything written
    make_job_dir(job_dir)
    refuse_a_newer_format(job_dir)
    if training and enable_checkpoint_saving:
        check_checkpoints_writable(job_dir)
    with contextlib.ExitStack() as stack:
        # Stop signals are caught from before the run is built: one that comes while the step
        # compiles or the checkpoint is read stops the run after its first step, with a checkpoint;
        # with several processes too, whichever of them got it (the first step's vote is read once
        # it is computed).
        preemption = stack.enter_context(stop_signals()) if training else None
        # Several processes: a fault one of them meets from here on stops them all with its line.
        # A process that dies or freezes stops the others with a line naming it (peer_liveness.py).
        peers = stack.enter_context(PeerFaults(job_dir=job_dir))
        try:
            stack.enter_context(compilation_cache(run_config, job_dir=job_dir))
            run = stack.enter_context(Run(run_config, RunContext(
                job_dir=job_dir, enable_checkpoint_saving=enable_checkpoint_saving,
                training=training)))
            if jax.process_index() == 0:
                write_job_configs(job_dir, experiment=experiment, tree=tree, run=run, argv=argv)
            if not training:
                peers.progress.activity = Activity.EVALUATING
                run.run_eval()
                return 0
        except (UserError, RunStoppedError) as error:
            peers.stop_every_process(error)
            raise
        except Exception as error:  # a failed collective may be a lost peer: wait for the verdict
            peers.await_lost_peer(error)
            raise
        try:
            run.train(preemption=preemption, peers=peers)
        except Exception as error:  # one-line faults were told inside
            if not isinstance(error, (UserError, RunStoppedError)):
                peers.await_lost_peer(error)
            raise
        if run.preempted_at is not None:
            return exit_code_if_preempted if run.preempted_saved else PREEMPTED_UNSAVED_EXIT_CODE
    return 0
