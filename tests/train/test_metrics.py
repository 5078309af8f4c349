"""MetricsWriter: jsonl, TensorBoard event files (parsed by hand, no TensorFlow) and log line."""

import json
import math
import pathlib
import struct

import pytest
from absl import logging as absl_logging
from tensorboardX.proto import event_pb2

from paxlite.train.metrics import MetricsWriter, format_train_line


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def _masked_crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _read_events(directory: pathlib.Path) -> list[event_pb2.Event]:
    """TFRecord framing: u64 length, u32 masked crc(length), payload, u32 masked crc(payload)."""
    events = []
    files = sorted(directory.glob("events.out.tfevents.*"))
    assert files, f"no event file in {directory}"
    for path in files:
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            header = data[offset : offset + 8]
            (length,) = struct.unpack("<Q", header)
            (length_crc,) = struct.unpack("<I", data[offset + 8 : offset + 12])
            assert length_crc == _masked_crc32c(header)
            payload = data[offset + 12 : offset + 12 + length]
            (payload_crc,) = struct.unpack("<I", data[offset + 12 + length : offset + 16 + length])
            assert payload_crc == _masked_crc32c(payload)
            offset += 16 + length
            event = event_pb2.Event()
            event.ParseFromString(payload)
            events.append(event)
    return events


def _scalars(directory: pathlib.Path) -> list[tuple[int, str, float]]:
    return [
        (event.step, value.tag, value.simple_value)
        for event in _read_events(directory)
        for value in event.summary.value
    ]


def _jsonl(job_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]


def test_jsonl_and_tensorboard_round_trip(tmp_path: pathlib.Path) -> None:
    with MetricsWriter(tmp_path, max_steps=100) as writer:
        writer.write_train(10, {"loss": 5.25, "grad_norm": 1.5, "learning_rate": 6e-4, "mfu": None})
        writer.write_train(20, {"loss": float("nan"), "grad_norm": float("inf"), "tokens": 4096})
        writer.write_eval(20, {"loss": 4.75, "lambada_acc_strict": 0.5})
    assert _jsonl(tmp_path) == [
        {"step": 10, "loss": 5.25, "grad_norm": 1.5, "learning_rate": 6e-4, "mfu": None},
        {"step": 20, "loss": None, "grad_norm": None, "tokens": 4096},
        {"step": 20, "eval/loss": 4.75, "eval/lambada_acc_strict": 0.5},
    ]
    train = _scalars(tmp_path / "summaries" / "train")
    assert [(s, t) for s, t, _ in train] == [
        (10, "loss"),
        (10, "grad_norm"),
        (10, "learning_rate"),
        (20, "loss"),
        (20, "grad_norm"),
        (20, "tokens"),
    ]
    values = [v for _, _, v in train]
    assert values[:3] == [5.25, 1.5, pytest.approx(6e-4)]
    assert math.isnan(values[3]) and values[4] == math.inf and values[5] == 4096.0
    eval_scalars = _scalars(tmp_path / "summaries" / "eval")
    assert eval_scalars == [(20, "loss", 4.75), (20, "lambada_acc_strict", 0.5)]


def test_reopen_appends(tmp_path: pathlib.Path) -> None:
    with MetricsWriter(tmp_path) as writer:
        writer.write_train(1, {"loss": 3.0})
    with MetricsWriter(tmp_path) as writer:
        writer.write_train(2, {"loss": 2.0})
    assert _jsonl(tmp_path) == [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}]
    steps = [s for s, _, _ in _scalars(tmp_path / "summaries" / "train")]
    assert steps == [1, 2]


def test_each_line_is_flushed_before_close(tmp_path: pathlib.Path) -> None:
    writer = MetricsWriter(tmp_path)
    writer.write_train(7, {"loss": 1.0})
    assert _jsonl(tmp_path) == [{"step": 7, "loss": 1.0}]
    assert _scalars(tmp_path / "summaries" / "train") == [(7, "loss", 1.0)]
    writer.close()


def test_disabled_writes_nothing(tmp_path: pathlib.Path) -> None:
    job_dir = tmp_path / "job"
    with MetricsWriter(job_dir, enabled=False) as writer:
        writer.write_train(1, {"loss": 1.0})
        writer.write_eval(1, {"loss": 1.0})
    assert not job_dir.exists()


def test_bad_keys_are_rejected(tmp_path: pathlib.Path) -> None:
    with MetricsWriter(tmp_path) as writer:
        with pytest.raises(ValueError, match="eval/loss"):
            writer.write_eval(1, {"eval/loss": 1.0})
        with pytest.raises(ValueError, match="step"):
            writer.write_train(1, {"step": 1.0})


def test_train_line_is_logged(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    with (caplog.at_level("INFO", logger=absl_logging.get_absl_logger().name),
          MetricsWriter(tmp_path, max_steps=10) as writer):
        writer.write_train(4, {"loss": 2.0, "step_time_s": 1.0})
    assert any("step 4/10 | loss 2.0000" in r.getMessage() for r in caplog.records)


def test_format_train_line() -> None:
    metrics = {
        "loss": 5.12341,
        "grad_norm": 1.234,
        "learning_rate": 6e-4,
        "step_time_s": 0.412,
        "tokens_per_s": 19880.4,
        "mfu": 0.4123,
    }
    line = format_train_line(100, metrics, max_steps=600000)
    # ETA: 599,900 steps * 0.412 s = 247,158.8 s = 2 d 20:39:19.
    assert line == (
        "step 100/600000 | loss 5.1234 | grad_norm 1.23 | lr 6.00e-04 | 0.412 s/step | "
        "19,880 tok/s | MFU 41.2% | ETA 2d 20:39:19"
    )


def test_format_train_line_missing_values() -> None:
    line = format_train_line(5, {"loss": 1.0, "step_time_s": 2.0, "mfu": None}, max_steps=None)
    assert line == (
        "step 5 | loss 1.0000 | grad_norm n/a | lr n/a | 2.000 s/step | n/a | MFU n/a | ETA n/a"
    )
    short = format_train_line(5, {"step_time_s": 3.0}, max_steps=1205)
    assert short.endswith("ETA 01:00:00")
