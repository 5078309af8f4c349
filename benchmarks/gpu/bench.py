"""The one-call GPU benchmark: matmul ceilings, then training throughput of three models, as one
table.

    python benchmarks/gpu/bench.py --log_dir=DIR [--deadline_s=UNIX_TIME] [--cpu --tiny]
                                   [--peak_tflops=BF16,FP8] [--plan_s=60]
                                   [--plan_target=h100|h200|a100|cpu]

Parts (benchmarks/gpu/run.sh calls this after the GPU tests; docs/performance.md, "GPU benchmark"):
1. The measured matmul ceiling of this device: a large square bf16 `jnp.dot`, and an FP8 one
   (float8_e4m3fn operands dequantised by a scalar scale each, the pattern XLA rewrites into one
   cuBLASLt FP8 GEMM; the compiled HLO is checked for that call). TFLOP/s of the best of a few
   sizes. Run in a subprocess, so this process never holds the GPU while the training jobs need it.
2. Planned peak memory (benchmarks/gpu/peaks.py), beside part 1: each training case's train step
   compiled for one device of the local GPU model by XLA's GPU compiler, deviceless, in one CPU-only
   subprocess capped at --plan_s seconds (the cases in run order; what the cap cuts off is "n/a").
3. Synthetic126M (seq 2048), a LLaMA-style 1B (fuji-1B-v3-flash dims, seq 4096, 8 sequences) and
   GLaM126M64E (synthetic), each in BF16 and native FP8 (`--fdl.USE_FP8=True`), with flash attention
   on and off: `python -m paxlite.main` subprocesses on one device with checkpoint saving off and
   the model's XLA preset (paxlite.xla_presets), read back from their metrics.jsonl and config.json,
   and each run's measured peak device memory (`peak_bytes_in_use`, read inside the run by
   peaks.py).

Columns: tokens/s and input wait are medians over the logged windows after the first (which holds
the warm-up steps); TFLOP/s per device = tokens/s x flops_per_token (config.json, MaxText's count) /
devices; MFU against the spec peak of the row's precision (paxlite.train.flops; --peak_tflops
overrides) and against the measured ceiling of the same precision; planned and measured peak GiB per
device and measured/planned, the planner's error (over 1: the run needed more than planned). A run
that fails gives its row "failed: <first error line>" and the rest go on; a run that would pass the
deadline is not started ("skipped: time budget"). `--cpu --tiny` runs every part on the CPU in
seconds (tiny models, 3 steps, tiny matmuls, the first case planned for the CPU, whose devices
report no memory peak): the test (tests/test_gpu_benchmark.py) and a dry run before spending GPU
time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # the repository's paxlite, also when run as a script

import peaks  # benchmarks/gpu/peaks.py: the planned and measured memory columns

from paxlite import xla_presets
from paxlite.train.flops import peak_flops_per_device

# fuji-1B-v3 (AXLearn's 1B: 16 layers, d 2048, 32 heads, 8 kv heads, vocab 131072, tied head) at
# sequence 4096, 8 sequences (32,768 tokens) per step, scanned layers.
_FUJI_1B = ["--fdl.SYNTHETIC_DATA=true", "--fdl.MAX_SEQ_LEN=4096", "--fdl.GLOBAL_BATCH_SIZE=8",
            "--fdl.USE_REPEATED_LAYER=true"]
_TINY_DENSE = [
    "--fdl.MODEL_DIMS=32",
    "--fdl.NUM_HEADS=4",
    "--fdl.DIMS_PER_HEAD=8",
    "--fdl.HIDDEN_DIMS=64",
    "--fdl.VOCAB_SIZE=256",
    "--fdl.MAX_SEQ_LEN=32",
]
# A tiny run is mostly its process start and compile: one layer compiles quicker than two. GLaM
# keeps two, as its MoE layer is the first of each pair.
_TINY_LAYERS = ("--fdl.NUM_LAYERS=1",)


@dataclasses.dataclass(frozen=True)
class Model:
    label: str
    config: str
    flags: tuple[str, ...]  # full size
    tiny_flags: tuple[str, ...]  # --tiny
    flash_on: tuple[str, ...]  # the switch for flash attention; off is ATTENTION_KIND=dot_product
    est_s: float  # rough seconds for one GPU run (start, compile, 30 steps, one eval batch)


MODELS = (
    Model(
        "Synthetic126M",
        "Synthetic126M",
        (),
        (*_TINY_DENSE, *_TINY_LAYERS, "--fdl.PERCORE_BATCH_SIZE=2"),
        ("--fdl.USE_CUDNN_FLASH_ATTENTION=True",),
        40,
    ),
    Model(
        "LLaMA-1B (fuji-1B-v3)",
        "fuji-1B-v3-flash",
        tuple(_FUJI_1B),
        (
            "--fdl.SYNTHETIC_DATA=true",
            *_TINY_DENSE,
            *_TINY_LAYERS,
            "--fdl.NUM_KV_HEADS=2",
            "--fdl.GLOBAL_BATCH_SIZE=2",
        ),
        ("--fdl.ATTENTION_KIND=flash",),
        90,
    ),
    # Pax's per-GPU batch of 4 x 2048: one GShard group of 8,192 tokens (capacity 256 per expert).
    Model(
        "GLaM126M64E",
        "SyntheticGLaM126M64E",
        (),
        (*_TINY_DENSE, "--fdl.NUM_LAYERS=2", "--fdl.PERCORE_BATCH_SIZE=2", "--fdl.NUM_EXPERTS=4"),
        ("--fdl.USE_CUDNN_FLASH_ATTENTION=True",),
        75,
    ),
)
PRECISIONS = ("bf16", "fp8")
ATTENTIONS = ("flash", "dot_product")


@dataclasses.dataclass(frozen=True)
class Case:
    model: Model
    precision: str
    attention: str

    @property
    def name(self) -> str:
        return re.sub(
            r"[^A-Za-z0-9]+", "_", f"{self.model.config}_{self.precision}_{self.attention}"
        ).lower()


def run_order() -> list[Case]:
    """Most telling first, so a tight budget still measures each model: each model in BF16 with its
    usual attention, then FP8, then the other attention."""
    usual = {
        "Synthetic126M": "dot_product",
        "fuji-1B-v3-flash": "flash",
        "SyntheticGLaM126M64E": "dot_product",
    }
    cases = []
    for precision, same in (("bf16", True), ("fp8", True), ("bf16", False), ("fp8", False)):
        for model in MODELS:
            attention = (
                usual[model.config]
                if same
                else next(a for a in ATTENTIONS if a != usual[model.config])
            )
            cases.append(Case(model, precision, attention))
    return cases


# ------------------------------------------------------------------------------------------ matmuls
def _matmul_child(out_path: str, sizes: list[int]) -> None:
    """Runs in its own process: the bf16 and FP8 ceilings as JSON."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def bf16_mm(a, b):
        return jnp.dot(a, b, preferred_element_type=jnp.bfloat16)

    def fp8_mm(a8, b8, sa, sb):
        # dequantise (convert f8 -> bf16, times a scalar scale) straight into the dot: XLA's FP8
        # GEMM pattern
        a = a8.astype(jnp.bfloat16) * sa
        b = b8.astype(jnp.bfloat16) * sb
        return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)

    def timed(fn, args, flops):
        compiled = jax.jit(fn).lower(*args).compile()
        jax.block_until_ready(compiled(*args))
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        once = max(time.perf_counter() - start, 1e-6)
        reps = max(3, min(200, int(0.5 / once)))  # about half a second of work
        for _ in range(2):
            compiled(*args)
        jax.block_until_ready(compiled(*args))
        start = time.perf_counter()
        for _ in range(reps):
            out = compiled(*args)
        jax.block_until_ready(out)
        seconds = (time.perf_counter() - start) / reps
        return flops / seconds / 1e12, compiled.as_text()

    device = jax.devices()[0]
    record = {"device_kind": device.device_kind, "platform": device.platform, "bf16": {}, "fp8": {}}
    key = jax.random.key(0)
    for n in sizes:
        ka, kb = jax.random.split(jax.random.fold_in(key, n))
        a = jax.random.normal(ka, (n, n), jnp.bfloat16)
        b = jax.random.normal(kb, (n, n), jnp.bfloat16)
        flops = 2.0 * n**3
        record["bf16"][str(n)], _ = timed(bf16_mm, (a, b), flops)
        a8, b8 = a.astype(jnp.float8_e4m3fn), b.T.astype(jnp.float8_e4m3fn)
        # scalar scales in the dot's dtype: nothing between them and the dot
        scale = jnp.ones((), jnp.bfloat16)
        tflops, hlo = timed(fp8_mm, (a8, b8, scale, scale), flops)
        record["fp8"][str(n)] = tflops
        # cuBLASLt's FP8 GEMM is a custom call taking f8e4m3fn operands; anything else ran as bf16
        targets = re.findall(r'custom_call_target="([^"]+)"', hlo)
        record["fp8_gemm"] = "cuBLASLt FP8" if any("f8" in t for t in targets) else "not rewritten"
        del a, b, a8, b8
    with open(out_path, "w") as f:
        json.dump(record, f)


def measure_matmuls(
    log_dir: str, *, sizes: list[int], env: dict[str, str], timeout_s: float
) -> dict:
    out = os.path.join(log_dir, "matmul.json")
    log = os.path.join(log_dir, "matmul.log")
    cmd = [sys.executable, os.path.abspath(__file__), "--_matmul_child", out, "--_sizes",
           ",".join(map(str, sizes))]
    status = _run(cmd, env=env, log=log, timeout_s=timeout_s)
    if status is not None:
        return {"error": status}
    with open(out) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------ runs
def _first_error(text: str) -> str:
    """The line that says what went wrong: paxlite's own one-line error, else the exception's last
    line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if "paxlite: error:" in line:
            return line.split("paxlite: error:", 1)[1].strip()
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line):
            return line
    return lines[-1] if lines else "no output"


def _run(cmd: list[str], *, env: dict[str, str], log: str, timeout_s: float,
         done: Callable[[], bool] | None = None) -> str | None:
    """Runs `cmd` with its output in `log`; None on success, else 'failed: <first error line>'.

    `done`: polled while it runs; once true, the run has given what is measured and is stopped (the
    final evaluation and teardown of a training job cost GPU time and measure nothing here).
    """
    timeout_s = max(1.0, timeout_s)
    end = time.time() + timeout_s
    with open(log, "w") as f:
        f.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
        while (rc := proc.poll()) is None:
            if done is not None and done():
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                f.write("\n[bench] measured steps logged: stopped before the final evaluation\n")
                return None
            if time.time() > end:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return f"failed: timed out after {timeout_s:.0f} s"
            # a run left going after its last step starts the final evaluation's compile
            time.sleep(0.1)
    if rc == 0:
        return None
    with open(log) as f:
        lines = f.read().splitlines()[1:]
    return f"failed: {_first_error(chr(10).join(lines))[:200]}"


def _steps(tiny: bool) -> tuple[int, int]:
    """(MAX_STEPS, SUMMARY_INTERVAL_STEPS)."""
    return (3, 1) if tiny else (30, 10)


def case_command(case: Case, *, job_dir: str, tiny: bool) -> list[str]:
    model = case.model
    steps, interval = _steps(tiny)
    cmd = [
        sys.executable,
        "-m",
        "paxlite.main",
        f"--fdl_config={model.config}",
        "--fdl.ICI_MESH_SHAPE=[1,1,1]",
        "--fdl.DCN_MESH_SHAPE=[1,1,1]",
        "--fdl.FPROP_DTYPE=bfloat16",
        f"--fdl.MAX_STEPS={steps}",
        f"--fdl.SUMMARY_INTERVAL_STEPS={interval}",
        "--fdl.EVAL_INTERVAL_STEPS=100000",
        "--fdl.EVAL_LOOP_NUM_BATCHES=1",
        *(model.tiny_flags if tiny else model.flags),
    ]
    cmd += (
        list(model.flash_on) if case.attention == "flash" else ["--fdl.ATTENTION_KIND=dot_product"]
    )
    if case.precision == "fp8":
        cmd.append("--fdl.USE_FP8=True")
    return [
        *cmd,
        "--enable_checkpoint_saving=false",
        f"--job_log_dir={job_dir}",
        "--alsologtostderr",
    ]


def read_run(job_dir: str) -> dict:
    """Medians of the train lines after the first logged window, flops_per_token and the device."""
    with open(os.path.join(job_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    logged = [line for line in lines if "loss" in line]
    train = [line for line in logged if line.get("tokens_per_s")]
    steady = train[1:] if len(train) > 1 else train
    if not steady:
        raise ValueError(f"{job_dir}/metrics.jsonl has no timed train lines")
    with open(os.path.join(job_dir, "config.json")) as f:
        config = json.load(f)

    def median(key):
        values = [line[key] for line in steady if line.get(key) is not None]
        return statistics.median(values) if values else None

    return {
        "tokens_per_s": median("tokens_per_s"),
        "input_wait_fraction": median("input_wait_fraction"),
        "step_time_s": median("step_time_s"),
        # the steps the medians cover: each logged line times the steps since the line before it
        "steps": [
            max((line["step"] for line in logged if line["step"] < steady[0]["step"]), default=0)
            + 1,
            steady[-1]["step"],
        ],
        "flops_per_token": config["flops_per_token"],
        "num_devices": config["devices"]["count"],
        "device_kind": config["devices"]["kind"],
    }


# ------------------------------------------------------------------------------------------ table
COLUMNS = (
    "model",
    "precision",
    "attention",
    "tokens/s",
    "TFLOP/s/dev",
    "MFU spec",
    "MFU measured",
    "input wait",
    "planned peak GiB",
    "measured peak GiB",
    "measured/planned",
    "note",
)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None or not math.isfinite(value) else format(value, spec)


def _tflops(value: float | None) -> str:
    """One decimal at GPU scale; three significant digits for the CPU's tiny numbers (never a bare
    0.0)."""
    return _fmt(value, ".1f" if value is not None and value >= 10 else ".3g")


def _memory(result: dict, *, ran: bool) -> list[str]:
    """planned peak GiB, measured peak GiB, measured/planned: 3 significant digits (GPU and tiny CPU
    scales alike); a run that did not run has no measured cells."""
    planned, measured = result.get("planned_peak_bytes"), result.get("measured_peak_bytes")
    cells = [_fmt(peaks.gib(planned), ".3g")]
    if not ran:
        return [*cells, "-", "-"]
    return [*cells, _fmt(peaks.gib(measured), ".3g"), _fmt(peaks.ratio(measured, planned), ".2f")]


def table_rows(
    results: list[dict], matmul: dict, spec_peaks: dict[str, float | None]
) -> list[list[str]]:
    rows = []
    for precision in PRECISIONS:
        if "error" in matmul:
            rows.append([f"matmul {precision}", precision, *["-"] * 9, matmul["error"]])
            continue
        sizes = matmul[precision]
        best = max(sizes, key=lambda n: sizes[n])
        peak = spec_peaks[precision]
        note = matmul.get("fp8_gemm", "") if precision == "fp8" else ""
        rows.append(
            [
                f"matmul {precision} {best}^3",
                precision,
                "-",
                "-",
                _tflops(sizes[best]),
                _fmt(sizes[best] * 1e12 / peak if peak else None, ".1%"),
                "100.0%",
                "-",
                "-",
                "-",
                "-",
                note,
            ]
        )
    for result in results:
        head = [result["model"], result["precision"], result["attention"]]
        if "status" in result:
            rows.append(
                [*head, "-", "-", "-", "-", "-", *_memory(result, ran=False), result["status"]]
            )
            continue
        tflops = result["tokens_per_s"] * result["flops_per_token"] / result["num_devices"] / 1e12
        peak = spec_peaks[result["precision"]]
        ceiling = None if "error" in matmul else max(matmul[result["precision"]].values())
        rows.append([*head, _fmt(result["tokens_per_s"], ",.0f"), _tflops(tflops),
                     _fmt(tflops * 1e12 / peak if peak else None, ".1%"),
                     _fmt(tflops / ceiling if ceiling else None, ".1%"),
                     _fmt(result["input_wait_fraction"], ".1%"), *_memory(result, ran=True),
                     f"steps {result['steps'][0]}-{result['steps'][-1]}"])
    return rows


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(COLUMNS[i]), *(len(r[i]) for r in rows)) for i in range(len(COLUMNS))]
    line = lambda cells: (
        "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"
    )
    return "\n".join(
        [line(COLUMNS), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)]
    )


# ------------------------------------------------------------------------------------------ main
# The preset's variables (with its flags resolved against this jaxlib) by its flags and variables:
# presets that set the same ones (llama and moe) are probed once.
_PRESET_ENV: dict[tuple, dict[str, str]] = {}


def _environment(cpu: bool, preset: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    # one device: drop a forced host device count (tests set 8)
    env["XLA_FLAGS"] = re.sub(
        r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", "")
    ).strip()
    if cpu:
        env["JAX_PLATFORMS"] = "cpu"
    if preset is not None:  # probed once per flag set (a short JAX start on the CPU)
        spec = xla_presets.get_preset(preset)
        key = (spec.flags, spec.env)
        if key not in _PRESET_ENV:
            _PRESET_ENV[key], dropped = xla_presets.environment(
                spec, base_flags=env.get("BASE_XLA_FLAGS"), environ=env)
            print(
                f"[bench] XLA preset {preset}: {_PRESET_ENV[key]}"
                + "".join(f"; left out (unknown to this jaxlib): {f.spellings}" for f in dropped),
                flush=True,
            )
        env.update(_PRESET_ENV[key])
    return env


def _start_planning(
    cases: list[Case],
    *,
    args: argparse.Namespace,
    target: str | None,
    deadline: float,
    log_dir: str,
    say: Callable[[str], None],
) -> subprocess.Popen | None:
    """The planner subprocess for `cases` (None when there is no target or no time)."""
    if target is None or not cases:
        return None
    if deadline - time.time() < (5 if args.tiny else 30):
        say("planning: skipped (time budget)")
        return None
    say(
        f"planning {len(cases)} cases for {target}, at most {args.plan_s:.0f} s, beside the matmuls"
    )
    return peaks.start_planner(
        log_dir,
        cases=[peaks.plan_case(c.name, case_command(c, job_dir="", tiny=args.tiny)) for c in cases],
        target=target,
        num_devices=1,
        env=_environment(args.cpu, None),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log_dir", default=os.environ.get("OUT") or "/tmp/paxlite_gpu_bench")
    parser.add_argument("--deadline_s", type=float, default=None,
                        help="UNIX time by which the last run must end (default: now + 420 s)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU backend")
    parser.add_argument("--tiny", action="store_true", help="tiny models, 3 steps, tiny matmuls")
    parser.add_argument("--peak_tflops", default=None,
                        help="BF16,FP8 spec peaks in TFLOP/s per device (default: paxlite's table)")
    parser.add_argument("--only", default=None, help="comma-separated model labels or configs to "
                                                     "run")
    parser.add_argument("--plan_s", type=float, default=60,
                        help="seconds the planner may take (beside the matmuls) before the first "
                             "run")
    parser.add_argument("--plan_target", default=None, type=str.lower,
                        help="the GPU model to plan for (default: the local GPU's; cpu with --cpu)")
    parser.add_argument("--_matmul_child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_sizes", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._matmul_child:
        _matmul_child(args._matmul_child, [int(n) for n in args._sizes.split(",")])
        return 0
    platform = xla_presets.detect_platform()
    if not args.cpu and platform.platform is xla_presets.Platform.TPU:
        # cuDNN flash rows, FP8 GEMMs and GPU presets mean nothing there: the TPU has its own
        print(f"bench: error: this host has a TPU ({platform.evidence}): run the TPU benchmark, "
              "bash benchmarks/tpu/run.sh (splash attention, int8 ceilings, TPU peaks)",
              file=sys.stderr)
        return 2
    peak_override = None
    if args.peak_tflops:
        try:
            bf16, fp8 = (float(x) for x in args.peak_tflops.split(","))
        except ValueError:
            print(f"bench: error: --peak_tflops={args.peak_tflops!r}: give BF16,FP8 in TFLOP/s, "
                  "e.g. 989,1979",
                  file=sys.stderr)
            return 2
        peak_override = {"bf16": bf16 * 1e12, "fp8": fp8 * 1e12}
    if args.plan_target is not None and args.plan_target not in peaks.TARGETS:
        print(f"bench: error: --plan_target={args.plan_target!r}: expected one of "
              f"{', '.join(peaks.TARGETS)}",
              file=sys.stderr)
        return 2
    models = MODELS
    if args.only:
        wanted = set(args.only.split(","))
        models = tuple(m for m in MODELS if m.label in wanted or m.config in wanted)
        if not models:
            print(f"bench: error: --only={args.only!r} names no model; valid: "
                  f"{', '.join(m.config for m in MODELS)}", file=sys.stderr)
            return 2
    log_dir = os.path.abspath(args.log_dir)
    os.makedirs(log_dir, exist_ok=True)
    deadline = args.deadline_s or time.time() + 420
    say = lambda msg: print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)
    cases = [c for c in run_order() if c.model in models]

    # planned peaks, beside the matmul part; --tiny plans the first case only: the dry run needs one
    # to exercise the planning path, and each tiny compile costs seconds of the CPU the runs share
    target, target_note = peaks.plan_target(cpu=args.cpu, requested=args.plan_target)
    planned_cases = cases[:1] if args.tiny else cases
    plan_started = time.time()
    planner = _start_planning(
        planned_cases, args=args, target=target, deadline=deadline, log_dir=log_dir, say=say
    )

    sizes = [64, 128] if args.tiny else [4096, 8192, 16384]
    say(f"matmul ceilings, sizes {sizes}")
    if deadline - time.time() < (5 if args.tiny else 30):
        matmul = {"error": "skipped: time budget"}
    else:
        matmul = measure_matmuls(log_dir, sizes=sizes, env=_environment(args.cpu, None),
                                 timeout_s=min(120, deadline - time.time()))
    say(f"matmul: {json.dumps(matmul)}")
    plan_stop = (
        peaks.finish_planner(planner, until=min(plan_started + args.plan_s, deadline))
        if planner
        else None
    )
    plans = peaks.read_plans(log_dir) if planner else {}
    planning = peaks.planning_summary(
        plans, target_note=target_note, cases=[c.name for c in cases],
        asked=[c.name for c in planned_cases] if planner else [], stopped=plan_stop,
        seconds=time.time() - plan_started, asked_note="--tiny plans the first case only")
    say(f"planning: {planning}")

    results: dict[str, dict] = {}
    device_kind = matmul.get("device_kind", "")
    for case in cases:
        result = {
            "model": case.model.label,
            "precision": case.precision,
            "attention": case.attention,
            "planned_peak_bytes": plans.get(case.name, {}).get("peak_bytes"),
        }
        results[case.name] = result
        left = deadline - time.time()
        need = 5 if args.tiny else case.model.est_s
        if left < need:
            result["status"] = "skipped: time budget"
            say(f"{case.name}: skipped ({left:.0f} s left, about {need:.0f} s needed)")
            continue
        job_dir = os.path.join(log_dir, case.name)
        cmd = case_command(case, job_dir=job_dir, tiny=args.tiny)
        say(f"{case.name}: {' '.join(cmd[2:])}")
        started = time.time()
        env = _environment(args.cpu, xla_presets.preset_for_experiment(case.model.config))
        # the same run with a thread beside it that reads the devices' memory peak after each train
        # line
        status = _run(peaks.watched_command(cmd, job_dir=job_dir), env=env,
                      log=os.path.join(log_dir, f"{case.name}.log"), timeout_s=left,
                      done=peaks.measured_after(job_dir, _steps(args.tiny)[0]))
        if status is None:
            try:
                result.update(read_run(job_dir))
                device_kind = result["device_kind"]
            except (OSError, ValueError, KeyError) as e:
                status = f"failed: {e}"
            # only a reading after the last step has the whole peak
            reading = peaks.read_measured(job_dir)
            last = reading.get("step", 0) >= _steps(args.tiny)[0]
            result["measured_peak_bytes"] = reading.get("peak_bytes_in_use") if last else None
        if status is not None:
            result["status"] = status
        say(f"{case.name}: {time.time() - started:.0f} s, {result.get('status') or 'ok'}")

    spec_peaks = peak_override or {
        p: peak_flops_per_device(device_kind, fp8=p == "fp8") for p in PRECISIONS
    }
    ordered = [results[c.name] for m in models for p in PRECISIONS for a in ATTENTIONS
               for c in [Case(m, p, a)] if c.name in results]
    table = format_table(table_rows(ordered, matmul, spec_peaks))
    spec = ", ".join(f"{p} {_fmt(v and v / 1e12, '.0f')}" for p, v in spec_peaks.items())
    measured = [r["measured_peak_bytes"] for r in ordered if "measured_peak_bytes" in r]
    footer = (
        f"device: {device_kind or 'unknown'}; spec peaks TFLOP/s: {spec}; MFU of FP8 rows is "
        "against the FP8 peak and ceiling; medians over the windows after the first; logs in "
        + log_dir
        + "\n"
        f"planned peak: the train step compiled before the runs, {planning}; measured peak: "
        "peak_bytes_in_use of the run's device after its last step"
        + ("" if any(m is not None for m in measured) or not measured else " (none reported: n/a)")
    )
    with open(os.path.join(log_dir, "results.json"), "w") as f:
        json.dump(
            {
                "matmul": matmul,
                "runs": ordered,
                "peaks": spec_peaks,
                "planning": {"target": target, "summary": planning, "cases": plans},
            },
            f,
            indent=2,
        )
    with open(os.path.join(log_dir, "table.md"), "w") as f:
        f.write(table + "\n\n" + footer + "\n")
    print("\n" + footer + "\n\n" + table, flush=True)  # the table last
    return 0


if __name__ == "__main__":
    sys.exit(main())
