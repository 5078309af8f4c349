"""The one-call TPU benchmark: matmul ceilings, then paxlite's training step beside a bare-JAX step
of the same shapes, for each case, as one table.

    python benchmarks/tpu/bench.py --log_dir=DIR [--cases=NAME,...] [--steps=10] [--deadline_s=T]
                                   [--cpu --tiny]

Parts (benchmarks/tpu/run.sh calls this after the TPU tests; docs/performance.md, "TPU benchmark"):
1. The measured matmul ceiling of the chip: square bf16 `jnp.dot`s and int8 ones (int32
   accumulation: the low-precision path of v5e and v6e, which have no FP8 units), TFLOP/s (TOP/s)
   of the best size, against the chip's published peaks (paxlite.train.flops).
2. Each case in a process of its own (only one program holds the chip; a fresh process also makes
   its peak memory the case's own): paxlite's real training path (`Run.train()` on synthetic tokens,
   checkpoints off) for one untimed compiling step and `--steps` timed ones, then, where the model
   is a GPT the bare step can express, a hand-written jax.numpy + optax step of the same shapes
   (float32 parameters, the run's activation dtype, `jax.checkpoint` per layer where paxlite
   recomputes, the same attention kernel) timed the same way. Columns: step time, tokens/s, MFU (by
   paxlite's FLOP count against the chip's bf16 peak), paxlite / bare, paxlite's peak device memory
   (`memory_stats()`, measured after its steps, before the bare step runs) beside the TPU compiler's
   own figure for the same compiled step (`memory_analysis()`: arguments + outputs + temporaries -
   aliased), and their ratio. The measured peak is the runtime's two high-water marks together:
   buffers (`peak_bytes_in_use`) and what it reserves for loaded programs' temporaries
   (`peak_bytes_reserved`; on a TPU the first alone missed the temporaries).

A case that fails gives its row "failed: <first error line>"; a case that would pass the deadline
is not started. `--cpu --tiny` runs every part on the CPU in seconds (tiny models): the test
(tests/test_tpu_benchmark.py) and a dry run before spending chip time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

GIB = 2**30
# The 507M GPT of docs/performance.md's TPU table: 16 layers, d 1536, 12 heads of 128, FFN 6144,
# vocabulary 32768, scanned and recomputed (SAVE_NOTHING).
_GPT507M = ("NUM_LAYERS=16", "MODEL_DIMS=1536", "NUM_HEADS=12", "DIMS_PER_HEAD=128",
            "HIDDEN_DIMS=6144", "VOCAB_SIZE=32768", "USE_REPEATED_LAYER=True",
            "CHECKPOINT_POLICY='SAVE_NOTHING'")
_ONE_CHIP = ("ICI_MESH_SHAPE=[1,1,1]", "DCN_MESH_SHAPE=[1,1,1]")
_SPLASH = ("ATTENTION_IMPLEMENTATION='splash'",)
_TINY = ("NUM_LAYERS=2", "MODEL_DIMS=64", "NUM_HEADS=4", "DIMS_PER_HEAD=16", "HIDDEN_DIMS=128",
         "VOCAB_SIZE=256", "MAX_SEQ_LEN=128", "PERCORE_BATCH_SIZE=2")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    experiment: str
    overrides: tuple[str, ...]
    bare: bool = True  # a GPT the bare step expresses
    steps: int | None = None  # timed steps, where fewer than --steps will do


# Most telling first: a deadline cuts the last ones.
CASES = (
    Case("gpt126m_b4", "Synthetic126M", (*_ONE_CHIP, "PERCORE_BATCH_SIZE=4")),
    Case("gpt507m_b4", "Synthetic126M", (*_ONE_CHIP, *_GPT507M, "PERCORE_BATCH_SIZE=4")),
    Case("gpt507m_b4_splash", "Synthetic126M",
         (*_ONE_CHIP, *_GPT507M, "PERCORE_BATCH_SIZE=4", *_SPLASH)),
    Case("gpt507m_s8192_b1_splash", "Synthetic126M",
         (*_ONE_CHIP, *_GPT507M, "PERCORE_BATCH_SIZE=1", "MAX_SEQ_LEN=8192", *_SPLASH)),
    Case("qwen2.5-0.5b_b4", "Qwen2_5_0_5B",
         ("SYNTHETIC_DATA=True", "CHECKPOINT_RESTORE_PATH=None", "MAX_SEQ_LEN=2048",
          "GLOBAL_BATCH_SIZE=4", *_ONE_CHIP), bare=False),
    Case("gpt126m_b4_splash", "Synthetic126M", (*_ONE_CHIP, "PERCORE_BATCH_SIZE=4", *_SPLASH)),
    # XLA's attention at 8192 tokens: ~11 s a step, so two timed steps
    Case("gpt507m_s8192_b1", "Synthetic126M",
         (*_ONE_CHIP, *_GPT507M, "PERCORE_BATCH_SIZE=1", "MAX_SEQ_LEN=8192"), steps=2),
    Case("gpt507m_s32768_b1_splash", "Synthetic126M",
         (*_ONE_CHIP, *_GPT507M, "PERCORE_BATCH_SIZE=1", "MAX_SEQ_LEN=32768", *_SPLASH),
         bare=False, steps=3),
)


# --------------------------------------------------------------------------- matmul ceilings
def matmul_ceilings(sizes: Sequence[int], *, repeats: int = 5) -> dict:
    """Best TFLOP/s (bf16) and TOP/s (int8 x int8 -> int32) over square matmuls of `sizes`."""
    import jax
    import jax.numpy as jnp

    out = {}
    for name, dtype, accumulate in (("bf16", jnp.bfloat16, jnp.float32),
                                    ("int8", jnp.int8, jnp.int32)):
        best = 0.0
        for n in sizes:
            a = jnp.ones((n, n), dtype)
            b = jnp.ones((n, n), dtype)
            f = jax.jit(lambda x, y, acc=accumulate: jnp.dot(x, y, preferred_element_type=acc))
            jax.block_until_ready(f(a, b))
            start = time.perf_counter()
            for _ in range(repeats):
                result = f(a, b)
            jax.block_until_ready(result)
            seconds = (time.perf_counter() - start) / repeats
            best = max(best, 2 * n**3 / seconds / 1e12)
        out[name] = best
    return out


# ------------------------------------------------------------------------------ the bare step
def bare_step(model: dict, *, dtype: str, remat: bool, attention: str):
    """The jitted bare GPT step (donated state): cpu_step.py's pre-LN GPT in `dtype` activations,
    each layer under `jax.checkpoint` (nothing saved) when `remat`, attention by XLA or splash."""
    import jax
    import jax.numpy as jnp
    import optax

    from benchmarks.cpu_step import _layer_norm

    compute = jnp.dtype(dtype)
    scale = model["dims_per_head"] ** -0.5
    eps = model["norm_epsilon"]

    def layer(x, p):
        def c(w):
            return w.astype(compute)

        y = _layer_norm(x, p["ln1"], eps)
        qkv = jnp.einsum("btd,dknh->btknh", y, c(p["qkv_w"])) + c(p["qkv_b"])  # [B, T, 3, N, H]
        q, k, v = qkv[:, :, 0] * scale, qkv[:, :, 1], qkv[:, :, 2]
        if attention == "splash":
            from paxlite.models.splash_attention import splash_attention

            attn = splash_attention(q, k, v, segment_ids=None)
        else:
            attn = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=1.0,
                                                implementation="xla")
        x = x + (jnp.einsum("btnh,nhd->btd", attn, c(p["out_w"])) + c(p["out_b"]))
        y = _layer_norm(x, p["ln2"], eps)
        hidden = jax.nn.gelu(y @ c(p["wi"]) + c(p["bi"]), approximate=True)
        return x + (hidden @ c(p["wo"]) + c(p["bo"]))

    if remat:
        layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)

    def loss_fn(params, inputs, targets):
        t = inputs.shape[1]
        x = (params["embedding"][inputs] + params["position"][:t][None]).astype(compute)
        for p in params["layers"]:
            x = layer(x, p)
        x = _layer_norm(x, params["final_ln"], eps)
        logits = jnp.einsum("btd,vd->btv", x, params["embedding"].astype(compute))
        logits = logits.astype(jnp.float32)
        log_z = jax.nn.logsumexp(logits, axis=-1)
        target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return jnp.mean(log_z - target)

    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-4))

    def step(params, opt_state, inputs, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1)), optimizer


def time_bare(config, *, steps: int) -> dict:
    import jax
    import numpy as np

    from benchmarks.cpu_step import BareModel, bare_init

    m = config.model
    model = BareModel(num_layers=m.num_layers, model_dims=m.model_dims, num_heads=m.num_heads,
                      dims_per_head=m.dims_per_head, hidden_dims=m.hidden_dims,
                      vocab_size=m.vocab_size, max_seq_len=m.max_seq_len, init_std=m.init_std,
                      norm_epsilon=m.norm_epsilon)
    attention = ("splash" if str(getattr(m.attention_implementation, "value", "")) == "splash"
                 else "xla")
    step, optimizer = bare_step(dataclasses.asdict(model), dtype=m.dtype,
                                remat=str(m.remat_policy.value) != "none", attention=attention)
    params = bare_init(jax.random.key(0), model)
    state = [params, optimizer.init(params)]
    batch = int(config.loop.percore_batch_size * jax.device_count())
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, m.vocab_size, size=(batch, config.data.seq_len + 1), dtype=np.int32)
    inputs, targets = jax.device_put(tokens[:, :-1]), jax.device_put(tokens[:, 1:])
    compiled = step.lower(*state, inputs, targets).compile()
    params, opt_state, loss = compiled(*state, inputs, targets)
    jax.block_until_ready(loss)
    start = time.perf_counter()
    for _ in range(steps):
        params, opt_state, loss = compiled(params, opt_state, inputs, targets)
    jax.block_until_ready((params, loss))
    return {"bare_step_s": (time.perf_counter() - start) / steps,
            "bare_compiled_bytes": compiled_bytes(compiled), "bare_loss": float(loss)}


def compiled_bytes(compiled) -> int | None:
    """What the compiler says the program needs on the device at its peak (None where it does not
    say): its own `peak_memory_in_bytes` where it reports one (the TPU compiler does: within 0.6%
    of the runtime's measured peak on the chip), else arguments + outputs + temporaries - aliased
    (which counts every temporary as live beside the arguments: 17% over on the 507M GPT)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    peak = getattr(analysis, "peak_memory_in_bytes", 0)
    if peak:
        return int(peak)
    return int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes
               + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)


# ---------------------------------------------------------------------------- one case (child)
def run_case(case: Case, *, steps: int, tiny: bool, job_dir: str) -> dict:
    import jax

    from paxlite.experiments.build import build_run_config
    from paxlite.train.loop import Run, RunContext

    total = steps + 1
    overrides = [*case.overrides, f"MAX_STEPS={total}",
                 f"SUMMARY_INTERVAL_STEPS={total}", f"EVAL_INTERVAL_STEPS={total + 1}",
                 f"CHECKPOINT_EVERY_N_STEPS={total + 1}", "SYNTHETIC_DATA=True"]
    if tiny:  # the tiny sizes replace the case's own
        names = {o.split("=")[0] for o in _TINY}
        overrides = [*(o for o in overrides if o.split("=")[0] not in names), *_TINY]
    _, config = build_run_config(case.experiment, overrides)
    device = jax.devices()[0]
    result: dict = {"case": case.name, "device_kind": device.device_kind,
                    "platform": device.platform}
    with Run(config, RunContext(job_dir=job_dir, enable_checkpoint_saving=False)) as run:
        run.train()
        # the allocator's high-water mark of this process: the run's own (nothing else ran here)
        stats = device.memory_stats() or {}
        result["memory_stats"] = stats
        if "peak_bytes_in_use" in stats:  # buffers, and what programs reserve for temporaries
            result["measured_bytes"] = (stats["peak_bytes_in_use"]
                                        + stats.get("peak_bytes_reserved", 0))
        batch = next(iter(run.data.eval_batches(1, run.steps.batch_sharding)))
        # Under the run's mesh, as the loop calls the step: the same program, so its compile is
        # read back from the cache. Outside it the activations' sharding constraints are left out
        # and the step compiles again, a different program.
        with jax.set_mesh(run.mesh):
            compiled = run.steps.train.lower(run.steps.abstract_state, batch).compile()
        result["planned_bytes"] = compiled_bytes(compiled)
        analysis = compiled.memory_analysis()
        result["memory_analysis"] = {name: getattr(analysis, name) for name in dir(analysis)
                                     if name.endswith("_in_bytes")}
        del batch, compiled
    with open(os.path.join(job_dir, "metrics.jsonl"), encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    summary = [x for x in lines if x.get("step") == total and "step_time_s" in x][-1]
    result.update(step_s=summary["step_time_s"], tokens_per_s=summary["tokens_per_s"],
                  mfu=summary.get("mfu"), loss=summary.get("loss"),
                  flops_per_token=config.loop.flops_per_token)
    if case.bare:
        result.update(time_bare(config, steps=steps))
    return result


# ------------------------------------------------------------------------------- the table
def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def table(results: list[dict], ceilings: dict, peaks: dict) -> str:
    head = ["case", "step s", "tok/s", "MFU", "bare step s", "paxlite/bare", "peak GiB measured",
            "compiled GiB", "measured/compiled"]
    rows = [head, ["---"] * len(head)]
    for r in results:
        if "error" in r:
            rows.append([r["case"], f"failed: {r['error']}"] + [""] * (len(head) - 2))
            continue
        bare = r.get("bare_step_s")
        measured, planned = r.get("measured_bytes"), r.get("planned_bytes")
        rows.append([
            r["case"], _fmt(r["step_s"], ".4f"), _fmt(r["tokens_per_s"], ",.0f"),
            "n/a" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%",
            _fmt(bare, ".4f"), "n/a" if bare is None else f"{r['step_s'] / bare:.3f}",
            _fmt(None if measured is None else measured / GIB, ".2f"),
            _fmt(None if planned is None else planned / GIB, ".2f"),
            "n/a" if not (measured and planned) else f"{measured / planned:.3f}"])
    ceiling = (f"matmul ceiling: bf16 {ceilings.get('bf16', 0):.1f} TFLOP/s (peak "
               f"{_fmt(peaks.get('bf16'), '.0f')}), int8 {ceilings.get('int8', 0):.1f} TOP/s "
               f"(peak {_fmt(peaks.get('int8'), '.0f')})")
    lines = [ceiling, ""]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _child_main(args) -> int:
    case = {c.name: c for c in CASES}[args.child]
    os.makedirs(args.job_dir, exist_ok=True)
    steps = args.steps if case.steps is None or args.tiny else min(args.steps, case.steps)
    result = run_case(case, steps=steps, tiny=args.tiny, job_dir=args.job_dir)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


def _ceilings_main(*, tiny: bool) -> int:
    """The ceilings part (its own process): one JSON line, with the chip's published peaks."""
    import jax

    from paxlite.train import flops

    kind = jax.devices()[0].device_kind
    ceilings = matmul_ceilings([256, 512] if tiny else [4096, 8192, 16384])
    peaks = {"bf16": (flops.peak_flops_per_device(kind) or 0) / 1e12 or None,
             "int8": (flops.peak_int8_ops_per_device(kind) or 0) / 1e12 or None}
    print(json.dumps({"ceilings": ceilings, "peaks": peaks, "device_kind": kind}))
    return 0


def _first_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if "Error" in line or line.startswith("paxlite:"):
            return line[:200]
    return (lines[-1] if lines else "no output")[:200]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--log_dir", required=True)
    parser.add_argument("--cases", default=",".join(c.name for c in CASES))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--deadline_s", type=float, default=None, help="a UNIX time")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (JAX_PLATFORMS=cpu)")
    parser.add_argument("--tiny", action="store_true", help="tiny models, for a dry run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--job_dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--ceilings_child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child_main(args)
    if args.ceilings_child:
        return _ceilings_main(tiny=args.tiny)
    known = {c.name for c in CASES}
    wanted = [n for n in args.cases.split(",") if n]
    unknown = [n for n in wanted if n not in known]
    if unknown:
        print(f"--cases: unknown {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return 2
    os.makedirs(args.log_dir, exist_ok=True)
    env = dict(os.environ)
    # each case's memory figure compiles its step a second time: read back from the cache
    env.setdefault("JAX_COMPILATION_CACHE_DIR",
                   os.path.join(tempfile.gettempdir(), "paxlite-tpu-bench-jax-cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    if args.cpu:
        env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), ROOT) if p)
    # the ceilings in a process of their own too (this one never holds the chip)
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--log_dir", args.log_dir,
                           "--ceilings_child", *(["--tiny"] if args.tiny else [])], env=env,
                          capture_output=True, text=True, check=False)
    try:
        head = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        print("matmul ceilings failed: " + _first_error(done.stdout + done.stderr))
        head = {"ceilings": {}, "peaks": {}}
    print(json.dumps(head), flush=True)
    results = []
    for name in wanted:
        if args.deadline_s is not None and time.time() > args.deadline_s:
            results.append({"case": name, "error": "skipped: time budget"})
            continue
        out = os.path.join(args.log_dir, f"{name}.json")
        log = os.path.join(args.log_dir, f"{name}.log")
        command = [sys.executable, os.path.abspath(__file__), "--log_dir", args.log_dir,
                   "--child", name, "--job_dir", os.path.join(args.log_dir, "jobs", name),
                   "--out", out, "--steps", str(args.steps), *(["--tiny"] if args.tiny else [])]
        timeout = None if args.deadline_s is None else max(1.0, args.deadline_s - time.time())
        start = time.time()
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True,
                                  timeout=timeout, check=False)
            with open(log, "w", encoding="utf-8") as f:
                f.write(done.stdout + done.stderr)
            if done.returncode == 0:
                with open(out, encoding="utf-8") as f:
                    results.append(json.load(f))
            else:
                results.append({"case": name, "error": _first_error(done.stdout + done.stderr)})
        except subprocess.TimeoutExpired:
            results.append({"case": name, "error": "stopped at the deadline"})
        print(f"{name}: {time.time() - start:.0f} s {json.dumps(results[-1])}", flush=True)
    print(table(results, head.get("ceilings", {}), head.get("peaks", {})))
    with open(os.path.join(args.log_dir, "results.json"), "w", encoding="utf-8") as f:
        json.dump({"head": head, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
