"""One decoder layer (``Block``) and the scan unit of several (``BlockUnit``: an MoE model's, or
one period of the layers' attention pattern).

Apart from models/transformer.py so that the layer stacks (models/layer_stacks.py) can build their
bodies from them without importing the Transformer back. The parameter names are the Transformer's:
a Block's ``pre_attention_norm``, ``attention``, ``pre_mlp_norm`` and ``mlp`` (or ``moe``), with
``post_norms`` also ``post_attention_norm`` and ``post_mlp_norm``; a BlockUnit's ``layer_{j}``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from paxlite.models.activations import activation_fn
from paxlite.models.attention import Attention
from paxlite.models.mla_attention import MlaAttention
from paxlite.models.mlp import Mlp
from paxlite.models.moe import MoeMlp
from paxlite.models.norms import norm_class
from paxlite.models.rotary import RopeScaling
from paxlite.models.transformer_config import (
    LayerAttention,
    NormKind,
    PositionEmbedding,
    TransformerConfig,
)

EMBED_ACTIVATION_AXES: tuple[str, ...] = (
    "activation_batch", "activation_length", "activation_embed",
)


def make_norm(config: TransformerConfig, *, name: str) -> nn.Module:
    """The config's norm (LayerNorm, RMSNorm, Gemma's) in its dtypes; ``name`` is its parameter
    path."""
    return norm_class(config.norm)(
        epsilon=config.norm_epsilon,
        dtype=jnp.dtype(config.dtype),
        param_dtype=jnp.dtype(config.param_dtype),
        name=name,
    )


def layer_rope(config: TransformerConfig, *, layer_index: int
               ) -> tuple[float | None, RopeScaling | None]:
    """(RoPE base, scaling) of layer ``layer_index``: None for no rotary embedding (Llama 4's
    NoPE layers too); Gemma 3's sliding layers their ``local_rope_theta``, unscaled."""
    if (config.position_kind is not PositionEmbedding.ROTARY
            or layer_attention(config, layer_index=layer_index) is LayerAttention.FULL_NO_ROPE):
        return None, None
    if (config.local_rope_theta is not None
            and layer_attention(config, layer_index=layer_index) is LayerAttention.SLIDING):
        return config.local_rope_theta, None
    return config.rope_theta, config.rope_scaling


def layer_attention(config: TransformerConfig, *, layer_index: int) -> LayerAttention | None:
    """What layer ``layer_index`` attends to; None without ``layer_types`` (``sliding_window``
    then says, for every layer)."""
    return None if config.layer_types is None else config.layer_types[layer_index]


class Block(nn.Module):
    """One pre-norm layer: ``x + drop(attn(norm(x)))`` then ``x + drop(mlp(norm(x)))``; with
    ``post_norms`` (Gemma) ``x + drop(norm(attn(norm(x))))`` and the same around the MLP.

    Returns ``(x, None)`` so the same module is a valid ``nn.scan`` body; ``deterministic`` is an
    attribute rather than an argument so neither scan nor remat has to treat it as static.
    ``layer_index`` picks the layer's entry of ``config.layer_types``: its index in the stack, or
    in its scan unit (units are whole periods of the pattern, so the entry is the same).
    """

    config: TransformerConfig
    deterministic: bool = True
    moe_layer: bool = False  # the MLP is config.moe's mixture of experts
    decode: bool = False  # attention keeps a KV cache (models/decode.py)
    layer_index: int = 0

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
        if cfg.post_norms:
            h = make_norm(cfg, name="post_attention_norm")(h)
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
        if cfg.post_norms:
            h = make_norm(cfg, name="post_mlp_norm")(h)
        h = nn.Dropout(rate=cfg.dropout_prob)(h, deterministic=self.deterministic)
        x = x + h
        x = nn.with_logical_constraint(x, EMBED_ACTIVATION_AXES)
        return x, None

    def _attention(self) -> Attention | MlaAttention:
        cfg = self.config
        rope_theta, rope_scaling = layer_rope(cfg, layer_index=self.layer_index)
        if cfg.mla is not None:  # DeepSeek's latent attention (its options checked by the config)
            return MlaAttention(
                config=cfg.mla, num_heads=cfg.num_heads, rope_theta=rope_theta,
                rope_scaling=rope_scaling, init_std=cfg.init_std, dtype=jnp.dtype(cfg.dtype),
                param_dtype=jnp.dtype(cfg.param_dtype), attention_kind=cfg.attention_kind,
                attention_implementation=cfg.attention_implementation,
                lora=cfg.lora_spec if cfg.lora_targets.attention else None, fp8=cfg.fp8,
                decode=self.decode, pipelined=cfg.pipeline is not None, name="attention")
        kind = layer_attention(cfg, layer_index=self.layer_index)
        window = cfg.sliding_window if kind in (None, LayerAttention.SLIDING) else None
        temperature = (None if cfg.query_temperature_floor is None or rope_theta is not None
                       else (cfg.query_temperature_floor, cfg.query_temperature_scale))
        return Attention(
            num_heads=cfg.num_heads,
            dims_per_head=cfg.dims_per_head,
            num_kv_heads=cfg.num_kv_heads,
            rope_theta=rope_theta,
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
            rope_scaling=rope_scaling,
            qkv_bias=cfg.qkv_bias,
            qk_norm=cfg.qk_norm,
            qk_norm_epsilon=cfg.norm_epsilon,
            sliding_window=window,
            # Gemma 3's q/k norms are its (1 + scale) kind; every other model's an RMSNorm
            qk_norm_kind=(cfg.norm if cfg.norm is NormKind.GEMMA_RMS_NORM
                          else NormKind.RMS_NORM),
            query_scale_dims=cfg.query_scale_dims,
            logit_cap=cfg.attention_logit_cap,
            chunk_size=cfg.attention_chunk_size if kind is LayerAttention.CHUNKED else None,
            qk_l2_norm=cfg.qk_l2_norm and rope_theta is not None,
            query_temperature=temperature,
            sinks=cfg.attention_sinks,
            out_bias=cfg.out_bias,
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
    """``config.layers_per_scan_unit`` consecutive blocks: the scanned body of an MoE model whose
    experts sit on every k-th layer (GLaM: a dense and an MoE layer, the first MoE), or of a
    model whose layers attend in a pattern of period k (Gemma 2: a sliding and a global layer)."""

    config: TransformerConfig
    deterministic: bool = True
    decode: bool = False

    @nn.compact
    def __call__(
        self, x: jax.Array, mask: jax.Array | None, positions: jax.Array | None = None,
        paddings: jax.Array | None = None, segment_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, None]:
        """Block's arguments and result, through the unit's blocks ``layer_0..layer_{k-1}``."""
        moe = self.config.moe
        for j in range(self.config.layers_per_scan_unit):
            x, _ = Block(config=self.config, deterministic=self.deterministic,
                         moe_layer=moe is not None and moe.is_moe_layer(j), decode=self.decode,
                         layer_index=j, name=f"layer_{j}")(x, mask, positions, paddings,
                                                           segment_ids)
        return x, None
