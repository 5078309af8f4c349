"""Llama 4's text model (``llama4_text``) against transformers in float32, on a tiny random model
transformers writes here: 4 layers (three chunked RoPE layers with the weightless q/k norm, one
NoPE layer with the query temperature made to bite, floor_scale 4), chunks of 8 in sequences of
24, a dense layer then a sparse one (top-1 of 4 experts, sigmoid gates on the input, a shared
expert), llama3 RoPE with equal low/high factors as Scout's. The logits of `hf.load` within 1e-4;
each Llama 4 feature bites (the logits move by far more than that without it); greedy generation
over the KV cache across chunk boundaries equal to `generate(do_sample=False)`; `hf.save` read
back by transformers with the same logits and bytes; `convert` + `generate --prompt` through the
model's own tokenizer.json equal to transformers' greedy ids; FineTune (and LoRA) from the
converted directory trains; the refusals; the published Scout's parameter count against
transformers' own on the meta device; the published multimodal form (Llama4ForConditionalGeneration
holding the same text model) read as its text model. Meshes: tests/models/test_llama4_layers.py."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from paxlite.interop import hf
from paxlite.interop.hf_config import (
    Family,
    UnsupportedCheckpointError,
    family_of_config,
    from_hf_config,
    to_hf_config,
)
from paxlite.models.decode import generate
from paxlite.models.moe_config import MoeRouting
from paxlite.models.open_model_fields import LayerAttention
from tests.interop.conftest import (
    _perturb_norms,
    convert_with_tokenizer,
    finetune,
    generate_matches_transformers,
    hf_logits,
    safetensors_of,
    save_and_read_back,
    transformers_greedy,
)

TOKENS = np.random.default_rng(7).integers(0, 256, size=(2, 24)).astype(np.int32)
CHUNK = 8
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=32, intermediate_size_mlp=48,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
             attention_chunk_size=CHUNK, max_position_embeddings=256, floor_scale=4,
             attn_scale=0.5, initializer_range=0.1,
             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                              "original_max_position_embeddings": 16})
PROMPTS = [[17, 3, 99, 200, 5, 8, 41, 7, 90, 11], [61, 2, 3]]  # the first crosses a chunk
NEW = 9  # ... and generation crosses the next one
C, F, N = LayerAttention.CHUNKED, LayerAttention.FULL, LayerAttention.FULL_NO_ROPE


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import torch
    import transformers

    directory = tmp_path_factory.mktemp("llama4")
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(**SIZES)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager").eval()
    _perturb_norms(model, names=("norm",))
    model.save_pretrained(directory)
    return directory, model, hf_logits(model, TOKENS), hf.load(directory)


def test_logits_match_transformers(tiny):
    _, _, want, pretrained = tiny
    assert pretrained.family is Family.LLAMA4_TEXT
    np.testing.assert_allclose(pretrained.logits(TOKENS), want, atol=1e-4, rtol=0)


def test_features_are_read(tiny):
    directory, model, _, pretrained = tiny
    config, moe = pretrained.config, pretrained.config.moe
    assert config.layer_types == (C, C, C, N)
    assert (config.attention_chunk_size, config.qk_l2_norm, config.query_temperature_floor,
            config.query_temperature_scale, config.hidden_dims) == (CHUNK, True, 4, 0.5, 48)
    assert (moe.routing, moe.experts_per_token, moe.num_experts, moe.expert_hidden_dims,
            moe.shared_expert_hidden_dims, moe.renormalize_top_k) == (
        MoeRouting.SIGMOID_TOPK, 1, 4, 32, 32, False)
    # paxlite's placement is transformers' own list
    assert [i for i in range(4) if moe.is_moe_layer(i)] == model.config.moe_layers == [1, 3]
    assert (config.rope_scaling.low_freq_factor, config.rope_scaling.high_freq_factor) == (1, 1)
    assert family_of_config(config) is Family.LLAMA4_TEXT
    # the fused experts as stored: gate columns first, no q/k row permutation
    tensors = safetensors_of(directory)
    layer = pretrained.params["layers_1"]
    gate_up = tensors["model.layers.1.feed_forward.experts.gate_up_proj"]
    np.testing.assert_array_equal(layer["moe"]["wi_gate"]["kernel"], gate_up[:, :, :32])
    np.testing.assert_array_equal(layer["attention"]["query"]["kernel"].reshape(64, 64).T,
                                  tensors["model.layers.1.self_attn.q_proj.weight"])


@pytest.mark.parametrize("change", [
    dict(attention_chunk_size=None, layer_types=(F, F, F, N)),  # no chunks
    dict(qk_l2_norm=False),
    dict(query_temperature_floor=None),
    dict(layer_types=(C, C, C, C), query_temperature_floor=None),  # RoPE on the NoPE layer
    "softmax",  # Mixtral's routing in place of the sigmoid gates on the input
    "rotate_half",  # HF LLaMA's q/k row order
])
def test_each_feature_bites(tiny, change):
    """Without any one of Llama 4's pieces the logits move by far more than the tolerance."""
    from paxlite.interop.layouts import interleaved_to_rotate_half

    _, _, want, pretrained = tiny
    config, params = pretrained.config, pretrained.params
    if change == "softmax":
        config = dataclasses.replace(config, moe=dataclasses.replace(
            config.moe, routing=MoeRouting.DROPLESS_TOPK, renormalize_top_k=True))
    elif change == "rotate_half":
        params = jax.tree.map(lambda x: x, params)
        for i in range(4):
            att = params[f"layers_{i}"]["attention"]
            for name, heads in (("query", 4), ("key", 2)):
                kernel = att[name]["kernel"]  # [D, heads, H]
                rows = interleaved_to_rotate_half(kernel.reshape(64, -1).T, heads=heads,
                                                  head_dim=16)
                att[name] = {"kernel": rows.T.reshape(kernel.shape)}
    else:
        config = dataclasses.replace(config, **change)
    changed = dataclasses.replace(pretrained, config=config, params=params).logits(TOKENS)
    assert np.abs(changed - want).max() > 1e-2


def test_greedy_generation_matches_transformers(tiny):
    _, model, _, pretrained = tiny
    want = transformers_greedy(model, PROMPTS, NEW)
    assert generate(pretrained.config, pretrained.params, PROMPTS, max_new_tokens=NEW) == want


def test_save_loads_in_transformers_with_the_same_logits(tiny, tmp_path):
    directory, _, want, pretrained = tiny
    written, model = save_and_read_back(pretrained, directory, tmp_path / "out")
    source = json.loads((directory / "config.json").read_text())
    for key in ("model_type", "architectures", "layer_types", "no_rope_layers", "moe_layers",
                "attention_chunk_size", "use_qk_norm", "floor_scale", "attn_scale",
                "attn_temperature_tuning", "rope_parameters", "intermediate_size",
                "intermediate_size_mlp"):
        assert written[key] == source[key], key
    assert sum(p.numel() for p in model.parameters()) == pretrained.num_params
    np.testing.assert_allclose(hf_logits(model, TOKENS), want, atol=1e-4, rtol=0)


def test_config_defaults_are_transformers_own():
    """A config.json that leaves Llama 4's fields out reads as Llama4TextConfig completes it."""
    import transformers

    minimal = {"model_type": "llama4_text", "vocab_size": 64, "hidden_size": 32,
               "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 8, "intermediate_size": 16, "intermediate_size_mlp": 24,
               "interleave_moe_layer_step": 2}
    theirs = transformers.Llama4TextConfig(**minimal)
    _, config = from_hf_config(minimal)
    assert [kind is N for kind in config.layer_types] == [not r for r in theirs.no_rope_layers]
    assert [kind is C for kind in config.layer_types] == [
        t == "chunked_attention" for t in theirs.layer_types]
    assert [i for i in range(8) if config.moe.is_moe_layer(i)] == theirs.moe_layers
    assert (config.attention_chunk_size, config.query_temperature_floor, config.rope_theta,
            config.max_seq_len) == (8192, 8192, 500000.0, 131072)
    written = to_hf_config(config, family=Family.LLAMA4_TEXT)
    assert from_hf_config(written)[1] == config


def _json(**changes):
    return {"model_type": "llama4_text", "vocab_size": 64, "hidden_size": 32,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "intermediate_size": 16, "intermediate_size_mlp": 24, **changes}


@pytest.mark.parametrize("changes, says", [
    (dict(layer_types=["chunked_attention"] * 4, no_rope_layers=[1, 1, 1, 0]),
     "layer_types[3]='chunked_attention'"),
    (dict(moe_layers=[0, 1, 3]), "moe_layers=[0, 1, 3]"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(model_type="llama4"), "text_config=None"),  # a multimodal file needs its text model
    (dict(no_rope_layers=[1, 2, 1, 0]), "no_rope_layers=[1, 2, 1, 0]"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_type 'yarn'"),
])
def test_refusals_name_the_field(changes, says):
    with pytest.raises(UnsupportedCheckpointError, match="config.json") as error:
        from_hf_config(_json(**changes))
    assert says in str(error.value)
    assert "\n" not in str(error.value)


def test_refusals_of_other_model_types_list_every_family():
    """An unknown model_type's error lists every model_type paxlite converts (Llama 4's and
    DeepSeek's among them); a shared expert outside the layouts that have one lists those."""
    with pytest.raises(UnsupportedCheckpointError) as error:
        from_hf_config({"model_type": "bert"})
    assert all(repr(family.value) in str(error.value) for family in Family), error.value
    assert "'llama4'" in str(error.value)
    with pytest.raises(UnsupportedCheckpointError) as error:
        from_hf_config({"model_type": "qwen2_moe", "shared_expert_intermediate_size": 8})
    for model_type in ("deepseek_v3", "deepseek_v2", "llama4_text", "gpt_oss"):
        assert repr(model_type) in str(error.value)


def test_chunks_refuse_a_kernel_without_them_in_one_line():
    _, config = from_hf_config(_json())
    assert dataclasses.replace(config, attention_kind="flash").attention_kind.value == "flash"
    with pytest.raises(ValueError, match="attention_chunk_size=8192 with attention implementation "
                                         "'pallas_triton': that kernel has no chunk pattern"):
        dataclasses.replace(config, attention_kind="flash",
                            attention_implementation="pallas_triton")


def test_published_scout_count_is_transformers_own():
    """Llama4Scout17B16E's count against transformers' count of the published text config, built
    on the meta device (no memory)."""
    import torch
    import transformers

    from paxlite.cli.catalogue import parameter_counts
    from paxlite.experiments.build import load_experiment

    published = transformers.Llama4TextConfig(
        vocab_size=202048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
        num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
        num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=1,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192},
        attention_chunk_size=8192, use_qk_norm=True, attn_temperature_tuning=True,
        floor_scale=8192, attn_scale=0.1, rms_norm_eps=1e-5, max_position_embeddings=10485760,
        tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(published)
    theirs = sum(p.numel() for p in model.parameters())
    experiment = load_experiment("meta-llama/Llama-4-Scout-17B-16E", [])
    import fiddle as fdl

    ours = fdl.build(experiment.model_config())
    assert parameter_counts(ours)[0] == theirs == 107_769_861_120
    # ... and the experiment's model is the one the published config converts to
    _, converted = from_hf_config(published.to_dict())
    same = ("layer_types", "attention_chunk_size", "qk_l2_norm", "query_temperature_floor",
            "query_temperature_scale", "rope_scaling", "rope_theta", "moe")
    moe = dataclasses.replace(ours.moe, grouped_matmul=converted.moe.grouped_matmul)
    assert {n: getattr(dataclasses.replace(ours, moe=moe), n) for n in same} == {
        n: getattr(converted, n) for n in same}


# ---------------------------------------------------------------- the command line
@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    """(the tiny model's directory with a tokenizer.json, its `convert --to=paxlite` output),
    converted once for the command-line tests."""
    pytest.importorskip("tokenizers")
    return convert_with_tokenizer(tiny[0], tmp_path_factory.mktemp("converted"))


def test_convert_generate_finetune_and_lora(tiny, converted, tmp_path, capsys):
    """`generate --prompt` on the converted directory through the model's tokenizer.json
    (transformers' greedy ids), FineTune and LoRA from it (one step each: what moves), convert
    --to=hf read back by transformers with the same logits."""
    import transformers

    from paxlite.__main__ import main

    _, model, want, _ = tiny
    hf_dir, out = converted
    texts = ["the quick brown fox said hello world to the lazy dog"]
    [ids] = generate_matches_transformers(model, hf_dir, out, texts, NEW, capsys,
                                          stop_at_eos=False)
    assert len(ids) > CHUNK

    for extra in ([], ["USE_LORA=true", "LORA_RANK=4", "LORA_TARGET_LAYERS=attention"]):
        _, before, after = finetune(out, tmp_path / f"job{len(extra)}", *extra)
        moved = {k for k in after if not np.array_equal(after[k], before[k])}
        lora = {k for k in moved if "lora" in k}
        assert moved and (lora == moved if extra else not lora), moved

    back = tmp_path / "hf_again"
    assert main(["convert", "--from=paxlite", "--to=hf", f"--input={out}",
                 f"--output={back}"]) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(
        back, attn_implementation="eager").eval()
    np.testing.assert_allclose(hf_logits(again, TOKENS), want, atol=1e-4, rtol=0)


# ---------------------------------------------------------------- the published multimodal form
def test_multimodal_checkpoint_reads_its_text_model(tiny, converted, tmp_path, caplog):
    """A tiny Llama4ForConditionalGeneration (model_type 'llama4') whose text model holds the
    tiny model's weights, as transformers saves it (text_config; tensors under language_model.,
    beside vision_model. and multi_modal_projector.): `hf.load` and `convert` read the text model
    (logits of transformers' Llama4ForCausalLM on the same weights; the same parameters as the
    text checkpoint's conversion), saying in one logged line what is left out; `convert --to=hf`
    writes it back as the text checkpoint, llama4_text."""
    import logging

    import transformers

    from paxlite.__main__ import main
    from paxlite.interop.hf_llama4 import TEXT_TOWER

    directory, model, _, pretrained = tiny
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=64, image_size=28, patch_size=14, vision_output_dim=32,
                  projector_input_dim=32, projector_output_dim=32)
    multimodal = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(
        text_config=model.config.to_dict(), vision_config=vision)).eval()
    multimodal.language_model.load_state_dict(model.state_dict())
    multimodal.save_pretrained(tmp_path / "llama4")
    written = json.loads((tmp_path / "llama4" / "config.json").read_text())
    stored = safetensors_of(tmp_path / "llama4")
    assert written["model_type"] == "llama4" and "text_config" in written
    assert {name.split(".")[0] for name in stored} == {
        "language_model", "vision_model", "multi_modal_projector"}
    assert sorted(TEXT_TOWER + name for name in safetensors_of(directory)) == sorted(
        name for name in stored if name.startswith(TEXT_TOWER))

    def notes():
        lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                 and "vision tower" in r.getMessage()]
        caplog.clear()
        return lines

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        loaded = hf.load(tmp_path / "llama4")
        [note] = notes()
        assert "model_type='llama4'" in note and "'vision_model.'" in note and "\n" not in note
        assert (loaded.family, loaded.config) == (Family.LLAMA4_TEXT, pretrained.config)
        np.testing.assert_allclose(loaded.logits(TOKENS), hf_logits(multimodal.language_model,
                                                                     TOKENS), atol=1e-4, rtol=0)
        jax.tree.map(np.testing.assert_array_equal, loaded.params, pretrained.params)

        out, back = tmp_path / "pax", tmp_path / "back"
        assert main(["convert", "--from=hf", "--to=paxlite", f"--input={tmp_path / 'llama4'}",
                     f"--output={out}"]) == 0
        assert len(notes()) == 1
    streamed, text = hf.from_paxlite(out), hf.from_paxlite(converted[1])
    assert streamed.config == text.config
    jax.tree.map(np.testing.assert_array_equal, streamed.params, text.params)
    assert main(["convert", "--from=paxlite", "--to=hf", f"--input={out}",
                 f"--output={back}"]) == 0
    again = json.loads((back / "config.json").read_text())
    assert (again["model_type"], again["architectures"]) == ("llama4_text", ["Llama4ForCausalLM"])
    original = safetensors_of(directory)
    ours = safetensors_of(back)
    assert sorted(ours) == sorted(original)
    for name in original:
        assert ours[name].tobytes() == original[name].tobytes(), name
