"""gpt-oss against transformers in float32, on a tiny random GptOssForCausalLM that transformers
writes here (sinks, q/k/v/o biases, alternating sliding and full layers, YaRN RoPE, biased router
and experts with the clamped SwiGLU): the logits of `hf.load` within 1e-4 in both config.json
forms, greedy generation equal to `generate(do_sample=False)` over a KV cache past the window,
`hf.save` outputs that transformers loads with the same logits and tensors, MXFP4 expert weights
(quantised here by the published rule) dequantised as transformers' own function does, the CLI's
convert / generate --prompt through a tokenizer.json / convert --to=hf, FineTune (and LoRA) from
the converted directory, training on a mesh equal to one device, and one clear refusal per thing
paxlite cannot hold."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from paxlite.interop import hf
from paxlite.interop.gpt_oss_layout import dequantize_mxfp4
from paxlite.interop.hf_config import (
    Family,
    UnsupportedCheckpointError,
    family_of_config,
    from_hf_config,
)
from paxlite.models.decode import generate
from paxlite.models.open_model_fields import LayerAttention
from paxlite.models.rotary import RopeScalingKind
from tests.interop.conftest import (
    FINETUNE,
    convert_with_tokenizer,
    finetune,
    generate_matches_transformers,
    hf_logits,
    safetensors_of,
    save_and_read_back,
    transformers_greedy,
)
from tests.interop.test_hf_open_families import legacy_form

TOKENS = np.random.default_rng(7).integers(0, 256, size=(2, 20)).astype(np.int32)
WINDOW = 4
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 150000.0}
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
             num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=64,
             initializer_range=0.1, rope_parameters=YARN, swiglu_limit=1.5)
PROMPTS = [[17, 3, 99, 200, 5, 8, 41, 7, 90, 11], [61, 2, 3]]  # the first longer than WINDOW
NEW = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(directory, torch model, its logits, hf.load of it). Biases and sinks are random (the
    expert biases init at zero), norms away from 1; swiglu_limit 1.5 so that the clamps bite."""
    import torch
    import transformers

    directory = tmp_path_factory.mktemp("gpt_oss")
    torch.manual_seed(0)
    config = transformers.GptOssConfig(**SIZES)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "bias" in name or "sinks" in name:
                param.normal_(0.0, 0.5)
            elif "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(directory)
    return directory, model, hf_logits(model, TOKENS), hf.load(directory)


def test_logits_match_transformers_in_both_config_forms(tiny, tmp_path):
    directory, _, want, pretrained = tiny
    assert pretrained.family is Family.GPT_OSS
    np.testing.assert_allclose(pretrained.logits(TOKENS), want, atol=1e-4, rtol=0)
    written = json.loads((directory / "config.json").read_text())
    legacy = legacy_form(written)
    assert legacy["rope_scaling"]["rope_type"] == "yarn"
    shutil.copytree(directory, tmp_path / "legacy")
    (tmp_path / "legacy" / "config.json").write_text(json.dumps(legacy))
    assert hf.load(tmp_path / "legacy").config == pretrained.config


def test_features_are_read(tiny):
    directory, _, _, pretrained = tiny
    config, moe = pretrained.config, pretrained.config.moe
    assert (config.qkv_bias, config.out_bias, config.use_bias, config.attention_sinks,
            config.sliding_window, config.layer_types, config.rope_theta) == (
        True, True, False, True, WINDOW, (LayerAttention.SLIDING, LayerAttention.FULL), 150000.0)
    scaling = config.rope_scaling
    assert (scaling.kind, scaling.factor, scaling.beta_fast, scaling.truncate,
            scaling.original_max_position_embeddings) == (RopeScalingKind.YARN, 4.0, 8.0, False, 16)
    assert (moe.num_experts, moe.experts_per_token, moe.moe_layer_interval, moe.use_bias,
            moe.swiglu_limit, moe.swiglu_alpha, moe.renormalize_top_k) == (
        4, 2, 1, True, 1.5, 1.702, True)
    tensors = safetensors_of(directory)
    layer = pretrained.params["layers_1"]
    p = "model.layers.1.mlp."
    gate_up = tensors[p + "experts.gate_up_proj"]  # [E, D, 2F], gate and up interleaved
    assert np.array_equal(layer["moe"]["wi_gate"]["kernel"], gate_up[..., ::2])
    assert np.array_equal(layer["moe"]["wi"]["kernel"], gate_up[..., 1::2])
    assert np.array_equal(layer["moe"]["wi"]["bias"], tensors[p + "experts.gate_up_proj_bias"][
        :, 1::2])
    assert np.array_equal(layer["moe"]["router"]["bias"], tensors[p + "router.bias"])
    assert np.array_equal(layer["attention"]["sinks"], tensors["model.layers.1.self_attn.sinks"])
    assert family_of_config(config) is Family.GPT_OSS


def test_greedy_generation_matches_transformers(tiny):
    _, model, _, pretrained = tiny
    want = transformers_greedy(model, PROMPTS, NEW)
    config = dataclasses.replace(pretrained.config, scan_layers=False)
    assert generate(config, pretrained.params, PROMPTS, max_new_tokens=NEW) == want


def test_save_loads_in_transformers_with_the_same_logits(tiny, tmp_path):
    directory, _, want, pretrained = tiny
    written, model = save_and_read_back(pretrained, directory, tmp_path / "out")
    assert (written["model_type"], written["architectures"], written["layer_types"],
            written["rope_parameters"]["rope_type"], written["rope_parameters"]["truncate"]) == (
        "gpt_oss", ["GptOssForCausalLM"], ["sliding_attention", "full_attention"], "yarn", False)
    assert sum(p.numel() for p in model.parameters()) == pretrained.num_params
    np.testing.assert_allclose(hf_logits(model, TOKENS), want, atol=1e-4, rtol=0)


# ---------------------------------------------------------------- MXFP4
FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def _quantize_mxfp4(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[E, in, out] float -> (blocks uint8 [E, out, in/32, 16], scales uint8 [E, out, in/32]) by
    the OCP MX rule: per 32 inputs of an output row, scale 2^(floor(log2(max |x|)) - 2) (E2M1's
    largest exponent), each value rounded to the nearest E2M1 magnitude (<= 6), sign in bit 3,
    two codes a byte, the even input in the low nibble."""
    rows = np.swapaxes(weight, 1, 2).astype(np.float32)  # [E, out, in]
    groups = rows.reshape(*rows.shape[:2], -1, 32)
    peak = np.max(np.abs(groups), axis=-1)
    exponent = np.floor(np.log2(np.maximum(peak, 2.0**-100))) - 2
    scaled = groups / np.exp2(exponent)[..., None]
    magnitude = np.argmin(np.abs(np.abs(scaled)[..., None] - FP4), axis=-1)
    codes = (magnitude + 8 * (scaled < 0)).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    # C order: safetensors' save_file writes an array's memory as it lies
    return (np.ascontiguousarray(blocks, np.uint8),
            np.ascontiguousarray(exponent + 127, np.uint8))


def test_mxfp4_experts_are_dequantized_as_transformers_does(tiny, tmp_path):
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    directory, model, _, _ = tiny
    tensors = safetensors_of(directory)
    dequantized = {}
    for i in range(SIZES["num_hidden_layers"]):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            blocks, scales = _quantize_mxfp4(tensors.pop(name))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            theirs = convert_moe_packed_tensors(torch.from_numpy(blocks),
                                                torch.from_numpy(scales)).float().numpy()
            np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales).astype(np.float32),
                                          theirs, err_msg=name)
            dequantized[name] = theirs
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    pretrained = hf.load(tmp_path)
    gate_up = dequantized["model.layers.0.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(pretrained.params["layers_0"]["moe"]["wi_gate"]["kernel"],
                                  gate_up[..., ::2])
    state = {name: torch.from_numpy(value) for name, value in dequantized.items()}
    reference = type(model)(model.config).eval()
    reference.load_state_dict({**model.state_dict(), **state})
    np.testing.assert_allclose(pretrained.logits(TOKENS), hf_logits(reference, TOKENS),
                               atol=1e-4, rtol=0)
    assert not np.allclose(hf_logits(reference, TOKENS), hf_logits(model, TOKENS), atol=1e-3)
    # the streaming conversion (its layout first walked on stand-ins) reads the same weights
    from paxlite.__main__ import main

    assert main(["convert", "--from=hf", "--to=paxlite", f"--input={tmp_path}",
                 f"--output={tmp_path / 'pax'}"]) == 0
    streamed = hf.from_paxlite(tmp_path / "pax")
    jax.tree.map(np.testing.assert_array_equal, streamed.params, pretrained.params)


# ---------------------------------------------------------------- the command line
@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    """(the tiny model's directory with a tokenizer.json, its `convert --to=paxlite` output),
    converted once for the command line and FineTune."""
    pytest.importorskip("tokenizers")
    return convert_with_tokenizer(tiny[0], tmp_path_factory.mktemp("converted"))


def test_cli_convert_generate_and_back(tiny, converted, tmp_path, capsys):
    """convert --to=paxlite with a tokenizer.json beside the model, generate --prompt equal to
    transformers' greedy ids through AutoTokenizer, convert --to=hf read back by transformers."""
    import transformers

    from paxlite.__main__ import main

    _, model, want, _ = tiny
    hf_dir, out = converted
    texts = ["the quick brown fox said hello", "lazy dog"]
    generate_matches_transformers(model, hf_dir, out, texts, NEW, capsys)
    back = tmp_path / "hf_again"
    assert main(["convert", "--from=paxlite", "--to=hf", f"--input={out}",
                 f"--output={back}"]) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(
        back, attn_implementation="eager").eval()
    np.testing.assert_allclose(hf_logits(again, TOKENS), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora_attention"])
def test_finetune_trains_from_the_converted_directory(converted, tmp_path, lora):
    """FineTune reads the model (sinks: einsum attention by default; the YaRN fields kept),
    starts from exactly the converted parameters and trains (one step: what moves); with LoRA on
    attention the adapters move and the base stays."""
    import fiddle as fdl

    from paxlite.checkpointing.pretrained import load_model_config, read_state
    from paxlite.experiments.build import load_experiment

    out = str(converted[1])
    overrides = ["USE_LORA=true", "LORA_TARGET_LAYERS=attention", "LORA_RANK=2"] if lora else []
    experiment = load_experiment("FineTune", [f"CHECKPOINT_RESTORE_PATH={out}", *FINETUNE,
                                              *overrides])
    assert experiment.ATTENTION_KIND == "dot_product"
    model = fdl.build(experiment.model_config())
    recorded = load_model_config(out)
    assert dataclasses.replace(model, lora_rank=None, lora_alpha=None, lora_targets=(
        recorded.lora_targets), max_seq_len=recorded.max_seq_len, dtype=recorded.dtype,
        scan_layers=recorded.scan_layers, remat_policy=recorded.remat_policy) == recorded
    saved = read_state(out)[2]["params"]
    base = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(saved)}
    _, start, after = finetune(out, tmp_path / "job", *overrides)
    for key, value in base.items():
        np.testing.assert_array_equal(start[key], value, err_msg=key)
    moved = {key for key, value in base.items() if not np.array_equal(after[key], value)}
    if lora:
        assert not moved  # the base is frozen
        assert any("lora" in key and not np.array_equal(value, start[key])
                   for key, value in after.items())
    else:
        assert moved == set(base)


# ---------------------------------------------------------------- sharded == one device
@pytest.fixture(scope="module")
def reference():
    """A scanned two-layer gpt-oss (a sliding + full unit, both MoE) on one device, the
    load-balancing loss on, from seeded host parameters (init's mesh invariance is
    tests/parallel/test_moe_sharded.py's)."""
    from paxlite.parallel.mesh import MeshConfig, build_mesh
    from tests.host_params import random_host_params
    from tests.parallel.test_moe_sharded import _loss_and_grads

    hf_json = {"model_type": "gpt_oss", **SIZES, "hidden_size": 32, "head_dim": 8,
               "num_local_experts": 4, "vocab_size": 128, "output_router_logits": True,
               "max_position_embeddings": 16}
    config = dataclasses.replace(from_hf_config(hf_json)[1], scan_layers=True)
    assert config.layers_per_scan_unit == 2
    one = build_mesh(MeshConfig(ici_mesh_shape=(1, 1, 1)), devices=jax.devices()[:1])
    return config, _loss_and_grads(config, one, random_host_params)


def test_training_on_a_mesh_equals_one_device(reference):
    from tests.host_params import random_host_params
    from tests.parallel.test_moe_sharded import assert_mesh_matches_one_device

    assert_mesh_matches_one_device((1, 2, 2, 2), (1, 1, 1), reference, params=random_host_params)


# ---------------------------------------------------------------- refusals
def _json(**changes):
    base = {"model_type": "gpt_oss", **{k: v for k, v in SIZES.items()
                                        if k != "initializer_range"}}
    return {**base, **changes}


@pytest.mark.parametrize("changes, field", [
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config="),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
     "rope_type 'llama3' is not one paxlite implements"),
    (dict(layer_types=["sliding_attention"]), "it has 1 entries for num_hidden_layers=2"),
    (dict(layer_types=["chunked_attention", "full_attention"]), "layer_types="),
    (dict(num_experts_per_tok=5), "num_experts_per_tok=5"),
    (dict(swiglu_limit=0), "swiglu_limit=0"),
    (dict(sliding_window=None), "sliding_window=None"),
])
def test_refusals_name_the_field(changes, field):
    with pytest.raises(UnsupportedCheckpointError, match="config.json") as error:
        from_hf_config(_json(**changes))
    assert field in str(error.value)
    assert "\n" not in str(error.value)


def test_defaults_and_layouts():
    """What GptOssConfig fills in (YaRN, the alternation, biases) is what paxlite reads; without
    attention_bias no projection has one; other families refuse sinks and the output bias."""
    _, config = from_hf_config({k: v for k, v in _json().items()
                                if k not in ("rope_parameters", "swiglu_limit")})
    assert (config.rope_scaling.kind, config.rope_scaling.factor, config.rope_theta,
            config.moe.swiglu_limit, config.layer_types[0]) == (
        RopeScalingKind.YARN, 32.0, 150000.0, 7.0, LayerAttention.SLIDING)
    _, plain = from_hf_config(_json(attention_bias=False))
    assert (plain.qkv_bias, plain.out_bias) == (False, False)
    assert family_of_config(plain) is Family.GPT_OSS
    llama_like = dataclasses.replace(plain, attention_sinks=False, moe=None, layer_types=None,
                                     sliding_window=None, rope_scaling=None, out_bias=True)
    with pytest.raises(UnsupportedCheckpointError) as error:
        family_of_config(llama_like)
    assert "out_bias (resolved) == use_bias=True (needs False)" in str(error.value)
