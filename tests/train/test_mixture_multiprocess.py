"""A DATA_MIXTURE run on two processes stops and resumes: each process saves and restores its own
mixture position, and data/mixture/* sums both processes' tokens.

Reference: each process's reader (MixtureData with that process index) driven here, uninterrupted,
for the same number of batches. The row-level exactness of a resume is tests/data/test_mixture.py's.
"""

import json

import pytest

from paxlite.checkpointing.checkpoint import Checkpointer
from paxlite.data.mixture import MixtureData, mixture_fractions
from paxlite.experiments.build import build_run_config
from tests.parallel.test_multiprocess import _finish, _start_pair
from tests.train.test_mixture_training import _overrides, sources  # noqa: F401 (a fixture)

# fsdp over each process's 2 devices (_start_pair), data over the processes: each reads its own rows
MESH = ["ICI_MESH_SHAPE=[1,2,1]", "DCN_MESH_SHAPE=[2,1,1]"]


def _flags(sources, max_steps):  # noqa: F811
    return ["--fdl_config=TinyShakespeare", "--alsologtostderr",
            *(f"--fdl.{o}" for o in _overrides(sources, max_steps, *MESH))]


@pytest.mark.slow  # two 2-process starts (~25 s on 2 cores)
@pytest.mark.multiprocess
def test_two_processes_resume_a_mixture_and_sum_its_fractions(tmp_path, sources):  # noqa: F811
    job = tmp_path / "job"
    logs = [tmp_path / "process0.log", tmp_path / "process1.log"]
    for max_steps in (3, 5):  # the second start resumes from the checkpoint at 3
        _finish(_start_pair(job, _flags(sources, max_steps), tmp_path, devices_per_process=2),
                logs, timeout=240)
    assert all("Resumed from checkpoint step 3" in log.read_text() for log in logs)

    _, config = build_run_config("TinyShakespeare", _overrides(sources, 5, *MESH))
    readers = [
        MixtureData(
            config.data, global_batch_size=8, process_index=p, process_count=2
        ).train_iterator()
        for p in range(2)
    ]
    want = {}
    for step in range(1, 6):
        for reader in readers:
            next(reader)
        want[step] = [reader.get_state() for reader in readers]
    with Checkpointer(job / "checkpoints", save_interval_steps=3, max_to_keep=None) as ckpt:
        for step in (3, 5):
            record = ckpt.restore_data(step)
            assert record["batches_consumed"] == step and record["processes"] == want[step], step
    lines = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    fractions = {
        r["step"]: {k: v for k, v in r.items() if k.startswith("data/mixture/")}
        for r in lines
        if "loss" in r
    }
    assert sorted(fractions) == [1, 2, 3, 4, 5]
    for step, got in fractions.items():
        assert got == pytest.approx(
            {f"data/mixture/{k}": v for k, v in mixture_fractions(want[step]).items()}, abs=1e-12
        )
    evals = [r for r in lines if "eval/loss" in r]
    assert evals and all("eval/books/loss" in r and "eval/books_2/loss" in r for r in evals)
