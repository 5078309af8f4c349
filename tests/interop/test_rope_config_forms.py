"""RoPE fields in a config.json as transformers reads them, whatever mix of forms a file holds:
each case is parsed by transformers' own config class (its standardised `rope_parameters`) and by
paxlite, and the base and scaling of every layer kind must agree. The files people hand-edit hold
both forms: paxlite's own --to=hf writes 5.x's `rope_parameters` and 4.x's `rope_scaling`."""

import pytest

from paxlite.interop.hf_config import UnsupportedCheckpointError, from_hf_config
from paxlite.models.open_model_fields import LayerAttention

SHAPE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "max_position_embeddings": 64}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
LLAMA3_X4 = {**LLAMA3, "factor": 4.0}


def _theirs(config: dict) -> dict:
    """transformers' standardised rope_parameters of ``config``: {layer kind: its entry}."""
    import transformers

    rope = transformers.AutoConfig.for_model(**config).rope_parameters
    return rope if "full_attention" in rope else {"full_attention": rope}


def _ours(config: dict) -> dict:
    """paxlite's reading in the same shape: {layer kind: (base, scaling kind, factor)}."""
    model = from_hf_config(config)[1]
    scaling = model.rope_scaling
    out = {"full_attention": (model.rope_theta, scaling.kind.value if scaling else "default",
                              scaling.factor if scaling else None)}
    if model.layer_types and LayerAttention.SLIDING in model.layer_types:
        out["sliding_attention"] = (model.local_rope_theta, "default", None)
    return out


def _as_ours(theirs: dict) -> dict:
    return {kind: (float(entry["rope_theta"]), entry["rope_type"],
                   None if entry["rope_type"] == "default" else float(entry["factor"]))
            for kind, entry in theirs.items()}


LLAMA_CASES = {
    "5.x only": dict(rope_parameters={**LLAMA3, "rope_theta": 5e5}),
    "4.x only": dict(rope_theta=5e5, rope_scaling=LLAMA3),
    # rope_scaling, when given, replaces rope_parameters whole: its base is the top-level one
    "scaling beside plain parameters": dict(rope_theta=2e5,
                                            rope_parameters={"rope_type": "default",
                                                             "rope_theta": 5e5},
                                            rope_scaling=LLAMA3),
    "two scalings": dict(rope_parameters={**LLAMA3, "rope_theta": 5e5},
                         rope_scaling=LLAMA3_X4),
    "two scalings, no top-level base": dict(rope_parameters={**LLAMA3_X4, "rope_theta": 5e5},
                                            rope_scaling=LLAMA3),
    "null scaling beside parameters": dict(rope_parameters={**LLAMA3, "rope_theta": 5e5},
                                           rope_scaling=None),
}


@pytest.mark.parametrize("fields", LLAMA_CASES.values(), ids=LLAMA_CASES.keys())
def test_llama_reads_rope_as_transformers(fields):
    config = {"model_type": "llama", **SHAPE, **fields}
    assert _ours(config) == _as_ours(_theirs(config))


GEMMA3_PER_TYPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
GEMMA3_CASES = {
    "5.x only": dict(rope_parameters=GEMMA3_PER_TYPE),
    "4.x only": dict(rope_theta=1e6, rope_local_base_freq=1e4,
                     rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "4.x, no scaling": dict(rope_theta=1e6, rope_local_base_freq=100.0),
    # rope_scaling is merged into the global layers' entry, over what it holds
    "scaling over a scaled entry": dict(rope_parameters=GEMMA3_PER_TYPE,
                                        rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "scaling over a plain entry": dict(
        rope_parameters={**GEMMA3_PER_TYPE,
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
        rope_scaling={"rope_type": "linear", "factor": 8.0}),
    # transformers keeps the entry's rope_type 'default' when the kind is spelled 'type'
    "kind spelled 'type'": dict(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 8.0}),
    "only the global entry": dict(rope_parameters={"full_attention": {"rope_type": "default",
                                                                      "rope_theta": 5e5}},
                                  rope_local_base_freq=50.0),
}


@pytest.mark.parametrize("fields", GEMMA3_CASES.values(), ids=GEMMA3_CASES.keys())
def test_gemma3_reads_rope_as_transformers(fields):
    config = {"model_type": "gemma3_text", **SHAPE, "sliding_window": 4, **fields}
    assert _ours(config) == _as_ours(_theirs(config))


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2", "gemma3_text"])
def test_a_top_level_partial_rotation_is_refused(model_type):
    """transformers moves it into the RoPE object; paxlite rotates every dimension."""
    with pytest.raises(UnsupportedCheckpointError, match="partial_rotary_factor=0.5") as error:
        from_hf_config({"model_type": model_type, **SHAPE, "partial_rotary_factor": 0.5})
    assert "\n" not in str(error.value)
    assert from_hf_config({"model_type": model_type, **SHAPE, "partial_rotary_factor": 1.0})
