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
