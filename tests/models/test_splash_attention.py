"""The splash kernel on the CPU, interpreted (Pallas' interpreter runs the same kernel program
the chip compiles): forward and gradients against Pax's einsum attention, sharded over a mesh
against one device, and its refusals. tests/models/test_attention_tpu.py runs it compiled on a TPU.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxlite.errors import SettingError
from paxlite.models.attention_kernels import AttentionImplementation, resolve_implementation
from paxlite.models.splash_attention import block_size, padded_length, splash_attention
from paxlite.parallel.mesh import MeshConfig, build_mesh
from paxlite.parallel.rules import DEFAULT_RULES
from tests.models import test_attention_tpu as on_tpu

SMALL = {
    # a length that is not a whole lane (padded to 256), packed rows, grouped kv heads
    "packed_gqa_160": (2, 160, 4, 2, 64, True, None, None),
    # a sliding window and soft-capping in one call
    "window_cap": (1, 128, 2, 2, 64, False, 32, 3.0),
}


@pytest.fixture(autouse=True)
def small_cases(monkeypatch):
    monkeypatch.setattr(on_tpu, "CASES", SMALL)


@pytest.mark.parametrize("case", list(SMALL))
def test_interpreted_splash_equals_einsum_attention(case):
    cpu = jax.devices("cpu")[0]
    out, grads, _ = on_tpu.kernel_run(case, "splash", cpu, interpret=True)
    on_tpu.assert_close((out, grads), on_tpu.reference(case, cpu), rtol=2e-5)


def test_the_comparison_catches_a_wrong_mask():
    # the same kernel without the packed rows' segment ids attends across documents: caught
    cpu = jax.devices("cpu")[0]
    want = on_tpu.reference("packed_gqa_160", cpu)
    SMALL["unpacked"] = (*SMALL["packed_gqa_160"][:5], False, None, None)
    try:
        got = on_tpu.kernel_run("unpacked", "splash", cpu, interpret=True)[:2]
    finally:
        del SMALL["unpacked"]
    with pytest.raises(AssertionError, match="of the largest entry"):
        on_tpu.assert_close(got, want, rtol=2e-5)


def test_sharded_splash_equals_one_device():
    """Batch over `data` and heads over `tensor` (shard_map, each shard its own kernel) against the
    unsharded call, forward and gradients, with grouped kv heads that do not split over the
    tensor axis (one kv head: repeated to every query head first)."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((4, 128, 4, 64)) / 8, jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((4, 128, 1, 64)), jnp.float32) for _ in range(2))
    segments = jnp.asarray(np.repeat([[1] * 50 + [2] * 78], 4, axis=0), jnp.int32)

    def loss(q, k, v):
        out = splash_attention(q, k, v, segment_ids=segments, interpret=True)
        return jnp.sum(out * jnp.arange(out.size, dtype=out.dtype).reshape(out.shape) / out.size)

    with jax.default_matmul_precision("highest"):
        want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
        mesh = build_mesh(MeshConfig(ici_mesh_shape=(2, 1, 2)), devices=jax.devices("cpu")[:4])
        with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
            compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v)
            got = compiled.compile()(q, k, v)
    assert "shard_map" in compiled.as_text() or "sdy.manual_computation" in compiled.as_text()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_lanes_and_blocks():
    assert [padded_length(n) for n in (1, 128, 129, 300, 2048)] == [128, 128, 256, 384, 2048]
    # the largest multiple of 128 up to 512 that divides the padded length
    assert [block_size(n) for n in (128, 384, 640, 2048, 8192)] == [128, 384, 128, 512, 512]


def test_splash_off_a_tpu_is_one_setting_error():
    with pytest.raises(SettingError, match=r"^attention implementation 'splash' cannot run: the "
                                           r"splash attention kernel runs on TPUs, and this job's "
                                           r"JAX backend is 'cpu'") as error:
        resolve_implementation("splash", dtype=jnp.bfloat16, head_dim=128, seq_len=2048,
                               dense_bias=True, has_bias=False, backend="cpu")
    assert "\n" not in str(error.value)
    assert resolve_implementation("splash", dtype=jnp.float32, head_dim=64, seq_len=100,
                                  dense_bias=True, has_bias=False,
                                  backend="tpu") is AttentionImplementation.SPLASH
    with pytest.raises(SettingError, match="takes no logit bias"):
        resolve_implementation("splash", dtype=jnp.float32, head_dim=64, seq_len=100,
                               dense_bias=True, has_bias=True, backend="tpu")


def test_auto_on_a_tpu_runs_xla_attention_and_names_splash():
    assert resolve_implementation("auto", dtype=jnp.bfloat16, head_dim=128, seq_len=2048,
                                  dense_bias=True, has_bias=False,
                                  backend="tpu") is AttentionImplementation.XLA
    from paxlite.models.attention_kernels import auto_choice_message, cudnn_problems

    message = auto_choice_message(cudnn_problems(dtype=jnp.bfloat16, head_dim=128,
                                                 backend="tpu"))
    assert "XLA attention" in message and "'splash'" in message
