"""The AXLearn-style launcher: one CPU training run (module-scoped, read by several tests), every
flag's mapping through the pure parse (no devices, no training), every bad input, the Fuji mesh
rules, and a 2-process CPU run joined through AXLearn's flags' environment variables."""

import json
import os
import socket
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from paxlite.cli.launch_plan import LaunchError, LaunchFlags, parse_launch, split_fdl_args
from paxlite.config.errors import ConfigError
from paxlite.config.modifiers import split_over_processes
from paxlite.experiments import fuji_mesh
from paxlite.parallel.distributed import DistributedError, Launch, LaunchSource
from tests.fork_server import paxlite_python
from tests.in_process import paxlite_main
from tests.xla_test_flags import COMPILE_FLAGS

REPO = Path(__file__).resolve().parents[1]
BASE = dict(module="text.gpt.c4_trainer", config="fuji-test-v1", data_dir="FAKE", jax_backend="cpu")


def _env(**extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "PAXLITE_", "DISTRIBUTED_", "NUM_PROCESSES", "PROCESS_ID"))
        or k.startswith("PAXLITE_TEST_")  # the suite's own (tests/fork_server.py)
    }
    return {**env, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", **extra}


def _launcher(args, *, env=None, timeout=300):
    return subprocess.run([paxlite_python(), "-m", "paxlite.launch_trainer_main", *args],
                          capture_output=True, text=True, env=env or _env(), timeout=timeout,
                          check=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """AXLearn's CPU smoke test, two steps (8 fake CPU devices from conftest's XLA_FLAGS)."""
    trainer_dir = tmp_path_factory.mktemp("launch") / "trainer"
    result = _launcher(
        [
            "--config_module=text.gpt.c4_trainer",
            "--config=fuji-test-v1",
            f"--trainer_dir={trainer_dir}",
            "--data_dir=FAKE",
            "--jax_backend=cpu",
            "--trainer_log_every_n_steps=1",
            "--trainer_prng_seed=7",
            "--fdl.MAX_STEPS=2",
            "--fdl.EVAL_LOOP_NUM_BATCHES=1",
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return trainer_dir


def _plan(env=None, fdl=(), **flags):
    return parse_launch(
        LaunchFlags.of(fdl=fdl, **{**BASE, "trainer_dir": "/tmp/never-made", **flags}),
        {} if env is None else env,
    )


def _hparams(env=None, fdl=(), num_devices=8, num_processes=1, **flags):
    plan = _plan(env, fdl, **flags)
    return plan.experiment(num_devices=num_devices, num_processes=num_processes)


# ---------------------------------------------------------------------------- the CPU training run
def test_cpu_run_writes_axlearns_layout(trained):
    assert sorted(os.listdir(trained / "checkpoints")) == ["checkpoint_00000002"]
    assert os.listdir(trained / "summaries" / "train")
    lines = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "loss" in line] == [1, 2]  # log every step


def test_cpu_run_writes_trainer_config_and_flags(trained):
    config = (trained / "trainer_config").read_text()
    assert config.startswith("# fuji-test-v1: paxlite.experiments.fuji.FujiTestV1\n")
    assert "ICI_MESH_SHAPE=[8, 1, 1], DCN_MESH_SHAPE=[1, 1, 1]" in config  # AXLearn's data=-1
    assert "SEED = 7" in config and "SYNTHETIC_DATA = True" in config
    flags = json.loads((trained / "launch_trainer_flags").read_text())
    assert (flags["config"], flags["module"], flags["data_dir"]) == (
        "fuji-test-v1", "text.gpt.c4_trainer", "FAKE")
    assert flags["fdl"] == ["MAX_STEPS=2", "EVAL_LOOP_NUM_BATCHES=1"]
    recorded = json.loads((trained / "config.json").read_text())
    assert (
        recorded["hparams"]["SEED"],
        recorded["global_batch_size"],
        recorded["mesh"]["data"],
    ) == (7, 64, 8)


# ---------------------------------------------------------------------------- flag mappings
def test_trainer_flags_map_onto_hyperparameters():
    e = _hparams(trainer_prng_seed=5, trainer_watchdog_timeout_seconds=60,
                 trainer_crash_on_hang_timeout_seconds=120, trainer_log_every_n_steps=10,
                 trace_at_steps=["20"], n_steps_for_each_trace=4)
    assert (e.SEED, e.WATCHDOG_TIMEOUT_SECONDS, e.CRASH_ON_HANG_TIMEOUT_SECONDS,
            e.SUMMARY_INTERVAL_STEPS, e.PROFILER_CAPTURE_STEP, e.PROFILER_NUM_STEPS) == (
        5, 60, 120, 10, 20, 4)
    e = _hparams()  # AXLearn's defaults
    assert (e.SEED, e.WATCHDOG_TIMEOUT_SECONDS, e.CRASH_ON_HANG_TIMEOUT_SECONDS,
            e.SUMMARY_INTERVAL_STEPS, e.PROFILER_CAPTURE_STEP, e.SYNTHETIC_DATA) == (
        0, 3600, 7200, 100, None, True)
    e = _hparams(fdl=["SEED=3", "MAX_STEPS=9"])  # --fdl where no flag is given
    assert (e.SEED, e.MAX_STEPS) == (3, 9)


def test_fdl_arguments_are_split_from_absl_ones():
    assert split_fdl_args(["prog", "--config=x", "--fdl.MAX_STEPS=3", "--fdl.A='b=c'"]) == (
        ["prog", "--config=x"], ["MAX_STEPS=3", "A='b=c'"])
    with pytest.raises(LaunchError, match="--fdl.MAX_STEPS: hyperparameter overrides are written"):
        split_fdl_args(["--fdl.MAX_STEPS"])


def test_data_dir_mapping(tmp_path, monkeypatch):
    tfds = tmp_path / "tfds"
    (tfds / "c4" / "en" / "3.0.1").mkdir(parents=True)
    (tfds / "c4" / "en" / "3.0.1" / "dataset_info.json").write_text("{}")
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "paxlite_dataset.json").write_text("{}")
    vocab = {"VOCAB_PATH": str(tmp_path / "bpe_32k_c4.model")}
    assert _plan(vocab, data_dir=str(tfds)).overrides["TFDS_DATA_DIR"] == str(tfds)
    assert _plan(data_dir=str(prepared)).overrides["DATA_DIR"] == str(prepared)
    assert _plan({"DATA_DIR": str(prepared), **vocab}, data_dir=None).overrides["DATA_DIR"] == str(
        prepared
    )
    assert _plan({"DATA_DIR": "FAKE"}, data_dir=None).overrides["SYNTHETIC_DATA"] is True
    with pytest.raises(LaunchError, match=r"--data_dir=/nope: no such directory; --data_dir=FAKE"):
        _plan(data_dir="/nope")
    with pytest.raises(LaunchError, match=r"holds neither the TFDS dataset c4/en:3.0.1 .* nor a "
                                          r"dataset made"):
        _plan(data_dir=str(tmp_path))
    with pytest.raises(LaunchError, match="needs a SentencePiece tokenizer \\(AXLearn's "
                                          "bpe_32k_c4.model"):
        _plan(data_dir=str(tfds))
    with pytest.raises(LaunchError, match="tiktoken tokenizer, which paxlite cannot run"):
        _plan(vocab, data_dir=str(tfds), config="fuji-8B-v3-tiktoken")
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(LaunchError, match=r"the default \(no --data_dir, no \$DATA_DIR\): "
                                          r"~/tensorflow_datasets"):
        _plan(data_dir=None)
    with pytest.raises(LaunchError, match="--data_dir and --fdl.SYNTHETIC_DATA both say"):
        _plan(fdl=["SYNTHETIC_DATA=true"])
    assert _plan(fdl=["SYNTHETIC_DATA=true"], data_dir=None).overrides["SYNTHETIC_DATA"] is True


def test_distributed_flags_and_environment():
    assert _plan().launch == Launch(source=LaunchSource.SINGLE)
    flags = dict(distributed_coordinator="10.0.0.1:1234", num_processes=4, process_id=3)
    want = Launch(source=LaunchSource.FLAGS, num_processes=4, process_id=3,
                  coordinator_address="10.0.0.1:1234")
    assert _plan(**flags).launch == want
    env = {"DISTRIBUTED_COORDINATOR": "10.0.0.1:1234", "NUM_PROCESSES": "4", "PROCESS_ID": "3"}
    assert _plan(env).launch == want
    assert _plan(env, process_id=1).launch.process_id == 1  # a flag beats its variable
    assert _plan(num_processes=1, process_id=0).launch.is_distributed is False
    slurm = {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_STEP_NODELIST": "n[1-2]"}
    # none of the three: paxlite's detection
    assert _plan(slurm).launch.source is LaunchSource.SLURM
    with pytest.raises(LaunchError, match="--num_processes and --process_id .* come together"):
        _plan(num_processes=2)
    with pytest.raises(LaunchError, match="--num_processes and --process_id .* come together"):
        _plan({"PROCESS_ID": "0"})
    with pytest.raises(LaunchError, match="DISTRIBUTED_COORDINATOR=h:1 also needs --num_processes"):
        _plan({"DISTRIBUTED_COORDINATOR": "h:1"})
    with pytest.raises(LaunchError, match="--num_processes=2 needs --distributed_coordinator"):
        _plan(num_processes=2, process_id=0)
    with pytest.raises(DistributedError, match="PROCESS_ID=5 is outside 0..3"):
        _plan({**env, "PROCESS_ID": "5"})
    assert _plan(initialization_timeout=17).timeouts.initialization_s == 17
    assert _plan({"PAXLITE_INIT_TIMEOUT_S": "9"}).timeouts.initialization_s == 9
    with pytest.raises(LaunchError, match="--initialization_timeout=0 must be at least 1"):
        _plan(initialization_timeout=0)


@pytest.mark.parametrize("flags, fdl, message", [
    (dict(module="text.gpt.pile_trainer"), (), ("--module=text.gpt.pile_trainer: not one of "
                                               "text.gpt.c4_trainer")),
    (dict(module=None), (), "--module is required: one of text.gpt.c4_trainer"),
    (dict(config="fuji-7b-v2"), (), ("--config=fuji-7b-v2: not a config of text.gpt.c4_trainer "
                                     r"\(did you mean 'fuji-7B-v2'")),
    (dict(config=None), (), "--config is required"),
    (dict(trainer_dir=None), (), "--trainer_dir is required"),
    (dict(trainer_dir="gs://bucket/dir"), (), "--trainer_dir"),
    (dict(jax_backend=None), (), "--jax_backend is required: one of cpu, gpu, tpu"),
    (dict(jax_backend="cuda"), (), "--jax_backend=cuda: not one of cpu, gpu, tpu"),
    (dict(jax_backend="proxy"), (), "--jax_backend=proxy is AXLearn's Pathways proxy"),
    (dict(status_port=7337), (), "--status_port: paxlite serves no status page"),
    (dict(init_module=["a:b"]), (), "--init_module: paxlite has no init-module hooks"),
    (dict(host_tracer_level=2), (), "--host_tracer_level: paxlite's profiler trace has no tracer"),
    (dict(trace_at_steps=["3", "9"]), (), "--trace_at_steps=3,9: paxlite traces one window"),
    (dict(trace_at_steps=["x"]), (), "--trace_at_steps=x: not a step number"),
    (dict(n_steps_for_each_trace=5), (), ("--n_steps_for_each_trace is read only with "
                                         "--trace_at_steps")),
    (dict(trainer_prng_seed=1), ("SEED=2",), "--trainer_prng_seed and --fdl.SEED set the same"),
    (dict(trace_at_steps=["3"]), ("PROFILER_NUM_STEPS=2",), ("--trace_at_steps and "
                                                            "--fdl.PROFILER_NUM_STEPS")),
    (dict(mesh_selector="tpu-v5p-512"), ("ICI_MESH_SHAPE=[8,1,1]",), ("--mesh_selector=tpu-v5p-512 "
                                                                     "and --fdl.ICI_MESH_SHAPE "
                                                                     "both set")),
    (dict(), ("MAX_STEP=3",), r"did you mean 'MAX_STEPS'"),
    (dict(trace_at_steps=["5000"]), (), ("PROFILER_CAPTURE_STEP must be a step from 1 to "
                                        "MAX_STEPS=3000")),
])
def test_bad_input_is_one_clear_error(flags, fdl, message):
    with pytest.raises((LaunchError, ConfigError, ValueError), match=message):
        _plan(fdl=fdl, **flags)


def test_backend_is_checked_against_the_devices():
    plan = _plan(jax_backend="gpu")
    plan.check_devices([SimpleNamespace(platform="gpu")] * 8)
    with pytest.raises(LaunchError, match=r"--jax_backend=gpu, but JAX found 8 cpu device\(s\); "
                                          "pass --jax_backend=cpu"):
        plan.check_devices([SimpleNamespace(platform="cpu")] * 8)


def test_cli_mistakes_exit_2_with_one_line_before_jax(tmp_path):
    result = _launcher(["--module=text.gpt.c4_trainer", "--config=fuji-7b-v2",
                        f"--trainer_dir={tmp_path}", "--jax_backend=cpu", "--data_dir=FAKE"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(
        "paxlite: error: --config=fuji-7b-v2: not a config of text.gpt.c4_trainer (did you mean")
    # the backend mismatch is found when the devices are first listed; still exit 2, one line
    result = _launcher([*[f"--{k}={v}" for k, v in BASE.items() if k != "jax_backend"],
                        "--jax_backend=gpu", f"--trainer_dir={tmp_path}"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert "paxlite: error: --jax_backend=gpu, but JAX found 8 cpu device(s)" in result.stderr
    assert not os.listdir(tmp_path)  # nothing written


# ---------------------------------------------------------------------------- mesh rules
def _mesh(config, selector, *, devices, processes):
    e = _hparams(
        config=config, mesh_selector=selector, num_devices=devices, num_processes=processes
    )
    return e.ICI_MESH_SHAPE, e.DCN_MESH_SHAPE, e.GRAD_ACCUM_STEPS, e.CHECKPOINT_POLICY


def test_mesh_rules_of_axlearns_table():
    # 7B on 32 p5 nodes: data -1, fsdp 8 -> fsdp within a node, data across the nodes
    assert _mesh("fuji-7B-v2", "gpu-p5.48xlarge-256", devices=256, processes=32)[:3] == (
        [1, 8, 1], [32, 1, 1], 1)
    # v5litepod-256 (64 hosts x 4 chips): fsdp 256 split over the hosts, gradient accumulation 4
    assert _mesh("fuji-7B-v2", "tpu-v5litepod-256", devices=256, processes=64)[:3] == (
        [1, 4, 1], [1, 64, 1], 4)
    assert (
        _mesh("fuji-7B-v3", "tpu-v5litepod-256-4", devices=1024, processes=256)[3]
        == "SAVE_DOT_ONLY"
    )
    assert _mesh("fuji-70B-v3", "gpu-a3-megagpu-8g-512", devices=512, processes=64)[:2] == (
        [1, 8, 1], [8, 8, 1])  # data 8 x fsdp 64: the 64 processes go on data 8 x fsdp 8
    assert _mesh("fuji-405B-v3", "tpu-v5p-1024", devices=512, processes=128)[:2] == (
        [1, 4, 1], [1, 128, 1])  # fsdp -1
    # no rule matches: AXLearn's defaults (1B-8B data -1 fsdp 8; 70B/405B fsdp -1)
    assert _mesh("fuji-7B-v2", "gpu-p5.48xlarge-8", devices=8, processes=1)[:2] == (
        [1, 8, 1],
        [1, 1, 1],
    )
    assert _mesh("fuji-70B-v2", None, devices=16, processes=2)[:2] == ([1, 8, 1], [1, 2, 1])
    assert _mesh("fuji-8B-v3-tiktoken", None, devices=16, processes=2)[:2] == ([1, 8, 1], [2, 1, 1])
    plan = _plan(config="fuji-7B-v2", mesh_selector="gpu-p5.48xlarge-8")
    assert plan.mesh.rule is None and "no mesh rule of fuji-7B-v2 matches" in plan.no_rule_warning()
    assert "gpu-(p5.48xlarge|p4de.24xlarge)-(256|512|1024)" in plan.no_rule_warning()
    a4 = fuji_mesh.select_mesh("7B", "gpu-a4-highgpu-8g-64")
    assert "FlashBlockSizeModifier" in a4.rule.not_reproduced
    # --fdl mesh instead of a rule
    assert _hparams(fdl=["ICI_MESH_SHAPE=[2,4,1]"]).ICI_MESH_SHAPE == [2, 4, 1]


def test_split_over_processes_is_axlearns_first_axis_rule():
    assert split_over_processes([2, 8, 1], 2) == ([1, 8, 1], [2, 1, 1])
    assert split_over_processes([1, 16, 1], 2) == ([1, 8, 1], [1, 2, 1])
    assert split_over_processes([4, 2, 1], 1) == ([4, 2, 1], [1, 1, 1])
    # where AXLearn's first-axis rule fails, the processes spill over to the next axis
    assert split_over_processes([2, 8, 1], 4) == ([1, 4, 1], [2, 2, 1])
    assert split_over_processes([8, 64, 1], 64) == ([1, 8, 1], [8, 8, 1])
    with pytest.raises(ConfigError, match=r"cannot be split over 2 processes"):
        split_over_processes([3, 1, 1], 2)
    with pytest.raises(ConfigError, match="fixed axes \\(8\\) do not divide 12 devices"):
        _hparams(config="fuji-7B-v2", num_devices=12)


# ---------------------------------------------------------------------------- two processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two launcher processes plus a one-process reference (~29 s on 2 cores)
@pytest.mark.multiprocess
def test_two_processes_from_axlearns_environment_variables(tmp_path):
    trainer_dir, port = tmp_path / "trainer", _free_port()
    # the session's compile flags without its 8-device flag: each process has 4 devices
    env = {**{k: v for k, v in _env().items() if not k.startswith("XLA_")},
           "XLA_FLAGS": COMPILE_FLAGS}
    procs = []
    for index in range(2):
        process_env = dict(
            env,
            JAX_NUM_CPU_DEVICES="4",
            DISTRIBUTED_COORDINATOR=f"127.0.0.1:{port}",
            NUM_PROCESSES="2",
            PROCESS_ID=str(index),
            PAXLITE_HEARTBEAT_TIMEOUT_S="10",
            PAXLITE_SHUTDOWN_TIMEOUT_S="10",
        )
        with open(tmp_path / f"p{index}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [
                        paxlite_python(),
                        "-m",
                        "paxlite.launch_trainer_main",
                        *[f"--{k}={v}" for k, v in BASE.items()],
                        f"--trainer_dir={trainer_dir}",
                        "--initialization_timeout=60",
                        "--fdl.MAX_STEPS=2",
                        "--fdl.EVAL_LOOP_NUM_BATCHES=1",
                        "--trainer_log_every_n_steps=1",
                    ],
                    env=process_env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = "\n".join((tmp_path / f"p{i}.log").read_text()[-2000:] for i in range(2))
    assert codes == [0, 0], logs
    assert all("timeouts: connect 60s" in (tmp_path / f"p{i}.log").read_text() for i in range(2))
    recorded = json.loads((trainer_dir / "config.json").read_text())
    assert (recorded["devices"]["process_count"], recorded["devices"]["count"]) == (2, 8)
    # the test model's data=-1 over 8 devices in two processes: ICI data 4, DCN data 2
    assert (
        "ICI_MESH_SHAPE=[4, 1, 1], DCN_MESH_SHAPE=[2, 1, 1]"
        in (trainer_dir / "trainer_config").read_text()
    )
    flags = json.loads((trainer_dir / "launch_trainer_flags").read_text())
    assert (flags["num_processes_resolved"], flags["process_id_resolved"]) == (2, 0)
    assert sorted(os.listdir(trainer_dir / "checkpoints")) == ["checkpoint_00000002"]


def test_a_value_only_the_config_dataclasses_refuse_is_one_line_from_both_entry_points(
    tmp_path, monkeypatch, capfd
):
    """LEARNING_RATE=-1 passes the experiment's own checks; the optimizer config's __post_init__
    refuses it while the run is built. Both entry points share that build (experiments/build.py:
    build_tree), so both report it as the user's mistake: one line, exit 2, nothing written."""
    result = _launcher([*[f"--{k}={v}" for k, v in BASE.items()], "--fdl.LEARNING_RATE=-1.0",
                        f"--trainer_dir={tmp_path / 'launcher'}"])
    assert result.returncode == 2, result.stderr[-2000:]
    # Fuji's weight decay is scaled by the learning rate, so its check is the first to fail.
    assert result.stderr.strip().splitlines()[-1] == (
        "paxlite: error: weight_decay must be a finite number >= 0, got -0.01.")
    assert "Traceback" not in result.stderr
    # paxlite.main in this process (tests/in_process.py): the value is refused before any work
    with paxlite_main(monkeypatch, capfd) as run:
        result = run("--fdl_config=TinySynthetic", "--fdl.LEARNING_RATE=-1.0",
                     f"--job_log_dir={tmp_path / 'main'}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "paxlite: error: learning_rate must be a finite number >= 0, got -1.0.")
    assert not (tmp_path / "main").exists()
