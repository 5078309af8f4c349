"""Host overhead of paxlite's training loop: `Run.train()` against the same jitted step in a bare
loop.

Why: on a model whose step takes well under a millisecond, everything the loop does on the host per
step (building the batch, reading metrics back, checking finiteness, bookkeeping) shows up directly
in the step time. This benchmark isolates that cost. Both sides run the *same* compiled
`train_step` of a tiny LLaMA-style model (1 layer, d_model 32, 4 rows x 16 tokens, one device):

- bare: the jitted step called in a tight Python loop over device batches built beforehand, one
  `block_until_ready` at the end (what a hand-written JAX loop does);
- paxlite: the real `Run.train()` with its synthetic feed (what a user gets; batches are built
  and put on the device by the loop's input producer), its step_time_s read from metrics.jsonl;
- paxlite-prebuilt: `Run.train()` fed the bare side's pre-built device batches, so only the loop's
  own bookkeeping differs from the bare side.

Rounds alternate the order of the sides; the ratio reported is median(paxlite) / median(bare).
Goal: paxlite <= 1.10x the bare step.

    .venv/bin/python benchmarks/host_overhead.py --steps 200 --rounds 5

`--tiny` (a few steps, one round) checks the harness only; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from paxlite.experiments.build import build_run_config
from paxlite.train.loop import Run, RunContext

EXPERIMENT = "paxlite.experiments.tiny.TinyLLaMA"
ROWS = 4


def overrides(steps: int, *, num_devices: int) -> list[str]:
    """One untimed (compiling) step, then `steps` timed ones in one summary window; the eval and
    the (disabled) checkpoint at the last step come after that window is closed."""
    total = steps + 1
    return [
        "SYNTHETIC_DATA=True",
        "NUM_LAYERS=1",
        "MODEL_DIMS=32",
        "MAX_SEQ_LEN=16",
        f"GLOBAL_BATCH_SIZE={max(ROWS, num_devices)}",
        "EVAL_LOOP_NUM_BATCHES=1",
        f"MAX_STEPS={total}",
        f"SUMMARY_INTERVAL_STEPS={total}",
        f"EVAL_INTERVAL_STEPS={total + 1}",
        f"CHECKPOINT_EVERY_N_STEPS={total + 1}",
    ]


class PrebuiltFeed:
    """The synthetic feed's batches, built and put on the device before timing starts."""

    metric_prefix = ""
    has_eval_data = True

    def __init__(self, feed: Any, batches: Sequence[dict[str, jax.Array]]):
        self._feed = feed
        self._batches = batches

    def train_batch(self, index: int, sharding: Any) -> dict[str, jax.Array]:
        del sharding
        return self._batches[index]

    def eval_batches(self, num_batches: int, sharding: Any) -> Iterator[dict[str, jax.Array]]:
        return self._feed.eval_batches(num_batches, sharding)

    def __getattr__(self, name: str) -> Any:  # state(), restore(), position(): the real feed's
        return getattr(self._feed, name)


def paxlite_round(run: Run, *, max_steps: int) -> float:
    """One `Run.train()` from a fresh state; its step_time_s for the window ending at the last
    step."""
    run.train()
    path = os.path.join(run.context.job_dir, "metrics.jsonl")
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    timed = [x for x in lines if x.get("step") == max_steps and x.get("step_time_s") is not None]
    if not timed:
        raise RuntimeError(f"no timed summary line for step {max_steps} in {path}")
    return float(timed[-1]["step_time_s"])


def bare_round(run: Run, batches: Sequence[dict[str, jax.Array]]) -> float:
    """A fresh state, one untimed step, then len(batches) - 1 timed ones ending in one block."""
    state = run.steps.init()
    state, metrics = run.steps.train(state, batches[0])
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for batch in batches[1:]:
        state, metrics = run.steps.train(state, batch)
    jax.block_until_ready((state, metrics))
    return (time.perf_counter() - start) / (len(batches) - 1)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per round and side")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per side")
    parser.add_argument("--tiny", action="store_true", help="2 steps, 1 round: a harness check")
    args = parser.parse_args(argv)
    if args.tiny:
        args.steps, args.rounds = 2, 1
    if args.steps < 1 or args.rounds < 1:
        parser.error(f"--steps and --rounds must be >= 1, got {args.steps} and {args.rounds}")
    if jax.device_count() != 1 and not args.tiny:
        raise SystemExit(f"this benchmark runs on one device and JAX sees {jax.device_count()}; "
                         "restrict it, e.g. CUDA_VISIBLE_DEVICES=0")
    max_steps = args.steps + 1
    _, config = build_run_config(EXPERIMENT, overrides(args.steps, num_devices=jax.device_count()))
    times: dict[str, list[float]] = {"bare": [], "paxlite": [], "paxlite_prebuilt": []}
    with tempfile.TemporaryDirectory() as job_dir, Run(
            config, RunContext(job_dir=job_dir, enable_checkpoint_saving=False)) as run:
        synthetic = run.data
        with jax.set_mesh(run.mesh):
            batches = [synthetic.train_batch(i, run.steps.batch_sharding) for i in range(max_steps)]
        jax.block_until_ready(batches)
        prebuilt = PrebuiltFeed(synthetic, batches)
        for index in range(args.rounds):
            sides = list(times)
            if index % 2:  # alternate the order so slow drift on a shared host hits every side
                sides.reverse()
            for side in sides:
                if side == "bare":
                    with jax.set_mesh(run.mesh):
                        times[side].append(bare_round(run, batches))
                else:
                    run.data = prebuilt if side == "paxlite_prebuilt" else synthetic
                    times[side].append(paxlite_round(run, max_steps=max_steps))
            print(f"round {index + 1}: " + ", ".join(
                f"{side} {1e3 * t[-1]:.3f} ms/step" for side, t in times.items()), flush=True)
    medians = {side: statistics.median(t) for side, t in times.items()}
    device = jax.devices()[0]
    result = {
        "steps": args.steps,
        "rounds": args.rounds,
        "batch": f"{config.loop.global_batch_size or ROWS} x {config.model.max_seq_len}",
        **{f"{side}_ms": [round(1e3 * x, 4) for x in t] for side, t in times.items()},
        **{f"{side}_median_ms": round(1e3 * m, 4) for side, m in medians.items()},
        "ratio": medians["paxlite"] / medians["bare"],
        "ratio_prebuilt": medians["paxlite_prebuilt"] / medians["bare"],
        "jax": jax.__version__,
        "device": f"{device.platform} ({device.device_kind})",
    }
    print(json.dumps(result))
    print(f"jax {jax.__version__} on {result['device']}, {platform.node() or 'host'}, "
          f"{os.cpu_count()} CPUs; TinyLLaMA 1 layer, d_model 32, batch {result['batch']}; "
          f"{args.steps} steps x {args.rounds} rounds")
    print(f"bare {1e3 * medians['bare']:.3f} ms/step; paxlite {1e3 * medians['paxlite']:.3f} "
          f"ms/step, ratio {result['ratio']:.3f}; with pre-built batches "
          f"{1e3 * medians['paxlite_prebuilt']:.3f} ms/step, ratio {result['ratio_prebuilt']:.3f} "
          "(goal <= 1.10)")
    return result


if __name__ == "__main__":
    main()
