"""benchmarks/tpu/bench.py --cpu --tiny: the TPU benchmark's parts run on the CPU in seconds, and
its table (printed last) follows from each case's own numbers; benchmarks/tpu/run.sh runs the tpu
pass first; tests/tpu_pass.py lists every file with a `tpu` test."""

import json
import os
import pathlib
import re
import subprocess
import time

import pytest

from tests import tpu_pass
from tests.fork_server import served_python
from tests.xla_test_flags import COMPILE_FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "tpu" / "bench.py"
CASES = ("gpt126m_b4",)  # a GPT with its bare step (the other cases run the same code)
ROWS = {"gpt126m_b4": 2}  # rows per step at the tiny sizes (128 tokens each)
_TPU_MARK = re.compile(r"pytest\.mark\.tpu\b")


def _bench(log_dir, *args, timeout=600):
    env = dict(os.environ, XLA_FLAGS=COMPILE_FLAGS)
    return subprocess.run([served_python(env), str(BENCH), "--cpu", "--tiny", "--steps=2",
                           f"--log_dir={log_dir}", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("tpu_bench")
    done = _bench(log_dir, f"--cases={','.join(CASES)}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return log_dir, done.stdout


def _rows(stdout):
    lines = stdout.rstrip().splitlines()
    table = [line for line in lines if line.startswith("| ")]
    assert lines[-1] == table[-1]  # the table is printed last
    return {cells[0]: cells for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in table[2:])}


@pytest.mark.slow
def test_every_case_has_a_row_that_follows_from_its_numbers(bench):
    log_dir, stdout = bench
    rows = _rows(stdout)
    assert sorted(rows) == sorted(CASES)
    for case in CASES:
        result = json.loads((log_dir / f"{case}.json").read_text())
        row = rows[case]
        assert "failed" not in row[1], row
        assert float(row[1]) == pytest.approx(result["step_s"], abs=5e-5)
        assert float(row[2].replace(",", "")) == pytest.approx(result["tokens_per_s"], abs=0.5)
        # tokens/s is the step's tokens over its time
        assert result["tokens_per_s"] * result["step_s"] == pytest.approx(ROWS[case] * 128,
                                                                           rel=1e-3)
        assert row[3] == "n/a"  # the CPU has no published peak
        assert row[6] == "n/a" and result.get("measured_bytes") is None  # nor memory statistics
        assert result["planned_bytes"] > 0
    gpt = json.loads((log_dir / "gpt126m_b4.json").read_text())
    assert float(rows["gpt126m_b4"][5]) == pytest.approx(gpt["step_s"] / gpt["bare_step_s"],
                                                         abs=1e-3)
    head = json.loads(next(line for line in stdout.splitlines() if line.startswith('{"ceilings"')))
    assert head["ceilings"]["bf16"] > 0 and head["ceilings"]["int8"] > 0


def test_an_unknown_case_is_one_line_exit_2(tmp_path):
    done = subprocess.run([served_python(dict(os.environ)), str(BENCH), f"--log_dir={tmp_path}",
                           "--cases=gpt126m_b4,gpt999"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2
    assert done.stdout.strip().splitlines() == [
        "--cases: unknown gpt999; known: " + ", ".join(sorted(_known()))]


def test_past_the_deadline_nothing_starts_and_every_row_prints(tmp_path):
    done = _bench(tmp_path, "--cases=gpt126m_b4", f"--deadline_s={time.time() - 1}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "failed: skipped: time budget" in _rows(done.stdout)["gpt126m_b4"][1]
    assert not (tmp_path / "gpt126m_b4.json").exists()


def _known():
    text = BENCH.read_text()
    return re.findall(r'Case\("([^"]+)"', text)


def test_every_file_with_a_tpu_test_is_in_the_tpu_pass_and_only_those():
    marked = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
                    if _TPU_MARK.search(path.read_text()))
    assert marked, "no tpu-marked test found: the pattern no longer matches how tests are marked"
    listed = [tpu_pass.TPU_MEMORY_FILE, *tpu_pass.TPU_TEST_FILES]
    assert sorted(listed) == marked and len(set(listed)) == len(listed)


def test_the_tpu_script_runs_the_tpu_pass_then_the_benchmark():
    commands = [line for line in (ROOT / "benchmarks" / "tpu" / "run.sh").read_text().splitlines()
                if not line.lstrip().startswith("#")]
    tests = next(i for i, line in enumerate(commands) if "tests/tpu_pass.py" in line)
    bench = next(i for i, line in enumerate(commands) if "benchmarks/tpu/bench.py" in line)
    assert tests < bench


def test_a_tpu_host_is_seen_without_starting_jax(tmp_path):
    dev = tmp_path / "dev"
    (dev / "vfio").mkdir(parents=True)
    (dev / "vfio" / "vfio").touch()  # VFIO's control device alone: no chip
    assert not tpu_pass.has_tpu(devices=str(dev), environ={})
    (dev / "vfio" / "1").touch()  # a bound group, as on the lent v5e
    assert not tpu_pass.has_tpu(devices=str(dev), environ={})  # a GPU passthrough looks alike
    assert tpu_pass.has_tpu(devices=str(dev), environ={"TPU_ACCELERATOR_TYPE": "v5litepod-4"})
    (dev / "accel0").touch()  # v4 and v5p name their chips
    assert tpu_pass.has_tpu(devices=str(tmp_path / "dev"), environ={})


def test_without_a_tpu_the_pass_says_so_and_succeeds(tmp_path, capsys):
    assert tpu_pass.main([], devices=str(tmp_path), environ={}) == 0  # an empty /dev
    assert "no TPU here" in capsys.readouterr().out
