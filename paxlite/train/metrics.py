"""Training and evaluation metrics: metrics.jsonl, TensorBoard event files and a log line.

`metrics.jsonl` is the machine-readable record (docs/training.md lists its keys): one JSON object
per call, appended so a resumed run keeps its history, flushed per line so a crash loses nothing
already logged, and strictly valid JSON (NaN/inf become null, because `json` would otherwise write
the non-standard `NaN` token that most readers reject). Sinks (Weights & Biases:
train/wandb_sink.py) get each record as it is appended there, so they log what it holds.

TensorBoard files go to `summaries/train` and `summaries/eval` with the same tag names (eval keys
without the `eval/` prefix), so TensorBoard overlays train and eval curves as Pax's did. They are
written with tensorboardX's synchronous `EventsWriter` rather than `SummaryWriter`: the latter
queues events to a background thread, so its `flush()` cannot promise that a step is on disk.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol, Self, TextIO

from absl import logging

from paxlite.checkpointing.storage_faults import check_not_removed, refused_writes


@contextlib.contextmanager
def _without_torch() -> Iterator[None]:
    """Makes `import torch` fail inside the block, unless torch is loaded already.

    tensorboardX's package imports torch whenever it is installed, for PyTorch helpers paxlite never
    calls; torch is an optional extra (checkpoint conversion), and loading it costs every training
    process 1.3-1.6 s on a 2-core machine. A None entry in sys.modules is Python's way of saying a
    module is unavailable, and tensorboardX falls back to NumPy exactly as it does without torch.
    """
    if "torch" in sys.modules:
        yield
        return
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]


with _without_torch():
    from tensorboardX import summary as tb_summary
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto import event_pb2

_EVAL_PREFIX = "eval/"


def _json_value(value: object) -> int | float | None:
    """Plain JSON number, or None for missing / non-finite values (numpy and jax scalars too)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"Metric values must be numbers or None, got the bool {value!r}.")
    if isinstance(value, int):
        return value
    number = float(value)  # type: ignore[arg-type]
    return number if math.isfinite(number) else None


def _format_duration(seconds: float) -> str:
    """'2d 04:13:07' or '04:13:07'."""
    total = round(seconds)
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    clock = f"{hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{days}d {clock}" if days else clock


def _number(metrics: Mapping[str, float | None], key: str) -> float | None:
    value = metrics.get(key)
    return None if value is None else float(value)


def format_train_line(
    step: int, metrics: Mapping[str, float | None], *, max_steps: int | None
) -> str:
    """Human-readable one-line summary; a missing or None value prints as 'n/a'.

    Expected keys: loss, grad_norm, learning_rate, step_time_s, tokens_per_s, mfu (a fraction).
    The ETA assumes the remaining steps take `step_time_s` each.
    """

    def field(key: str, spec: str, suffix: str = "") -> str:
        value = _number(metrics, key)
        return "n/a" if value is None else f"{value:{spec}}{suffix}"

    step_text = f"step {step}/{max_steps}" if max_steps is not None else f"step {step}"
    mfu = _number(metrics, "mfu")
    step_time = _number(metrics, "step_time_s")
    eta = "n/a"
    if max_steps is not None and step_time is not None and math.isfinite(step_time):
        eta = _format_duration(max(0, max_steps - step) * step_time)
    parts = [
        step_text,
        f"loss {field('loss', '.4f')}",
        f"grad_norm {field('grad_norm', '.3g')}",
        f"lr {field('learning_rate', '.2e')}",
        field("step_time_s", ".3f", " s/step"),
        field("tokens_per_s", ",.0f", " tok/s"),
        f"MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}",
        f"ETA {eta}",
    ]
    return " | ".join(parts)


class MetricSink(Protocol):
    """Another destination of metrics.jsonl's records (a metrics service)."""

    def write(self, step: int, record: Mapping[str, int | float | None]) -> None:
        """One record as metrics.jsonl gets it, without its "step"."""

    def close(self) -> None:
        """Called once, when the writer closes."""


class MetricsWriter:
    """Writes metrics to `job_dir/metrics.jsonl`, TensorBoard, the absl log and `sinks`.

    Args:
        job_dir: The run's job directory.
        enabled: False on non-zero processes: nothing is written or logged.
        max_steps: Total steps, used for the ETA in the log line; None omits it.
        sinks: Given each metrics.jsonl record as it is appended; closed with the writer.
    """

    def __init__(
        self,
        job_dir: str | os.PathLike,
        *,
        enabled: bool = True,
        max_steps: int | None = None,
        sinks: Sequence[MetricSink] = (),
    ) -> None:
        self._job_dir = pathlib.Path(job_dir)
        self._enabled = enabled
        self._max_steps = max_steps
        self._sinks = list(sinks)
        self._jsonl: TextIO | None = None
        # Created on first use, so a run without evaluation has no empty eval event file.
        self._tensorboard: dict[str, EventsWriter] = {}
        if enabled:
            self._job_dir.mkdir(parents=True, exist_ok=True)
            # Open for the writer's lifetime (one line per step, flushed); close() closes it.
            path = self._job_dir / "metrics.jsonl"
            self._jsonl = open(path, "a", encoding="utf-8")  # noqa: SIM115

    def write_train(self, step: int, metrics: Mapping[str, float | None]) -> None:
        """Records one training step's metrics (keys as docs/training.md lists them)."""
        if not self._enabled:
            return
        self._check_keys(metrics)
        self._append_json(step, dict(metrics))
        self._write_scalars("train", step, metrics)
        logging.info("%s", format_train_line(step, metrics, max_steps=self._max_steps))

    def write_eval(self, step: int, metrics: Mapping[str, float | None]) -> None:
        """Records evaluation metrics; keys come without 'eval/', which is added in the jsonl."""
        if not self._enabled:
            return
        self._check_keys(metrics)
        for key in metrics:
            if key.startswith(_EVAL_PREFIX):
                raise ValueError(
                    f"Eval metric {key!r} already has the 'eval/' prefix; pass "
                    f"{key[len(_EVAL_PREFIX):]!r} and the writer adds it."
                )
        self._append_json(step, {_EVAL_PREFIX + k: v for k, v in metrics.items()})
        self._write_scalars("eval", step, metrics)
        shown = ", ".join(
            f"{k} {'n/a' if (v := _json_value(val)) is None else f'{v:.4g}'}"
            for k, val in metrics.items()
        )
        logging.info("eval at step %d | %s", step, shown)

    def write_lm_eval(self, step: int, metrics: Mapping[str, float | None]) -> None:
        """Records lm-evaluation-harness scores, keyed ``lm_eval/<task>/<metric>`` in the jsonl and
        ``<task>/<metric>`` in TensorBoard's summaries/lm_eval."""
        if not self._enabled or not metrics:
            return
        self._check_keys(metrics)
        prefix = "lm_eval/"
        for key in metrics:
            if not key.startswith(prefix):
                raise ValueError(f"lm_eval metric {key!r} lacks the {prefix!r} prefix")
        self._append_json(step, dict(metrics))
        self._write_scalars("lm_eval", step, {k[len(prefix):]: v for k, v in metrics.items()})
        logging.info("lm_eval at step %d | %s", step, ", ".join(
            f"{k[len(prefix):]} {'n/a' if (v := _json_value(val)) is None else f'{v:.4g}'}"
            for k, val in metrics.items()))

    def close(self) -> None:
        """Flushes and closes every file; safe to call twice."""
        # Each write is flushed, so closing can fail only for data a write already failed to
        # write (a full disk), an error already raised: it must not replace that one.
        if self._jsonl is not None:
            with contextlib.suppress(OSError):
                self._jsonl.close()
            self._jsonl = None
        for writer in self._tensorboard.values():
            with contextlib.suppress(OSError):
                writer.close()
        self._tensorboard.clear()
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            sink.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _check_keys(metrics: Mapping[str, float | None]) -> None:
        if "step" in metrics:
            raise ValueError("'step' is not a metric name: pass the step as the first argument.")

    def _append_json(self, step: int, metrics: dict[str, float | None]) -> None:
        if self._jsonl is None:
            raise ValueError(f"MetricsWriter for {self._job_dir} is closed.")
        values = {k: _json_value(v) for k, v in metrics.items()}
        path = self._job_dir / "metrics.jsonl"
        with refused_writes(path):  # a full disk, a removed job directory: one line
            self._jsonl.write(json.dumps({"step": int(step), **values}, allow_nan=False) + "\n")
            self._jsonl.flush()
            check_not_removed(path, self._jsonl)
        for sink in self._sinks:
            sink.write(int(step), values)

    def _write_scalars(self, split: str, step: int, metrics: Mapping[str, float | None]) -> None:
        with refused_writes(self._job_dir / "summaries" / split):
            self._write_events(split, step, metrics)

    def _write_events(self, split: str, step: int, metrics: Mapping[str, float | None]) -> None:
        writer = self._tensorboard.get(split)
        if writer is None:
            directory = self._job_dir / "summaries" / split
            directory.mkdir(parents=True, exist_ok=True)
            # tensorboardX names files by the second and host and truncates an existing one; a
            # pid + nanosecond suffix keeps a quick restart from wiping the previous run's events.
            writer = EventsWriter(
                str(directory / "events"), filename_suffix=f".{os.getpid()}.{time.time_ns()}"
            )
            self._tensorboard[split] = writer
        wall_time = time.time()
        for key, value in metrics.items():
            if value is not None:
                summary = tb_summary.scalar(key, float(value))
                event = event_pb2.Event(wall_time=wall_time, step=int(step), summary=summary)
                writer.write_event(event)
        writer.flush()
