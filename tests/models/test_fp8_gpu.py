"""GPU: an FP8 train step really runs cuBLASLt FP8 GEMMs (run with JAX_PLATFORMS=cuda,cpu).

XLA turns a dot into the FP8 GEMM only when its operands trace straight back to f8 values through
the ops its pattern allows (docs/fp8.md); anything else silently leaves a BF16 GEMM. So the
check counts the FP8 custom calls in the optimised HLO of the whole train step: one forward and two
backward GEMMs for each of the 4 FP8 matmuls (qkv, attention output, wi, wo) of every layer.
"""

from __future__ import annotations

import fiddle as fdl
import jax
import pytest

from paxlite.data.synthetic import SyntheticData
from paxlite.experiments.build import load_experiment
from paxlite.models.transformer import Transformer
from paxlite.parallel.compiled_kernels import cublaslt_fp8_operand_types
from paxlite.parallel.mesh import MeshConfig, build_mesh
from paxlite.train.optimizer import make_optimizer
from paxlite.train.schedules import make_schedule
from paxlite.train.step import compile_steps

NUM_LAYERS = 2
# cuBLASLt FP8 needs the GEMM dimensions in multiples of 16: every size here is.
OVERRIDES = (
    "USE_FP8=true",
    "FPROP_DTYPE=bfloat16",
    f"NUM_LAYERS={NUM_LAYERS}",
    "MODEL_DIMS=128",
    "HIDDEN_DIMS=512",
    "NUM_HEADS=4",
    "DIMS_PER_HEAD=32",
    "VOCAB_SIZE=256",
    "MAX_SEQ_LEN=64",
)


@pytest.mark.gpu
def test_fp8_train_step_compiles_to_cublaslt_fp8_gemms():
    run = fdl.build(load_experiment("TinySynthetic", list(OVERRIDES)).run_config())
    mesh = build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1)), devices=jax.devices("gpu")[:1])
    schedule = make_schedule(run.schedule)
    with jax.set_mesh(mesh):
        steps = compile_steps(model=Transformer(run.model),
                              optimizer=make_optimizer(run.optimizer, schedule), schedule=schedule,
                              mesh=mesh, seq_len=run.data.seq_len, seed=0, deterministic=True)
        batch = SyntheticData(run.data, global_batch_size=8).train_batch(0, steps.batch_sharding)
        hlo = steps.train.lower(steps.abstract_state, batch).compile().as_text()
    matmuls = 4 * NUM_LAYERS
    # operands' types, wherever the HLO text prints them
    fp8_gemms = cublaslt_fp8_operand_types(hlo)
    forward = [types for types in fp8_gemms if types == ("f8e4m3fn", "f8e4m3fn")]
    assert len(forward) >= matmuls, (
        f"{len(forward)} e4m3 x e4m3 FP8 GEMMs for {matmuls} FP8 matmuls: some forward matmul "
        "stayed BF16")
    assert len(fp8_gemms) >= 3 * matmuls, (
        f"{len(fp8_gemms)} FP8 GEMMs, expected forward + 2 backward for each of {matmuls} matmuls")
