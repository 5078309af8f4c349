"""benchmarks/gpu/bench.py --cpu --tiny: every part of the one-call GPU benchmark runs, and its
table (printed last) has every row, with numbers that follow from the runs' own metrics.jsonl and
config.json, and planned peaks that are the planner's for the experiment each run recorded."""

import json
import os
import re
import statistics
import subprocess
import sys
import time

import jax
import pytest

from paxlite.experiments.build import load_recorded_experiment
from paxlite.planner.search import compile_train_step
from tests.fork_server import paxlite_python, served_python
from tests.xla_test_flags import COMPILE_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "gpu", "bench.py")
MODELS = ("Synthetic126M", "LLaMA-1B (fuji-1B-v3)", "GLaM126M64E")
# --peak_tflops: a known spec peak, so the "MFU spec" column is a number on the CPU
PEAKS = (2.0, 4.0)
# Parameters another part of paxlite may not have yet: rows that use them may say "failed: <error>".
PENDING = ("USE_FP8", "USE_CUDNN_FLASH_ATTENTION")
# --tiny plans the first case of the run order only
PLANNED = ("Synthetic126M", "bf16", "dot_product")
NOTE = 11  # the note column, last


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("bench")
    env = {k: v for k, v in os.environ.items() if k not in ("BASE_XLA_FLAGS", "XLA_PRESET")}
    env["XLA_FLAGS"] = COMPILE_FLAGS
    result = subprocess.run(
        [
            served_python(env),  # the bench and its runs forked, not each a fresh interpreter
            BENCH,
            "--cpu",
            "--tiny",
            f"--log_dir={log_dir}",
            f"--deadline_s={time.time() + 3000}",
            f"--peak_tflops={PEAKS[0]},{PEAKS[1]}",
            "--plan_s=600",
        ],  # the cap is not under test here
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return log_dir, result.stdout


def _table(stdout):
    lines = stdout.rstrip().splitlines()
    table = []
    for line in reversed(lines):  # the table is the last thing printed
        if not line.startswith("|"):
            break
        table.insert(0, [cell.strip() for cell in line.strip("|").split("|")])
    header, rule, *rows = table
    assert set("".join(rule)) == {"-"}
    return header, rows


def _number(cell):
    return float(cell.rstrip("%").replace(",", ""))


# slow: the shared fixture runs twelve training processes, the matmul part and the planner (one tiny
# compile) (90-130 s on 2 cores, with the load)
@pytest.mark.slow
def test_table_is_last_and_has_every_row(bench):
    _, stdout = bench
    header, rows = _table(stdout)
    assert header == [
        "model",
        "precision",
        "attention",
        "tokens/s",
        "TFLOP/s/dev",
        "MFU spec",
        "MFU measured",
        "input wait",
        "planned peak GiB",
        "measured peak GiB",
        "measured/planned",
        "note",
    ]
    assert [r[0].split(" ")[:2] for r in rows[:2]] == [["matmul", "bf16"], ["matmul", "fp8"]]
    for row in rows[:2]:
        assert _number(row[4]) > 0 and row[6] == "100.0%" and row[8:11] == ["-"] * 3
        assert _number(row[5]) == pytest.approx(
            100 * _number(row[4]) / PEAKS[row[1] == "fp8"], abs=0.06
        )
    combos = [(r[0], r[1], r[2]) for r in rows[2:]]
    assert combos == [
        (m, p, a) for m in MODELS for p in ("bf16", "fp8") for a in ("flash", "dot_product")
    ]


@pytest.mark.slow  # the same fixture as the table test
def test_numbers_follow_from_each_runs_metrics(bench):
    log_dir, stdout = bench
    _, rows = _table(stdout)
    matmul = json.loads((log_dir / "matmul.json").read_text())
    numeric = set()
    for row in rows[2:]:
        model, precision, attention = row[:3]
        name = re.sub(r"[^A-Za-z0-9]+", "_", f"{_config(model)}_{precision}_{attention}").lower()
        if row[NOTE].startswith("failed: "):
            # only a parameter still being added may fail, and the row quotes the run's log
            log = (log_dir / f"{name}.log").read_text()
            assert any(p in row[NOTE] for p in PENDING), row
            assert row[NOTE][len("failed: "):] in log
            assert row[3:8] == ["-"] * 5 and row[9:11] == ["-"] * 2  # no run, no measured peak
            continue
        # step 1 compiles, the window of step 2 is the first: dropped
        assert row[NOTE] == "steps 3-3"
        numeric.add((model, precision, attention))
        lines = [
            json.loads(line) for line in (log_dir / name / "metrics.jsonl").read_text().splitlines()
        ]
        steady = [line for line in lines if "loss" in line and line["tokens_per_s"]][1:]
        config = json.loads((log_dir / name / "config.json").read_text())
        tokens = statistics.median(line["tokens_per_s"] for line in steady)
        tflops = tokens * config["flops_per_token"] / config["devices"]["count"] / 1e12
        assert _number(row[3]) == pytest.approx(tokens, abs=0.6)
        assert _number(row[4]) == pytest.approx(tflops, rel=0.01)
        assert _number(row[5]) == pytest.approx(100 * tflops / PEAKS[precision == "fp8"], abs=0.06)
        ceiling = max(matmul[precision].values())
        assert _number(row[6]) == pytest.approx(100 * tflops / ceiling, abs=0.06)
        wait = statistics.median(line["input_wait_fraction"] for line in steady)
        assert _number(row[7]) == pytest.approx(100 * wait, abs=0.06)
        assert 0 <= wait <= 1
    # everything that needs no pending parameter ran: bf16 dot-product everywhere, flash on LLaMA
    assert numeric >= {(m, "bf16", "dot_product") for m in MODELS} | {
        ("LLaMA-1B (fuji-1B-v3)", "bf16", "flash")
    }


@pytest.mark.slow  # the same fixture as the table test
def test_planned_peaks_are_the_planners_for_each_runs_recorded_experiment(bench):
    log_dir, stdout = bench
    _, rows = _table(stdout)
    runs = {(r["model"], r["precision"], r["attention"]): r
            for r in json.loads((log_dir / "results.json").read_text())["runs"]}
    # the CPU keeps no allocator statistics; a backend that does would give every run a number
    cpu_reports = jax.devices("cpu")[0].memory_stats() is not None
    for row in rows[2:]:
        key = tuple(row[:3])
        planned = runs[key]["planned_peak_bytes"]
        if key != PLANNED:
            assert row[8] == "n/a" and planned is None, row
        else:
            assert planned > 0 and _number(row[8]) == pytest.approx(planned / 2**30, rel=0.01), row
        if not row[NOTE].startswith("steps"):
            continue
        # the run's own reading, taken inside it after its last train line (step 3)
        name = re.sub(r"[^A-Za-z0-9]+", "_", f"{_config(key[0])}_{key[1]}_{key[2]}").lower()
        reading = json.loads((log_dir / name / "device_memory.json").read_text())
        assert reading["step"] == 3 and reading["platform"] == "cpu", reading
        measured = runs[key]["measured_peak_bytes"]
        assert measured == reading["peak_bytes_in_use"]
        if cpu_reports:
            assert _number(row[9]) == pytest.approx(measured / 2**30, rel=0.01)
        else:
            assert row[9] == "n/a" and measured is None
        assert row[10] == (
            "n/a" if planned is None or measured is None else f"{measured / planned:.2f}"
        )
    # One compile here, apart from the benchmark's planner: the experiment the run recorded in its
    # config.json (what it trained, flags and all), planned for one CPU device, gives the same
    # bytes.
    config = json.loads((log_dir / "synthetic126m_bf16_dot_product" / "config.json").read_text())
    experiment = load_recorded_experiment(
        config["experiment"], {name: config["hparams"][name] for name in config["overridden"]}
    )
    expected = compile_train_step(experiment, num_devices=1, target="cpu").memory.peak_bytes
    assert runs[PLANNED]["planned_peak_bytes"] == expected
    assert ("planned peak: the train step compiled before the runs, for cpu (--cpu: no GPU model), "
            "1 device: 1 of 12 cases") in stdout


def _config(label):
    return {"Synthetic126M": "Synthetic126M", "LLaMA-1B (fuji-1B-v3)": "fuji-1B-v3-flash",
            "GLaM126M64E": "SyntheticGLaM126M64E"}[label]


def test_past_the_deadline_nothing_starts_and_every_row_still_prints(tmp_path):
    env = {**os.environ, "XLA_FLAGS": COMPILE_FLAGS}
    result = subprocess.run(
        [
            paxlite_python(),  # the suite's fork server: its runs are forked too
            BENCH,
            "--cpu",
            "--tiny",
            f"--log_dir={tmp_path}",
            f"--deadline_s={time.time()}",
            "--only=Synthetic126M",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    _, rows = _table(result.stdout)
    assert [r[NOTE] for r in rows[:2]] == ["skipped: time budget"] * 2
    assert [(r[0], r[1], r[2], *r[8:]) for r in rows[2:]] == [
        ("Synthetic126M", p, a, "n/a", "-", "-", "skipped: time budget")
        for p in ("bf16", "fp8") for a in ("flash", "dot_product")]
    assert not any(tmp_path.glob("synthetic126m_*"))  # no run was started
    assert not any(tmp_path.glob("plan*"))  # nor the planner
    assert (
        "planned peak: the train step compiled before the runs, not planned: time budget"
        in result.stdout
    )


def test_unknown_model_is_one_line_exit_2(tmp_path):
    result = subprocess.run([sys.executable, BENCH, f"--log_dir={tmp_path}", "--only=GPT9000"],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        ("bench: error: --only='GPT9000' names no model; valid: Synthetic126M, fuji-1B-v3-flash, "
        "SyntheticGLaM126M64E")]


def test_unknown_plan_target_is_one_line_exit_2(tmp_path):
    result = subprocess.run([sys.executable, BENCH, f"--log_dir={tmp_path}", "--plan_target=b200"],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "bench: error: --plan_target='b200': expected one of cpu, h100, h200, a100"]


def test_on_a_tpu_host_it_points_to_the_tpu_benchmark(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="tpu")  # what a TPU host's launch would say
    done = subprocess.run([paxlite_python(), BENCH, f"--log_dir={tmp_path}"], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        ("bench: error: this host has a TPU (JAX_PLATFORMS=tpu): run the TPU benchmark, bash "
         "benchmarks/tpu/run.sh (splash attention, int8 ceilings, TPU peaks)")]
