"""Joining a multi-process JAX job: from Pax's flags, SLURM, or a Kubernetes Indexed Job.

Which processes form the job is decided by `detect_launch`, a pure function of the command-line
values and the environment, so every rule below is unit-tested with plain dicts. In order:

1. `--multiprocess_gpu --server_addr=HOST:PORT --num_hosts=N --host_idx=I` (Pax's flags) win.
2. `PAXLITE_COORDINATOR_ADDRESS` + `PAXLITE_NUM_PROCESSES`, with the index from
   `PAXLITE_PROCESS_ID` or Kubernetes' `JOB_COMPLETION_INDEX` (Indexed Jobs).
3. SLURM in an srun step (`SLURM_NTASKS` > 1 and `SLURM_PROCID` set): index `SLURM_PROCID`;
   coordinator on the first host of the step's node list (task 0 runs there), port
   `PAXLITE_COORDINATOR_PORT` or 12345 + `SLURM_JOB_ID` mod 4096.
4. Otherwise one process, and `jax.distributed` is not started.

JAX's own cluster detection is switched off (`cluster_detection_method="deactivate"`) once the three
numbers are known: under SLURM it would otherwise make each process see only GPU `SLURM_LOCALID`,
which breaks Pax's one-process-per-node layout with 8 GPUs. Restrict devices with
`JAX_LOCAL_DEVICE_IDS` or `CUDA_VISIBLE_DEVICES`.

Timeouts are bounded so a process whose peer died exits with an error instead of waiting forever:
`PAXLITE_INIT_TIMEOUT_S` (connecting, default 300), `PAXLITE_HEARTBEAT_TIMEOUT_S` (a peer silent
this long is declared lost, default 60) and `PAXLITE_SHUTDOWN_TIMEOUT_S` (waiting for peers at exit,
default 60). paxlite's own watcher declares the lost peer (train/peer_liveness.py: one line, exit
status 75); JAX's heartbeat timeout is set `JAX_HEARTBEAT_MARGIN_S` above it, so that the runtime's
own end of the process (SIGABRT) is left for what paxlite's watcher cannot see.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
from collections.abc import Mapping

from absl import logging

from paxlite.errors import RunStoppedError, UserError

DEFAULT_SLURM_PORT = 12345
JAX_HEARTBEAT_MARGIN_S = 30


class DistributedError(UserError, ValueError):
    """A multi-process launch that is incomplete or inconsistent."""


class ConnectionFailedError(RunStoppedError, RuntimeError):
    """`jax.distributed.initialize` raised (e.g. JAX was already in use).

    A coordinator that cannot be reached in time does not raise: JAX aborts the process
    (DEADLINE_EXCEEDED), which is also a bounded, non-zero exit.
    """


class LaunchSource(str, enum.Enum):
    """Where the process layout came from (logged, and recorded by tests)."""

    SINGLE = "single"
    FLAGS = "flags"
    ENV = "env"
    KUBERNETES = "kubernetes"
    SLURM = "slurm"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Launch:
    """This process's place in the job; `coordinator_address` is None for a single process."""

    source: LaunchSource
    num_processes: int = 1
    process_id: int = 0
    coordinator_address: str | None = None

    @property
    def is_distributed(self) -> bool:
        return self.source is not LaunchSource.SINGLE


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timeouts:
    """Seconds for `jax.distributed.initialize`: connect, declare a silent peer dead, exit."""

    initialization_s: int = 300
    heartbeat_s: int = 60
    shutdown_s: int = 60

    @property
    def jax_heartbeat_s(self) -> int:
        """JAX's own heartbeat timeout: past paxlite's, and its verdict's publication and wait."""
        return self.heartbeat_s + JAX_HEARTBEAT_MARGIN_S


def _int(value: str | int | None, *, name: str, minimum: int) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        raise DistributedError(f"{name}={value!r} is not an integer") from None
    if number < minimum:
        raise DistributedError(f"{name}={number} must be at least {minimum}")
    return number


def _check_address(address: str, *, name: str) -> str:
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"{name}={address!r} is not HOST:PORT (for example 10.0.0.1:12345)")
    return address.strip()


def _check_index(*, num: int, index: int, names: tuple[str, str, str]) -> None:
    if not 0 <= index < num:
        raise DistributedError(
            f"{names[2]}={index} is outside 0..{num - 1} for {names[1]}={num} "
            f"process{'es' if num != 1 else ''} (process ids count from 0)"
        )


def _checked(
    *, source: LaunchSource, address: str, num: int, index: int, names: tuple[str, str, str]
) -> Launch:
    _check_address(address, name=names[0])
    _check_index(num=num, index=index, names=names)
    return Launch(source=source, num_processes=num, process_id=index, coordinator_address=address)


def explicit_launch(
    *,
    coordinator_address: str | None,
    num_processes: int | str,
    process_id: int | str,
    names: tuple[str, str, str],
) -> Launch:
    """A launch given by its three values (the AXLearn-style launcher's --distributed_coordinator,
    --num_processes, --process_id), checked as Pax's flags are; `names` spell them in messages.

    No coordinator: one process (AXLearn's localhost), so the id must be 0; a different id is
    refused rather than ignored (it may be one process of a job whose other flags were lost).
    """
    num = _int(num_processes, name=names[1], minimum=1)
    index = _int(process_id, name=names[2], minimum=0)
    if coordinator_address is not None:
        return _checked(source=LaunchSource.FLAGS, address=coordinator_address, num=num,
                        index=index, names=names)
    if num != 1:
        raise DistributedError(f"{names[1]}={num} needs {names[0]}=HOST:PORT, the address of "
                               "process 0")
    _check_index(num=num, index=index, names=names)
    return Launch(source=LaunchSource.SINGLE)


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[003-005,9],cpu1' -> 'gpu003'."""
    match = re.match(r"\s*([^,\[\s]+)(?:\[([^\]]+)\])?", nodelist)
    if not match or not match.group(1):
        raise DistributedError(f"cannot read a host from SLURM node list {nodelist!r}")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _from_flags(*, server_addr: str | None, num_hosts: int | None, host_idx: int | None) -> Launch:
    missing = [
        f"--{n}"
        for n, v in (("server_addr", server_addr), ("num_hosts", num_hosts), ("host_idx", host_idx))
        if v is None
    ]
    if missing:
        raise DistributedError(f"--multiprocess_gpu needs {', '.join(missing)} (as in Pax)")
    num = _int(num_hosts, name="--num_hosts", minimum=1)
    index = _int(host_idx, name="--host_idx", minimum=0)
    return _checked(
        source=LaunchSource.FLAGS,
        address=str(server_addr),
        num=num,
        index=index,
        names=("--server_addr", "--num_hosts", "--host_idx"),
    )


def _from_paxlite_env(env: Mapping[str, str]) -> Launch:
    missing = [
        n for n in ("PAXLITE_COORDINATOR_ADDRESS", "PAXLITE_NUM_PROCESSES") if not env.get(n)
    ]
    index_name = "PAXLITE_PROCESS_ID" if env.get("PAXLITE_PROCESS_ID") else "JOB_COMPLETION_INDEX"
    if not env.get(index_name):
        missing.append("PAXLITE_PROCESS_ID (or Kubernetes' JOB_COMPLETION_INDEX)")
    if missing:
        raise DistributedError(
            f"a multi-process launch from the environment also needs {', '.join(missing)}"
        )
    source = LaunchSource.ENV if index_name == "PAXLITE_PROCESS_ID" else LaunchSource.KUBERNETES
    num = _int(env["PAXLITE_NUM_PROCESSES"], name="PAXLITE_NUM_PROCESSES", minimum=1)
    index = _int(env[index_name], name=index_name, minimum=0)
    return _checked(
        source=source,
        address=env["PAXLITE_COORDINATOR_ADDRESS"],
        num=num,
        index=index,
        names=("PAXLITE_COORDINATOR_ADDRESS", "PAXLITE_NUM_PROCESSES", index_name),
    )


def _from_slurm(env: Mapping[str, str]) -> Launch:
    num = _int(env["SLURM_NTASKS"], name="SLURM_NTASKS", minimum=1)
    index = _int(env["SLURM_PROCID"], name="SLURM_PROCID", minimum=0)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    # Task 0 (the coordinator) runs on the step's first node; the launch node may be a login node.
    host = first_slurm_host(nodelist) if nodelist else env.get("SLURM_LAUNCH_NODE_IPADDR")
    if not host:
        raise DistributedError(
            "under SLURM with several tasks but neither SLURM_STEP_NODELIST, "
            "SLURM_JOB_NODELIST nor "
            "SLURM_LAUNCH_NODE_IPADDR is set; pass --multiprocess_gpu --server_addr=HOST:PORT ..."
        )
    if env.get("PAXLITE_COORDINATOR_PORT"):
        port = _int(env["PAXLITE_COORDINATOR_PORT"], name="PAXLITE_COORDINATOR_PORT", minimum=1)
    else:
        # Jobs sharing a node must not share a port.
        job_id = env.get("SLURM_JOB_ID", "0")
        port = DEFAULT_SLURM_PORT + (int(job_id) % 4096 if job_id.isdigit() else 0)
    return _checked(
        source=LaunchSource.SLURM,
        address=f"{host}:{port}",
        num=num,
        index=index,
        names=("SLURM coordinator", "SLURM_NTASKS", "SLURM_PROCID"),
    )


def _slurm_tasks(env: Mapping[str, str]) -> int:
    if not env.get("SLURM_NTASKS"):
        return 1
    return _int(env["SLURM_NTASKS"], name="SLURM_NTASKS", minimum=1)


def detect_launch(
    *,
    multiprocess_gpu: bool,
    server_addr: str | None,
    num_hosts: int | None,
    host_idx: int | None,
    env: Mapping[str, str],
) -> Launch:
    """This process's place in the job, from Pax's flags or the environment (see module doc)."""
    if multiprocess_gpu:
        return _from_flags(server_addr=server_addr, num_hosts=num_hosts, host_idx=host_idx)
    given = [
        f"--{n}"
        for n, v in (("server_addr", server_addr), ("num_hosts", num_hosts), ("host_idx", host_idx))
        if v is not None
    ]
    if given:
        raise DistributedError(
            f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} with "
            "--multiprocess_gpu; add it (as in Pax)"
        )
    if env.get("PAXLITE_COORDINATOR_ADDRESS") or env.get("PAXLITE_NUM_PROCESSES"):
        return _from_paxlite_env(env)
    if _slurm_tasks(env) > 1 and "SLURM_PROCID" in env:  # in an srun step, not a bare salloc shell
        return _from_slurm(env)
    return Launch(source=LaunchSource.SINGLE)


def timeouts_from_env(env: Mapping[str, str]) -> Timeouts:
    """Timeouts from PAXLITE_{INIT,HEARTBEAT,SHUTDOWN}_TIMEOUT_S, each at least one second."""
    defaults = Timeouts()
    return Timeouts(
        initialization_s=_int(
            env.get("PAXLITE_INIT_TIMEOUT_S", defaults.initialization_s),
            name="PAXLITE_INIT_TIMEOUT_S",
            minimum=1,
        ),
        heartbeat_s=_int(
            env.get("PAXLITE_HEARTBEAT_TIMEOUT_S", defaults.heartbeat_s),
            name="PAXLITE_HEARTBEAT_TIMEOUT_S",
            minimum=1,
        ),
        shutdown_s=_int(
            env.get("PAXLITE_SHUTDOWN_TIMEOUT_S", defaults.shutdown_s),
            name="PAXLITE_SHUTDOWN_TIMEOUT_S",
            minimum=1,
        ),
    )


def initialize(launch: Launch, *, timeouts: Timeouts) -> None:
    """Start JAX's multi-process runtime for `launch` (not for one process); before any JAX use."""
    if not launch.is_distributed:
        logging.info("Single process: jax.distributed not started")
        return
    import jax

    logging.info(
        "Joining %d-process job as process %d via %s (coordinator %s; timeouts: connect %ds, "
        "heartbeat %ds, shutdown %ds)",
        launch.num_processes,
        launch.process_id,
        launch.source.value,
        launch.coordinator_address,
        timeouts.initialization_s,
        timeouts.heartbeat_s,
        timeouts.shutdown_s,
    )
    try:
        jax.distributed.initialize(
            coordinator_address=launch.coordinator_address,
            num_processes=launch.num_processes,
            process_id=launch.process_id,
            cluster_detection_method="deactivate",
            initialization_timeout=timeouts.initialization_s,
            heartbeat_timeout_seconds=timeouts.jax_heartbeat_s,
            shutdown_timeout_seconds=timeouts.shutdown_s,
        )
    except RuntimeError as e:  # includes jax.errors.JaxRuntimeError
        raise ConnectionFailedError(
            f"process {launch.process_id} of {launch.num_processes} could not join the job at "
            f"{launch.coordinator_address}: {e}"
        ) from e
    logging.info(
        "Process %d of %d: %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def setup(
    *,
    multiprocess_gpu: bool,
    server_addr: str | None,
    num_hosts: int | None,
    host_idx: int | None,
    env: Mapping[str, str] | None = None,
) -> Launch:
    """Detect the launch from flags and environment, then join it; DistributedError on bad input."""
    env = os.environ if env is None else env
    launch = detect_launch(
        multiprocess_gpu=multiprocess_gpu,
        server_addr=server_addr,
        num_hosts=num_hosts,
        host_idx=host_idx,
        env=env,
    )
    if not launch.is_distributed and _slurm_tasks(env) > 1:
        logging.warning(
            "SLURM_NTASKS=%s but no SLURM_PROCID (not started by srun): one process",
            env["SLURM_NTASKS"],
        )
    initialize(launch, timeouts=timeouts_from_env(env))
    return launch
