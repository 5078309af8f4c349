"""The pipeline axis over DCN (issue 24): two processes of 4 CPU devices, one pipeline stage each
(DCN_MESH_SHAPE's 5th entry), train exactly as one 8-device process with the same mesh, and evaluate
and checkpoint through the pipelined steps."""

import json
import os

import pytest

from tests.in_process import train_in_this_process
from tests.parallel.test_multiprocess import _finish, _start_pair, _train_losses

STEPS = 3
PIPELINE_OVER_DCN = [
    "--fdl_config=TinySynthetic",
    "--fdl.NUM_LAYERS=2",
    "--fdl.ICI_MESH_SHAPE=[2,2,1]",  # data 2 x fsdp 2 within each process
    "--fdl.DCN_MESH_SHAPE=[1,1,1,1,2]",  # a pipeline of 2 stages across the processes
    "--fdl.NUM_MICROBATCHES=2",
    f"--fdl.MAX_STEPS={STEPS}",
    "--fdl.SUMMARY_INTERVAL_STEPS=1",
    f"--fdl.CHECKPOINT_EVERY_N_STEPS={STEPS}",
    f"--fdl.EVAL_INTERVAL_STEPS={STEPS}",
    "--fdl.EVAL_LOOP_NUM_BATCHES=1",
    "--alsologtostderr",
]


@pytest.mark.multiprocess
def test_pipeline_across_two_processes_matches_one_process(tmp_path):
    job, ref = tmp_path / "job", tmp_path / "ref"
    logs = [tmp_path / "process0.log", tmp_path / "process1.log"]
    procs = _start_pair(job, PIPELINE_OVER_DCN, tmp_path)
    try:  # the one-process reference, on 8 devices, while the pair trains
        train_in_this_process(ref, PIPELINE_OVER_DCN, save_checkpoints=False)
    finally:
        _finish(procs, logs, timeout=240)

    got, want = _train_losses(job), _train_losses(ref)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    assert max(abs(got[s] - want[s]) for s in want) < 1e-5, (got, want)
    record = json.loads((job / "config.json").read_text())
    assert record["devices"]["process_count"] == 2
    assert (
        record["mesh"]["pipeline"] == 2
        and record["mesh"]["data"] == 2
        and record["mesh"]["fsdp"] == 2
    )
    assert os.listdir(job / "checkpoints") == [f"checkpoint_{STEPS:08d}"]
    evals = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals if "eval/loss" in e] == [STEPS]
