"""Decoder-only transformer language model (Pax GPT and LLaMA) with logical axis names.

Usable on its own: ``Transformer(TransformerConfig(...)).init({'params': key}, tokens)``. Params
are created with logical axis names so the trainer can shard them with one rules table, and
activations carry logical sharding constraints at block boundaries (no-ops without rules).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from paxlite.models.activations import Activation, activation_fn
from paxlite.models.attention import (
    CONTEXT_NAME,
    KEY_PROJ_NAME,
    OUT_PROJ_NAME,
    QKV_PROJ_NAME,
    QUERY_PROJ_NAME,
    VALUE_PROJ_NAME,
    Attention,
    make_attention_mask,
)
from paxlite.models.attention_kernels import AttentionImplementation
from paxlite.models.embedding import Embed
from paxlite.models.linear import FP8_COLLECTION, Linear
from paxlite.models.mlp import Mlp
from paxlite.models.moe import MoeMlp
from paxlite.models.norms import LayerNorm, RMSNorm
from paxlite.models.parallel_config import SEQ_AXIS, mesh_axis_size
from paxlite.models.pipelined_stack import check_pipeline, pipelined_layers
from paxlite.models.sown import AUX_LOSS_COLLECTION, SUMMARIES_COLLECTION
from paxlite.models.te_layer import (
    TransformerEngineBlock,
    fp8_state_collections,
    uses_transformer_engine,
)
from paxlite.models.transformer_config import (
    LLAMA_ARCHITECTURE,
    VALID_DTYPES,
    NormKind,
    PositionEmbedding,
    RematPolicy,
    TransformerConfig,
)
from paxlite.parallel import rules as rules_lib

__all__ = [  # the config names stay importable from here, where they were first defined
    "LLAMA_ARCHITECTURE", "VALID_DTYPES", "Activation", "Block", "NormKind", "PositionEmbedding",
    "RematPolicy", "Transformer", "TransformerConfig", "abstract_variables", "logical_param_axes",
    "num_params", "project_hidden",
]

EMBED_ACTIVATION_AXES: tuple[str, ...] = (
    "activation_batch", "activation_length", "activation_embed",
)
LOGITS_ACTIVATION_AXES: tuple[str, ...] = (
    "activation_batch", "activation_length", "activation_vocab",
)
# The rows of the embedding, final norm and logits around a pipelined stack: split over the stages
# too (rules: "activation_embed_and_logits_batch"), so each stage computes 1/S of them rather than
# every stage all of them; the pipeline gathers its microbatches from them (a [B, T, D] all-gather
# over the stages) and hands its result back to be split again.
PIPELINE_EDGE_BATCH = "activation_embed_and_logits_batch"
# q/k/v projection tags: the fused one (GPT) and the separate ones (grouped-query attention).
_QKV_NAMES: tuple[str, ...] = (QKV_PROJ_NAME, QUERY_PROJ_NAME, KEY_PROJ_NAME, VALUE_PROJ_NAME)


def _remat_policy_fn(policy: RematPolicy) -> Callable[..., bool]:
    """The ``jax.checkpoint`` policy of a RematPolicy, as Pax's ``custom_policy`` maps them."""
    names = jax.checkpoint_policies.save_only_these_names
    policies: dict[RematPolicy, Callable[..., bool]] = {
        RematPolicy.SAVE_NOTHING: jax.checkpoint_policies.nothing_saveable,
        RematPolicy.SAVE_EVERYTHING: jax.checkpoint_policies.everything_saveable,
        RematPolicy.SAVE_DOT_ONLY: jax.checkpoint_policies.dots_saveable,
        RematPolicy.SAVE_DOT_WITH_NO_BATCH_DIM:
            jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        RematPolicy.SAVE_DOT_FOR_MLPERF_200B: names(*_QKV_NAMES, CONTEXT_NAME, OUT_PROJ_NAME),
        # Pax tags the scan iteration's input; a remat'd block keeps its input anyway, so there is
        # nothing else to save.
        RematPolicy.SAVE_ITERATION_INPUT: jax.checkpoint_policies.nothing_saveable,
        RematPolicy.SAVE_QKV_OUT_PROJ: names(*_QKV_NAMES, OUT_PROJ_NAME),
        RematPolicy.SAVE_OUT_PROJ: names(OUT_PROJ_NAME),
        RematPolicy.SAVE_CONTEXT: names(CONTEXT_NAME),
        RematPolicy.SAVE_CONTEXT_AND_OUT_PROJ: names(CONTEXT_NAME, OUT_PROJ_NAME),
    }
    if policy not in policies:
        raise ValueError(f"RematPolicy {policy!r} has no jax.checkpoint policy (it means no remat)")
    return policies[policy]


def _make_norm(config: TransformerConfig, *, name: str) -> nn.Module:
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
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        x = nn.with_logical_constraint(x, EMBED_ACTIVATION_AXES)  # [B, T, D]

        h = _make_norm(cfg, name="pre_attention_norm")(x)
        h = Attention(
            num_heads=cfg.num_heads,
            dims_per_head=cfg.dims_per_head,
            num_kv_heads=cfg.num_kv_heads,
            rope_theta=cfg.rope_theta if cfg.position_kind is PositionEmbedding.ROTARY else None,
            use_bias=cfg.use_bias,
            init_std=cfg.init_std,
            dtype=dtype,
            param_dtype=param_dtype,
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
            name="attention",
        )(h, mask, positions, segment_ids=segment_ids)
        h = nn.Dropout(rate=cfg.dropout_prob)(h, deterministic=self.deterministic)
        x = x + h
        x = nn.with_logical_constraint(x, EMBED_ACTIVATION_AXES)

        h = _make_norm(cfg, name="pre_mlp_norm")(x)
        if self.moe_layer:
            h = MoeMlp(
                config=cfg.moe,
                hidden_dims=cfg.moe.expert_hidden_dims or cfg.hidden_dims,
                init_std=cfg.init_std,
                dtype=dtype,
                param_dtype=param_dtype,
                fp8=cfg.fp8,
                name="moe",
            )(h, paddings=paddings)
        else:
            h = self._dense_mlp(h)
        h = nn.Dropout(rate=cfg.dropout_prob)(h, deterministic=self.deterministic)
        x = x + h
        x = nn.with_logical_constraint(x, EMBED_ACTIVATION_AXES)
        return x, None

    def _dense_mlp(self, h: jax.Array) -> jax.Array:
        cfg = self.config
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        return Mlp(
            hidden_dims=cfg.hidden_dims,
            activation=activation_fn(cfg.activation),
            gated=cfg.gated_mlp,
            use_bias=cfg.use_bias,
            init_std=cfg.init_std,
            dtype=dtype,
            param_dtype=param_dtype,
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
    def __call__(self, x, mask, positions=None, paddings=None, segment_ids=None):
        for j in range(self.config.layers_per_scan_unit):
            x, _ = Block(config=self.config, deterministic=self.deterministic, moe_layer=j == 0,
                         decode=self.decode, name=f"layer_{j}")(x, mask, positions, paddings,
                                                                segment_ids)
        return x, None


class Transformer(nn.Module):
    """Decoder: embeddings -> num_layers pre-norm blocks -> final norm -> logits.

    With ``config.pipeline`` the blocks run as a pipeline outside init and decoding, on the same
    parameters; sown MoE values are then means over microbatches (models/pipelined_stack.py)."""

    config: TransformerConfig

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        deterministic: bool = True,
        return_hidden: bool = False,
        decode_mask: jax.Array | None = None,
    ) -> jax.Array:
        """tokens int32 [B, T] -> float32 logits [B, T, vocab].

        positions default to ``arange(T)``; for packed rows pass positions restarting at 0 per
        document together with segment_ids, and attention stays within each document (and RoPE
        rotates each document as if it ran alone). With ``return_hidden`` the result is the final
        norm's output [B, T, D] instead, which `project` (or `project_hidden`) turns into logits
        a slice of positions at a time, so a chunked loss never holds all [B, T, V] logits.

        ``decode_mask`` bool [B, 1, T, S_max] switches to incremental decoding (models/decode.py):
        each attention layer appends this call's keys and values to its "cache" collection
        (mutable) and attends over the whole cache under that mask; positions are then required.
        """
        cfg = self.config
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape [batch, length], got {tokens.shape}")
        batch, length = tokens.shape
        if length > cfg.max_seq_len:
            raise ValueError(
                f"tokens length {length} exceeds max_seq_len={cfg.max_seq_len}"
            )
        for name, arr in (("positions", positions), ("segment_ids", segment_ids)):
            if arr is not None and arr.shape != tokens.shape:
                raise ValueError(
                    f"{name} must have the shape of tokens {tokens.shape}, got {arr.shape}"
                )

        decode = decode_mask is not None
        if decode and (positions is None or segment_ids is not None):
            raise ValueError("decoding with a KV cache needs positions and takes no segment_ids")
        if decode and uses_transformer_engine(cfg):
            raise ValueError("decoding with a KV cache is not available for ENABLE_TE layers")

        embed = _token_embedding(cfg, name="embedding")
        x = embed(tokens)  # [B, T, D]
        position_kind = cfg.position_kind
        if position_kind is not PositionEmbedding.NONE and positions is None:
            positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        if position_kind is PositionEmbedding.LEARNED:
            x = x + Embed(
                num_embeddings=cfg.max_seq_len,
                features=cfg.model_dims,
                axes=("position", "embed"),
                init_std=cfg.init_std,
                dtype=dtype,
                param_dtype=param_dtype,
                name="position_embedding",
            )(positions)
        x = nn.Dropout(rate=cfg.input_dropout_prob)(x, deterministic=deterministic)
        pipelined = cfg.pipeline is not None and not decode and not self.is_initializing()
        x = _constrain_rows(x, EMBED_ACTIVATION_AXES, pipelined=pipelined)

        # Packed rows: the same-segment causal mask [B, 1, T, S], built once for all layers. Unpacked
        # rows pass None (causal only), so a fused kernel needs no dense mask at all.
        mask = None
        if segment_ids is not None:
            mask = make_attention_mask(seq_len=length, segment_ids=segment_ids)
        # Only RoPE reads positions inside the blocks; GPT blocks get None (an empty pytree). A
        # KV cache also records them (a relative bias compares them with the cached keys'). With
        # the sequence sharded over a `seq` axis, attention masks by them (a row may be reordered
        # for load balance, models/context_parallel.py), so every block gets them.
        block_positions = positions if position_kind is PositionEmbedding.ROTARY else None
        if mesh_axis_size(SEQ_AXIS) > 1 and not decode:
            block_positions = positions  # None (a model without positions): attention takes arange
        if decode:
            mask, block_positions = decode_mask, positions
        # MoE routing keeps padding (segment id 0 in packed rows) out of the experts' capacity.
        paddings = None
        if cfg.moe is not None and segment_ids is not None:
            paddings = (segment_ids == 0).astype(jnp.float32)
        unit = cfg.layers_per_scan_unit
        # ENABLE_TE: every layer is TE's TransformerLayer (models/te_layer.py), dense only
        layer_cls: Any = TransformerEngineBlock if uses_transformer_engine(cfg) else Block
        remat = cfg.remat_policy is not RematPolicy.NONE and not decode  # nothing to save
        check_pipeline(cfg)
        if pipelined:
            # models/pipelined_stack.py; init and decoding run the stack below on the same params
            unit_body = (Block if unit == 1 else BlockUnit)(
                config=cfg, deterministic=deterministic, parent=None,
                **({"moe_layer": cfg.moe is not None} if unit == 1 else {}))
            x = pipelined_layers(
                self, unit_body, x, mask=mask, positions=block_positions, paddings=paddings,
                segment_ids=segment_ids, dropout=not deterministic and cfg.dropout_prob > 0,
                remat_policy=_remat_policy_fn(cfg.remat_policy) if remat else None)
            x = _constrain_rows(x, EMBED_ACTIVATION_AXES, pipelined=True)
        elif cfg.scan_layers:
            body: Any = layer_cls if unit == 1 else BlockUnit
            if remat:
                body = nn.remat(body, policy=_remat_policy_fn(cfg.remat_policy), prevent_cse=False)
            extra = {} if unit > 1 else {"moe_layer": cfg.moe is not None}
            if decode:
                extra["decode"] = True
            scanned = nn.scan(
                body,
                # sown MoE losses and summaries are stacked per layer, like the parameters; so
                # is the FP8 state: each layer has its own scales and histories (no sharing)
                variable_axes={"params": 0, AUX_LOSS_COLLECTION: 0, SUMMARIES_COLLECTION: 0,
                               FP8_COLLECTION: 0, "cache": 0,
                               **{name: 0 for name in fp8_state_collections(cfg)}},
                split_rngs={"params": True, "dropout": True},
                in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
                length=cfg.num_layers // unit,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            x, _ = scanned(config=cfg, deterministic=deterministic, name="layers", **extra)(
                x, mask, block_positions, paddings, segment_ids
            )
        else:
            block_cls: Any = layer_cls
            if remat:
                block_cls = nn.remat(layer_cls, policy=_remat_policy_fn(cfg.remat_policy),
                                     prevent_cse=True)
            for i in range(cfg.num_layers):
                moe_layer = cfg.moe is not None and cfg.moe.is_moe_layer(i)
                x, _ = block_cls(config=cfg, deterministic=deterministic, moe_layer=moe_layer,
                                 **({"decode": True} if decode else {}), name=f"layers_{i}")(x, mask, block_positions, paddings,
                                                       segment_ids)

        x = _make_norm(cfg, name="final_norm")(x)
        if return_hidden:
            return _constrain_rows(x, EMBED_ACTIVATION_AXES, pipelined=pipelined)
        if cfg.tie_embeddings:
            logits = embed.attend(x)  # [B, T, V]
        else:
            logits = _output_layer(cfg, name="output")(x)
        return _constrain_rows(logits.astype(jnp.float32), LOGITS_ACTIVATION_AXES,
                               pipelined=pipelined)

    def project(self, hidden: jax.Array) -> jax.Array:
        """hidden [B, t, D] from ``return_hidden=True`` -> float32 logits [B, t, V], exactly as
        ``__call__`` computes them; use as ``model.apply(variables, hidden, method="project")``."""
        return project_hidden(self.config, self.variables["params"], hidden)


def _constrain_rows(x: jax.Array, axes: tuple[str, ...], *, pipelined: bool) -> jax.Array:
    """The logical constraint of `axes`; around a pipelined stack with the rows split over the
    stages as well, as far as the batch divides over them (``PIPELINE_EDGE_BATCH``)."""
    if not pipelined:
        return nn.with_logical_constraint(x, axes)
    return rules_lib.logical_constraint(x, (PIPELINE_EDGE_BATCH,) + axes[1:])


def _token_embedding(config: TransformerConfig, **module_kwargs: Any) -> Embed:
    return Embed(
        num_embeddings=config.vocab_size,
        features=config.model_dims,
        axes=("vocab", "embed"),
        init_std=config.embedding_init_std,
        dtype=jnp.dtype(config.dtype),
        param_dtype=jnp.dtype(config.param_dtype),
        **module_kwargs,
    )


def _output_layer(config: TransformerConfig, **module_kwargs: Any) -> Linear:
    """The untied output projection (``tie_embeddings=False``); ``module_kwargs``: name, parent."""
    return Linear(
        equation="BTD,DV->BTV",
        kernel_shape=(config.model_dims, config.vocab_size),
        kernel_axes=("embed", "vocab"),
        bias_axes=None,
        init_std=config.embedding_init_std,
        dtype=jnp.dtype(config.dtype),
        param_dtype=jnp.dtype(config.param_dtype),
        **module_kwargs,
    )


def project_hidden(config: TransformerConfig, params: Any, hidden: jax.Array) -> jax.Array:
    """The model's output projection as a pure function of its parameters: hidden [B, t, D] (after
    the final norm) -> float32 logits [B, t, V], through the same modules as ``Transformer``."""
    if config.tie_embeddings:
        logits = _token_embedding(config, parent=None).apply(
            {"params": params["embedding"]}, hidden, method=Embed.attend)
    else:
        logits = _output_layer(config, parent=None).apply({"params": params["output"]}, hidden)
    return _constrain_rows(logits.astype(jnp.float32), LOGITS_ACTIVATION_AXES,
                           pipelined=config.pipeline is not None)


def abstract_variables(config: TransformerConfig) -> Any:
    """Boxed (LogicallyPartitioned) ShapeDtypeStruct variables; allocates no device memory.

    Traced with XLA attention: the parameters do not depend on the kernel, and a cuDNN or Pallas
    model's shapes must be countable on a CPU machine too (``show``, ``plan``).
    """
    if config.attention_implementation is not AttentionImplementation.XLA:  # AUTO too: it would
        # resolve (and log its choice) for this process's backend, whatever the run's devices are
        config = dataclasses.replace(config, attention_implementation=AttentionImplementation.XLA)
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return jax.eval_shape(
        lambda key, toks: Transformer(config).init({"params": key}, toks),
        jax.ShapeDtypeStruct((2,), jnp.uint32),
        tokens,
    )


def num_params(config: TransformerConfig) -> int:
    """Exact number of parameters (LoRA adapters included), computed abstractly."""
    params = nn.meta.unbox(abstract_variables(config)["params"])
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


def logical_param_axes(config: TransformerConfig) -> Any:
    """PartitionSpecs of logical axis names with the structure of ``variables['params']``."""
    return nn.get_partition_spec(abstract_variables(config))["params"]
