"""Gemma 2/3's options on the Transformer (its (1 + w) RMSNorm, post norms, scaled embeddings,
query_pre_attn_scalar, soft-caps, per-layer sliding/global attention with their own RoPE, q/k
norms): training on data/fsdp/tensor meshes equal to one device (1e-5), unrolled, scanned in units
of one pattern period and pipelined; and one clear refusal where a kernel, a scan or a pipeline
cannot run them. The transformers comparisons are tests/interop/test_hf_gemma.py."""

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
from paxlite.models.attention import Attention, AttentionKind
from paxlite.models.attention_kernels import AttentionImplementation
from paxlite.models.norms import GemmaRMSNorm
from paxlite.models.open_model_fields import LayerAttention, layer_pattern_period
from paxlite.models.parallel_config import PipelineConfig
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
S, F = LayerAttention.SLIDING, LayerAttention.FULL
GEMMA = TransformerConfig(
    vocab_size=32, num_layers=4, model_dims=16, num_heads=4, num_kv_heads=2, dims_per_head=4,
    hidden_dims=24, max_seq_len=T, tie_embeddings=True,
    **{**LLAMA_ARCHITECTURE, "norm": "gemma_rms_norm", "activation": "gelu_tanh"},
    post_norms=True, scale_embeddings=True, query_scale_dims=8, attention_logit_cap=2.0,
    final_logit_cap=3.0, qk_norm=True, layer_types=(S, F, S, F), sliding_window=5,
    rope_theta=1e4, local_rope_theta=100.0,
    rope_scaling=RopeScaling(kind="linear", factor=4.0))


def _units(params, *, unit: int, num_layers: int):
    """Unrolled params -> the scanned tree of units of ``unit`` layers (``layers/layer_j``)."""
    out = {k: v for k, v in params.items() if not k.startswith("layers_")}
    out["layers"] = {f"layer_{j}": jax.tree.map(  # stacked on the host: no eager op to compile
        lambda *xs: np.stack(xs), *[params[f"layers_{u * unit + j}"]
                                     for u in range(num_layers // unit)])
        for j in range(unit)}
    return out


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(packed: bool):
        if packed not in cache:
            params = random_params(GEMMA, seed=11)
            batch = make_batch(packed=packed, seed=int(packed))
            loss, grads = jax.jit(jax.value_and_grad(
                lambda p, b: weighted_cross_entropy(GEMMA, p, b)))(params, batch)
            cache[packed] = (params, batch, loss, grads)
        return cache[packed]

    return get


def _assert_same(loss, grads, want_loss, want_grads):
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-5)
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want_grads))
    for path, got in jax.tree_util.tree_leaves_with_path(grads):
        np.testing.assert_allclose(got, flat_want[path], rtol=1e-5, atol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("mesh_shape, packed, scanned", [
    ((2, 2, 1, 2), False, False), ((1, 2, 1, 4), True, False), ((2, 2, 1, 2), True, True),
], ids=["d2f2t2", "f2t4-packed", "d2f2t2-packed-scanned"])
def test_training_on_a_mesh_equals_one_device(reference, mesh_shape, packed, scanned):
    params, batch, want_loss, want_grads = reference(packed)
    cfg = dataclasses.replace(GEMMA, scan_layers=scanned)
    if scanned:  # units of one period: a sliding and a global layer
        assert cfg.layers_per_scan_unit == 2
        params = _units(params, unit=2, num_layers=4)
        want_grads = _units(want_grads, unit=2, num_layers=4)
    mesh = make_mesh(*mesh_shape)
    shardings = logical_to_shardings(logical_param_axes(cfg), mesh, DEFAULT_RULES, shapes=params)
    # Host arrays in: their shards are cut on the host (a device array would be resliced by a
    # small program compiled per shape and mesh).
    sharded = jax.device_put(jax.tree.map(np.asarray, params), shardings)
    rows = jax.device_put(batch, batch_sharding(mesh))
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        loss, grads = jax.jit(jax.value_and_grad(
            lambda p, b: weighted_cross_entropy(cfg, p, b)))(sharded, rows)
    _assert_same(loss, grads, want_loss, want_grads)


def test_a_pipeline_of_whole_periods_equals_the_stack(reference):
    """Two stages of one unit (a sliding and a global layer) each, on the unrolled parameters."""
    params, batch, want_loss, want_grads = reference(False)
    cfg = dataclasses.replace(GEMMA, pipeline=PipelineConfig(num_stages=2))
    loss, grads = jax.jit(jax.value_and_grad(
        lambda p, b: weighted_cross_entropy(cfg, p, b)))(params, batch)
    _assert_same(loss, grads, want_loss, want_grads)


def test_the_options_change_the_function(reference):
    """Each option reaches the logits (a dropped one would leave the loss unchanged)."""
    params, batch, want_loss, _ = reference(False)
    for change in (dict(final_logit_cap=None), dict(attention_logit_cap=None),
                   dict(query_scale_dims=None), dict(local_rope_theta=None),
                   dict(layer_types=(S, S, S, S)), dict(scale_embeddings=False)):
        loss = weighted_cross_entropy(dataclasses.replace(GEMMA, **change), params, batch)
        assert abs(float(loss) - float(want_loss)) > 1e-3, change


def test_gemma_rms_norm_multiplies_by_one_plus_its_scale():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 8)), jnp.float32)
    scale = jnp.linspace(-0.5, 0.5, 8)
    norm = GemmaRMSNorm(epsilon=1e-6)
    init = nn.meta.unbox(norm.init(jax.random.key(0), x))["params"]["scale"]
    assert float(jnp.abs(init).max()) == 0.0
    got = norm.apply({"params": {"scale": scale}}, x)
    want = x / jnp.sqrt(jnp.mean(x**2, axis=-1, keepdims=True) + 1e-6) * (1 + scale)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_pattern_periods():
    assert layer_pattern_period(None) == 1
    assert layer_pattern_period((S, F) * 21) == 2
    assert layer_pattern_period(((S,) * 5 + (F,)) * 4 + (S, S)) == 6  # Gemma 3 1B: 26 layers
    assert layer_pattern_period((F, F, F)) == 1


def test_a_pattern_that_does_not_divide_the_layers_runs_unrolled_only():
    gemma3 = dataclasses.replace(GEMMA, num_layers=5, layer_types=(S, S, F, S, S))
    params = random_params(gemma3, seed=1)
    # The shapes of test_the_options_change_the_function's batch: each eager primitive is compiled
    # once for both tests.
    batch = make_batch(packed=False, seed=0)
    assert weighted_cross_entropy(gemma3, params, batch).shape == ()
    for change, what in ((dict(scan_layers=True), "scan_layers=True"),
                         (dict(pipeline=PipelineConfig(num_stages=1)), "a pipeline")):
        with pytest.raises(ValueError, match=(
                r"^TransformerConfig.layer_types repeats every 3 layers, which does not divide "
                rf"num_layers=5: {what} ")) as error:
            dataclasses.replace(gemma3, **change)
        assert "\n" not in str(error.value)


def test_the_seq_axis_with_a_soft_cap_is_one_setting_error(reference):
    params, batch, _, _ = reference(False)
    cfg = dataclasses.replace(GEMMA, sliding_window=None, layer_types=None,
                              local_rope_theta=None)
    with jax.set_mesh(make_mesh(seq=2)), nn.logical_axis_rules(DEFAULT_RULES), pytest.raises(
            SettingError, match=r"^attention_logit_cap=2.0 cannot run with sequence parallel"):
        jax.eval_shape(lambda p, b: weighted_cross_entropy(cfg, p, b), params, batch)


def test_fused_kernels_refuse_a_soft_cap():
    with pytest.raises(ValueError, match=r"^TransformerConfig.attention_logit_cap=2.0 with "
                                         "attention kind 'flash': JAX's fused kernels"):
        dataclasses.replace(GEMMA, attention_kind="flash")
    layer = Attention(num_heads=2, dims_per_head=8, logit_cap=5.0,
                      attention_kind=AttentionKind.FLASH,
                      attention_implementation=AttentionImplementation.XLA)
    with pytest.raises(SettingError, match=r"^attention_logit_cap=5.0 cannot run with attention "
                                           "implementation 'xla'"):
        layer.init(jax.random.key(0), jnp.zeros((1, 4, 16)), None)


@pytest.mark.parametrize("changes, message", [
    (dict(layer_types=(S, F)), "layer_types has 2 entries but num_layers=4"),
    (dict(layer_types=("sliding_attention", "local") * 2), "layer_types=['sliding_attention'"),
    (dict(sliding_window=None), "'sliding_attention' layers but sliding_window is None"),
    (dict(layer_types=None), "local_rope_theta=100.0 is set but layer_types is None"),
    (dict(final_logit_cap=0), "final_logit_cap=0 must be None or a positive number"),
    (dict(query_scale_dims=2.5), "query_scale_dims=2.5 must be None"),
    (dict(post_norms=1), "post_norms=1 must be True or False"),
    (dict(layer_implementation="transformer_engine"), "post_norms=True is paxlite's option"),
])
def test_invalid_fields_are_one_clear_error(changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        dataclasses.replace(GEMMA, **changes)


def test_the_fields_survive_model_config_json():
    config = dataclasses.replace(GEMMA, scan_layers=True)
    text = model_config_to_json(config)
    assert json.loads(text)["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert model_config_from_json(text) == config
