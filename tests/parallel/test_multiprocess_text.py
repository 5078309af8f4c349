"""Two processes trained on a prepared text dataset resume from a checkpoint and end where an
uninterrupted pair ends.

Each process reads its own slice of the records, shuffles and packs it, and saves its pipeline's
position in every checkpoint (docs/data.md). The synthetic-data test beside this one cannot see that
position: its batches are a function of the step alone. Here a resume that restored the wrong
position, or one process's position for both, would feed different rows and change the losses and
the parameters.
"""

import json
import random
import shutil

import jax
import numpy as np
import pytest
from flax import linen as nn

from paxlite.checkpointing import pretrained
from paxlite.checkpointing.checkpoint import Checkpointer
from paxlite.data.prepare import prepare
from paxlite.data.train_tokenizer import train_tokenizer
from paxlite.experiments.build import build_run_config
from paxlite.models.transformer import abstract_variables
from tests.parallel.test_multiprocess import _finish, _start_pair, _train_losses
from tests.train.test_text_training import WORDS

STEPS = 3  # per phase; the interrupted pair trains STEPS, then resumes to 2 x STEPS
MODEL = ["NUM_LAYERS=1", "MODEL_DIMS=32", "NUM_HEADS=4", "DIMS_PER_HEAD=8", "HIDDEN_DIMS=64",
         "VOCAB_SIZE=320", "MAX_SEQ_LEN=32", "PERCORE_BATCH_SIZE=1"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[str, str]:
    """(data dir, vocab path): 200 seeded random paragraphs in 2 shards, as test_text_training's
    make_text_dataset writes them but with no validation split: the runs train without evaluating
    (nothing here reads an eval), which spares each of the four processes an eval step's compile."""
    root = tmp_path_factory.mktemp("text")
    rng = random.Random(0)
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))
                                  for _ in range(200)) + "\n")
    vocab = train_tokenizer([str(corpus)], str(root / "spm"), vocab_size=300)
    prepare([str(corpus)], str(root / "data"), vocab_path=vocab, validation_fraction=0.0,
            num_shards=2)
    return str(root / "data"), vocab


def _overrides(dataset) -> list[str]:
    data_dir, vocab = dataset
    return [
        f"DATA_DIR={data_dir}",
        f"VOCAB_PATH={vocab}",
        *MODEL,
        "ICI_MESH_SHAPE=[1,2,1]",  # fsdp over each process's 2 devices (_start_pair)
        "DCN_MESH_SHAPE=[2,1,1]",  # data over the processes: each reads its own rows
        "SUMMARY_INTERVAL_STEPS=1",
        f"CHECKPOINT_EVERY_N_STEPS={STEPS}",
        "LEARNING_RATE=1e-2",
        "LR_COS_WARMUP=1",
        f"LR_COS_DECAY_END={4 * STEPS}",
    ]


def _flags(dataset, max_steps: int) -> list[str]:
    return ["--fdl_config=TinyShakespeare", "--alsologtostderr",
            *(f"--fdl.{o}" for o in [*_overrides(dataset), f"MAX_STEPS={max_steps}"])]


def _final_params(job, dataset) -> dict:
    _, config = build_run_config("TinyShakespeare", _overrides(dataset))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                            nn.meta.unbox(abstract_variables(config.model)["params"]))
    step, params = pretrained.restore_params(
        job / "checkpoints" / f"checkpoint_{2 * STEPS:08d}", abstract
    )
    assert step == 2 * STEPS
    return jax.device_get(params)


def _stopped_at_steps(ref, job) -> None:
    """`job` as a pair stopped after step STEPS leaves it: the reference pair's checkpoint at STEPS
    (the same processes trained the same rows to it; a pair started with MAX_STEPS=STEPS would
    train them again) and its summaries up to STEPS."""
    (job / "checkpoints").mkdir(parents=True)
    name = f"checkpoint_{STEPS:08d}"
    shutil.copytree(ref / "checkpoints" / name, job / "checkpoints" / name)
    lines = (ref / "metrics.jsonl").read_text().splitlines()
    (job / "metrics.jsonl").write_text(
        "".join(f"{line}\n" for line in lines if json.loads(line)["step"] <= STEPS))


@pytest.mark.slow  # two 2-process runs (~40 s on 2 cores)
@pytest.mark.multiprocess
def test_two_processes_resume_text_training_exactly(tmp_path, dataset):
    job, ref = tmp_path / "job", tmp_path / "ref"
    (tmp_path / "ref_logs").mkdir()
    logs = [tmp_path / "process0.log", tmp_path / "process1.log"]
    ref_logs = [tmp_path / "ref_logs" / "process0.log", tmp_path / "ref_logs" / "process1.log"]
    # The uninterrupted pair commits a checkpoint at STEPS on its way to 2 x STEPS.
    _finish(_start_pair(ref, _flags(dataset, 2 * STEPS), tmp_path / "ref_logs",
                        devices_per_process=2), ref_logs, timeout=240)
    _stopped_at_steps(ref, job)
    # the interrupted pair's second start: it resumes from the checkpoint at STEPS
    _finish(_start_pair(job, _flags(dataset, 2 * STEPS), tmp_path, devices_per_process=2), logs,
            timeout=240)

    assert all(f"Resumed from checkpoint step {STEPS}" in log.read_text() for log in logs)
    with Checkpointer(job / "checkpoints", save_interval_steps=STEPS, max_to_keep=None) as ckpt:
        record = ckpt.restore_data(STEPS)
    assert len(record["processes"]) == 2 and record["batches_consumed"] == STEPS, record
    got, want = _train_losses(job), _train_losses(ref)
    assert sorted(got) == sorted(want) == list(range(1, 2 * STEPS + 1))
    # Steps 1..STEPS are the reference's own lines (copied above); the resumed steps: same
    # processes, same devices, same rows in the same order, so the same arithmetic, bit for bit.
    resumed_steps = range(STEPS + 1, 2 * STEPS + 1)
    assert [got[step] for step in resumed_steps] == [want[step] for step in resumed_steps]
    resumed, straight = _final_params(job, dataset), _final_params(ref, dataset)
    leaves = jax.tree_util.tree_leaves_with_path(straight)
    assert len(leaves) > 5
    for (path, want_leaf), got_leaf in zip(leaves, jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(got_leaf, want_leaf, err_msg=jax.tree_util.keystr(path))
