"""`python -m paxlite plan --target=v5e-8`: a run's train step compiled by the TPU compiler for a
compile-only slice, on this CPU-only machine (libtpu on PYTHONPATH: conftest.py).

What the plan says is checked against independent figures: the CPU plan of the same run (the
state's exact bytes, the per-device FLOPs of XLA's cost analysis, a peak of the same order), the
chip's HBM as the compiler states it, and, for a run too big for a v5e chip (which the TPU
compiler refuses to compile), the same program compiled for a v6e chip, which has room for it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from paxlite.experiments.build import load_experiment
from paxlite.parallel.compile_targets import CompileTarget
from paxlite.planner import plan as plan_lib
from paxlite.planner.results import TPU_PEAK_FORMULA, Plan

GIB = 2**30
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPERIMENT = "TinySynthetic"
# 2 layers of 4 heads x 64 (lane-sized, so the TPU's layout pads little), 2 rows of 128 tokens
# on each device.
TINY = ("NUM_LAYERS=2", "MODEL_DIMS=256", "HIDDEN_DIMS=1024", "NUM_HEADS=4", "DIMS_PER_HEAD=64",
        "VOCAB_SIZE=1024", "MAX_SEQ_LEN=128", "PERCORE_BATCH_SIZE=2")
# One layer whose float32 state is 16 bytes a parameter (weights, two Adam moments, gradients):
# the vocabulary sets the size. 65,536: 0.14B parameters, 2 GiB; 524,288: 1.08B, 16 GiB.
BIG = ("NUM_LAYERS=1", "MODEL_DIMS=2048", "PERCORE_BATCH_SIZE=1", "ICI_MESH_SHAPE=[1,1,1]")


def _plan(overrides, *, target: str, num_devices: int) -> Plan:
    return plan_lib.plan_experiment(load_experiment(EXPERIMENT, overrides),
                                    num_devices=num_devices, target=target, longest_seq="off")


@pytest.fixture(scope="module")
def cpu() -> Plan:
    return _plan(TINY, target="cpu", num_devices=8)


@pytest.fixture(scope="module")
def v5e_8() -> Plan:
    return _plan(TINY, target="v5e-8", num_devices=8)


@pytest.fixture(scope="module")
def v5e_1() -> Plan:
    return _plan(TINY, target="v5e-1", num_devices=1)


def test_the_plan_says_which_chip_and_slice_and_takes_its_hbm_and_peak(v5e_8, v5e_1):
    assert (v5e_8.compiled_for, v5e_8.topology, v5e_8.num_devices) == ("v5e-8", "v5e:2x4", 8)
    assert (v5e_1.compiled_for, v5e_1.topology, v5e_1.num_devices) == ("v5e-1", "v5e:1x1", 1)
    # the HBM a v5e chip gives a program: 15.75 GiB, as the compiler says when one does not fit
    assert v5e_8.device_memory_bytes == int(15.75 * GIB) and v5e_8.verdict.fits
    assert v5e_8.peak_tflops_per_device == 197.0
    # no XLA preset, no option: a GPU preset's flags and optimization level never reach a TPU
    assert v5e_8.program.xla_preset is None and v5e_8.program.compiler_options == {}
    assert v5e_8.program.fp8_gemms is None and v5e_8.gpu_program is None
    assert v5e_8.refused is None and v5e_8.peak_formula == TPU_PEAK_FORMULA
    text = plan_lib.format_text(v5e_8)
    assert ("compiled for v5e-8 (topology v5e:2x4, 8 chips of TPU v5 lite) by the TPU compiler"
            in text)
    assert "Verdict: fits in 15.75 GiB" in text and "197 TFLOP/s per device" in text
    round_trip = Plan.from_json(json.loads(json.dumps(v5e_8.to_json())))
    assert round_trip == v5e_8 and round_trip.compiled_for.tpu.chips == 8


def test_the_memory_agrees_with_the_cpu_plan_where_it_must(cpu, v5e_8, v5e_1):
    for tpu in (v5e_8, v5e_1):
        tpu_memory, cpu_memory = tpu.memory_per_device, cpu.memory_per_device
        # the state's bytes follow from shapes and shardings alone
        assert tpu_memory.state_bytes == cpu_memory.state_bytes > 0
        assert tpu_memory.parameter_bytes == cpu_memory.parameter_bytes
        # the TPU's arguments are the same shards, padded to its tiles: never fewer bytes
        assert cpu_memory.argument_bytes <= tpu_memory.argument_bytes < 1.05 * (
            cpu_memory.argument_bytes)
        # the donated state's outputs are its arguments' buffers
        assert tpu_memory.output_bytes - tpu_memory.alias_bytes < 2**20
        assert tpu_memory.alias_bytes >= tpu_memory.state_bytes - tpu_memory.gradient_bytes
        # other fusion and buffer assignment, the same program: the same order of bytes (the
        # TPU's peak is its compiler's own, the CPU's the sum of its memory analysis)
        assert 0.5 < tpu_memory.peak_bytes / cpu_memory.peak_bytes < 2.0, (tpu_memory, cpu_memory)
        assert tpu_memory.peak_bytes >= tpu_memory.argument_bytes
        # XLA's cost analysis counts the same per-device work on both compilers
        cpu_flops, tpu_flops = (p.flops_per_step.compiler_per_device for p in (cpu, tpu))
        assert tpu_flops == pytest.approx(cpu_flops, rel=0.01)
    # data parallel: each device of v5e-8 holds what the one chip of v5e-1 holds, and a gradient
    # all-reduce
    assert v5e_8.memory_per_device.peak_bytes == pytest.approx(
        v5e_1.memory_per_device.peak_bytes, rel=0.1)


@pytest.fixture(scope="module")
def too_big() -> Plan:
    return _plan((*BIG, "VOCAB_SIZE=524288"), target="v5e-1", num_devices=1)


def test_the_verdict_flips_when_the_run_outgrows_the_chip(too_big):
    fits = _plan((*BIG, "VOCAB_SIZE=65536"), target="v5e-1", num_devices=1)
    assert fits.verdict.fits and fits.refused is None
    assert not too_big.verdict.fits and too_big.verdict.margin_bytes < 0
    # The TPU compiler refused it and said how much it needs: the plan's peak, to 0.01 GiB
    refused = too_big.refused
    assert refused.available_bytes == round(15.75 * GIB) == too_big.device_memory_bytes
    assert too_big.memory_per_device.peak_bytes == refused.needed_bytes > refused.available_bytes
    assert too_big.program.kernels is None  # nothing compiled, no kernels known
    state = too_big.memory_per_device.state_bytes
    assert 16 * 1.07e9 < state < 16 * 1.09e9  # 16 bytes a parameter, exact from the shapes
    assert "the TPU compiler refused the program: it needs" in plan_lib.format_text(too_big)
    # the levers are planned on the same chip (the remat lever compiled, and refused too)
    remat = next(lever for lever in too_big.levers if "SAVE_NOTHING" in lever.lever)
    assert remat.method == "compiled" and not remat.fits


def test_a_refused_programs_figure_is_what_a_bigger_chip_compiles(too_big):
    """The same step on a v6e chip (31.24 GiB) compiles: the compiler's peak there is the need
    its refusal stated for v5e (16.15 against 16.16 GiB when measured)."""
    v6e = _plan((*BIG, "VOCAB_SIZE=524288"), target="v6e-1", num_devices=1)
    assert v6e.verdict.fits and v6e.refused is None
    assert v6e.memory_per_device.state_bytes == too_big.memory_per_device.state_bytes
    assert v6e.memory_per_device.peak_bytes == pytest.approx(
        too_big.memory_per_device.peak_bytes, rel=0.01)


def test_the_cli_plans_a_tpu_slice_in_a_fresh_process_without_libtpus_warnings():
    """A fresh `python -m paxlite plan` (JAX not started): --devices is the slice's chips."""
    result = subprocess.run(
        [sys.executable, "-m", "paxlite", "plan", f"--fdl_config={EXPERIMENT}",
         *(f"--fdl.{a}" for a in TINY), "--target=v5e-4", "--format=json"],
        capture_output=True, text=True, cwd=REPO, timeout=600, check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("TPU_")})
    assert result.returncode == 0, result.stderr[-3000:]
    plan = Plan.from_json(json.loads(result.stdout))
    assert (plan.compiled_for, plan.num_devices, plan.topology) == ("v5e-4", 4, "v5e:2x2")
    assert "TPU_ACCELERATOR_TYPE" not in result.stderr and "TPU_WORKER" not in result.stderr


def test_a_v5p_slice_counts_tensorcores_and_plans_its_chips():
    plan = _plan(TINY, target="v5p-8", num_devices=4)
    assert (plan.compiled_for, plan.topology, plan.mesh.data) == ("v5p-8", "v5p:2x2x1", 4)
    assert plan.device_memory_bytes == int(95.73 * GIB) and plan.peak_tflops_per_device == 459.0
    assert isinstance(plan.compiled_for, CompileTarget) and plan.verdict.fits
