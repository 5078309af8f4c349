"""Llama 4's layers on their own: the chunk mask and temperature against their definitions, the
sigmoid router against NumPy, the scanned stack (units of a period of 4 with experts on every
layer) equal to the unrolled one, and training a tiny Llama 4 (chunked and NoPE layers, a dense
and a sparse layer) on an 8-device mesh (data x expert, fsdp x tensor x expert) equal to one
device. Against transformers: tests/interop/test_hf_llama4.py."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxlite.models.activations import Activation
from paxlite.models.chunked_attention import chunk_mask, temperature_scale
from paxlite.models.moe_config import MoeConfig, MoeRouting
from paxlite.models.moe_sigmoid_gating import sigmoid_topk_routing
from paxlite.models.open_model_fields import LayerAttention
from paxlite.models.transformer import LLAMA_ARCHITECTURE, Transformer, TransformerConfig
from paxlite.parallel.mesh import MeshConfig, build_mesh
from tests.host_params import random_host_params
from tests.parallel.test_moe_sharded import _loss_and_grads, assert_mesh_matches_one_device

C, N = LayerAttention.CHUNKED, LayerAttention.FULL_NO_ROPE


def test_chunk_mask_and_temperature_by_position():
    positions = jnp.arange(10)[None]
    mask = np.asarray(chunk_mask(positions, positions, chunk=4))[0, 0]
    want = np.array([[i // 4 == j // 4 for j in range(10)] for i in range(10)])
    np.testing.assert_array_equal(mask, want)
    scale = np.asarray(temperature_scale(positions, floor=4, scale=0.5))[0, :, 0, 0]
    np.testing.assert_allclose(scale, [1 + 0.5 * np.log1p((p + 1) // 4) for p in range(10)],
                               rtol=1e-6)


def test_sigmoid_router_against_numpy():
    logits = np.random.default_rng(0).normal(size=(6, 5)).astype(np.float32)
    gates, experts, probs = sigmoid_topk_routing(jnp.asarray(logits), k=2)
    order = np.argsort(-logits, axis=1)[:, :2]
    np.testing.assert_array_equal(experts, order)
    np.testing.assert_allclose(gates, 1 / (1 + np.exp(-np.take_along_axis(logits, order, 1))),
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(probs).sum(-1), 1.0, rtol=1e-6)
    with pytest.raises(ValueError, match="renormalize_top_k=True with routing='sigmoid_topk'"):
        MoeConfig(num_experts=4, routing="sigmoid_topk")


def _llama4(*, num_layers: int, interval: int, first: int, **changes) -> TransformerConfig:
    moe = MoeConfig(num_experts=8, experts_per_token=1, routing=MoeRouting.SIGMOID_TOPK,
                    renormalize_top_k=False, gated_experts=True,
                    expert_activation=Activation.SILU, expert_hidden_dims=32,
                    shared_expert_hidden_dims=32, moe_layer_interval=interval,
                    first_moe_layer=first, load_balancing_weight=0.01)
    types = tuple(N if (i + 1) % 2 == 0 else C for i in range(num_layers))
    return TransformerConfig(
        vocab_size=128, num_layers=num_layers, model_dims=32, num_heads=4, num_kv_heads=2,
        dims_per_head=8, hidden_dims=48, max_seq_len=16, **LLAMA_ARCHITECTURE,
        tie_embeddings=False, rope_theta=5e5, moe=moe, layer_types=types,
        attention_chunk_size=4, qk_l2_norm=True, query_temperature_floor=4,
        query_temperature_scale=0.5, **changes)


def test_scanned_units_equal_the_unrolled_layers():
    from paxlite.interop.layouts import stack_layers

    config = _llama4(num_layers=4, interval=1, first=0)
    scanned = dataclasses.replace(config, scan_layers=True)
    assert scanned.layers_per_scan_unit == 2
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 128, size=(2, 12)), jnp.int32)
    # random host parameters of init's shapes: init itself (threefry) costs 8 s of compiles here
    abstract = jax.eval_shape(Transformer(config).init, jax.random.key(0), tokens)["params"]
    params = random_host_params(nn.meta.unbox(abstract))
    # jitted: one compile each, not one per primitive as an eager apply has
    want = jax.jit(Transformer(config).apply)({"params": params}, tokens)
    got = jax.jit(Transformer(scanned).apply)(
        {"params": stack_layers(params, num_layers=4, unit=2)}, tokens)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)  # the scan reorders sums


@pytest.fixture(scope="module")
def reference():
    # layer 0 dense and chunked, layer 1 sparse and NoPE: every Llama 4 piece in 2 layers; seeded
    # host parameters (init's mesh invariance is tests/parallel/test_moe_sharded.py's)
    config = _llama4(num_layers=2, interval=2, first=1)
    one = build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1)), devices=jax.devices()[:1])
    return config, _loss_and_grads(config, one, random_host_params)


@pytest.mark.parametrize("ici,dcn", [((2, 1, 1, 4), (1, 1, 1)), ((1, 2, 2, 2), (1, 1, 1))],
                         ids=["data2xexpert4", "fsdp2xtensor2xexpert2"])
def test_training_on_expert_meshes_equals_one_device(ici, dcn, reference):
    assert_mesh_matches_one_device(ici, dcn, reference, params=random_host_params)
