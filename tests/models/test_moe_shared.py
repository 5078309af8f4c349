"""Shared experts and dense first layers (``MoeConfig.shared_expert_hidden_dims``,
``first_moe_layer``): the layer against a float64 NumPy reference, where the MoE layers sit, the
refusals, and a model with both trained on an expert x fsdp x tensor mesh equal to one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import AxisType

from paxlite.models.moe import MoeMlp
from paxlite.models.moe_config import MoeConfig, MoeRouting
from paxlite.models.moe_params import closed_form_num_params
from paxlite.models.parallel_config import PipelineConfig
from paxlite.models.transformer import (
    LLAMA_ARCHITECTURE,
    Transformer,
    TransformerConfig,
    logical_param_axes,
    num_params,
)
from paxlite.parallel.rules import DEFAULT_RULES, batch_sharding, logical_to_shardings
from tests.models.test_moe import _np_expert, _silu
from tests.models.test_seq_parallel_transformer import AXES, random_params

D, F, E, SHARED = 8, 12, 4, 10
MOE = MoeConfig(num_experts=E, experts_per_token=2, routing=MoeRouting.DROPLESS_TOPK,
                gated_experts=True, expert_activation="silu", shared_expert_hidden_dims=SHARED)


def test_shared_expert_layer_matches_numpy():
    x = jax.random.normal(jax.random.key(0), (3, 5, D), jnp.float32)
    layer = MoeMlp(config=MOE, hidden_dims=F, init_std=0.3)
    params = nn.meta.unbox(layer.init({"params": jax.random.key(1)}, x)["params"])
    assert set(params["shared_expert"]) == {"wi", "wi_gate", "wo"}
    assert params["shared_expert"]["wi"]["kernel"].shape == (D, SHARED)
    y = np.asarray(layer.apply({"params": params}, x), np.float64).reshape(-1, D)

    xs = np.asarray(x, np.float64).reshape(-1, D)
    router = np.asarray(params["router"]["kernel"], np.float64)
    shared = {k: np.asarray(v["kernel"], np.float64) for k, v in params["shared_expert"].items()}
    want = np.zeros_like(xs)
    for n, tok in enumerate(xs):
        logits = tok @ router
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs)[:2]
        for weight, e in zip(probs[top] / probs[top].sum(), top):
            want[n] += weight * _np_expert(tok, params, e, gated=True, act=_silu)
        want[n] += (_silu(tok @ shared["wi_gate"]) * (tok @ shared["wi"])) @ shared["wo"]
    np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("first, interval, want", [
    (0, 1, [0, 1, 2, 3, 4]), (0, 2, [0, 2, 4]), (3, 1, [3, 4]), (1, 2, [1, 3]), (2, 2, [2, 4]),
])
def test_moe_layer_placement(first, interval, want):
    cfg = MoeConfig(num_experts=E, routing="dropless_topk", first_moe_layer=first,
                    moe_layer_interval=interval)
    assert [i for i in range(5) if cfg.is_moe_layer(i)] == want
    assert cfg.num_moe_layers(5) == len(want)


@pytest.mark.parametrize("changes, message", [
    ({"first_moe_layer": -1}, "first_moe_layer=-1 must be an integer >= 0"),
    ({"first_moe_layer": True}, "first_moe_layer=True must be an integer >= 0"),
    ({"shared_expert_hidden_dims": 0}, "shared_expert_hidden_dims=0 must be a positive integer"),
])
def test_bad_values_are_one_clear_error(changes, message):
    with pytest.raises(ValueError, match=message):
        MoeConfig(num_experts=E, routing="dropless_topk", **changes)


T, B = 8, 4
MODEL = TransformerConfig(
    vocab_size=32, num_layers=3, model_dims=16, num_heads=4, dims_per_head=4, hidden_dims=24,
    max_seq_len=T, tie_embeddings=False, **LLAMA_ARCHITECTURE,
    moe=MoeConfig(num_experts=4, experts_per_token=2, routing="dropless_topk",
                  gated_experts=True, expert_activation="silu", expert_hidden_dims=8,
                  shared_expert_hidden_dims=12, first_moe_layer=1))


def test_dense_first_layers_in_the_model_and_its_count():
    params = nn.meta.unbox(jax.eval_shape(
        lambda: Transformer(MODEL).init({"params": jax.random.key(0)},
                                        jnp.zeros((1, T), jnp.int32)))["params"])
    assert ["mlp" in params[f"layers_{i}"] for i in range(3)] == [True, False, False]
    assert ["moe" in params[f"layers_{i}"] for i in range(3)] == [False, True, True]
    assert "shared_expert" in params["layers_1"]["moe"]
    assert closed_form_num_params(MODEL) == num_params(MODEL)


@pytest.mark.parametrize("changes", [{"scan_layers": True},
                                     {"pipeline": PipelineConfig(num_stages=3)}])
def test_dense_first_layers_refuse_a_scan(changes):
    with pytest.raises(ValueError, match="first_moe_layer=1 needs scan_layers=False"):
        TransformerConfig(**{**{f: getattr(MODEL, f) for f in (
            "vocab_size", "num_layers", "model_dims", "num_heads", "dims_per_head",
            "hidden_dims", "max_seq_len", "moe")}, **changes})


def _loss(params, tokens):
    logits = Transformer(MODEL).apply({"params": params}, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def test_training_on_a_mesh_equals_one_device():
    params = random_params(MODEL, seed=3)
    tokens = np.random.default_rng(0).integers(0, 32, size=(B, T + 1)).astype(np.int32)
    want_loss, want_grads = jax.jit(jax.value_and_grad(_loss))(params, tokens)
    shape = (1, 1, 2, 1, 2, 2)  # fsdp 2, tensor 2, expert 2
    mesh = jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES),
                         devices=jax.devices()[:8])
    shardings = logical_to_shardings(logical_param_axes(MODEL), mesh, DEFAULT_RULES,
                                     shapes=params)
    sharded = jax.device_put(params, shardings)
    rows = jax.device_put(tokens, batch_sharding(mesh))
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        loss, grads = jax.jit(jax.value_and_grad(_loss))(sharded, rows)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-5)
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want_grads))
    for path, got in jax.tree_util.tree_leaves_with_path(grads):
        np.testing.assert_allclose(got, flat_want[path], rtol=1e-5, atol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))
    assert any("shared_expert" in jax.tree_util.keystr(p) for p in flat_want)
