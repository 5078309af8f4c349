"""--job_log_dir mistakes found at start-up, before anything is built: one line and the status of
docs/troubleshooting.md's table, never a traceback. Real filesystems only: a file where the
directory should be, a directory made read-only (tests/train/test_storage_faults.py's _read_only:
chattr +i as root, chmod otherwise)."""

from __future__ import annotations

import json
import logging

import pytest

from paxlite.cli.job import _write_keeping_history, make_job_dir
from paxlite.errors import StorageFaultError, exit_status
from tests.in_process import paxlite_main
from tests.train.test_storage_faults import _read_only

TRAIN = ("--fdl_config=TinySynthetic", "--fdl.MAX_STEPS=1")


def _one_line(proc) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("paxlite: error: ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def test_a_file_where_the_job_directory_should_be_is_a_mistake(tmp_path, monkeypatch, capfd):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with paxlite_main(monkeypatch, capfd) as run:
        as_file = run(*TRAIN, f"--job_log_dir={notes}")
        under_file = run(*TRAIN, f"--job_log_dir={notes / 'job'}")
    assert as_file.returncode == under_file.returncode == 2
    assert _one_line(as_file) == (f"paxlite: error: --job_log_dir={notes} is a file, not a "
                                  "directory: give the path of a directory (a new one is made)")
    assert _one_line(under_file) == (f"paxlite: error: --job_log_dir={notes / 'job'} lies under "
                                     f"{notes}, which is a file: give the path of a directory")
    assert notes.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == [
        "notes.txt"]


def test_a_parent_storage_refuses_is_one_line_and_status_75(tmp_path, monkeypatch, capfd):
    parent = tmp_path / "jobs"
    parent.mkdir()
    with _read_only(parent) as refused, paxlite_main(monkeypatch, capfd) as run:
        proc = run(*TRAIN, f"--job_log_dir={parent / 'job'}")
    assert proc.returncode == 75
    assert _one_line(proc).startswith(
        f"paxlite: error: could not write {parent / 'job'}: {refused}; make the directory "
        "writable for this user again and run the same command again"), proc.stderr[-2000:]


def test_a_read_only_checkpoints_directory_stops_before_the_first_step(tmp_path, monkeypatch,
                                                                       capfd):
    """A rerun while checkpoints/ is still read-only: refused before anything is built or trained
    (it trained until its first save before)."""
    job = tmp_path / "job"
    (job / "checkpoints").mkdir(parents=True)
    with _read_only(job / "checkpoints") as refused, paxlite_main(monkeypatch, capfd) as run:
        proc = run(*TRAIN, f"--job_log_dir={job}")
    assert proc.returncode == 75
    assert _one_line(proc).startswith(
        f"paxlite: error: could not write {job / 'checkpoints'}: {refused}; "), proc.stderr[-2000:]
    assert sorted(p.name for p in job.iterdir()) == ["checkpoints"]  # nothing trained or written
    assert list((job / "checkpoints").iterdir()) == []


def test_a_read_only_job_directory_keeps_its_config_and_says_so(tmp_path):
    """Other settings than the config.json there: the old one is kept aside first; a directory that
    refuses the rename is a storage fault's one line, and config.json is left as it was."""
    job = tmp_path / "job"
    job.mkdir()
    (job / "config.json").write_text(json.dumps({"experiment": "Before"}))
    with _read_only(job) as refused, pytest.raises(StorageFaultError) as raised:
        _write_keeping_history(str(job / "config.json"), "{}", same_run=False)
    assert str(raised.value).startswith(f"could not write {job / 'config.json'}: {refused}; ")
    assert exit_status(raised.value) == 75
    assert json.loads((job / "config.json").read_text()) == {"experiment": "Before"}


def test_a_directory_of_other_files_is_trained_into_with_a_warning(tmp_path, caplog):
    (tmp_path / "thesis.tex").write_text("mine")
    with caplog.at_level(logging.WARNING):
        make_job_dir(str(tmp_path))
    assert [r.getMessage() for r in caplog.records] == [
        (f"--job_log_dir={tmp_path} holds 1 entry and none of a paxlite job's (checkpoints, "
        "summaries, metrics.jsonl, config.json, config.txt): the run writes its own beside them")]
    caplog.clear()
    (tmp_path / "metrics.jsonl").write_text("")
    with caplog.at_level(logging.WARNING):
        make_job_dir(str(tmp_path))  # a job's directory: nothing to say
    assert caplog.records == []


def test_a_refused_newer_format_leaves_the_record_it_points_to(tmp_path, monkeypatch, capfd):
    """A job whose newest checkpoint a newer paxlite wrote: the refusal's line says the job's
    config.json names that paxlite, so the start refuses before writing anything (it rewrote
    config.json with its own version before, or set it aside per attempt)."""
    job = tmp_path / "job"
    step = job / "checkpoints" / "checkpoint_00000005"
    step.mkdir(parents=True)
    (step / "_CHECKPOINT_METADATA").write_text(json.dumps(
        {"custom_metadata": {"paxlite_checkpoint_format": 99}}))
    record = json.dumps({"experiment": "TinySynthetic", "versions": {"paxlite": "9.9.0"}})
    (job / "config.json").write_text(record)
    before = sorted(p.name for p in job.iterdir())
    with paxlite_main(monkeypatch, capfd) as run:
        proc = run(*TRAIN, f"--job_log_dir={job}")
    assert proc.returncode == 2
    assert _one_line(proc) == (
        f"paxlite: error: {step} was written in paxlite checkpoint format 99, and this paxlite "
        "reads format 1 and older: read it with the paxlite that wrote it (its job's config.json "
        "names the version), or point at another checkpoint")
    assert (job / "config.json").read_text() == record
    assert sorted(p.name for p in job.iterdir()) == before
