"""DeepSeek's FLOPs per token (train/flops.py) term by term against hand counts: multi-head latent
attention's projections (query through its latent or one projection, kv_a, kv_b, output of
v_head_dim) and its attention (scores over qk_head_dim, context over v_head_dim), the shared
expert, the router, dense first layers; and the registered DeepSeekV3 / DeepSeekV2Lite counted from
their published sizes."""

from __future__ import annotations

import dataclasses

import pytest

from paxlite.train.flops import LatentAttentionSizes, flops_per_token

# D, H, h = nope 16 + rope 8, v, r_kv, r_q, dense F, vocabulary, S, layers (1 dense, 2 MoE),
# E experts of F_e (top-k), shared expert F_s
D, H, NOPE, ROPE, V, R_KV, R_Q, F, VOCAB, S, L, MOE_L = 64, 4, 16, 8, 12, 32, 48, 100, 50, 10, 3, 2
E, K, F_E, F_S = 8, 2, 20, 40
HEAD = NOPE + ROPE
MLA = LatentAttentionSizes(kv_lora_rank=R_KV, qk_rope_head_dims=ROPE, v_head_dims=V,
                           q_lora_rank=R_Q)


def _count(**changes) -> int:
    kwargs = dict(num_layers=L, model_dims=D, num_heads=H, num_kv_heads=H, dims_per_head=HEAD,
                  hidden_dims=F, vocab_size=VOCAB, seq_len=S, gated_mlp=True,
                  num_moe_layers=MOE_L, num_experts=E, experts_per_token=K,
                  expert_hidden_dims=F_E, gated_experts=True, shared_expert_hidden_dims=F_S,
                  mla=MLA)
    return flops_per_token(**{**kwargs, **changes})


def test_the_whole_count_by_hand() -> None:
    query = 2 * D * R_Q + 2 * R_Q * H * HEAD  # q_a_proj, q_b_proj
    kv_a = 2 * D * (R_KV + ROPE)  # kv_a_proj_with_mqa
    kv_b = 2 * R_KV * H * (NOPE + V)  # kv_b_proj: per-head nope keys and values
    out = 2 * H * V * D  # o_proj
    dense_mlp = 2 * D * F * 3
    moe = 2 * D * E + K * 2 * D * F_E * 3 + 2 * D * F_S * 3  # router, k experts, shared
    forward = (L * (query + kv_a + kv_b + out) + (L - MOE_L) * dense_mlp + MOE_L * moe
               + 2 * D * VOCAB)
    attention = L * 3 * S * H * (HEAD + V)  # (scores over h + context over v) / 2, x 3
    assert _count() == 3 * forward + attention


def test_each_term_moves_the_count_by_its_own_amount() -> None:
    base = _count()
    # one query projection instead of the latent: 2 D H h instead of 2 D r_q + 2 r_q H h
    one_query = _count(mla=dataclasses.replace(MLA, q_lora_rank=None))
    assert base - one_query == 3 * L * (2 * D * R_Q + 2 * R_Q * H * HEAD - 2 * D * H * HEAD)
    # v_head_dim: kv_b's values, the output projection and the context (3 x S H per unit)
    wider_v = _count(mla=dataclasses.replace(MLA, v_head_dims=V + 1))
    assert wider_v - base == 3 * L * (2 * R_KV * H + 2 * H * D) + L * 3 * S * H
    # the latent rank: kv_a's output, kv_b's input (and q's rank: q_a's output, q_b's input)
    assert _count(mla=dataclasses.replace(MLA, kv_lora_rank=R_KV + 1)) - base == (
        3 * L * (2 * D + 2 * H * (NOPE + V)))
    # the shared expert: a gated MLP of F_s on each MoE layer only
    assert base - _count(shared_expert_hidden_dims=None) == 3 * MOE_L * 2 * D * F_S * 3
    # the router: 2 D per expert on each MoE layer (the experts a token runs stay k)
    assert _count(num_experts=E + 1) - base == 3 * MOE_L * 2 * D
    # dense first layers: one more MoE layer trades a dense MLP for the MoE term
    moe = 2 * D * E + K * 2 * D * F_E * 3 + 2 * D * F_S * 3
    assert _count(num_moe_layers=MOE_L + 1) - base == 3 * (moe - 2 * D * F * 3)
    # scores over h = nope + rope, context over v: one more position costs 3 H (h + v) per layer
    assert _count(seq_len=S + 1) - base == L * 3 * H * (HEAD + V)


def test_without_mla_the_attention_term_is_the_old_one() -> None:
    plain = _count(mla=None)
    qkv, out = 2 * D * 3 * H * HEAD, 2 * D * H * HEAD
    moe = 2 * D * E + K * 2 * D * F_E * 3 + 2 * D * F_S * 3
    forward = L * (qkv + out) + (L - MOE_L) * 2 * D * F * 3 + MOE_L * moe + 2 * D * VOCAB
    assert plain == 3 * forward + L * 6 * S * H * HEAD


@pytest.mark.parametrize("changes, message", [
    ({"mla": dataclasses.replace(MLA, kv_lora_rank=0)}, "mla.kv_lora_rank=0 must be a positive"),
    ({"mla": dataclasses.replace(MLA, qk_rope_head_dims=HEAD)}, "must be smaller than"),
    ({"shared_expert_hidden_dims": -1}, "shared_expert_hidden_dims must be a positive"),
])
def test_bad_sizes_are_refused(changes, message) -> None:
    with pytest.raises(ValueError, match=message):
        _count(**changes)


@pytest.mark.parametrize("name, sizes", [
    # D, H, r_q, r_kv, dense F, layers, first dense, E, k, F_e, shared, vocab
    ("DeepSeekV3", (7168, 128, 1536, 512, 18432, 61, 3, 256, 8, 2048, 1, 129280)),
    ("DeepSeekV2Lite", (2048, 16, None, 512, 10944, 27, 1, 64, 6, 1408, 2, 102400)),
])
def test_registered_experiments_count_their_published_sizes(name, sizes) -> None:
    from paxlite.experiments import EXPERIMENTS

    d, h, r_q, r_kv, f, layers, dense, e, k, f_e, shared, vocab = sizes
    head, rope, v, s = 192, 64, 128, 4096
    query = 2 * d * h * head if r_q is None else 2 * d * r_q + 2 * r_q * h * head
    attention = query + 2 * d * (r_kv + rope) + 2 * r_kv * h * (head - rope + v) + 2 * h * v * d
    moe = 2 * d * e + k * 2 * d * f_e * 3 + 2 * d * shared * f_e * 3
    forward = layers * attention + dense * 2 * d * f * 3 + (layers - dense) * moe + 2 * d * vocab
    want = 3 * forward + layers * 3 * s * h * (head + v)
    assert EXPERIMENTS[name].resolve({}).flops_per_token() == want
