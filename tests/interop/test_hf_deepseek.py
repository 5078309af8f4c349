"""DeepSeek-V3 and DeepSeek-V2(-Lite) against transformers in float32 (eager attention), on tiny
random models transformers writes here: `hf.load` logits within 1e-4 (V3: low-rank query, YaRN
with its mscale, sigmoid grouped routing with a nonzero choice bias, a shared expert and a dense
first layer; V2-Lite: one query projection, YaRN with mscale 0.707, softmax greedy routing, two
shared experts), greedy generation equal to transformers', `hf.save` read back by transformers
with the same logits and tensors, training of the converted model on an fsdp x tensor x expert mesh
equal to one device with the router bias untouched, LoRA on MLA, and one refusal per field
paxlite cannot hold."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import AxisType

from paxlite.interop import hf
from paxlite.interop.hf_config import Family, UnsupportedCheckpointError, from_hf_config
from paxlite.models.decode import generate
from paxlite.models.moe_router_deepseek import SCORE_BIAS_NAME, trainable_paths
from paxlite.models.transformer import Transformer, logical_param_axes, num_params
from paxlite.parallel.rules import DEFAULT_RULES, batch_sharding, logical_to_shardings
from tests.interop.conftest import (
    _perturb_norms,
    hf_logits,
    save_and_read_back,
    transformers_greedy,
)
from tests.models.test_seq_parallel_transformer import AXES

TOKENS = np.random.default_rng(5).integers(0, 256, size=(2, 20)).astype(np.int32)
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
             qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, initializer_range=0.1,
             max_position_embeddings=64, first_k_dense_replace=1)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
            beta_fast=32, beta_slow=1)
CASES = {
    "v3": ("DeepseekV3Config", dict(
        q_lora_rank=24, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
        n_group=4, topk_group=2, num_experts_per_tok=3, norm_topk_prob=True,
        rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0})),
    "v2_lite": ("DeepseekV2Config", dict(
        q_lora_rank=None, n_shared_experts=2, n_routed_experts=8, routed_scaling_factor=1.0,
        topk_method="greedy", n_group=1, topk_group=1, num_experts_per_tok=3,
        norm_topk_prob=False,
        rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707})),
}
PROMPTS = [[17, 3, 99, 200, 5, 8, 41, 7, 90, 11], [61, 2, 3]]
NEW = 6


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    import torch
    import transformers

    directory = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    config_class, fields = CASES[request.param]
    config = getattr(transformers, config_class)(**SIZES, **fields)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager").eval()
    _perturb_norms(model, names=("norm", "layernorm"))
    with torch.no_grad():  # a choice bias that changes which experts are chosen
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))
    model.save_pretrained(directory)
    return request.param, directory, model, hf_logits(model, TOKENS), hf.load(directory)


def test_logits_match_transformers(case):
    name, _, _, want, pretrained = case
    assert pretrained.family is (Family.DEEPSEEK_V3 if name == "v3" else Family.DEEPSEEK_V2)
    np.testing.assert_allclose(pretrained.logits(TOKENS), want, atol=1e-4, rtol=0)
    config = pretrained.config
    assert config.rope_scaling.kind.value == "yarn" and config.mla.scale != 24 ** -0.5
    assert [f"layers_{i}" for i in range(3) if "moe" in pretrained.params[f"layers_{i}"]] == [
        "layers_1", "layers_2"]
    if name == "v3":
        bias = pretrained.params["layers_1"]["moe"][SCORE_BIAS_NAME]
        assert np.abs(bias).max() > 0.1
        assert "q_a" in pretrained.params["layers_0"]["attention"]
    else:
        assert "query" in pretrained.params["layers_0"]["attention"]


def test_greedy_generation_matches_transformers(case):
    _, _, model, _, pretrained = case
    want = transformers_greedy(model, PROMPTS, NEW)
    assert generate(pretrained.config, pretrained.params, PROMPTS, max_new_tokens=NEW) == want


def test_save_loads_in_transformers_with_the_same_logits(case, tmp_path):
    _, directory, _, want, pretrained = case
    _, model = save_and_read_back(pretrained, directory, tmp_path / "out")
    buffers = sum(b.numel() for n, b in model.named_buffers()
                  if n.endswith("e_score_correction_bias"))
    assert sum(p.numel() for p in model.parameters()) + buffers == pretrained.num_params
    np.testing.assert_allclose(hf_logits(model, TOKENS), want, atol=1e-4, rtol=0)


def _loss(config, params, tokens):
    logits = Transformer(config).apply({"params": params}, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def test_training_on_a_mesh_equals_one_device_and_keeps_the_bias(case):
    name, _, _, _, pretrained = case
    config = pretrained.config
    params = jax.tree.map(np.asarray, pretrained.params)
    tokens = np.concatenate([TOKENS[:, :13], TOKENS[:, 7:]])  # 4 rows: data x fsdp x expert
    grad_fn = jax.jit(jax.value_and_grad(lambda p, t: _loss(config, p, t)))
    want_loss, want_grads = grad_fn(params, tokens)
    mesh = jax.make_mesh((1, 1, 2, 1, 2, 2), AXES, axis_types=(AxisType.Auto,) * len(AXES),
                         devices=jax.devices()[:8])
    shardings = logical_to_shardings(logical_param_axes(config), mesh, DEFAULT_RULES,
                                     shapes=params)
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        loss, grads = grad_fn(jax.device_put(params, shardings),
                              jax.device_put(tokens, batch_sharding(mesh)))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want_grads))
    for path, got in jax.tree_util.tree_leaves_with_path(grads):
        np.testing.assert_allclose(got, flat_want[path], rtol=1e-4, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))
    trainable = trainable_paths(config)
    if name == "v3":  # the bias has no gradient and the train step never trains it
        assert not np.any(np.asarray(grads["layers_1"]["moe"][SCORE_BIAS_NAME]))
        assert not trainable("layers_1/moe/score_correction_bias")
        assert trainable("layers_1/moe/router/kernel")
    else:
        assert trainable is None


def test_lora_on_latent_attention(case):
    _, _, _, _, pretrained = case
    config = dataclasses.replace(pretrained.config, lora_rank=2, lora_targets="attention")
    # the same init traced abstractly: the tree is what is checked (eager, it compiled each of
    # its ops: 13 CPU-s)
    variables = jax.eval_shape(lambda: Transformer(config).init(jax.random.key(0), TOKENS[:, :8]))
    attention = nn.meta.unbox(variables["params"])["layers_0"]["attention"]
    assert {"lora_a", "lora_b"} <= set(attention["kv_a"]) and "lora_a" in attention["out"]
    assert num_params(config) > pretrained.num_params
    assert trainable_paths(config)("layers_0/attention/kv_a/lora_a")


def _json(name, **changes):
    _, fields = CASES[name]
    hf_json = {"model_type": "deepseek_v3" if name == "v3" else "deepseek_v2", **SIZES,
               **fields, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    hf_json.update(changes)
    return hf_json


@pytest.mark.parametrize("name, changes, field", [
    ("v3", {"attention_bias": True}, "attention_bias"),
    ("v3", {"topk_method": "greedy"}, "topk_method"),
    ("v3", {"rope_interleave": False}, "rope_interleave"),
    ("v3", {"num_key_value_heads": 2}, "num_key_value_heads"),
    ("v2_lite", {"norm_topk_prob": True}, "norm_topk_prob"),
    ("v2_lite", {"topk_method": "noaux_tc"}, "topk_method"),
    ("v2_lite", {"mlp_bias": True}, "mlp_bias"),
    ("v2_lite", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters"),
])
def test_refusals_name_the_field(name, changes, field):
    with pytest.raises(UnsupportedCheckpointError, match=f"config.json {field}"):
        from_hf_config(_json(name, **changes))


def test_multi_token_prediction_layers_are_ignored_as_transformers_does():
    config = from_hf_config(_json("v3", num_nextn_predict_layers=1))[1]
    assert config == from_hf_config(_json("v3"))[1]


@pytest.mark.parametrize("field, value", [
    ("attention_sinks", True), ("qk_l2_norm", True), ("out_bias", True)])
def test_latent_attention_refuses_options_it_would_ignore(field, value):
    """MLA has its own projections and softmax: a sink, a q/k L2 norm or an output bias set beside
    it would be silently dropped, so the config refuses it, naming the field."""
    import dataclasses

    config = from_hf_config(_json("v2_lite"))[1]
    with pytest.raises(ValueError, match=f"TransformerConfig.mla: .*{field}={value!r}"):
        dataclasses.replace(config, **{field: value})
