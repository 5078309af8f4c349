"""benchmarks/attention_kernels.py --cpu --tiny: runs, checks each path against XLA before timing,
times the paths that run on CPU, and says why the cuDNN ones are skipped."""

import importlib.util
import json
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "attention_kernels.py"


def test_tiny_cpu_run_prints_times_and_reasons(capsys):
    spec = importlib.util.spec_from_file_location("attention_kernels_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--cpu", "--tiny", "--json"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result["ms_per_fwd_bwd"]) == {"xla_dense_mask", "pallas_segment_ids"}
    assert all(ms > 0 for ms in result["ms_per_fwd_bwd"].values())
    assert "cudnn_dense_mask     skipped: cuDNN flash attention runs on NVIDIA GPUs" in out
    assert "interpreted on CPU" in out


def test_chunks_and_sinks_benchmark_checks_each_path_before_timing(capsys):
    """benchmarks/tpu/attention_variants.py --cpu --tiny (one case): the einsum core, XLA's
    attention and splash (interpreted) agree before they are timed, and the row ratios are against
    the einsum core."""
    script = SCRIPT.parent / "tpu" / "attention_variants.py"
    spec = importlib.util.spec_from_file_location("attention_variants_benchmark", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--cpu", "--tiny", "--cases=sinks_window", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {row["path"]: row for row in result["rows"]}
    assert set(rows) == {"einsum", "xla", "splash"} and rows["einsum"]["vs_einsum"] == 1.0
    assert all(row["ms"] > 0 and row["case"] == "sinks_window" for row in rows.values())
