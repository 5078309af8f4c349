"""YaRN RoPE (`rope_type: "yarn"`) against transformers' own `ROPE_INIT_FUNCTIONS["yarn"]`: the
inverse frequencies and the attention factor that multiplies cos and sin, for gpt-oss's and
DeepSeek's published values and the corner cases of the rule (no truncation, an explicit
attention_factor, mscale without mscale_all_dim, the original context left out); then
query-key scores through paxlite's rotation against transformers' rotate-half one, and the
config.json reader and writer both ways."""

import math

import numpy as np
import pytest

from paxlite.interop.hf_rope import YARN_ONLY, rope_entry, rope_of
from paxlite.models.rotary import RopeScaling, RopeScalingKind, apply_rotary, rotary_angles

HEAD_DIM = 64
GPT_OSS = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
           "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
DEEPSEEK_V3 = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
               "rope_theta": 10000.0}
CASES = {  # name -> (rope_parameters, max_position_embeddings)
    "gpt-oss": (GPT_OSS, 131072),
    "DeepSeek-V3": (DEEPSEEK_V3, 163840),
    "DeepSeek-V2-Lite": ({**DEEPSEEK_V3, "mscale": 0.707, "mscale_all_dim": 0.707}, 163840),
    "mscale only": ({**DEEPSEEK_V3, "mscale": 0.707, "mscale_all_dim": None}, 163840),
    "unequal mscales": ({**DEEPSEEK_V3, "mscale": 1.0, "mscale_all_dim": 0.5}, 163840),
    "attention_factor": ({**GPT_OSS, "attention_factor": 0.8, "truncate": True}, 131072),
    "defaults": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                  "rope_theta": 10000.0}, 128),
    "original from max_position_embeddings": ({"rope_type": "yarn", "factor": 2.0,
                                               "rope_theta": 10000.0, "beta_fast": 8.0,
                                               "beta_slow": 2.0}, 256),
}


def _hf_config(rope: dict, max_positions: int):
    import transformers

    rope = {k: v for k, v in rope.items() if v is not None}
    return transformers.LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4,
                                    head_dim=HEAD_DIM, max_position_embeddings=max_positions,
                                    rope_parameters=rope)


def _theirs(rope: dict, max_positions: int) -> tuple[np.ndarray, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](_hf_config(rope, max_positions))
    return inv_freq.numpy(), float(scaling)


def _ours(rope: dict, max_positions: int) -> tuple[float, RopeScaling]:
    hf = {"rope_parameters": {k: v for k, v in rope.items() if v is not None},
          "max_position_embeddings": max_positions}
    return rope_of(hf, kinds=YARN_ONLY)


@pytest.mark.parametrize("name", list(CASES))
def test_yarn_frequencies_and_attention_factor_match_transformers(name: str) -> None:
    rope, max_positions = CASES[name]
    inv_freq, attention = _theirs(rope, max_positions)
    theta, scaling = _ours(rope, max_positions)
    assert scaling.kind is RopeScalingKind.YARN
    ones = np.ones((1, 1), np.int32)
    ours = np.asarray(rotary_angles(ones, dims_per_head=HEAD_DIM, theta=theta,
                                    scaling=scaling))[0, 0]
    np.testing.assert_allclose(ours, inv_freq, rtol=2e-6, atol=0)
    assert scaling.attention_scaling() == pytest.approx(attention, rel=1e-12)


def test_published_attention_factors() -> None:
    """The three published configurations' factors, by hand: gpt-oss 0.1 ln 32 + 1; V3 1 (mscale
    over mscale_all_dim, equal); V2-Lite 1 too."""
    assert _ours(*CASES["gpt-oss"])[1].attention_scaling() == pytest.approx(
        0.1 * math.log(32) + 1)
    assert _ours(*CASES["DeepSeek-V3"])[1].attention_scaling() == 1.0
    assert _ours(*CASES["DeepSeek-V2-Lite"])[1].attention_scaling() == 1.0


def _to_interleaved(x: np.ndarray) -> np.ndarray:
    """rotate-half rows [.., H] -> interleaved ones (meta_row[2j + p] = hf_row[p * H/2 + j])."""
    half = x.shape[-1] // 2
    return np.stack([x[..., :half], x[..., half:]], axis=-1).reshape(x.shape)


@pytest.mark.parametrize("name", ["gpt-oss", "DeepSeek-V2-Lite"])
def test_yarn_attention_scores_match_transformers_rotation(name: str) -> None:
    """q.k scores after paxlite's rotation equal transformers' (LLaMA's rotate-half with YaRN's
    cos and sin, attention factor included) at positions well past the original context."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    rope, max_positions = CASES[name]
    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, 2, 6, HEAD_DIM)).astype(np.float32)  # [B, N, T, H] (theirs)
    k = rng.normal(size=(1, 2, 6, HEAD_DIM)).astype(np.float32)
    positions = np.array([[0, 1, 7, 4095, 9000, 60000]], np.int32)
    embedding = LlamaRotaryEmbedding(_hf_config(rope, max_positions))
    cos, sin = embedding(torch.from_numpy(q), torch.from_numpy(positions).long())
    hq, hk = apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k), cos, sin)
    theirs = torch.einsum("bnth,bnsh->bnts", hq, hk).numpy()
    theta, scaling = _ours(rope, max_positions)

    def rotate(x: np.ndarray, scaling: RopeScaling | None) -> np.ndarray:
        return np.asarray(apply_rotary(_to_interleaved(x.transpose(0, 2, 1, 3)), positions,
                                       theta=theta, scaling=scaling))

    ours = np.einsum("btnh,bsnh->bnts", rotate(q, scaling), rotate(k, scaling))
    # float32 angles at position 60000 carry ~4e-3 rad of rounding either side (pos * ulp)
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=5e-3)
    plain = np.einsum("btnh,bsnh->bnts", rotate(q, None), rotate(k, None))
    assert not np.allclose(ours, plain, atol=1e-2)  # the scaling is in there


@pytest.mark.parametrize("name", ["gpt-oss", "DeepSeek-V2-Lite", "mscale only",
                                  "original from max_position_embeddings"])
def test_yarn_config_json_round_trip(name: str) -> None:
    """What is read is written back (5.x's rope_parameters and 4.x's rope_scaling), and both
    read again to the same scaling."""
    rope, max_positions = CASES[name]
    theta, scaling = _ours(rope, max_positions)
    parameters, legacy = rope_entry(theta=theta, scaling=scaling)
    assert parameters["rope_type"] == legacy["rope_type"] == "yarn"
    for field in ("mscale", "mscale_all_dim", "attention_factor"):
        assert (field in legacy) == (rope.get(field) is not None)
    for hf in ({"rope_parameters": parameters}, {"rope_theta": theta, "rope_scaling": legacy}):
        assert rope_of({**hf, "max_position_embeddings": max_positions},
                       kinds=YARN_ONLY) == (theta, scaling)


def test_yarn_refusals() -> None:
    from paxlite.interop.errors import UnsupportedCheckpointError

    with pytest.raises(ValueError, match=r"RopeScaling.beta_fast=-1.0 must be a positive number"):
        RopeScaling(kind="yarn", beta_fast=-1.0)
    with pytest.raises(ValueError, match=r"RopeScaling.truncate='no' must be true or false"):
        RopeScaling(kind="yarn", truncate="no")
    with pytest.raises(UnsupportedCheckpointError, match="rope_type 'yarn' is not one"):
        rope_of({"rope_parameters": GPT_OSS})  # LLaMA's reader: llama3 only
    with pytest.raises(UnsupportedCheckpointError, match="has no factor"):
        rope_of({"rope_parameters": {"rope_type": "yarn"}}, kinds=YARN_ONLY)
