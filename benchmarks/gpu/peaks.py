"""The GPU benchmark's memory columns: each case's planned peak beside its run's measured one.

Why: the planner (`paxlite.planner.search.compile_train_step`) promises a run's peak device memory
from a compile on a machine without the GPU (XLA's GPU compiler for the GPU model, deviceless).
Only a run on that GPU can say how far the promise is from the allocator's real peak, so the
benchmark that spends GPU time anyway measures both and prints their ratio, the planner's error.

- **Planned**: before the training runs, one subprocess (`JAX_PLATFORMS=cpu`: the planner never
  holds the GPU the runs need; imports paid once) compiles each case's train step, the same
  experiment and `--fdl.` flags as its run, on one device of the local GPU model (`nvidia-smi`'s
  name, which is the device kind JAX reports, mapped through `paxlite.parallel.compile_targets`'s
  GPU_SPECS), or of the CPU with `--cpu`. One JSON line per case, so a capped planner keeps what
  it did.
- **Measured**: the run is `paxlite.main` started by this module's `watch` command: a thread waits
  for each new train line in the run's metrics.jsonl (so the run's backend exists and nothing starts
  JAX early) and then writes `peak_bytes_in_use` of the run's devices (JAX's `memory_stats()`, the
  allocator's high-water mark since the process started) to DIR/device_memory.json. The CPU reports
  no memory statistics: there the column is "n/a".

    python benchmarks/gpu/peaks.py plan CASES_JSON OUT_JSONL TARGET NUM_DEVICES
    python benchmarks/gpu/peaks.py watch JOB_DIR -- PAXLITE_MAIN_ARGS...
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
if __name__ == "__main__":
    sys.path[0] = ROOT  # as `python -m paxlite.main` from the repository root, not this folder

from paxlite.parallel.compile_targets import GPU_SPECS, CompileTarget

TARGETS = tuple(t.value for t in CompileTarget)
PLAN_FILE = "plan.jsonl"
MEMORY_FILE = "device_memory.json"
GIB = 2**30


# -------------------------------------------------------------------------------------- planned
def local_gpu_model() -> str:
    """The first GPU's name as nvidia-smi gives it ('' without one): the CUDA device name, which is
    also JAX's `device_kind`, read without starting JAX on the GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return next((line.strip() for line in out.splitlines() if line.strip()), "")


def plan_target(*, cpu: bool, requested: str | None) -> tuple[str | None, str]:
    """(compile target, how it was chosen); target None with the reason when there is none."""
    if requested:
        return requested, f"{requested} (--plan_target)"
    if cpu:
        return CompileTarget.CPU.value, "cpu (--cpu: no GPU model)"
    kind = local_gpu_model()
    target = next((t for t, spec in GPU_SPECS.items() if spec.device_kind == kind), None)
    if target is None:
        known = ", ".join(f"{spec.device_kind!r}" for spec in GPU_SPECS.values())
        return None, f"no compile target for GPU {kind or '(none found)'!r}; known: {known}"
    return target.value, f"{target.value} ({kind})"


def plan_case(name: str, command: Sequence[str]) -> dict:
    """What the planner needs of one run's `python -m paxlite.main` command: its experiment and
    its `--fdl.NAME=VALUE` settings, exactly as the run gets them."""
    config = next(arg.split("=", 1)[1] for arg in command if arg.startswith("--fdl_config="))
    return {"name": name, "config": config,
            "assignments": [arg[len("--fdl."):] for arg in command if arg.startswith("--fdl.")]}


def start_planner(log_dir: str, *, cases: list[dict], target: str, num_devices: int,
                  env: dict[str, str]) -> subprocess.Popen:
    """The planner subprocess, on the CPU platform (with `num_devices` CPU devices for `cpu`)."""
    from paxlite.planner.plan import fake_device_env

    cases_path = os.path.join(log_dir, "plan_cases.json")
    with open(cases_path, "w") as f:
        json.dump(cases, f, indent=2)
    out = os.path.join(log_dir, PLAN_FILE)
    if os.path.exists(out):
        os.remove(out)
    cmd = [sys.executable, HERE, "plan", cases_path, out, target, str(num_devices)]
    with open(os.path.join(log_dir, "plan.log"), "w") as log:  # the child keeps its own descriptor
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        return subprocess.Popen(cmd, env=fake_device_env(num_devices, base=env, target=target),
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def finish_planner(proc: subprocess.Popen, *, until: float) -> str | None:
    """Wait for the planner until the UNIX time `until`, then stop it; None when it finished."""
    while proc.poll() is None:
        if time.time() >= until:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "the planner was stopped at its time cap"
        time.sleep(0.25)
    return None if proc.returncode == 0 else f"planner exited with status {proc.returncode}"


def read_plans(log_dir: str) -> dict[str, dict]:
    """{case name: its planner record}, plus "*" for an error that stopped every case."""
    plans: dict[str, dict] = {}
    path = os.path.join(log_dir, PLAN_FILE)
    if not os.path.exists(path):  # the planner has not written a line yet
        return plans
    with open(path) as f:
        for line in f:
            if line.endswith("\n"):  # whole lines only: a killed planner may leave half of one
                record = json.loads(line)
                plans[record.get("name", "*")] = record
    return plans


def planning_summary(plans: dict[str, dict], *, target_note: str, cases: list[str],
                     asked: list[str], stopped: str | None, seconds: float, asked_note: str) -> str:
    """One line for the table's footer: what was planned for which target, and why not the rest."""
    if not asked:
        return f"not planned: {target_note if target_note.startswith('no ') else 'time budget'}"
    if "*" in plans:
        return f"not planned: {plans['*']['error']}"
    done = [name for name in asked if "peak_bytes" in plans.get(name, {})]
    failed = [name for name in asked if "error" in plans.get(name, {})]
    text = f"for {target_note}, 1 device: {len(done)} of {len(cases)} cases in {seconds:.0f} s"
    if failed:
        text += f"; {len(failed)} failed ({failed[0]}: {plans[failed[0]]['error']})"
    if len(done) + len(failed) < len(asked):
        text += f"; {len(asked) - len(done) - len(failed)} not reached ({stopped})"
    if len(asked) < len(cases):
        text += f"; {asked_note}"
    return text


def _plan_child(cases_path: str, out_path: str, target: str, num_devices: int) -> None:
    from paxlite.experiments.build import load_experiment
    from paxlite.parallel.compile_targets import plugin_problem
    from paxlite.planner.search import compile_train_step

    with open(cases_path) as f:
        cases = json.load(f)
    with open(out_path, "a") as out:
        problem = plugin_problem() if CompileTarget.parse(target).is_gpu else None
        if problem:
            out.write(json.dumps({"error": problem}) + "\n")
            return
        for case in cases:
            started = time.perf_counter()
            try:
                result = compile_train_step(load_experiment(case["config"], case["assignments"]),
                                            num_devices=num_devices, target=target)
            except Exception as error:  # noqa: BLE001  a case's failure is its own; the rest go on
                first = (str(error).strip().splitlines() or [""])[0]
                record = {"name": case["name"], "error": f"{type(error).__name__}: {first}"[:300]}
            else:
                present = result.to_json()  # attention_note, kernels, xla_preset: where present
                record = {"name": case["name"], "peak_bytes": result.memory.peak_bytes,
                          "compiled_for": result.compiled_for.value,
                          "memory": result.memory.to_json(), "compile_s": result.compile_s,
                          **{key: present[key] for key in ("attention_note", "kernels",
                                                           "xla_preset") if key in present}}
            record["wall_s"] = round(time.perf_counter() - started, 2)
            out.write(json.dumps(record) + "\n")
            out.flush()
            print(f"planned {case['name']}: {record.get('peak_bytes', record.get('error'))} "
                  f"({record['wall_s']} s)", flush=True)


# ------------------------------------------------------------------------------------- measured
def watched_command(command: Sequence[str], *, job_dir: str) -> list[str]:
    """`python -m paxlite.main ARGS` as the same run with the memory watcher beside it."""
    if list(command[1:3]) != ["-m", "paxlite.main"]:
        raise ValueError(f"expected 'python -m paxlite.main ...', got {list(command[:3])}")
    return [command[0], HERE, "watch", job_dir, "--", *command[3:]]


def _train_steps(job_dir: str) -> list[int]:
    """The steps with a train line in metrics.jsonl (whole lines only)."""
    try:
        with open(os.path.join(job_dir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if line.endswith("\n")]
    except (OSError, ValueError):  # not there yet, or being rewritten
        return []
    return [r["step"] for r in records if "loss" in r]


def _watch(job_dir: str) -> None:
    """Daemon thread of a watched run: after each new train line, the devices' memory peak."""
    import jax  # already imported by the run when its first train line exists

    seen = 0
    while True:
        time.sleep(0.1)
        steps = _train_steps(job_dir)
        if not steps or max(steps) == seen:
            continue
        seen = max(steps)
        devices = jax.local_devices()
        stats = [s for s in (d.memory_stats() for d in devices) if s]  # None on the CPU
        peaks = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
        limits = [s["bytes_limit"] for s in stats if "bytes_limit" in s]
        record = {"step": seen, "peak_bytes_in_use": max(peaks) if peaks else None,
                  "bytes_limit": max(limits) if limits else None,
                  "platform": devices[0].platform, "device_kind": devices[0].device_kind}
        path = os.path.join(job_dir, MEMORY_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)  # a reader never sees half a file


def read_measured(job_dir: str) -> dict:
    """The watcher's last record ({} when it wrote none)."""
    try:
        with open(os.path.join(job_dir, MEMORY_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def measured_after(job_dir: str, step: int, *, grace_s: float = 5.0) -> Callable[[], bool]:
    """A run's stop condition: `step`'s train line is logged and the watcher has read the memory
    after it (or `grace_s` passed since the line, should it never)."""
    logged_at: float | None = None

    def done() -> bool:
        nonlocal logged_at
        if logged_at is None:
            if step not in _train_steps(job_dir):
                return False
            logged_at = time.time()
        return read_measured(job_dir).get("step", 0) >= step or time.time() - logged_at > grace_s

    return done


def _watch_main(job_dir: str, args: list[str]) -> None:
    threading.Thread(target=_watch, args=(job_dir,), daemon=True).start()
    sys.argv = [os.path.join(ROOT, "paxlite", "main.py"), *args]
    runpy.run_module("paxlite.main", run_name="__main__", alter_sys=True)


# ---------------------------------------------------------------------------------------- table
def gib(value: int | None) -> float | None:
    return None if value is None else value / GIB


def ratio(measured: int | None, planned: int | None) -> float | None:
    return measured / planned if measured is not None and planned else None


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    if command == "plan":
        _plan_child(rest[0], rest[1], rest[2], int(rest[3]))
    elif command == "watch" and rest[1:2] == ["--"]:
        _watch_main(rest[0], rest[2:])
    else:
        sys.exit(f"peaks.py: error: expected 'plan CASES OUT TARGET N' or 'watch JOB_DIR -- ARGS', "
                 f"got {sys.argv[1:]}")
