"""The same CPU step under two Python environments (e.g. before and after a JAX upgrade).

Why: a dependency move must say what it does to step time, and two JAX versions cannot share one
process. This runs ``benchmarks/cpu_step.py`` alternately under each interpreter (old, new, new,
old, ... so drift on a shared host hits both), and prints per-pair ratios of the bare-JAX step and
of paxlite's step, new over old, and their medians.

    python benchmarks/stack_compare.py --old /path/old/bin/python --new .venv/bin/python --pairs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence

CPU_STEP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_step.py")


def run_once(python: str, *, steps: int, rounds: int) -> dict:
    """One cpu_step.py run; its JSON result line."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one device, as cpu_step.py requires
    proc = subprocess.run(
        [python, CPU_STEP, "--steps", str(steps), "--rounds", str(rounds)],
        capture_output=True, text=True, env=env, check=False,
        cwd=os.path.dirname(os.path.dirname(CPU_STEP)),
    )
    if proc.returncode != 0:
        raise SystemExit(f"{python} {CPU_STEP} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit(f"{python} {CPU_STEP} printed no JSON result:\n{proc.stdout[-3000:]}")


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="python of the environment before the move")
    parser.add_argument("--new", default=sys.executable, help="python of the environment after it")
    parser.add_argument("--pairs", type=int, default=3, help="old/new pairs of runs")
    parser.add_argument("--steps", type=int, default=5, help="cpu_step.py --steps")
    parser.add_argument("--rounds", type=int, default=2, help="cpu_step.py --rounds")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error(f"--pairs must be >= 1, got {args.pairs}")

    bare_ratios: list[float] = []
    pax_ratios: list[float] = []
    versions: dict[str, str] = {}
    for index in range(args.pairs):
        order = ("old", "new") if index % 2 == 0 else ("new", "old")
        results = {}
        for side in order:
            results[side] = run_once(getattr(args, side), steps=args.steps, rounds=args.rounds)
            versions[side] = results[side]["jax"]
        bare_ratios.append(results["new"]["bare_median_ms"] / results["old"]["bare_median_ms"])
        pax_ratios.append(results["new"]["paxlite_median_ms"] / results["old"]["paxlite_median_ms"])
        print(f"pair {index + 1}: bare old {results['old']['bare_median_ms']:.1f} ms, new "
              f"{results['new']['bare_median_ms']:.1f} ms; paxlite old "
              f"{results['old']['paxlite_median_ms']:.1f} ms, new "
              f"{results['new']['paxlite_median_ms']:.1f} ms", flush=True)
    summary = {
        "old_jax": versions["old"], "new_jax": versions["new"],
        "bare_new_over_old": [round(r, 3) for r in bare_ratios],
        "paxlite_new_over_old": [round(r, 3) for r in pax_ratios],
        "bare_median_ratio": statistics.median(bare_ratios),
        "paxlite_median_ratio": statistics.median(pax_ratios),
    }
    print(json.dumps(summary))
    print(f"jax {versions['old']} -> {versions['new']}: bare step "
          f"x{summary['bare_median_ratio']:.3f}, paxlite step "
          f"x{summary['paxlite_median_ratio']:.3f} (new over old, median of {args.pairs} pairs)")
    return summary


if __name__ == "__main__":
    main()
