"""Autoregressive generation with a KV cache: prefill the prompts, then one jitted step per token.

The Transformer runs in decode mode (``decode_mask=``): each attention layer keeps its keys and
values in the "cache" collection, laid out as training's k/v activations ([B, S_max, K, H], logical
axes activation_batch / activation_length / activation_heads, or activation_kv_heads for grouped
queries / activation_kv), so a mesh's rules shard the cache as they shard training. Parameters are
the training ones, unchanged.

Under ``jax.set_mesh`` the cache is created sharded (one jit whose out_shardings come from the
rules in context), donated to the prefill and to every step and kept at those shardings, so no
device ever holds more than its shard (a replicated LLaMA-70B cache for 32 rows of 4k tokens would
be 43 GB on every GPU). Host values enter as global arrays and the sampled tokens come back
replicated, so the loop is one SPMD program that also runs over several processes.

A batch of prompts of different lengths is *left*-padded to the longest one, P: every row's last
prompt token is at slot P - 1, so all rows write the same cache slot at each step (one shared
index), while each row's positions count from its own first token (RoPE and learned position
embeddings see exactly the positions of the prompt run alone) and the padded slots are masked out of
attention.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from paxlite.models.attention import HEAD_ACTIVATION_AXES, KV_HEAD_ACTIVATION_AXES
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
            raise ValueError("top_p must be in (0, 1] (1: no nucleus restriction), got "
                             f"{self.top_p!r}")


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


# The logical axes of each cache leaf, by its name in the attention layer (models/attention.py):
# keys and values as training's k/v activations, positions as [B, S], the write index a scalar.
# A scanned stack (scan_layers) adds a leading "layers" axis to each.
def cache_logical_axes(config: TransformerConfig, cache: PyTree) -> PyTree:
    """A PartitionSpec of logical axis names for each leaf of a cache (arrays or shapes)."""
    grouped = config.num_kv_heads is not None and config.num_kv_heads != config.num_heads
    kv_axes = KV_HEAD_ACTIVATION_AXES if grouped else HEAD_ACTIVATION_AXES
    by_name = {"cached_key": kv_axes, "cached_value": kv_axes, "cached_positions": kv_axes[:2],
               "cache_index": ()}

    def axes(path, leaf) -> PartitionSpec:
        name = getattr(path[-1], "key", None)
        if name not in by_name:
            raise ValueError(f"cache leaf {jax.tree_util.keystr(path)} has no known logical axes "
                             f"(expected one of {sorted(by_name)})")
        base = by_name[name]
        return PartitionSpec(*("layers",) * (len(leaf.shape) - len(base)), *base)

    return jax.tree_util.tree_map_with_path(axes, cache)


def _context_sharding() -> tuple[Mesh | None, tuple]:
    """The mesh of ``jax.set_mesh`` (None: none, one device) and the logical rules in context."""
    mesh = jax.sharding.get_mesh()
    if mesh is None or mesh.empty:
        return None, ()
    return mesh, tuple(nn.get_logical_axis_rules())


def _cache_shapes(model: Transformer, *, batch: int, max_len: int) -> PyTree:
    tokens = jnp.zeros((batch, max_len), jnp.int32)
    mask = jnp.ones((batch, 1, max_len, max_len), bool)
    return jax.eval_shape(
        lambda: model.init({"params": jax.random.key(0)}, tokens, positions=tokens,
                           decode_mask=mask)["cache"])


def cache_shardings(model: Transformer, *, mesh: Mesh, rules: Sequence, max_len: int) -> PyTree:
    """The NamedSharding of each cache leaf on `mesh` under `rules` (the training table shards the
    batch over the batch axes and the heads as it shards training's k/v activations)."""
    shapes = _cache_shapes(model, batch=1, max_len=max_len)
    specs = cache_logical_axes(model.config, shapes)
    return jax.tree.map(lambda spec: named_sharding(mesh, spec, rules), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def named_sharding(mesh: Mesh, logical: PartitionSpec, rules: Sequence) -> NamedSharding:
    """The NamedSharding of logical axes; mesh axes a rule names that `mesh` lacks (a hand-made
    mesh without "expert") are left out, as a size-1 axis would be."""
    def present(entry):
        if entry is None:
            return None
        kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry)
                     if a in mesh.axis_names)
        return kept or None

    mesh_axes = nn.logical_to_mesh_axes(logical, rules)
    return NamedSharding(mesh, PartitionSpec(*(present(e) for e in mesh_axes)))


def init_cache(model: Transformer, *, batch: int, max_len: int) -> PyTree:
    """An empty "cache" collection for `batch` rows of up to `max_len` tokens (zeros; no compile of
    the model's parameters: their shapes come from an abstract init).

    Under ``jax.set_mesh`` each leaf is created already sharded by its logical axes under the
    rules in context (``nn.logical_axis_rules``), inside one jit: no device ever holds the
    whole cache. Without a mesh it is on the default device."""
    mesh, rules = _context_sharding()
    shardings = None if mesh is None else cache_shardings(model, mesh=mesh, rules=rules,
                                                          max_len=max_len)
    return _cache_initializer(model, shardings, max_len=max_len)(batch=batch)


def _cache_initializer(model: Transformer, shardings: PyTree | None, *, max_len: int):
    """A jitted function of `batch` (static) that returns a zero cache at `shardings`."""
    def zeros(*, batch: int) -> PyTree:
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                            _cache_shapes(model, batch=batch, max_len=max_len))

    return jax.jit(zeros, static_argnames=("batch",), out_shardings=shardings)


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
    """The jitted functions of one (model, sampling, mesh, rules) setting, compiled once per
    shape. With a mesh, `cache` holds the cache's shardings (kept from step to step through
    out_shardings), `tokens` the prompt's and `replicated` that of what the host reads back."""

    init: Any  # batch= -> an empty cache
    prefill: Any
    step: Any
    cache: PyTree | None = None
    tokens: NamedSharding | None = None
    rows: NamedSharding | None = None
    replicated: NamedSharding | None = None


@functools.lru_cache(maxsize=8)
def _cached_steps(config: TransformerConfig, sampling: SamplingConfig, max_len: int,
                  vocab_limit: int | None, mesh: Mesh | None, rules: tuple) -> _Steps:
    """Repeated calls with the same settings reuse the compiled steps."""
    return _make_steps(Transformer(config), sampling, max_len, vocab_limit, mesh, rules)


def _make_steps(model: Transformer, sampling: SamplingConfig, max_len: int,
                vocab_limit: int | None, mesh: Mesh | None, rules: tuple) -> _Steps:
    def prefill(params, cache, tokens, pad, seed):
        length = tokens.shape[1]
        positions = jnp.maximum(jnp.arange(length)[None, :] - pad[:, None], 0)
        mask = _step_mask(pad, start=jnp.int32(0), length=length, max_len=max_len)
        logits, cache = _forward(model, params, cache, tokens, positions, mask, vocab_limit)
        key = jax.random.fold_in(jax.random.key(seed), 0)
        return sample_logits(logits, key, sampling), cache

    def step(params, cache, token, pad, index, seed, i):
        positions = (index - pad)[:, None]  # [B, 1]: each row's own position
        mask = _step_mask(pad, start=index, length=1, max_len=max_len)
        logits, cache = _forward(model, params, cache, token[:, None], positions, mask,
                                 vocab_limit)
        key = jax.random.fold_in(jax.random.key(seed), i)
        return sample_logits(logits, key, sampling), cache

    # The cache is donated to prefill and to every step: each returns its updated cache in the
    # same buffers, so a device never holds two copies of its shard.
    if mesh is None:
        return _Steps(init=_cache_initializer(model, None, max_len=max_len),
                      prefill=jax.jit(prefill, donate_argnums=(1,)),
                      step=jax.jit(step, donate_argnums=(1,)))
    cache = cache_shardings(model, mesh=mesh, rules=rules, max_len=max_len)
    replicated = NamedSharding(mesh, PartitionSpec())
    # the sampled tokens come back replicated: every process reads all rows (a [B] int32 gather)
    out = (replicated, cache)
    return _Steps(
        init=_cache_initializer(model, cache, max_len=max_len),
        prefill=jax.jit(prefill, donate_argnums=(1,), out_shardings=out),
        step=jax.jit(step, donate_argnums=(1,), out_shardings=out),
        cache=cache,
        tokens=named_sharding(mesh, PartitionSpec("activation_batch", "activation_length"), rules),
        rows=named_sharding(mesh, PartitionSpec("activation_batch"), rules),
        replicated=replicated)


def _num_shards(sharding: NamedSharding) -> int:
    """Into how many blocks `sharding` splits an array's first dimension."""
    entry = sharding.spec[0] if sharding.spec else None
    axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
    return math.prod(sharding.mesh.shape[a] for a in axes)


def _put(value: np.ndarray, sharding: NamedSharding | None) -> jax.Array:
    """A host array every process holds alike, as one global array (each process places only its
    own devices' parts, so this works across processes)."""
    if sharding is None:
        return jnp.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


@dataclasses.dataclass(frozen=True)
class Generation:
    """What `generate_with_cache` returns: the generated ids of each prompt, and the KV cache as
    the last step left it (its sharding is the one the whole decode loop ran with)."""

    ids: list[list[int]]
    cache: PyTree


def generate(config: TransformerConfig, params: PyTree, prompts: Sequence[Sequence[int]],
             **options) -> list[list[int]]:
    """`generate_with_cache`'s ids alone (what every caller but the cache placement checks wants);
    `options` are its keyword arguments."""
    return generate_with_cache(config, params, prompts, **options).ids


def generate_with_cache(
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
    prompt_length: int | None = None,
    stop: Callable[[list[int]], bool] | None = None,
) -> Generation:
    """The generated ids of each prompt (the prompt not included), and the KV cache as the last
    step left it: up to `max_new_tokens` ids, ending with `eos_id` where the model emits it. The
    same seed gives the same tokens.

    The ids are used as given: no BOS is added here (the command line adds the model family's;
    see paxlite/cli/generate.py).
    vocab_limit: only ids below it are generated (a tokenizer smaller than the model's padded
    vocabulary cannot decode the others); None: all.
    batch_multiple: the rows are made a multiple of it (copies of the last prompt, whose outputs
    are dropped); under a mesh they are also made a multiple of the batch's split over it.
    prompt_length: every prompt is left-padded to this many tokens (at least the longest prompt's)
        instead of the longest prompt's: the outputs are the same (padding is masked), and callers
        with prompts of many lengths compile one program per bucket instead of one per length.
    stop: called with a row's generated ids after each new token; True ends that row as EOS does
        (lm_eval's `until` strings). Under several processes it must answer alike on each.

    Under ``jax.set_mesh`` (and ``nn.logical_axis_rules``), the cache and the prompts are sharded
    by the rules and the loop is one SPMD program, also across several processes: every process
    calls this with the same prompts and gets all the ids.
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
    if prompt_length is not None:
        if prompt_length < longest:
            raise ValueError(f"prompt_length={prompt_length} is shorter than the longest prompt "
                             f"({longest} tokens)")
        longest = prompt_length
    max_len = longest + max_new_tokens
    if max_len > config.max_seq_len:
        raise ValueError(
            f"the longest prompt ({longest} tokens) plus max_new_tokens={max_new_tokens} is "
            f"{max_len}, over the model's max_seq_len={config.max_seq_len}")
    model = Transformer(decoding_config(config))
    mesh, rules = _context_sharding()
    try:
        steps = _cached_steps(model.config, sampling, max_len, vocab_limit, mesh, rules)
    except TypeError:  # a config holding something unhashable: compiled for this call only
        steps = _make_steps(model, sampling, max_len, vocab_limit, mesh, rules)
    if steps.rows is not None:  # the rows must split evenly over the mesh axes of the batch
        batch_multiple = math.lcm(batch_multiple, _num_shards(steps.rows))
    given = len(prompts)
    prompts = [*prompts, *[prompts[-1]] * (-given % batch_multiple)]
    batch = len(prompts)
    pad_np = np.array([longest - len(p) for p in prompts], np.int32)
    tokens = np.zeros((batch, longest), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, pad_np[row]:] = prompt
    pad = _put(pad_np, steps.rows)
    seed_array = _put(np.asarray(seed % 2**32, np.uint32), steps.replicated)
    cache = steps.init(batch=batch)
    token, cache = steps.prefill(params, cache, _put(tokens, steps.tokens), pad, seed_array)
    out = [[] for _ in prompts]
    done = np.zeros(batch, bool)
    for i in range(max_new_tokens):
        ids = np.asarray(token)
        for row in np.flatnonzero(~done):
            out[row].append(int(ids[row]))
            done[row] = (eos_id is not None and ids[row] == eos_id) or (
                stop is not None and stop(out[row]))
        if done.all() or i + 1 == max_new_tokens:
            break
        token, cache = steps.step(params, cache, token, pad,
                                  _put(np.asarray(longest + i, np.int32), steps.replicated),
                                  seed_array, _put(np.asarray(i + 1, np.int32), steps.replicated))
    return Generation(ids=out[:given], cache=cache)
