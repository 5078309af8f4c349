"""Storage faults during a run: a full disk while saving, a removed or unwritable job directory, a
full disk under metrics.jsonl, slow saves. Each is one `paxlite: error:` line with exit status 75
(or, with CHECKPOINT_SAVE_FAILURE='continue', one warning line per refused save), and the last
complete checkpoint is untouched.

A full disk is RLIMIT_FSIZE in a started process (Python ignores SIGXFSZ, so a write past the limit
fails with EFBIG; the limit must not hit the test process). Every save writes files of about the
same size, so a limit cannot let one save through and stop the next: the job is first trained to
its first checkpoint without a limit (in this process), then the same command resumes it under the
limit, and its next save is refused. A full device for one file is /dev/full (ENOSPC).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

from paxlite.checkpointing.checkpoint import Checkpointer, CheckpointSaveError
from paxlite.checkpointing.storage_faults import StorageFault, storage_fault
from paxlite.errors import StorageFaultError, exit_status
from paxlite.train.metrics import MetricsWriter
from tests.in_process import train_in_this_process

TRAIN = ["--fdl_config=TinySynthetic", "--fdl.CHECKPOINT_EVERY_N_STEPS=5",
         "--fdl.EVAL_INTERVAL_STEPS=100000", "--fdl.SUMMARY_INTERVAL_STEPS=5"]
# Below every save's fixed-size files (Orbax's _METADATA ~32 KB and _sharding ~50 KB), so each save
# is refused whatever its OCDBT data files come to (TensorStore batches TinySynthetic's ~1.5 MB into
# 3 to 10 files, by timing: with a 200 KB limit a save under load once went through), and above
# what else a resumed run writes (config.json, config.txt ~5 KB, metrics.jsonl, summaries). The
# resumed run has no compilation cache (COMPILATION_CACHE=False): its entries reach ~145 KB.
FILE_SIZE_LIMIT = 16_000


def _tree_digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _resume_under_file_size_limit(job: Path, *flags: str) -> subprocess.CompletedProcess:
    """`python -m paxlite.main` in a process that sets the limit first (a preexec_fn would fork
    this multithreaded process)."""
    argv = ["paxlite.main", f"--job_log_dir={job}", *TRAIN, "--fdl.COMPILATION_CACHE=False", *flags]
    start = (f"import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, "
             f"({FILE_SIZE_LIMIT}, resource.RLIM_INFINITY)); sys.argv = {argv!r}; "
             "runpy.run_module('paxlite.main', run_name='__main__', alter_sys=True)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PAXLITE_"))}
    env["JAX_PLATFORMS"] = "cpu"
    # Python writes a compiled module past the limit short (a truncated __pycache__ file, which
    # every later process then fails to import): none is written here
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.run([sys.executable, "-c", start], env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def _tree_sizes(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("paxlite: error:")]


@pytest.fixture(scope="module")
def saved_job(tmp_path_factory) -> Path:
    """A job trained to its checkpoint at step 5, without a limit."""
    job = tmp_path_factory.mktemp("storage") / "job"
    train_in_this_process(job, [*TRAIN, "--fdl.MAX_STEPS=5"])
    return job


def _copy(job: Path, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    copy = tmp_path / "job"
    shutil.copytree(job, copy)
    return copy, _tree_digest(copy / "checkpoints" / "checkpoint_00000005")


def _full_disk_line(job: Path, step: int) -> re.Pattern:
    return re.compile(
        rf"checkpoint step {step} was not saved in {re.escape(str(job / 'checkpoints'))}: File "
        r"too large \(EFBIG\) while writing \d+ bytes; the last complete checkpoint, step 5, is "
        "untouched")


def test_full_disk_while_saving_stops_with_one_line_and_status_75(saved_job, tmp_path):
    job, before = _copy(saved_job, tmp_path)
    out = _resume_under_file_size_limit(job, "--fdl.MAX_STEPS=10")
    assert out.returncode == 75, out.stderr[-3000:]
    [line] = _error_lines(out.stderr)
    expected = _full_disk_line(job, 10).pattern + re.escape(
        "; raise the file-size limit (ulimit -f) or free space and run the same command again to "
        "resume from step 5")
    assert re.fullmatch(r"paxlite: error: " + expected, line), line
    # Orbax's own reports of the fault (tracebacks from its threads, "Event loop is closed",
    # abandoned coroutines at exit) are not shown
    assert "Traceback" not in out.stderr and "Event loop is closed" not in out.stderr
    assert len(out.stderr.splitlines()) < 20, out.stderr
    # the last complete checkpoint is untouched, byte for byte; the unfinished step is gone
    assert sorted(os.listdir(job / "checkpoints")) == ["checkpoint_00000005"]
    assert _tree_digest(job / "checkpoints" / "checkpoint_00000005") == before


def test_continue_logs_each_refused_save_counts_it_and_stops_at_the_last(saved_job, tmp_path):
    job, before = _copy(saved_job, tmp_path)
    out = _resume_under_file_size_limit(job, "--fdl.MAX_STEPS=20",
                                        "--fdl.CHECKPOINT_SAVE_FAILURE='continue'")
    assert out.returncode == 75, (out.stderr[-3000:], _tree_sizes(job / "checkpoints"))
    # an asynchronous save's fault is found once it ended, or when the next save waits for it
    warnings = [line for line in out.stderr.splitlines() if "training goes on" in line]
    assert len(warnings) == 2, out.stderr
    for step, warning in zip((10, 15), warnings, strict=True):
        assert _full_disk_line(job, step).search(warning), warning
        assert warning.endswith("; training goes on (CHECKPOINT_SAVE_FAILURE='continue') and "
                                "saves again at the next interval")
    [line] = _error_lines(out.stderr)  # the last step's save must commit: it stops the run
    assert _full_disk_line(job, 20).search(line), line
    assert "Traceback" not in out.stderr
    records = [json.loads(x) for x in (job / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if "loss" in r}
    # step 10's (found once it ended, at step 15's save at the latest), and step 15's where it
    # ended before step 20's line (raise_if_refused: its own test above)
    assert train[20]["checkpoint/failed_saves"] in (1, 2)
    assert train[20]["checkpoint/save_s"] > 0
    assert sorted(os.listdir(job / "checkpoints")) == ["checkpoint_00000005"]
    assert _tree_digest(job / "checkpoints" / "checkpoint_00000005") == before
    # space came back: the same command resumes from step 5 and commits its last step
    train_in_this_process(job, [*TRAIN, "--fdl.MAX_STEPS=20",
                                "--fdl.CHECKPOINT_SAVE_FAILURE='continue'"])
    assert sorted(os.listdir(job / "checkpoints")) == [  # CHECKPOINT_MAX_TO_KEEP=3
        "checkpoint_00000010", "checkpoint_00000015", "checkpoint_00000020"]


def _state(scale: float) -> dict:
    return {"w": jnp.arange(4096, dtype=jnp.float32) * scale}


def test_a_removed_job_directory_stops_the_next_save(tmp_path, capsys):
    """Orbax would make the directory again and save into it; the run stops instead."""
    directory = tmp_path / "job" / "checkpoints"
    with Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as checkpointer:
        checkpointer.save(1, _state(1.0))
        checkpointer.wait_until_finished()
        shutil.rmtree(tmp_path / "job")
        with pytest.raises(CheckpointSaveError) as raised:
            checkpointer.save(2, _state(2.0))
    assert not directory.exists()
    assert str(raised.value) == (
        f"checkpoint step 2 was not saved in {directory}: No such file or directory (ENOENT); "
        "there is no complete checkpoint to keep; restore the directory (or remount its "
        "filesystem) and run the same command again to resume from the beginning")
    assert exit_status(raised.value) == 75
    assert capsys.readouterr().err == f"paxlite: error: {raised.value}\n"


def test_a_refused_background_save_is_found_once_it_ends_not_at_the_next_save(tmp_path):
    """The save's writes are refused in Orbax's threads, after save() returned: raise_if_refused
    (the loop's, every step) reports it as soon as the save has ended. The file-size limit is this
    process's for the save only (nothing else of it writes then: its programs are compiled by the
    first save), and far below the save's files."""
    directory = tmp_path / "checkpoints"
    state = {"w": jnp.arange(65536, dtype=jnp.float32)}  # 256 KB
    with Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as checkpointer:
        checkpointer.save(1, state)
        checkpointer.wait_until_finished()
        before = _tree_digest(directory)
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
        try:
            checkpointer.raise_if_refused()  # nothing in flight: nothing to find
            assert checkpointer.save(2, state)
            deadline = time.monotonic() + 120
            while checkpointer.saving() and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        with pytest.raises(CheckpointSaveError) as raised:
            checkpointer.raise_if_refused()
        checkpointer.raise_if_refused()  # found once
    assert re.match(rf"checkpoint step 2 was not saved in {re.escape(str(directory))}: File too "
                    r"large \(EFBIG\)", str(raised.value)), raised.value
    assert sorted(os.listdir(directory)) == ["checkpoint_00000001"]
    assert _tree_digest(directory) == before


def test_close_puts_the_hooks_back_when_orbaxs_close_raises(tmp_path, monkeypatch):
    """Checkpointer.close() undoes what it installed (the hooks and log filters that quiet a
    storage fault's echoes) even when Orbax's own close() raises, and that error is not hidden."""
    loggers = (logging.getLogger("absl"), logging.getLogger("asyncio"))
    hooks, filters = (sys.unraisablehook, sys.excepthook), [list(log.filters) for log in loggers]

    def refused_close(manager):
        raise OSError(errno.EIO, "Input/output error")

    checkpointer = Checkpointer(tmp_path / "checkpoints", save_interval_steps=1, max_to_keep=None)
    checkpointer.save(1, _state(1.0))
    assert (sys.unraisablehook, sys.excepthook) != hooks  # installed while it saves
    monkeypatch.setattr(ocp.CheckpointManager, "close", refused_close)
    with pytest.raises(OSError, match="Input/output error"):
        checkpointer.close()
    assert (sys.unraisablehook, sys.excepthook) == hooks
    assert [list(log.filters) for log in loggers] == filters
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_00000001"]


def test_a_removed_job_directory_stops_the_next_metrics_line(tmp_path):
    """Appending to metrics.jsonl after its directory is removed would succeed, into nothing."""
    job = tmp_path / "job"
    with MetricsWriter(job) as writer:
        writer.write_eval(1, {"loss": 1.0})
        shutil.rmtree(job)
        with pytest.raises(StorageFaultError) as raised:
            writer.write_eval(2, {"loss": 0.5})
    assert str(raised.value) == (
        f"could not write {job / 'metrics.jsonl'}: No such file or directory (ENOENT); restore "
        "the directory (or remount its filesystem) and run the same command again (it resumes "
        "from the last complete checkpoint)")


def test_a_full_disk_under_metrics_jsonl_is_one_line(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    (job / "metrics.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    writer = MetricsWriter(job)
    with pytest.raises(StorageFaultError) as raised:
        writer.write_eval(1, {"loss": 1.0})
    writer.close()  # the unwritten line is not raised again
    assert str(raised.value).startswith(
        f"could not write {job / 'metrics.jsonl'}: No space left on device (ENOSPC); free space "
        "on that filesystem and run the same command again")
    assert exit_status(raised.value) == 75


@contextlib.contextmanager
def _read_only(directory):
    """`directory` refuses new entries, for this process whoever runs it: without write
    permission (EACCES), or as root, who ignores permissions, immutable (`chattr +i`: EPERM, also
    for root; ext4, xfs, btrfs). Yields the error's text."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield "Permission denied (EACCES)"
        finally:
            directory.chmod(0o755)
        return
    subprocess.run(["chattr", "+i", str(directory)], check=True)
    try:
        yield "Operation not permitted (EPERM)"
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True)


def test_a_read_only_checkpoint_directory_stops_the_next_save(tmp_path):
    directory = tmp_path / "checkpoints"
    with Checkpointer(directory, save_interval_steps=1, max_to_keep=None) as checkpointer:
        checkpointer.save(1, _state(1.0))
        checkpointer.wait_until_finished()
        before = _tree_digest(directory)
        with _read_only(directory) as refused, pytest.raises(CheckpointSaveError) as raised:
            # refused by save() itself, which makes the step's directories (made in the
            # background, Orbax's writers waited 300 s for them, holding the process at exit)
            checkpointer.save(2, _state(2.0))
    assert refused in str(raised.value)
    assert "the last complete checkpoint, step 1, is untouched" in str(raised.value)
    assert _tree_digest(directory) == before


def test_tensorstore_and_python_errors_are_classified():
    """The OS's errno, from Python's OSError or TensorStore's message; anything else is not
    storage (a bug keeps its traceback)."""
    tensorstore = ValueError(
        'OUT_OF_RANGE: Error writing "params.w/0" in OCDBT database at local file "/j/": Failed '
        "to write 779771 bytes to file 7: File too large [os_error_code='27']")
    assert storage_fault(tensorstore) == StorageFault(code=27, bytes_writing=779771)
    quota = RuntimeError("wrapped")
    quota.__cause__ = OSError(122, "Disk quota exceeded", "/j/x")
    assert storage_fault(quota) == StorageFault(code=122, path="/j/x")
    assert storage_fault(ValueError("INVALID_ARGUMENT: bad shape")) is None
    assert storage_fault(OSError(5, "Input/output error")) is None


def test_slow_saves_never_stack_and_their_seconds_are_reported(tmp_path):
    """A save at every step, each slower than a step: each save waits for the previous one's
    commit (Checkpointer.save, as Orbax does), every step is committed in turn, and the seconds
    the loop spent saving are on each train line."""
    job = tmp_path / "job"
    train_in_this_process(job, [*TRAIN, "--fdl.MAX_STEPS=6", "--fdl.CHECKPOINT_EVERY_N_STEPS=1",
                                "--fdl.SUMMARY_INTERVAL_STEPS=2",
                                "--fdl.CHECKPOINT_MAX_TO_KEEP=10"])
    assert sorted(os.listdir(job / "checkpoints")) == [f"checkpoint_{s:08d}" for s in range(1, 7)]
    records = [json.loads(x) for x in (job / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["checkpoint/save_s"] for r in records if "loss" in r and r["step"] > 2]
    assert len(seconds) == 2 and all(s > 0 for s in seconds), records
    assert not any("checkpoint/failed_saves" in r for r in records)


# Run in a user and mount namespace of its own (`unshare --user --map-root-user --mount`), where
# any user may mount a tmpfs: a checkpoint saved, the disk filled to its last byte, the next save
# refused, closed as Run.__exit__ closes (close_keeping); what it found, as JSON.
_FULL_DISK_SCRIPT = """
import contextlib, hashlib, json, pathlib, sys
import jax.numpy as jnp
from paxlite.checkpointing.checkpoint import Checkpointer, CheckpointSaveError
from paxlite.checkpointing.storage_faults import close_keeping
from paxlite.errors import exit_status
disk = pathlib.Path(sys.argv[1])
def digest():
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((disk / "checkpoints").rglob("*")) if p.is_file()}
state = lambda scale: {"w": jnp.full((64, 64), scale), "b": jnp.full((64,), scale)}
checkpointer = Checkpointer(disk / "checkpoints", save_interval_steps=1, max_to_keep=None)
checkpointer.save(1, state(1.0))
checkpointer.wait_until_finished()
before = digest()
with open(disk / "filler", "wb") as f, contextlib.suppress(OSError):
    while True:
        f.write(bytes(65536))
        f.flush()
raised = None
try:
    with contextlib.ExitStack() as stack:
        stack.push(lambda kind, *exc: close_keeping(checkpointer.close, ending=kind))
        checkpointer.save(2, state(2.0))
        checkpointer.wait_until_finished()
except Exception as error:
    raised = error
(disk / "filler").unlink()
saved_error = isinstance(raised, CheckpointSaveError)
print(json.dumps({"kind": type(raised).__name__, "line": str(raised),
                  "status": exit_status(raised) if saved_error else None,
                  "untouched": digest() == before}))
"""


def test_a_disk_full_before_a_save_starts_keeps_its_one_line_through_the_close(tmp_path):
    """The disk is already full when a save starts (a 4 MB tmpfs filled after the last commit):
    the save's one line is the error the run ends with. Orbax's close raises the save's error
    again; the run's close (train/loop.py: Run.__exit__, through close_keeping) logs it instead of
    letting it replace the line with its traceback."""
    disk = tmp_path / "disk"
    disk.mkdir()
    out = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
         f'mount -t tmpfs -o size=4m tmpfs "$1" && exec "{sys.executable}" -c "$2" "$1"', "sh",
         str(disk), _FULL_DISK_SCRIPT],
        env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=180,
        check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["kind"] == "CheckpointSaveError", found
    assert "No space left on device (ENOSPC)" in found["line"]
    assert "the last complete checkpoint, step 1, is untouched" in found["line"]
    assert found["status"] == 75 and found["untouched"], found
