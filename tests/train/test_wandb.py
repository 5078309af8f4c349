"""Weights & Biases (WANDB_*; train/wandb_sink.py), in wandb's offline mode: what a run logged is
read back from the run's own transaction log (DIR/wandb/offline-run-*/run-ID.wandb, the file
`wandb sync` uploads) and compared with what paxlite wrote itself: the history rows with
metrics.jsonl's lines, the W&B config with config.json's hparams; the same job started again
continues the same W&B run. Nothing here reaches the network."""

import json
import pathlib
import struct
import sys
import zlib
from collections import defaultdict

import jax
import pytest

from paxlite.config.errors import ConfigError
from paxlite.errors import SettingError
from paxlite.experiments.build import build_run_config, load_experiment
from paxlite.train import run_build
from paxlite.train.metrics import MetricsWriter
from paxlite.train.run_build import RunContext
from paxlite.train.run_config import WandbConfig
from paxlite.train.wandb_sink import RUN_ID_FILE, WandbSink, job_run_id
from tests.in_process import paxlite_main, train_in_this_process

# The log's framing (leveldb's log format, as wandb writes it): a 7-byte file header, then records
# cut into 32 KiB blocks, each piece behind a header of crc32 (of its type byte and data), length
# and type.
_FILE_HEADER = b":W&B"
_BLOCK = 32768
_PIECE_HEADER = struct.Struct("<IHB")
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: pathlib.Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data.startswith(_FILE_HEADER), path
    records, pending, offset = [], b"", 7
    while offset + _PIECE_HEADER.size <= len(data):
        left_in_block = _BLOCK - offset % _BLOCK
        if left_in_block < _PIECE_HEADER.size:  # a block's zero-filled tail
            offset += left_in_block
            continue
        crc, length, kind = _PIECE_HEADER.unpack_from(data, offset)
        piece = data[offset + _PIECE_HEADER.size:offset + _PIECE_HEADER.size + length]
        assert kind in (_FULL, _FIRST, _MIDDLE, _LAST), (path, offset, kind)
        assert crc == zlib.crc32(piece, zlib.crc32(bytes([kind]))), (path, offset)
        offset += _PIECE_HEADER.size + length
        pending += piece
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def _offline_run(directory: pathlib.Path) -> dict:
    """The one offline run under `directory`: its run record, config and history rows."""
    import wandb

    wandb.teardown()  # the service writes out the log's last block as it stops, after finish()
    (path,) = directory.glob("wandb/offline-run-*/run-*.wandb")
    records = _records(path)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {_key(item): json.loads(item.value_json) for item in run.config.update}
    for record in records:
        if record.WhichOneof("record_type") == "config":
            config.update({_key(i): json.loads(i.value_json) for i in record.config.update})
    config.pop("_wandb")
    rows = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {_key(i): json.loads(i.value_json) for i in record.history.item}
            rows[record.history.step.num] = {k: v for k, v in row.items()
                                             if not k.startswith("_")}
    (exit_record,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    return {"run": run, "config": config, "rows": rows, "exit_code": exit_record.exit_code}


def _jsonl_rows(job: pathlib.Path, *, after: int = 0) -> dict[int, dict]:
    """metrics.jsonl's lines of each step, joined, without their None values."""
    rows = defaultdict(dict)
    for line in (job / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        step = record.pop("step")
        if step > after:
            rows[step].update({k: v for k, v in record.items() if v is not None})
    return dict(rows)


@pytest.fixture
def offline(monkeypatch):
    """wandb offline, quiet, leaving this process's stdout and stderr as pytest set them (no
    console capture), and torn down afterwards (it reads its settings once per process)."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    wandb.teardown()
    yield
    wandb.teardown()


FLAGS = ["--fdl_config=TinySynthetic", "--fdl.NUM_LAYERS=1", "--fdl.SUMMARY_INTERVAL_STEPS=2",
         "--fdl.EVAL_INTERVAL_STEPS=2", "--fdl.WANDB_PROJECT=paxlite-tests",
         '--fdl.WANDB_TAGS=["tiny", "offline"]']


def test_the_run_logs_metrics_jsonl_and_config_json_and_a_restart_continues_it(
        tmp_path, monkeypatch, capfd, offline):
    job = tmp_path / "job-7"
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    with paxlite_main(monkeypatch, capfd) as run:
        result = run(*FLAGS, "--fdl.MAX_STEPS=4", f"--job_log_dir={job}")
    assert result.returncode == 0, result.stderr[-3000:]
    first = _offline_run(tmp_path / "wandb_dir")
    run_id = (job / RUN_ID_FILE).read_text().strip()
    assert first["run"].run_id == run_id and first["run"].project == "paxlite-tests"
    assert first["run"].display_name == "job-7"  # WANDB_RUN_NAME's default: the job's name
    assert list(first["run"].tags) == ["tiny", "offline"]
    assert first["config"] == json.loads((job / "config.json").read_text())["hparams"]
    # one row per step: its training and evaluation lines, the same keys and values
    assert first["rows"] == _jsonl_rows(job)
    assert sorted(first["rows"]) == [2, 4] and "eval/loss" in first["rows"][4]
    assert "mfu" not in first["rows"][2]  # null in metrics.jsonl (no peak for CPUs): left out
    assert first["exit_code"] == 0

    # the same job again, to step 6: the same W&B run, from where it stopped; without WANDB_DIR
    # the W&B files go to the job directory
    monkeypatch.delenv("WANDB_DIR")
    train_in_this_process(job, [*FLAGS, "--fdl.MAX_STEPS=6"])
    second = _offline_run(job)
    assert (job / RUN_ID_FILE).read_text().strip() == run_id  # kept, not written again
    assert second["run"].run_id == run_id and second["run"].resume
    assert second["rows"] == _jsonl_rows(job, after=4) and sorted(second["rows"]) == [6]


def test_an_error_marks_the_run_failed_and_goes_on(tmp_path, offline):
    with pytest.raises(FloatingPointError, match="diverged"):
        sink = WandbSink(WandbConfig(project="paxlite-tests", hparams={"A": 1}), job_dir=tmp_path)
        with MetricsWriter(tmp_path, sinks=[sink]) as writer:
            writer.write_train(1, {"loss": 1.5, "mfu": float("nan")})
            raise FloatingPointError("diverged")
    logged = _offline_run(tmp_path)
    assert logged["exit_code"] == 1 and logged["config"] == {"A": 1}
    assert logged["rows"] == {1: {"loss": 1.5}} == _jsonl_rows(tmp_path)


def test_no_api_key_is_one_line(tmp_path, monkeypatch, offline):
    monkeypatch.setenv("WANDB_MODE", "online")
    for name, value in (("HOME", tmp_path), ("NETRC", tmp_path / "netrc"),
                        ("WANDB_CONFIG_DIR", tmp_path / "config"),
                        ("WANDB_BASE_URL", "http://127.0.0.1:9")):  # never the network
        monkeypatch.setenv(name, str(value))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(SettingError, match=r"^Weights & Biases did not start the run: No API key "
                                           r".* \(WANDB_MODE=offline logs to disk"):
        WandbSink(WandbConfig(project="paxlite-tests"), job_dir=tmp_path / "job")


def test_a_missing_wandb_package_is_one_line_before_anything_compiles(
        tmp_path, monkeypatch, capfd):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets without it

    def compile_run_steps(*args, **kwargs):
        raise AssertionError("compiled before the missing package was said")

    monkeypatch.setattr(run_build, "compile_run_steps", compile_run_steps)
    job = tmp_path / "job"
    with paxlite_main(monkeypatch, capfd) as run:
        result = run(*FLAGS, "--fdl.MAX_STEPS=2", f"--job_log_dir={job}")
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if "error" in line]
    assert line.startswith("paxlite: error: WANDB_PROJECT is set, and Weights & Biases is not "
                           "installed") and line.endswith("pip install 'paxlite[wandb]'")
    assert not (job / RUN_ID_FILE).exists()


def test_other_processes_start_no_wandb_run(tmp_path, monkeypatch):
    # Without the package a sink could not be made: none is, and nothing is written
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    _, config = build_run_config("TinySynthetic", ["WANDB_PROJECT='paxlite-tests'"])
    job = tmp_path / "job"
    writer = run_build.metrics_writer(config, context=RunContext(job_dir=str(job)))
    writer.write_train(1, {"loss": 1.0})
    writer.write_eval(1, {"loss": 2.0})
    writer.close()
    assert not job.exists()


def test_the_job_keeps_its_run_id(tmp_path):
    made = job_run_id(str(tmp_path))
    assert len(made) == 8 and made.isalnum()
    assert job_run_id(str(tmp_path)) == made == (tmp_path / RUN_ID_FILE).read_text().strip()
    (tmp_path / RUN_ID_FILE).write_text("my-run_1\n")  # an id written by the user is used
    assert job_run_id(str(tmp_path)) == "my-run_1"
    (tmp_path / RUN_ID_FILE).write_text("two words")
    with pytest.raises(SettingError, match=r"wandb_run_id holds 'two words', not a Weights & "
                                           r"Biases run id .* delete the file"):
        job_run_id(str(tmp_path))


@pytest.mark.parametrize("overrides, message", [
    (['WANDB_TAGS=["a"]', "WANDB_ENTITY='me'"],
     "WANDB_ENTITY, WANDB_TAGS set without WANDB_PROJECT: name the Weights & Biases project"),
    (["WANDB_PROJECT='a/b'"], "WANDB_PROJECT='a/b' is not a Weights & Biases project name"),
    (["WANDB_PROJECT='p'", 'WANDB_TAGS=["ok", " "]'], "WANDB_TAGS=['ok', ' ']: [' '] are not"),
    (["WANDB_PROJECT='p'", "WANDB_RUN_NAME=''"], "WANDB_RUN_NAME='' is empty"),
])
def test_each_mistake_is_one_line_naming_the_value(overrides, message):
    with pytest.raises(ConfigError) as raised:
        load_experiment("TinySynthetic", overrides)
    assert message in str(raised.value) and "\n" not in str(raised.value)
