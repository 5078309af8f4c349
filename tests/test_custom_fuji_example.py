"""examples/custom_fuji.py (AXLearn's custom-configuration example) trains the tiny Fuji on CPU
with the custom mesh rule, batch, sequence length and intervals it sets from Python.

The script's main(argv) is called in this process, as `python examples/custom_fuji.py ARGS` calls
it: a process of its own would add a Python and JAX start (~2 CPU-s) and nothing the checks see;
this process has the eight CPU devices the script's run needs (tests/conftest.py)."""

import json
import os
import runpy
import sys
from pathlib import Path

import pytest

from tests.in_process import Result

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "custom_fuji.py"


@pytest.fixture(scope="module")
def script_main():
    """The script's main(argv), its module run once under a name other than __main__."""
    return runpy.run_path(str(SCRIPT), run_name="custom_fuji")["main"]


def _run(script_main, monkeypatch, capfd, *args: str) -> Result:
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])  # the job records its command line
    capfd.readouterr()
    code = script_main(list(args))
    out, err = capfd.readouterr()
    return Result(code, out, err)


def test_custom_fuji_example_trains_with_its_settings(tmp_path, script_main, monkeypatch, capfd):
    trainer_dir = tmp_path / "custom"
    result = _run(script_main, monkeypatch, capfd, "--config=fuji-test-v1",
                  f"--trainer_dir={trainer_dir}", "--max_step=3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("mesh rule 'custom' (--mesh_selector=custom): ICI_MESH_SHAPE=[1, 8, 1], "
            "DCN_MESH_SHAPE=[1, 1, 1], GRAD_ACCUM_STEPS=2, global batch 16 x 32") in result.stdout
    recorded = json.loads((trainer_dir / "config.json").read_text())
    hp = recorded["hparams"]
    assert (recorded["mesh"]["fsdp"], recorded["mesh"]["data"], recorded["global_batch_size"]) == (
        8,
        1,
        16,
    )
    assert (
        hp["MAX_STEPS"],
        hp["MAX_SEQ_LEN"],
        hp["GRAD_ACCUM_STEPS"],
        hp["CHECKPOINT_EVERY_N_STEPS"],
        hp["SUMMARY_INTERVAL_STEPS"],
        hp["SYNTHETIC_DATA"],
    ) == (3, 32, 2, 2, 1, True)
    lines = [json.loads(line) for line in (trainer_dir / "metrics.jsonl").read_text().splitlines()]
    train = [line for line in lines if "loss" in line]
    assert [line["step"] for line in train] == [1, 2, 3]  # a summary every step
    # 16 sequences of 32 tokens per step, whatever the microbatching
    assert all(line["tokens_per_s"] is None or line["tokens_per_s"] > 0 for line in train)
    assert sorted(os.listdir(trainer_dir / "checkpoints")) == [
        "checkpoint_00000002", "checkpoint_00000003"]  # every 2 steps, and the last


def test_custom_fuji_example_refuses_an_unknown_config(tmp_path, script_main, monkeypatch, capfd):
    result = _run(script_main, monkeypatch, capfd, "--config=fuji-test-v9",
                  f"--trainer_dir={tmp_path}")
    assert result.returncode == 2
    assert "--config=fuji-test-v9 is not a Fuji config name" in result.stderr
