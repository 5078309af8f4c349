"""`make test-py311`: paxlite, installed as a user would on the oldest supported stack, trains.

Run by the Python of the venv that `make test-py311` builds (Python 3.11, `pip install -c
constraints-py311.txt`, paxlite installed from a copy of the checkout, not editable), from a
temporary directory outside the checkout, so that nothing can be imported from the checkout by
accident:

1. `import paxlite` is the installed copy, and every distribution constraints-py311.txt pins is
   installed at its pin (pip cannot have resolved past the range setup.cfg declares);
2. `python -m paxlite.main --fdl_config=TinySynthetic --fdl.MAX_STEPS=3` exits 0 on the CPU, and its
   metrics.jsonl holds a finite training loss for its last step (and every other it logged).

Prints one line per check; on the first that fails, exits 1 with the reason.

    python tests/installed_check.py --constraints=constraints-py311.txt --checkout=. --python=3.11
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

STEPS = 3


def pins(constraints: pathlib.Path) -> dict[str, str]:
    """distribution -> pinned version, from a constraints file's `name==version` lines."""
    found = {}
    for line in constraints.read_text().splitlines():
        match = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s#;]+)", line)
        if match:
            found[match[1]] = match[2]
    return found


def check_install(*, constraints: pathlib.Path, checkout: pathlib.Path, python: str) -> str:
    running = ".".join(map(str, sys.version_info[:2]))
    if running != python:
        raise SystemExit(f"installed check: this is Python {running}; the venv should have "
                         f"{python}")
    import paxlite

    where = pathlib.Path(paxlite.__file__).resolve()
    if where.parent == (checkout / "paxlite").resolve():
        raise SystemExit(f"installed check: paxlite was imported from the checkout ({where}), "
                         "not from the installed package")
    wrong = []
    for name, version in pins(constraints).items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # a test tool the check does not install (pytest, ...)
        if installed != version:
            wrong.append(f"{name} {installed} (pinned {version})")
    if wrong:
        raise SystemExit(f"installed check: not the pinned versions: {', '.join(wrong)}")
    return (f"paxlite {paxlite.__version__} from {where.parent}; Python {running}, jax "
            f"{importlib.metadata.version('jax')}, flax {importlib.metadata.version('flax')}, "
            f"orbax-checkpoint {importlib.metadata.version('orbax-checkpoint')}")


def check_training(work: pathlib.Path) -> str:
    job = work / "job"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "paxlite.main", "--fdl_config=TinySynthetic",
         f"--fdl.MAX_STEPS={STEPS}", f"--job_log_dir={job}"],
        cwd=work, env=env, capture_output=True, text=True, timeout=600, check=False)
    seconds = time.monotonic() - start
    if run.returncode != 0:
        raise SystemExit(f"installed check: training exited {run.returncode}:\n"
                         f"{run.stderr[-3000:]}")
    rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    losses = {row["step"]: row["loss"] for row in rows if "loss" in row}
    if STEPS not in losses:
        raise SystemExit(f"installed check: metrics.jsonl has no training loss for step {STEPS} "
                         f"(steps with one: {sorted(losses)})")
    if not all(math.isfinite(loss) for loss in losses.values()):
        raise SystemExit(f"installed check: a training loss is not finite: {losses}")
    return (f"TinySynthetic trained {STEPS} steps on the CPU in {seconds:.1f} s, "
            f"loss {losses[STEPS]:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--constraints", type=pathlib.Path, required=True)
    parser.add_argument("--checkout", type=pathlib.Path, required=True)
    parser.add_argument("--python", required=True, help="the Python version the venv must have")
    args = parser.parse_args()
    print("installed check:", check_install(constraints=args.constraints, checkout=args.checkout,
                                            python=args.python), flush=True)
    with tempfile.TemporaryDirectory(prefix="paxlite-installed-") as work:
        print("installed check:", check_training(pathlib.Path(work)), flush=True)


if __name__ == "__main__":
    main()
