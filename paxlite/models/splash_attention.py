"""TPU attention: JAX's Pallas splash attention kernel behind ``AttentionImplementation.SPLASH``.

Why splash and not XLA's attention on a TPU: XLA materialises the [B, N, T, S] logits and
probabilities of every layer, so memory grows with the square of the sequence and long rows do
not fit one chip; splash streams key blocks through the chip's vector memory (online softmax) and
skips the blocks a mask leaves empty (the upper triangle of causal attention, other documents'
blocks of packed rows are still computed but masked), so it holds O(T) per head. It is the kernel
MaxText runs as ``attention=flash`` on TPUs.

What it takes here: causal attention, packed rows (the [B, T] segment ids, compared inside the
kernel: no dense mask is read), grouped kv heads (the kernel maps query head i to kv head
i // (N / K) itself, as JAX's grouping does), a sliding window (a local mask: the query's own slot
and the ``window - 1`` slots before it), Gemma 2's logit soft-capping, gpt-oss's sinks (the
kernel's ``sinks``, one float32 logit per query head) and Llama 4's chunks. No logit bias
(relative position buckets), and not a chunk and a window in one layer (no family has both): a
``SettingError``.

Chunks: a row without segment ids is chunked by its slots, with JAX's ``ChunkedCausalMask``, whose
block tables skip the blocks outside every chunk; its positions are then its slots (the
Transformer's default ``arange(T)``). Packed rows are chunked by their positions, which restart
in each document: the segment ids become one id per run of slots in the same document and chunk
(``kernel_masks.chunk_segment_ids``), compared inside the kernel under a causal mask, exactly as
the einsum cores' chunk mask (JAX 0.10.2, the oldest supported, has both ``ChunkedCausalMask`` and
the ``sinks`` argument; its backward pass sums the sinks' gradient in the activations' dtype,
JAX 0.12's in float32).

Layout: paxlite's activations are [B, T, N, H]; the kernel runs on one example's [N, T, H], so the
call transposes, maps the kernel over the batch, and transposes back. The sequence is padded to a
whole number of 128-slot lanes (padding follows every real token, so causality keeps it out of
real rows). Under a mesh the kernel runs per shard (``shard_map``, batch and heads split as the
logical rules split the attention activations): a Mosaic custom call cannot be partitioned by XLA.
On a CPU it runs only interpreted (``interpret=True``), for tests.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec

from paxlite.errors import SettingError
from paxlite.models.kernel_masks import chunk_segment_ids

# The kernel's tiles: key blocks are whole 128-lane vregs; 512 x 512 blocks are MaxText's defaults
# (sa_block_q, sa_block_kv, ...), and a sequence shorter than that uses one block of its length.
LANES: int = 128
DEFAULT_BLOCK: int = 512

_HEAD_AXES: tuple[str, ...] = (
    "activation_batch", "activation_length", "activation_heads", "activation_kv",
)
_SEGMENT_AXES: tuple[str, ...] = ("activation_batch", "activation_length")


def splash_problems(*, has_bias: bool, backend: str | None = None, chunk: int | None = None,
                    sliding_window: int | None = None) -> list[str]:
    """Why splash attention cannot run here ([] when it can); backend None: not checked; chunk
    (attention_chunk_size) and sliding_window: the layer's."""
    problems = []
    if backend is not None and backend != "tpu":
        problems.append(
            f"the splash attention kernel runs on TPUs, and this job's JAX backend is {backend!r} "
            "(on CPU it runs only interpreted, for tests: paxlite.models.splash_attention."
            "splash_attention(interpret=True))")
    if has_bias:
        problems.append(
            "the splash attention kernel takes no logit bias (relative position bias): use 'xla'")
    if chunk is not None and sliding_window is not None:
        problems.append(
            f"the splash attention kernel takes attention_chunk_size={chunk} or sliding_window="
            f"{sliding_window} in one layer, not both: use 'xla'")
    return problems


def padded_length(seq_len: int) -> int:
    """seq_len rounded up to whole 128-slot lanes."""
    return -(-seq_len // LANES) * LANES


def block_size(padded: int, *, largest: int = DEFAULT_BLOCK) -> int:
    """The largest multiple of 128 that divides ``padded`` and is at most ``largest``."""
    best = LANES
    for candidate in range(LANES, min(largest, padded) + 1, LANES):
        if padded % candidate == 0:
            best = candidate
    return best


def block_sizes(padded: int) -> Any:
    """The kernel's BlockSizes for a padded sequence: one block size for every pass."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    block = block_size(padded)
    return sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                         block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                         block_q_dq=block, block_kv_dq=block)


def _kernel(*, heads: int, padded: int, sliding_window: int | None, logit_cap: float | None,
            chunk: int | None, interpret: bool) -> Any:
    """One example's kernel, [N, T, H] x [K, T, H] -> [N, T, H]. Built in each trace that calls it,
    never cached across traces: the kernel holds its mask's block tables as arrays of the trace it
    was made in (a kernel kept from an earlier jit leaks that trace's values)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    shape = (padded, padded)
    if chunk is not None:  # causal within chunks of slots
        one_head = sm.ChunkedCausalMask(shape, chunk_size=chunk)
    elif sliding_window is None:
        one_head = sm.CausalMask(shape)
    else:  # the query's own slot and the window - 1 before it: causal within the window
        one_head = sm.LocalMask(shape, window_size=(sliding_window - 1, 0), offset=0)
    mask = sm.MultiHeadMask(tuple(one_head for _ in range(heads)))
    return sk.make_splash_mha_single_device(
        mask, block_sizes=block_sizes(padded), attn_logits_soft_cap=logit_cap,
        interpret=interpret)


def mesh_spec(logical: tuple[str, ...], mesh: Any) -> PartitionSpec:
    """The PartitionSpec the current logical rules give, keeping only axes this mesh has."""
    entries = []
    for entry in nn.logical_to_mesh_axes(logical):
        axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
        kept = tuple(a for a in axes if a in mesh.axis_names)
        entries.append(kept if kept else None)
    return PartitionSpec(*entries)


def _shards(spec_entry: Any, mesh: Any) -> int:
    if spec_entry is None:
        return 1
    names = (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)
    return math.prod(mesh.shape[name] for name in names)


def splash_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, segment_ids: jax.Array | None,
    sliding_window: int | None = None, logit_cap: float | None = None, interpret: bool = False,
    chunk: int | None = None, positions: jax.Array | None = None, sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal splash attention: q [B, T, N, H] prescaled, k, v [B, T, K, H] with K dividing N,
    segment_ids int [B, T] or None -> [B, T, N, H] in q's dtype.

    sliding_window: query slot i sees key slots j with i - window < j <= i. logit_cap: the
    logits become ``cap * tanh(logits / cap)`` before the mask (Gemma 2). chunk: keys in the
    query's chunk of ``chunk`` positions only (packed rows: ``positions`` [B, T]; the module
    docstring). sinks: float [N] logits in every softmax (gpt-oss)."""
    batch, length, n, _ = q.shape
    kv = k.shape[2]
    if k.shape[1] != length or v.shape[1] != length:
        raise ValueError(f"self-attention only: q has {length} positions, k/v {k.shape[1]}")
    if n % kv:
        raise ValueError(f"{n} query heads cannot share {kv} kv heads evenly")
    require_splash(has_bias=False, backend=None, chunk=chunk, sliding_window=sliding_window)
    if chunk is not None and segment_ids is not None:  # by positions, through the segment ids
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        segment_ids = chunk_segment_ids(segment_ids, positions, chunk=chunk)
        chunk = None
    mesh = jax.sharding.get_abstract_mesh()
    head_spec = None if mesh.empty else mesh_spec(_HEAD_AXES, mesh)
    head_shards = 1 if head_spec is None else _shards(head_spec[2], mesh)
    if kv % head_shards:
        # Each shard's query heads need their own kv heads: repeat them to N (head i reads kv
        # head i // G, as before).
        k = jnp.repeat(k, n // kv, axis=2)
        v = jnp.repeat(v, n // kv, axis=2)
        k = nn.with_logical_constraint(k, _HEAD_AXES)
        v = nn.with_logical_constraint(v, _HEAD_AXES)
    padded = padded_length(length)
    if padded != length:
        pad = ((0, 0), (0, padded - length), (0, 0), (0, 0))
        q, k, v = (jnp.pad(a, pad) for a in (q, k, v))
        if segment_ids is not None:
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, padded - length)),
                                  constant_values=-1)
    if segment_ids is not None:
        segment_ids = segment_ids.astype(jnp.int32)

    # the optional inputs, by name, in the order the kernel's shards take them after q, k, v
    extras: dict[str, tuple[jax.Array, Any]] = {}
    if segment_ids is not None:
        extras["segment_ids"] = (segment_ids, None if mesh.empty
                                 else mesh_spec(_SEGMENT_AXES, mesh))
    if sinks is not None:  # [N] on the heads' split
        extras["sinks"] = (sinks.astype(jnp.float32), None if head_spec is None
                           else PartitionSpec(head_spec[2]))

    def per_shard(q, k, v, *rest):
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_kernel as sk,
        )

        given = dict(zip(extras, rest, strict=True))
        kernel = _kernel(heads=q.shape[2], padded=padded, sliding_window=sliding_window,
                         logit_cap=logit_cap, chunk=chunk, interpret=interpret)
        options = {} if "sinks" not in given else {"sinks": given["sinks"]}
        # Mosaic compiles a kernel's bfloat16 matmuls at the chip's native precision only (a
        # float32 contract precision on bfloat16 operands fails to compile: "Bad lhs type"), so a
        # caller's jax.default_matmul_precision('highest') applies to float32 inputs alone.
        precision = "highest" if q.dtype == jnp.float32 else "default"
        # [B, T, N, H] -> [B, N, T, H]: one example's heads first, as the kernel takes them
        qt, kt, vt = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
        with jax.default_matmul_precision(precision):
            if "segment_ids" not in given:
                out = jax.vmap(lambda a, b, c: kernel(a, b, c, **options))(qt, kt, vt)
            else:
                ids = sk.SegmentIds(q=given["segment_ids"], kv=given["segment_ids"])
                out = jax.vmap(lambda a, b, c, s: kernel(a, b, c, segment_ids=s, **options))(
                    qt, kt, vt, ids)
        return jnp.swapaxes(out, 1, 2).astype(q.dtype)  # [B, T, N, H]

    kernel = per_shard
    if head_spec is not None:
        specs = (head_spec,) * 3 + tuple(spec for _, spec in extras.values())
        kernel = jax.shard_map(per_shard, mesh=mesh, in_specs=specs, out_specs=head_spec,
                               check_vma=False)
    return kernel(q, k, v, *(array for array, _ in extras.values()))[:, :length]


def require_splash(*, has_bias: bool, backend: str | None, chunk: int | None = None,
                   sliding_window: int | None = None) -> None:
    """SettingError naming every reason splash cannot run here."""
    problems = splash_problems(has_bias=has_bias, backend=backend, chunk=chunk,
                               sliding_window=sliding_window)
    if problems:
        raise SettingError("attention implementation 'splash' cannot run: " + "; ".join(problems))
