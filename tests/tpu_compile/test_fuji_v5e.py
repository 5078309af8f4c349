"""Fuji 7B as AXLearn trains it on a v5e-256 pod (its `tpu-v5litepod-256` mesh rule: fsdp 256, 4
gradient-accumulation steps), planned for the slice the rule names, by the TPU compiler.

The experiment is built as AXLearn's launcher builds it (paxlite/cli/launch_plan.py, with the
target's own instance type as `--mesh_selector`), cut to one layer of 128 tokens (the rule's mesh,
batch and accumulation kept) so that the compile stays within a few minutes on two cores: the
whole step with its 32 layers of 4,096 tokens is the same program with a longer scan and longer
rows. 128 tokens, one TPU lane tile, rather than 512: the plan's CPU seconds fell from 84 to 65
(2026-12-07, three runs of each, interleaved, on a shared 2-core machine: 84.3, 84.7, 82.7 against
68.6, 71.0, 54.4; 32 tokens, rows shorter than a tile, took 59 once), with the same mesh, batch,
accumulation and verdict, and asynchronous collectives still there (4 starts; 7 at 512).
"""

from __future__ import annotations

import pytest

from paxlite.cli.launch_plan import LaunchFlags, parse_launch
from paxlite.parallel.compile_targets import CompileTarget
from paxlite.planner import plan as plan_lib

GIB = 2**30
SHORT = ("NUM_LAYERS=1", "MAX_SEQ_LEN=128", "TOKENS_PER_BATCH=131072")  # 1,024 rows, as v2's


@pytest.mark.slow
def test_fuji_7b_on_v5e_256_with_axleans_rule_fits_its_chips(tmp_path):
    target = CompileTarget.parse("v5e-256")
    launch = parse_launch(LaunchFlags.of(
        module="text.gpt.c4_trainer", config="fuji-7B-v2", trainer_dir=str(tmp_path),
        jax_backend="tpu", data_dir="FAKE", mesh_selector=target.tpu.instance_type, fdl=SHORT),
        env={})
    assert launch.describe_mesh().startswith("mesh rule 'tpu-v5litepod-256'")
    experiment = launch.experiment(num_devices=target.num_devices, num_processes=1)
    plan = plan_lib.plan_experiment(experiment, num_devices=target.num_devices, target=target,
                                    longest_seq="off")
    assert (plan.compiled_for, plan.topology) == ("v5e-256", "v5e:16x16")
    assert (plan.mesh.data, plan.mesh.fsdp) == (1, 256) and experiment.GRAD_ACCUM_STEPS == 4
    assert plan.global_batch_size == 1024 and plan.refused is None
    # FSDP over the slice: every chip holds 1/256 of the float32 parameters (the norms whole)
    parameter_bytes = plan.memory_per_device.parameter_bytes
    assert 4 * plan.num_params / 256 <= parameter_bytes < 1.01 * 4 * plan.num_params / 256
    assert plan.verdict.fits and plan.device_memory_bytes == int(15.75 * GIB)
    # the gathers of FSDP's weights and the reduce-scatters of its gradients are scheduled
    # asynchronously on the TPU
    assert plan.program.kernels.get("AsyncCollectiveStart", 0) > 0, plan.program.kernels
    print(f"fuji-7B-v2 x1 layer on v5e-256: peak {plan.memory_per_device.peak_bytes / GIB:.2f} "
          f"GiB, compile {plan.compile_s} s, plan {plan.plan_s} s")
