"""Multi-head latent attention (MLA: DeepSeek-V2 and V3), beside the multi-head attention of
models/attention.py.

Keys and values come from one low-rank latent per token: ``kv_a`` projects x to a latent of
``kv_lora_rank`` (RMS-normalised, ``kv_a_norm``) that ``key_b`` and ``value_b`` expand to each
head's key part without position (``qk_nope_head_dims``) and value (``v_head_dims``); ``key_rope``
projects x to one rotary key part of ``qk_rope_head_dims`` that every head shares. The query is
one projection (``query``, DeepSeek-V2-Lite's ``q_proj``) or a low-rank pair ``q_a`` -> RMSNorm
``q_a_norm`` -> ``q_b`` (``q_lora_rank``, V3); each head's query is its non-rotary part followed
by its rotary part, and so is each head's key. The value head size may differ from the query/key
head size; the logits are scaled by ``softmax_scale`` (``qk_head_dims ** -0.5`` times YaRN's
``mscale ** 2`` where the checkpoint asks for it, which the config computes).

Rotary embeddings use paxlite's interleaved-pair layout (models/rotary.py), which is the layout of
DeepSeek's checkpoints (V2's complex pairs; V3's ``rope_interleave``, whose concatenated output is
one permutation of the rotated dimensions applied to q and k alike, so their products are equal).

Training runs the einsum core or a fused kernel (``AttentionKind.FLASH``; q, k and v zero-padded to
one head size where v's differs, which changes no product); decoding caches the expanded per-head
keys and values (models/kv_cache.py) and reads them under the caller's mask. Rows split over a
``seq`` mesh axis are refused (no context-parallel MLA core).

Einsum letters: B batch, T length, D model dims, R a latent rank, N heads, H dims per head part.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from paxlite.errors import SettingError
from paxlite.models.attention import (
    CONTEXT_NAME,
    HEAD_ACTIVATION_AXES,
    OUT_PROJ_NAME,
    QUERY_PROJ_NAME,
    AttentionCore,
    AttentionKind,
    check_attention_choice,
    select_core,
)
from paxlite.models.attention_kernels import (
    AttentionImplementation,
    einsum_attention,
    fused_attention,
)
from paxlite.models.kv_cache import extend_cache
from paxlite.models.linear import Fp8Config, Linear, projection
from paxlite.models.lora import LoraSpec
from paxlite.models.norms import RMSNorm
from paxlite.models.parallel_config import SEQ_AXIS, mesh_axis_size
from paxlite.models.rotary import RopeScaling, apply_rotary

# The logical name of a latent's rank dimension (kept whole: DEFAULT_RULES map it to None).
LATENT_AXIS = "mla_latent"
# DeepSeek's q_a_layernorm and kv_a_layernorm use their class's default epsilon, not the
# model's rms_norm_eps.
LATENT_NORM_EPSILON = 1e-6


def yarn_mscale(scale: float, mscale: float) -> float:
    """DeepSeek's ``yarn_get_mscale``: 1 up to a factor of 1, else 0.1 mscale ln(scale) + 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(*, qk_head_dims: int, scaling: RopeScaling | None) -> float:
    """qk_head_dims ** -0.5, times yarn_mscale(factor, mscale_all_dim) ** 2 under YaRN with a
    nonzero ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``): ``MlaConfig.softmax_scale``
    of DeepSeek's config.json (interop) and of its registered experiments."""
    scale = qk_head_dims ** -0.5
    if scaling is not None and scaling.mscale_all_dim:
        scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    return scale


def _count(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlaConfig:
    """The sizes of multi-head latent attention (``TransformerConfig.mla``); plain values.

    Attributes:
        kv_lora_rank: the key/value latent's size.
        qk_nope_head_dims: each head's query/key part without rotary embedding.
        qk_rope_head_dims: each head's rotary query part, and the size of the shared rotary key.
        v_head_dims: each head's value size.
        q_lora_rank: the query latent's size; None: one query projection.
        softmax_scale: the logits' scale; None: ``qk_head_dims ** -0.5``.
    """

    kv_lora_rank: int
    qk_nope_head_dims: int
    qk_rope_head_dims: int
    v_head_dims: int
    q_lora_rank: int | None = None
    softmax_scale: float | None = None

    def __post_init__(self) -> None:
        problems = [f"{name}={getattr(self, name)!r} must be a positive integer"
                    for name in ("kv_lora_rank", "qk_nope_head_dims", "qk_rope_head_dims",
                                 "v_head_dims") if not _count(getattr(self, name))]
        if self.q_lora_rank is not None and not _count(self.q_lora_rank):
            problems.append(f"q_lora_rank={self.q_lora_rank!r} must be a positive integer or "
                            "None (one query projection)")
        if _count(self.qk_rope_head_dims) and self.qk_rope_head_dims % 2:
            problems.append(f"qk_rope_head_dims={self.qk_rope_head_dims} must be even (RoPE "
                            "rotates pairs)")
        scale = self.softmax_scale
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not scale > 0):
            problems.append(f"softmax_scale={scale!r} must be a positive number or None")
        if problems:
            raise ValueError("MlaConfig: " + "; ".join(problems))

    @property
    def qk_head_dims(self) -> int:
        return self.qk_nope_head_dims + self.qk_rope_head_dims

    @property
    def scale(self) -> float:
        return self.qk_head_dims ** -0.5 if self.softmax_scale is None else self.softmax_scale


def _pad_heads(x: jax.Array, dims: int) -> jax.Array:
    """x [B, T, N, H] zero-padded to H = dims (a no-op when it is already that size)."""
    return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, dims - x.shape[-1])))


class MlaAttention(nn.Module):
    """x [B, T, D] -> [B, T, D]: multi-head latent attention (module docstring); the same call as
    ``Attention``'s (mask, positions, segment_ids). ``lora`` puts adapters on every projection."""

    config: MlaConfig
    num_heads: int
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    init_std: float = 0.02
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32
    attention_kind: AttentionKind = AttentionKind.DOT_PRODUCT
    attention_implementation: AttentionImplementation = AttentionImplementation.AUTO
    lora: LoraSpec | None = None
    fp8: Fp8Config | None = None
    decode: bool = False
    pipelined: bool = False

    def _proj(self, equation: str, shape: tuple[int, ...], axes: tuple[str, ...],
              name: str) -> Linear:
        return projection(self, equation=equation, shape=shape, axes=axes, bias_axes=None,
                          name=name, lora=self.lora)

    def _latent_norm(self, name: str) -> RMSNorm:
        return RMSNorm(epsilon=LATENT_NORM_EPSILON, dtype=self.dtype,
                       param_dtype=self.param_dtype, name=name)

    @nn.compact
    def __call__(
        self, x: jax.Array, mask: jax.Array | None, positions: jax.Array | None = None, *,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        cfg = self.config
        batch, length, model_dims = x.shape
        n, h_nope, h_rope, h_v = (self.num_heads, cfg.qk_nope_head_dims, cfg.qk_rope_head_dims,
                                  cfg.v_head_dims)
        h_qk = cfg.qk_head_dims
        check_attention_choice(self.attention_kind, self.attention_implementation)
        seq_shards = 1 if self.decode else mesh_axis_size(SEQ_AXIS)
        core = select_core(kind=self.attention_kind, decode=self.decode, seq_shards=seq_shards)
        if core is AttentionCore.SEQUENCE_PARALLEL:
            raise SettingError(f"multi-head latent attention (mla) cannot run with the mesh's seq "
                               f"axis of {seq_shards}: it has no context-parallel core; use seq=1")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))

        if cfg.q_lora_rank is None:
            q = self._proj("BTD,DNH->BTNH", (model_dims, n, h_qk), ("embed", "heads", "kv"),
                           "query")(x)  # [B, T, N, H_qk]
        else:
            q_latent = self._proj("BTD,DR->BTR", (model_dims, cfg.q_lora_rank),
                                  ("embed", LATENT_AXIS), "q_a")(x)  # [B, T, R_q]
            q_latent = self._latent_norm("q_a_norm")(q_latent)
            q = self._proj("BTR,RNH->BTNH", (cfg.q_lora_rank, n, h_qk),
                           (LATENT_AXIS, "heads", "kv"), "q_b")(q_latent)  # [B, T, N, H_qk]
        q = checkpoint_name(nn.with_logical_constraint(q, HEAD_ACTIVATION_AXES), QUERY_PROJ_NAME)

        kv_latent = self._proj("BTD,DR->BTR", (model_dims, cfg.kv_lora_rank),
                               ("embed", LATENT_AXIS), "kv_a")(x)  # [B, T, R_kv]
        kv_latent = self._latent_norm("kv_a_norm")(kv_latent)
        k_rope = self._proj("BTD,DH->BTH", (model_dims, h_rope), ("embed", "kv"),
                            "key_rope")(x)[:, :, None, :]  # [B, T, 1, H_rope]
        k_nope = self._proj("BTR,RNH->BTNH", (cfg.kv_lora_rank, n, h_nope),
                            (LATENT_AXIS, "heads", "kv"), "key_b")(kv_latent)  # [B, T, N, H_nope]
        v = self._proj("BTR,RNH->BTNH", (cfg.kv_lora_rank, n, h_v),
                       (LATENT_AXIS, "heads", "kv"), "value_b")(kv_latent)  # [B, T, N, H_v]

        rope = {"theta": self.rope_theta, "scaling": self.rope_scaling}
        q_rope = apply_rotary(q[..., h_nope:], positions, **rope)  # [B, T, N, H_rope]
        k_rope = apply_rotary(k_rope, positions, **rope)  # [B, T, 1, H_rope]
        q = jnp.concatenate([q[..., :h_nope], q_rope], axis=-1)  # [B, T, N, H_qk]
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (batch, length, n, h_rope))],
                            axis=-1)  # [B, T, N, H_qk]
        q = q * jnp.asarray(cfg.scale, dtype=self.dtype)
        k = nn.with_logical_constraint(k, HEAD_ACTIVATION_AXES)
        v = nn.with_logical_constraint(v, HEAD_ACTIVATION_AXES)

        if self.decode:  # k [B, S_max, N, H_qk], v [B, S_max, N, H_v]
            k, v, _ = extend_cache(self, k, v, positions, kv_axes=HEAD_ACTIVATION_AXES)
        if core is AttentionCore.FUSED:  # one head size for the kernel; zeros change no product
            dims = max(h_qk, h_v)
            out = fused_attention(_pad_heads(q, dims), _pad_heads(k, dims), _pad_heads(v, dims),
                                  implementation=self.attention_implementation, mask=mask,
                                  bias=None, segment_ids=segment_ids,
                                  vmapped_stages=self.pipelined, sliding_window=None)[..., :h_v]
        else:  # EINSUM, or CACHED under the caller's mask over the whole cache
            out = einsum_attention(q, k, v, mask=mask, segment_ids=segment_ids, dtype=self.dtype)
        out = nn.with_logical_constraint(out, HEAD_ACTIVATION_AXES)  # [B, T, N, H_v]
        out = checkpoint_name(out, CONTEXT_NAME)
        out = self._proj("BTNH,NHD->BTD", (n, h_v, model_dims), ("heads", "kv", "embed"),
                         "out")(out)  # [B, T, D]
        return checkpoint_name(out, OUT_PROJ_NAME)


def mla_problems(config) -> list[str]:
    """What a TransformerConfig with ``mla`` set cannot also be, one clause each: MLA has its own
    projections, rotary keys and scale, so the other attention options do not apply to it."""
    problems = []
    if config.position_kind.value != "rotary":
        problems.append(f"position_embedding={config.position_kind.value!r} (MLA rotates its "
                        "rope parts: use 'rotary')")
    if config.dims_per_head != config.mla.qk_head_dims:
        problems.append(f"dims_per_head={config.dims_per_head} must equal the query/key head "
                        f"size qk_nope_head_dims + qk_rope_head_dims = {config.mla.qk_head_dims}")
    if config.num_kv_heads not in (None, config.num_heads):
        problems.append(f"num_kv_heads={config.num_kv_heads} (MLA expands its latent to every "
                        "head: leave it None)")
    for name, value, off in (("qk_norm", config.qk_norm, False),
                             ("sliding_window", config.sliding_window, None),
                             ("attention_logit_cap", config.attention_logit_cap, None),
                             ("query_scale_dims", config.query_scale_dims, None),
                             ("layer_types", config.layer_types, None),
                             ("local_rope_theta", config.local_rope_theta, None),
                             ("scale_query", config.scale_query, True),
                             ("qkv_bias", config.qkv_bias, None),
                             ("use_bias", config.use_bias, False),
                             ("out_bias", config.out_bias, None),
                             ("qk_l2_norm", config.qk_l2_norm, False),
                             ("attention_sinks", config.attention_sinks, False)):
        if value != off:
            problems.append(f"{name}={value!r} (MLA has no such option: use {off!r})")
    return problems
