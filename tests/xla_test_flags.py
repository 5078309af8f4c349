"""The XLA flags of a test session, for the test processes and every process they start (a test that
wants one CPU device, as on a plain machine, sets XLA_FLAGS to `COMPILE_FLAGS` alone).

`COMPILE_FLAGS` sets LLVM's optimisation level of the CPU backend to 0 (XLA's default is 3). Nearly
all of the suite's time is XLA compiling tiny models on the CPU, and the tiny programs run for
milliseconds, so LLVM's passes cost far more than they save. Only the machine-code generation
changes: the HLO passes (SPMD partitioning, fusion, layout) are the same at every level, so the
sharding bugs the tests look for are compiled as before.

Why 0 and not 1 or 2: at levels 1-3 LLVM contracts a multiply and an add into one fused
multiply-add where its inlining lets it, so two different programs that do the same arithmetic can
round differently. At level 3 the tests' exact comparisons of two programs happen to agree; at
levels 1 and 2 one did not (the LoRA model at initialisation against its base model, 3e-8 apart).
Level 0 contracts nothing: every operation rounds as IEEE arithmetic says, whatever program it sits
in. Results differ from level 3 in the last bits; no test compares with a number recorded at level 3
more tightly than that (the whole suite passes at level 0).

Measured on 2 cores (jax 0.12.0.1, 2026-12-03, `make test`): the suite's summed test time fell from
3090 s (level 3) to 2541 s (level 1) and 2188 s (level 0).
"""

COMPILE_FLAGS = "--xla_backend_optimization_level=0"

# `GPU_COMPILE_FLAGS`, for the programs tests/gpu_compile compiles for H100/H200 with no GPU here:
# XLA's GPU autotuner cannot time a kernel without one, yet its pass (config-assigner) took 14.6 of
# the 18 s of HLO passes of one of the session's programs (fp8_triton). Level 0 skips it. Checked on
# four of the session's programs (data, fsdp_fp8, fp8_triton, gpipe; 2026-12-05): the custom calls,
# FP8 GEMM counts and memory figures were byte-identical with and without it, and a compile's CPU
# seconds fell by 40-47% (16.8 -> 9.6 s for fsdp_fp8). Set in every test process but the GPU pass
# (a CPU compile ignores it).
# `--xla_gpu_disable_gpuasm_optimizations`: ptxas assembles the PTX at -O0 instead of -O3. The
# tests read the compiled HLO (custom calls, fusions, GEMM kinds) and buffer assignment's memory
# figures, which come before ptxas; the machine code's speed is never measured here. The gpu_compile
# session's CPU seconds fell from 134.0 to 119.3 (all 43 tests passing both ways, 2026-12-05).
GPU_COMPILE_FLAGS = "--xla_gpu_autotune_level=0 --xla_gpu_disable_gpuasm_optimizations=true"
