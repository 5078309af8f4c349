"""From the AXLearn-style launcher's flags to a plan: which experiment, which hyperparameters, which
mesh rule, which processes; everything checked before JAX touches a device.

Kept apart from `launch_trainer_main` (which defines the absl flags) so that the mapping of every
flag is a pure function of plain values and the environment, testable without absl or devices.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from paxlite.config.errors import did_you_mean
from paxlite.config.modifiers import (
    ChainConfigModifier,
    ConfigModifier,
    GlobalMeshShapeModifier,
    MeshShapeModifier,
)
from paxlite.config.overrides import parse_overrides
from paxlite.errors import UserError
from paxlite.experiments import fuji, fuji_mesh
from paxlite.experiments.build import configure
from paxlite.parallel import distributed

CONFIG_MODULES = ("text.gpt.c4_trainer",)  # AXLearn's module of the Fuji configs
BACKENDS = ("cpu", "gpu", "tpu")
FAKE = "FAKE"

# Every flag and its default (AXLearn's defaults where it has one).
DEFAULTS: Mapping[str, Any] = {
    "module": None, "config": None, "trainer_dir": None, "data_dir": None, "jax_backend": None,
    "mesh_selector": None, "distributed_coordinator": None, "num_processes": None,
    "process_id": None, "initialization_timeout": None, "trainer_prng_seed": 0,
    "trace_at_steps": [], "n_steps_for_each_trace": 3, "trainer_watchdog_timeout_seconds": 3600.0,
    "trainer_crash_on_hang_timeout_seconds": 7200.0, "trainer_log_every_n_steps": 100,
    "jax_profiler_port": None,
}
# AXLearn flags paxlite has no use for: refused when given (never accepted and ignored).
REFUSED: Mapping[str, str] = {
    "status_port": "paxlite serves no status page; progress is in DIR/metrics.jsonl and the log",
    "init_module": "paxlite has no init-module hooks; run set-up code before the launcher",
    "tpu_trace_mode": "paxlite's profiler trace has no TPU trace modes",
    "host_tracer_level": "paxlite's profiler trace has no tracer levels",
    "device_tracer_level": "paxlite's profiler trace has no tracer levels",
    "python_tracer_level": "paxlite's profiler trace has no tracer levels",
    "eval_trace_at_iters": "paxlite traces training steps only (--trace_at_steps)",
    "device_monitor": "paxlite has no device monitor; the hang watchdog is "
                      "--trainer_watchdog_timeout_seconds",
}
FLAG_NAMES: tuple[str, ...] = (*DEFAULTS, *REFUSED)
# Launcher flag -> the hyperparameter it sets (with the flag's value, its default included).
HPARAM_FLAGS: Mapping[str, str] = {
    "trainer_prng_seed": "SEED",
    "trainer_watchdog_timeout_seconds": "WATCHDOG_TIMEOUT_SECONDS",
    "trainer_crash_on_hang_timeout_seconds": "CRASH_ON_HANG_TIMEOUT_SECONDS",
    "trainer_log_every_n_steps": "SUMMARY_INTERVAL_STEPS",
}
_DATA_HPARAMS = ("SYNTHETIC_DATA", "DATA_DIR", "TFDS_DATA_DIR")
_MESH_HPARAMS = ("ICI_MESH_SHAPE", "DCN_MESH_SHAPE")
_ENV = {"distributed_coordinator": "DISTRIBUTED_COORDINATOR", "num_processes": "NUM_PROCESSES",
        "process_id": "PROCESS_ID"}


class LaunchError(UserError, ValueError):
    """A bad launcher command line (one line, exit status 2)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchFlags:
    """The flag values, the names given on the command line (`present`) and the --fdl.NAME=VALUE
    assignments: plain values, so every mapping is testable without absl."""

    values: Mapping[str, Any]
    present: frozenset[str] = frozenset()
    fdl: tuple[str, ...] = ()

    @classmethod
    def of(cls, fdl: Sequence[str] = (), **given: Any) -> LaunchFlags:
        """Flags as if `given` were on the command line (a None: not given), the rest at their
        defaults."""
        unknown = sorted(set(given) - set(FLAG_NAMES))
        if unknown:
            raise TypeError(f"not launcher flags: {unknown}")
        values = {**DEFAULTS, **{name: None for name in REFUSED}, **given}
        present = frozenset(name for name, value in given.items() if value is not None)
        return cls(values=values, present=present, fdl=tuple(fdl))

    def __getitem__(self, name: str) -> Any:
        return self.values[name]


def split_fdl_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the other arguments, ['NAME=VALUE', ...]) from `--fdl.NAME=VALUE` arguments."""
    rest, fdl = [], []
    for arg in argv:
        if arg.startswith("--fdl."):
            assignment = arg[len("--fdl."):]
            if "=" not in assignment:
                raise LaunchError(f"{arg}: hyperparameter overrides are written --fdl.NAME=VALUE")
            fdl.append(assignment)
        else:
            rest.append(arg)
    return rest, fdl


def _with_counts(
    modifier: ConfigModifier, *, num_devices: int, num_processes: int
) -> ConfigModifier:
    """`modifier` with the job's device and process counts filled in (no JAX call needed)."""
    if isinstance(modifier, GlobalMeshShapeModifier):
        return dataclasses.replace(modifier, num_devices=num_devices, num_processes=num_processes)
    if isinstance(modifier, MeshShapeModifier):
        return dataclasses.replace(modifier, num_local_devices=num_devices // num_processes,
                                   num_processes=num_processes)
    if isinstance(modifier, ChainConfigModifier):
        return ChainConfigModifier(
            [
                _with_counts(m, num_devices=num_devices, num_processes=num_processes)
                for m in modifier.config_modifiers
            ]
        )
    return modifier


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """Everything the launcher decided before touching a device."""

    config_name: str
    experiment_class: type[fuji.BaseFuji]
    overrides: Mapping[str, Any]  # hyperparameters from the flags and --fdl, on top of the mesh
    mesh: fuji_mesh.MeshChoice | None  # None: ICI/DCN_MESH_SHAPE given with --fdl
    trainer_dir: str
    backend: str
    launch: distributed.Launch
    timeouts: distributed.Timeouts
    flags: LaunchFlags

    def experiment(self, *, num_devices: int, num_processes: int) -> fuji.BaseFuji:
        """The resolved experiment on a job of `num_devices` devices over `num_processes`
        processes."""
        modifiers = [] if self.mesh is None else [
            _with_counts(self.mesh.modifier, num_devices=num_devices, num_processes=num_processes)]
        return configure(self.experiment_class, *modifiers, **self.overrides)

    def describe_mesh(self) -> str:
        return ("ICI_MESH_SHAPE / DCN_MESH_SHAPE as given with --fdl" if self.mesh is None
                else self.mesh.describe())

    def no_rule_warning(self) -> str:
        size = self.experiment_class.fuji_size
        patterns = fuji_mesh.rule_patterns(size)
        return (f"--mesh_selector={self.mesh.selector if self.mesh else None}: no mesh rule of "
                f"{self.config_name} matches (its rules: {patterns or 'none'}); using AXLearn's "
                f"default mesh for the {size} model")

    def check_devices(self, devices: Sequence[Any]) -> None:
        """--jax_backend against the devices JAX found: one clear error if they differ."""
        platforms = sorted({d.platform for d in devices})
        if platforms != [self.backend]:
            raise LaunchError(
                f"--jax_backend={self.backend}, but JAX found {len(devices)} "
                f"{'/'.join(platforms)} device(s); pass --jax_backend={platforms[0]}, or make the "
                f"{self.backend} devices visible (JAX_PLATFORMS, CUDA_VISIBLE_DEVICES)")

    def flags_record(self) -> dict[str, Any]:
        """What DIR/launch_trainer_flags holds: every flag's value, the --fdl assignments and the
        resolved launch."""
        return {**{name: self.flags[name] for name in FLAG_NAMES}, "fdl": list(self.flags.fdl),
                "mesh": self.describe_mesh(), "num_processes_resolved": self.launch.num_processes,
                "process_id_resolved": self.launch.process_id}


def _choice(name: str, value: Any, valid: Sequence[str]) -> str:
    if not value:
        raise LaunchError(f"--{name} is required: one of {', '.join(valid)}")
    if value not in valid:
        raise LaunchError(f"--{name}={value}: not one of "
                          f"{', '.join(valid)}{did_you_mean(value, valid)}")
    return value


def _config_class(name: str | None) -> type[fuji.BaseFuji]:
    names = fuji.named_trainer_configs()
    if not name:
        raise LaunchError("--config is required: an AXLearn config name such as fuji-7B-v2, "
                          "fuji-test-v1 (python -m paxlite list shows them all)")
    if name not in fuji.AXLEARN_NAMES:
        raise LaunchError(f"--config={name}: not a config of text.gpt.c4_trainer"
                          f"{did_you_mean(name, list(names))}; python -m paxlite list shows them "
                          "all")
    return getattr(fuji, fuji.AXLEARN_NAMES[name])


def _launch(flags: LaunchFlags, env: Mapping[str, str]) -> distributed.Launch:
    """AXLearn's rules (utils_spmd.setup, non-TPU) on the flags or their environment variables.

    None of the three: paxlite's own detection (SLURM, PAXLITE_* variables, else one process)."""
    given: dict[str, Any] = {}
    for name, var in _ENV.items():
        value = flags[name]
        if value is None and env.get(var, "").strip():
            value = env[var].strip()
            name_used = var
        else:
            name_used = f"--{name}"
        if value is not None:
            given[name] = (name_used, value)
    if not given:
        return distributed.detect_launch(multiprocess_gpu=False, server_addr=None, num_hosts=None,
                                         host_idx=None, env=env)
    if ("num_processes" in given) != ("process_id" in given):
        have = ", ".join(n for n, _ in given.values())
        raise LaunchError(f"{have}: --num_processes and --process_id (NUM_PROCESSES, PROCESS_ID) "
                          "come together, as in AXLearn")
    if "num_processes" not in given:  # a coordinator alone
        raise LaunchError(
            f"{given['distributed_coordinator'][0]}={given['distributed_coordinator'][1]} "
            "also needs --num_processes and --process_id"
        )
    names = tuple(given.get(n, (f"--{n}", None))[0] for n in _ENV)
    num = given["num_processes"][1]
    if "distributed_coordinator" not in given:
        if str(num).strip() == "1":  # AXLearn: localhost; one process needs no coordinator
            return distributed.explicit_launch(coordinator_address=None, num_processes=num,
                                               process_id=given["process_id"][1], names=names)
        raise LaunchError(f"{names[1]}={num} needs --distributed_coordinator=HOST:PORT "
                          "(DISTRIBUTED_COORDINATOR), the address of process 0")
    return distributed.explicit_launch(coordinator_address=str(given["distributed_coordinator"][1]),
                                       num_processes=num, process_id=given["process_id"][1],
                                       names=names)


def _trace_overrides(flags: LaunchFlags) -> dict[str, Any]:
    steps = [s.strip() for s in flags["trace_at_steps"] or [] if str(s).strip()]
    if not steps:
        if "n_steps_for_each_trace" in flags.present:
            raise LaunchError("--n_steps_for_each_trace is read only with --trace_at_steps=STEP; "
                              "add it, or drop --n_steps_for_each_trace")
        return {}
    if len(steps) > 1:
        raise LaunchError(f"--trace_at_steps={','.join(steps)}: paxlite traces one window of "
                          "steps; give one step (with --n_steps_for_each_trace=N steps)")
    try:
        step = int(steps[0])
    except ValueError:
        raise LaunchError(f"--trace_at_steps={steps[0]}: not a step number") from None
    return {"PROFILER_CAPTURE_STEP": step, "PROFILER_NUM_STEPS": flags["n_steps_for_each_trace"]}


def _data_overrides(flags: LaunchFlags, cls: type[fuji.BaseFuji], fdl_values: Mapping[str, Any],
                    env: Mapping[str, str]) -> dict[str, Any]:
    given = [n for n in _DATA_HPARAMS if n in fdl_values]
    if given:
        if "data_dir" in flags.present:
            raise LaunchError(f"--data_dir and --fdl.{given[0]} both say where the data is; give "
                              "one")
        return {}  # the --fdl values say it
    raw, source = flags["data_dir"], "--data_dir"
    if raw is None and env.get("DATA_DIR"):
        raw, source = env["DATA_DIR"], "$DATA_DIR"
    if raw is None:
        raw, source = "~/tensorflow_datasets", "the default (no --data_dir, no $DATA_DIR)"
    if raw == FAKE:
        return {"SYNTHETIC_DATA": True}
    from paxlite.data.records import MANIFEST
    from paxlite.data.tfds_datasets import TfdsName
    from paxlite.paths import require_local_path

    require_local_path(raw, setting="--data_dir")
    path = os.path.abspath(os.path.expanduser(raw))
    where = f"--data_dir={raw}" if source == "--data_dir" else f"{source}: {raw}"
    fake = "; --data_dir=FAKE trains on synthetic data"
    if not os.path.isdir(path):
        raise LaunchError(f"{where}: no such directory{fake}")
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return {"DATA_DIR": path}
    dataset = fdl_values.get("TFDS_DATASET", cls.TFDS_DATASET)
    tfds_dir = TfdsName.parse(dataset).directory(path)
    if not os.path.isfile(os.path.join(tfds_dir, "dataset_info.json")):
        raise LaunchError(
            f"{where}: holds neither the TFDS dataset {dataset} ({tfds_dir}/dataset_info.json) nor "
            f"a dataset made by python -m paxlite.data.prepare ({path}/{MANIFEST}){fake}")
    if cls.fuji_version == "3-tiktoken":
        raise LaunchError(
            f"{cls.axlearn_name} reads text with Llama 3's tiktoken tokenizer, which paxlite "
            "cannot run (SentencePiece models only): use --data_dir=FAKE (synthetic tokens), or a "
            "tokenized dataset directory (paxlite_dataset.json)")
    if not (fdl_values.get("VOCAB_PATH") or env.get("VOCAB_PATH")):
        vocab = "bpe_128k_c4.model" if cls.fuji_version == "3" else "bpe_32k_c4.model"
        raise LaunchError(
            f"{where}: text from TFDS needs a SentencePiece tokenizer (AXLearn's {vocab} for "
            f"{cls.axlearn_name}): pass --fdl.VOCAB_PATH=FILE or set VOCAB_PATH")
    return {"TFDS_DATA_DIR": path}


def parse_launch(flags: LaunchFlags, env: Mapping[str, str]) -> LaunchPlan:
    """The plan of a launch, every user mistake raised as one LaunchError/UserError line."""
    refused = [name for name in REFUSED if name in flags.present]
    if refused:
        raise LaunchError(f"--{refused[0]}: {REFUSED[refused[0]]}")
    _choice("module", flags["module"], CONFIG_MODULES)
    cls = _config_class(flags["config"])
    if not flags["trainer_dir"]:
        raise LaunchError("--trainer_dir is required: the job directory (checkpoints/, summaries/, "
                          "metrics.jsonl)")
    from paxlite.paths import require_local_path

    require_local_path(flags["trainer_dir"], setting="--trainer_dir")
    backend = flags["jax_backend"]
    if backend == "proxy":
        raise LaunchError("--jax_backend=proxy is AXLearn's Pathways proxy, which paxlite does not "
                          f"run on; use one of {', '.join(BACKENDS)}")
    _choice("jax_backend", backend, BACKENDS)
    fdl_values = parse_overrides(cls, flags.fdl)
    overrides: dict[str, Any] = {}
    for flag, hparam in HPARAM_FLAGS.items():
        if hparam in fdl_values and flag in flags.present:
            raise LaunchError(f"--{flag} and --fdl.{hparam} set the same hyperparameter; give one")
        if hparam not in fdl_values:
            overrides[hparam] = flags[flag]
    trace = _trace_overrides(flags)
    clash = sorted(set(trace) & set(fdl_values))
    if clash:
        raise LaunchError(f"--trace_at_steps and --fdl.{clash[0]} both set the trace; give one")
    overrides.update(trace)
    overrides.update(_data_overrides(flags, cls, fdl_values, env))
    overrides.update(fdl_values)
    mesh_given = [n for n in _MESH_HPARAMS if n in fdl_values]
    if mesh_given and flags["mesh_selector"]:
        raise LaunchError(f"--mesh_selector={flags['mesh_selector']} and --fdl.{mesh_given[0]} "
                          "both set the mesh; give one")
    mesh = None if mesh_given else fuji_mesh.select_mesh(cls.fuji_size, flags["mesh_selector"])
    configure(cls, **overrides)  # every hyperparameter checked now, before any device
    timeouts = distributed.timeouts_from_env(env)
    if flags["initialization_timeout"] is not None:
        if flags["initialization_timeout"] < 1:
            raise LaunchError(f"--initialization_timeout={flags['initialization_timeout']} must be "
                              "at least 1 second")
        timeouts = dataclasses.replace(timeouts, initialization_s=flags["initialization_timeout"])
    return LaunchPlan(config_name=flags["config"], experiment_class=cls, overrides=overrides,
                      mesh=mesh, trainer_dir=os.path.abspath(flags["trainer_dir"]), backend=backend,
                      launch=_launch(flags, env), timeouts=timeouts, flags=flags)
