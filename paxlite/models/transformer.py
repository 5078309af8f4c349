"""Decoder-only transformer language model with Pax GPT semantics and logical axis names.

Usable on its own: ``Transformer(TransformerConfig(...)).init({'params': key}, tokens)``. Params
are created with logical axis names so the trainer can shard them with one rules table, and
activations carry logical sharding constraints at block boundaries (no-ops without rules).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from paxlite.models.attention import (
    CONTEXT_NAME,
    OUT_PROJ_NAME,
    QKV_PROJ_NAME,
    Attention,
    make_attention_mask,
)
from paxlite.models.embedding import Embed
from paxlite.models.linear import Linear
from paxlite.models.mlp import Mlp
from paxlite.models.norms import LayerNorm, RMSNorm

EMBED_ACTIVATION_AXES: tuple[str, ...] = (
    "activation_batch", "activation_length", "activation_embed",
)
LOGITS_ACTIVATION_AXES: tuple[str, ...] = (
    "activation_batch", "activation_length", "activation_vocab",
)
VALID_DTYPES: tuple[str, ...] = ("float32", "bfloat16")


class Activation(str, enum.Enum):
    """MLP non-linearity; GPT uses the tanh approximation of GELU (Pax ``approximate=True``)."""

    GELU_TANH = "gelu_tanh"
    GELU = "gelu"
    RELU = "relu"
    SILU = "silu"


class NormKind(str, enum.Enum):
    """LayerNorm for GPT; RMSNorm for LLaMA-style models."""

    LAYER_NORM = "layer_norm"
    RMS_NORM = "rms_norm"


class RematPolicy(str, enum.Enum):
    """What a transformer block keeps for the backward pass (Pax ``CHECKPOINT_POLICY``).

    Values are Pax's names in lower case. Everything a policy does not keep is recomputed from the
    block's input during the backward pass, which a remat'd block always keeps. The name-based
    policies select tensors tagged in ``models/attention.py`` (``QKV_PROJ_NAME``, ``CONTEXT_NAME``,
    ``OUT_PROJ_NAME``); ``docs/training.md`` says what each one saves.
    """

    NONE = "none"  # no jax.checkpoint wrapper at all
    SAVE_NOTHING = "save_nothing"  # recompute the whole block
    SAVE_EVERYTHING = "save_everything"  # checkpoint wrapper that saves everything
    SAVE_DOT_ONLY = "save_dot_only"  # every matmul output, batched ones (attention) included
    SAVE_DOT_WITH_NO_BATCH_DIM = "save_dot_with_no_batch_dim"  # matmuls against weights only
    SAVE_DOT_FOR_MLPERF_200B = "save_dot_for_mlperf_200b"  # q/k/v, context, attention output
    SAVE_ITERATION_INPUT = "save_iteration_input"  # only the layer input (same as SAVE_NOTHING)
    SAVE_QKV_OUT_PROJ = "save_qkv_out_proj"  # fused q/k/v projection and attention output
    SAVE_OUT_PROJ = "save_out_proj"  # attention output projection
    SAVE_CONTEXT = "save_context"  # attention context (probabilities x values)
    SAVE_CONTEXT_AND_OUT_PROJ = "save_context_and_out_proj"

    @classmethod
    def parse(cls, name: str | RematPolicy) -> RematPolicy:
        """A policy from its value or Pax name, any case (``"SAVE_DOT_ONLY"``, ``"save_dot_only"``).

        Raises ValueError listing every valid name, with the closest one first when there is one.
        """
        if isinstance(name, cls):
            return name
        text = str(name).strip().lower()
        for member in cls:
            if text == member.value:
                return member
        names = [m.name for m in cls if m is not cls.NONE]
        close = difflib.get_close_matches(text.upper(), names, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(
            f"unknown checkpoint (remat) policy {name!r}{hint}; valid names: {', '.join(names)}"
        )


def _coerce_enum(config: Any, field: str, enum_cls: type[enum.Enum]) -> None:
    """Turn a string value (e.g. from JSON) into ``enum_cls`` on a frozen dataclass."""
    value = getattr(config, field)
    if isinstance(value, enum_cls):
        return
    try:
        object.__setattr__(config, field, enum_cls(value))
    except ValueError:
        valid = ", ".join(repr(m.value) for m in enum_cls)
        raise ValueError(
            f"TransformerConfig.{field}={value!r} is not valid; expected one of {valid}"
        ) from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Every size and switch of a GPT-style decoder; defaults follow Pax GPT126M."""

    vocab_size: int
    num_layers: int
    model_dims: int
    num_heads: int
    dims_per_head: int
    hidden_dims: int
    max_seq_len: int
    norm: NormKind = NormKind.LAYER_NORM
    norm_epsilon: float = 1e-5
    activation: Activation = Activation.GELU_TANH
    use_bias: bool = True  # biases on QKV, attention output, both MLP matmuls
    tie_embeddings: bool = True  # True: the embedding table is also the softmax weight
    learned_position_embedding: bool = True
    init_std: float = 0.02  # normal(0, init_std) for every matmul weight and the position table
    softmax_init_std: float | None = None  # token embedding / softmax table; None -> init_std
    dropout_prob: float = 0.0  # residual dropout after attention and after the MLP
    input_dropout_prob: float = 0.0  # dropout on (token + position) embedding
    scan_layers: bool = False  # nn.scan over one block (Pax USE_REPEATED_LAYER)
    remat_policy: RematPolicy = RematPolicy.NONE
    dtype: str = "float32"  # compute dtype; params are always param_dtype
    param_dtype: str = "float32"

    def __post_init__(self) -> None:
        _coerce_enum(self, "norm", NormKind)
        _coerce_enum(self, "activation", Activation)
        _coerce_enum(self, "remat_policy", RematPolicy)
        for name in ("vocab_size", "num_layers", "model_dims", "num_heads", "dims_per_head",
                     "hidden_dims", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"TransformerConfig.{name}={value!r} must be a positive integer"
                )
        for name in ("use_bias", "tie_embeddings", "learned_position_embedding", "scan_layers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"TransformerConfig.{name}={getattr(self, name)!r} must be True or False"
                )
        for name in ("norm_epsilon", "init_std", "softmax_init_std"):
            value = getattr(self, name)
            if name == "softmax_init_std" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"TransformerConfig.{name}={value!r} must be a positive number")
        for name in ("dropout_prob", "input_dropout_prob"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not 0.0 <= value < 1.0):
                raise ValueError(
                    f"TransformerConfig.{name}={value!r} must be a probability in [0, 1)"
                )
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            if value not in VALID_DTYPES:
                raise ValueError(
                    f"TransformerConfig.{name}={value!r} is not valid; expected one of "
                    f"{', '.join(repr(d) for d in VALID_DTYPES)}"
                )

    @property
    def embedding_init_std(self) -> float:
        return self.init_std if self.softmax_init_std is None else self.softmax_init_std


def _activation_fn(activation: Activation) -> Callable[[jax.Array], jax.Array]:
    if activation is Activation.GELU_TANH:
        return functools.partial(jax.nn.gelu, approximate=True)
    if activation is Activation.GELU:
        return functools.partial(jax.nn.gelu, approximate=False)
    if activation is Activation.RELU:
        return jax.nn.relu
    return jax.nn.silu


def _remat_policy_fn(policy: RematPolicy) -> Callable[..., bool]:
    """The ``jax.checkpoint`` policy of a RematPolicy, as Pax's ``custom_policy`` maps them."""
    names = jax.checkpoint_policies.save_only_these_names
    policies: dict[RematPolicy, Callable[..., bool]] = {
        RematPolicy.SAVE_NOTHING: jax.checkpoint_policies.nothing_saveable,
        RematPolicy.SAVE_EVERYTHING: jax.checkpoint_policies.everything_saveable,
        RematPolicy.SAVE_DOT_ONLY: jax.checkpoint_policies.dots_saveable,
        RematPolicy.SAVE_DOT_WITH_NO_BATCH_DIM:
            jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        RematPolicy.SAVE_DOT_FOR_MLPERF_200B: names(QKV_PROJ_NAME, CONTEXT_NAME, OUT_PROJ_NAME),
        # Pax tags the scan iteration's input; a remat'd block keeps its input anyway, so there is
        # nothing else to save.
        RematPolicy.SAVE_ITERATION_INPUT: jax.checkpoint_policies.nothing_saveable,
        RematPolicy.SAVE_QKV_OUT_PROJ: names(QKV_PROJ_NAME, OUT_PROJ_NAME),
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

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> tuple[jax.Array, None]:
        cfg = self.config
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        x = nn.with_logical_constraint(x, EMBED_ACTIVATION_AXES)  # [B, T, D]

        h = _make_norm(cfg, name="pre_attention_norm")(x)
        h = Attention(
            num_heads=cfg.num_heads,
            dims_per_head=cfg.dims_per_head,
            use_bias=cfg.use_bias,
            init_std=cfg.init_std,
            dtype=dtype,
            param_dtype=param_dtype,
            name="attention",
        )(h, mask)
        h = nn.Dropout(rate=cfg.dropout_prob)(h, deterministic=self.deterministic)
        x = x + h
        x = nn.with_logical_constraint(x, EMBED_ACTIVATION_AXES)

        h = _make_norm(cfg, name="pre_mlp_norm")(x)
        h = Mlp(
            hidden_dims=cfg.hidden_dims,
            activation=_activation_fn(cfg.activation),
            use_bias=cfg.use_bias,
            init_std=cfg.init_std,
            dtype=dtype,
            param_dtype=param_dtype,
            name="mlp",
        )(h)
        h = nn.Dropout(rate=cfg.dropout_prob)(h, deterministic=self.deterministic)
        x = x + h
        x = nn.with_logical_constraint(x, EMBED_ACTIVATION_AXES)
        return x, None


class Transformer(nn.Module):
    """GPT decoder: embeddings -> num_layers pre-norm blocks -> final norm -> logits."""

    config: TransformerConfig

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """tokens int32 [B, T] -> float32 logits [B, T, vocab].

        positions default to ``arange(T)``; for packed rows pass positions restarting at 0 per
        document together with segment_ids, and attention stays within each document.
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

        embed = Embed(
            num_embeddings=cfg.vocab_size,
            features=cfg.model_dims,
            axes=("vocab", "embed"),
            init_std=cfg.embedding_init_std,
            dtype=dtype,
            param_dtype=param_dtype,
            name="embedding",
        )
        x = embed(tokens)  # [B, T, D]
        if cfg.learned_position_embedding:
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
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
        x = nn.with_logical_constraint(x, EMBED_ACTIVATION_AXES)

        mask = make_attention_mask(seq_len=length, segment_ids=segment_ids)  # [B|1, 1, T, S]
        block_cls: Any = Block
        if cfg.remat_policy is not RematPolicy.NONE:
            block_cls = nn.remat(
                Block, policy=_remat_policy_fn(cfg.remat_policy), prevent_cse=not cfg.scan_layers
            )
        if cfg.scan_layers:
            scanned = nn.scan(
                block_cls,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=(nn.broadcast,),
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            x, _ = scanned(config=cfg, deterministic=deterministic, name="layers")(x, mask)
        else:
            for i in range(cfg.num_layers):
                x, _ = block_cls(config=cfg, deterministic=deterministic, name=f"layers_{i}")(
                    x, mask
                )

        x = _make_norm(cfg, name="final_norm")(x)
        if cfg.tie_embeddings:
            logits = embed.attend(x)  # [B, T, V]
        else:
            logits = Linear(
                equation="BTD,DV->BTV",
                kernel_shape=(cfg.model_dims, cfg.vocab_size),
                kernel_axes=("embed", "vocab"),
                bias_axes=None,
                init_std=cfg.embedding_init_std,
                dtype=dtype,
                param_dtype=param_dtype,
                name="output",
            )(x)
        logits = logits.astype(jnp.float32)
        return nn.with_logical_constraint(logits, LOGITS_ACTIVATION_AXES)


def abstract_variables(config: TransformerConfig) -> Any:
    """Boxed (LogicallyPartitioned) ShapeDtypeStruct variables; allocates no device memory."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return jax.eval_shape(
        lambda key, toks: Transformer(config).init({"params": key}, toks),
        jax.ShapeDtypeStruct((2,), jnp.uint32),
        tokens,
    )


def num_params(config: TransformerConfig) -> int:
    """Exact number of parameters (all trainable), computed abstractly."""
    params = nn.meta.unbox(abstract_variables(config)["params"])
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


def logical_param_axes(config: TransformerConfig) -> Any:
    """PartitionSpecs of logical axis names with the structure of ``variables['params']``."""
    return nn.get_partition_spec(abstract_variables(config))["params"]
