"""GPU compile targets without the plugin: topologies, the device descriptions and the compile
options (tests/gpu_compile/test_gpu_target_compile.py compiles with them)."""

import pytest

from paxlite.errors import UserError
from paxlite.parallel import compile_targets as gpu_target
from paxlite.parallel.compile_targets import CompileTarget, GpuTopology


def test_topologies_are_slices_by_hosts_by_gpus():
    assert str(GpuTopology.parse("1x32x8")) == "1x32x8"
    assert GpuTopology.parse("2x4x8").num_devices == 64
    assert GpuTopology.for_devices(256) == GpuTopology(hosts=32, gpus_per_host=8)
    assert GpuTopology.for_devices(4) == GpuTopology(hosts=1, gpus_per_host=4)
    assert GpuTopology.for_devices(16, gpus_per_host=4) == GpuTopology(hosts=4, gpus_per_host=4)
    with pytest.raises(UserError, match=r"--devices=12 is not a whole number of hosts of 8 GPUs"):
        GpuTopology.for_devices(12)
    with pytest.raises(UserError, match=r"expected <slices>x<hosts>x<gpus per host>"):
        GpuTopology.parse("32x8")


def test_targets_parse_with_one_line_naming_the_valid_ones():
    assert CompileTarget.parse("H100") is CompileTarget.H100
    with pytest.raises(UserError, match=r"--target='h800': expected one of cpu, h100, h200, a100"):
        CompileTarget.parse("h800")


def test_the_descriptions_carry_each_parts_published_memory_and_capability():
    # The bytes the CUDA driver reports as total memory for each part.
    assert CompileTarget.H100.spec.memory_bytes == 84_942_979_072
    assert CompileTarget.H200.spec.memory_bytes == 151_397_597_184
    h100 = gpu_target.target_config_text(CompileTarget.H100)
    assert "device_memory_size: 84942979072" in h100 and "core_count: 132" in h100
    assert "major: 9 minor: 0 feature_extension: ACCELERATED_FEATURES" in h100
    a100 = gpu_target.target_config_text(CompileTarget.A100)
    assert "major: 8 minor: 0 feature_extension: NONE" in a100 and "core_count: 108" in a100
    assert gpu_target.spec_for_device_kind("NVIDIA H200").memory_bytes == 151_397_597_184
    with pytest.raises(ValueError, match="no GPU description"):
        _ = CompileTarget.CPU.spec


def test_xla_flags_become_compile_options_in_xlas_spelling():
    options = gpu_target.compiler_options(
        ["--xla_gpu_enable_triton_gemm=false", "--xla_gpu_enable_command_buffer=",
         "--xla_gpu_all_reduce_combine_threshold_bytes=51200", "--not_xla=1"],
        [("JAX_OPTIMIZATION_LEVEL", "O1"), ("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.8")])
    assert options == {"xla_gpu_enable_triton_gemm": "False", "xla_gpu_enable_command_buffer": "",
                       "xla_gpu_all_reduce_combine_threshold_bytes": "51200",
                       "optimization_level": "O1"}


def test_without_the_plugin_one_line_says_what_to_install(monkeypatch):
    import sys

    import jax

    monkeypatch.setitem(sys.modules, "jax_plugins", None)  # as where it is not installed
    assert not gpu_target.plugin_installed()
    problem = gpu_target.plugin_problem()
    assert problem is not None and "\n" not in problem
    assert f"pip install 'jax[cuda12]=={jax.__version__}'" in problem
    with pytest.raises(gpu_target.GpuCompileUnavailableError, match=r"JAX's CUDA plugin"):
        gpu_target.gpu_devices(CompileTarget.H100, GpuTopology(gpus_per_host=8))


def test_without_a_mesh_the_platform_is_this_processs_backend():
    assert gpu_target.compile_platform() == ("cpu", None)
