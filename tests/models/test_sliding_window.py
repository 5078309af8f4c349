"""The open-model attention options (sliding window, q/k/v biases, q/k norms, llama3 RoPE scaling):
training on a data/fsdp/tensor mesh equal to one device (1e-5), the fused XLA kernel equal to the
einsums, the window's exact bounds, and one clear refusal where a kernel or strategy cannot run
it. The transformers comparisons are tests/interop/test_hf_open_families.py."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from paxlite.checkpointing.pretrained import model_config_from_json, model_config_to_json
from paxlite.errors import SettingError
from paxlite.models.attention_kernels import AttentionImplementation, flash_attention
from paxlite.models.kernel_masks import sliding_window_mask
from paxlite.models.rotary import RopeScaling
from paxlite.models.transformer import LLAMA_ARCHITECTURE, TransformerConfig, logical_param_axes
from paxlite.parallel.rules import DEFAULT_RULES, batch_sharding, logical_to_shardings
from tests.models.test_seq_parallel_transformer import (
    make_batch,
    make_mesh,
    random_params,
    weighted_cross_entropy,
)

T = 16
OPEN = TransformerConfig(vocab_size=32, num_layers=2, model_dims=16, num_heads=4, num_kv_heads=2,
                         dims_per_head=4, hidden_dims=24, max_seq_len=T, tie_embeddings=True,
                         **LLAMA_ARCHITECTURE, qkv_bias=True, qk_norm=True, sliding_window=5,
                         rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=8))


def test_window_bounds_are_i_minus_window_exclusive():
    positions = jnp.arange(8)[None]
    mask = np.asarray(sliding_window_mask(positions, positions, window=3))[0, 0]
    for i in range(8):
        for j in range(8):
            assert mask[i, j] == (j > i - 3), (i, j)


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(packed: bool):
        if packed not in cache:
            params = random_params(OPEN, seed=7)
            batch = make_batch(packed=packed, seed=int(packed))
            loss, grads = jax.jit(jax.value_and_grad(
                lambda p, b: weighted_cross_entropy(OPEN, p, b)))(params, batch)
            cache[packed] = (params, batch, loss, grads)
        return cache[packed]

    return get


@pytest.mark.parametrize("mesh_shape, packed, flash", [
    ((2, 2, 1, 2), False, False), ((1, 2, 1, 4), True, False), ((2, 1, 1, 2), True, True),
], ids=["d2f2t2", "f2t4-packed", "d2t2-packed-flash_xla"])
def test_training_on_a_mesh_equals_one_device(reference, mesh_shape, packed, flash):
    params, batch, want_loss, want_grads = reference(packed)
    cfg = OPEN
    if flash:
        cfg = dataclasses.replace(cfg, attention_kind="flash", attention_implementation="xla")
    mesh = make_mesh(*mesh_shape)
    # 2 kv heads (and their biases) on a tensor axis of 4 stay whole, as the trainer fits them
    shardings = logical_to_shardings(logical_param_axes(cfg), mesh, DEFAULT_RULES, shapes=params)
    sharded = jax.device_put(params, shardings)
    rows = jax.device_put({k: jnp.asarray(v) for k, v in batch.items()}, batch_sharding(mesh))
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        loss, grads = jax.jit(jax.value_and_grad(
            lambda p, b: weighted_cross_entropy(cfg, p, b)))(sharded, rows)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-5)
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want_grads))
    for path, got in jax.tree_util.tree_leaves_with_path(grads):
        np.testing.assert_allclose(got, flat_want[path], rtol=1e-5, atol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))


def test_the_seq_axis_with_a_window_is_one_setting_error(reference):
    params, batch, _, _ = reference(False)
    mesh = make_mesh(seq=2)
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES), pytest.raises(
            SettingError, match=r"^sliding_window=5 cannot run with sequence parallelism"):
        jax.eval_shape(lambda p, b: weighted_cross_entropy(OPEN, p, b), params, batch)


def test_pallas_triton_refuses_a_window():
    q = jnp.zeros((1, 8, 2, 8), jnp.float32)
    with pytest.raises(SettingError, match="'pallas_triton' cannot run sliding_window=3"):
        flash_attention(q, q, q, implementation=AttentionImplementation.PALLAS_TRITON,
                        sliding_window=3, interpret=True)


@pytest.mark.parametrize("changes, message", [
    (dict(sliding_window=0), "sliding_window=0 must be None"),
    (dict(qkv_bias="yes"), "qkv_bias='yes' must be None"),
    (dict(qk_norm=None), "qk_norm=None must be True or False"),
    (dict(rope_scaling=3), "rope_scaling=3 must be None or a RopeScaling"),
    (dict(rope_scaling={"kind": "dynamic"}), "RopeScaling.kind='dynamic' is not valid"),
    (dict(rope_scaling={"low_freq_factor": 4.0, "high_freq_factor": 1.0}),
     "RopeScaling.high_freq_factor=1.0 must be larger"),
    (dict(attention_kind="flash", attention_implementation="pallas_triton"),
     "sliding_window=5 with attention implementation 'pallas_triton'"),
    (dict(position_embedding="learned"),
     "rope_scaling is set but the position embedding is 'learned'"),
])
def test_invalid_fields_are_one_clear_error(changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        dataclasses.replace(OPEN, **changes)


def test_the_fields_survive_model_config_json():
    text = model_config_to_json(OPEN)
    assert json.loads(text)["rope_scaling"]["kind"] == "llama3"
    assert model_config_from_json(text) == OPEN
