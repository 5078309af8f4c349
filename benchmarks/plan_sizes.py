"""The size table: peak memory per device of each large experiment at its documented mesh,
compiled by XLA's GPU compiler for H100 and H200 and by the CPU planner, side by side
(docs/performance.md).

    PYTHONPATH=.venv/gpu_compile python benchmarks/plan_sizes.py [--cases GPT5B,LLaMA7B]
        [--out FILE.json]

Each case runs in a fresh process (`--one NAME`) with as many fake CPU devices as its mesh has (the
CPU planner needs them; the GPU targets need none) and compiles the same train step three times:
`planner.search.compile_train_step(target=cpu|h100|h200)`. The GPU compiles take each experiment's
XLA preset as compile options, as its run is launched with. The table is printed as Markdown;
`--out` keeps the raw numbers. Needs JAX's CUDA plugin (`make gpu-compile` puts it in
.venv/gpu_compile).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# (experiment, devices, overrides): the mesh and device count docs/experiments.md lists for each,
# and the training settings of Pax's LLaMA scripts (the LLaMA defaults are Pax's zero-shot
# evaluation batch).
CASES: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    ("GPT5B", 256, ()), ("GPT175B", 256, ()), ("LLaMA7B", 8, ()), ("LLaMA13B", 8, ()),
    ("LLaMA70B", 16, ()), ("GLaM64B64E", 512, ()), ("Mixtral8x7B", 8, ()),
    # Fuji at AXLearn's GPU mesh rules (fuji_mesh.py: p5.48xlarge-256 for 7B, -512 for 70B), with
    # the flash attention its GPU runs use; the 8-device default mesh of docs/experiments.md holds
    # 2,048 sequences of 8,192 tokens, which XLA's CPU compiler cannot even compile (it dies of
    # SIGFPE).
    ("Fuji7BV3Flash", 256, ("ICI_MESH_SHAPE=[1,8,1]", "DCN_MESH_SHAPE=[32,1,1]")),
    ("Fuji70BV3Flash", 512, ("ICI_MESH_SHAPE=[1,8,1]", "DCN_MESH_SHAPE=[4,16,1]")),
    # run_llama_boolq.sh: full fine-tuning 2 sequences per GPU on 16 GPUs, with XLA's attention and
    # with the fused one (flash: cuDNN on a GPU); LoRA 2 per GPU on 8 (a random base: sizes only)
    ("LLaMA7B", 16, ("PERCORE_BATCH_SIZE=2", "DCN_MESH_SHAPE=[1,2,1]")),
    ("LLaMA7B", 16, ("PERCORE_BATCH_SIZE=2", "DCN_MESH_SHAPE=[1,2,1]", "ATTENTION_KIND='flash'")),
    ("LLaMA7B", 8, ("PERCORE_BATCH_SIZE=2", "USE_LORA=True", "LORA_RANDOM_BASE=True",
                    "ICI_MESH_SHAPE=[8,1,1]", "ATTENTION_KIND='flash'")),
)
TARGETS = ("cpu", "h100", "h200")
GIB = 2**30


def measure_one(name: str, devices: int, assignments: list[str]) -> dict:
    """In this process (fake CPU devices already set): the three compiles of one case."""
    from paxlite.experiments.build import load_experiment
    from paxlite.planner.results import Verdict
    from paxlite.planner.search import compile_train_step, target_defaults

    experiment = load_experiment(name, tuple(assignments))
    row: dict = {"experiment": name, "devices": devices, "overrides": assignments}
    for target in TARGETS:
        started = time.perf_counter()
        try:
            result = compile_train_step(experiment, num_devices=devices, target=target)
        except Exception as error:  # noqa: BLE001 - a case that cannot compile is a row, not a crash
            row[target] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
            continue
        device_bytes, _ = target_defaults(target)  # as `plan --target` assumes
        memory, program = result.memory, result.gpu_program
        row[target] = {
            "peak_bytes": memory.peak_bytes, "temp_bytes": memory.temp_bytes,
            "argument_bytes": memory.argument_bytes, "device_bytes": device_bytes,
            "fits": Verdict.of(peak_bytes=memory.peak_bytes, device_bytes=device_bytes).fits,
            "kernels": program and program.kernels, "fp8_gemms": program and program.fp8_gemms,
            "mesh": result.mesh.to_json(), "global_batch_size": result.global_batch_size,
            "seq_len": result.seq_len, "seconds": round(time.perf_counter() - started, 1),
        }
    return row


def run_case(name: str, devices: int, assignments: list[str], *, timeout_s: float) -> dict:
    from paxlite.planner.plan import fake_device_env

    command = [sys.executable, os.path.abspath(__file__), "--one", name, "--devices", str(devices),
               *(["--assign", *assignments] if assignments else [])]
    try:
        done = subprocess.run(command, env=fake_device_env(devices), capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"experiment": name, "devices": devices, "error": f"timed out after {timeout_s:.0f} "
                                                                 "s"}
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return {"experiment": name, "devices": devices,
                "error": lines[-1] if lines else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cell(entry: dict | None) -> str:
    if not entry:
        return "—"
    if "error" in entry:
        return f"error: {entry['error'][:80]}"
    verdict = "fits" if entry["fits"] else "**does not fit**"
    return f"{entry['peak_bytes'] / GIB:.2f} GiB, {verdict}"


def table(rows: list[dict]) -> str:
    lines = [("| experiment | devices | mesh (non-1 axes) | H100 (80 GB) peak | H200 (141 GB) peak "
              "| CPU planner peak (80 GiB) | GPU / CPU |"),
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['experiment']} | {row['devices']} | | error: "
                         f"{row['error'][:120]} | | | |")
            continue
        any_ok = next((row[t] for t in TARGETS if "mesh" in row.get(t, {})), None)
        mesh = ", ".join(f"{k} {v}" for k, v in (any_ok or {}).get("mesh", {}).items() if v > 1)
        ratio = ""
        if "peak_bytes" in row.get("h100", {}) and "peak_bytes" in row.get("cpu", {}):
            ratio = f"{row['h100']['peak_bytes'] / row['cpu']['peak_bytes']:.2f}"
        name = row["experiment"] + "".join(f" `{a}`" for a in row.get("overrides", []))
        lines.append(f"| {name} | {row['devices']} | {mesh} | {_cell(row.get('h100'))} | "
                     f"{_cell(row.get('h200'))} | {_cell(row.get('cpu'))} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="", help="comma-separated experiment names (default: "
                                                    "all)")
    parser.add_argument("--out", default="", help="write the raw rows here as JSON")
    parser.add_argument("--timeout_s", type=float, default=1800.0, help="per case")
    parser.add_argument("--case_index", type=int, default=None, help="only CASES[i]")
    parser.add_argument("--with_overrides_only", action="store_true",
                        help="only the cases with overrides (Pax's LLaMA training settings)")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--assign", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args.one, args.devices, args.assign)))
        return 0
    wanted = {c for c in args.cases.split(",") if c}
    cases = [case for case in CASES if not wanted or case[0] in wanted]
    if args.with_overrides_only:
        cases = [case for case in cases if case[2]]
    if args.case_index is not None:
        cases = [CASES[args.case_index]]
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {len(cases)} cases",
          file=sys.stderr)
    rows = []
    for name, devices, assignments in cases:
        started = time.perf_counter()
        rows.append(run_case(name, devices, list(assignments), timeout_s=args.timeout_s))
        print(f"# {name} on {devices}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
