"""Decoder-only transformer language model (Pax GPT and LLaMA) with logical axis names.

Usable on its own: ``Transformer(TransformerConfig(...)).init({'params': key}, tokens)``. Params
are created with logical axis names so the trainer can shard them with one rules table, and
activations carry logical sharding constraints at block boundaries (no-ops without rules). The
layers are models/block.py's; models/layer_stacks.py runs them pipelined, scanned or unrolled.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from paxlite.models.activations import Activation
from paxlite.models.attention import make_attention_mask
from paxlite.models.attention_kernels import AttentionImplementation, soft_cap
from paxlite.models.block import EMBED_ACTIVATION_AXES, Block, make_norm
from paxlite.models.embedding import Embed
from paxlite.models.layer_stacks import (
    LayerInputs,
    StackKind,
    constrain_rows,
    run_layers,
    stack_kind,
)
from paxlite.models.linear import Linear
from paxlite.models.parallel_config import SEQ_AXIS, mesh_axis_size
from paxlite.models.te_layer import uses_transformer_engine
from paxlite.models.transformer_config import (
    LLAMA_ARCHITECTURE,
    VALID_DTYPES,
    NormKind,
    PositionEmbedding,
    RematPolicy,
    TransformerConfig,
)

__all__ = [  # the config names stay importable from here, where they were first defined
    "LLAMA_ARCHITECTURE", "VALID_DTYPES", "Activation", "Block", "NormKind", "PositionEmbedding",
    "RematPolicy", "Transformer", "TransformerConfig", "abstract_variables", "logical_param_axes",
    "num_params", "project_hidden",
]

LOGITS_ACTIVATION_AXES: tuple[str, ...] = (
    "activation_batch", "activation_length", "activation_vocab",
)


class Transformer(nn.Module):
    """Decoder: embeddings -> num_layers pre-norm blocks -> final norm -> logits.

    The blocks run as models/layer_stacks.py's ``stack_kind`` says: scanned or unrolled, and with
    ``config.pipeline`` pipelined outside init and decoding, on the same parameters; sown MoE
    values are then means over microbatches (models/pipelined_stack.py)."""

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
        decode = decode_mask is not None
        _check_inputs(cfg, tokens, positions=positions, segment_ids=segment_ids, decode=decode)
        batch, length = tokens.shape

        embed = _token_embedding(cfg, name="embedding")
        x = embed(tokens)  # [B, T, D]
        if cfg.scale_embeddings:  # Gemma: the factor rounded to dtype first, as transformers
            x = x * jnp.asarray(math.sqrt(cfg.model_dims), dtype=x.dtype)
        if cfg.position_kind is not PositionEmbedding.NONE and positions is None:
            positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        if cfg.position_kind is PositionEmbedding.LEARNED:
            x = x + _embedding(cfg, num_embeddings=cfg.max_seq_len, axes=("position", "embed"),
                               init_std=cfg.init_std, name="position_embedding")(positions)
        x = nn.Dropout(rate=cfg.input_dropout_prob)(x, deterministic=deterministic)
        kind = stack_kind(cfg, decode=decode, initializing=self.is_initializing())
        pipelined = kind is StackKind.PIPELINED
        x = constrain_rows(x, EMBED_ACTIVATION_AXES, pipelined=pipelined)

        inputs = _layer_inputs(cfg, length=length, positions=positions, segment_ids=segment_ids,
                               decode_mask=decode_mask)
        x = run_layers(self, x, inputs, kind=kind, deterministic=deterministic, decode=decode)

        x = make_norm(cfg, name="final_norm")(x)
        if return_hidden:
            return constrain_rows(x, EMBED_ACTIVATION_AXES, pipelined=pipelined)
        if cfg.tie_embeddings:
            logits = embed.attend(x)  # [B, T, V]
        else:
            logits = _output_layer(cfg, name="output")(x)
        return constrain_rows(_capped(cfg, logits), LOGITS_ACTIVATION_AXES,
                              pipelined=pipelined)

    def project(self, hidden: jax.Array) -> jax.Array:
        """hidden [B, t, D] from ``return_hidden=True`` -> float32 logits [B, t, V], exactly as
        ``__call__`` computes them; use as ``model.apply(variables, hidden, method="project")``."""
        return project_hidden(self.config, self.variables["params"], hidden)


def _check_inputs(config: TransformerConfig, tokens: jax.Array, *, positions: jax.Array | None,
                  segment_ids: jax.Array | None, decode: bool) -> None:
    """Shapes and combinations the model cannot take, refused before anything is traced."""
    if tokens.ndim != 2:
        raise ValueError(f"tokens must have shape [batch, length], got {tokens.shape}")
    length = tokens.shape[1]
    if length > config.max_seq_len:
        raise ValueError(
            f"tokens length {length} exceeds max_seq_len={config.max_seq_len}"
        )
    for name, arr in (("positions", positions), ("segment_ids", segment_ids)):
        if arr is not None and arr.shape != tokens.shape:
            raise ValueError(
                f"{name} must have the shape of tokens {tokens.shape}, got {arr.shape}"
            )
    if decode and (positions is None or segment_ids is not None):
        raise ValueError("decoding with a KV cache needs positions and takes no segment_ids")
    if decode and uses_transformer_engine(config):
        raise ValueError("decoding with a KV cache is not available for ENABLE_TE layers")


def _layer_inputs(config: TransformerConfig, *, length: int, positions: jax.Array | None,
                  segment_ids: jax.Array | None, decode_mask: jax.Array | None) -> LayerInputs:
    """The layers' side inputs, built once for all of them (positions already defaulted)."""
    if decode_mask is not None:  # the cache's mask; the cache records every token's position
        return LayerInputs(mask=decode_mask, positions=positions, paddings=None, segment_ids=None)
    # Packed rows: the same-segment causal mask [B, 1, T, S]. Unpacked rows pass None (causal
    # only), so a fused kernel needs no dense mask at all.
    mask = None
    if segment_ids is not None:
        mask = make_attention_mask(seq_len=length, segment_ids=segment_ids)
    # Only RoPE reads positions inside the blocks; GPT blocks get None (an empty pytree). With the
    # sequence sharded over a `seq` axis, attention masks by them (a row may be reordered for load
    # balance, models/context_parallel.py), so every block gets them (None, for a model without
    # positions: attention takes arange).
    block_positions = None
    if config.position_kind is PositionEmbedding.ROTARY or mesh_axis_size(SEQ_AXIS) > 1:
        block_positions = positions
    # MoE routing keeps padding (segment id 0 in packed rows) out of the experts' capacity.
    paddings = None
    if config.moe is not None and segment_ids is not None:
        paddings = (segment_ids == 0).astype(jnp.float32)
    return LayerInputs(mask=mask, positions=block_positions, paddings=paddings,
                       segment_ids=segment_ids)


def _embedding(config: TransformerConfig, *, num_embeddings: int, axes: tuple[str, str],
               init_std: float, **module_kwargs: Any) -> Embed:
    """A table of `model_dims` vectors in the model's dtypes: the tokens' or the learned
    positions'."""
    return Embed(num_embeddings=num_embeddings, features=config.model_dims, axes=axes,
                 init_std=init_std, dtype=jnp.dtype(config.dtype),
                 param_dtype=jnp.dtype(config.param_dtype), **module_kwargs)


def _token_embedding(config: TransformerConfig, **module_kwargs: Any) -> Embed:
    return _embedding(config, num_embeddings=config.vocab_size, axes=("vocab", "embed"),
                      init_std=config.embedding_init_std, **module_kwargs)


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
    return constrain_rows(_capped(config, logits), LOGITS_ACTIVATION_AXES,
                          pipelined=config.pipeline is not None)


def _capped(config: TransformerConfig, logits: jax.Array) -> jax.Array:
    """float32 logits, soft-capped as ``cap * tanh(logits / cap)`` with ``final_logit_cap``."""
    return soft_cap(logits.astype(jnp.float32), config.final_logit_cap)


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
