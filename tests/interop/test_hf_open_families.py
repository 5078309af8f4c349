"""LLaMA-3 (llama3 RoPE scaling, tied embeddings), Mistral (sliding window), Qwen2 (q/k/v biases)
and Qwen3 (q/k norms, its own head_dim) against transformers, in float32: the logits of
`hf.load` within 1e-4, greedy generation equal to `generate(do_sample=False)` (Mistral with
prompts longer than its window), `hf.save` outputs that transformers loads with the same logits,
config.json in transformers 5's form and in 4.x's (written here from it), and one clear refusal
per feature paxlite does not implement."""

import dataclasses
import json
import shutil

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
from tests.interop.conftest import _perturb_norms, hf_logits

TOKENS = np.random.default_rng(3).integers(0, 256, size=(2, 24)).astype(np.int32)
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, initializer_range=0.1, max_position_embeddings=64)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
WINDOW = 4
FAMILIES = {  # family -> (config class, its settings)
    Family.LLAMA: ("LlamaConfig", dict(num_key_value_heads=2, rope_parameters=LLAMA3_ROPE,
                                       tie_word_embeddings=True)),
    Family.MISTRAL: ("MistralConfig", dict(num_key_value_heads=2, sliding_window=WINDOW)),
    Family.QWEN2: ("Qwen2Config", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    Family.QWEN3: ("Qwen3Config", dict(num_key_value_heads=2, head_dim=24)),
}
PROMPTS = [[17, 3, 99, 200, 5, 8, 41, 7, 90, 11], [61, 2, 3]]  # the first longer than WINDOW
NEW = 6


def _make(directory, family):
    import torch
    import transformers

    torch.manual_seed(0)
    config_class, settings = FAMILIES[family]
    config = getattr(transformers, config_class)(**SIZES, **settings)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager").eval()
    _perturb_norms(model, names=("norm", "bias"))
    model.save_pretrained(directory)
    return model


def legacy_form(hf_config: dict, *, spell_type: bool = False) -> dict:
    """transformers 4.x's config.json for a 5.x one: top-level rope_theta and rope_scaling."""
    legacy = dict(hf_config)
    rope = dict(legacy.pop("rope_parameters"))
    legacy["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    legacy["rope_scaling"] = None if kind == "default" else {
        "type" if spell_type else "rope_type": kind, **rope}
    return legacy


@pytest.fixture(scope="module", params=list(FAMILIES), ids=lambda f: f.value)
def family_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param.value)
    model = _make(directory, request.param)
    return request.param, directory, model, hf_logits(model, TOKENS)


def test_logits_match_transformers_in_both_config_forms(family_dir, tmp_path):
    family, directory, _, want = family_dir
    pretrained = hf.load(directory)
    assert pretrained.family is family
    np.testing.assert_allclose(pretrained.logits(TOKENS), want, atol=1e-4, rtol=0)

    shutil.copytree(directory, tmp_path / "legacy")
    written = json.loads((directory / "config.json").read_text())
    legacy = legacy_form(written, spell_type=family is Family.LLAMA)
    (tmp_path / "legacy" / "config.json").write_text(json.dumps(legacy))
    assert from_hf_config(legacy) == from_hf_config(written)
    assert hf.load(tmp_path / "legacy").config == pretrained.config


def test_features_are_read(family_dir):
    family, directory, _, _ = family_dir
    config = hf.load(directory).config
    expected = {
        Family.LLAMA: dict(tie_embeddings=True, qkv_bias=None, qk_norm=False,
                           sliding_window=None),
        Family.MISTRAL: dict(sliding_window=WINDOW, qk_norm=False, rope_scaling=None),
        Family.QWEN2: dict(qkv_bias=True, use_bias=False, tie_embeddings=True, qk_norm=False),
        Family.QWEN3: dict(qk_norm=True, dims_per_head=24, qkv_bias=None, sliding_window=None),
    }[family]
    assert {name: getattr(config, name) for name in expected} == expected
    if family is Family.LLAMA:
        scaling = config.rope_scaling
        assert (scaling.kind.value, scaling.factor, scaling.original_max_position_embeddings,
                config.rope_theta) == ("llama3", 8.0, 16, 500000.0)
    assert family_of_config(config) is family


def test_greedy_generation_matches_transformers(family_dir):
    import torch

    _, directory, model, _ = family_dir
    want = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW,
                                 eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(prompt):].tolist())
    pretrained = hf.load(directory)
    config = dataclasses.replace(pretrained.config, scan_layers=False)
    assert generate(config, pretrained.params, PROMPTS, max_new_tokens=NEW) == want


def test_save_loads_in_transformers_with_the_same_logits(family_dir, tmp_path):
    import transformers

    family, directory, _, want = family_dir
    pretrained = hf.load(directory)
    hf.save(pretrained, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == family.value
    assert from_hf_config(written)[1] == pretrained.config
    assert from_hf_config(legacy_form(written))[1] == pretrained.config
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    np.testing.assert_allclose(hf_logits(model, TOKENS), want, atol=1e-4, rtol=0)
    again = hf.load(tmp_path / "out")
    for name, array in again.params["layers_0"]["attention"].items():
        for leaf, value in array.items():
            np.testing.assert_array_equal(
                value, pretrained.params["layers_0"]["attention"][name][leaf])


def _llama_json(**changes):
    base = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    return {**base, **changes}


@pytest.mark.parametrize("changes, field", [
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     "rope_parameters={'rope_type': 'yarn'"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_type 'linear' is not one"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     "rope_scaling={'rope_type': 'dynamic'"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=8),
     "use_sliding_window=True"),
    (dict(model_type="qwen3", layer_types=["full_attention", "sliding_attention"]),
     "layer_types=['sliding_attention']"),
    (dict(model_type="qwen3", attention_bias=True), "attention_bias=True"),
    (dict(model_type="mistral", rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 16}),
     "rope_scaling=RopeScaling("),
    (dict(sliding_window=8), "sliding_window=8"),
])
def test_refusals_name_the_field(changes, field):
    with pytest.raises(UnsupportedCheckpointError, match="config.json") as error:
        from_hf_config(_llama_json(**changes))
    assert field in str(error.value)
    assert "\n" not in str(error.value)


def test_family_of_config_tells_the_families_apart():
    _, llama = from_hf_config(_llama_json())
    assert family_of_config(llama) is Family.LLAMA
    windowless = from_hf_config(_llama_json(model_type="mistral", sliding_window=None))[1]
    assert family_of_config(windowless) is Family.LLAMA  # the same model as a LLaMA
    assert family_of_config(windowless, prefer=Family.MISTRAL) is Family.MISTRAL
    assert to_hf_config(windowless, family=Family.MISTRAL)["sliding_window"] is None
    both = dataclasses.replace(llama, qk_norm=True, qkv_bias=True)
    with pytest.raises(UnsupportedCheckpointError, match="; as Qwen3 in qkv_bias"):
        family_of_config(both)


def test_convert_into_an_experiment_compares_the_new_architecture_fields():
    """`convert --fdl_config=NAME` refuses a checkpoint whose attention differs from the
    experiment's: each new switch is compared, not taken from the experiment."""
    from paxlite.cli.conversion import architecture_differences
    from paxlite.models.rotary import RopeScaling, RopeScalingKind

    _, base = from_hf_config(_llama_json())
    scaling = RopeScaling(kind=RopeScalingKind.LLAMA3, factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=16)
    changed = dataclasses.replace(base, qk_norm=True, qkv_bias=True, sliding_window=4,
                                  rope_scaling=scaling)
    assert architecture_differences(base, want=base) == []
    differences = architecture_differences(base, want=changed)
    assert [d.split(":")[0] for d in differences] == [
        "uses_qkv_bias", "qk_norm", "sliding_window", "rope_scaling"]
    assert "sliding_window: converted None, experiment 4" in differences
