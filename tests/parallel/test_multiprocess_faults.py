"""A fault on one process of two stops both, each with the same one line and exit status
(train/peer_faults.py), where before both waited at different Orbax barriers for 20 minutes.

The fault: process 1's disk is full while it saves step 6 of a resumed job (RLIMIT_FSIZE in that
process only; Python ignores SIGXFSZ, so its writes past the limit fail with EFBIG). Its output goes
through a pipe, which the limit does not cover. Process 0's storage is fine, and it learns of the
fault only through the distributed runtime's key-value store.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from paxlite.data import tfds_datasets
from paxlite.data.train_tokenizer import train_tokenizer
from paxlite.errors import RunStoppedError, StorageFaultError, UserError, exit_status
from paxlite.train import peer_faults
from tests.parallel.test_multiprocess import (
    EXPERIMENT,
    _env,
    _finish,
    _free_port,
    _start,
    _start_pair,
)
from tests.train.test_text_training import WORDS

# Below every save's fixed-size files, above what else the resumed process writes
# (tests/train/test_storage_faults.py says why).
FILE_SIZE_LIMIT = 16_000
# Below the job's config.json, above the files a run opens before it (metrics, summaries)
BUILD_FILE_SIZE_LIMIT = 2_000
# 2 devices a process (fsdp 2 within, data over the two); the limited process writes no cache entry
FLAGS = [*EXPERIMENT, "--fdl.ICI_MESH_SHAPE=[1,2,1]", "--fdl.COMPILATION_CACHE=False"]


def _tree_digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _start_limited(job: Path, flags: list[str], *, limit: int) -> subprocess.Popen:
    """A process as `python -m paxlite.main`, in an interpreter that sets the limit first (a
    preexec_fn would fork the multithreaded test process)."""
    argv = ["paxlite.main", f"--job_log_dir={job}", *flags]
    start = (f"import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, "
             f"({limit}, resource.RLIM_INFINITY)); sys.argv = {argv!r}; "
             "runpy.run_module('paxlite.main', run_name='__main__', alter_sys=True)")
    # no compiled module written past the limit (a truncated __pycache__ file)
    env = {**_env(2), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.Popen([sys.executable, "-c", start], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _one_limited_pair(job: Path, flags: list[str], tmp_path: Path, *, limited: int,
                      limit: int) -> tuple[list[int], str, float]:
    """Runs both processes of a job, process `limited` under the file-size limit; (their exit
    statuses, the one `paxlite: error:` line both printed, seconds until both ended). Fails unless
    both printed exactly one such line, the same one."""
    port = _free_port()
    multiprocess = ["--multiprocess_gpu", f"--server_addr=127.0.0.1:{port}", "--num_hosts=2"]
    log = tmp_path / f"unlimited{1 - limited}.log"
    started = time.monotonic()
    processes = [None, None]
    processes[limited] = _start_limited(job, [*flags, *multiprocess, f"--host_idx={limited}"],
                                        limit=limit)
    processes[1 - limited] = _start(job, [*flags, *multiprocess, f"--host_idx={1 - limited}"],
                                    log=log, num_cpu_devices=2)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.append(processes[limited].stdout.read()))
    reader.start()
    try:
        codes = [processes[0].wait(timeout=120), processes[1].wait(timeout=60)]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
        reader.join()
    elapsed = time.monotonic() - started
    logs = [output[0], log.read_text()] if limited == 0 else [log.read_text(), output[0]]
    tails = "\n".join(f"--- process {i}\n{text[-3000:]}" for i, text in enumerate(logs))
    lines = [[line for line in text.splitlines() if line.startswith("paxlite: error: ")]
             for text in logs]
    assert lines[0] == lines[1] and len(lines[0]) == 1, tails
    return codes, lines[0][0], elapsed


@pytest.mark.slow  # three two-process phases' worth of processes (~20 s on 2 cores)
@pytest.mark.multiprocess
def test_a_full_disk_on_one_process_stops_both_with_its_line(tmp_path):
    job = tmp_path / "job"
    _finish(_start_pair(job, [*FLAGS, "--fdl.MAX_STEPS=3"], tmp_path, devices_per_process=2),
            [tmp_path / "process0.log", tmp_path / "process1.log"], timeout=180)
    kept = _tree_digest(job / "checkpoints" / "checkpoint_00000003")

    codes, line, elapsed = _one_limited_pair(job, [*FLAGS, "--fdl.MAX_STEPS=6"], tmp_path,
                                             limited=1, limit=FILE_SIZE_LIMIT)
    assert codes == [75, 75], line
    assert line.startswith(
        f"paxlite: error: checkpoint step 6 was not saved in {job / 'checkpoints'}: File too "
        "large (EFBIG)"), line
    assert "the last complete checkpoint, step 3, is untouched" in line
    assert elapsed < 90, elapsed  # not Orbax's 20-minute barrier timeout
    assert _tree_digest(job / "checkpoints" / "checkpoint_00000003") == kept
    assert sorted(p.name for p in (job / "checkpoints").iterdir()
                  if not p.name.endswith(".orbax-checkpoint-tmp")) == ["checkpoint_00000003"]


@pytest.mark.slow  # a two-process start (~8 s on 2 cores)
@pytest.mark.multiprocess
def test_a_fault_while_the_run_is_built_stops_both_with_its_line(tmp_path):
    """Process 0's disk refuses the job's config.json, which it writes once the run is built, while
    process 1 goes on to restore and waits for it: both stop with process 0's line and status.
    Before, process 0's end broke the runtime's shutdown barrier, and the runtime aborted both
    (SIGABRT) with a page of fatal-error stacks and no line on process 1."""
    job = tmp_path / "job"
    codes, line, elapsed = _one_limited_pair(job, [*FLAGS, "--fdl.MAX_STEPS=3"], tmp_path,
                                             limited=0, limit=BUILD_FILE_SIZE_LIMIT)
    assert codes == [75, 75], line
    assert line.startswith(f"paxlite: error: could not write {job / 'config.json'}: File too "
                           "large (EFBIG)"), line
    assert elapsed < 90, elapsed
    assert not (job / "checkpoints").exists() or not any((job / "checkpoints").iterdir())


@pytest.mark.parametrize("error, status", [
    (UserError("no such file: /data/train.jsonl"), 2),
    (StorageFaultError("could not write /job/config.json: No space left on device"), 75),
    (RunStoppedError("the loss diverged at step 7"), 1),
])
def test_every_process_reports_a_published_fault_with_its_line_and_status(error, status, capsys):
    """What the watcher of every process prints and exits with, from the record the faulting
    process published (through JSON, as the key-value store carries it): the same line and status
    that process would have reported itself."""
    record = json.loads(json.dumps(peer_faults.fault_record(error)))
    assert exit_status(peer_faults.error_of(record)) == exit_status(error) == status
    out = capsys.readouterr().err.splitlines()
    assert out == [f"paxlite: error: {error}"] * 2


@pytest.fixture(scope="module")
def pile_tfrecord(tmp_path_factory) -> tuple[str, str]:
    """(TFDS data dir, vocab path): a tiny Pile in TFRecord files, as Pax's scripts wrote it."""
    root = tmp_path_factory.mktemp("pile")
    rng = random.Random(0)
    paragraphs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))
                  for _ in range(120)]
    (root / "corpus.txt").write_text("\n".join(paragraphs) + "\n")
    vocab = train_tokenizer([str(root / "corpus.txt")], str(root / "spm"), vocab_size=300)
    (root / "pile" / "train").mkdir(parents=True)
    (root / "pile" / "train" / "00.jsonl").write_text(
        "".join(json.dumps({"text": p}) + "\n" for p in paragraphs[:100]))
    (root / "pile" / "val.jsonl").write_text(
        "".join(json.dumps({"text": p}) + "\n" for p in paragraphs[100:]))
    tfds_datasets.build(tfds_datasets.THE_PILE, data_dir=str(root / "tfds"),
                        file_format="tfrecord", local_dir=str(root / "pile"))
    return str(root / "tfds"), vocab


@pytest.mark.slow  # two processes start TensorFlow and SeqIO (~30 s on 2 cores)
@pytest.mark.multiprocess
def test_an_evaluation_file_vanishing_mid_training_stops_both_with_its_line(
        tmp_path, pile_tfrecord):
    """SeqIO opens its evaluation files again at every evaluation: the file moved away after the
    first one (an unmounted filesystem) stops both processes at the next, each with the line of
    the process that met it first, exit 75, and nothing saved after the fault."""
    data_dir, vocab = pile_tfrecord
    settings = [f"TFDS_DATA_DIR={data_dir!r}", f"VOCAB_PATH={vocab}", "INPUT_PIPELINE=seqio",
                "NUM_LAYERS=1", "MODEL_DIMS=32", "NUM_HEADS=4", "DIMS_PER_HEAD=8",
                "HIDDEN_DIMS=64", "VOCAB_SIZE=320", "MAX_SEQ_LEN=32", "PERCORE_BATCH_SIZE=1",
                "ICI_MESH_SHAPE=[1,2,1]", "DCN_MESH_SHAPE=[2,1,1]", "SUMMARY_INTERVAL_STEPS=1",
                "CHECKPOINT_EVERY_N_STEPS=10", "EVAL_INTERVAL_STEPS=20", "EVAL_LOOP_NUM_BATCHES=1",
                "MAX_STEPS=40"]
    flags = ["--fdl_config=TinyShakespeare", "--alsologtostderr",
             *(f"--fdl.{s}" for s in settings)]
    job = tmp_path / "job"
    logs = [tmp_path / "process0.log", tmp_path / "process1.log"]
    (path,) = glob.glob(os.path.join(data_dir, "the_pile", "**", "*-validation.tfrecord-*"),
                        recursive=True)
    procs = _start_pair(job, flags, tmp_path, devices_per_process=2)
    try:
        deadline = time.monotonic() + 240
        while not any("eval/loss" in r for r in _metrics(job)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (
                "\n".join(log.read_text()[-3000:] for log in logs))
            time.sleep(0.02)
        os.rename(path, path + ".away")
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if os.path.exists(path + ".away"):
            os.rename(path + ".away", path)
    texts = [log.read_text() for log in logs]
    lines = [[line for line in text.splitlines() if line.startswith("paxlite: error: ")]
             for text in texts]
    assert codes == [75, 75] and lines[0] == lines[1] and len(lines[0]) == 1, texts[0][-3000:]
    assert lines[0][0] == (
        f"paxlite: error: could not read {path} for step 40: No such file or directory (ENOENT); "
        "put it back (or remount its filesystem) and run the same command again to resume from "
        "step 30"), lines[0][0]
    assert sorted(p.name for p in (job / "checkpoints").iterdir()
                  if not p.name.endswith(".orbax-checkpoint-tmp")) == [
        "checkpoint_00000010", "checkpoint_00000020", "checkpoint_00000030"]


def _metrics(job: Path) -> list[dict]:
    path = job / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
