"""Every manifest under k8s/, parsed as Kubernetes would read it and checked against what paxlite
reads: image and command, the coordinator wiring, volumes, GPUs, and the preemption and restart
settings."""

import math
import pathlib
import re

import fiddle as fdl
import pytest
import yaml

from paxlite.cli.job import preemption_exit_code
from paxlite.config.registry import resolve_experiment
from paxlite.experiments import EXPERIMENTS
from paxlite.experiments.build import load_experiment, run_tree
from paxlite.parallel.distributed import detect_launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
MANIFESTS = sorted((ROOT / "k8s").glob("*.yaml"))
WORKSPACE = "/opt/paxlite/workspace"  # docker/Dockerfile's mount point
PREEMPTED = 143
# AXLearn's launcher flags (launch.py and launch_trainer.py), which paxlite.launch_trainer_main
# takes
AXLEARN_FLAGS = {
    "module",
    "config_module",
    "config",
    "trainer_dir",
    "data_dir",
    "jax_backend",
    "mesh_selector",
    "distributed_coordinator",
    "num_processes",
    "process_id",
    "initialization_timeout",
    "trainer_prng_seed",
    "trace_at_steps",
    "trainer_watchdog_timeout_seconds",
    "trainer_crash_on_hang_timeout_seconds",
    "trainer_log_every_n_steps",
}


def _documents():
    return [
        (path.name, doc)
        for path in MANIFESTS
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def _jobs():
    return [(name, doc) for name, doc in _documents() if doc["kind"] == "Job"]


JOBS = _jobs()


def _container(job):
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def _env(container):
    return {item["name"]: item["value"] for item in container.get("env", [])}


def _flags(args):
    """['--a=1', '--b'] -> {'a': '1', 'b': None}; every argument is a flag."""
    flags = {}
    for arg in args:
        match = re.fullmatch(r"--([\w.]+)(?:=(.*))?", arg)
        assert match, f"not a --flag: {arg!r}"
        flags[match.group(1)] = match.group(2)
    return flags


def _job_dir(container):
    flags = _flags(container["args"])
    return flags.get("job_log_dir") or flags["trainer_dir"]


def _experiment(container):
    """The experiment the pod would run, through the checks paxlite.main's parse_job makes before
    any device."""
    module = container["command"][2]
    flags = _flags(container["args"])
    if module == "paxlite.main":
        assignments = [f"{k[4:]}={v}" for k, v in flags.items() if k.startswith("fdl.")]
        assignments.append(f"TFDS_DATA_DIR={flags['tfds_data_dir']!r}")
        name = flags["fdl_config"]
    # the AXLearn-style launcher, through its own flag parsing (the data directory is the cluster's)
    else:
        assert set(flags) <= AXLEARN_FLAGS, set(flags) - AXLEARN_FLAGS
        assert flags["module"] == "text.gpt.c4_trainer" and flags["jax_backend"] == "gpu"
        from paxlite.cli.launch_plan import LaunchFlags, parse_launch

        plan = parse_launch(LaunchFlags.of(**{**flags, "data_dir": "FAKE"}), {})
        experiment = plan.experiment(num_devices=container["resources"]["limits"]["nvidia.com/gpu"],
                                     num_processes=1)
        fdl.build(run_tree(experiment))
        return experiment
    experiment = load_experiment(name, assignments)
    fdl.build(run_tree(experiment))
    return experiment


def test_the_manifests_are_found():
    assert {p.name for p in MANIFESTS} >= {"indexed-job.yaml", "single-node-job.yaml"}
    assert {name for name, _ in JOBS} == {p.name for p in MANIFESTS}


@pytest.mark.parametrize("name, job", JOBS, ids=[n for n, _ in JOBS])
def test_image_and_command(name, job):
    container = _container(job)
    assert container["name"] == "paxlite"
    assert container["image"] == "IMAGE"  # the placeholder docs/kubernetes.md says to replace
    assert "workingDir" not in container  # the image's WORKDIR, /opt/paxlite
    python, dash_m, module = container["command"]
    assert (python, dash_m) == ("python", "-m")
    assert module in ("paxlite.main", "paxlite.launch_trainer_main")
    if module == "paxlite.main":
        from paxlite import main  # its absl flags: every flag in the manifest must be one of them

        assert all(
            flag in main.FLAGS or flag.startswith("fdl.") for flag in _flags(container["args"])
        )


@pytest.mark.parametrize("name, job", JOBS, ids=[n for n, _ in JOBS])
def test_experiment_resolves_and_fits_the_pods_gpus(name, job):
    container = _container(job)
    experiment = _experiment(container)
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    # one process owns its node's GPUs
    assert gpus == 8 and math.prod(experiment.ICI_MESH_SHAPE) == gpus
    pods = job["spec"].get("completions", 1)
    assert math.prod(experiment.DCN_MESH_SHAPE) == pods  # one process per pod: DCN covers the pods
    # TE's layers (the image's default) refuse packed rows: a manifest that runs a packed experiment
    # says 0
    te = _env(container).get("ENABLE_TE", "1")
    assert te == "0" or not experiment.PACKED_INPUT


def test_the_launchers_config_is_registered_under_axlearns_name():
    (job,) = [j for n, j in JOBS if n == "single-node-job.yaml"]
    config = _flags(_container(job)["args"])["config"]
    assert config == "fuji-3B-v3-flash-single-host"
    assert resolve_experiment(config, EXPERIMENTS).__name__ == "Fuji3BV3FlashSingleHost"


def test_indexed_job_env_gives_each_pod_its_process_index():
    (service,) = [d for n, d in _documents() if n == "indexed-job.yaml" and d["kind"] == "Service"]
    (job,) = [j for n, j in JOBS if n == "indexed-job.yaml"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert service["spec"]["clusterIP"] == "None"  # headless: per-pod DNS names
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    (port,) = [p["port"] for p in service["spec"]["ports"]]
    env = _env(_container(job))
    pods = spec["completions"]
    assert spec["parallelism"] == pods == int(env["PAXLITE_NUM_PROCESSES"])
    # Indexed pods: <job>-<index>
    pod0 = f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    for index in range(pods):
        launch = detect_launch(
            multiprocess_gpu=False,
            server_addr=None,
            num_hosts=None,
            host_idx=None,
            env={**env, "JOB_COMPLETION_INDEX": str(index)},
        )
        assert (launch.num_processes, launch.process_id) == (pods, index)
        assert launch.coordinator_address == f"{pod0}:{port}"


@pytest.mark.parametrize("name, job", JOBS, ids=[n for n, _ in JOBS])
def test_volumes_and_mounts(name, job):
    pod = job["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in _container(job)["volumeMounts"]}
    assert set(mounts.values()) <= set(volumes)  # every mount names a volume
    assert set(volumes) <= set(mounts.values())  # and no volume is left unmounted
    # outlives the pod: checkpoints survive
    assert "persistentVolumeClaim" in volumes[mounts[WORKSPACE]]
    assert volumes[mounts["/dev/shm"]] == {
        "name": mounts["/dev/shm"],
        "emptyDir": {"medium": "Memory"},
    }
    container = _container(job)
    flags = _flags(container["args"])
    paths = [_job_dir(container)] + [
        v
        for k, v in flags.items()
        if k in ("tfds_data_dir", "fdl.VOCAB_PATH", "data_dir") and v != "FAKE"
    ]
    for path in paths:  # every path the run reads or writes lies on a mounted volume
        assert any(path.startswith(mount + "/") for mount in mounts), path


@pytest.mark.parametrize("name, job", JOBS, ids=[n for n, _ in JOBS])
def test_preemption_exits_with_a_status_the_job_ignores(name, job):
    spec, pod, container = job["spec"], job["spec"]["template"]["spec"], _container(job)
    env = _env(container)
    assert preemption_exit_code(env) == PREEMPTED  # paxlite's own check of the value
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy needs it
    # long enough to finish a step and commit a checkpoint (the manifests' comments give the sum)
    assert 300 <= pod["terminationGracePeriodSeconds"] <= 3600
    # at least one whole-job crash is retried
    assert spec["backoffLimit"] >= spec.get("completions", 1)
    # the same job directory on every restart: no per-pod or per-attempt part in it
    job_dir = _job_dir(container)
    assert job_dir.startswith(WORKSPACE + "/") and "$(" not in job_dir


def _decide(rules, *, exit_code, conditions=()):
    """Kubernetes' podFailurePolicy for one failed pod with one container: the first matching rule's
    action, else Count (the default: the failure uses up backoffLimit)."""
    for rule in rules:
        if "onPodConditions" in rule:
            if any(
                c["type"] in conditions and c.get("status", "True") == "True"
                for c in rule["onPodConditions"]
            ):
                return rule["action"]
            continue
        on = rule["onExitCodes"]
        assert on.get("containerName") in (None, "paxlite")
        assert on["operator"] != "In" or 0 not in on["values"]  # the API refuses 0 with In
        matched = exit_code in on["values"]
        if exit_code != 0 and (matched if on["operator"] == "In" else not matched):
            return rule["action"]
    return "Count"


@pytest.mark.parametrize("name, job", JOBS, ids=[n for n, _ in JOBS])
@pytest.mark.parametrize("exit_code, conditions, action", [
    (PREEMPTED, (), "Ignore"),                   # paxlite checkpointed and stopped on SIGTERM
    (137, ("DisruptionTarget",), "Ignore"),      # evicted and killed before it finished
    (PREEMPTED, ("DisruptionTarget",), "Ignore"),
    (2, (), "FailJob"),                          # a user mistake: no retry
    (3, (), "FailJob"),                          # stopped with saving off: a retry resumes nothing
    (1, (), "Count"),                            # diverged
    (124, (), "Count"),                          # the hang watchdog
    (134, (), "Count"),                          # a peer died (jax.distributed aborts)
    (137, (), "Count"),                          # OOM-killed
])
def test_pod_failure_policy(name, job, exit_code, conditions, action):
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert _decide(rules, exit_code=exit_code, conditions=conditions) == action


def test_docs_show_the_manifests_policy_and_grace_period():
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    block = re.search(r"```yaml\n(podFailurePolicy:.*?)```", docs, re.DOTALL).group(1)
    shown = yaml.safe_load(block)["podFailurePolicy"]
    for name, job in JOBS:
        assert job["spec"]["podFailurePolicy"] == shown, name
        grace = job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert f"terminationGracePeriodSeconds: {grace}" in docs, name
        assert f"backoffLimit: {job['spec']['backoffLimit']}" in docs, name
