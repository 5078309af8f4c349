"""Compile targets without any compiler: `--target` parsed once into a CompileTarget (cpu, a GPU
model, a TPU slice), the TPU slices' names and shapes as GCP and AXLearn give them, the one table
of chip facts that MFU and the planner share, and the plan's refusals of a bad target, a device
count that is not the slice's, a memory larger than the chip's. The TPU compiler's own tests are
in tests/tpu_compile/ (libtpu on PYTHONPATH)."""

import json
import pickle
import sys

import pytest

from paxlite import __main__ as cli
from paxlite.errors import UserError
from paxlite.experiments.build import load_experiment
from paxlite.parallel import compile_targets
from paxlite.parallel.compile_targets import TPU_CHIPS, CompileTarget, TargetKind, TpuGeneration
from paxlite.parallel.compile_targets import tpu as tpu_lib
from paxlite.parallel.compiled_kernels import custom_calls
from paxlite.planner import plan as plan_lib
from paxlite.planner import search
from paxlite.train import flops

GIB = 2**30


@pytest.mark.parametrize(("text", "name", "topology", "chips", "instance_type"), [
    ("v5e-1", "v5e-1", "v5e:1x1", 1, "tpu-v5litepod-1"),
    ("v5e-8", "v5e-8", "v5e:2x4", 8, "tpu-v5litepod-8"),
    ("V5E-256", "v5e-256", "v5e:16x16", 256, "tpu-v5litepod-256"),
    ("v5e:4x4", "v5e-16", "v5e:4x4", 16, "tpu-v5litepod-16"),  # a default shape: named by size
    ("tpu-v5litepod-256", "v5e-256", "v5e:16x16", 256, "tpu-v5litepod-256"),  # AXLearn's selector
    ("v5litepod-32", "v5e-32", "v5e:4x8", 32, "tpu-v5litepod-32"),  # GCP's accelerator type
    ("v6e-256", "v6e-256", "v6e:16x16", 256, "tpu-v6e-256"),
    # v4 and v5p count TensorCores, two to a chip: v5p-8 is 4 chips, JAX's 4 devices
    ("v5p-8", "v5p-8", "v5p:2x2x1", 4, "tpu-v5p-8"),
    ("v5p-512", "v5p-512", "v5p:4x8x8", 256, "tpu-v5p-512"),
    ("v4-8", "v4-8", "v4:2x2x1", 4, "tpu-v4-8"),
    ("v4-2048", "v4-2048", "v4:8x8x16", 1024, "tpu-v4-2048"),
    ("v5p:4x4x12", "v5p:4x4x12", "v5p:4x4x12", 192, "tpu-v5p-384"),  # no default of 192 chips
])
def test_tpu_slices_are_named_as_gcp_and_axlearn_name_them(text, name, topology, chips,
                                                           instance_type):
    target = CompileTarget.parse(text)
    assert (target, target.kind, target.tpu.topology) == (name, TargetKind.TPU, topology)
    assert target.num_devices == target.tpu.chips == chips
    assert target.tpu.instance_type == instance_type
    assert CompileTarget.parse(target) is target  # a target is not parsed again
    assert CompileTarget.parse(str(target)) == target
    assert CompileTarget.parse(name).tpu == target.tpu


def test_a_target_is_its_name_with_the_device_it_describes():
    v5e = CompileTarget.parse("v5e-8")
    assert v5e == "v5e-8" and v5e.value == "v5e-8" and json.dumps({"t": v5e}) == '{"t": "v5e-8"}'
    assert (v5e.platform, v5e.device_kind, v5e.compile_only) == ("tpu", "TPU v5 lite", True)
    assert v5e.memory_bytes == int(15.75 * GIB) and v5e.peak_tflops == 197.0
    assert pickle.loads(pickle.dumps(v5e)).tpu == v5e.tpu
    with pytest.raises(AttributeError):
        v5e.kind = TargetKind.CPU
    with pytest.raises(ValueError, match="no GPU description"):
        _ = v5e.spec
    # the GPU models and cpu keep their names, and iterating the type gives them (not the slices)
    assert [t.value for t in CompileTarget] == ["cpu", "h100", "h200", "a100"]
    assert CompileTarget.parse("H200") is CompileTarget.H200 and CompileTarget.H200.is_gpu
    assert CompileTarget.CPU.num_devices is None and CompileTarget.H100.num_devices is None
    assert search.target_defaults(v5e) == (int(15.75 * GIB), 197.0)
    assert search.target_defaults("h100") == (84_942_979_072, 989.0)
    assert search.target_defaults("cpu") == (80 * GIB, 989.0)


@pytest.mark.parametrize(("text", "message"), [
    ("h800", (r"--target='h800': expected one of cpu, h100, h200, a100, or a TPU slice v4-N, "
              r"v5e-N, v5p-N, v6e-N \(e.g. v5e-8\) or topology \(e.g. v5e:2x4\); did you mean "
              r"'h200'\?$")),
    ("tpu", r"expected one of .*; did you mean 'v5e-8'\?$"),
    ("v5p", r"expected one of .*; did you mean 'v5p-8'\?$"),
    ("v5e-7", (r"--target='v5e-7': v5e-N counts chips; N is one of 1, 4, 8, 16, 32, 64, 128, "
               r"256 \(or give a topology, e.g. v5e:16x16\); did you mean 'v5e-8'\?$")),
    ("v5p-4", r"v5p-N counts TensorCores, 2 to a chip; N is one of 8, 16, .*did you mean 'v5p-8'"),
    ("v6e-512", r"did you mean 'v6e-256'\?$"),
    ("v5e:3x3", r"--target='v5e:3x3': v5e slices are 1x1, 2x2, 2x4, .*did you mean 'v5e:2x4'\?$"),
    ("v5p:2x2", r"--target='v5p:2x2': a v5p topology has 3 sizes"),
    ("gpu", r"expected one of cpu, h100, h200, a100, or a TPU slice"),
])
def test_a_bad_target_is_one_line_with_the_valid_forms(text, message):
    with pytest.raises(UserError, match=message) as raised:
        CompileTarget.parse(text)
    assert "\n" not in str(raised.value)


def test_the_chip_table_is_the_one_mfu_reads_and_names_jaxs_device_kinds():
    # JAX's device_kind of each generation (libtpu's topology devices: tests/tpu_compile checks)
    kinds = {generation: chip.device_kind for generation, chip in TPU_CHIPS.items()}
    assert kinds == {TpuGeneration.V4: "TPU v4", TpuGeneration.V5E: "TPU v5 lite",
                     TpuGeneration.V5P: "TPU v5", TpuGeneration.V6E: "TPU v6 lite"}
    published = {"TPU v4": (275e12, None), "TPU v5 lite": (197e12, 394e12),
                 "TPU v5": (459e12, 918e12), "TPU v6 lite": (918e12, 1836e12)}
    for kind, (bf16, int8) in published.items():
        assert flops.peak_flops_per_device(kind) == bf16
        assert flops.peak_int8_ops_per_device(kind) == int8
        assert flops.peak_flops_per_device(kind, fp8=True) is None  # no FP8 matmul units
    # "TPU v5" (v5p) must not take "TPU v5 lite", nor "TPU v4" an unlisted "TPU v4 lite"
    assert flops.peak_flops_per_device("TPU v5e") == 197e12
    assert flops.peak_flops_per_device("tpu v5p") == 459e12
    assert flops.peak_flops_per_device("TPU v4 lite") is None
    # the GPUs as before, from the same table
    assert flops.peak_flops_per_device("NVIDIA H100 80GB HBM3", fp8=True) == 1979e12
    assert flops.peak_flops_per_device("NVIDIA H100 PCIe") == 756e12
    assert flops.peak_flops_per_device("NVIDIA A100-SXM4-80GB", fp8=True) is None
    assert flops.peak_int8_ops_per_device("NVIDIA H100 80GB HBM3") is None
    assert flops.peak_flops_per_device("cpu") is None
    for target in (CompileTarget.H100, CompileTarget.parse("v6e-8")):
        assert target.peak_tflops * 1e12 == flops.peak_flops_per_device(target.device_kind)


def test_the_plan_request_takes_a_tpu_slices_chips_and_refuses_others():
    request = plan_lib.PlanRequest(name="TinySynthetic", target="v5e-8")
    assert request.num_devices == 8 and request.target.tpu.topology == "v5e:2x4"
    v5p = plan_lib.PlanRequest(name="TinySynthetic", target="v5p-8", num_devices=4)
    assert v5p.num_devices == 4
    with pytest.raises(ValueError, match=r"^--devices=4 but --target=v5e-8 is 8 chips \(topology "
                                         r"v5e:2x4\): leave --devices out, or plan "
                                         r"--target=v5e-4$"):
        plan_lib.PlanRequest(name="TinySynthetic", target="v5e-8", num_devices=4)
    with pytest.raises(ValueError, match=r"^--devices is required for --target=h100"):
        plan_lib.PlanRequest(name="TinySynthetic", target="h100")
    with pytest.raises(ValueError, match=r"--device_memory_gib=20.0 is more than the 15.75 GiB of "
                                         r"HBM a v5e chip gives a program"):
        plan_lib.PlanRequest(name="TinySynthetic", target="v5e-1", device_memory_gib=20.0)
    command = plan_lib.plan_command_line(request, output_format=plan_lib.OutputFormat.JSON)
    assert "--target=v5e-8" in command and "--devices=8" in command


@pytest.mark.parametrize(("argv", "line"), [
    (["--devices=4", "--target=v5e-8"], "--devices=4 but --target=v5e-8 is 8 chips"),
    (["--target=v5e-7"], "--target='v5e-7': v5e-N counts chips"),
    (["--target=h100"], "--devices is required for --target=h100"),
])
def test_the_command_line_refuses_in_one_line_before_any_compile(capsys, argv, line):
    assert cli.main(["plan", "--fdl_config=TinySynthetic", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"paxlite: error: {line}"), err


def test_a_tpu_plans_beside_the_cpu_quietly_with_no_gpu_flags():
    env = plan_lib.fake_device_env(8, {"XLA_FLAGS": "--a=1", "TPU_HOST_BOUNDS": "2,2,1"},
                                   target="v5e-8")
    assert env == {"XLA_FLAGS": "--a=1", "JAX_PLATFORMS": "cpu", "TPU_HOST_BOUNDS": "2,2,1",
                   "TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost",
                   "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    assert plan_lib.prepare_this_process(256, target="v5e-256")  # beside 8 CPU devices
    # No preset for a TPU (every preset is a GPU one): no --xla_gpu_* flag, no optimization level
    for name in ("Synthetic126M", "LLaMA7B", "GLaM64B64E", "fuji-7B-v2"):
        target = CompileTarget.parse("v5e-8")
        assert search.compile_options(load_experiment(name), target) == (None, {})


def test_without_libtpu_one_line_says_how_to_install_it(monkeypatch):
    import jax

    monkeypatch.setitem(sys.modules, "libtpu", None)  # as where it is not installed
    problem = compile_targets.compiler_problem(CompileTarget.parse("v5e-8"))
    assert problem is not None and "\n" not in problem
    assert f"pip install 'jax[tpu]=={jax.__version__}'" in problem and "make tpu-compile" in problem
    with pytest.raises(compile_targets.TpuCompileUnavailableError, match="needs libtpu"):
        compile_targets.tpu_devices(CompileTarget.parse("v5e-8").tpu)
    assert compile_targets.compiler_problem(CompileTarget.CPU) is None


def test_the_tpu_compilers_out_of_memory_refusal_is_read():
    # libtpu 0.0.50.1's words (tests/tpu_compile compiles one)
    message = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total "
               "memory required for HLO temporaries (16.16G) exceeds available HBM (15.75G). HLO "
               "module: jit_train_step.")
    assert tpu_lib.hbm_oom(RuntimeError(message)) == (round(16.16 * GIB), round(15.75 * GIB))
    assert tpu_lib.hbm_oom(RuntimeError("INVALID_ARGUMENT: something else")) is None


def test_a_pallas_kernel_on_a_tpu_is_named_by_its_kernel():
    call = '  %{} = f32[8]{{0}} custom-call(%a), custom_call_target="{}"{}'
    pallas = ', metadata={{op_name="jit(train_step)/layers_{}/splash_mha_fwd/pallas_call"}}'
    hlo = "\n".join([call.format("splash_mha_fwd.2", "tpu_custom_call", pallas.format(0)),
                     call.format("splash_mha_fwd.3", "tpu_custom_call", pallas.format(1)),
                     call.format("my_kernel.7", "tpu_custom_call", ""),
                     call.format("g", "AssumeGatherIndicesInBound", "")])
    assert custom_calls(hlo) == {"AssumeGatherIndicesInBound": 1,
                                 "tpu_custom_call:my_kernel": 1,
                                 "tpu_custom_call:splash_mha_fwd": 2}
