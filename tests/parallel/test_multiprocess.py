"""Several JAX processes: launch detection (pure, from fake environments) and real 2-process runs.

The `multiprocess` tests start `python -m paxlite.main` twice on this machine, 4 CPU devices each,
joined through Pax's --multiprocess_gpu flags and JAX's gloo collectives, and compare with one
8-device process (_start_pair: the other files' pairs whose mesh is not the point run on 2).
"""

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from paxlite.parallel.distributed import (
    DistributedError,
    Launch,
    LaunchSource,
    Timeouts,
    detect_launch,
    first_slurm_host,
    timeouts_from_env,
)
from tests.fork_server import paxlite_python
from tests.in_process import paxlite_main, train_in_this_process
from tests.xla_test_flags import COMPILE_FLAGS

NO_FLAGS = dict(multiprocess_gpu=False, server_addr=None, num_hosts=None, host_idx=None)


def _detect(env: dict[str, str], **flags) -> Launch:
    return detect_launch(env=env, **{**NO_FLAGS, **flags})


def test_pax_flags():
    launch = _detect(
        {"SLURM_NTASKS": "4", "SLURM_PROCID": "3"},
        multiprocess_gpu=True,
        server_addr="10.0.0.1:1234",
        num_hosts=2,
        host_idx=1,
    )
    assert launch == Launch(
        source=LaunchSource.FLAGS,
        num_processes=2,
        process_id=1,
        coordinator_address="10.0.0.1:1234",
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (dict(multiprocess_gpu=True, server_addr="h:1"), "needs --num_hosts, --host_idx"),
        (
            dict(multiprocess_gpu=True, server_addr="h:1", num_hosts=2, host_idx=2),
            r"--host_idx=2 is outside 0..1 for --num_hosts=2",
        ),
        (
            dict(multiprocess_gpu=True, server_addr="h", num_hosts=2, host_idx=0),
            "--server_addr='h' is not HOST:PORT",
        ),
        (
            dict(multiprocess_gpu=True, server_addr="h:1", num_hosts=0, host_idx=0),
            "--num_hosts=0 must be at least 1",
        ),
        (
            dict(server_addr="h:1", num_hosts=2),
            "--server_addr, --num_hosts only apply with --multiprocess_gpu",
        ),
    ],
)
def test_bad_pax_flags(flags, message):
    with pytest.raises(DistributedError, match=message):
        _detect({}, **flags)


def test_no_cluster_is_one_process():
    assert _detect({}) == Launch(source=LaunchSource.SINGLE)
    assert _detect({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}).source is LaunchSource.SINGLE


def test_slurm_coordinator_on_first_node_with_job_derived_port():
    env = {
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "2",
        "SLURM_JOB_ID": "4100",
        "SLURM_STEP_NODELIST": "gpu[007-010]",
        "SLURM_JOB_NODELIST": "gpu[001-010]",
        "SLURM_LAUNCH_NODE_IPADDR": "10.9.9.9",
    }
    # 12345 + 4100 mod 4096 = 12349.
    assert _detect(env) == Launch(
        source=LaunchSource.SLURM, num_processes=4, process_id=2, coordinator_address="gpu007:12349"
    )
    assert _detect({**env, "PAXLITE_COORDINATOR_PORT": "5000"}).coordinator_address == "gpu007:5000"
    del env["SLURM_STEP_NODELIST"], env["SLURM_JOB_NODELIST"]
    assert _detect(env).coordinator_address == "10.9.9.9:12349"


def test_slurm_outside_srun_or_without_host():
    # A bare `salloc -n 2` shell (no srun step, so no SLURM_PROCID) runs one process.
    assert _detect({"SLURM_NTASKS": "2"}).source is LaunchSource.SINGLE
    with pytest.raises(DistributedError, match="SLURM_STEP_NODELIST, SLURM_JOB_NODELIST nor"):
        _detect({"SLURM_NTASKS": "2", "SLURM_PROCID": "0"})


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("node1", "node1"),
        ("gpu[003-005,9],cpu1", "gpu003"),
        ("a-b[12,14]", "a-b12"),
        ("x1,x2", "x1"),
    ],
)
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_kubernetes_indexed_job():
    env = {
        "JOB_COMPLETION_INDEX": "3",
        "PAXLITE_COORDINATOR_ADDRESS": "job-0.svc:8476",
        "PAXLITE_NUM_PROCESSES": "4",
        "SLURM_NTASKS": "8",
        "SLURM_PROCID": "1",
    }
    assert _detect(env) == Launch(
        source=LaunchSource.KUBERNETES,
        num_processes=4,
        process_id=3,
        coordinator_address="job-0.svc:8476",
    )
    explicit = _detect({**env, "PAXLITE_PROCESS_ID": "0"})
    assert (explicit.source, explicit.process_id) == (LaunchSource.ENV, 0)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"PAXLITE_COORDINATOR_ADDRESS": "h:1", "PAXLITE_NUM_PROCESSES": "2"},
            "JOB_COMPLETION_INDEX",
        ),
        (
            {"PAXLITE_COORDINATOR_ADDRESS": "h:1", "JOB_COMPLETION_INDEX": "0"},
            "PAXLITE_NUM_PROCESSES",
        ),
        (
            {
                "PAXLITE_COORDINATOR_ADDRESS": "h:1",
                "PAXLITE_NUM_PROCESSES": "2",
                "JOB_COMPLETION_INDEX": "2",
            },
            "JOB_COMPLETION_INDEX=2 is outside 0..1",
        ),
        (
            {
                "PAXLITE_COORDINATOR_ADDRESS": "h:1",
                "PAXLITE_NUM_PROCESSES": "two",
                "JOB_COMPLETION_INDEX": "0",
            },
            "PAXLITE_NUM_PROCESSES='two' is not an integer",
        ),
    ],
)
def test_incomplete_environment(env, message):
    with pytest.raises(DistributedError, match=message):
        _detect(env)


def test_timeouts():
    assert timeouts_from_env({}) == Timeouts(initialization_s=300, heartbeat_s=60, shutdown_s=60)
    assert timeouts_from_env({"PAXLITE_HEARTBEAT_TIMEOUT_S": "7"}).heartbeat_s == 7
    # JAX's own timeout lies past paxlite's verdict (train/peer_liveness.py), which comes first
    assert Timeouts(heartbeat_s=7).jax_heartbeat_s == 37
    with pytest.raises(DistributedError, match="PAXLITE_INIT_TIMEOUT_S=0 must be at least 1"):
        timeouts_from_env({"PAXLITE_INIT_TIMEOUT_S": "0"})


# ------------------------------------------------------------------------------------------------
# Real processes.

STEPS = 3  # per phase; the two-phase run trains 2 x STEPS
EXPERIMENT = [
    "--fdl_config=TinySynthetic",
    "--fdl.NUM_LAYERS=1",
    "--fdl.ICI_MESH_SHAPE=[1,2,2]",
    "--fdl.DCN_MESH_SHAPE=[2,1,1]",
    "--fdl.SUMMARY_INTERVAL_STEPS=1",
    f"--fdl.CHECKPOINT_EVERY_N_STEPS={STEPS}",
    "--fdl.EVAL_INTERVAL_STEPS=1000",
    "--alsologtostderr",
]
_CLUSTER_VARS = ("SLURM_", "PAXLITE_", "JAX_", "XLA_", "OMPI_", "PMI_")


def _env(num_cpu_devices: int) -> dict[str, str]:
    """No XLA_FLAGS from conftest but its compile flags (each process sets its own device count), no
    cluster variables. The session's compilation cache stays (tests/conftest.py): JAX writes to it
    from process 0 only, so process 0 of a later pair (a resume, another test's pair of the same
    model and mesh) reads its programs back instead of compiling them again."""
    env = {
        k: v
        for k, v in os.environ.items()
        if (not k.startswith(_CLUSTER_VARS) or k == "JAX_COMPILATION_CACHE_DIR"
            or k.startswith("PAXLITE_TEST_"))  # the suite's own (tests/fork_server.py)
        and k != "JOB_COMPLETION_INDEX"
    }
    env.update(
        JAX_PLATFORMS="cpu",
        JAX_NUM_CPU_DEVICES=str(num_cpu_devices),
        XLA_FLAGS=COMPILE_FLAGS,
        PAXLITE_HEARTBEAT_TIMEOUT_S="10",
        PAXLITE_SHUTDOWN_TIMEOUT_S="10",
        PAXLITE_INIT_TIMEOUT_S="60",
    )
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(job: Path, flags: list[str], *, log: Path, num_cpu_devices: int,
           env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [paxlite_python(), "-m", "paxlite.main", f"--job_log_dir={job}", *flags],
            env={**_env(num_cpu_devices), **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _start_pair(job: Path, flags: list[str], logs: Path, *,
                devices_per_process: int = 4) -> list[subprocess.Popen]:
    """Processes 0 and 1 of a 2-process job, `devices_per_process` CPU devices each. A test whose
    property is the processes (each one's data, its signals, the resume), not a mesh of 8, asks
    for 2: a process costs about a quarter less CPU time on 2 devices than on 4 (the per-device
    work: Orbax's copies of each replicated array, the threads of 4 devices), whatever the mesh
    axes within the process."""
    port = _free_port()
    return [
        _start(
            job,
            [
                *flags,
                "--multiprocess_gpu",
                f"--server_addr=127.0.0.1:{port}",
                "--num_hosts=2",
                f"--host_idx={i}",
            ],
            log=logs / f"process{i}.log",
            num_cpu_devices=devices_per_process,
        )
        for i in range(2)
    ]


def _finish(procs: list[subprocess.Popen], logs: list[Path], *, timeout: float) -> None:
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    tails = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
    assert codes == [0] * len(procs), tails


def _train_losses(job: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


def _mesh_layout(log: str) -> list[int]:
    """The mesh's devices in mesh order, each as its rank among the job's device ids.

    build_mesh logs the ids; process 1's CPU devices are numbered from 2048, one process's from 4.
    """
    line = [line for line in log.splitlines() if "over device ids" in line][-1]
    ids = [int(i) for i in re.findall(r"\d+", line.split("over device ids ", 1)[1])]
    return [sorted(ids).index(i) for i in ids]


@pytest.mark.slow  # two-process runs, a resume and a one-process reference (~40 s on 2 cores)
@pytest.mark.multiprocess
def test_two_processes_resume_and_match_one_process(tmp_path, caplog):
    job, ref = tmp_path / "job", tmp_path / "ref"
    logs = [tmp_path / "process0.log", tmp_path / "process1.log"]
    procs = _start_pair(job, [*EXPERIMENT, f"--fdl.MAX_STEPS={STEPS}"], tmp_path)
    try:  # One process with 8 devices, uninterrupted, while the pair trains its first STEPS.
        ref_log = train_in_this_process(ref, [*EXPERIMENT, f"--fdl.MAX_STEPS={2 * STEPS}"],
                                        save_checkpoints=False, caplog=caplog)
    finally:
        _finish(procs, logs, timeout=240)
    # the second start resumes from the checkpoint at STEPS
    _finish(_start_pair(job, [*EXPERIMENT, f"--fdl.MAX_STEPS={2 * STEPS}"], tmp_path), logs,
            timeout=240)

    assert sorted(os.listdir(job / "checkpoints")) == ["checkpoint_00000003", "checkpoint_00000006"]
    assert all(f"Resumed from checkpoint step {STEPS}" in log.read_text() for log in logs)
    got, want = _train_losses(job), _train_losses(ref)
    assert sorted(got) == sorted(want) == list(range(1, 2 * STEPS + 1))
    assert max(abs(got[s] - want[s]) for s in want) < 1e-5, (got, want)
    # The hybrid mesh over two processes puts the same devices where the one-process layout does.
    assert (_mesh_layout(logs[0].read_text()) == _mesh_layout(logs[1].read_text())
            == _mesh_layout(ref_log) == list(range(8)))
    record = json.loads((job / "config.json").read_text())
    assert record["devices"]["process_count"] == 2 and record["devices"]["count"] == 8


@pytest.mark.multiprocess
def test_survivor_exits_with_an_error_when_its_peer_dies(tmp_path):
    job = tmp_path / "job"
    logs = [tmp_path / "process0.log", tmp_path / "process1.log"]
    # no checkpoints: the pair trains until one is killed, and saving would only add work
    flags = [*EXPERIMENT, "--fdl.MAX_STEPS=100000", "--fdl.CHECKPOINT_EVERY_N_STEPS=100000"]
    procs = _start_pair(job, flags, tmp_path)
    try:
        deadline = time.monotonic() + 180
        while not (job / "metrics.jsonl").exists() or len(_train_losses(job)) < 2:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "\n".join(
                log.read_text()[-3000:] for log in logs
            )
            time.sleep(0.1)
        procs[0].send_signal(signal.SIGKILL)  # the coordinator's process: the harder case
        killed_at = time.monotonic()
        code = procs[1].wait(timeout=90)
        elapsed = time.monotonic() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    survivor_log = logs[1].read_text()
    assert code != 0, survivor_log[-3000:]
    assert elapsed < 90
    assert "JAX distributed service detected fatal errors" in survivor_log, survivor_log[-3000:]


@pytest.mark.multiprocess
def test_process_whose_peer_never_comes_gives_up_after_the_init_timeout(tmp_path):
    log = tmp_path / "process1.log"
    flags = [
        *EXPERIMENT,
        "--multiprocess_gpu",
        f"--server_addr=127.0.0.1:{_free_port()}",
        "--num_hosts=2",
        "--host_idx=1",
    ]
    started = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.run(
            [paxlite_python(), "-m", "paxlite.main", f"--job_log_dir={tmp_path / 'job'}", *flags],
            env={**_env(4), "PAXLITE_INIT_TIMEOUT_S": "1"},  # the least it takes
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=90, check=False
        )
    text = log.read_text()
    assert proc.returncode != 0, text[-3000:]
    assert time.monotonic() - started < 60
    assert "timeouts: connect 1s" in text and "DEADLINE_EXCEEDED" in text, text[-3000:]


def test_bad_multiprocess_flags_are_one_clear_error(tmp_path, monkeypatch, capfd):
    # in this process (tests/in_process.py): the flags are refused before JAX joins any process
    with paxlite_main(monkeypatch, capfd) as run:
        proc = run("--fdl_config=TinySynthetic", f"--job_log_dir={tmp_path}", "--multiprocess_gpu",
                   "--server_addr=127.0.0.1:1", "--num_hosts=2", "--host_idx=2")
    assert proc.returncode == 2
    assert "paxlite: error: --host_idx=2 is outside 0..1 for --num_hosts=2" in proc.stderr
