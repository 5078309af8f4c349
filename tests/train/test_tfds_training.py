"""Training and evaluating from Pax's TFDS layout: the Grain path (ArrayRecord) and the SeqIO path
(TFRecord, Pax's own task semantics), each resumed exactly; Lambada read from either storage format
scores the same."""

import dataclasses
import gc
import glob
import hashlib
import json
import os
import random
import shutil
import sys

import jax
import numpy as np
import pytest

from paxlite.data import tfds_datasets
from paxlite.data.train_tokenizer import train_tokenizer
from paxlite.errors import StorageFaultError, exit_status
from paxlite.experiments.build import build_run_config
from paxlite.train.loop import Run, RunContext

WORDS = ("the king and queen of a far land rode out at dawn to see the sea while bells rang and "
         "children sang of rain wind fire stone gold silver bread wine night day love war").split()


@pytest.fixture(scope="module")
def tfds_dirs(tmp_path_factory):
    """The same tiny Pile and Lambada, stored as ArrayRecord and as TFRecord (what Pax's scripts
    wrote)."""
    root = tmp_path_factory.mktemp("tfds")
    rng = random.Random(0)
    paragraphs = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) for _ in range(300)
    ]
    (root / "corpus.txt").write_text("\n".join(paragraphs) + "\n")
    vocab = train_tokenizer([str(root / "corpus.txt")], str(root / "spm"), vocab_size=300)
    (root / "pile" / "train").mkdir(parents=True)
    (root / "pile" / "train" / "00.jsonl").write_text(
        "".join(json.dumps({"text": p}) + "\n" for p in paragraphs[:280])
    )
    (root / "pile" / "val.jsonl").write_text(
        "".join(json.dumps({"text": p}) + "\n" for p in paragraphs[280:])
    )
    passages = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 20))) for _ in range(9)]
    (root / "lambada_test.jsonl").write_text(
        "".join(json.dumps({"text": p}) + "\n" for p in passages)
    )
    dirs = {}
    for file_format in tfds_datasets.FILE_FORMATS:
        dirs[file_format] = str(root / file_format)
        tfds_datasets.build(
            tfds_datasets.THE_PILE,
            data_dir=dirs[file_format],
            file_format=file_format,
            local_dir=str(root / "pile"),
        )
        tfds_datasets.build(
            tfds_datasets.LAMBADA,
            data_dir=dirs[file_format],
            file_format=file_format,
            local_file=str(root / "lambada_test.jsonl"),
        )
    return dirs, vocab


def _overrides(tfds_dir, vocab, max_steps, *extra):
    return [
        f"TFDS_DATA_DIR={tfds_dir!r}",
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
        *extra,
    ]


# SeqIO repeats the training split, then shuffles: Pax's 100,000-example buffer would be filled
# from ~350 passes over this 280-paragraph split, in each run. A buffer of a few epochs still mixes
# across the split, and resuming does not depend on its size.
SEQIO_SHUFFLE_BUFFER = 1000


def _train(job, overrides):
    _, config = build_run_config("TinyShakespeare", overrides)
    if hasattr(config.data, "shuffle_buffer_size"):  # the SeqIO pipeline's config
        config = dataclasses.replace(config, data=dataclasses.replace(
            config.data, shuffle_buffer_size=SEQIO_SHUFFLE_BUFFER))
    with Run(config, RunContext(job_dir=str(job))) as run:
        return jax.device_get(run.train())


def _records(job, key):
    with open(os.path.join(job, "metrics.jsonl")) as f:
        return [(r["step"], r[key]) for r in map(json.loads, f) if key in r]


@pytest.fixture(scope="module")
def grain_first_three_steps(tfds_dirs, tmp_path_factory):
    """A 3-step job from ArrayRecord on the default (Grain) pipeline: the first half of the Grain
    resume and the checkpoint Lambada is scored on; each test copies it before using it."""
    dirs, vocab = tfds_dirs
    job = tmp_path_factory.mktemp("grain") / "job"
    _train(job, _overrides(dirs["array_record"], vocab, 3, "INPUT_PIPELINE=grain"))
    return job


def _digests(directory) -> dict[str, str]:
    return {path: hashlib.sha256(open(path, "rb").read()).hexdigest()
            for path in sorted(glob.glob(os.path.join(directory, "**"), recursive=True))
            if os.path.isfile(path)}


def _stopped_without(split, job, overrides, tfds_dir, file_format) -> tuple[str, Exception]:
    """(the file, the error) of a run of `job` with `split`'s file moved away (a removed shard, an
    unmounted filesystem); the file is put back after."""
    (path,) = glob.glob(os.path.join(tfds_dir, "the_pile", "**", f"*-{split}.{file_format}-*"),
                        recursive=True)
    os.rename(path, path + ".away")
    try:
        with pytest.raises(StorageFaultError) as stopped:
            _train(job, overrides)
    finally:
        os.rename(path + ".away", path)
    assert exit_status(stopped.value) == 75
    return path, stopped.value


def _vanished_line(path, step, resume_step) -> str:
    return (f"could not read {path} for step {step}: No such file or directory (ENOENT); put it "
            "back (or remount its filesystem) and run the same command again to resume from step "
            f"{resume_step}")


def _stops_on_each_vanished_file(job, overrides, tfds_dir, file_format):
    """A training file, then an evaluation file, moved away before `job` resumes from its step-3
    checkpoint: each stops the run in one line naming the file and the step that read it (4: its
    first batch; 6: the evaluation after training steps 4 to 6), exit status 75, with the
    checkpoint untouched."""
    checkpoints = _digests(job / "checkpoints")
    for split, step in (("train", 4), ("validation", 6)):
        path, error = _stopped_without(split, job, overrides, tfds_dir, file_format)
        assert str(error) == _vanished_line(path, step, 3), split
        assert _digests(job / "checkpoints") == checkpoints


def _stops_after_walking_back(job, overrides, tfds_dir, file_format):
    """`job`'s newest checkpoint (step 6) damaged in its state, its data record intact, and the
    training file moved away: the resume walks back to step 3, sets step 6 aside, and stops where
    it puts the input pipeline at step 3's position, in the same line as a resume from step 3
    does (the early check before compiling does not name step 6, which will not be resumed)."""
    newest = job / "checkpoints" / "checkpoint_00000006"
    (newest / "state" / "_METADATA").write_text("{oops")
    path, error = _stopped_without("train", job, overrides, tfds_dir, file_format)
    assert str(error) == _vanished_line(path, 4, 3)
    assert sorted(os.listdir(job / "checkpoints")) == ["checkpoint_00000003"]
    assert os.listdir(job / "checkpoints_corrupted") == ["checkpoint_00000006"]


def _live_tf_data_iterators() -> set[int]:
    tf = sys.modules.get("tensorflow")
    if tf is None:
        return set()
    return {id(o) for o in gc.get_objects() if isinstance(o, tf.data.Iterator)}


@pytest.fixture
def collector_off():
    """Python's garbage collector off for the test: what its runs leave alive stays alive, as it
    would until some later collection (a tf.data iterator freed then makes whichever thread
    collected wait for its reader threads)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


# slow: three training runs each; the SeqIO one also starts TensorFlow (~12 s on 2 cores)
@pytest.mark.slow
@pytest.mark.parametrize("pipeline,file_format", [("grain", "array_record"), ("seqio", "tfrecord")])
def test_resume_from_tfds_consumes_exactly_the_uninterrupted_batches(
    tmp_path, tfds_dirs, pipeline, file_format, request
):
    dirs, vocab = tfds_dirs
    settings = (dirs[file_format], vocab)
    extra = f"INPUT_PIPELINE={pipeline}"
    if pipeline == "seqio":
        request.getfixturevalue("collector_off")
    iterators_before = _live_tf_data_iterators()
    straight = _train(tmp_path / "straight", _overrides(*settings, 6, extra))
    if pipeline == "grain":  # the same 3-step job as the module's shared one
        shutil.copytree(request.getfixturevalue("grain_first_three_steps"), tmp_path / "resumed")
    else:
        _train(tmp_path / "resumed", _overrides(*settings, 3, extra))
    _stops_on_each_vanished_file(tmp_path / "resumed", _overrides(*settings, 6, extra),
                                 dirs[file_format], file_format)
    resumed = _train(tmp_path / "resumed", _overrides(*settings, 6, extra))
    if pipeline == "grain":  # SeqIO reads nothing when its position is restored
        _stops_after_walking_back(tmp_path / "straight", _overrides(*settings, 6, extra),
                                  dirs[file_format], file_format)
    got = _records(tmp_path / "resumed", "loss")
    # the run the evaluation file stopped had trained steps 4 to 6, as the last run did again
    assert [step for step, _ in got] == [1, 2, 3, 4, 5, 6, 4, 5, 6]
    assert got[3:6] == got[6:] and got[:6] == _records(tmp_path / "straight", "loss")
    assert len(_records(tmp_path / "straight", "loss")) == 6
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # every run, the stopped ones too, released its tf.data iterators (SeqIO's reader threads)
    assert _live_tf_data_iterators() - iterators_before == set()


def test_lambada_scores_the_same_from_either_storage_format(
    tmp_path, tfds_dirs, grain_first_three_steps
):
    dirs, vocab = tfds_dirs
    scores = {}
    for file_format, tfds_dir in dirs.items():
        job = tmp_path / file_format
        shutil.copytree(grain_first_three_steps, job)
        # --mode=eval on the same checkpoint: only Lambada is read, from one storage format or the
        # other.
        _, config = build_run_config(
            "TinyShakespeare",
            _overrides(tfds_dir, vocab, 2, "EVAL_TASK=lambada", "EVAL_LOOP_NUM_BATCHES=-1"),
        )
        with Run(config, RunContext(job_dir=str(job), training=False)) as run:
            run.run_eval()
        scores[file_format] = (
            _records(job, "eval/lambada_acc_strict"),
            _records(job, "eval/log_pplx"),
        )
    assert scores["array_record"][1][0][0] == 3 and scores["array_record"] == scores["tfrecord"]
