"""Per-model XLA flag presets, as Pax's `xla_flags/*.env` files had them, in today's spellings.

Pax shipped one env file per model family (common.env for GLaM, GPT-5B/175B and LLaMA-70B;
gpt-126m.env; llama-7b*.env; grok-proxy.env for large MoE). Several of their flags were renamed or
dropped since, and XLA aborts the whole process on a flag it does not know ("Unknown flag in
XLA_FLAGS"), so a preset here is not a fixed string: each entry lists its spellings, newest first,
and `resolve` asks the installed jaxlib which one it parses (a subprocess that starts JAX on the CPU
with the candidate flags: XLA's flag table is one for every backend, so the CPU client parses
GPU-only flags too, as checked with jaxlib 0.10.2 and 0.12.0.1; the CUDA plugin of the same release
carries the same table). An entry no spelling of which is known is dropped and reported, never
passed on to abort a training job.

What changed from Pax's files (docs/performance.md, "XLA flag presets"):
- `--xla_gpu_enable_latency_hiding_scheduler=true` -> `JAX_OPTIMIZATION_LEVEL=O1`, which turns on
  the latency-hiding scheduler (and, per JAX-Toolbox, collective pipelining and while-loop double
  buffering).
- `--xla_gpu_enable_pipelined_{all_gather,all_reduce,reduce_scatter}=true` -> the enums
  `--xla_gpu_pipeline_*=on` where the jaxlib knows them; older jaxlibs get the booleans.
- `--xla_gpu_enable_highest_priority_async_stream` is left out: XLA made it the default.
- `--xla_gpu_enable_custom_fusions=true` (grok-proxy.env) is left out: XLA removed the flag (its
  name is a reserved field of DebugOptions now, and the jaxlib rejects it).
- `--xla_gpu_enable_cudnn_fmha=false` (gpt-126m.env) is left out: it steered XLA's automatic
  attention rewrite, and paxlite chooses the attention kernel itself (ATTENTION_KIND /
  USE_CUDNN_FLASH_ATTENTION).

The user's XLA_FLAGS win flag by flag: a flag the user sets replaces the preset's flag of the same
name, the rest of the preset stays. An environment variable the user has set is likewise kept.

Every preset declares its platform, and every one here is a GPU preset. None is ever applied to a
TPU run: its `JAX_OPTIMIZATION_LEVEL=O1` applies to TPU compiles too, and halved GPT126M's step on
one TPU v5e (batch 4, seq 2048: 0.150 -> 0.305 s per step, 2026-12-07), while its `--xla_gpu_*`
flags are ignored there and only hide what runs. No TPU preset exists (none has been measured to
help). The platform is read without opening an accelerator, since presets are exported before
JAX starts (`detect_platform`): JAX_PLATFORMS's first entry; else TPU_ACCELERATOR_TYPE set means
a TPU; else an NVIDIA device node (/dev/nvidia0, /dev/nvidiactl) a GPU; else a TPU device node
(/dev/accel<N>, or a VFIO group /dev/vfio/<N>: a TPU v5e VM seen on 2026-12-07 had /dev/vfio/1,
no /dev/accel*, and TPU_ACCELERATOR_TYPE=v5litepod-4) a TPU; else unknown. A preset applies on
its own platform, on the CPU and where the platform is unknown (as before platforms were
declared), never on another accelerator: there the command prints one line saying so and exports
nothing, or, given `--platform` and a preset by name (`--model`), exits 2 with one line.

    python -m paxlite.xla_presets --model=gpt126m                 # the XLA_FLAGS string
    python -m paxlite.xla_presets --experiment=Pile126M --format=shell   # export lines for a script
    python -m paxlite.xla_presets --list
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import logging
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence

from paxlite.errors import UserError, exit_status

_log = logging.getLogger(__name__)


def flag_name(token: str) -> str:
    """'--xla_foo=1' -> 'xla_foo' (the name XLA keys its flags by)."""
    return token.lstrip("-").split("=", 1)[0]


@dataclasses.dataclass(frozen=True)
class Flag:
    """One preset entry: its spellings, newest first (each a whole `--name=value` token)."""

    spellings: tuple[str, ...]

    @property
    def name(self) -> str:
        return flag_name(self.spellings[0])


class Platform(str, enum.Enum):
    """A run's JAX backend, as far as presets care."""

    GPU = "gpu"
    TPU = "tpu"
    CPU = "cpu"

    @classmethod
    def parse(cls, value: str | Platform) -> Platform:
        try:
            return cls(str(value.value if isinstance(value, Platform) else value).lower())
        except ValueError:
            raise UserError(f"platform {value!r} is not valid; expected one of "
                            f"{', '.join(p.value for p in cls)}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preset:
    name: str
    doc: str
    flags: tuple[Flag, ...]
    env: tuple[tuple[str, str], ...]
    platform: Platform  # the only accelerator it is for (module docstring: where it applies)

    def applies_on(self, platform: Platform | None) -> bool:
        """On its own platform, on the CPU, and where the platform is unknown (None); never on
        another accelerator."""
        return platform in (None, Platform.CPU, self.platform)


def _flag(*spellings: str) -> Flag:
    return Flag(tuple(spellings))


def _pipelined(collective: str) -> Flag:
    # The enum (openxla/xla PR #45836, 2026-07) replaced the boolean; `on` is the old `true`.
    return _flag(
        f"--xla_gpu_pipeline_{collective}=on", f"--xla_gpu_enable_pipelined_{collective}=true"
    )


def _with(base: Sequence[Flag], *changes: Flag) -> tuple[Flag, ...]:
    """`base` with each change replacing the entry of the same flag name, or appended."""
    by_name = {flag.name: flag for flag in base}
    for change in changes:
        by_name[change.name] = change
    return tuple(by_name.values())


# Pax's common.env (and its scripts' defaults), 2026 spellings. The combine threshold of 51200 bytes
# is Pax's; it is small on purpose for data parallelism over many small gradients.
_COMMON = (
    _flag("--xla_allow_excess_precision=true"),
    _flag("--xla_gpu_enable_triton_gemm=false"),
    _flag("--xla_gpu_all_reduce_combine_threshold_bytes=51200"),
    _flag("--xla_gpu_enable_command_buffer="),  # CUDA graphs off, as Pax and MaxText's H100 recipes
)
_COMMON_ENV = (("JAX_OPTIMIZATION_LEVEL", "O1"), ("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.8"))

PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(name="common", doc="Pax common.env: the defaults of every other preset",
               flags=_COMMON, env=_COMMON_ENV, platform=Platform.GPU),
        Preset(
            name="gpt126m",
            doc="Pax gpt-126m.env: all-reduce combine threshold 32 MiB (Pile126M, Synthetic126M)",
            flags=_with(_COMMON, _flag("--xla_gpu_all_reduce_combine_threshold_bytes=33554432")),
            env=_COMMON_ENV,
            platform=Platform.GPU,
        ),
        Preset(name="gpt5b", doc="Pax common.env, as Pax used for GPT-5B", flags=_COMMON,
               env=_COMMON_ENV, platform=Platform.GPU),
        Preset(name="gpt175b", doc="Pax common.env, as Pax used for GPT-175B", flags=_COMMON,
               env=_COMMON_ENV, platform=Platform.GPU),
        Preset(name="llama", doc="Pax llama-7b.env / common.env (LLaMA, Fuji)", flags=_COMMON,
               env=_COMMON_ENV, platform=Platform.GPU),
        Preset(
            name="llama-lora",
            doc="Pax llama-7b-lora.env: memory fraction 0.85",
            flags=_COMMON,
            env=(("JAX_OPTIMIZATION_LEVEL", "O1"), ("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")),
            platform=Platform.GPU,
        ),
        Preset(
            name="moe",
            doc="Pax common.env, as Pax used for GLaM-126M/64E and GLaM-64B/64E (GLaM, Mixtral)",
            flags=_COMMON,
            env=_COMMON_ENV,
            platform=Platform.GPU,
        ),
        Preset(
            name="moe-fsdp",
            doc="common.env's flags, memory fraction 0.95: an MoE fine-tune whose whole state is "
                "sharded over 8 GPUs (Qwen3-30B-A3B: 73.73 GiB planned of an H100's 79.11)",
            flags=_COMMON,
            env=(("JAX_OPTIMIZATION_LEVEL", "O1"), ("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")),
            platform=Platform.GPU,
        ),
        Preset(
            name="moe-large",
            doc="Pax grok-proxy.env: large combine thresholds, pipelined collectives, "
                "while-loop double buffering, no rematerialization pass",
            flags=_with(
                _COMMON,
                _flag("--xla_gpu_all_reduce_combine_threshold_bytes=3221225472"),
                _flag("--xla_gpu_all_gather_combine_threshold_bytes=3221225472"),
                _flag("--xla_gpu_reduce_scatter_combine_threshold_bytes=402653184"),
                _pipelined("all_reduce"),
                _pipelined("all_gather"),
                _pipelined("reduce_scatter"),
                _flag("--xla_gpu_enable_while_loop_double_buffering=true"),
                _flag("--xla_gpu_enable_all_gather_combine_by_dim=false"),
                _flag("--xla_gpu_enable_reduce_scatter_combine_by_dim=false"),
                _flag("--xla_disable_hlo_passes=rematerialization"),
            ),
            env=(("JAX_OPTIMIZATION_LEVEL", "O1"), ("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")),
            platform=Platform.GPU,
        ),
    )
}

# Experiment name -> preset, first match wins (case-insensitive search); MoE before sizes:
# GLaM126M64E.
_EXPERIMENT_PATTERNS = (
    (r"grok", "moe-large"),
    (r"30b_a3b", "moe-fsdp"),
    (r"glam|mixtral|moe", "moe"),
    (r"lora", "llama-lora"),
    (r"llama|fuji", "llama"),
    (r"126m", "gpt126m"),
    (r"175b", "gpt175b"),
    (r"5b", "gpt5b"),
)

_UNKNOWN_FLAG = re.compile(r"Unknown flags? in XLA_FLAGS: (\S+)")


def preset_for_experiment(experiment: str) -> str:
    """The preset Pax used for an experiment's family; 'common' for anything else."""
    short = experiment.rsplit(".", 1)[-1]
    for pattern, preset in _EXPERIMENT_PATTERNS:
        if re.search(pattern, short, re.IGNORECASE):
            return preset
    return "common"


def preset_name(*, model: str | None = None, experiment: str | None = None) -> str:
    """A preset by name (`model`, checked by get_preset), or an experiment's family preset; with
    neither, 'common'."""
    if model is not None and experiment is not None:
        raise UserError(f"give a preset (model={model!r}) or an experiment "
                        f"(experiment={experiment!r}), not both")
    return preset_for_experiment(experiment) if experiment is not None else (model or "common")


# ------------------------------------------------------------------------------------------------
# The platform a run will have, read before JAX starts (module docstring: the rule)

# JAX_PLATFORMS entries -> platform (jax's names; "gpu" is its older name for cuda/rocm)
_JAX_PLATFORM_NAMES = {"tpu": Platform.TPU, "cuda": Platform.GPU, "rocm": Platform.GPU,
                       "gpu": Platform.GPU, "cpu": Platform.CPU}
_NVIDIA_NODES = ("nvidia0", "nvidiactl")
_TPU_NODE = re.compile(r"accel\d+")  # /dev/accel0, ... (the kernel's DRM accel/ is a folder)


@dataclasses.dataclass(frozen=True)
class DetectedPlatform:
    platform: Platform | None  # None: nothing tells (a preset then applies, as it always did)
    evidence: str  # what told, for the line that says a preset was not applied


def detect_platform(*, environ: Mapping[str, str] | None = None,
                    dev_dir: str = "/dev") -> DetectedPlatform:
    """The platform a JAX process started here would have, from its environment and device
    nodes only: nothing is opened, so a launch script can ask before JAX holds the chip."""
    environ = os.environ if environ is None else environ
    first = environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if first in _JAX_PLATFORM_NAMES:
        return DetectedPlatform(_JAX_PLATFORM_NAMES[first],
                                f"JAX_PLATFORMS={environ['JAX_PLATFORMS']}")
    if environ.get("TPU_ACCELERATOR_TYPE"):
        return DetectedPlatform(Platform.TPU,
                                f"TPU_ACCELERATOR_TYPE={environ['TPU_ACCELERATOR_TYPE']}")
    for node in _NVIDIA_NODES:
        if os.path.exists(os.path.join(dev_dir, node)):
            return DetectedPlatform(Platform.GPU, os.path.join(dev_dir, node))
    try:
        nodes = sorted(os.listdir(dev_dir))
    except OSError:
        nodes = []
    accel = [n for n in nodes if _TPU_NODE.fullmatch(n)]
    if accel:
        return DetectedPlatform(Platform.TPU, os.path.join(dev_dir, accel[0]))
    vfio = os.path.join(dev_dir, "vfio")
    groups = sorted(n for n in os.listdir(vfio) if n.isdigit()) if os.path.isdir(vfio) else []
    if groups:
        return DetectedPlatform(Platform.TPU, os.path.join(vfio, groups[0]))
    return DetectedPlatform(None, "no JAX_PLATFORMS, TPU_ACCELERATOR_TYPE or device node")


def not_applied_line(preset: Preset, detected: DetectedPlatform, *, detected_here: bool) -> str:
    """The one line that says a preset was left out, and why (`detected_here`: the platform is
    detect_platform's guess, which the line says how to correct)."""
    platform = detected.platform.value.upper() if detected.platform else "unknown"
    hint = ("; if this is a GPU run, set JAX_PLATFORMS=cuda" if detected_here
            and preset.platform is Platform.GPU else "")
    return (f"paxlite.xla_presets: {preset.name} is a {preset.platform.value.upper()} preset and "
            f"this is a {platform} run ({detected.evidence}): no XLA flags or variables set "
            f"(GPU presets' JAX_OPTIMIZATION_LEVEL=O1 slows TPU steps{hint})")


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=2, cutoff=0.5)
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise UserError(f"unknown XLA preset {name!r}{hint}; valid: {', '.join(PRESETS)}")
    return PRESETS[name]


def probe(
    flags: Sequence[str], *, python: str = sys.executable, timeout_s: float = 120.0
) -> str | None:
    """The first flag of `flags` the installed jaxlib rejects as unknown, or None if it takes them
    all.

    Starts JAX's CPU backend in a subprocess with XLA_FLAGS set to exactly `flags`: XLA parses
    XLA_FLAGS when its first client starts, and aborts naming the first unknown flag.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [python, "-c", "import jax; jax.devices()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if result.returncode == 0:
        return None
    match = _UNKNOWN_FLAG.search(result.stderr)
    if match is None:
        raise RuntimeError(f"probing XLA_FLAGS={' '.join(flags)!r} failed for another reason:\n"
                           f"{result.stderr[-2000:]}")
    return match.group(1)


@dataclasses.dataclass(frozen=True)
class Resolved:
    flags: tuple[str, ...]  # the spelling chosen for each entry the jaxlib knows
    dropped: tuple[Flag, ...]  # entries none of whose spellings it knows


def resolve(preset: Preset, *, python: str = sys.executable) -> Resolved:
    """Each entry's first spelling the installed jaxlib accepts (one probe, plus one per unknown
    flag)."""
    choice = {flag.name: 0 for flag in preset.flags}
    dropped: list[Flag] = []
    live = list(preset.flags)
    while True:
        current = [flag.spellings[choice[flag.name]] for flag in live]
        unknown = probe(current, python=python)
        if unknown is None:
            return Resolved(tuple(current), tuple(dropped))
        index = next(
            (i for i, token in enumerate(current) if flag_name(token) == flag_name(unknown)), None
        )
        if index is None:
            raise RuntimeError(f"the jaxlib rejected {unknown!r}, which is not among {current}")
        flag = live[index]
        if choice[flag.name] + 1 < len(flag.spellings):
            choice[flag.name] += 1
        else:
            dropped.append(flag)
            del live[index]


def merge(preset_flags: Sequence[str], user_flags: str) -> str:
    """The preset's flags, less those the user's XLA_FLAGS name, then the user's flags (the user
    wins)."""
    user = shlex.split(user_flags)
    overridden = {flag_name(token) for token in user if token.startswith("-")}
    kept = [token for token in preset_flags if flag_name(token) not in overridden]
    return " ".join([*kept, *user])


def environment(preset: Preset, *, base_flags: str | None, environ: Mapping[str, str],
                probe_jaxlib: bool = True) -> tuple[dict[str, str], tuple[Flag, ...]]:
    """The variables to export: XLA_FLAGS (preset + the user's, the user winning) and the preset's
    other variables, each unless the user set it. `base_flags` (Pax's BASE_XLA_FLAGS) replaces the
    preset's flags, unprobed, as in Pax's scripts."""
    dropped: tuple[Flag, ...] = ()
    if base_flags is not None:
        flags: Sequence[str] = shlex.split(base_flags)
    elif probe_jaxlib:
        resolved = resolve(preset)
        flags, dropped = resolved.flags, resolved.dropped
    else:
        flags = [flag.spellings[0] for flag in preset.flags]
    out = {"XLA_FLAGS": merge(flags, environ.get("XLA_FLAGS", ""))}
    for key, value in preset.env:
        out[key] = environ.get(key, value)
    return out, dropped


def environment_for(*, model: str | None = None, experiment: str | None = None,
                    platform: Platform | str, base_flags: str | None = None,
                    environ: Mapping[str, str] | None = None,
                    probe_jaxlib: bool = True) -> dict[str, str]:
    """The variables to export for a run of preset `model` (or `experiment`'s family preset) on
    `platform` ("auto": detect_platform's answer): `environment`'s, or {} where the preset is not
    for that platform (any preset on a TPU), logged in one line. A left-out flag is logged too.
    `environ` (default os.environ) holds the user's XLA_FLAGS and variables, which win."""
    environ = os.environ if environ is None else environ
    preset = get_preset(preset_name(model=model, experiment=experiment))
    detected = (detect_platform(environ=environ) if str(platform) == "auto"
                else DetectedPlatform(Platform.parse(platform), f"platform={platform!s}"))
    if not preset.applies_on(detected.platform):
        _log.warning("%s", not_applied_line(preset, detected,
                                            detected_here=str(platform) == "auto"))
        return {}
    env, dropped = environment(preset, base_flags=base_flags, environ=environ,
                               probe_jaxlib=probe_jaxlib)
    for flag in dropped:
        _log.warning("%s", _dropped_line(preset, flag))
    return env


def _dropped_line(preset: Preset, flag: Flag) -> str:
    return (f"paxlite.xla_presets: {preset.name}: left out {' / '.join(flag.spellings)}: this "
            "jaxlib knows none of these spellings")


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m paxlite.xla_presets", description=__doc__.split("\n")[0]
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", help=f"preset name: {', '.join(PRESETS)}")
    which.add_argument("--experiment", help="an experiment name (Pile126M, LLaMA7B, ...): its "
                                            "family's preset")
    which.add_argument("--list", action="store_true", help="print the presets and their flags")
    parser.add_argument("--format", default="flags", choices=("flags", "shell", "json"),
                        help="flags: the XLA_FLAGS string; shell: export lines; json: everything")
    parser.add_argument("--platform", default="auto",
                        choices=("auto", *(p.value for p in Platform)),
                        help="the run's platform; auto: from JAX_PLATFORMS, TPU_ACCELERATOR_TYPE "
                             "and the device nodes (no preset is applied on a TPU)")
    parser.add_argument("--no_probe", action="store_true",
                        help="print the newest spellings without asking the installed jaxlib")
    args = parser.parse_args(argv)
    try:
        if args.list:
            for preset in PRESETS.values():
                print(f"{preset.name}: {preset.doc} [{preset.platform.value} only]")
                print("    " + " ".join(" | ".join(f.spellings) for f in preset.flags))
                print("    " + " ".join(f"{k}={v}" for k, v in preset.env))
            return 0
        preset = get_preset(preset_name(model=args.model, experiment=args.experiment))
        if args.platform == "auto":
            detected = detect_platform(environ=os.environ)
        else:
            detected = DetectedPlatform(Platform(args.platform), f"--platform={args.platform}")
        applied = preset.applies_on(detected.platform)
        if not applied and args.platform != "auto" and args.model is not None:
            raise UserError(
                f"--model={args.model} is a {preset.platform.value.upper()} preset and "
                f"--platform={args.platform}: its JAX_OPTIMIZATION_LEVEL=O1 slows TPU steps "
                "(halved GPT126M's on a TPU v5e) and TPUs ignore --xla_gpu_* flags; paxlite has "
                f"no {args.platform.upper()} presets: run without one")
        dropped: tuple[Flag, ...] = ()
        env: dict[str, str] = {}
        if applied:
            env, dropped = environment(
                preset,
                base_flags=os.environ.get("BASE_XLA_FLAGS"),
                environ=os.environ,
                probe_jaxlib=not args.no_probe,
            )
    except UserError as e:
        return exit_status(e)
    if not applied:
        print(not_applied_line(preset, detected, detected_here=args.platform == "auto"),
              file=sys.stderr)
    for flag in dropped:
        print(_dropped_line(preset, flag), file=sys.stderr)
    if args.format == "flags":  # not applied: the user's own, unchanged
        print(env.get("XLA_FLAGS", os.environ.get("XLA_FLAGS", "")))
    elif args.format == "shell":
        for key, value in env.items():
            print(f"export {key}={shlex.quote(value)}")
    else:
        print(json.dumps({"preset": preset.name, "platform": preset.platform.value,
                          "applied": applied, "env": env,
                          "dropped": [list(f.spellings) for f in dropped]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
