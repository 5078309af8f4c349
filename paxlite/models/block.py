"""One decoder layer (``Block``) and the scan unit of an MoE model (``BlockUnit``).

Apart from models/transformer.py so that the layer stacks (models/layer_stacks.py) can build their
bodies from them without importing the Transformer back. The parameter names are the Transformer's:
a Block's ``pre_attention_norm``, ``attention``, ``pre_mlp_norm`` and ``mlp`` (or ``moe``), a
BlockUnit's ``layer_{j}``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from paxlite.models.activations import activation_fn
from paxlite.models.attention import Attention
from paxlite.models.mlp import Mlp
from paxlite.models.moe import MoeMlp
from paxlite.models.norms import LayerNorm, RMSNorm
from paxlite.models.transformer_config import NormKind, PositionEmbedding, TransformerConfig

EMBED_ACTIVATION_AXES: tuple[str, ...] = (
    "activation_batch", "activation_length", "activation_embed",
)


def make_norm(config: TransformerConfig, *, name: str) -> nn.Module:
    """The config's norm (LayerNorm or RMSNorm) in its dtypes; ``name`` is its parameter path."""
    cls = LayerNorm if config.norm is NormKind.LAYER_NORM else RMSNorm
    return cls(
        epsilon=config.norm_epsilon,
        dtype=jnp.dtype(config.dtype),
        param_dtype=jnp.dtype(config.param_dtype),
        name=name,
    )


class Block(nn.Module):
    """One pre-norm layer: ``x + drop(attn(norm(x)))`` then ``x + drop(mlp(norm(x)))``.

    Returns ``(x, None)`` so the same module is a valid ``nn.scan`` body; ``deterministic`` is an
    attribute rather than an argument so neither scan nor remat has to treat it as static.
    """

    config: TransformerConfig
    deterministic: bool = True
    moe_layer: bool = False  # the MLP is config.moe's mixture of experts
    decode: bool = False  # attention keeps a KV cache (models/decode.py)

    @nn.compact
    def __call__(
        self, x: jax.Array, mask: jax.Array | None, positions: jax.Array | None = None,
        paddings: jax.Array | None = None, segment_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, None]:
        """x [B, T, D], mask [B|1, 1, T, S] (None: causal only), positions [B, T] (RoPE, relative
        bias), paddings [B, T] (1: padding; MoE routing only), segment_ids [B, T] (packed rows,
        with the mask they make; the Pallas kernel reads them) -> (x [B, T, D], None)."""
        cfg = self.config
        x = nn.with_logical_constraint(x, EMBED_ACTIVATION_AXES)  # [B, T, D]

        h = make_norm(cfg, name="pre_attention_norm")(x)
        h = self._attention()(h, mask, positions, segment_ids=segment_ids)
        h = nn.Dropout(rate=cfg.dropout_prob)(h, deterministic=self.deterministic)
        x = x + h
        x = nn.with_logical_constraint(x, EMBED_ACTIVATION_AXES)

        h = make_norm(cfg, name="pre_mlp_norm")(x)
        if self.moe_layer:
            h = MoeMlp(
                config=cfg.moe,
                hidden_dims=cfg.moe.expert_hidden_dims or cfg.hidden_dims,
                init_std=cfg.init_std,
                dtype=jnp.dtype(cfg.dtype),
                param_dtype=jnp.dtype(cfg.param_dtype),
                fp8=cfg.fp8,
                name="moe",
            )(h, paddings=paddings)
        else:
            h = self._dense_mlp(h)
        h = nn.Dropout(rate=cfg.dropout_prob)(h, deterministic=self.deterministic)
        x = x + h
        x = nn.with_logical_constraint(x, EMBED_ACTIVATION_AXES)
        return x, None

    def _attention(self) -> Attention:
        cfg = self.config
        return Attention(
            num_heads=cfg.num_heads,
            dims_per_head=cfg.dims_per_head,
            num_kv_heads=cfg.num_kv_heads,
            rope_theta=cfg.rope_theta if cfg.position_kind is PositionEmbedding.ROTARY else None,
            use_bias=cfg.use_bias,
            init_std=cfg.init_std,
            dtype=jnp.dtype(cfg.dtype),
            param_dtype=jnp.dtype(cfg.param_dtype),
            attention_kind=cfg.attention_kind,
            attention_implementation=cfg.attention_implementation,
            lora=cfg.lora_spec if cfg.lora_targets.attention else None,
            relative_position_buckets=(
                cfg.relative_position_buckets
                if cfg.position_kind is PositionEmbedding.RELATIVE_BIAS else None),
            relative_position_max_distance=cfg.relative_position_max_distance,
            scale_query=cfg.scale_query,
            fp8=cfg.fp8,
            decode=self.decode,
            context_parallel_strategy=cfg.context_parallel_strategy,
            pipelined=cfg.pipeline is not None,
            rope_scaling=cfg.rope_scaling,
            qkv_bias=cfg.qkv_bias,
            qk_norm=cfg.qk_norm,
            qk_norm_epsilon=cfg.norm_epsilon,
            sliding_window=cfg.sliding_window,
            name="attention",
        )

    def _dense_mlp(self, h: jax.Array) -> jax.Array:
        cfg = self.config
        return Mlp(
            hidden_dims=cfg.hidden_dims,
            activation=activation_fn(cfg.activation),
            gated=cfg.gated_mlp,
            use_bias=cfg.use_bias,
            init_std=cfg.init_std,
            dtype=jnp.dtype(cfg.dtype),
            param_dtype=jnp.dtype(cfg.param_dtype),
            lora=cfg.lora_spec if cfg.lora_targets.mlp else None,
            fp8=cfg.fp8,
            name="mlp",
        )(h)


class BlockUnit(nn.Module):
    """``config.layers_per_scan_unit`` consecutive blocks, the first an MoE block: the scanned body
    of an MoE model whose experts sit on every k-th layer (GLaM: a dense and an MoE layer)."""

    config: TransformerConfig
    deterministic: bool = True
    decode: bool = False

    @nn.compact
    def __call__(
        self, x: jax.Array, mask: jax.Array | None, positions: jax.Array | None = None,
        paddings: jax.Array | None = None, segment_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, None]:
        """Block's arguments and result, through the unit's blocks ``layer_0..layer_{k-1}``."""
        for j in range(self.config.layers_per_scan_unit):
            x, _ = Block(config=self.config, deterministic=self.deterministic, moe_layer=j == 0,
                         decode=self.decode, name=f"layer_{j}")(x, mask, positions, paddings,
                                                                segment_ids)
        return x, None
