"""Autoregressive generation with a KV cache: prefill the prompts, then one jitted step per token.

The Transformer runs in decode mode (``decode_mask=``): each attention layer keeps its keys and
values in the "cache" collection, laid out as training's k/v activations ([B, S_max, K, H], logical
axes activation_batch / activation_length / activation_kv_heads / activation_kv), so a mesh's rules
shard the cache as they shard training. Parameters are the training ones, unchanged.

A batch of prompts of different lengths is *left*-padded to the longest one, P: every row's last
prompt token is at slot P - 1, so all rows write the same cache slot at each step (one shared index),
while each row's positions count from its own first token (RoPE and learned position embeddings see
exactly the positions of the prompt run alone) and the padded slots are masked out of attention.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paxlite.models.transformer import Transformer, TransformerConfig

PyTree = Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How the next token is chosen from the logits.

    temperature 0 is greedy (argmax; top_k and top_p do not apply). Otherwise logits are divided by
    the temperature, restricted to the top_k most likely tokens (0: all) and to the smallest set
    whose probability reaches top_p (1.0: all), and a token is drawn from what is left.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no top-k restriction), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: no nucleus restriction), got {self.top_p!r}")


def sample_logits(logits: jax.Array, key: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """logits f32 [B, V] -> token ids int32 [B]."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1:
        order = jnp.argsort(-logits, axis=-1)  # [B, V], most likely first
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # keep a token when the tokens more likely than it have not reached top_p yet (so the most
        # likely one is always kept)
        keep_sorted = jnp.cumsum(probs, axis=-1) - probs < sampling.top_p
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(
            keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def decoding_config(config: TransformerConfig) -> TransformerConfig:
    """The model config generation runs: the same parameters, no remat, no dropout, and converted
    or trained FP8 scaling state not needed (FP8 matmuls are a training speed-up)."""
    return dataclasses.replace(config, fp8=None)


def init_cache(model: Transformer, *, batch: int, max_len: int) -> PyTree:
    """An empty "cache" collection for `batch` rows of up to `max_len` tokens (zeros; no compile of
    the model's parameters: their shapes come from an abstract init)."""
    tokens = jnp.zeros((batch, max_len), jnp.int32)
    mask = jnp.ones((batch, 1, max_len, max_len), bool)
    shapes = jax.eval_shape(
        lambda: model.init({"params": jax.random.key(0)}, tokens, positions=tokens,
                           decode_mask=mask)["cache"])
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _step_mask(pad: jax.Array, *, start: jax.Array, length: int, max_len: int) -> jax.Array:
    """bool [B, 1, T, S]: query t (cache slot start + t) sees slot s iff s is no later and not
    left padding."""
    slots = jnp.arange(max_len)[None, None, :]  # [1, 1, S]
    query_slots = start + jnp.arange(length)[None, :, None]  # [1, T, 1]
    return ((slots <= query_slots) & (slots >= pad[:, None, None]))[:, None]


def _forward(model: Transformer, params: PyTree, cache: PyTree, tokens: jax.Array,
             positions: jax.Array, mask: jax.Array, vocab_limit: int | None,
             ) -> tuple[jax.Array, PyTree]:
    """Last position's logits [B, V] (ids from vocab_limit on excluded) and the updated cache."""
    logits, updated = model.apply({"params": params, "cache": cache}, tokens, positions=positions,
                                  decode_mask=mask, mutable=["cache"])
    logits = logits[:, -1]
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
    return logits, updated["cache"]


@dataclasses.dataclass(frozen=True)
class _Steps:
    """The two jitted functions of one (model, sampling) pair, compiled once per shape."""

    prefill: Any
    step: Any


@functools.lru_cache(maxsize=8)
def _cached_steps(config: TransformerConfig, sampling: SamplingConfig, max_len: int,
                  vocab_limit: int | None) -> _Steps:
    """Repeated calls with the same settings reuse the compiled steps."""
    return _make_steps(Transformer(config), sampling, max_len, vocab_limit)


def _make_steps(model: Transformer, sampling: SamplingConfig, max_len: int,
                vocab_limit: int | None) -> _Steps:
    def prefill(params, cache, tokens, pad, key):
        length = tokens.shape[1]
        positions = jnp.maximum(jnp.arange(length)[None, :] - pad[:, None], 0)
        mask = _step_mask(pad, start=jnp.int32(0), length=length, max_len=max_len)
        logits, cache = _forward(model, params, cache, tokens, positions, mask, vocab_limit)
        return sample_logits(logits, key, sampling), cache

    def step(params, cache, token, pad, index, key):
        positions = (index - pad)[:, None]  # [B, 1]: each row's own position
        mask = _step_mask(pad, start=index, length=1, max_len=max_len)
        logits, cache = _forward(model, params, cache, token[:, None], positions, mask,
                                 vocab_limit)
        return sample_logits(logits, key, sampling), cache

    return _Steps(prefill=jax.jit(prefill), step=jax.jit(step, donate_argnums=(1,)))


def generate(
    config: TransformerConfig,
    params: PyTree,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int = 0,
    eos_id: int | None = None,
    vocab_limit: int | None = None,
    batch_multiple: int = 1,
) -> list[list[int]]:
    """The generated ids of each prompt (the prompt not included): up to `max_new_tokens`, ending
    with `eos_id` where the model emits it. The same seed gives the same tokens.

    vocab_limit: only ids below it are generated (a tokenizer smaller than the model's padded
    vocabulary cannot decode the others); None: all.
    batch_multiple: the rows are made a multiple of it (copies of the last prompt, whose outputs
    are dropped), so that a mesh's batch axes divide the batch.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    vocab = config.vocab_size
    bad = sorted({t for p in prompts for t in p if not 0 <= t < vocab})
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    longest = max(len(p) for p in prompts)
    max_len = longest + max_new_tokens
    if max_len > config.max_seq_len:
        raise ValueError(
            f"the longest prompt ({longest} tokens) plus max_new_tokens={max_new_tokens} is "
            f"{max_len}, over the model's max_seq_len={config.max_seq_len}")
    model = Transformer(decoding_config(config))
    try:
        steps = _cached_steps(model.config, sampling, max_len, vocab_limit)
    except TypeError:  # a config holding something unhashable: compiled for this call only
        steps = _make_steps(model, sampling, max_len, vocab_limit)
    given = len(prompts)
    prompts = [*prompts, *[prompts[-1]] * (-given % batch_multiple)]
    batch = len(prompts)
    pad_np = np.array([longest - len(p) for p in prompts], np.int32)
    tokens = np.zeros((batch, longest), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, pad_np[row]:] = prompt
    pad = jnp.asarray(pad_np)
    key = jax.random.key(seed)
    cache = init_cache(model, batch=batch, max_len=max_len)
    token, cache = steps.prefill(params, cache, jnp.asarray(tokens), pad, jax.random.fold_in(key, 0))
    out = [[] for _ in prompts]
    done = np.zeros(batch, bool)
    for i in range(max_new_tokens):
        ids = np.asarray(token)
        for row in np.flatnonzero(~done):
            out[row].append(int(ids[row]))
            done[row] = eos_id is not None and ids[row] == eos_id
        if done.all() or i + 1 == max_new_tokens:
            break
        token, cache = steps.step(params, cache, token, pad, jnp.int32(longest + i),
                                  jax.random.fold_in(key, i + 1))
    return out[:given]
