"""KV-cache generation (models/decode.py) against the full forward pass, and sampling."""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from paxlite.models.activations import Activation
from paxlite.models.decode import SamplingConfig, generate, sample_logits
from paxlite.models.moe_config import MoeConfig, MoeRouting
from paxlite.models.transformer import NormKind, Transformer, TransformerConfig
from paxlite.models.transformer_config import PositionEmbedding
from tests.models.test_transformer import random_params, stack_layers, tiny

# Prompts of different lengths in one batch: left padding must not shift positions or leak.
PROMPTS = [[3, 17, 5, 9, 30], [11], [7, 2, 25]]
NEW = 6


def llama(**overrides: Any) -> TransformerConfig:
    fields: dict[str, Any] = dict(
        norm=NormKind.RMS_NORM, activation=Activation.SILU, gated_mlp=True, use_bias=False,
        tie_embeddings=False, position_embedding=PositionEmbedding.ROTARY, num_kv_heads=1,
        num_heads=4, dims_per_head=4)
    fields.update(overrides)
    return tiny(**fields)


CONFIGS = {
    "gpt": tiny(),  # fused qkv, learned absolute positions, tied embeddings
    "gpt_scanned": tiny(scan_layers=True),
    "llama_gqa": llama(),  # RoPE, 4 query heads on 1 kv head
    "glam_relative_bias": tiny(position_embedding=PositionEmbedding.RELATIVE_BIAS,
                               relative_position_buckets=8, relative_position_max_distance=8),
    "mixtral_moe": llama(num_kv_heads=2, moe=MoeConfig(
        num_experts=4, routing=MoeRouting.DROPLESS_TOPK, gated_experts=True,
        expert_activation=Activation.SILU)),
}


def _params(cfg: TransformerConfig) -> Any:
    params = random_params(cfg.__class__(**{**cfg.__dict__, "scan_layers": False}), seed=1)
    return stack_layers(params, cfg.num_layers) if cfg.scan_layers else params


@functools.cache
def _full_forward(cfg: TransformerConfig) -> Any:
    """One jitted forward per config: the reference runs it for every prompt and token, and a
    new jit per prompt would trace and lower the model again each time."""
    return jax.jit(lambda p, t: Transformer(cfg).apply({"params": p}, t))


def _greedy_by_full_forward(cfg: TransformerConfig, params: Any, prompt: list[int],
                            new: int) -> list[int]:
    """The reference: no cache, no left padding; the whole sequence again for every token.

    The sequence sits at the start of a fixed [1, max_seq_len] row (one compile): causal
    attention keeps the zeros after it from changing any logit up to its last token."""
    forward = _full_forward(cfg)
    seq = list(prompt)
    for _ in range(new):
        row = np.zeros((1, cfg.max_seq_len), np.int32)
        row[0, :len(seq)] = seq
        logits = forward(params, jnp.asarray(row))
        seq.append(int(np.argmax(np.asarray(logits[0, len(seq) - 1]))))
    return seq[len(prompt):]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_greedy_equals_argmax_of_full_forward(name: str) -> None:
    cfg = CONFIGS[name]
    params = _params(cfg)
    got = generate(cfg, params, PROMPTS, max_new_tokens=NEW)
    want = [_greedy_by_full_forward(cfg, params, p, NEW) for p in PROMPTS]
    assert got == want
    if name in ("gpt", "llama_gqa"):  # batch composition does not matter: alone, the same tokens
        assert generate(cfg, params, [PROMPTS[1]], max_new_tokens=NEW) == [want[1]]


def test_eos_stops_a_row_and_is_kept() -> None:
    cfg = CONFIGS["gpt"]
    params = _params(cfg)
    full = generate(cfg, params, PROMPTS, max_new_tokens=NEW)
    eos = full[0][2]
    got = generate(cfg, params, PROMPTS, max_new_tokens=NEW, eos_id=eos)
    for row, ids in zip(full, got, strict=True):
        cut = row.index(eos) + 1 if eos in row else len(row)
        assert ids == row[:cut]


def test_a_longer_prompt_length_changes_nothing_and_stop_ends_rows_like_eos() -> None:
    """prompt_length left-pads every prompt further (masked, so the same tokens); `stop` ends a
    row once it says so, keeping the token that made it say so."""
    cfg = CONFIGS["llama_gqa"]
    params = _params(cfg)
    full = generate(cfg, params, PROMPTS, max_new_tokens=NEW)
    longest, padded = max(map(len, PROMPTS)), cfg.max_seq_len - NEW
    assert padded > longest
    assert generate(cfg, params, PROMPTS, max_new_tokens=NEW, prompt_length=padded) == full
    with pytest.raises(ValueError, match="shorter than the longest prompt"):
        generate(cfg, params, PROMPTS, max_new_tokens=NEW, prompt_length=longest - 1)
    marker = full[1][2]  # ends each row at its first `marker`, as lm_eval's until strings do
    got = generate(cfg, params, PROMPTS, max_new_tokens=NEW, stop=lambda ids: ids[-1] == marker)
    for row, ids in zip(full, got, strict=True):
        assert ids == (row[:row.index(marker) + 1] if marker in row else row)
    assert got != full


def test_sampling_is_reproducible_per_seed_and_differs_across_seeds() -> None:
    cfg = CONFIGS["llama_gqa"]
    params = _params(cfg)
    sampling = SamplingConfig(temperature=1.5)
    runs = {seed: generate(cfg, params, PROMPTS, max_new_tokens=NEW, sampling=sampling, seed=seed)
            for seed in (0, 1)}
    assert generate(cfg, params, PROMPTS, max_new_tokens=NEW, sampling=sampling, seed=0) == runs[0]
    assert runs[0] != runs[1]
    # top_k=1 and a tiny top_p leave only the most likely token: greedy whatever the seed
    greedy = generate(cfg, params, PROMPTS, max_new_tokens=NEW)
    for narrow in (SamplingConfig(temperature=1.5, top_k=1), SamplingConfig(temperature=1.5,
                                                                           top_p=1e-6)):
        assert generate(cfg, params, PROMPTS, max_new_tokens=NEW, sampling=narrow, seed=3) == greedy


def test_top_k_and_top_p_draw_only_from_the_kept_tokens() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two (0.5 < 0.7 <= 0.8)
    probs = np.array([0.05, 0.5, 0.15, 0.3])
    logits = jnp.asarray(np.log(np.tile(probs, (4000, 1))), jnp.float32)
    key = jax.random.key(0)
    for sampling, kept, share in ((SamplingConfig(temperature=1.0, top_p=0.7), {1, 3}, 0.5 / 0.8),
                                  (SamplingConfig(temperature=1.0, top_k=3), {1, 2, 3},
                                   0.5 / 0.95)):
        ids = np.asarray(sample_logits(logits, key, sampling))
        assert set(ids.tolist()) == kept
        assert abs(np.mean(ids == 1) - share) < 0.03  # renormalised over what is kept


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), "temperature"), (dict(top_k=-2), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
])
def test_bad_sampling_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def test_too_long_and_out_of_vocabulary_prompts() -> None:
    cfg = CONFIGS["gpt"]  # max_seq_len 12, vocab 32
    params = _params(cfg)
    with pytest.raises(ValueError, match="max_seq_len=12"):
        generate(cfg, params, [[1] * 8], max_new_tokens=5)
    with pytest.raises(ValueError, match=r"\[32\]"):
        generate(cfg, params, [[1, 32]], max_new_tokens=2)


# Each case's rules and the sharding they give each cache leaf, written out by hand: the batch over
# data x fsdp x expert, the heads of keys and values over tensor, the cache length whole.
BATCH = ("data", "fsdp", "expert")
SHARDED_CASES = {
    # GQA keys/values have their own head axis name, over tensor in DEFAULT_RULES as here
    "llama_gqa_kv_heads_over_tensor": (
        dict(cfg="llama", batch_multiple=4),
        (("activation_kv_heads", "tensor"),),
        {
            "cached_key": P(BATCH, None, "tensor", None),
            "cached_value": P(BATCH, None, "tensor", None),
            "cached_positions": P(BATCH, None),
            "cache_index": P(),
        },
    ),
    # multi-head attention: the cache has training's head axis, over tensor in DEFAULT_RULES; a
    # scanned stack puts the layers first
    "gpt_scanned": (
        # no batch_multiple: generate pads the 3 rows to the batch split (4) itself
        dict(cfg="gpt_scanned", batch_multiple=1),
        (),
        {
            "cached_key": P(None, BATCH, None, "tensor", None),
            "cached_value": P(None, BATCH, None, "tensor", None),
            "cached_positions": P(None, BATCH, None),
            "cache_index": P(None),
        },
    ),
}


@pytest.mark.parametrize("case", list(SHARDED_CASES))
def test_sharded_generation_equals_one_device_with_the_cache_sharded_by_the_rules(
    case: str,
) -> None:
    """(2,2,2,1) mesh under the trainer's rules: params FSDP x tensor sharded, the batch and the
    cache over the batch axes and the kv heads over tensor (the cache's logical axes are the k/v
    activations'), each device holding only its shard of it; same tokens as one device."""
    from flax import linen as nn
    from jax.sharding import AxisType, NamedSharding

    from paxlite.models.decode import generate_with_cache
    from paxlite.models.transformer import logical_param_axes
    from paxlite.parallel.rules import DEFAULT_RULES

    which, extra_rules, want_specs = SHARDED_CASES[case]
    cfg = llama(num_heads=4, num_kv_heads=2) if which["cfg"] == "llama" else CONFIGS[which["cfg"]]
    rules = (*DEFAULT_RULES, *extra_rules)
    params = _params(cfg)
    prompts = PROMPTS  # 3 rows, made 4 for the batch axes (data x fsdp)
    want = generate(cfg, params, prompts, max_new_tokens=NEW)
    mesh = jax.make_mesh(
        (1, 2, 2, 1, 2, 1),
        ("pipeline", "data", "fsdp", "seq", "tensor", "expert"),
        axis_types=(AxisType.Auto,) * 6,
    )
    shardings = nn.logical_to_mesh_sharding(logical_param_axes(cfg), mesh, rules)
    sharded = jax.device_put(params, shardings)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        got = generate_with_cache(cfg, sharded, prompts, max_new_tokens=NEW,
                                  batch_multiple=which["batch_multiple"])
    assert got.ids == want
    leaves = jax.tree_util.tree_leaves_with_path(got.cache)
    assert len(leaves) == 4 * (1 if cfg.scan_layers else cfg.num_layers)
    for path, leaf in leaves:
        spec = want_specs[path[-1].key]
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), (
            jax.tree_util.keystr(path), leaf.sharding)
        if path[-1].key == "cached_key":  # each device: a quarter of the rows, half the heads
            whole = leaf.shape
            local = {tuple(s.data.shape) for s in leaf.addressable_shards}
            rows = 1 if cfg.scan_layers else 0
            assert local == {(*whole[:rows], whole[rows] // 4, whole[rows + 1],
                              whole[rows + 2] // 2, whole[rows + 3])}


def test_the_cache_is_donated_to_prefill_and_every_step() -> None:
    """The cache passed in is consumed (its buffers reused for the updated one), so a device never
    holds two copies of its cache."""
    from paxlite.models import decode

    cfg = CONFIGS["llama_gqa"]
    params = _params(cfg)
    model = Transformer(cfg)
    steps = decode._make_steps(model, SamplingConfig(), 8, None, None, ())
    cache = decode.init_cache(model, batch=2, max_len=8)
    tokens = jnp.asarray([[3, 4, 5], [0, 6, 7]], jnp.int32)
    pad = jnp.asarray([0, 1], jnp.int32)
    seed = jnp.asarray(0, jnp.uint32)
    token, updated = steps.prefill(params, cache, tokens, pad, seed)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(cache))
    _, last = steps.step(params, updated, token, pad, jnp.int32(3), seed, jnp.int32(1))
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(updated))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(last))
