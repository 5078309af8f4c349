"""Tiny GLaM and Mixtral train from the command line: the loss falls and the MoE metrics are logged.

One subprocess per model, as users run it (`python -m paxlite.main --fdl_config=...`), on one CPU
device; the metrics are read back from metrics.jsonl and the TensorBoard event files.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from tests.train.test_metrics import _scalars

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
ENV.pop("XLA_FLAGS", None)  # one CPU device, as on a plain machine
MOE_KEYS = {"moe/aux_loss", "moe/dropped_fraction", "moe/expert_load_min", "moe/expert_load_max"}


@pytest.fixture(scope="module", params=["TinyGLaM", "TinyMixtral"])
def trained(request, tmp_path_factory):
    job = tmp_path_factory.mktemp(request.param) / "job"
    flags = [f"--fdl_config={request.param}", f"--job_log_dir={job}", "--fdl.MAX_STEPS=40",
             "--fdl.SUMMARY_INTERVAL_STEPS=10", "--fdl.Z_LOSS_WEIGHT=0.0001"]
    result = subprocess.run([sys.executable, "-m", "paxlite.main", *flags], capture_output=True,
                            text=True, env=ENV, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    return request.param, job, [line for line in lines if "loss" in line]


def test_loss_falls(trained):
    name, _, train = trained
    assert [line["step"] for line in train] == [10, 20, 30, 40]
    first, last = train[0]["loss"], train[-1]["loss"]
    vocab = {"TinyGLaM": 256, "TinyMixtral": 512}[name]
    assert first < math.log(vocab) + 0.5  # a sane start near ln(vocab)...
    assert last < 0.85 * first, f"{name}: loss {first} -> {last}"  # ...that learns the permutation


def test_moe_metrics_in_jsonl_and_tensorboard(trained):
    name, job, train = trained
    for line in train:
        assert MOE_KEYS | {"moe/z_loss"} <= set(line), sorted(line)
        assert line["moe/expert_load_min"] <= 1 / 8 <= line["moe/expert_load_max"] <= 1.0
        assert 0.5 < line["moe/aux_loss"] < 8.0  # 1.0 when perfectly uniform, 8 = E if collapsed
        assert line["moe/z_loss"] > 0
        if name == "TinyMixtral":
            assert line["moe/dropped_fraction"] == 0.0
        else:
            assert 0.0 <= line["moe/dropped_fraction"] < 1.0
    tags = {tag for _, tag, _ in _scalars(job / "summaries" / "train")}
    assert MOE_KEYS | {"moe/z_loss"} <= tags, sorted(tags)
