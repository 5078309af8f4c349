"""Two processes fine-tuned on chat rows (TRAIN_TASK=chat) resume from a checkpoint and train
what an uninterrupted pair trains.

Each process packs its own share of the examples and saves its position (epoch, next example,
the template clock) in every checkpoint (data/chat_pipeline.py); a resume that restored the
wrong position, or one process's for both, would feed other rows and change the losses.
"""

import json
import shutil

import pytest

from paxlite.checkpointing.checkpoint import Checkpointer
from tests.parallel.test_multiprocess import _finish, _start_pair, _train_losses
from tests.train.test_chat_sft import chat_flags, make_chat_data, make_chat_model

STEPS = 2  # per phase: the interrupted pair trains STEPS, then resumes to 2 x STEPS


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("chat_model"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_chat_data(tmp_path_factory.mktemp("chat_data"))


def _pair_flags(model, data, max_steps: int) -> list[str]:
    mesh = ("--fdl.ICI_MESH_SHAPE=", "--fdl.DCN_MESH_SHAPE=")
    flags = [f for f in chat_flags(model, data) if not f.startswith(mesh)]
    return [*flags, "--fdl.ICI_MESH_SHAPE=[1,2,2]", "--fdl.DCN_MESH_SHAPE=[2,1,1]",
            f"--fdl.CHECKPOINT_EVERY_N_STEPS={STEPS}", f"--fdl.MAX_STEPS={max_steps}",
            "--alsologtostderr"]


@pytest.mark.slow  # two 2-process runs
@pytest.mark.multiprocess
def test_two_processes_resume_chat_training_exactly(tmp_path, model, data):
    job, ref = tmp_path / "job", tmp_path / "ref"
    (tmp_path / "ref_logs").mkdir()
    ref_logs = [tmp_path / "ref_logs" / f"process{i}.log" for i in range(2)]
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    _finish(_start_pair(ref, _pair_flags(model, data, 2 * STEPS), tmp_path / "ref_logs"),
            ref_logs, timeout=240)
    # the interrupted pair as it stopped after STEPS: the reference's checkpoint and lines
    (job / "checkpoints").mkdir(parents=True)
    name = f"checkpoint_{STEPS:08d}"
    shutil.copytree(ref / "checkpoints" / name, job / "checkpoints" / name)
    lines = (ref / "metrics.jsonl").read_text().splitlines()
    (job / "metrics.jsonl").write_text(
        "".join(f"{line}\n" for line in lines if json.loads(line)["step"] <= STEPS))
    _finish(_start_pair(job, _pair_flags(model, data, 2 * STEPS), tmp_path), logs, timeout=240)

    assert all(f"Resumed from checkpoint step {STEPS}" in log.read_text() for log in logs)
    with Checkpointer(job / "checkpoints", save_interval_steps=STEPS, max_to_keep=None) as ckpt:
        record = ckpt.restore_data(STEPS)
    positions = record["processes"]
    assert [p["feed_index"] for p in positions] == [0, 1] and record["batches_consumed"] == STEPS
    got, want = _train_losses(job), _train_losses(ref)
    assert sorted(got) == sorted(want) == list(range(1, 2 * STEPS + 1))
    assert [got[s] for s in range(STEPS + 1, 2 * STEPS + 1)] == [
        want[s] for s in range(STEPS + 1, 2 * STEPS + 1)]
