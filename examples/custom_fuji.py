"""AXLearn's custom-configuration example, on paxlite's Python API.

AXLearn users (NVIDIA's JAX-Toolbox runs among them) customise a Fuji config in Python: look the
config up by name, add a "custom" mesh rule that chains gradient accumulation with a hybrid
(ICI x DCN) mesh, select it, and set the step count, trainer directory, global batch, sequence
length and checkpoint and summary intervals. The same steps here:

    python examples/custom_fuji.py --config=fuji-test-v1 --trainer_dir=/tmp/custom --max_step=3

AXLearn name -> what it sets here:
  named_trainer_configs()[name]            paxlite.experiments.fuji.named_trainer_configs()[name]
  ("custom", ChainConfigModifier([...]))   fuji_mesh.MeshRule("custom", ChainConfigModifier([...]))
  --mesh_selector=custom                   fuji_mesh.select_mesh(size, "custom", extra_rules=[...])
  max_step                                 MAX_STEPS
  dir                                      the job directory given to paxlite.cli.job.run_job
  input...global_logical_batch_size        GLOBAL_BATCH_SIZE
  input.source.max_sequence_length         MAX_SEQ_LEN
  checkpointer.save_policy.n               CHECKPOINT_EVERY_N_STEPS
  checkpointer.keep_every_n_steps          no equivalent: paxlite keeps the last
                                           CHECKPOINT_MAX_TO_KEEP checkpoints and none beyond
  summary_writer.write_every_n_steps       SUMMARY_INTERVAL_STEPS
"""

from __future__ import annotations

import argparse
import sys

import fiddle as fdl

from paxlite.cli.job import Mode, run_job
from paxlite.config.modifiers import (
    ChainConfigModifier,
    GradientAccumulationModifier,
    HybridMeshShape,
    MeshShapeModifier,
    mesh_shape_from_axes,
)
from paxlite.errors import UserError
from paxlite.experiments import fuji_mesh
from paxlite.experiments.build import run_tree
from paxlite.experiments.fuji import named_trainer_configs


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="AXLearn Fuji name, e.g. fuji-test-v1")
    parser.add_argument("--trainer_dir", required=True, help="job directory")
    parser.add_argument("--max_step", type=int, default=3)
    parser.add_argument("--mesh_selector", default="custom")
    parser.add_argument("--global_batch_size", type=int, default=16)
    parser.add_argument("--max_sequence_length", type=int, default=32)
    parser.add_argument("--grad_acc_steps", type=int, default=2)
    parser.add_argument("--checkpoint_every_n_steps", type=int, default=2)
    parser.add_argument("--summary_every_n_steps", type=int, default=1)
    parser.add_argument("--data_dir", default="FAKE", help="FAKE: synthetic tokens (the default)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _args(argv)
    configs = named_trainer_configs()
    if args.config not in configs:
        print(f"custom_fuji: error: --config={args.config} is not a Fuji config name "
              "(python -m paxlite list shows them)", file=sys.stderr)
        return 2
    config_fn = configs[args.config]
    experiment_class = type(config_fn())

    # The "custom" mesh rule: gradient accumulation, then a hybrid mesh (fsdp over the devices
    # of each process, data across the processes). -1 takes what is left.
    custom_rule = fuji_mesh.MeshRule("custom", ChainConfigModifier([
        GradientAccumulationModifier(grad_acc_steps=args.grad_acc_steps),
        MeshShapeModifier(mesh_shape=HybridMeshShape(ici=mesh_shape_from_axes(fsdp=-1),
                                                     dcn=mesh_shape_from_axes(data=-1))),
    ]))
    choice = fuji_mesh.select_mesh(experiment_class.fuji_size, args.mesh_selector,
                                   extra_rules=[custom_rule])
    data = ({"SYNTHETIC_DATA": True} if args.data_dir == "FAKE"
            else {"TFDS_DATA_DIR": args.data_dir})
    try:
        experiment = config_fn(
            choice.modifier,
            MAX_STEPS=args.max_step,
            GLOBAL_BATCH_SIZE=args.global_batch_size,
            MAX_SEQ_LEN=args.max_sequence_length,
            CHECKPOINT_EVERY_N_STEPS=args.checkpoint_every_n_steps,
            SUMMARY_INTERVAL_STEPS=args.summary_every_n_steps,
            EVAL_LOOP_NUM_BATCHES=1,  # keeps the final evaluation of a CPU demo short
            **data,
        )
        tree = run_tree(experiment)
        run_config = fdl.build(tree)
    except UserError as e:
        print(f"custom_fuji: error: {e}", file=sys.stderr)
        return 2
    print(f"{args.config}: {choice.describe()}: ICI_MESH_SHAPE={experiment.ICI_MESH_SHAPE}, "
          f"DCN_MESH_SHAPE={experiment.DCN_MESH_SHAPE}, "
          f"GRAD_ACCUM_STEPS={experiment.GRAD_ACCUM_STEPS}, global batch "
          f"{experiment.GLOBAL_BATCH_SIZE} x {experiment.MAX_SEQ_LEN}")
    return run_job(experiment, tree, run_config, job_dir=args.trainer_dir, mode=Mode.TRAIN,
                   enable_checkpoint_saving=True, argv=sys.argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
