"""Gemma 2 and Gemma 3 (text) against transformers, in float32, on tiny models transformers writes
here: 4 layers of both attention kinds with a window of 4, shorter than the sequences; Gemma 2
with its soft-caps made small enough to bite, Gemma 3 with q/k norms, its own local RoPE base and
linear scaling on the global layers. The logits of `hf.load` within 1e-4, greedy generation equal
to `generate(do_sample=False)` with a prompt longer than the window, `hf.save` outputs that
transformers loads with the same logits, config.json in transformers 5's form and in 4.x's, and
one clear refusal per field paxlite does not implement. The layers' own tests (sharded training,
scan units, kernels) are tests/models/test_gemma_layers.py."""

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
from paxlite.models.open_model_fields import LayerAttention
from tests.interop.conftest import _perturb_norms, hf_logits
from tests.interop.test_hf_export import train_bpe

TOKENS = np.random.default_rng(3).integers(0, 256, size=(2, 24)).astype(np.int32)
WINDOW = 4
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.1,
             max_position_embeddings=64, sliding_window=WINDOW, query_pre_attn_scalar=24)
FAMILIES = {  # family -> (config class, its settings)
    Family.GEMMA2: ("Gemma2Config", dict(attn_logit_softcapping=2.0,
                                         final_logit_softcapping=8.0)),
    Family.GEMMA3_TEXT: ("Gemma3TextConfig", dict(
        sliding_window_pattern=3, final_logit_softcapping=3.0, rope_theta=10000.0,
        rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 8.0})),
}
PROMPTS = [[17, 3, 99, 200, 5, 8, 41, 7, 90, 11], [61, 2, 3]]  # the first longer than WINDOW
NEW = 6
S, F = LayerAttention.SLIDING, LayerAttention.FULL


def _make(directory, family):
    import torch
    import transformers

    torch.manual_seed(0)
    config_class, settings = FAMILIES[family]
    config = getattr(transformers, config_class)(**SIZES, **settings)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager").eval()
    _perturb_norms(model, names=("norm",))  # (1 + w): w starts at 0
    with torch.no_grad():  # layers that count beside the sqrt(d)-scaled embeddings: greedy
        for name, param in model.named_parameters():  # decoding then varies its tokens
            if "post_" in name:
                param.add_(3.0)
    model.save_pretrained(directory)
    return model


def legacy_form(hf_config: dict) -> dict:
    """transformers 4.x's config.json for a 5.x one: top-level rope_theta and rope_scaling (and
    Gemma 3's rope_local_base_freq); Gemma 3's layers by sliding_window_pattern alone."""
    legacy = dict(hf_config)
    rope = legacy.pop("rope_parameters")
    if legacy["model_type"] == "gemma3_text":
        legacy["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
        del legacy["layer_types"], legacy["_sliding_window_pattern"]
    rope = dict(rope)
    legacy["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    legacy["rope_scaling"] = None if kind == "default" else {"rope_type": kind, **rope}
    return legacy


@pytest.fixture(scope="module", params=list(FAMILIES), ids=lambda f: f.value)
def family_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param.value)
    model = _make(directory, request.param)
    return request.param, directory, model, hf_logits(model, TOKENS), hf.load(directory)


def test_logits_match_transformers_in_both_config_forms(family_dir, tmp_path):
    import transformers

    family, directory, _, want, pretrained = family_dir
    assert pretrained.family is family
    np.testing.assert_allclose(pretrained.logits(TOKENS), want, atol=1e-4, rtol=0)

    written = json.loads((directory / "config.json").read_text())
    legacy = legacy_form(written)
    assert from_hf_config(legacy) == from_hf_config(written)
    # transformers reads the 4.x form as the same model (its RoPE and layers)
    parsed = transformers.AutoConfig.for_model(**legacy)
    assert (parsed.rope_parameters, parsed.layer_types) == (written["rope_parameters"],
                                                            written["layer_types"])
    shutil.copytree(directory, tmp_path / "legacy")
    (tmp_path / "legacy" / "config.json").write_text(json.dumps(legacy))
    assert hf.load(tmp_path / "legacy").config == pretrained.config


def test_features_are_read(family_dir):
    family, _, _, _, pretrained = family_dir
    config = pretrained.config
    common = dict(norm="gemma_rms_norm", activation="gelu_tanh", post_norms=True,
                  scale_embeddings=True, query_scale_dims=24, sliding_window=WINDOW,
                  tie_embeddings=True)
    expected = {
        Family.GEMMA2: dict(common, layer_types=(S, F, S, F), attention_logit_cap=2.0,
                            final_logit_cap=8.0, qk_norm=False, local_rope_theta=None,
                            rope_scaling=None, rope_theta=10000.0),
        Family.GEMMA3_TEXT: dict(common, layer_types=(S, S, F, S), attention_logit_cap=None,
                                 final_logit_cap=3.0, qk_norm=True, local_rope_theta=100.0,
                                 rope_theta=10000.0),
    }[family]
    assert {name: getattr(config, name) for name in expected} == expected
    if family is Family.GEMMA3_TEXT:
        assert (config.rope_scaling.kind.value, config.rope_scaling.factor) == ("linear", 8.0)
    assert family_of_config(config) is family


def test_greedy_generation_matches_transformers(family_dir):
    import torch

    _, _, model, _, pretrained = family_dir
    want = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW,
                                 eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(prompt):].tolist())
    assert generate(pretrained.config, pretrained.params, PROMPTS, max_new_tokens=NEW) == want


def test_save_loads_in_transformers_with_the_same_logits(family_dir, tmp_path):
    import sentencepiece as spm
    import transformers

    family, directory, _, want, pretrained = family_dir
    vocab = train_bpe(tmp_path / "spm", dummy_prefix=False)  # as Gemma's: no "▁" before the text
    hf.save(pretrained, tmp_path / "out", max_shard_size="100KB",  # sharded, as big models are
            vocab_path=vocab)
    # Gemma's tokenizer class, and no "▁" added before the text, as the SentencePiece model adds
    # none (LlamaTokenizer's settings would add one and encode every text differently)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert type(tokenizer).__name__ == "GemmaTokenizer"
    sp = spm.SentencePieceProcessor(model_file=vocab)
    for text in ("hello world!", "the lazy dog said hello to the fox", "a fox, 42 dogs!"):
        assert tokenizer.encode(text) == [sp.bos_id(), *sp.encode(text)], text
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == family.value
    assert from_hf_config(written)[1] == pretrained.config
    assert from_hf_config(legacy_form(written))[1] == pretrained.config
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    np.testing.assert_allclose(hf_logits(model, TOKENS), want, atol=1e-4, rtol=0)
    # the (1 + w) norm weights are written as read, q/k rows back in HF's order
    source = transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), source[name].numpy(), err_msg=name)


def test_a_model_without_sliding_layers_saves_a_window_transformers_runs(family_dir, tmp_path):
    """transformers' Gemma needs a `sliding_window` even when every layer is global: `hf.save`
    writes one over the whole context, and reading it back gives the model without a window."""
    import transformers

    _, _, _, _, pretrained = family_dir
    config = dataclasses.replace(pretrained.config, layer_types=(F,) * 4, sliding_window=None)
    global_only = dataclasses.replace(pretrained, config=config)
    hf.save(global_only, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["sliding_window"] == config.max_seq_len
    assert hf.load(tmp_path / "out").config == config
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    np.testing.assert_allclose(hf_logits(model, TOKENS), global_only.logits(TOKENS), atol=1e-4,
                               rtol=0)


def test_convert_into_gemma2_9b_stacks_whole_periods(family_dir, tmp_path, monkeypatch, capfd):
    """`convert --fdl_config=Gemma2_9B` (shrunk to the tiny shapes) writes the experiment's scanned
    stack, units of one sliding and one global layer, which reads back as the same model and
    exports to transformers with the same logits; an experiment whose soft-cap differs is refused
    naming it. Gemma 3's pattern here repeats every 3 of 4 layers: it cannot be scanned."""
    import jax
    import transformers

    from paxlite.checkpointing.pretrained import model_config_from_json
    from tests.in_process import paxlite_command

    family, directory, _, want, pretrained = family_dir
    if family is Family.GEMMA3_TEXT:
        with pytest.raises(ValueError, match="layer_types repeats every 3 layers, which does not "
                                             "divide num_layers=4: scan_layers=True"):
            dataclasses.replace(pretrained.config, scan_layers=True)
        return
    run = paxlite_command(monkeypatch, capfd)
    shapes = [f"--fdl.{name}={value}" for name, value in dict(
        NUM_LAYERS=4, NUM_HEADS=4, NUM_KV_HEADS=2, MODEL_DIMS=64, HIDDEN_DIMS=96, VOCAB_SIZE=256,
        DIMS_PER_HEAD=16, SLIDING_WINDOW=WINDOW, QUERY_PRE_ATTN_SCALAR=24,
        FINAL_LOGIT_SOFTCAP=8.0).items()]
    convert = ["convert", "--from=hf", "--to=paxlite", f"--input={directory}",
               "--fdl_config=Gemma2_9B", *shapes]
    refused = run(*convert, f"--output={tmp_path / 'refused'}")
    assert refused.returncode == 2
    assert "attention_logit_cap: converted 2.0, experiment 50.0" in refused.stderr
    result = run(*convert, f"--output={tmp_path / 'ckpt'}", "--fdl.ATTENTION_LOGIT_SOFTCAP=2.0")
    assert result.returncode == 0, result.stderr
    config = model_config_from_json((tmp_path / "ckpt" / "model_config.json").read_text())
    assert (config.scan_layers, config.layers_per_scan_unit) == (True, 2)
    back = hf.from_paxlite(tmp_path / "ckpt", dtype="float32")  # restored as the scanned model
    jax.tree.map(np.testing.assert_array_equal, back.params, pretrained.params)
    hf.stream_paxlite_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager").eval()
    np.testing.assert_allclose(hf_logits(model, TOKENS), want, atol=1e-4, rtol=0)


def test_gelu_tanh_is_gelu_pytorch_tanh():
    import jax
    import torch
    from transformers.activations import ACT2FN

    x = np.linspace(-6, 6, 101, dtype=np.float32)
    np.testing.assert_allclose(jax.nn.gelu(x, approximate=True),
                               ACT2FN["gelu_pytorch_tanh"](torch.tensor(x)).numpy(), atol=1e-6)


def _gemma_json(**changes):
    base = {"model_type": "gemma2", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8}
    return {**base, **changes}


@pytest.mark.parametrize("changes, field", [
    (dict(model_type="gemma3"), "model_type='gemma3'"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(hidden_activation="silu"), "hidden_activation='silu'"),
    (dict(layer_types=["sliding_attention", "chunked_attention"]), "layer_types=["),
    (dict(layer_types=["full_attention"]), "it has 1 entries for num_hidden_layers=2"),
    (dict(sliding_window=None), "sliding_window=None"),
    # transformers builds the sliding mask whatever the layers, and fails without a window
    (dict(sliding_window=None, layer_types=["full_attention"] * 2), "sliding_window=None"),
    (dict(query_pre_attn_scalar=20.5), "query_pre_attn_scalar=20.5"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     "rope_type 'yarn' is not one"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                           "partial_rotary_factor": 0.5}), "partial_rotary_factor=0.5"),
    (dict(model_type="gemma3_text", rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "rope_parameters['sliding_attention']="),
    (dict(model_type="gemma3_text", rope_parameters={"rope_type": "default"}),
     "one entry per layer type"),
    # Llama 4's layer kinds are paxlite's too, not Gemma 3's
    (dict(model_type="gemma3_text", rope_parameters={"chunked_attention": {
        "rope_type": "default"}}), "one entry per layer type (['full_attention', 'sliding"),
    # 4.x's form is named as the file spells it
    (dict(model_type="gemma3_text", rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     "config.json rope_scaling="),
])
def test_refusals_name_the_field(changes, field):
    with pytest.raises(UnsupportedCheckpointError, match="config.json") as error:
        from_hf_config(_gemma_json(**changes))
    assert field in str(error.value)
    assert "\n" not in str(error.value)


def test_family_of_config_tells_gemma_from_the_others():
    _, gemma2 = from_hf_config(_gemma_json())
    _, gemma3 = from_hf_config(_gemma_json(model_type="gemma3_text", num_hidden_layers=12))
    assert family_of_config(gemma2) is Family.GEMMA2
    assert family_of_config(gemma3) is Family.GEMMA3_TEXT
    _, llama = from_hf_config({**_gemma_json(), "model_type": "llama"})
    assert family_of_config(llama) is Family.LLAMA
    with pytest.raises(UnsupportedCheckpointError, match="as LLaMA it differs in norm="):
        family_of_config(dataclasses.replace(gemma2, qk_norm=True))  # no family has both
    with pytest.raises(UnsupportedCheckpointError,
                       match=r"as LLaMA it differs in .*post_norms=True \(needs False\)"):
        family_of_config(dataclasses.replace(gemma2, norm="rms_norm", activation="silu"))
    # Gemma 3's 4.x form writes the pattern it follows, Gemma 2's alternation is its default
    written = to_hf_config(gemma3, family=Family.GEMMA3_TEXT)
    assert written["sliding_window_pattern"] == 6
    assert written["rope_parameters"]["sliding_attention"] == {"rope_type": "default",
                                                                "rope_theta": 10000.0}
