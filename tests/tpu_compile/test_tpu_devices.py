"""Compile-only TPU chips from libtpu (paxlite/parallel/compile_targets/tpu.py): what each
generation's devices are, that the chip table names them as JAX does, and that a model built on
them sees a TPU: its kernel choices, and a Pallas kernel compiled by Mosaic named in the plan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from paxlite.experiments.build import load_experiment
from paxlite.models.attention_kernels import AttentionImplementation, resolve_implementation
from paxlite.parallel.compile_targets import CompileTarget, compile_platform, tpu_devices
from paxlite.planner import plan as plan_lib
from paxlite.train import flops


@pytest.mark.parametrize(("target", "device_kind", "chips"), [
    ("v4-8", "TPU v4", 4),  # megacore: one device per chip of two TensorCores
    ("v5e-8", "TPU v5 lite", 8),
    ("v5p-16", "TPU v5", 8),
    ("v6e-4", "TPU v6 lite", 4),
    ("v5e-256", "TPU v5 lite", 256),
])
def test_a_slice_is_its_chips_in_one_process_named_as_the_table_names_them(target, device_kind,
                                                                           chips):
    target = CompileTarget.parse(target)
    devices = tpu_devices(target.tpu)
    assert len(devices) == chips == target.num_devices
    assert {d.platform for d in devices} == {"tpu"}
    assert {d.device_kind for d in devices} == {device_kind} == {target.device_kind}
    assert {d.process_index for d in devices} == {0}  # the slice is one ICI domain
    # MFU's peak of this device kind is the target's (one table: compile_targets/chips.py)
    assert flops.peak_flops_per_device(devices[0].device_kind) == target.peak_tflops * 1e12
    assert jax.default_backend() == "cpu"  # the process's own backend is untouched


def test_the_models_see_a_tpu_on_a_compile_only_mesh():
    mesh = Mesh(np.array(tpu_devices(CompileTarget.parse("v5e-4").tpu)), ("data",))
    seen = {}

    def probe(x):
        seen["platform"] = compile_platform()
        seen["auto"] = resolve_implementation(
            AttentionImplementation.AUTO, dtype=jnp.bfloat16, head_dim=128, seq_len=1024,
            dense_bias=False, has_bias=False)
        return x

    with jax.set_mesh(mesh):
        jax.jit(probe).lower(jax.ShapeDtypeStruct((8,), jnp.float32)).compile()
    assert seen == {"platform": ("tpu", None), "auto": AttentionImplementation.XLA}


def test_splash_attention_compiles_to_mosaic_kernels_the_plan_names():
    overrides = ("ATTENTION_IMPLEMENTATION='splash'", "MAX_SEQ_LEN=512", "DIMS_PER_HEAD=128",
                 "NUM_HEADS=2", "MODEL_DIMS=256")
    plan = plan_lib.plan_experiment(load_experiment("TinySynthetic", overrides), num_devices=1,
                                    target="v5e-1", longest_seq="off")
    kernels = plan.program.kernels
    # two layers: the forward kernel and the two backward ones (dq, dkv) for each
    splash = {name: n for name, n in kernels.items() if name.startswith("tpu_custom_call:splash")}
    assert sorted(splash.values()) == [2, 2, 2], kernels
    assert plan.attention_kernel == "splash" and plan.attention_logits_bytes_per_layer is None
    assert plan.attention_note is None
