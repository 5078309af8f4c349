"""Mixture-of-experts and pipelined train steps compiled by XLA's GPU compiler for 8 H100s.

The real train step of each run (`planner.search.compile_train_step`, with the run's XLA preset)
compiles for compile-only H100s, and what is asserted is the GPU compiler's: cuDNN's attention
calls and cuBLASLt's GEMMs in the optimized program, and the GPU's buffer assignment holding the
state whose size follows from shapes and shardings alone. GLaM routes with GShard (dispatch and
combine einsums), Mixtral dropless (a grouped matmul, `ragged_dot`); the pipelines are GPipe and
the circular schedule on a 5-entry [data, fsdp, tensor, expert, pipeline] mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from paxlite.config.errors import ConfigError
from paxlite.experiments.build import load_experiment
from paxlite.parallel.compile_targets import GPU_SPECS, CompileTarget, GpuTopology, gpu_devices
from paxlite.planner.results import StepMeasurement
from paxlite.planner.search import compile_train_step

pytestmark = pytest.mark.gpu_compile
TINY = "paxlite.experiments.tiny."
H100_BYTES = GPU_SPECS[CompileTarget.H100].memory_bytes
CUDNN = ("FPROP_DTYPE='bfloat16'", "USE_CUDNN_FLASH_ATTENTION=True")
# The planner's batch is packed (segment ids): cuDNN takes the segments as a dense mask (a bias).
CUDNN_FORWARD = "__cudnn$fmhaScaleBiasSoftmax"
CUDNN_BACKWARD = "__cudnn$fmhaScaleBiasSoftmaxBackward"
PIPELINE = ("FPROP_DTYPE='bfloat16'", "USE_REPEATED_LAYER=True", "NUM_MICROBATCHES=2",
            "ICI_MESH_SHAPE=[4,1,1,1,2]")
# Flash attention with 'auto' at a size cuDNN takes (64 dims per head): outside a pipeline it would
# be cuDNN's, inside the stages on packed rows it is XLA's (the pipelines below are compiled so)
AUTO_FLASH = ("ATTENTION_KIND='flash'", "DIMS_PER_HEAD=64", "MODEL_DIMS=256")


def _compile(name: str, *overrides: str) -> StepMeasurement:
    return compile_train_step(load_experiment(TINY + name, overrides), num_devices=8, target="h100")


@pytest.fixture(scope="module")
def glam():
    """GShard top-2 over 8 experts on data 2 x expert 4; 2 layers, the first MoE."""
    return _compile("TinyGLaM", *CUDNN, "NUM_LAYERS=2", "ICI_MESH_SHAPE=[2,1,1,4]")


@pytest.fixture(scope="module")
def mixtral():
    """Dropless top-2 over 8 experts on data 2 x expert 4; 2 layers, both MoE."""
    return _compile("TinyMixtral", *CUDNN, "ICI_MESH_SHAPE=[2,1,1,4]")


@pytest.fixture(scope="module")
def gpipe():
    """2 stages of 1 layer on the pipeline axis, data 4, 2 microbatches (flash attention with
    'auto': XLA's, inside the stages)."""
    return _compile("TinyLLaMA", *PIPELINE, *AUTO_FLASH, "NUM_LAYERS=2")


@pytest.fixture(scope="module")
def circular():
    """The circular schedule: 4 layers as 2 stages x PIPELINE_REPEATS=2, 2 microbatches."""
    return _compile("TinyLLaMA", *PIPELINE, *AUTO_FLASH, "NUM_LAYERS=4", "PIPELINE_REPEATS=2")


def _the_gpu_holds_the_state(result: StepMeasurement) -> None:
    memory = result.memory
    # the GPU program's arguments are the state (params, Adam's two moments) and the batch
    assert memory.argument_bytes >= memory.parameter_bytes + memory.optimizer_state_bytes
    assert memory.alias_bytes > 0  # the donated state is updated in place
    assert 0 < memory.peak_bytes < H100_BYTES


@pytest.mark.parametrize("case", ["glam", "mixtral"])
def test_moe_steps_compile_with_cudnn_attention_and_cublaslt_experts(case, request):
    result = request.getfixturevalue(case)
    program = result.gpu_program
    assert result.compiled_for == "h100" and program.xla_preset == "moe"
    assert result.mesh.expert == 4 and result.mesh.data == 2
    assert {k: v for k, v in program.kernels.items() if k.startswith("__cudnn$")} == {
        CUDNN_FORWARD: 2, CUDNN_BACKWARD: 2}  # one attention per layer, forward and backward
    # every matmul (the routed experts', GShard's dispatch and combine, the grouped matmul's
    # expansion) is a library GEMM: the MoE preset turns Triton GEMMs off
    assert program.compiler_options["xla_gpu_enable_triton_gemm"] == "False"
    assert program.kernels["__cublas$lt$matmul"] >= 2 * 3 * 3  # >= 2 layers x 3 matmuls x 3
    assert program.fp8_gemms["total"] == 0
    _the_gpu_holds_the_state(result)


@pytest.mark.parametrize("case", ["gpipe", "circular"])
def test_pipelined_steps_compile_with_each_stages_layers(case, request):
    result = request.getfixturevalue(case)
    assert result.compiled_for == "h100" and result.gpu_program.xla_preset == "llama"
    assert result.mesh.pipeline == 2 and result.mesh.data == 4
    assert result.gpu_program.kernels["__cublas$lt$matmul"] > 0
    assert not any(k.startswith("__cudnn$") for k in result.gpu_program.kernels)
    # the scanned stack's [L, ...] parameters are split over the stages
    assert 0 < result.pipeline_split_parameter_bytes < result.memory.parameter_bytes
    _the_gpu_holds_the_state(result)


def test_the_circular_stage_holds_twice_the_gpipe_stages_layers(gpipe, circular):
    # 4 layers over 2 stages against 2 layers over 2 stages: each device holds 2 layers, not 1
    assert circular.pipeline_split_parameter_bytes == 2 * gpipe.pipeline_split_parameter_bytes


def test_jaxs_cudnn_attention_still_refuses_a_head_broadcast_mask_under_vmap():
    """JAX 0.12's cuDNN attention batching rule reshapes a vmapped mask to [B, N, T, S] and fails on
    a [B, 1, T, S] mask (broadcast over heads), as a pipeline's stages give it (jax-ml/jax#34920).
    When this test fails, JAX compiles it: paxlite's refusal (cudnn_problems' vmapped_stages) can
    go."""
    mesh = Mesh(np.array(gpu_devices(CompileTarget.H100, GpuTopology(gpus_per_host=1))), ("data",))
    qkv = jax.ShapeDtypeStruct((2, 4, 256, 4, 64), jnp.bfloat16)  # [stages, B, T, N, H]
    mask = jax.ShapeDtypeStruct((2, 4, 1, 256, 256), jnp.bool_)  # [stages, B, 1, T, S]

    def stage(q, k, v, m):
        return jax.nn.dot_product_attention(q, k, v, mask=m, implementation="cudnn").sum()

    with (jax.sharding.use_abstract_mesh(mesh.abstract_mesh),
          pytest.raises(TypeError, match=r"cannot reshape array of shape \(2, 4, 1, 256, 256\)")):
        jax.jit(jax.vmap(jax.grad(stage, argnums=(0, 1, 2)))).lower(qkv, qkv, qkv, mask).compile()


def test_a_pipeline_refuses_cudnn_on_packed_rows_and_auto_runs_xla_there(gpipe):
    with pytest.raises(ConfigError, match=r"^USE_CUDNN_FLASH_ATTENTION=true cannot run TinyLLaMA: "
                       r"with a mask \(packed rows\) or a logit bias cuDNN cannot run inside a "
                       r"pipeline's stages"):
        load_experiment(TINY + "TinyLLaMA", (*PIPELINE, *CUDNN, "PACKED_INPUT=True",
                                             "DIMS_PER_HEAD=64", "MODEL_DIMS=256"))
    # AUTO (flash kind) on the same packed batch (the gpipe step): XLA's attention inside the
    # stages, no cuDNN call
    kernels = gpipe.gpu_program.kernels
    assert not [name for name in kernels if name.startswith("__cudnn")], kernels
    assert kernels["__cublas$lt$matmul"] > 0


# One dropless MoE layer of 32 experts, 8 on each device (expert 4), bf16: each device sorts
# ep 4 x 2,048 tokens x k 2 = 16,384 rows of D 256 (global batch 16 x 1,024 over 8 batch shards).
DROPLESS_ROWS = ("NUM_LAYERS=1", "NUM_EXPERTS=32", "MAX_SEQ_LEN=1024", "MODEL_DIMS=256",
                 "ICI_MESH_SHAPE=[2,1,1,4]")
# XLA's ragged-dot lowering pads those rows once per local expert: bf16 [8, 16384, 256]
EXPANSION_BYTES = 8 * 16_384 * 256 * 2


def test_the_tiled_grouped_matmul_holds_no_copy_of_the_rows_per_local_expert():
    """The same step with each kernel: ragged_dot's temporaries hold at least one [local experts,
    rows, D] expansion more than the tiled kernel's (models/tiled_grouped_matmul.py), whose
    matmuls are library GEMMs too."""
    steps = {kernel: _compile("TinyMixtral", *CUDNN, *DROPLESS_ROWS,
                              f"MOE_GROUPED_MATMUL={kernel}") for kernel in ("ragged_dot", "tiled")}
    ragged, tiled = (steps[k].memory.temp_bytes for k in ("ragged_dot", "tiled"))
    assert ragged - tiled >= EXPANSION_BYTES, (ragged, tiled)
    assert steps["tiled"].gpu_program.kernels["__cublas$lt$matmul"] > 0
    _the_gpu_holds_the_state(steps["tiled"])
