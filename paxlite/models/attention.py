"""Causal multi-head self-attention with a fused QKV projection (Pax GPT layout).

Einsum letters: B batch, T query length, S key length, D model (embed) dims, K the 3 of
q/k/v, N heads, H dims per head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from paxlite.models.linear import Linear

HEAD_ACTIVATION_AXES: tuple[str, ...] = (
    "activation_batch", "activation_length", "activation_heads", "activation_kv",
)
# checkpoint_name tags (Pax's names) that the name-based remat policies select.
QKV_PROJ_NAME: str = "combined_qkv_proj"  # fused q/k/v projection output [B, T, 3, N, H]
CONTEXT_NAME: str = "context"  # probabilities x values, before the output projection [B, T, N, H]
OUT_PROJ_NAME: str = "out_proj"  # output projection [B, T, D]
# Pax uses -0.7 * max(float32) rather than -inf so that a fully masked row stays finite.
LARGE_NEGATIVE: float = -0.7 * float(jnp.finfo(jnp.float32).max)


def make_attention_mask(*, seq_len: int, segment_ids: jax.Array | None) -> jax.Array:
    """Boolean mask [B or 1, 1, T, S]: True where query t may attend to key s.

    Causal, and with packed rows also restricted to keys of the same segment, so that documents
    packed into one row never see each other.
    """
    idx = jnp.arange(seq_len)
    mask = idx[:, None] >= idx[None, :]  # [T, S]
    if segment_ids is None:
        return mask[None, None, :, :]
    if segment_ids.ndim != 2 or segment_ids.shape[1] != seq_len:
        raise ValueError(
            f"segment_ids must have shape [batch, {seq_len}], got {segment_ids.shape}"
        )
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, S]
    return (mask[None, :, :] & same_segment)[:, None, :, :]


class Attention(nn.Module):
    """Multi-head attention: fused QKV -> scaled dot product (softmax in f32) -> output.

    Attributes mirror Pax ``DotProductAttention`` with ``combine_qkv=True`` and
    ``internal_enable_per_dim_scale=False``: the query is scaled by 1/sqrt(dims_per_head).
    """

    num_heads: int
    dims_per_head: int
    use_bias: bool = True
    init_std: float = 0.02
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        """x [B, T, D], mask bool broadcastable to [B, N, T, S] -> [B, T, D] in dtype."""
        model_dims = x.shape[-1]
        n, h = self.num_heads, self.dims_per_head
        qkv = Linear(
            equation="BTD,DKNH->BTKNH",
            kernel_shape=(model_dims, 3, n, h),
            kernel_axes=("embed", "qkv", "heads", "kv"),
            bias_axes=("qkv", "heads", "kv") if self.use_bias else None,
            init_std=self.init_std,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="qkv",
        )(x)  # [B, T, 3, N, H]
        qkv = checkpoint_name(qkv, QKV_PROJ_NAME)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # each [B, T, N, H]
        q = nn.with_logical_constraint(q, HEAD_ACTIVATION_AXES)
        k = nn.with_logical_constraint(k, HEAD_ACTIVATION_AXES)
        v = nn.with_logical_constraint(v, HEAD_ACTIVATION_AXES)
        q = q * jnp.asarray(h**-0.5, dtype=self.dtype)

        logits = jnp.einsum("BTNH,BSNH->BNTS", q, k).astype(jnp.float32)
        logits = jnp.where(mask, logits, LARGE_NEGATIVE)
        probs = jax.nn.softmax(logits, axis=-1).astype(self.dtype)  # [B, N, T, S]
        out = jnp.einsum("BNTS,BSNH->BTNH", probs, v)
        out = nn.with_logical_constraint(out, HEAD_ACTIVATION_AXES)
        out = checkpoint_name(out, CONTEXT_NAME)

        out = Linear(
            equation="BTNH,NHD->BTD",
            kernel_shape=(n, h, model_dims),
            kernel_axes=("heads", "kv", "embed"),
            bias_axes=("norm",) if self.use_bias else None,
            init_std=self.init_std,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="out",
        )(out)  # [B, T, D]
        return checkpoint_name(out, OUT_PROJ_NAME)
