"""`python -m paxlite plan --fdl_config=NAME [--fdl.X=V ...] --devices=N [--target=cpu|h100|v5e-8]`:
will it fit? The command line only; the planning is paxlite/planner/plan.py's.

Imported by the command line's parser, so that it must not import JAX: the plan sets its fake CPU
devices before JAX starts (tests/test_architecture.py checks)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from paxlite.errors import exit_status
from paxlite.planner import plan as planner
from paxlite.planner.plan import DEFAULT_DEVICE_MEMORY_GIB, DEFAULT_PEAK_TFLOPS, DEFAULT_SEQ_STEP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fdl_config", required=True,
                        help="registered name, dotted path or Pax name")
    parser.add_argument("--devices", type=int, default=None,
                        help="devices to plan for (ICI x DCN); required but for a TPU target, "
                             "whose default is its chips")
    parser.add_argument("--target", default="cpu", metavar="cpu|h100|h200|a100|v5e-8|...",
                        help="the compiler that measures: cpu (fake CPU devices; default), a GPU "
                             "model, h100 / h200 / a100 (XLA's GPU compiler, no GPU needed; JAX's "
                             "CUDA plugin), or a TPU slice, v4-N / v5e-N / v5p-N / v6e-N or a "
                             "topology such as v5e:2x4 (the TPU compiler, no TPU needed; libtpu)")
    parser.add_argument("--device_memory_gib", type=float, default=None,
                        help="memory of one device (default: the GPU's own, or the HBM the TPU "
                             f"compiler lets a program use; {DEFAULT_DEVICE_MEMORY_GIB:g} for cpu)")
    parser.add_argument("--peak_tflops", type=float, default=None,
                        help="dense peak TFLOP/s of one device (step time at 100%% MFU; default: "
                             f"the target's BF16 peak; {DEFAULT_PEAK_TFLOPS:g} for cpu)")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--longest_seq", choices=("auto", "on", "off"), default="auto",
                        help="search the longest MAX_SEQ_LEN that fits (auto: for runs with a seq "
                             "axis)")
    parser.add_argument("--seq_step", type=int, default=DEFAULT_SEQ_STEP,
                        help="granularity in tokens of that search (raised to a multiple of 2 x "
                             "seq)")


def run(args: argparse.Namespace, assignments: Sequence[str]) -> int:
    """Runs before anything imports JAX, so that the fake CPU devices can still be set."""
    try:
        request = planner.PlanRequest(
            name=args.fdl_config, assignments=tuple(assignments), num_devices=args.devices,
            target=args.target, device_memory_gib=args.device_memory_gib,
            peak_tflops=args.peak_tflops, longest_seq=args.longest_seq, seq_step=args.seq_step,
        )
    except ValueError as e:  # a bad --devices or --device_memory_gib (a bad --target: UserError)
        return exit_status(e, user_errors=(ValueError,))
    return planner.run_plan_command(request, output_format=planner.OutputFormat(args.format))
