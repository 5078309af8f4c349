"""`python -m paxlite show --fdl_config=NAME [--fdl.X=V ...] [--format=json]`: one experiment,
resolved after its overrides."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import fiddle as fdl

from paxlite.cli.catalogue import parameter_counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fdl_config", required=True,
                        help="registered name, dotted path or Pax name")
    parser.add_argument("--format", choices=("text", "json"), default="text")


def run(args: argparse.Namespace, assignments: Sequence[str]) -> int:
    from paxlite.experiments.build import load_experiment

    info = describe(load_experiment(args.fdl_config or "", assignments))
    if args.format == "json":
        print(json.dumps(info, indent=2, sort_keys=False))
    else:
        for key, value in info.items():
            if key != "hparams":
                print(f"{key}: {value}")
        print("hparams:")
        for key, value in info["hparams"].items():
            print(f"  {key} = {value!r}")
    return 0


def describe(experiment, *, num_local_devices: int | None = None) -> dict:
    """What a user wants to know before launching: size, cost per token, batch and mesh, every
    hyperparameter."""
    import math

    import jax

    from paxlite.parallel.mesh import BATCH_AXES, MESH_AXES, global_batch_size

    model = fdl.build(experiment.model_config())
    mesh = fdl.build(experiment.mesh_config())
    local = jax.local_device_count() if num_local_devices is None else num_local_devices
    sizes = mesh.axis_sizes(local)
    num_devices = math.prod(sizes[axis] for axis in MESH_AXES)
    batch = global_batch_size(
        percore_batch_size=experiment.PERCORE_BATCH_SIZE,
        num_devices=num_devices,
        batch_split=math.prod(sizes[axis] for axis in BATCH_AXES),
        fixed_global_batch_size=getattr(experiment, "GLOBAL_BATCH_SIZE", None),
    )
    total, active = parameter_counts(model)
    return {
        "experiment": experiment.name,
        "class": f"{type(experiment).__module__}.{type(experiment).__qualname__}",
        "num_params": total,
        "num_active_params": active,
        "flops_per_token": experiment.flops_per_token(),
        "global_batch_size": batch,
        "tokens_per_step": batch * experiment.MAX_SEQ_LEN,
        "num_devices": num_devices,
        "mesh": {axis: sizes[axis] for axis in MESH_AXES},
        **_pipeline_and_seq(model, batch=batch, experiment=experiment, seq=sizes["seq"]),
        "hparams": experiment.hparams(),
    }


def _pipeline_and_seq(model, *, batch: int, experiment, seq: int) -> dict:
    """The pipeline schedule (stages, microbatches, bubble) and the seq strategy, where the run has
    them."""
    out: dict = {}
    if model.pipeline is not None:
        schedule = model.pipeline.schedule(batch // max(experiment.GRAD_ACCUM_STEPS, 1))
        del schedule["iterations"]
        out["pipeline"] = {**schedule, "bubble_fraction": round(schedule["bubble_fraction"], 4)}
    if seq > 1:
        out["sequence_parallel"] = {
            "seq": seq,
            "strategy": model.context_parallel_strategy.value,
            "load_balance": bool(experiment.CONTEXT_PARALLEL_LOAD_BALANCE),
            "tokens_per_shard": experiment.MAX_SEQ_LEN // seq,
        }
    return out
