"""`python -m paxlite plan --target=h100|h200`: the plan compiled by XLA's GPU compiler says so.

What a CPU plan cannot show is asserted against the CPU plan of the same run: cuDNN's attention
kernels in the program, temporaries without the float32 [B, N, T, S] logits XLA's attention holds,
the GPU's own memory and peak, and no FLOPs where the GPU compiler counts none. The levers and the
longest-sequence search re-plan on the same target (checked against an independent compile of the
same run). The last tests need no plugin: a process without it, and a bad --target, are one line
and exit 2.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from paxlite import __main__ as cli
from paxlite.errors import UserError
from paxlite.experiments.build import load_experiment
from paxlite.parallel.compile_targets import GPU_SPECS, CompileTarget
from paxlite.planner import levers as plan_levers
from paxlite.planner import plan as plan_lib
from paxlite.planner.results import Plan

gpu_compile = pytest.mark.gpu_compile  # each test that compiles for a GPU (the last ones need none)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPERIMENT = "paxlite.experiments.tiny.TinyLLaMA"
# cuDNN-able (bf16, 64 dims per head), one layer of 2 heads, one row per device on 2 devices.
CUDNN = ("NUM_LAYERS=1", "FPROP_DTYPE='bfloat16'", "DIMS_PER_HEAD=64", "NUM_HEADS=2",
         "NUM_KV_HEADS=2", "MODEL_DIMS=128", "HIDDEN_DIMS=256", "PERCORE_BATCH_SIZE=1",
         "ICI_MESH_SHAPE=[2,1,1]", "USE_CUDNN_FLASH_ATTENTION=True")
H100 = GPU_SPECS[CompileTarget.H100]


def _plan(seq_len: int, **kwargs) -> Plan:
    experiment = load_experiment(EXPERIMENT, (*CUDNN, f"MAX_SEQ_LEN={seq_len}"))
    return plan_lib.plan_experiment(experiment, num_devices=2, **kwargs)


def _logits_bytes(seq_len: int) -> int:
    """One layer's float32 [B, N, T, S] attention logits on one device (1 row, 2 heads), by hand."""
    return 4 * 1 * 2 * seq_len * seq_len


@pytest.fixture(scope="module")
def h100() -> Plan:
    return _plan(2048, target="h100", longest_seq="off")


@pytest.fixture(scope="module")
def cpu() -> Plan:
    return _plan(2048, longest_seq="off")


@pytest.fixture(scope="module")
def tight(h100) -> Plan:
    """The run at 4096 tokens on an H100 with the 2048-token step's peak + 1 MiB: it does not
    fit, so levers (one compiled) and the longest sequence (steps of 2048: one compile) are
    planned."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plan_levers, "_MAX_COMPILED_LEVERS", 1)
        return _plan(4096, target="h100", longest_seq="on", seq_step=2048,
                     device_memory_gib=(h100.memory_per_device.peak_bytes + 2**20) / 2**30)


@gpu_compile
def test_the_plan_says_which_compiler_and_takes_the_gpus_memory_and_peak(h100, cpu):
    assert (h100.compiled_for, cpu.compiled_for) == ("h100", "cpu")
    assert h100.device_memory_bytes == H100.memory_bytes
    assert cpu.device_memory_bytes == 80 * 2**30
    assert h100.peak_tflops_per_device == H100.dense_bf16_tflops
    assert h100.gpu_program.xla_preset == "llama" and cpu.gpu_program is None
    # the state's bytes follow from shapes and shardings: the same whichever compiler
    gpu_memory, cpu_memory = h100.memory_per_device, cpu.memory_per_device
    assert gpu_memory.parameter_bytes == cpu_memory.parameter_bytes > 0
    assert gpu_memory.optimizer_state_bytes == cpu_memory.optimizer_state_bytes > 0
    assert gpu_memory.argument_bytes == cpu_memory.argument_bytes > 0


@gpu_compile
def test_cudnn_attention_is_compiled_and_its_temporaries_hold_no_logits(h100, cpu):
    kernels = h100.gpu_program.kernels
    assert any(name.startswith("__cudnn$fmha") for name in kernels), kernels
    assert kernels["__cublas$lt$matmul"] > 0 and h100.gpu_program.fp8_gemms["total"] == 0
    assert h100.attention_kernel == "cudnn" and h100.attention_logits_bytes_per_layer is None
    assert h100.attention_note is None  # the CPU's stand-in note: cuDNN is compiled here
    assert cpu.attention_note.startswith("attention planned with 'xla'")
    assert cpu.attention_logits_bytes_per_layer == _logits_bytes(2048)
    # XLA's attention on the CPU holds the logits; cuDNN's kernel does not: more than a layer's
    # logits apart (27 MB against 108 MB when measured)
    gpu_temp, cpu_temp = (p.memory_per_device.temp_bytes for p in (h100, cpu))
    assert gpu_temp < cpu_temp - _logits_bytes(2048), (gpu_temp, cpu_temp)


@gpu_compile
def test_no_gpu_flops_are_reported_and_none_are_borrowed_from_the_cpu(h100, cpu):
    gpu, host = h100.flops_per_step, cpu.flops_per_step
    assert gpu.compiler_per_device is None and gpu.compiler_total is None
    assert "no cost analysis" in gpu.compiler_note and host.compiler_note is None
    assert host.compiler_per_device > 0 and gpu.analytic == host.analytic > 0
    text = plan_lib.format_text(h100)
    assert "compiled for h100 by XLA's GPU compiler" in text and "__cudnn$fmha" in text
    assert "compiler not available (XLA's GPU compiler gives no cost analysis" in text
    assert f"{host.compiler_total:.4g}" not in text
    assert "attention planned with 'xla'" not in text


@gpu_compile
def test_levers_and_the_longest_sequence_are_compiled_for_the_gpu(h100, tight):
    assert tight.compiled_for == "h100" and not tight.verdict.fits
    compiled = [lever for lever in tight.levers
                if lever.peak_bytes is not None and lever.method == "compiled"]
    assert [lever.lever for lever in compiled] == ["fsdp 1 -> 2 (all of data moved to fsdp)"]
    # one layer's float32 [B, N, T, S] logits alone, which any XLA-attention (CPU) compile holds,
    # exceed this lever's whole peak: it was compiled with cuDNN's attention
    assert 0 < compiled[0].peak_bytes < _logits_bytes(4096)
    found = tight.longest_seq
    assert found.pinned and found.seq_len == 2048 and found.compiles == 1
    # the search's compile at 2048 is the independently planned 2048-token step's, byte for byte
    assert found.peak_bytes == h100.memory_per_device.peak_bytes
    assert "Longest sequence that fits" in plan_lib.format_text(tight)


@gpu_compile
def test_the_cli_plans_for_h200_in_a_fresh_process():
    """A fresh `python -m paxlite plan` (JAX not started): the H200's 141 GiB by default."""
    result = subprocess.run(
        [sys.executable, "-m", "paxlite", "plan", f"--fdl_config={EXPERIMENT}",
         *(f"--fdl.{a}" for a in (*CUDNN, "MAX_SEQ_LEN=256")), "--devices=2", "--target=h200"],
        capture_output=True, text=True, cwd=REPO, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    gib = GPU_SPECS[CompileTarget.H200].memory_bytes / 2**30
    assert f"Verdict: fits in {gib:,.2f} GiB" in result.stdout, result.stdout
    assert "compiled for h200 by XLA's GPU compiler" in result.stdout
    assert "__cudnn$fmha" in result.stdout and "compiler not available" in result.stdout


# ------------------------------------------------------------------------------------------------
# No plugin needed


def test_a_gpu_target_plans_here_or_in_a_process_on_the_cpu_platform():
    # this process runs JAX on 8 CPU devices: compile-only GPUs need no more of them
    assert plan_lib.prepare_this_process(512, target="h100")
    assert not plan_lib.prepare_this_process(512)
    env = plan_lib.fake_device_env(512, {"XLA_FLAGS": "--a=1"}, target="h100")
    assert env == {"XLA_FLAGS": "--a=1", "JAX_PLATFORMS": "cpu"}
    request = plan_lib.PlanRequest(name="TinySynthetic", num_devices=16, target="H200")
    command = plan_lib.plan_command_line(request, output_format=plan_lib.OutputFormat.JSON)
    assert "--target=h200" in command  # and the target's own memory: none passed
    assert not any(arg.startswith(("--device_memory_gib", "--peak_tflops")) for arg in command)


def test_a_bad_target_is_one_line_naming_the_valid_ones(capsys):
    with pytest.raises(UserError, match=r"--target='tpu': expected one of cpu, h100, h200, a100"):
        plan_lib.PlanRequest(name="TinySynthetic", num_devices=8, target="tpu")
    assert cli.main(["plan", "--fdl_config=TinySynthetic", "--devices=8", "--target=tpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [("paxlite: error: --target='tpu': expected one of cpu, h100, h200, a100, or a "
                    "TPU slice v4-N, v5e-N, v5p-N, v6e-N (e.g. v5e-8) or topology (e.g. v5e:2x4); "
                    "did you mean 'v5e-8'?")]


def test_a_gpu_target_without_the_plugin_is_one_line_and_exit_2():
    """`python -m paxlite plan` where JAX's CUDA plugin is not installed (`make install` alone): the
    plugin's directory off PYTHONPATH, and its package hidden in case the venv holds it itself."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    without_plugin = ("import runpy, sys; sys.modules['jax_plugins'] = None; "
                      "sys.argv[0] = 'paxlite'; runpy.run_module('paxlite', run_name='__main__')")
    result = subprocess.run(
        [sys.executable, "-c", without_plugin, "plan", "--fdl_config=TinySynthetic", "--devices=2",
         "--target=h100"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(
        "paxlite: error: compiling for a GPU without one needs JAX's CUDA plugin"), lines[0]
    assert "pip install 'jax[cuda12]==" in lines[0] and result.stdout == ""
