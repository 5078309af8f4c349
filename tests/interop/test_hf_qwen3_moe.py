"""Qwen3-MoE (q/k norms, top-k experts renormalised or not, dense layers between sparse ones)
against transformers in float32, on tiny random models that transformers writes here: the logits
of `hf.load` within 1e-4 in both config.json forms, greedy generation equal to
`generate(do_sample=False)`, `hf.save` outputs that transformers loads with the same logits and the
same tensor names, transformers 5's fused in-memory expert names read too, training on meshes with
an expert axis equal to one device (1e-5), and one clear refusal per thing paxlite cannot hold."""

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from paxlite.checkpointing.pretrained import model_config_from_json, model_config_to_json
from paxlite.interop import hf
from paxlite.interop.hf_config import (
    Family,
    UnsupportedCheckpointError,
    family_of_config,
    from_hf_config,
)
from paxlite.models.decode import generate
from paxlite.models.moe_config import MoeConfig, MoeRouting
from paxlite.parallel.mesh import MeshConfig, build_mesh
from tests.interop.conftest import _perturb_norms, hf_logits
from tests.interop.test_hf_open_families import legacy_form
from tests.parallel.test_moe_sharded import _loss_and_grads
from tests.parallel.test_moe_sharded import (
    test_moe_mesh_matches_one_device as assert_mesh_matches_one_device,
)

TOKENS = np.random.default_rng(5).integers(0, 256, size=(2, 24)).astype(np.int32)
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
             num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
             initializer_range=0.1, max_position_embeddings=64)
CASES = {
    # every layer sparse, the top-2 weights renormalised (the published models), its own head_dim
    "renormalised": dict(num_hidden_layers=2, num_experts=4, norm_topk_prob=True, head_dim=24),
    # the weights as the softmax gave them; layers 1 and 3 dense (paxlite's moe_layer_interval 2);
    # head_dim from hidden/heads; the load-balancing loss on
    "plain_every_other": dict(num_hidden_layers=4, num_experts=8, norm_topk_prob=False,
                              mlp_only_layers=[1, 3], output_router_logits=True,
                              router_aux_loss_coef=0.02),
}
PROMPTS = [[17, 3, 99, 200, 5, 8, 41, 7, 90, 11], [61, 2, 3]]
NEW = 6


def _tensors(directory):
    with safe_open(os.path.join(directory, "model.safetensors"), framework="np") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118  not iterable


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    import torch
    import transformers

    directory = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**SIZES, **CASES[request.param])
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager").eval()
    _perturb_norms(model, names=("norm",))
    model.save_pretrained(directory)
    return request.param, directory, model, hf_logits(model, TOKENS), hf.load(directory)


def _legacy(written: dict) -> dict:
    """transformers 4.x's config.json: rope_theta at the top, the experts' count as num_experts."""
    legacy = legacy_form(written)
    legacy["num_experts"] = legacy.pop("num_local_experts")
    return legacy


def test_logits_match_transformers_in_both_config_forms(case, tmp_path):
    _, directory, _, want, pretrained = case
    assert pretrained.family is Family.QWEN3_MOE
    np.testing.assert_allclose(pretrained.logits(TOKENS), want, atol=1e-4, rtol=0)

    written = json.loads((directory / "config.json").read_text())
    assert "num_experts" not in written  # transformers 5 writes num_local_experts
    shutil.copytree(directory, tmp_path / "legacy")
    (tmp_path / "legacy" / "config.json").write_text(json.dumps(_legacy(written)))
    assert from_hf_config(_legacy(written)) == from_hf_config(written)
    assert hf.load(tmp_path / "legacy").config == pretrained.config


def test_features_are_read(case):
    name, directory, _, _, pretrained = case
    config, moe = pretrained.config, pretrained.config.moe
    renormalised = name == "renormalised"
    assert (config.qk_norm, config.dims_per_head, config.hidden_dims, config.qkv_bias) == (
        True, 24 if renormalised else 16, 96, None)
    assert (moe.num_experts, moe.experts_per_token, moe.routing, moe.moe_layer_interval,
            moe.expert_hidden_dims, moe.gated_experts, moe.renormalize_top_k) == (
        4 if renormalised else 8, 2, MoeRouting.DROPLESS_TOPK, 1 if renormalised else 2, 32,
        True, renormalised)
    # HF's coef * E * sum(density * proxy) over the 2 sparse layers pooled -> per layer coef K / 2
    assert moe.load_balancing_weight == (0.0 if renormalised else 0.02 * 2 / 2)
    assert family_of_config(config) is Family.QWEN3_MOE
    tensors = _tensors(directory)
    layers = [pretrained.params[f"layers_{i}"] for i in range(config.num_layers)]
    assert ["moe" in layer for layer in layers] == [moe.is_moe_layer(i)
                                                   for i in range(config.num_layers)]
    assert all(("mlp" in layer) != ("moe" in layer) for layer in layers)
    experts = layers[0]["moe"]
    prefix = "model.layers.0.mlp."
    assert np.array_equal(experts["router"]["kernel"], tensors[prefix + "gate.weight"].T)
    for kernel, proj in (("wi_gate", "gate_proj"), ("wi", "up_proj"), ("wo", "down_proj")):
        assert np.array_equal(experts[kernel]["kernel"][1],
                              tensors[f"{prefix}experts.1.{proj}.weight"].T), kernel


def test_greedy_generation_matches_transformers(case):
    import torch

    _, _, model, _, pretrained = case
    want = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW,
                                 eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(prompt):].tolist())
    config = dataclasses.replace(pretrained.config, scan_layers=False)
    assert generate(config, pretrained.params, PROMPTS, max_new_tokens=NEW) == want


def test_save_loads_in_transformers_with_the_same_logits(case, tmp_path):
    import transformers

    name, directory, _, want, pretrained = case
    hf.save(pretrained, tmp_path / "out")
    original, ours = _tensors(directory), _tensors(tmp_path / "out")
    assert sorted(ours) == sorted(original)  # per-expert names, as transformers 5 writes them
    for tensor in original:
        assert ours[tensor].tobytes() == original[tensor].tobytes(), tensor
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    case_settings = CASES[name]
    assert (written["model_type"], written["architectures"], written["num_local_experts"],
            written["num_experts"], written["norm_topk_prob"], written["decoder_sparse_step"],
            written["mlp_only_layers"], written["moe_intermediate_size"],
            written["output_router_logits"], written["router_aux_loss_coef"]) == (
        "qwen3_moe", ["Qwen3MoeForCausalLM"], case_settings["num_experts"],
        case_settings["num_experts"], case_settings["norm_topk_prob"], 1,
        case_settings.get("mlp_only_layers", []), 32, name != "renormalised",
        case_settings.get("router_aux_loss_coef", 0.001))
    assert from_hf_config(written)[1] == pretrained.config
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    assert sum(p.numel() for p in model.parameters()) == pretrained.num_params
    np.testing.assert_allclose(hf_logits(model, TOKENS), want, atol=1e-4, rtol=0)


def test_fused_in_memory_names_are_read_too(case, tmp_path):
    """transformers 5.x's module names (the experts fused per layer, a state_dict saved raw)."""
    _, directory, _, _, pretrained = case
    config = pretrained.config
    tensors = _tensors(directory)
    for i in range(config.num_layers):
        if not config.moe.is_moe_layer(i):
            continue
        p = f"model.layers.{i}.mlp.experts."
        experts = range(config.moe.num_experts)
        gate = [tensors.pop(f"{p}{e}.gate_proj.weight") for e in experts]
        up = [tensors.pop(f"{p}{e}.up_proj.weight") for e in experts]
        down = [tensors.pop(f"{p}{e}.down_proj.weight") for e in experts]
        tensors[p + "gate_up_proj"] = np.concatenate([np.stack(gate), np.stack(up)], axis=1)
        tensors[p + "down_proj"] = np.stack(down)
    shutil.copy(directory / "config.json", tmp_path / "config.json")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    fused = hf.load(tmp_path)
    for path, leaf in jax.tree_util.tree_leaves_with_path(pretrained.params):
        got = fused.params
        for key in path:
            got = got[key.key]
        np.testing.assert_array_equal(got, leaf, err_msg=jax.tree_util.keystr(path))


# ---------------------------------------------------------------- training on expert meshes
@pytest.fixture(scope="module")
def reference():
    """The sparse-every-other-layer, unrenormalised model on one device (test_moe_sharded's)."""
    hf_json = {"model_type": "qwen3_moe", **SIZES, **CASES["plain_every_other"], "head_dim": 8,
               "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64}
    config = from_hf_config(hf_json)[1]
    assert config.moe.load_balancing_weight > 0 and not config.moe.renormalize_top_k
    one = build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1)), devices=jax.devices()[:1])
    return config, _loss_and_grads(config, one)


@pytest.mark.parametrize("ici,dcn", [((2, 1, 1, 4), (1, 1, 1)), ((1, 2, 2, 2), (1, 1, 1))],
                         ids=["data2xexpert4", "fsdp2xtensor2xexpert2"])
def test_training_on_expert_meshes_equals_one_device(ici, dcn, reference):
    assert_mesh_matches_one_device(ici, dcn, reference)


# ---------------------------------------------------------------- refusals and layouts
def _qwen3_moe_json(**changes):
    base = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8,
            "num_experts_per_tok": 2, "norm_topk_prob": True}
    return {**base, **changes}


@pytest.mark.parametrize("changes, field", [
    (dict(decoder_sparse_step=2), "decoder_sparse_step=2, mlp_only_layers=[] make layers [1, 3]"),
    (dict(mlp_only_layers=[0]), "mlp_only_layers=[0] make layers [1, 2, 3] of 4"),
    (dict(mlp_only_layers=[0, 1, 2, 3]), "make layers [] of 4"),
    (dict(use_sliding_window=True, sliding_window=8), "use_sliding_window=True"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(shared_expert_intermediate_size=64), "shared_expert_intermediate_size=64"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
    (dict(num_experts=4), "config.json gives {'num_experts': 4, 'num_local_experts': 8}"),
    (dict(num_local_experts=0), "num_local_experts=0"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob='yes'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
     "rope_scaling=RopeScaling("),
])
def test_refusals_name_the_field(changes, field):
    with pytest.raises(UnsupportedCheckpointError, match="config.json") as error:
        from_hf_config(_qwen3_moe_json(**changes))
    assert field in str(error.value)
    assert "\n" not in str(error.value)


def test_family_of_config_tells_qwen3_moe_from_mixtral():
    _, qwen = from_hf_config(_qwen3_moe_json(mlp_only_layers=[1, 3]))
    assert (qwen.moe.moe_layer_interval, family_of_config(qwen)) == (2, Family.QWEN3_MOE)
    assert model_config_from_json(model_config_to_json(qwen)) == qwen
    mixtral = dataclasses.replace(qwen, qk_norm=False,
                                  moe=dataclasses.replace(qwen.moe, moe_layer_interval=1))
    assert family_of_config(mixtral) is Family.MIXTRAL
    neither = dataclasses.replace(
        mixtral, moe=dataclasses.replace(mixtral.moe, renormalize_top_k=False))
    with pytest.raises(UnsupportedCheckpointError) as error:
        family_of_config(neither)
    assert "moe.renormalize_top_k=False (needs True)" in str(error.value)
    assert "as Qwen3-MoE in qk_norm=False (needs True)" in str(error.value)


def test_renormalize_top_k_is_checked_once():
    with pytest.raises(ValueError, match="renormalize_top_k=1 must be True or False"):
        MoeConfig(num_experts=4, routing="dropless_topk", renormalize_top_k=1)
    with pytest.raises(ValueError, match="renormalize_top_k=False with routing='gshard_top2'"):
        MoeConfig(num_experts=4, renormalize_top_k=False)
