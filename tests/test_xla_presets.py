"""paxlite.xla_presets: every preset flag is one the installed jaxlib parses, the user's flags win
flag by flag, and the scripts export the preset. The jaxlib itself is the reference: XLA aborts on a
flag it does not know."""

import os
import subprocess
import sys

import jax
import pytest

from paxlite import xla_presets as xp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("XLA_FLAGS", "BASE_XLA_FLAGS", "XLA_PRESET", "JAX_OPTIMIZATION_LEVEL")
    }
    env["PATH"] = os.path.dirname(sys.executable) + ":" + env["PATH"]
    env["PYTHONPATH"] = ROOT
    return {**env, **extra}


@pytest.fixture(scope="module")
def probe():
    """xp.probe, asked once per flag list in this module: each probe starts a Python with JAX
    (about a second of CPU), and one jaxlib gives one flag list the same answer every time."""
    answers = {}
    real_probe = xp.probe  # `resolved` puts probe_once in its place

    def probe_once(flags, **kwargs):
        key = tuple(flags)
        if key not in answers:
            answers[key] = real_probe(flags, **kwargs)
        return answers[key]

    return probe_once


@pytest.fixture(scope="module")
def resolved(probe):
    """Each distinct preset flag list resolved once against the installed jaxlib (its probes
    remembered by `probe`)."""
    by_flags = {}
    out = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(xp, "probe", probe)
        for name, preset in xp.PRESETS.items():
            if preset.flags not in by_flags:
                by_flags[preset.flags] = xp.resolve(preset)
            out[name] = by_flags[preset.flags]
    return out


def test_probe_tells_an_unknown_flag_and_knows_gpu_flags_on_the_cpu():
    # GPU-only, CPU jaxlib
    assert xp.probe(["--xla_gpu_enable_latency_hiding_scheduler=true"]) is None
    assert xp.probe(["--xla_gpu_enable_command_buffer=", "--xla_paxlite_no_such_flag=1"]) == (
        "--xla_paxlite_no_such_flag=1")


@pytest.mark.parametrize("name", sorted(xp.PRESETS))
def test_every_preset_flag_is_accepted_by_the_installed_jaxlib(name, resolved, probe):
    result = resolved[name]
    assert result.dropped == (), f"{name}: the jaxlib knows no spelling of {result.dropped}"
    assert len(result.flags) == len(xp.PRESETS[name].flags)
    assert probe(list(result.flags)) is None  # and all of them together
    for key, value in xp.PRESETS[name].env:
        if key == "JAX_OPTIMIZATION_LEVEL":  # a value jax's config accepts
            jax.config.update("jax_optimization_level", value)
            jax.config.update("jax_optimization_level", "UNKNOWN")


def test_pipelining_uses_the_enum_exactly_where_the_jaxlib_has_it(resolved, probe):
    enum_known = probe(["--xla_gpu_pipeline_all_reduce=on"]) is None
    chosen = [f for f in resolved["moe-large"].flags if "pipeline" in f]
    assert len(chosen) == 3
    expected = (
        "--xla_gpu_pipeline_all_reduce=on"
        if enum_known
        else "--xla_gpu_enable_pipelined_all_reduce=true"
    )
    assert expected in chosen


def test_user_flags_win_flag_by_flag():
    merged = xp.merge(["--xla_a=1", "--xla_b=2", "--xla_c="], "--xla_b=9 --xla_d")
    assert merged.split() == ["--xla_a=1", "--xla_c=", "--xla_b=9", "--xla_d"]


@pytest.mark.parametrize(
    "experiment,preset",
    [
        ("Pile126M", "gpt126m"),
        ("Synthetic126M", "gpt126m"),
        ("paxlite.experiments.gpt.Lambada126M", "gpt126m"),
        ("GLaM126M64E", "moe"),
        ("SyntheticGLaM126M64E", "moe"),
        ("TinyMixtral", "moe"),
        ("Qwen3_30B_A3B", "moe-fsdp"),
        ("LLaMA7B", "llama"),
        ("fuji-1B-v3-flash", "llama"),
        ("Synthetic5B", "gpt5b"),
        ("GPT175B", "gpt175b"),
        ("TinySynthetic", "common"),
    ],
)
def test_experiment_to_preset(experiment, preset):
    assert xp.preset_for_experiment(experiment) == preset


def test_cli_unknown_preset_is_one_line_exit_2(capfd):
    """`python -m paxlite.xla_presets` runs main(); called here, it stops before any probe."""
    capfd.readouterr()
    assert xp.main(["--model=gtp126m"]) == 2
    assert capfd.readouterr().err.strip().splitlines() == [
        "paxlite: error: unknown XLA preset 'gtp126m' (did you mean 'gpt126m'?); valid: "
        + ", ".join(xp.PRESETS)]


def test_script_exports_the_preset_and_keeps_the_users_settings():
    script = ('source scripts_gpu/common.sh; paxlite_set_xla_flags --experiment=Pile126M; '
              'echo "$XLA_FLAGS"; echo "$JAX_OPTIMIZATION_LEVEL"; echo '
              '"$XLA_PYTHON_CLIENT_MEM_FRACTION"')
    env = _env(XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION --xla_dump_to=/tmp/x",
               XLA_PYTHON_CLIENT_MEM_FRACTION="0.5")
    result = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    flags, level, fraction = result.stdout.splitlines()
    assert flags.split() == [
        "--xla_allow_excess_precision=true",
        "--xla_gpu_enable_triton_gemm=false",
        "--xla_gpu_all_reduce_combine_threshold_bytes=33554432",
        "--xla_gpu_enable_command_buffer=FUSION",
        "--xla_dump_to=/tmp/x",
    ]
    assert (level, fraction) == ("O1", "0.5")
    # Pax's BASE_XLA_FLAGS replaces the preset's flags; XLA_PRESET picks another preset
    env = _env(BASE_XLA_FLAGS="--xla_gpu_enable_triton_gemm=true", XLA_PRESET="moe-large")
    result = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.splitlines() == ["--xla_gpu_enable_triton_gemm=true", "O1", "0.9"]


# ------------------------------------------------------------------------------------------------
# Platforms: every preset is a GPU preset, and none reaches a TPU run


def _devices(tmp_path, *nodes):
    """A fake /dev holding `nodes` (a name ending in / is a folder)."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for node in nodes:
        path = dev / node.rstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        if node.endswith("/"):
            path.mkdir()
        else:
            path.touch()
    return str(dev)


@pytest.mark.parametrize("environ, nodes, want", [
    ({"JAX_PLATFORMS": "tpu"}, (), xp.Platform.TPU),
    ({"JAX_PLATFORMS": "cuda,cpu"}, ("accel0",), xp.Platform.GPU),  # JAX_PLATFORMS first
    ({"JAX_PLATFORMS": "cpu"}, ("accel0",), xp.Platform.CPU),
    ({"TPU_ACCELERATOR_TYPE": "v5litepod-1"}, (), xp.Platform.TPU),
    ({}, ("nvidia0", "nvidiactl"), xp.Platform.GPU),
    ({}, ("nvidiactl", "vfio/0"), xp.Platform.GPU),  # a GPU host with a VFIO group
    ({}, ("accel0", "accel1"), xp.Platform.TPU),
    ({}, ("vfio/vfio", "vfio/1"), xp.Platform.TPU),  # a TPU v5e VM's nodes
    ({}, ("vfio/vfio",), None),  # the VFIO control node alone: no device
    ({}, ("accel/accel0",), None),  # the kernel's DRM accel folder is not a TPU
    ({"JAX_PLATFORMS": ""}, (), None),
])
def test_the_platform_is_read_from_the_environment_and_device_nodes(tmp_path, environ, nodes,
                                                                      want):
    detected = xp.detect_platform(environ=environ, dev_dir=_devices(tmp_path, *nodes))
    assert detected.platform is want, detected


def test_every_preset_is_a_gpu_preset_and_none_applies_on_a_tpu():
    for preset in xp.PRESETS.values():
        assert preset.platform is xp.Platform.GPU
        assert not preset.applies_on(xp.Platform.TPU)
        # as before platforms were declared: on the CPU and where nothing tells
        assert all(preset.applies_on(p) for p in (xp.Platform.GPU, xp.Platform.CPU, None))


def test_a_tpu_run_gets_no_preset_env_and_a_gpu_run_todays(caplog):
    environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/x", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    today, _ = xp.environment(xp.PRESETS["gpt126m"], base_flags=None, environ=environ,
                              probe_jaxlib=False)
    assert today["JAX_OPTIMIZATION_LEVEL"] == "O1"
    for platform in ("gpu", xp.Platform.GPU, "cpu"):
        assert xp.environment_for(experiment="Pile126M", platform=platform, environ=environ,
                                  probe_jaxlib=False) == today
    caplog.clear()
    with caplog.at_level("INFO", logger=xp.__name__):
        assert xp.environment_for(experiment="Pile126M", platform="tpu", environ=environ) == {}
        assert xp.environment_for(model="moe-large", platform="auto",
                                  environ={"JAX_PLATFORMS": "tpu"}) == {}
    assert [r.getMessage() for r in caplog.records] == [
        ("paxlite.xla_presets: gpt126m is a GPU preset and this is a TPU run (platform=tpu): no "
         "XLA flags or variables set (GPU presets' JAX_OPTIMIZATION_LEVEL=O1 slows TPU steps)"),
        ("paxlite.xla_presets: moe-large is a GPU preset and this is a TPU run "
         "(JAX_PLATFORMS=tpu): no XLA flags or variables set (GPU presets' "
         "JAX_OPTIMIZATION_LEVEL=O1 slows TPU steps; if this is a GPU run, set "
         "JAX_PLATFORMS=cuda)"),
    ]


def test_cli_refuses_a_gpu_preset_asked_for_a_tpu_in_one_line(capfd):
    capfd.readouterr()
    assert xp.main(["--model=gpt126m", "--platform=tpu"]) == 2
    out, err = capfd.readouterr()
    assert out == ""
    assert err.splitlines() == [
        ("paxlite: error: --model=gpt126m is a GPU preset and --platform=tpu: its "
         "JAX_OPTIMIZATION_LEVEL=O1 slows TPU steps (halved GPT126M's on a TPU v5e) and TPUs "
         "ignore --xla_gpu_* flags; paxlite has no TPU presets: run without one")]


def test_cli_on_a_tpu_exports_nothing_and_says_so(capfd, monkeypatch):
    """An experiment's preset on a TPU (asked with --platform, or detected: JAX_PLATFORMS): no
    export line, the user's XLA_FLAGS as they are, one line on stderr. --platform=gpu keeps the
    preset."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    capfd.readouterr()
    assert xp.main(["--experiment=Pile126M", "--platform=tpu", "--format=shell"]) == 0
    out, err = capfd.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith("paxlite.xla_presets: gpt126m is a GPU preset and this is a TPU run")
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    assert xp.main(["--experiment=Pile126M"]) == 0
    out, err = capfd.readouterr()
    assert out == "--xla_dump_to=/tmp/x\n" and "(JAX_PLATFORMS=tpu)" in err
    assert xp.main(["--experiment=Pile126M", "--platform=gpu", "--format=shell",
                    "--no_probe"]) == 0
    out, err = capfd.readouterr()
    assert "export JAX_OPTIMIZATION_LEVEL=O1" in out.splitlines() and err == ""


def test_script_on_a_tpu_exports_nothing():
    script = ('source scripts_gpu/common.sh; paxlite_set_xla_flags --experiment=Pile126M; '
              'echo "$XLA_FLAGS|${JAX_OPTIMIZATION_LEVEL:-unset}|'
              '${XLA_PYTHON_CLIENT_MEM_FRACTION:-unset}"')
    env = {k: v for k, v in _env(JAX_PLATFORMS="tpu", XLA_FLAGS="--xla_dump_to=/tmp/x").items()
           if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
    result = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.splitlines() == ["--xla_dump_to=/tmp/x|unset|unset"]
    assert len(result.stderr.splitlines()) == 1 and "TPU run" in result.stderr
