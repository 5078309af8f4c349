"""Step time of a pipelined tiny dense model over its unpipelined twin on the same 8 CPU devices.

Why: a pipeline pays for its bubble. With S stages, R layer repeats per stage (R = 1 GPipe, R > 1
the circular schedule) and M microbatches, ``R*M + S - 1`` iterations run where ``R*M`` would carry
work, so a ``(S - 1) / (R*M + S - 1)`` share of the stage-iterations is bubble
(``paxlite.models.pipeline.bubble_fraction``). This benchmark measures what the schedule costs in a
real jitted train step (``compile_steps``: forward, backward, Adam) against that formula.

The two sides, built from the same experiment (TinySynthetic at a larger size: scanned layers,
``--layers`` divisible by S*R) with the same global batch, the same initial state and the same 8
devices:

- pipelined: ICI mesh ``[data, 1, 1, 1, pipeline] = [8/S, 1, 1, 1, S]``, ``NUM_MICROBATCHES=M``,
  ``PIPELINE_REPEATS=R``;
- unpipelined twin: ICI ``[8, 1, 1]``, all 8 devices on the data axis.

Before timing, both sides take their first step from the same initial state on the same batch and
must report the same loss (relative 1e-4); otherwise the benchmark fails (two different computations
are not worth timing). Then rounds alternate the sides (A/B, B/A, ...); each round is one untimed
step and ``--steps`` timed ones. Reported per case: median ms/step of both, the median of the
per-round ratios pipelined / twin, the bubble fraction and the ratio it implies.

What the ratio means on this host. The 8 "devices" are XLA:CPU threads sharing the host's cores
(2 on the project's machine), so they do not run in parallel and no pipeline speed-up can show. The
pipelined step computes S*(R*M + S - 1) stage-iterations where S*R*M carry data (bubble iterations
compute on zeros and are discarded), so its layer work is
``(R*M + S - 1) / (R*M) = 1 / (1 - bubble)`` times the twin's: that is the expected ratio printed.
The measured ratio is that extra work plus the schedule's own overhead (stage shifts, per-iteration
weight selection, smaller matmuls on microbatches). The part of the step outside the layers
(embedding, logits and loss) is not inflated by the bubble, but on the pipelined mesh its batch is
split over the data axis only, so each device computes it for S times the rows a twin device does
(small here: vocabulary 256). On a GPU cluster, where stages do run at once, the same number
``1 / (1 - bubble)`` is the time of the pipelined step over a bubble-free one; this benchmark does
not measure that speed-up.

    .venv/bin/python benchmarks/pipeline_step.py --steps 2 --rounds 5   # ~2 min on 2 cores

``--tiny`` (4 stages, a small model, one round) checks the harness only; its numbers mean nothing.
"""

from __future__ import annotations

import os
import sys

_DEVICES = 8
if "jax" not in sys.modules:  # the fake devices must be asked for before JAX starts
    _flag = f"--xla_force_host_platform_device_count={_DEVICES}"
    _flags = os.environ.get("XLA_FLAGS", "").split()
    if not any(f.startswith("--xla_force_host_platform_device_count") for f in _flags):
        os.environ["XLA_FLAGS"] = " ".join([*_flags, _flag])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # Compiles are not timed, and a pipelined step read back from JAX's persistent compilation
    # cache has deadlocked in its collectives on fake CPU devices (jax 0.12.0.1): compile afresh.
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

import argparse
import dataclasses
import json
import platform
import statistics
import time
from typing import Any

import fiddle as fdl
import jax

from paxlite.data.synthetic import SyntheticData
from paxlite.experiments.build import load_experiment
from paxlite.models.pipeline import bubble_fraction
from paxlite.models.transformer import Transformer
from paxlite.parallel.mesh import build_mesh
from paxlite.train.optimizer import make_optimizer
from paxlite.train.schedules import make_schedule
from paxlite.train.step import compile_steps

EXPERIMENT = "TinySynthetic"
LOSS_TOLERANCE = 1e-4  # relative: pipelined vs twin loss on the same batch and state


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sizes:
    """The model and batch both sides share."""

    layers: int
    model_dims: int
    heads: int
    seq_len: int
    batch: int
    vocab: int = 256

    def overrides(self) -> list[str]:
        return [
            "USE_REPEATED_LAYER=true",
            "CHECKPOINT_POLICY=SAVE_NOTHING",
            f"NUM_LAYERS={self.layers}",
            f"MODEL_DIMS={self.model_dims}",
            f"HIDDEN_DIMS={4 * self.model_dims}",
            f"NUM_HEADS={self.heads}",
            f"DIMS_PER_HEAD={self.model_dims // self.heads}",
            f"MAX_SEQ_LEN={self.seq_len}",
            f"VOCAB_SIZE={self.vocab}",
            f"GLOBAL_BATCH_SIZE={self.batch}",
            "DROPOUT_PROB=0.0",
        ]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One pipelined configuration: S stages, R repeats, M microbatches."""

    stages: int
    repeats: int
    microbatches: int

    @property
    def schedule(self) -> str:
        return "gpipe" if self.repeats == 1 else "circular"

    @property
    def bubble(self) -> float:
        return bubble_fraction(num_stages=self.stages, repeats=self.repeats,
                               num_microbatches=self.microbatches)

    @property
    def expected_ratio(self) -> float:
        """(R*M + S - 1) / (R*M) = 1 / (1 - bubble): stage-iterations run over those carrying
        data."""
        items = self.repeats * self.microbatches
        return (items + self.stages - 1) / items

    def overrides(self) -> list[str]:
        data = _DEVICES // self.stages
        return [f"ICI_MESH_SHAPE=[{data},1,1,1,{self.stages}]",
                f"NUM_MICROBATCHES={self.microbatches}", f"PIPELINE_REPEATS={self.repeats}"]


def _require(condition: bool, message: str) -> None:
    """Like `assert`, but kept under `python -O`: a benchmark of two different computations is
    void."""
    if not condition:
        raise AssertionError(message)


@dataclasses.dataclass
class Side:
    """One compiled train step, its (donated) state, and its batches on its own mesh."""

    name: str
    mesh: Any
    train: Any
    state: Any
    shardings: Any  # of the state
    batches: list[dict[str, jax.Array]]
    times: list[float] = dataclasses.field(default_factory=list)

    def round(self) -> float:
        """One untimed step, then len(batches) timed ones ending in block_until_ready; s/step."""
        with jax.set_mesh(self.mesh):
            self.state, metrics = self.train(self.state, self.batches[0])
            jax.block_until_ready(metrics)
            start = time.perf_counter()
            for batch in self.batches:
                self.state, metrics = self.train(self.state, batch)
            jax.block_until_ready((self.state, metrics))
        return (time.perf_counter() - start) / len(self.batches)


def build_side(name: str, overrides: list[str], *, sizes: Sizes, steps: int,
               initial_state: Any | None) -> Side:
    """Compile one side's train step; its state is ``initial_state`` (host arrays) when given."""
    run = fdl.build(load_experiment(EXPERIMENT, [*sizes.overrides(), *overrides]).run_config())
    mesh = build_mesh(run.mesh, devices=jax.devices()[:_DEVICES])
    schedule = make_schedule(run.schedule)
    optimizer = make_optimizer(run.optimizer, schedule)
    data = SyntheticData(run.data, global_batch_size=sizes.batch)
    with jax.set_mesh(mesh):
        compiled = compile_steps(model=Transformer(run.model), optimizer=optimizer,
                                 schedule=schedule, mesh=mesh, seq_len=run.data.seq_len,
                                 seed=run.loop.seed, deterministic=True)
        if initial_state is None:
            state = compiled.init()
        else:  # the same parameters and optimizer state on this side's shardings
            state = jax.device_put(initial_state, compiled.state_shardings)
        batches = [data.train_batch(i, compiled.batch_sharding) for i in range(steps)]
    return Side(name=name, mesh=mesh, train=compiled.train, state=state,
                shardings=compiled.state_shardings, batches=batches)


def check_same_loss(label: str, *, loss: float, twin_loss: float) -> None:
    """Fail unless the pipelined first-step loss equals the twin's to ``LOSS_TOLERANCE``
    (relative)."""
    _require(abs(loss - twin_loss) <= LOSS_TOLERANCE * abs(twin_loss),
             f"{label}: first-step loss {loss:.7f} differs from the unpipelined twin's "
             f"{twin_loss:.7f} by more than {LOSS_TOLERANCE} relative: not the same computation")


def first_loss(side: Side) -> float:
    with jax.set_mesh(side.mesh):
        side.state, metrics = side.train(side.state, side.batches[0])
        return float(metrics["loss"])


def run_case(case: Case, twin: Side, initial_state: Any, *, sizes: Sizes, steps: int, rounds: int,
             twin_loss: float) -> dict[str, Any]:
    label = f"{case.schedule} S={case.stages} R={case.repeats} M={case.microbatches}"
    pipe = build_side(
        label, case.overrides(), sizes=sizes, steps=steps, initial_state=initial_state
    )
    loss = first_loss(pipe)
    check_same_loss(label, loss=loss, twin_loss=twin_loss)
    twin.times.clear()
    sides = [pipe, twin]
    for index in range(rounds):
        for side in sides if index % 2 == 0 else sides[::-1]:
            side.times.append(side.round())
        print(f"{label} round {index + 1}: pipelined {1e3 * pipe.times[-1]:.1f} ms, twin "
              f"{1e3 * twin.times[-1]:.1f} ms, ratio {pipe.times[-1] / twin.times[-1]:.3f}",
              flush=True)
    ratios = [a / b for a, b in zip(pipe.times, twin.times, strict=True)]
    measured = statistics.median(ratios)
    return {
        "schedule": case.schedule, "stages": case.stages, "repeats": case.repeats,
        "microbatches": case.microbatches, "data": _DEVICES // case.stages,
        "pipelined_ms": [round(1e3 * t, 1) for t in pipe.times],
        "twin_ms": [round(1e3 * t, 1) for t in twin.times],
        "pipelined_median_ms": round(1e3 * statistics.median(pipe.times), 1),
        "twin_median_ms": round(1e3 * statistics.median(twin.times), 1),
        "round_ratios": [round(r, 3) for r in ratios],
        "ratio": round(measured, 3),
        "bubble_fraction": round(case.bubble, 4),
        "expected_ratio": round(case.expected_ratio, 3),
        "measured_over_expected": round(measured / case.expected_ratio, 3),
        "loss": [round(loss, 6), round(twin_loss, 6)],
    }


def make_cases(*, stages: int, microbatch_factors: list[int]) -> list[Case]:
    """GPipe (R=1) and circular (R=2) for M = f*S for each factor f."""
    return [Case(stages=stages, repeats=r, microbatches=f * stages)
            for r in (1, 2) for f in microbatch_factors]


def table(results: list[dict[str, Any]]) -> str:
    """The Markdown table docs/performance.md takes."""
    lines = [("| schedule | S x data | R | M | bubble | pipelined ms | twin ms | ratio measured "
              "| expected 1/(1-bubble) | measured / expected |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['schedule']} | {r['stages']} x {r['data']} | {r['repeats']} | "
            f"{r['microbatches']} | {r['bubble_fraction']:.3f} | {r['pipelined_median_ms']:.1f} | "
            f"{r['twin_median_ms']:.1f} | {r['ratio']:.3f} | {r['expected_ratio']:.3f} | "
            f"{r['measured_over_expected']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round and side")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per case")
    parser.add_argument("--stages", type=int, default=4, choices=(2, 4, 8),
                        help="pipeline stages S; the other 8/S devices form the data axis")
    parser.add_argument("--microbatch_factors", default="1,2,4",
                        help="M = factor x S for each comma-separated factor")
    parser.add_argument("--layers", type=int, default=8, help="a multiple of 2 x stages")
    parser.add_argument("--model_dims", type=int, default=128)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32, help="global batch (rows), both sides")
    parser.add_argument("--tiny", action="store_true",
                        help="smoke test: 4 stages, a small model, M = S, one round of one step")
    parser.add_argument(
        "--json", action="store_true", help="print the report as one JSON line last"
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.steps, args.rounds, args.stages, args.microbatch_factors = 1, 1, 4, "1"
        args.layers, args.model_dims, args.seq_len, args.batch = 8, 32, 16, 8
    for name in ("steps", "rounds", "layers", "model_dims", "seq_len", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    try:
        factors = [int(f) for f in args.microbatch_factors.split(",") if f.strip()]
    except ValueError:
        factors = []
    if not factors or min(factors) < 1:
        parser.error(f"--microbatch_factors={args.microbatch_factors!r}: expected positive "
                     "integers separated by commas, e.g. 1,2,4")
    if args.layers % (2 * args.stages):
        parser.error(f"--layers={args.layers} must be a multiple of 2 x --stages = "
                     f"{2 * args.stages} (the circular schedule runs 2 repeats of every stage)")
    biggest_m = max(factors) * args.stages
    data = _DEVICES // args.stages
    if args.batch % _DEVICES or args.batch % (biggest_m * data):
        parser.error(f"--batch={args.batch} must split over the twin's {_DEVICES} data devices and "
                     f"into {biggest_m} microbatches each a multiple of the pipelined data axis "
                     f"({data}): a multiple of {max(_DEVICES, biggest_m * data)}")
    if args.model_dims % 32:
        parser.error(f"--model_dims={args.model_dims} must be a multiple of 32 (4 heads of a "
                     "multiple of 8)")
    if jax.device_count() < _DEVICES:
        raise SystemExit(f"this benchmark needs {_DEVICES} devices and JAX sees "
                         f"{jax.device_count()}: run it as a script (it sets "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={_DEVICES} before JAX "
                         "starts), not after JAX was imported")

    sizes = Sizes(layers=args.layers, model_dims=args.model_dims, heads=4, seq_len=args.seq_len,
                  batch=args.batch)
    cases = make_cases(stages=args.stages, microbatch_factors=factors)
    twin = build_side("twin", [f"ICI_MESH_SHAPE=[{_DEVICES},1,1]"], sizes=sizes, steps=args.steps,
                      initial_state=None)
    with jax.set_mesh(twin.mesh):
        initial_state = jax.device_get(twin.state)  # before the donating step below
    results = []
    for case in cases:
        with jax.set_mesh(twin.mesh):  # every case starts from the same state, as the twin does
            twin.state = jax.device_put(initial_state, twin.shardings)
        twin_loss = first_loss(twin)
        results.append(run_case(case, twin, initial_state, sizes=sizes, steps=args.steps,
                                rounds=args.rounds, twin_loss=twin_loss))
    device = jax.devices()[0]
    report = {"sizes": dataclasses.asdict(sizes), "steps": args.steps, "rounds": args.rounds,
              "tiny": args.tiny, "cases": results, "jax": jax.__version__,
              "device": f"{_DEVICES} x {device.platform} ({device.device_kind})",
              "cpus": os.cpu_count(), "host": platform.node() or "host"}
    print(f"jax {jax.__version__}, {report['device']} on {os.cpu_count()} CPUs; {sizes.layers} "
          f"layers (scanned), d_model {sizes.model_dims}, batch {sizes.batch} x {sizes.seq_len}; "
          f"{args.steps} steps x {args.rounds} rounds; twin: data {_DEVICES}")
    print(table(results))
    print("ratio = pipelined / twin step time (median of per-round ratios). The 8 devices share "
          "the host's cores, so this is the extra work of the bubble (expected 1/(1-bubble) for "
          "the layers) plus schedule overhead, not a parallel speed-up.")
    if args.tiny:
        print("--tiny checks the harness only; its numbers mean nothing.")
    if args.json:
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
