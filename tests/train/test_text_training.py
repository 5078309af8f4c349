"""Training on a prepared text dataset: the loop, the pipeline's saved position, and exact
resume."""

import json
import os
import random
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from paxlite.checkpointing.checkpoint import Checkpointer
from paxlite.data.errors import DatasetError
from paxlite.data.prepare import prepare
from paxlite.data.train_tokenizer import train_tokenizer
from paxlite.errors import exit_status
from paxlite.experiments.build import build_run_config
from paxlite.train import run_build
from paxlite.train.loop import Run, RunContext
from tests.fork_server import paxlite_python
from tests.xla_test_flags import COMPILE_FLAGS

WORDS = ("the king and queen of a far land rode out at dawn to see the sea while bells rang and "
         "children sang of rain wind fire stone gold silver bread wine night day love war").split()


def make_text_dataset(root, *, num_paragraphs: int) -> tuple[str, str]:
    """(data dir, vocab path): a real 300-piece SentencePiece model and a 2-shard prepared dataset
    of `num_paragraphs` random paragraphs (seeded), under `root`."""
    rng = random.Random(0)
    paragraphs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))
                  for _ in range(num_paragraphs)]
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(paragraphs) + "\n")
    vocab = train_tokenizer([str(corpus)], str(root / "spm"), vocab_size=300)
    data_dir = root / "data"
    prepare([str(corpus)], str(data_dir), vocab_path=vocab, validation_fraction=0.05, num_shards=2)
    return str(data_dir), vocab


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_text_dataset(tmp_path_factory.mktemp("text"), num_paragraphs=400)


def _overrides(dataset, max_steps):
    data_dir, vocab = dataset
    return [
        f"DATA_DIR={data_dir}",
        f"VOCAB_PATH={vocab}",
        "NUM_LAYERS=1",
        "MODEL_DIMS=32",
        "NUM_HEADS=8",
        "DIMS_PER_HEAD=4",
        "HIDDEN_DIMS=64",
        "VOCAB_SIZE=512",
        "MAX_SEQ_LEN=32",
        "PERCORE_BATCH_SIZE=1",
        f"MAX_STEPS={max_steps}",
        "SUMMARY_INTERVAL_STEPS=1",
        "CHECKPOINT_EVERY_N_STEPS=3",
        "EVAL_INTERVAL_STEPS=1000",
        "EVAL_LOOP_NUM_BATCHES=2",
        "LR_COS_WARMUP=2",
        "LR_COS_DECAY_END=6",
    ]


def _train(job, overrides):
    _, config = build_run_config("TinyShakespeare", overrides)
    with Run(config, RunContext(job_dir=str(job))) as run:
        return jax.device_get(run.train())


def _losses(job):
    with open(os.path.join(job, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


@pytest.fixture(scope="module")
def six_and_three_steps(dataset, tmp_path_factory):
    """(6-step job, its final state, 3-step job) of one configuration: the uninterrupted reference
    and the first half of a resume, shared by the tests below; a test that writes to the 3-step
    job works on a copy."""
    root = tmp_path_factory.mktemp("runs")
    straight = _train(root / "straight", _overrides(dataset, 6))
    _train(root / "short", _overrides(dataset, 3))
    return root / "straight", straight, root / "short"


def test_resume_consumes_exactly_the_uninterrupted_batches(tmp_path, dataset, six_and_three_steps):
    straight_job, straight, short_job = six_and_three_steps
    shutil.copytree(short_job, tmp_path / "resumed")
    with Checkpointer(
        tmp_path / "resumed" / "checkpoints", save_interval_steps=3, max_to_keep=None
    ) as ckpt:
        record = ckpt.restore_data(3)
    assert record["batches_consumed"] == 3 and len(record["processes"]) == 1
    resumed = _train(tmp_path / "resumed", _overrides(dataset, 6))
    # Shuffled and packed batches: the resumed run sees exactly the batches of the uninterrupted
    # one.
    assert _losses(tmp_path / "resumed") == _losses(straight_job)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mid_run_checkpoint_saves_the_consumed_position_not_the_producers(six_and_three_steps):
    """At step 3 of a 6-step run the producer has built batches 4 and 5 already; the checkpoint
    must record where batch 3 ended, as a run that stops at 3 does."""
    long_job, _, short_job = six_and_three_steps
    records = []
    for job in (long_job, short_job):
        with Checkpointer(job / "checkpoints", save_interval_steps=3, max_to_keep=None) as ckpt:
            records.append(ckpt.restore_data(3))
    assert records[0] == records[1] and records[0]["batches_consumed"] == 3
    with Checkpointer(long_job / "checkpoints", save_interval_steps=3, max_to_keep=None) as ckpt:
        assert ckpt.restore_data(6) != records[0]


def test_resume_with_another_batch_size_is_one_line_exit_2(
    tmp_path, dataset, six_and_three_steps, monkeypatch
):
    """The saved input position is for another global batch: a user's mistake, said in one line,
    found before the train step is compiled."""
    job = tmp_path / "job"
    # the 3-step job: 8 devices x PERCORE_BATCH_SIZE=1, global batch 8
    shutil.copytree(six_and_three_steps[2], job)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = COMPILE_FLAGS  # one device: PERCORE_BATCH_SIZE=2 is a global batch of 2
    overrides = [o for o in _overrides(dataset, 6) if not o.startswith("PERCORE_BATCH_SIZE=")]
    result = subprocess.run(
        [paxlite_python(), "-m", "paxlite.main", "--fdl_config=TinyShakespeare",
         *(f"--fdl.{o}" for o in overrides), "--fdl.PERCORE_BATCH_SIZE=2", f"--job_log_dir={job}"],
        capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("paxlite: error:")]
    assert len(errors) == 1 and "global_batch_size=8" in errors[0] and "=2" in errors[0], errors
    assert sorted(os.listdir(job / "checkpoints")) == ["checkpoint_00000003"]  # nothing written

    def compile_steps(**kwargs):
        raise AssertionError("the train step was compiled before the data position was checked")

    monkeypatch.setattr(run_build, "compile_steps", compile_steps)
    _, config = build_run_config("TinyShakespeare", overrides + ["PERCORE_BATCH_SIZE=2"])
    with pytest.raises(DatasetError, match="global_batch_size=8 but this pipeline has "
                                           "global_batch_size=16"):
        Run(config, RunContext(job_dir=str(job)))


def test_text_run_learns_and_evaluates(tmp_path, dataset):
    job = tmp_path / "job"
    # one checkpoint, at the end: saves every 3 steps would cost more than the 30 steps
    _train(job, _overrides(dataset, 30) + ["EVAL_INTERVAL_STEPS=30", "LEARNING_RATE=1e-2",
                                           "LR_COS_DECAY_END=30", "CHECKPOINT_EVERY_N_STEPS=30"])
    losses = [loss for _, loss in _losses(job)]
    # Untrained: about ln(300) = 5.7 nats. The words are drawn from 40 at random, so the floor is
    # near ln(40) / (tokens per word) - well below; the loss must fall by more than a nat and a
    # half.
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.5, losses
    with open(job / "metrics.jsonl") as f:
        evals = [r for r in map(json.loads, f) if "eval/loss" in r]
    assert evals[-1]["step"] == 30 and evals[-1]["eval/loss"] < np.log(300)


def test_missing_dataset_stops_before_compiling(tmp_path, dataset):
    _, _vocab = dataset
    overrides = _overrides(dataset, 3)
    overrides[0] = f"DATA_DIR={tmp_path / 'nowhere'}"
    _, config = build_run_config("TinyShakespeare", overrides)
    with pytest.raises(ValueError, match="nowhere"):
        Run(config, RunContext(job_dir=str(tmp_path / "job")))
    assert not (tmp_path / "job" / "checkpoints").exists()


def test_files_removed_mid_run_and_before_a_resume(tmp_path, dataset):
    """The readers open every shard when the run is built: the dataset's directory removed after
    that, the run trains and evaluates to its end. A shard missing at the next start is one line
    naming it, before anything compiles (exit 2); back, the same run resumes from its checkpoint."""
    data_dir = shutil.copytree(dataset[0], tmp_path / "data")
    overrides = _overrides((str(data_dir), dataset[1]), 3)
    job = tmp_path / "job"
    _, config = build_run_config("TinyShakespeare", overrides)
    with Run(config, RunContext(job_dir=str(job))) as run:
        shutil.move(data_dir, tmp_path / "away")
        run.train()
    assert [step for step, _ in _losses(job)] == [1, 2, 3]
    shard = "train-00001-of-00002.array_record"
    shutil.copytree(tmp_path / "away", data_dir, ignore=shutil.ignore_patterns(shard))
    _, config = build_run_config("TinyShakespeare", _overrides((str(data_dir), dataset[1]), 4))
    with pytest.raises(DatasetError) as raised:
        Run(config, RunContext(job_dir=str(job)))
    assert str(raised.value) == (f"{data_dir / 'paxlite_dataset.json'}: shard {shard} of split "
                                 "'train' is missing; put it back (or remount its filesystem), "
                                 "or prepare the dataset again, and run the same command again")
    assert exit_status(raised.value) == 2
    shutil.copy(tmp_path / "away" / shard, data_dir / shard)
    with Run(config, RunContext(job_dir=str(job))) as run:
        run.train()
    assert [step for step, _ in _losses(job)] == [1, 2, 3, 4]


def test_lambada_eval_interleaved_and_eval_only(tmp_path, dataset):
    from paxlite.data.tokenizer import Tokenizer

    _, vocab = dataset
    rng = random.Random(1)
    passages = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 20))) for _ in range(11)]
    lambada = tmp_path / "lambada_test.jsonl"
    lambada.write_text("".join(json.dumps({"text": p}) + "\n" for p in passages))
    overrides = _overrides(dataset, 4) + ["EVAL_TASK=lambada", f"LAMBADA_PATH={lambada}",
                                          "EVAL_LOOP_NUM_BATCHES=-1", "EVAL_INTERVAL_STEPS=2"]
    job = tmp_path / "job"
    _train(job, overrides)
    with open(job / "metrics.jsonl") as f:
        evals = [r for r in map(json.loads, f) if "eval/loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    tokenizer = Tokenizer(vocab)
    target_tokens = sum(len(tokenizer.encode(" " + p.split()[-1])) for p in passages)
    for record in evals:
        assert record["eval/num_tokens"] == target_tokens  # only target tokens are scored
        correct = record["eval/lambada_acc_strict"] * len(passages)
        # a fraction of whole examples, padding rows excluded
        assert abs(correct - round(correct)) < 1e-9

    # --mode=eval: no training data needed, the latest checkpoint is scored and logged at its step.
    eval_only = [o for o in overrides if not o.startswith("DATA_DIR=")]
    _, config = build_run_config("TinyShakespeare", eval_only)
    assert config.data is None
    with Run(config, RunContext(job_dir=str(job), training=False)) as run:
        metrics = run.run_eval()
    assert metrics["lambada_acc_strict"] == evals[-1]["eval/lambada_acc_strict"]
    assert metrics["loss"] == pytest.approx(evals[-1]["eval/loss"], rel=1e-6)


@pytest.mark.parametrize("corpus_kind", ["validation_fraction_0", "one_document"])
def test_a_dataset_without_validation_split_trains_without_evaluation(
    tmp_path, dataset, corpus_kind, caplog
):
    """prepare --validation_fraction 0 (or a one-document corpus) writes no validation split:
    training runs, with no eval lines, and --mode=eval says what to do instead."""
    _, vocab = dataset
    rng = random.Random(1)
    count = 1 if corpus_kind == "one_document" else 40
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "\n\n".join(
            " ".join(rng.choice(WORDS) for _ in range(400 if count == 1 else 30))
            for _ in range(count)
        )
        + "\n"
    )
    data_dir = tmp_path / "data"
    info = prepare([str(corpus)], str(data_dir), vocab_path=vocab,
                   validation_fraction=0.0 if count > 1 else 0.01)
    assert set(info.splits) == {"train"}
    overrides = _overrides((str(data_dir), vocab), 3)
    overrides[overrides.index("EVAL_INTERVAL_STEPS=1000")] = "EVAL_INTERVAL_STEPS=1"
    _train(tmp_path / "job", overrides)
    with open(tmp_path / "job" / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3]
    assert not [r for r in lines if any(k.startswith("eval/") for k in r)]
    assert [m for m in caplog.messages if "no validation split" in m and "without evaluation" in m]
    _, config = build_run_config("TinyShakespeare", overrides)
    with pytest.raises(ValueError, match="no validation split.*--fdl.EVAL_TASK=lambada"):
        Run(config, RunContext(job_dir=str(tmp_path / "job"), training=False))


def test_a_shard_that_cannot_be_read_is_one_line_not_a_shorter_dataset(tmp_path, dataset):
    """A shard that exists but that this user cannot read (mode 000, read by an unprivileged user
    through `unshare --user`: root reads it anyway): ArrayRecord reports no records and raises
    nothing, so the run trained on the other shards. Now it is one line naming the shard. A shard
    replaced after `prepare` (fewer records than the manifest says) is one line too."""
    import tempfile

    from array_record.python import array_record_module

    shard = "train-00001-of-00002.array_record"
    readable = tempfile.mkdtemp(prefix="paxlite-unreadable-")  # a directory anyone may enter
    try:
        os.chmod(readable, 0o755)
        path = os.path.join(readable, shard)
        shutil.copy(os.path.join(dataset[0], shard), path)
        os.chmod(path, 0)
        code = ("from paxlite.data.packing import ShardedRecords\n"
                f"try:\n    ShardedRecords([{path!r}])\n"
                "except Exception as e:\n    print(type(e).__name__, e)\n")
        # the real interpreter (not the fork server's client, whose children the server forks)
        out = subprocess.run(["unshare", "--user", sys.executable, "-c", code],
                             capture_output=True, text=True, timeout=120, check=False)
    finally:
        shutil.rmtree(readable)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == (
        f"DatasetError shard {path} cannot be read (Permission denied (EACCES)); make it readable "
        "for this user again (or remount its filesystem) and run the same command again"), out

    data_dir = shutil.copytree(dataset[0], tmp_path / "data")
    writer = array_record_module.ArrayRecordWriter(str(data_dir / shard), "group_size:1")
    writer.write(b"\0\0\0\0")  # one record where prepare wrote many
    writer.close()
    _, config = build_run_config("TinyShakespeare", _overrides((str(data_dir), dataset[1]), 2))
    with pytest.raises(DatasetError) as raised:
        Run(config, RunContext(job_dir=str(tmp_path / "job")))
    assert re.fullmatch(
        rf"split 'train' of {re.escape(str(data_dir))} holds [\d,]+ records and its manifest says "
        r"[\d,]+: a shard was changed after `prepare` wrote it; prepare the dataset again",
        str(raised.value)), str(raised.value)
    assert exit_status(raised.value) == 2
