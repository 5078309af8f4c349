"""Compile-only GPUs from JAX's CUDA plugin (paxlite/parallel/compile_targets/gpu.py): what they
are, and that the models' kernel choices see the target's platform, not this process's CPU
backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from paxlite.models.attention_kernels import AttentionImplementation, resolve_implementation
from paxlite.parallel.compile_targets import (
    CompileTarget,
    GpuTopology,
    compile_platform,
    gpu_devices,
)
from paxlite.parallel.compiled_kernels import custom_calls

pytestmark = pytest.mark.gpu_compile


def test_a_topology_has_its_hosts_and_gpus():
    devices = gpu_devices(CompileTarget.H100, GpuTopology.parse("1x2x8"))
    assert len(devices) == 16
    assert {d.platform for d in devices} == {"gpu"}
    assert {d.device_kind for d in devices} == {"NVIDIA H100 80GB HBM3"}
    assert sorted({d.process_index for d in devices}) == [0, 1]  # one process per host
    assert jax.default_backend() == "cpu"  # the process's own backend is untouched


@pytest.mark.parametrize(("target", "capability", "head_dim", "chosen"), [
    # A real Hopper takes up to 256 per head, but JAX checks the limit against this process's
    # devices, which a compile-only target is not: 128 here, whatever the target
    # (test_cudnn_head_dims_past_128_do_not_compile_for_a_gpu_this_process_lacks)
    (CompileTarget.H100, "9.0", 256, AttentionImplementation.XLA),
    (CompileTarget.H100, "9.0", 192, AttentionImplementation.XLA),  # DeepSeek's MLA heads
    (CompileTarget.H100, "9.0", 128, AttentionImplementation.CUDNN),
    (CompileTarget.A100, "8.0", 256, AttentionImplementation.XLA),  # 128 before Hopper
    (CompileTarget.A100, "8.0", 128, AttentionImplementation.CUDNN),
])
def test_the_kernel_choice_reads_the_targets_platform(target, capability, head_dim, chosen):
    mesh = Mesh(np.array(gpu_devices(target, GpuTopology(gpus_per_host=8))), ("data",))
    seen = {}

    def probe(x):
        seen["platform"] = compile_platform()
        seen["choice"] = resolve_implementation(
            AttentionImplementation.AUTO, dtype=jnp.bfloat16, head_dim=head_dim, seq_len=1024,
            dense_bias=False, has_bias=False)
        return x

    with jax.set_mesh(mesh):
        jax.jit(probe).lower(jax.ShapeDtypeStruct((8,), jnp.float32)).compile()
    assert seen == {"platform": ("gpu", capability), "choice": chosen}


def test_cudnn_attention_compiles_to_cudnns_fused_kernels():
    mesh = Mesh(
        np.array(gpu_devices(CompileTarget.H200, GpuTopology(gpus_per_host=8))).reshape(4, 2),
        ("data", "heads"),
    )
    spec = jax.ShapeDtypeStruct((8, 512, 8, 128), jnp.bfloat16,
                                sharding=NamedSharding(mesh, PartitionSpec("data", None, "heads")))

    def loss(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn").sum()

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, spec, spec).compile()
    assert custom_calls(compiled.as_text()) == {"__cudnn$fmhaSoftmax": 1,
                                                "__cudnn$fmhaSoftmaxBackward": 1}



def test_cudnn_head_dims_past_128_do_not_compile_for_a_gpu_this_process_lacks():
    """Why AUTO picks XLA above 128 per head on a compile-only GPU (and a named 'cudnn' is
    refused there): JAX's cuDNN attention checks Hopper's 256 against the local devices, so 192
    (DeepSeek's latent-attention heads) fails for an H100 compiled for on a CPU host. When JAX
    checks the target instead, this fails, and the limit in attention_kernels can go."""
    mesh = Mesh(np.array(gpu_devices(CompileTarget.H100, GpuTopology(gpus_per_host=8))), ("data",))
    spec = jax.ShapeDtypeStruct((8, 256, 4, 192), jnp.bfloat16,
                                sharding=NamedSharding(mesh, PartitionSpec("data")))

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    with pytest.raises(NotImplementedError, match="head dim must be <= 128"):
        jax.jit(attend).lower(spec, spec, spec).compile()
