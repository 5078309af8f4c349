"""Which kernel computes softmax(q k^T) v for ``AttentionKind.FLASH``, and the kernels' limits.

``AttentionImplementation`` names the kernel: JAX's XLA attention, cuDNN's fused flash attention
(both through the public ``jax.nn.dot_product_attention``), or JAX's Pallas-Triton flash attention
(``jax.experimental.pallas.ops.gpu.attention.mha``), JAX's Pallas splash attention for TPUs
(models/splash_attention.py), or AUTO (cuDNN where it can run, else XLA; XLA on a TPU until a
measurement there says splash is faster for the shape).

Why three on a GPU: the public cuDNN API takes packed rows (segment ids) only as a dense
[B, 1, T, S] mask, which it turns into an additive bias that has to be read from memory in both
passes; the Pallas-Triton kernel reads the [B, T] segment ids themselves and masks inside the
kernel, so it is the fused path for packed training. Which of the two packed paths is faster on a
given GPU is measured by ``benchmarks/attention_kernels.py``; AUTO keeps cuDNN (with its dense
mask) until a measurement says otherwise (docs/attention.md).

A kernel asked for by name where it cannot run is a ``SettingError`` naming why (backend, dtype,
head dims, bias), raised while the step is traced, before anything is compiled; the experiment
layer checks the parts it can know earlier (experiments/base.py). AUTO never fails: it falls back
to XLA, and says so once in the log (which kernel it chose and why), since a ``-flash`` run that
quietly computes XLA's attention (float32 activations, no GPU) is not what its name promises.

Llama 4's chunked attention and gpt-oss's sinks run in the XLA kernel (models/kernel_masks.py
says how) and in splash; AUTO runs XLA for them, and cuDNN (as paxlite calls it: a causal kernel
whose masks are dense biases) and Pallas-Triton refuse them in one line.

The explicit-einsum core of ``AttentionKind.DOT_PRODUCT`` (``einsum_attention``) lives here too,
below every layer that computes attention (its masks in models/kernel_masks.py): models/attention.py
and the sequence-parallel core models/context_parallel.py both call it, and neither imports the
other's module back.

Shapes: q [B, T, N, H] (already scaled by the caller), k and v [B, S, K, H] with K dividing N,
query head i using kv head i // (N / K) (JAX's grouping, as HF ``repeat_kv``).
"""

from __future__ import annotations

import enum
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging
from flax import linen as nn
from jax.typing import DTypeLike

from paxlite.errors import SettingError
from paxlite.models.attention_sinks import softmax_with_sinks
from paxlite.models.kernel_masks import (
    LARGE_NEGATIVE,
    chunk_sink_problems,
    make_attention_mask,
    xla_attention,
)
from paxlite.models.splash_attention import mesh_spec, require_splash, splash_attention
from paxlite.parallel.compile_targets import compile_platform

# cuDNN's flash kernels (JAX check_is_flash_attention): these dtypes, head dims a multiple of 8,
# at most 256 on Hopper and later (compute capability >= 9.0), at most 128 before.
CUDNN_DTYPES: tuple[str, ...] = ("bfloat16", "float16")
CUDNN_HEAD_DIM_MULTIPLE: int = 8
CUDNN_MAX_HEAD_DIM_HOPPER: int = 256
CUDNN_MAX_HEAD_DIM_PRE_HOPPER: int = 128
# Pallas-Triton tiles: forward blocks of up to 128 query/key rows, backward blocks of up to 32
# (JAX's BlockSizes.get_default()); sequences are padded up to a whole number of blocks.
PALLAS_FORWARD_BLOCK: int = 128
PALLAS_BACKWARD_BLOCK: int = 32

_HEAD_AXES: tuple[str, ...] = (
    "activation_batch", "activation_length", "activation_heads", "activation_kv",
)
_SEGMENT_AXES: tuple[str, ...] = ("activation_batch", "activation_length")


def einsum_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, mask: jax.Array | None = None,
    bias: jax.Array | None = None, segment_ids: jax.Array | None = None,
    dtype: DTypeLike = jnp.float32, logit_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Pax's DotProductAttention core (AttentionKind.DOT_PRODUCT): prescaled q [B, T, N, H], k, v
    [B, S, K, H] -> [B, T, N, H]; logits and softmax in float32, probabilities cast to dtype.
    sinks: [N] logits that join each head's softmax and are dropped (gpt-oss,
    models/attention_sinks.py); None: none.

    mask: bool [B|1, 1, T, S]; None: causal, restricted to segment_ids [B, T] when given.
    bias: float32 [B|1, N|1, T, S] added to the logits before the mask. With K < N, query head
    i = k * G + g reads kv head k (no copies of k/v are made). logit_cap: the logits become
    ``cap * tanh(logits / cap)`` before the bias and the mask (Gemma 2's soft-capping).
    """
    batch, length, n, h = q.shape
    kv = k.shape[2]
    if mask is None:
        mask = make_attention_mask(seq_len=length, segment_ids=segment_ids)
    if kv == n:
        logits = soft_cap(jnp.einsum("BTNH,BSNH->BNTS", q, k).astype(jnp.float32), logit_cap)
        if bias is not None:
            logits = logits + bias  # [B, N, T, S]
        logits = jnp.where(mask, logits, LARGE_NEGATIVE)
        probs = softmax_with_sinks(logits, sinks).astype(dtype)  # [B, N, T, S]
        return jnp.einsum("BNTS,BSNH->BTNH", probs, v)
    qg = q.reshape(batch, length, kv, n // kv, h)  # [B, T, K, G, H]; head i = k*G + g
    logits = soft_cap(jnp.einsum("BTKGH,BSKH->BKGTS", qg, k).astype(jnp.float32), logit_cap)
    if bias is not None:
        if bias.shape[1] == 1:
            grouped_bias = bias[:, :, None]  # [B|1, 1, 1, T, S]
        else:
            grouped_bias = bias.reshape(bias.shape[0], kv, n // kv, *bias.shape[2:])
        logits = logits + grouped_bias  # [B, K, G, T, S]
    logits = jnp.where(mask[:, :, None], logits, LARGE_NEGATIVE)  # mask [B|1, 1, 1, T, S]
    probs = softmax_with_sinks(logits, sinks).astype(dtype)  # [B, K, G, T, S]
    return jnp.einsum("BKGTS,BSKH->BTKGH", probs, v).reshape(batch, length, n, h)


def soft_cap(logits: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(logits / cap)`` (Gemma 2's tanh soft-capping); the logits as they are for
    None."""
    if cap is None:
        return logits
    return cap * jnp.tanh(logits / cap)


class AttentionImplementation(str, enum.Enum):
    """The kernel behind ``AttentionKind.FLASH``; all compute the same function."""

    AUTO = "auto"  # cuDNN where it can run (GPU, bf16/fp16, head dims), else XLA
    XLA = "xla"  # jax.nn.dot_product_attention(implementation='xla'): any backend, any dtype
    CUDNN = "cudnn"  # cuDNN fused flash attention; packed rows through a dense mask
    PALLAS_TRITON = "pallas_triton"  # JAX's Pallas-Triton flash attention, segment ids in-kernel
    SPLASH = "splash"  # JAX's Pallas splash attention for TPUs, segment ids in-kernel

    @property
    def is_fused_kernel(self) -> bool:
        """A kernel asked for by name (not XLA's attention, not AUTO's choice)."""
        return self in (AttentionImplementation.CUDNN, AttentionImplementation.PALLAS_TRITON,
                        AttentionImplementation.SPLASH)


def cudnn_max_head_dim(compute_capability: str | None) -> int:
    """256 on Hopper and later (compute capability 9.0+), 128 before; 256 when unknown."""
    if not compute_capability:
        return CUDNN_MAX_HEAD_DIM_HOPPER
    major = int(str(compute_capability).split(".")[0])
    return CUDNN_MAX_HEAD_DIM_HOPPER if major >= 9 else CUDNN_MAX_HEAD_DIM_PRE_HOPPER


def cudnn_problems(
    *, dtype: Any, head_dim: int, seq_len: int | None = None, dense_bias: bool = False,
    backend: str | None = None, compute_capability: str | None = None,
    vmapped_stages: bool = False, compile_only: bool = False, chunk: int | None = None,
    sinks: bool = False,
) -> list[str]:
    """Why cuDNN flash attention cannot run here ([] when it can); chunk
    (attention_chunk_size) and sinks: the layer's, which it cannot run.

    compile_only: the program is compiled for a GPU this process does not have (the planner's
    targets): JAX checks cuDNN's head-dim limit against this process's devices, so there it is
    the pre-Hopper 128 whatever the target (DeepSeek's 192-wide heads compile with XLA's
    attention there, and with cuDNN on a real Hopper).

    backend / compute_capability None: not known yet (experiment validation), not checked.
    dense_bias: a mask (packed rows) or a logit bias reaches cuDNN as a dense bias, and its
    backward pass then needs an even sequence length. vmapped_stages: the layer runs inside a
    pipeline's vmap over stages, where JAX 0.12's cuDNN batching rule reshapes a [B, 1, T, S]
    mask to [B, N, T, S] and fails (a compile of the real step for H100 showed it).
    """
    problems = []
    if backend is not None and backend != "gpu":
        problems.append(
            f"cuDNN flash attention runs on NVIDIA GPUs, and this job's JAX backend is {backend!r}")
    name = jnp.dtype(dtype).name
    if name not in CUDNN_DTYPES:
        problems.append(
            f"cuDNN flash attention takes {' or '.join(CUDNN_DTYPES)} activations, and the compute "
            f"dtype is {name}")
    limit = CUDNN_MAX_HEAD_DIM_PRE_HOPPER if compile_only else cudnn_max_head_dim(
        compute_capability)
    if head_dim % CUDNN_HEAD_DIM_MULTIPLE or head_dim > limit:
        where = ("a GPU compiled for without one: JAX checks the local devices" if compile_only
                 else f"compute capability {compute_capability}" if compute_capability
                 else "Hopper")
        problems.append(
            f"cuDNN flash attention needs dims per head a multiple of {CUDNN_HEAD_DIM_MULTIPLE} "
            f"and at most {limit} (on {where}; 128 before Hopper), got {head_dim}")
    if dense_bias and seq_len is not None and seq_len % 2:
        problems.append(
            f"with a mask (packed rows) or a logit bias cuDNN's backward pass needs an even "
            f"sequence length, got {seq_len}")
    if dense_bias and vmapped_stages:
        problems.append(
            "with a mask (packed rows) or a logit bias cuDNN cannot run inside a pipeline's stages "
            "(JAX's cuDNN batching rule cannot take the mask under the stages' vmap); unpacked "
            "rows (PACKED_INPUT=False) can")
    return problems + chunk_sink_problems("cuDNN flash attention", chunk=chunk, sinks=sinks)


def pallas_problems(*, has_bias: bool, backend: str | None = None, chunk: int | None = None,
                    sinks: bool = False) -> list[str]:
    """Why the Pallas-Triton kernel cannot run here ([] when it can); backend None: not checked;
    chunk (attention_chunk_size) and sinks: the layer's, which it cannot run."""
    problems = []
    if backend is not None and backend != "gpu":
        problems.append(
            f"the Pallas-Triton attention kernel runs on NVIDIA GPUs, and this job's JAX backend "
            f"is {backend!r} (on CPU it runs only interpreted, for tests: "
            "paxlite.models.attention_kernels.pallas_attention(interpret=True))")
    if has_bias:
        problems.append(
            "the Pallas-Triton attention kernel takes no logit bias (relative position bias): use "
            "'cudnn' or 'xla'")
    return problems + chunk_sink_problems("the Pallas-Triton attention kernel", chunk=chunk,
                                          sinks=sinks)


def _device_facts() -> tuple[str, str | None]:
    # The platform of the mesh the step is built on: a compile-only target's (a GPU or a TPU,
    # parallel/compile_targets), not this process's CPU backend, when the planner compiles for it.
    return compile_platform()


def resolve_implementation(
    requested: AttentionImplementation | str, *, dtype: Any, head_dim: int, seq_len: int,
    dense_bias: bool, has_bias: bool, backend: str | None = None,
    compute_capability: str | None = None, vmapped_stages: bool = False,
    chunk: int | None = None, sinks: bool = False, sliding_window: int | None = None,
) -> AttentionImplementation:
    """The kernel that runs: AUTO resolved, a named kernel checked (SettingError with every reason).

    backend None: this process's default backend and its first device's compute capability.
    chunk (attention_chunk_size), sinks and sliding_window: the layer's; AUTO runs XLA for a
    chunk or sinks, which cuDNN cannot take.
    """
    requested = AttentionImplementation(requested)
    compile_only = False
    if backend is None:
        backend, compute_capability = _device_facts()
        compile_only = backend == "gpu" and jax.default_backend() != "gpu"
    cudnn = cudnn_problems(dtype=dtype, head_dim=head_dim, seq_len=seq_len, dense_bias=dense_bias,
                           backend=backend, compute_capability=compute_capability,
                           vmapped_stages=vmapped_stages, compile_only=compile_only,
                           chunk=chunk, sinks=sinks)
    if requested is AttentionImplementation.AUTO:
        log_auto_choice(cudnn)
        return AttentionImplementation.CUDNN if not cudnn else AttentionImplementation.XLA
    if requested is AttentionImplementation.SPLASH:
        require_splash(has_bias=has_bias, backend=backend, chunk=chunk,
                       sliding_window=sliding_window)
        return requested
    if requested is AttentionImplementation.CUDNN and cudnn:
        raise SettingError(
            "attention implementation 'cudnn' (USE_CUDNN_FLASH_ATTENTION) cannot run: "
            + "; ".join(cudnn) + "; use 'auto' (cuDNN where it fits, else XLA) or 'xla'")
    if requested is AttentionImplementation.PALLAS_TRITON:
        pallas = pallas_problems(has_bias=has_bias, backend=backend, chunk=chunk, sinks=sinks)
        if pallas:
            raise SettingError(
                "attention implementation 'pallas_triton' cannot run: " + "; ".join(pallas))
    return requested


def auto_choice_message(cudnn: list[str]) -> str:
    """What AUTO runs, given why cuDNN cannot run here (``cudnn_problems``; [] when it can)."""
    if not cudnn:
        return "ATTENTION_IMPLEMENTATION='auto' runs cuDNN flash attention"
    if any("backend is 'tpu'" in reason for reason in cudnn):
        return ("ATTENTION_IMPLEMENTATION='auto' runs XLA attention (jax.nn.dot_product_attention "
                "implementation='xla') on this TPU; ATTENTION_IMPLEMENTATION='splash' runs the "
                "TPU splash attention kernel")
    return ("ATTENTION_IMPLEMENTATION='auto' runs XLA attention (jax.nn.dot_product_attention "
            "implementation='xla'), not cuDNN flash attention: " + "; ".join(cudnn))


@functools.cache
def _log_once(message: str, *, warn: bool) -> None:
    # Every attention layer of the model resolves AUTO when it is traced (and again under remat);
    # the choice is the same for all of them, so it is logged once per process per distinct reason.
    (logging.warning if warn else logging.info)("%s", message)


def log_auto_choice(cudnn: list[str]) -> None:
    """Logs once what AUTO chose and why: a warning when it falls back to XLA, else info."""
    _log_once(auto_choice_message(cudnn), warn=bool(cudnn))


def flash_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, implementation: AttentionImplementation,
    mask: jax.Array | None = None, bias: jax.Array | None = None,
    segment_ids: jax.Array | None = None, interpret: bool = False,
    sliding_window: int | None = None, logit_cap: float | None = None,
    chunk: int | None = None, positions: jax.Array | None = None, sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of prescaled q [B, T, N, H] over k, v [B, S, K, H] -> [B, T, N, H].

    sliding_window: query slot i sees key slots j > i - sliding_window only: JAX's local window
    (sliding_window - 1 keys to the left, none to the right), which the XLA kernel masks as
    ``i <= j + left``, cuDNN runs as its window of left + 1 and splash as a local mask; the
    Pallas-Triton kernel has none (SettingError). Slots equal positions within each packed
    segment, so this is exact there too.

    implementation: a resolved kernel (not AUTO). mask: bool [B|1, 1, T, S], a subset of causal
    (None: causal only); the XLA and cuDNN kernels read it, the Pallas kernel reads segment_ids
    [B, T] instead (mask must then be the one they make). bias: float [B|1, N|1, T, S].

    chunk: keys in the query's chunk of ``chunk`` positions only (Llama 4; ``positions`` [B, T],
    None: the slots); sinks: float [N] logits in every softmax (gpt-oss). XLA and splash run them
    (models/kernel_masks.py, models/splash_attention.py); cuDNN and Pallas-Triton refuse them.
    """
    implementation = AttentionImplementation(implementation)
    if implementation is AttentionImplementation.AUTO:
        raise ValueError("flash_attention needs a resolved implementation; see "
                         "resolve_implementation")
    if implementation in (AttentionImplementation.CUDNN, AttentionImplementation.PALLAS_TRITON):
        problems = chunk_sink_problems(f"attention implementation {implementation.value!r}",
                                       chunk=chunk, sinks=sinks is not None)
        if problems:
            raise SettingError(problems[0])
    if implementation is AttentionImplementation.PALLAS_TRITON:
        if sliding_window is not None:
            raise SettingError(
                f"attention implementation 'pallas_triton' cannot run sliding_window="
                f"{sliding_window}: the kernel has no local window; use 'auto', 'cudnn' or 'xla'")
        if bias is not None:
            raise SettingError(pallas_problems(has_bias=True)[0])
        if mask is not None and segment_ids is None:
            raise ValueError(
                "the Pallas-Triton kernel masks by segment ids: pass segment_ids [B, T] for a mask")
        return pallas_attention(q, k, v, segment_ids=segment_ids, interpret=interpret)
    if implementation is AttentionImplementation.SPLASH:
        if bias is not None:
            raise SettingError(splash_problems_text())
        if mask is not None and segment_ids is None:
            raise ValueError(
                "the splash kernel masks by segment ids: pass segment_ids [B, T] for a mask")
        return splash_attention(q, k, v, segment_ids=segment_ids, sliding_window=sliding_window,
                                logit_cap=logit_cap, interpret=interpret, chunk=chunk,
                                positions=positions, sinks=sinks)
    if logit_cap is not None:
        raise SettingError(
            f"attention_logit_cap={logit_cap} cannot run with attention implementation "
            f"{implementation.value!r}: JAX's XLA, cuDNN and Pallas-Triton fused kernels have no "
            "logit soft-capping; use attention implementation 'splash' (TPU) or attention kind "
            "'dot_product'")
    if bias is not None and implementation is AttentionImplementation.CUDNN:
        # cuDNN folds the mask into a bias of q's dtype; Pax computes the relative bias in the
        # activation dtype too.
        bias = bias.astype(q.dtype)
    if implementation is AttentionImplementation.XLA and (chunk is not None or sinks is not None):
        return xla_attention(q, k, v, mask=mask, bias=bias, sliding_window=sliding_window,
                             chunk=chunk, positions=positions, sinks=sinks)
    window = None if sliding_window is None else (sliding_window - 1, 0)
    return jax.nn.dot_product_attention(
        q, k, v, bias=bias, mask=mask, scale=1.0, is_causal=True,
        implementation=implementation.value, local_window_size=window,
    )


def fused_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, implementation: AttentionImplementation,
    mask: jax.Array | None, bias: jax.Array | None, segment_ids: jax.Array | None,
    vmapped_stages: bool, sliding_window: int | None, logit_cap: float | None = None,
    chunk: int | None = None, positions: jax.Array | None = None, sinks: jax.Array | None = None,
) -> jax.Array:
    """``AttentionCore.FUSED``: prescaled q [B, T, N, H], k, v [B, T, K, H] -> [B, T, N, H].

    Causal kernels; a mask (same-segment for packed rows) is a subset of causal, and the Pallas
    kernel reads segment_ids instead. Resolved per call: what a kernel can run depends on the
    traced dtype, sizes and bias, and on a pipeline's vmap. Only splash soft-caps the logits (the
    public XLA, cuDNN and Pallas-Triton APIs take no cap): a ``logit_cap`` with another kernel is
    a SettingError. chunk (positions [B, T]) and sinks [N]: Llama 4's chunks and gpt-oss's
    sinks, which XLA (AUTO's choice for them) and splash run (``flash_attention``)."""
    resolved = resolve_implementation(
        implementation, dtype=q.dtype, head_dim=q.shape[3], seq_len=q.shape[1],
        dense_bias=mask is not None or bias is not None, has_bias=bias is not None,
        vmapped_stages=vmapped_stages, chunk=chunk, sinks=sinks is not None,
        sliding_window=sliding_window,
    )
    return flash_attention(q, k, v, implementation=resolved, mask=mask, bias=bias,
                           segment_ids=segment_ids, sliding_window=sliding_window,
                           logit_cap=logit_cap, chunk=chunk, positions=positions, sinks=sinks)


def splash_problems_text() -> str:
    return ("attention implementation 'splash' cannot run: the splash attention kernel takes no "
            "logit bias (relative position bias): use 'xla'")


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pallas_block_sizes(seq_len: int) -> tuple[Any, int]:
    """(BlockSizes, padded length) for a sequence of seq_len: blocks of up to 128 rows forward and
    32 backward (powers of two, as Triton tiles must be), the length rounded up to whole blocks."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_mha

    forward = min(PALLAS_FORWARD_BLOCK, _next_power_of_two(seq_len))
    backward = min(PALLAS_BACKWARD_BLOCK, forward)
    sizes = pallas_mha.BlockSizes(
        block_q=forward, block_k=forward, block_q_dkv=backward, block_kv_dkv=backward,
        block_q_dq=backward, block_kv_dq=backward,
    )
    multiple = math.lcm(forward, backward)
    return sizes, -(-seq_len // multiple) * multiple


def pallas_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, segment_ids: jax.Array | None,
    interpret: bool = False,
) -> jax.Array:
    """Causal Pallas-Triton flash attention with packed rows: q [B, T, N, H] prescaled, k, v
    [B, T, K, H], segment_ids int [B, T] or None -> [B, T, N, H].

    Grouped kv heads are repeated to N (head i reads kv head i // G), so every query head is one
    kernel program; the sequence is zero-padded to whole blocks (padding comes after every real
    token, so causality keeps it out of real rows) and cut off again. Under a mesh the kernel runs
    per shard (``shard_map``): batch and heads split as the logical rules split the attention
    activations, since a Triton custom call cannot be partitioned by XLA. interpret=True runs it
    through the Pallas interpreter (CPU tests).
    """
    from jax.experimental.pallas.ops.gpu import attention as pallas_mha

    _, length, n, _ = q.shape
    kv = k.shape[2]
    if k.shape[1] != length or v.shape[1] != length:
        raise ValueError(f"self-attention only: q has {length} positions, k/v {k.shape[1]}")
    if kv != n:
        k = jnp.repeat(k, n // kv, axis=2)  # [B, T, N, H], head i = kv head i // G
        v = jnp.repeat(v, n // kv, axis=2)
    k = nn.with_logical_constraint(k, _HEAD_AXES)
    v = nn.with_logical_constraint(v, _HEAD_AXES)
    block_sizes, padded = pallas_block_sizes(length)
    if padded != length:
        pad = ((0, 0), (0, padded - length), (0, 0), (0, 0))
        q, k, v = (jnp.pad(a, pad) for a in (q, k, v))
        if segment_ids is not None:
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, padded - length)), constant_values=-1)
    if segment_ids is not None:
        segment_ids = segment_ids.astype(jnp.int32)

    def kernel(q, k, v, segment_ids=None):
        return pallas_mha.mha(q, k, v, segment_ids, sm_scale=1.0, causal=True,
                              block_sizes=block_sizes, interpret=interpret)

    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        head_spec = mesh_spec(_HEAD_AXES, mesh)
        specs = [head_spec] * 3
        if segment_ids is not None:
            specs.append(mesh_spec(_SEGMENT_AXES, mesh))
        kernel = jax.shard_map(kernel, mesh=mesh, in_specs=tuple(specs), out_specs=head_spec,
                               check_vma=False)
    args = (q, k, v) if segment_ids is None else (q, k, v, segment_ids)
    out = kernel(*args)
    return out[:, :length]
