"""The registered DeepSeek experiments against the published config.json values: transformers 5.24
builds each on the meta device and counts its parameters, and paxlite's count of the experiment
(traced, and the closed form) equals it plus V3's router choice biases, which transformers keeps
as buffers and paxlite as parameters it never trains.

The traced count is the one the experiment's golden file pins (its `num_params`, which
test_registry_and_golden.py's test_golden computes from the abstractly traced model and compares
with the file): read here rather than traced a second time, since tracing DeepSeek-V3's 61 unrolled
layers costs ~7 CPU-s and the two files may run in different test processes."""

from __future__ import annotations

import os
import re

import fiddle as fdl
import pytest

from paxlite.cli.catalogue import parameter_counts
from paxlite.experiments import EXPERIMENTS
from paxlite.models.moe_params import closed_form_num_params
from tests.experiments.test_registry_and_golden import GOLDEN_DIR

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
        "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}
PUBLISHED = {  # name: (transformers config class, the published values, the count asked for)
    "DeepSeekV3": ("DeepseekV3Config", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
        topk_method="noaux_tc", n_group=8, topk_group=4, num_experts_per_tok=8,
        first_k_dense_replace=3, norm_topk_prob=True, tie_word_embeddings=False,
        rms_norm_eps=1e-6, max_position_embeddings=163840,
        rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}), 671_026_404_352),
    "DeepSeekV2Lite": ("DeepseekV2Config", dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        n_shared_experts=2, n_routed_experts=64, routed_scaling_factor=1.0, kv_lora_rank=512,
        q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
        topk_method="greedy", n_group=1, topk_group=1, num_experts_per_tok=6,
        first_k_dense_replace=1, norm_topk_prob=False, tie_word_embeddings=False,
        rms_norm_eps=1e-6, max_position_embeddings=163840,
        rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}), 15_706_484_224),
}


def _transformers_count(config_class: str, values: dict) -> tuple[int, int]:
    """(parameters, e_score_correction_bias entries) of the model transformers builds on meta."""
    import torch
    import transformers

    config = getattr(transformers, config_class)(**values)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    bias = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    return sum(p.numel() for p in model.parameters()), bias


def _golden_num_params(name: str) -> int:
    """The traced model's parameter count as the golden file pins it (module docstring)."""
    with open(os.path.join(GOLDEN_DIR, f"{name}.txt")) as f:
        [count] = re.findall(r"^num_params = (\d+)$", f.read(), flags=re.MULTILINE)
    return int(count)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_equal_transformers(name: str) -> None:
    config_class, values, asked = PUBLISHED[name]
    count, bias = _transformers_count(config_class, values)
    assert count == asked
    model = fdl.build(EXPERIMENTS[name].resolve({}).model_config())
    assert _golden_num_params(name) == closed_form_num_params(model) == count + bias
    assert bias == (58 * 256 if name == "DeepSeekV3" else 0)
    # what `list` and `show` print: transformers' count, the choice biases left out
    assert parameter_counts(model)[0] == count == asked


def test_hugging_face_ids_name_the_experiments() -> None:
    for hf_id, name in {"deepseek-ai/DeepSeek-V3": "DeepSeekV3",
                        "deepseek-ai/DeepSeek-V2-Lite": "DeepSeekV2Lite"}.items():
        assert EXPERIMENTS[hf_id] is EXPERIMENTS[name]


def test_bias_update_speed_reaches_v3s_router_and_is_refused_elsewhere() -> None:
    from paxlite.config.errors import ConfigError

    assert fdl.build(EXPERIMENTS["DeepSeekV3"].resolve({}).model_config()
                     ).moe.deepseek_router.bias_update_speed == 0.0  # off by default
    v3 = EXPERIMENTS["DeepSeekV3"].resolve({"MOE_BIAS_UPDATE_SPEED": 0.001})
    v3.validate()
    assert fdl.build(v3.model_config()).moe.deepseek_router.bias_update_speed == 0.001
    for name, speed, message in (
            ("DeepSeekV2Lite", 0.001, "DeepSeekV2Lite's router has no choice bias to move"),
            ("Mixtral8x7B", 0.001, "Mixtral8x7B's router has no choice bias to move"),
            ("DeepSeekV3", -1.0, "MOE_BIAS_UPDATE_SPEED=-1.0 must be a finite number >= 0")):
        with pytest.raises(ConfigError, match=message):
            EXPERIMENTS[name].resolve({"MOE_BIAS_UPDATE_SPEED": speed}).validate()
