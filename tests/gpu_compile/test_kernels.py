"""What XLA's GPU compiler makes of paxlite's train steps: attention and FP8 kernels on 8 H100s.

Every program here is the real train step of a run (`planner.search.compile_train_step`: the run's
mesh, its XLA preset as compile options, the packed batch the planner feeds) compiled for
compile-only H100s, and every assertion is on what only the GPU compiler shows: the cuDNN and
cuBLASLt calls and the Triton GEMMs of the optimized program. A CPU compile has none of them.

The expected counts come from the model, not from a compile: each layer of TinyLLaMA has 7 dense
projections (query, key and value, as GQA keeps them apart; the attention output; wi_gate, wi, wo),
each one GEMM forward and two backward (dgrad, wgrad); each layer has one attention, one cuDNN
call forward and one backward. A scanned stack would show its body once; these stacks are unrolled.

TinyLLaMA at a size cuDNN takes (bfloat16, 64 dims per head) keeps its 4 query / 2 key-value heads.
"""

from __future__ import annotations

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from paxlite.config.errors import ConfigError
from paxlite.experiments.build import load_experiment
from paxlite.models.te_layer import TransformerEngineUnavailableError
from paxlite.parallel.compile_targets import GPU_SPECS, CompileTarget, GpuTopology, gpu_devices
from paxlite.parallel.compiled_kernels import (
    cublaslt_fp8_operand_types,
    custom_calls,
    fp8_gemms,
)
from paxlite.planner.results import StepMeasurement
from paxlite.planner.search import compile_train_step, gpu_compile_options

gpu_compile = pytest.mark.gpu_compile  # each test that compiles (the refusals need no plugin)
LLAMA = "paxlite.experiments.tiny.TinyLLaMA"
NUM_LAYERS = 2
PROJECTIONS_PER_LAYER = 7  # query, key, value, out, wi_gate, wi, wo
GEMMS_PER_FP8_PROJECTION = 3  # forward, dgrad, wgrad
FP8_GEMMS = NUM_LAYERS * PROJECTIONS_PER_LAYER * GEMMS_PER_FP8_PROJECTION
BF16 = ("FPROP_DTYPE='bfloat16'", f"NUM_LAYERS={NUM_LAYERS}", "DIMS_PER_HEAD=64", "MODEL_DIMS=256",
        "HIDDEN_DIMS=512")
CUDNN = (*BF16, "USE_CUDNN_FLASH_ATTENTION=True")
# The batch compile_train_step feeds is packed (segment ids and positions): cuDNN takes the rows'
# segments as a dense mask, so its calls are the bias variants (unpacked rows: `fmhaSoftmax`).
CUDNN_FORWARD = "__cudnn$fmhaScaleBiasSoftmax"
CUDNN_BACKWARD = "__cudnn$fmhaScaleBiasSoftmaxBackward"
H100_BYTES = GPU_SPECS[CompileTarget.H100].memory_bytes


def _compile(*overrides: str,
             compiler_options: dict[str, str] | None = None) -> StepMeasurement:
    return compile_train_step(load_experiment(LLAMA, overrides), num_devices=8, target="h100",
                              compiler_options=compiler_options)


@pytest.fixture(scope="module")
def data():
    return _compile(*CUDNN, "ICI_MESH_SHAPE=[8,1,1]")


@pytest.fixture(scope="module")
def fsdp_fp8():
    """FSDP 8 with cuDNN attention and FP8 projections, with the run's XLA preset (`llama`: its
    --xla_gpu_enable_triton_gemm=false sends every GEMM to cuBLAS)."""
    return _compile(*CUDNN, "USE_FP8=True", "ICI_MESH_SHAPE=[1,8,1]")


@pytest.fixture(scope="module")
def gqa_tensor():
    """data 2 x fsdp 2 x tensor 2: each device holds 2 of the 4 query heads and 1 of the 2 kv."""
    return _compile(*CUDNN, "ICI_MESH_SHAPE=[2,2,2]")


@pytest.fixture(scope="module")
def gqa_tensor4():
    """data 2 x tensor 4, more ways than the 2 kv heads: attention repeats them to 4 so that q, k
    and v split over tensor alike (cuDNN refuses whole kv heads beside split query heads, and any
    split of a head's dimensions)."""
    return _compile(*CUDNN, "ICI_MESH_SHAPE=[2,1,4]")


@pytest.fixture(scope="module")
def fp8_triton():
    """FP8 without the preset (no compile options: XLA's defaults, Triton GEMMs on), one layer.
    Its attention is Pallas's Triton kernel, whose rows split over the 8 data shards: one compile
    for both (the kernel is a custom call, the FP8 GEMMs fusions; each test reads its own)."""
    return _compile(*BF16, "NUM_LAYERS=1", "USE_FP8=True", "ATTENTION_KIND='flash'",
                    "ATTENTION_IMPLEMENTATION='pallas_triton'", "ICI_MESH_SHAPE=[8,1,1]",
                    compiler_options={})


@pytest.fixture(scope="module")
def seq():
    """data 2 x seq 4 (6-entry mesh): flash attention with 'auto', which is XLA's on a seq axis.
    One layer: nothing here is counted per layer."""
    return _compile(*BF16, "NUM_LAYERS=1", "ATTENTION_KIND=flash", "ICI_MESH_SHAPE=[2,1,1,1,1,4]")


def _cudnn_calls(result: StepMeasurement) -> dict[str, int]:
    return {name: n for name, n in result.gpu_program.kernels.items()
            if name.startswith("__cudnn$")}


@gpu_compile
@pytest.mark.parametrize("case", ["data", "fsdp_fp8", "gqa_tensor", "gqa_tensor4"])
def test_cudnn_flash_attention_is_cudnns_fused_kernel_forward_and_backward(case, request):
    result = request.getfixturevalue(case)
    assert result.compiled_for == "h100" and result.gpu_program.xla_preset == "llama"
    # one forward and one backward call per layer, with the packed rows' mask as cuDNN's bias
    assert _cudnn_calls(result) == {CUDNN_FORWARD: NUM_LAYERS, CUDNN_BACKWARD: NUM_LAYERS}
    assert result.gpu_program.kernels["__cublas$lt$matmul"] > 0
    assert 0 < result.memory.peak_bytes < H100_BYTES


@gpu_compile
def test_fsdp_and_tensor_split_the_parameters_of_the_gpu_program(data, fsdp_fp8, gqa_tensor):
    assert data.mesh.data == 8 and fsdp_fp8.mesh.fsdp == 8
    assert (gqa_tensor.mesh.data, gqa_tensor.mesh.fsdp, gqa_tensor.mesh.tensor) == (2, 2, 2)
    # FSDP 8 and fsdp 2 x tensor 2 split the parameters 8 and 4 ways (all but the norms' scales),
    # data parallelism not at all
    params = {case: r.memory.parameter_bytes for case, r in
              (("data", data), ("fsdp", fsdp_fp8), ("tensor", gqa_tensor))}
    assert params["data"] / params["fsdp"] == pytest.approx(8, rel=0.01), params
    assert params["data"] / params["tensor"] == pytest.approx(4, rel=0.01), params


def test_cudnn_on_a_seq_axis_is_one_line_naming_the_alternatives():
    with pytest.raises(ConfigError) as error:
        load_experiment(LLAMA, (*CUDNN, "ICI_MESH_SHAPE=[2,1,1,1,1,4]"))
    message = str(error.value)
    assert "\n" not in message and "seq axis of 4" in message and "'auto' or 'xla'" in message


@gpu_compile
def test_a_seq_axis_compiles_xlas_attention_for_the_gpu(seq):
    assert seq.mesh.seq == 4 and seq.mesh.data == 2
    assert _cudnn_calls(seq) == {}  # each device's attention sees one shard of the queries
    program = seq.gpu_program
    assert program.kernels["__cublas$lt$matmul"] > 0 and program.fp8_gemms["total"] == 0
    assert 0 < seq.memory.peak_bytes < H100_BYTES


@gpu_compile
def test_fp8_projections_are_cublaslt_fp8_gemms_forward_and_backward(fsdp_fp8):
    program = fsdp_fp8.gpu_program
    assert program.compiler_options["xla_gpu_enable_triton_gemm"] == "False"
    assert program.fp8_gemms == {"cublaslt": FP8_GEMMS, "cublas": 0, "triton": 0,
                                 "total": FP8_GEMMS}
    assert program.kernels["__cublas$lt$matmul$f8"] == FP8_GEMMS
    # the rest stays BF16 (docs/fp8.md): the softmax's matmuls
    assert program.kernels["__cublas$lt$matmul"] > 0


@gpu_compile
def test_without_the_preset_fp8_projections_are_triton_fp8_gemms(fp8_triton):
    program = fp8_triton.gpu_program
    assert program.compiler_options == {} and program.xla_preset is None
    gemms = PROJECTIONS_PER_LAYER * GEMMS_PER_FP8_PROJECTION  # one layer
    assert program.fp8_gemms == {"cublaslt": 0, "cublas": 0, "triton": gemms, "total": gemms}
    assert not any(name.startswith("__cublas") for name in program.kernels)


@gpu_compile
def test_pallas_triton_attention_compiles_with_rows_split_over_data(fp8_triton):
    """The step's init once traced the model on one row, which Pallas's per-shard kernel cannot
    split over 8 data shards ("2 does not evenly divide 1" on 2); now one row per batch shard."""
    kernels = fp8_triton.gpu_program.kernels
    assert fp8_triton.mesh.data == 8
    assert any("triton" in name for name in kernels), kernels


def _bare_einsum_programs(compiler_options: dict[str, str]) -> dict[str, str]:
    """The optimized programs of forward + backward of a bare Flax `nn.Fp8Einsum` and of a
    hand-written quantise / dequantise around a BF16 einsum, on 8 H100s (rows over data)."""
    mesh = Mesh(np.array(gpu_devices(CompileTarget.H100, GpuTopology(gpus_per_host=8))), ("data",))
    x = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16,
                             sharding=NamedSharding(mesh, PartitionSpec("data")))
    w = jax.ShapeDtypeStruct(
        (256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec())
    )
    einsum = nn.Fp8Einsum(amax_history_length=4)

    def flax_loss(state, x, w):
        return jnp.sum(einsum.apply(state, "bd,df->bf", x, w).astype(jnp.float32) ** 2)

    def hand_loss(x, w):
        x, w = (a.astype(jnp.float8_e4m3fn).astype(jnp.bfloat16) for a in (x, w))
        return jnp.sum(jnp.einsum("bd,df->bf", x, w).astype(jnp.float32) ** 2)

    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        state = jax.eval_shape(lambda x, w: einsum.init(jax.random.key(0), "bd,df->bf", x, w),
                               x, w)
        state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec())), state)
        return {name: jax.jit(jax.grad(loss, argnums=tuple(range(len(args))))).lower(*args)
                .compile(compiler_options).as_text()
                for name, loss, args in (("flax", flax_loss, (state, x, w)),
                                         ("hand", hand_loss, (x, w)))}


@gpu_compile
def test_a_bare_flax_fp8_einsum_is_the_models_three_gemms_and_a_bf16_dot_of_fp8_values_is_not():
    _, preset = gpu_compile_options(load_experiment(LLAMA, BF16))
    with_preset, without = _bare_einsum_programs(preset), _bare_einsum_programs({})
    # the reference: what each of the model's projections compiles to (forward, dgrad, wgrad)
    assert fp8_gemms(with_preset["flax"])["cublaslt"] == GEMMS_PER_FP8_PROJECTION
    assert custom_calls(with_preset["flax"]) == {"__cublas$lt$matmul$f8": GEMMS_PER_FP8_PROJECTION}
    # forward: activations x weights in e4m3; the two gradient GEMMs take the e5m2 gradient
    assert sorted(cublaslt_fp8_operand_types(with_preset["flax"])) == [
        ("f8e4m3fn", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2"), ("f8e5m2", "f8e4m3fn")]
    assert fp8_gemms(without["flax"]) == {"cublaslt": 0, "cublas": 0,
                                          "triton": GEMMS_PER_FP8_PROJECTION,
                                          "total": GEMMS_PER_FP8_PROJECTION}
    # values rounded through FP8 and multiplied in BF16: cuBLASLt's rewriter takes the forward
    # dot's dequantised operands as FP8 (its backward has no FP8 operand); Triton's GEMMs read the
    # FP8 values but convert them before the dot, which is no FP8 GEMM
    assert fp8_gemms(with_preset["hand"])["cublaslt"] == 1
    fused_gemm_of_fp8 = r"^%fused_computation\.gemm_fusion\S* \(.*f8e4m3fn\["  # an f8 parameter
    assert re.search(fused_gemm_of_fp8, without["hand"], re.MULTILINE)
    assert fp8_gemms(without["hand"])["total"] == 0


@gpu_compile
@pytest.mark.parametrize("case", ["data", "gqa_tensor", "gqa_tensor4", "seq"])
def test_without_use_fp8_there_is_no_fp8_gemm(case, request):
    program = request.getfixturevalue(case).gpu_program
    assert program.fp8_gemms["total"] == 0
    assert not any("f8" in name for name in program.kernels)


def test_enable_te_without_transformer_engine_is_one_line_before_any_compile(monkeypatch):
    # where TE is installed (a GPU image), it is hidden: this is the machine without it
    for module in ("transformer_engine", "transformer_engine.jax", "transformer_engine.common"):
        monkeypatch.setitem(sys.modules, module, None)
    # docs/transformer_engine.md: TE's JAX extension has no wheel, and built from source it cannot
    # be imported without the NVIDIA driver; the refusal comes at validation, before any mesh
    monkeypatch.setenv("ENABLE_TE", "1")
    with pytest.raises(TransformerEngineUnavailableError) as error:
        _compile(*BF16, "ICI_MESH_SHAPE=[8,1,1]")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("ENABLE_TE=1 but Transformer Engine cannot be imported")
    assert "nvcr.io/nvidia/jax" in message
