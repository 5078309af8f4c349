"""Time to the first step: a cold start against a warm restart of the same job (the compilation
cache).

Why: a preempted job is restarted, often many times; each restart that compiles again wastes
accelerator time that grows with the model. With JAX's persistent compilation cache in the job
directory (on by default), a restart loads its executables instead. Goal: warm <= 0.6x cold on CPU
for the benchmark model of cpu_step.py.

Each round runs, as separate processes of `python -m paxlite.main`:
  cold: a new job directory (no checkpoint, empty cache), trained to STEPS steps and stopped there;
  restart without the cache: the same command with MAX_STEPS raised and COMPILATION_CACHE=False,
    so it resumes from that checkpoint and compiles (what a restart cost before the cache);
  warm: the same again with the cache on, MAX_STEPS raised once more.
Time to first step = from starting the process to the first new line of metrics.jsonl (every step is
logged), so it includes Python and JAX start-up, building the run, restoring or initialising, and
compiling or loading the step. Rounds alternate, and the ratio is taken per round (a shared host
drifts).

    .venv/bin/python benchmarks/restart_time.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cpu_step import EXPERIMENT, MODEL_OVERRIDES

STEPS = 3


def _steps_logged(job: Path) -> int:
    path = job / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"loss"' in line)


def time_to_first_step(
    job: Path, *, max_steps: int, extra: tuple[str, ...] = (), timeout: float = 600
) -> float:
    """Seconds from process start until one more step is logged; the process then runs to its
    end."""
    before = _steps_logged(job)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PAXLITE_"))}
    env.setdefault("JAX_PLATFORMS", "cpu")
    command = [sys.executable, "-m", "paxlite.main", f"--fdl_config={EXPERIMENT}",
               *(f"--fdl.{o}" for o in MODEL_OVERRIDES), f"--fdl.MAX_STEPS={max_steps}",
               "--fdl.SUMMARY_INTERVAL_STEPS=1", "--fdl.EVAL_INTERVAL_STEPS=100000",
               f"--job_log_dir={job}", *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    first = None
    while first is None:
        if _steps_logged(job) > before:
            first = time.perf_counter() - start
        elif proc.poll() is not None or time.perf_counter() - start > timeout:
            break
        else:
            time.sleep(0.01)
    _, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0 or first is None:
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}):\n{err[-3000:]}")
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            job = Path(tmp) / f"job{round_index}"
            cold = time_to_first_step(job, max_steps=STEPS)
            cache_entries = len(os.listdir(job / "compilation_cache"))
            # the same restart with the cache off: what is left of the gain is not the cache's
            uncached = time_to_first_step(
                job, max_steps=2 * STEPS, extra=("--fdl.COMPILATION_CACHE=False",)
            )
            warm = time_to_first_step(job, max_steps=3 * STEPS)
            added = len(os.listdir(job / "compilation_cache")) - cache_entries
            rows.append({"cold_s": round(cold, 3), "restart_without_cache_s": round(uncached, 3),
                         "warm_s": round(warm, 3), "ratio": round(warm / cold, 3),
                         "restart_without_cache_ratio": round(uncached / cold, 3),
                         "cache_entries": cache_entries, "entries_added_by_warm": added})
            print(json.dumps(rows[-1]), flush=True)
    ratios = [row["ratio"] for row in rows]
    print(json.dumps({
        "benchmark": "restart_time", "model": f"{EXPERIMENT} + {' '.join(MODEL_OVERRIDES)}",
        "rounds": args.rounds, "median_warm_over_cold": statistics.median(ratios),
        "median_cold_s": statistics.median(r["cold_s"] for r in rows),
        "median_warm_s": statistics.median(r["warm_s"] for r in rows),
        "median_restart_without_cache_over_cold": statistics.median(
            r["restart_without_cache_ratio"] for r in rows),
        "host": platform.node(), "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }))


if __name__ == "__main__":
    main()
