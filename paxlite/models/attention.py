"""Causal self-attention: Pax GPT's fused QKV, or separate q/k/v with grouped-query attention.

The softmax(q k^T) v core has two formulations (``AttentionKind``): the explicit einsums
(DOT_PRODUCT, Pax's), or a fused attention kernel (FLASH), whose kernel is an
``AttentionImplementation`` (models/attention_kernels.py): cuDNN flash attention on GPUs where it
fits (AUTO), XLA's, cuDNN's or Pallas-Triton's by name; docs/attention.md says when each applies.
All compute the same function; AXLearn's ``-flash`` Fuji variants select FLASH. ``select_core``
says which core a call runs (``AttentionCore``: decoding and sequence parallelism have their own).
An optional additive logit bias (T5/GLaM relative position bias, models/relative_position.py)
enters after the 1/sqrt(H) query scaling and before the mask and softmax, where Pax adds it.

Sequence (context) parallelism: when the current mesh (``jax.set_mesh``) has a ``seq`` axis
larger than 1, the tokens of each row are sharded over it and the core runs as
``context_parallel_attention`` (models/context_parallel.py) instead, which is exact: the mask
compares token *positions* (plus segment ids), not slots, so a row reordered for load balance
(data/context_order.py) attends as the original row did. The projections, RoPE and the output
projection are per token and need nothing. While decoding (a KV cache) the sequence is not split.

The explicit-einsum core and its mask (``einsum_attention``, ``make_attention_mask``,
``LARGE_NEGATIVE``) live in models/attention_kernels.py, so that the sequence-parallel core can use
them without importing this module back; they stay importable from here.

Einsum letters: B batch, T query length, S key length, D model (embed) dims, K the 3 of q/k/v
(fused path) or the key/value heads (grouped path), N query heads, G query heads per kv head
(N = K * G), H dims per head.
"""

from __future__ import annotations

import enum
import functools
import math

import jax
import jax.numpy as jnp
from absl import logging
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from paxlite.errors import SettingError
from paxlite.models.attention_kernels import (
    LARGE_NEGATIVE,
    AttentionImplementation,
    einsum_attention,
    fused_attention,
    make_attention_mask,
)
from paxlite.models.attention_sinks import sinks_param
from paxlite.models.chunked_attention import local_mask, tune_query_key
from paxlite.models.context_parallel import context_parallel_attention
from paxlite.models.kv_cache import extend_cache
from paxlite.models.linear import Fp8Config, Linear, projection
from paxlite.models.lora import LoraSpec
from paxlite.models.norms import NormKind, norm_class
from paxlite.models.parallel_config import SEQ_AXIS, ContextParallelStrategy, mesh_axis_size
from paxlite.models.relative_position import RelativePositionBias
from paxlite.models.rotary import RopeScaling, apply_rotary
from paxlite.parallel import rules as rules_lib
from paxlite.parallel.mesh import BATCH_AXES

__all__ = [
    "CONTEXT_NAME", "HEAD_ACTIVATION_AXES", "KEY_PROJ_NAME", "KV_HEAD_ACTIVATION_AXES",
    "LARGE_NEGATIVE", "OUT_PROJ_NAME", "QKV_PROJ_NAME", "QUERY_PROJ_NAME", "TENSOR_AXIS",
    "VALUE_PROJ_NAME", "Attention", "AttentionCore", "AttentionKind", "check_attention_choice",
    "einsum_attention", "make_attention_mask", "select_core",
]

HEAD_ACTIVATION_AXES: tuple[str, ...] = (
    "activation_batch", "activation_length", "activation_heads", "activation_kv",
)
# Keys and values of grouped-query attention have fewer heads than the query; their head axis has
# its own logical name ("activation_kv_heads"; DEFAULT_RULES split it over tensor like the query's
# heads, which cuDNN requires, and attention repeats the kv heads to a multiple of that split when
# they are fewer: ``_repeat_kv_heads``).
KV_HEAD_ACTIVATION_AXES: tuple[str, ...] = (
    "activation_batch", "activation_length", "activation_kv_heads", "activation_kv",
)
# checkpoint_name tags (Pax's names) that the name-based remat policies select.
QKV_PROJ_NAME: str = "combined_qkv_proj"  # fused q/k/v projection output [B, T, 3, N, H]
QUERY_PROJ_NAME: str = "query_proj"  # separate projections (grouped path): q [B, T, N, H]
KEY_PROJ_NAME: str = "key_proj"  # k [B, T, K, H]
VALUE_PROJ_NAME: str = "value_proj"  # v [B, T, K, H]
CONTEXT_NAME: str = "context"  # probabilities x values, before the output projection [B, T, N, H]
OUT_PROJ_NAME: str = "out_proj"  # output projection [B, T, D]
# The mesh axis heads are split over (the rules' "activation_heads"); the sequence-parallel core
# keeps that split inside its shards when the kv heads divide over it.
TENSOR_AXIS: str = "tensor"


class AttentionKind(str, enum.Enum):
    """How softmax(q k^T) v is computed; the parameters and the result are the same."""

    DOT_PRODUCT = "dot_product"  # explicit einsums, float32 softmax (Pax DotProductAttention)
    FLASH = "flash"  # a fused kernel, chosen by AttentionImplementation (cuDNN on GPU by default)


def check_attention_choice(kind: AttentionKind | str,
                           implementation: AttentionImplementation | str) -> None:
    """A named kernel (cuDNN, Pallas-Triton) is a FLASH implementation; with DOT_PRODUCT it would
    be silently ignored, so that combination is refused."""
    kind, implementation = AttentionKind(kind), AttentionImplementation(implementation)
    if kind is AttentionKind.DOT_PRODUCT and implementation.is_fused_kernel:
        raise ValueError(
            f"attention implementation {implementation.value!r} is a fused kernel and attention "
            f"kind 'dot_product' runs einsums: use attention kind 'flash' with it")


class AttentionCore(str, enum.Enum):
    """Which computation of softmax(q k^T) v one call runs (``select_core``); all are exact."""

    EINSUM = "einsum"  # DOT_PRODUCT: Pax's explicit einsums, float32 softmax
    FUSED = "fused"  # FLASH: a fused kernel, its AttentionImplementation resolved per call
    CACHED = "cached"  # decoding: einsums over the whole KV cache under the caller's mask
    SEQUENCE_PARALLEL = "sequence_parallel"  # rows split over `seq`: context_parallel_attention


def select_core(*, kind: AttentionKind | str, decode: bool, seq_shards: int) -> AttentionCore:
    """The core a call runs. The kind decides only where it can: a KV cache is read under the
    caller's mask over all S_max slots, which the fused kernels (causal, S == T) cannot take, and
    rows split over a ``seq`` axis (never while decoding) need the context-parallel exchange."""
    if decode:
        return AttentionCore.CACHED
    if seq_shards > 1:
        return AttentionCore.SEQUENCE_PARALLEL
    if AttentionKind(kind) is AttentionKind.FLASH:
        return AttentionCore.FUSED
    return AttentionCore.EINSUM


class Attention(nn.Module):
    """Multi-head attention: projections -> (RoPE) -> scaled dot product (softmax in f32) -> out.

    With ``num_kv_heads`` unset or equal to ``num_heads`` this is Pax ``DotProductAttention`` with
    ``combine_qkv=True``: one fused ``qkv`` kernel [D, 3, N, H] (GPT's parameter layout). With fewer
    kv heads it is Pax ``MultiQueryDotProductAttention``: separate ``query`` [D, N, H], ``key`` and
    ``value`` [D, K, H] kernels, and query head i attends with kv head ``i // (N / K)`` (contiguous
    groups, as HF ``repeat_kv``). Either way the query is scaled by 1/sqrt(dims_per_head)
    (``internal_enable_per_dim_scale=False``).

    Attributes:
        num_kv_heads: key/value heads; None means num_heads. Must divide num_heads.
        rope_theta: None for no rotary embedding (GPT); else RoPE base (LLaMA-2: 10000) applied to
            q and k at the positions passed to ``__call__``.
        attention_kind: DOT_PRODUCT (einsums) or FLASH (a fused kernel, causal, with ``mask`` or
            ``segment_ids`` further restricting it to packed segments).
        attention_implementation: FLASH's kernel (AUTO: cuDNN where it fits, else XLA; XLA,
            CUDNN, PALLAS_TRITON by name, a SettingError naming why where it cannot run).
        lora: LoRA adapters on q, k, v (separate ones per q/k/v also when fused) and the output
            projection (Pax LORA_TARGET_LAYERS "attention"); None: none.
        relative_position_buckets: None for no relative bias; else this layer owns a T5 relative
            position bias table ``relative_bias/rel_bias`` [N, buckets] (GLaM: 32), added to its
            logits from the positions passed to ``__call__`` (causal buckets). Each layer has its
            own table, as in Pax, where ``relative_bias_tpl`` sits on every DotProductAttention.
        relative_position_max_distance: where the last bucket starts (GLaM: 128).
        rope_scaling: the RoPE frequencies rescaled (LLaMA-3.1's 'llama3'); None: plain.
        qkv_bias: biases on the q, k, v projections (Qwen2); None: as ``use_bias``, which
            alone decides the output projection's.
        qk_norm: RMSNorm (``qk_norm_epsilon``) over each head's q and k after the projection,
            before RoPE (Qwen3): parameters ``query_norm/scale`` and ``key_norm/scale`` [H].
        sliding_window: query at position i sees keys at positions j with
            i - sliding_window < j <= i (Mistral v0.1), in training and over a KV cache alike;
            the XLA and cuDNN kernels take it as their local window; Pallas-Triton and the
            sequence-parallel core cannot (SettingError). None: the whole context.
        qk_norm_kind: the q/k norms' kind (Gemma 3: its (1 + scale) RMSNorm).
        query_scale_dims: the query is scaled by this ** -0.5 (Gemma); None: dims_per_head.
        logit_cap: the logits become ``cap * tanh(logits / cap)`` before the mask (Gemma 2), in
            the einsum cores only; the fused and sequence-parallel ones refuse it (SettingError).
        sinks: a learned logit per head (``sinks`` [N]) in every softmax (gpt-oss,
            models/attention_sinks.py); not in the sequence-parallel core (SettingError).
        out_bias: a bias on the output projection; None: as ``use_bias`` (gpt-oss: True beside
            use_bias False, whose MLP has none).
        context_parallel_strategy: how the keys and values of other ``seq`` shards reach a
            shard's queries (ALL_GATHER or RING, models/context_parallel.py); read only when the
            mesh has a ``seq`` axis larger than 1. There, FLASH runs the same XLA einsum core
            (AUTO and XLA); a cuDNN or Pallas-Triton kernel named explicitly is a SettingError
            (it would see one shard of the row); a caller's ``bias`` and a ``mask`` without
            ``segment_ids`` are ValueErrors (the core masks by positions and segment ids); the
            layer's own relative position bias is supported, exactly.
    """

    num_heads: int
    dims_per_head: int
    num_kv_heads: int | None = None
    rope_theta: float | None = None
    use_bias: bool = True
    init_std: float = 0.02
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32
    attention_kind: AttentionKind = AttentionKind.DOT_PRODUCT
    attention_implementation: AttentionImplementation = AttentionImplementation.AUTO
    lora: LoraSpec | None = None
    relative_position_buckets: int | None = None
    relative_position_max_distance: int = 128
    scale_query: bool = True  # False: no 1/sqrt(H) (Pax GLaM's internal_enable_query_scale=False)
    fp8: Fp8Config | None = None  # q/k/v and output projections in FP8 (models/linear.py)
    # Incremental decoding (models/decode.py): keys and values go to the "cache" collection and
    # attention reads all cached ones under the caller's mask [B, 1, T, S_max].
    decode: bool = False
    context_parallel_strategy: ContextParallelStrategy = ContextParallelStrategy.ALL_GATHER
    # The layer is one of a pipeline's stages (vmapped over them): the kernel choice must know.
    pipelined: bool = False
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool | None = None
    qk_norm: bool = False
    qk_norm_epsilon: float = 1e-6
    sliding_window: int | None = None
    qk_norm_kind: NormKind = NormKind.RMS_NORM
    query_scale_dims: int | None = None
    logit_cap: float | None = None
    # Llama 4 (models/chunked_attention.py): keys of the query's own chunk of positions only; q, k
    # RMS-normed without weights after RoPE; the query times its position's temperature, given
    # as (floor, scale). None / False: off.
    chunk_size: int | None = None
    qk_l2_norm: bool = False
    query_temperature: tuple[int, float] | None = None
    sinks: bool = False
    out_bias: bool | None = None

    def _linear(self, *, equation: str, shape: tuple[int, ...], axes: tuple[str, ...],
                name: str, lora_groups: int = 0) -> Linear:
        """A q, k, v (or fused qkv) projection; its bias follows ``qkv_bias``."""
        bias = self.use_bias if self.qkv_bias is None else self.qkv_bias
        return projection(self, equation=equation, shape=shape, axes=axes,
                          bias_axes=axes[1:] if bias else None, name=name,
                          lora=None if self.lora is None else self.lora.with_groups(lora_groups))

    @nn.compact
    def __call__(
        self, x: jax.Array, mask: jax.Array | None, positions: jax.Array | None = None, *,
        bias: jax.Array | None = None, segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """x [B, T, D], mask bool broadcastable to [B, N, T, S] (a subset of causal; None: causal
        only, which lets a fused kernel skip building one), positions int [B, T] (RoPE and the
        relative bias read them; default arange) -> [B, T, D] in dtype. Under a mesh with a
        ``seq`` axis > 1 the mask is causal in ``positions`` (a row may be reordered) and, for
        packed rows, restricted by ``segment_ids``; ``mask`` must then be the one they make.

        segment_ids: int [B, T] of packed rows, given with the mask they make
        (``make_attention_mask``); the Pallas-Triton kernel masks by them instead of the mask.

        bias: optional float32 [B|1, N|1, T, S] added to the logits (after the query scaling,
        before the mask), e.g. a relative position bias shared by several layers; with
        ``relative_position_buckets`` set too, the two are summed.
        """
        batch, length, _ = x.shape
        q, k, v, kv_axes = self._project_qkv(x)  # q [B, T, N, H], k, v [B, T, K, H]
        check_attention_choice(self.attention_kind, self.attention_implementation)
        seq_shards = 1 if self.decode else mesh_axis_size(SEQ_AXIS)
        core = select_core(kind=self.attention_kind, decode=self.decode, seq_shards=seq_shards)

        sequence_parallel = core is AttentionCore.SEQUENCE_PARALLEL
        if positions is None and (self.rope_theta is not None or sequence_parallel
                                  or self.sliding_window is not None or self.chunk_size
                                  or self.query_temperature is not None):
            positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        if self.qk_norm:  # per head, over H: q [B, T, N, H], k [B, T, K, H]
            q = self._head_norm(name="query_norm")(q)
            k = self._head_norm(name="key_norm")(k)
        if self.rope_theta is not None:
            q = apply_rotary(q, positions, theta=self.rope_theta, scaling=self.rope_scaling)
            k = apply_rotary(k, positions, theta=self.rope_theta, scaling=self.rope_scaling)
        q, k = tune_query_key(q, k, positions, l2_norm=self.qk_l2_norm,
                              epsilon=self.qk_norm_epsilon, temperature=self.query_temperature)
        if self.scale_query:
            scale_dims = self.query_scale_dims or self.dims_per_head
            q = q * jnp.asarray(scale_dims**-0.5, dtype=self.dtype)
        key_positions = positions
        if self.decode:  # k, v [B, S_max, K, H] from here on
            k, v, key_positions = extend_cache(self, k, v, positions, kv_axes=kv_axes)
        if not sequence_parallel:  # sharded rows take the relative bias by distance, not [T, S]
            bias = self._logit_bias(bias, positions, key_positions, batch=batch, length=length)
        if core in (AttentionCore.EINSUM, AttentionCore.CACHED):  # [B, 1, T, S] or None
            mask = local_mask(mask, positions, key_positions, length=length,
                              segment_ids=segment_ids, window=self.sliding_window,
                              chunk=self.chunk_size)

        sinks = sinks_param(self, supported=not sequence_parallel, core=core.value)
        if core is AttentionCore.SEQUENCE_PARALLEL:
            out = self._sequence_parallel_core(q, k, v, mask=mask, bias=bias,
                                               positions=positions, segment_ids=segment_ids,
                                               seq_shards=seq_shards)
        elif core is AttentionCore.CACHED:  # the caller's mask over the whole cache
            out = einsum_attention(q, k, v, mask=mask, bias=bias, dtype=self.dtype,
                                   logit_cap=self.logit_cap, sinks=sinks)
        elif core is AttentionCore.FUSED:  # the kernel applies the window and the chunk
            out = fused_attention(q, k, v, implementation=self.attention_implementation,
                                  mask=mask, bias=bias, segment_ids=segment_ids,
                                  vmapped_stages=self.pipelined,
                                  sliding_window=self.sliding_window, logit_cap=self.logit_cap,
                                  chunk=self.chunk_size, positions=positions, sinks=sinks)
        else:
            out = einsum_attention(q, k, v, mask=mask, bias=bias, segment_ids=segment_ids,
                                   dtype=self.dtype, logit_cap=self.logit_cap, sinks=sinks)
        out = nn.with_logical_constraint(out, HEAD_ACTIVATION_AXES)  # [B, T, N, H]
        out = checkpoint_name(out, CONTEXT_NAME)

        out_bias = self.use_bias if self.out_bias is None else self.out_bias
        out = projection(
            self, equation="BTNH,NHD->BTD",
            shape=(self.num_heads, self.dims_per_head, x.shape[-1]),
            axes=("heads", "kv", "embed"), bias_axes=("norm",) if out_bias else None,
            name="out", lora=self.lora)(out)  # [B, T, D]
        return checkpoint_name(out, OUT_PROJ_NAME)

    def _project_qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array,
                                                   tuple[str, ...]]:
        """x [B, T, D] -> q [B, T, N, H], k, v [B, T, K, H] and the logical axes of k and v, in
        Pax's two parameter layouts (the class docstring); grouped kv heads may be repeated to fit
        the tensor split (``_repeat_kv_heads``)."""
        model_dims = x.shape[-1]
        n, h = self.num_heads, self.dims_per_head
        kv = n if self.num_kv_heads is None else self.num_kv_heads
        if kv <= 0 or n % kv:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} must be a positive divisor of "
                f"num_heads={n}"
            )
        if kv == n:
            qkv = self._linear(
                equation="BTD,DKNH->BTKNH", shape=(model_dims, 3, n, h),
                axes=("embed", "qkv", "heads", "kv"), name="qkv", lora_groups=1,
            )(x)  # [B, T, 3, N, H]
            qkv = checkpoint_name(qkv, QKV_PROJ_NAME)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # each [B, T, N, H]
            kv_axes = HEAD_ACTIVATION_AXES
        else:
            q = self._linear(
                equation="BTD,DNH->BTNH", shape=(model_dims, n, h),
                axes=("embed", "heads", "kv"), name="query",
            )(x)  # [B, T, N, H]
            k = self._linear(
                equation="BTD,DKH->BTKH", shape=(model_dims, kv, h),
                axes=("embed", "kv_heads", "kv"), name="key",
            )(x)  # [B, T, K, H]
            v = self._linear(
                equation="BTD,DKH->BTKH", shape=(model_dims, kv, h),
                axes=("embed", "kv_heads", "kv"), name="value",
            )(x)  # [B, T, K, H]
            q = checkpoint_name(q, QUERY_PROJ_NAME)
            k = checkpoint_name(k, KEY_PROJ_NAME)
            v = checkpoint_name(v, VALUE_PROJ_NAME)
            kv_axes = KV_HEAD_ACTIVATION_AXES
            k, v = _repeat_kv_heads(k, v, num_heads=n)
        q = nn.with_logical_constraint(q, HEAD_ACTIVATION_AXES)
        k = rules_lib.logical_constraint(k, kv_axes)
        v = rules_lib.logical_constraint(v, kv_axes)
        return q, k, v, kv_axes

    def _sequence_parallel_core(
        self, q: jax.Array, k: jax.Array, v: jax.Array, *, mask: jax.Array | None,
        bias: jax.Array | None, positions: jax.Array, segment_ids: jax.Array | None,
        seq_shards: int,
    ) -> jax.Array:
        """softmax(q k^T) v of rows sharded on T over the ``seq`` axis: prescaled q [B, T, N, H],
        k, v [B, T, K, H] (after RoPE), positions [B, T] -> [B, T, N, H].

        The relative position bias reaches the core as one bias per head and distance; the
        shards' layout is ``_sequence_parallel_axes``'.
        """
        where = f"the mesh's {SEQ_AXIS!r} axis has size {seq_shards}"
        refused = (("sliding_window", self.sliding_window, "attends to the whole context"),
                   ("attention_logit_cap", self.logit_cap, "has no logit soft-capping"),
                   ("attention_chunk_size", self.chunk_size, "has no chunked attention"))
        for name, value, why in refused:
            if value is not None:
                raise SettingError(f"{name}={value} cannot run with sequence parallelism "
                                   f"({where}): the context-parallel core {why}; use a seq axis "
                                   "of 1")
        if bias is not None:
            raise ValueError(
                f"attention takes no logit bias argument with sequence parallelism ({where}): "
                "give the layer relative_position_buckets instead, or use a seq axis of 1")
        if mask is not None and segment_ids is None:
            raise ValueError(
                f"with sequence parallelism ({where}) attention masks by positions and "
                "segment_ids: pass segment_ids [B, T] with the mask they make, not a mask alone")
        implementation = AttentionImplementation(self.attention_implementation)
        if AttentionKind(self.attention_kind) is AttentionKind.FLASH:
            if implementation.is_fused_kernel:
                raise SettingError(
                    f"attention implementation {implementation.value!r} cannot run with sequence "
                    f"parallelism ({where}): the kernel would see one shard of each row; use "
                    "'auto' or 'xla' (the context-parallel XLA core), or a seq axis of 1")
            _log_once(f"sequence parallelism ({where}): FLASH attention runs the "
                      "context-parallel XLA einsum core, not a fused kernel")
        distance_bias = None
        if self.relative_position_buckets is not None:
            distance_bias = self._distance_bias()
        mesh = jax.sharding.get_abstract_mesh()
        batch_axes, head_axes = _sequence_parallel_axes(
            mesh, batch=q.shape[0], num_heads=q.shape[2], num_kv_heads=k.shape[2])
        return context_parallel_attention(
            q, k, v, q_positions=positions, kv_positions=positions, segment_ids=segment_ids,
            distance_bias=distance_bias, strategy=self.context_parallel_strategy, mesh=mesh,
            axis_name=SEQ_AXIS, batch_axes=batch_axes, head_axes=head_axes)

    def _head_norm(self, *, name: str) -> nn.Module:
        return norm_class(self.qk_norm_kind)(epsilon=self.qk_norm_epsilon, dtype=self.dtype,
                                             param_dtype=self.param_dtype, name=name)

    def _distance_bias(self) -> jax.Array:
        """This layer's relative position bias as float32 [N, L]: column d is the bias of a key d
        positions before the query, through the same table and buckets as ``_logit_bias``.

        With causal buckets every distance beyond ``max_distance`` falls into the last bucket, so
        L = max_distance + 2 columns cover every distance (the core clips d to L - 1), and keys
        ahead of the query (d < 0) are masked. The parameter is the same ``relative_bias/rel_bias``.
        """
        span = self.relative_position_max_distance + 2
        bias = self._relative_bias()(
            jnp.arange(span, dtype=jnp.int32)[None, :], jnp.zeros((1, 1), jnp.int32))  # [1,N,L,1]
        return bias[0, :, :, 0]  # [N, L]: query at position d, key at 0

    def _relative_bias(self) -> RelativePositionBias:
        """This layer's T5 bias table (``relative_bias/rel_bias``), whichever way it is read."""
        return RelativePositionBias(
            num_buckets=self.relative_position_buckets,
            max_distance=self.relative_position_max_distance,
            num_heads=self.num_heads,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="relative_bias",
        )

    def _logit_bias(
        self, bias: jax.Array | None, positions: jax.Array | None,
        key_positions: jax.Array | None = None, *, batch: int, length: int,
    ) -> jax.Array | None:
        """The caller's bias checked, plus this layer's relative position bias when it has one.

        Without positions the relative bias is built from arange [1, T] (one [1, N, T, S] for the
        whole batch); with positions [B, T] each row uses its own, so packed documents whose
        positions restart at 0 see the same distances as unpacked ones.
        """
        n = self.num_heads
        if bias is not None:
            shape = bias.shape
            if (bias.ndim != 4 or shape[0] not in (1, batch) or shape[1] not in (1, n)
                    or shape[2:] != (length, length)):
                raise ValueError(
                    f"attention bias must have shape [1 or {batch}, 1 or {n}, {length}, "
                    f"{length}], got {shape}"
                )
            bias = bias.astype(jnp.float32)
        if self.relative_position_buckets is None:
            return bias
        if positions is None:
            positions = jnp.arange(length, dtype=jnp.int32)[None, :]  # [1, T]
        if key_positions is None:
            key_positions = positions
        relative = self._relative_bias()(positions, key_positions)  # [B|1, N, T, S]
        return relative if bias is None else bias + relative


def _repeat_kv_heads(k: jax.Array, v: jax.Array, *, num_heads: int) -> tuple[jax.Array, jax.Array]:
    """k, v [B, T, K, H] with each kv head repeated so that the split of "activation_kv_heads"
    (the tensor axis under DEFAULT_RULES, mesh and rules in context) divides them: K' =
    lcm(K, split) heads, each device holding the kv heads its query heads use.

    Why: with fewer kv heads than the tensor axis (2 kv heads, tensor 4; MQA) the kv heads cannot
    be split, and whole kv heads beside split query heads are what cuDNN's attention refuses
    ("Query, key and value should have same sharding"). Exact: query head i reads kv head
    i // (N / K') of the repeated heads, which is kv head i // (N / K). The parameters keep their
    K heads (replicated over tensor, rules.FITTED_NAMES); a KV cache holds K' heads split over
    tensor, as many per device as whole K heads would be at most.
    """
    kv = k.shape[2]
    ways = rules_lib.mesh_ways("activation_kv_heads")
    target = math.lcm(kv, ways)
    if target == kv or num_heads % target:  # divides already; or no split of the queries fits
        return k, v
    # whole heads first (fitted: the split dropped), so the projection stays as it is
    k = rules_lib.logical_constraint(k, KV_HEAD_ACTIVATION_AXES)
    v = rules_lib.logical_constraint(v, KV_HEAD_ACTIVATION_AXES)
    return jnp.repeat(k, target // kv, axis=2), jnp.repeat(v, target // kv, axis=2)


def _sequence_parallel_axes(mesh: jax.sharding.AbstractMesh, *, batch: int, num_heads: int,
                            num_kv_heads: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(batch axes, head axes) of the context-parallel core's shards: the batch over the mesh's
    batch axes that divide B (data, fsdp, expert), the heads over ``tensor`` when the kv heads
    divide over it (else whole heads in every shard, still exact)."""
    batch_axes: tuple[str, ...] = ()
    ways = 1
    for axis in BATCH_AXES:
        if axis in mesh.axis_names and batch % (ways * mesh.shape[axis]) == 0:
            batch_axes += (axis,)
            ways *= mesh.shape[axis]
    tensor = mesh.shape[TENSOR_AXIS] if TENSOR_AXIS in mesh.axis_names else 1
    divides = tensor > 1 and num_kv_heads % tensor == 0 and num_heads % tensor == 0
    return batch_axes, (TENSOR_AXIS,) if divides else ()


@functools.cache
def _log_once(message: str) -> None:
    # Every attention layer is traced (and again under remat) with the same choice: log it once.
    logging.info("%s", message)
