"""gpt-oss's registered experiments (experiments/gpt_oss.py): their parameter counts equal to
transformers' count of the published config.json values (GptOssConfig on the meta device, nothing
allocated), and paxlite's own counts (`list`'s closed form and the traced model) equal to both;
the Hugging Face ids as aliases; the model the same as a conversion of that config.json reads."""

import dataclasses

import fiddle as fdl
import pytest

from paxlite.cli.catalogue import parameter_counts
from paxlite.experiments import EXPERIMENTS
from paxlite.experiments.build import load_experiment
from paxlite.interop.hf_config import Family, family_of_config, from_hf_config
from tests.experiments.traced import traced_num_params

# The published config.json values (openai/gpt-oss-20b; the 120b: 36 layers, 128 experts)
PUBLISHED_20B = dict(
    hidden_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
    head_dim=64, num_local_experts=32, num_experts_per_tok=4, intermediate_size=2880,
    vocab_size=201088, sliding_window=128, swiglu_limit=7.0, tie_word_embeddings=False,
    max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=True,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096})
PUBLISHED = {
    "GptOss20B": ("openai/gpt-oss-20b", PUBLISHED_20B, 20_914_757_184),
    "GptOss120B": ("openai/gpt-oss-120b",
                   {**PUBLISHED_20B, "num_hidden_layers": 36, "num_local_experts": 128},
                   116_829_156_672),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_are_transformers_count_of_the_published_config(name: str) -> None:
    import torch
    import transformers

    hf_id, values, count = PUBLISHED[name]
    config = transformers.GptOssConfig(**values)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in theirs.parameters()) == count
    model = fdl.build(EXPERIMENTS[name].resolve({}).model_config())
    assert parameter_counts(model)[0] == traced_num_params(model) == count
    assert type(load_experiment(hf_id)) is EXPERIMENTS[name]
    # the experiment's model is what converting that config.json gives, up to the training setup
    _, converted = from_hf_config({"model_type": "gpt_oss", **config.to_dict()})
    setup = ("max_seq_len", "dtype", "scan_layers", "remat_policy", "attention_kind",
             "attention_implementation", "init_std", "softmax_init_std", "moe")
    assert dataclasses.replace(model, **{f: getattr(converted, f) for f in setup}) == converted
    moe, want = model.moe, converted.moe
    assert dataclasses.replace(moe, load_balancing_weight=want.load_balancing_weight,
                               grouped_matmul=want.grouped_matmul) == want
    assert family_of_config(model) is Family.GPT_OSS
    assert (model.attention_kind.value, model.layers_per_scan_unit) == ("dot_product", 2)
