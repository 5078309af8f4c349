"""Decoder-only transformer language model (Pax GPT and LLaMA) with logical axis names.

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
import types
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from paxlite.models.attention import (
    CONTEXT_NAME,
    KEY_PROJ_NAME,
    OUT_PROJ_NAME,
    QKV_PROJ_NAME,
    QUERY_PROJ_NAME,
    VALUE_PROJ_NAME,
    Attention,
    AttentionKind,
    make_attention_mask,
)
from paxlite.models.embedding import Embed
from paxlite.models.linear import Linear
from paxlite.models.lora import LoraSpec, LoraTargets, check_alpha, check_rank
from paxlite.models.mlp import Mlp
from paxlite.models.norms import LayerNorm, RMSNorm
from paxlite.models.rotary import DEFAULT_THETA

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


class PositionEmbedding(str, enum.Enum):
    """How tokens learn where they are: GPT's learned absolute table, LLaMA's RoPE, or nothing."""

    LEARNED = "learned"  # a [max_seq_len, embed] table added to the token embeddings
    ROTARY = "rotary"  # interleaved-pair RoPE on q and k inside attention (models/rotary.py)
    NONE = "none"


# q/k/v projection tags: the fused one (GPT) and the separate ones (grouped-query attention).
_QKV_NAMES: tuple[str, ...] = (QKV_PROJ_NAME, QUERY_PROJ_NAME, KEY_PROJ_NAME, VALUE_PROJ_NAME)


class RematPolicy(str, enum.Enum):
    """What a transformer block keeps for the backward pass (Pax ``CHECKPOINT_POLICY``).

    Values are Pax's names in lower case. Everything a policy does not keep is recomputed from the
    block's input during the backward pass, which a remat'd block always keeps. The name-based
    policies select tensors tagged in ``models/attention.py`` (``QKV_PROJ_NAME``, or
    ``QUERY_PROJ_NAME`` / ``KEY_PROJ_NAME`` / ``VALUE_PROJ_NAME`` when q, k and v are separate,
    ``CONTEXT_NAME``, ``OUT_PROJ_NAME``); ``docs/training.md`` says what each one saves.
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


# The switches that make a TransformerConfig LLaMA-style (Meta llama/model.py, HF LlamaForCausalLM, Pax BaseLLaMA):
# RMSNorm, SwiGLU, no biases, RoPE instead of a position table. Every LLaMA builder (the experiments, the HF and
# Meta converters) takes them from here; sizes, epsilon, RoPE theta and head tying stay with the builder.
LLAMA_ARCHITECTURE: Mapping[str, Any] = types.MappingProxyType({
    "norm": NormKind.RMS_NORM,
    "activation": Activation.SILU,
    "gated_mlp": True,
    "use_bias": False,
    "learned_position_embedding": False,
    "position_embedding": PositionEmbedding.ROTARY,
})


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
    """Every size and switch of a decoder; defaults follow Pax GPT126M.

    LLaMA-style models set ``num_kv_heads`` (grouped-query attention), ``gated_mlp=True`` with
    ``activation=SILU`` (SwiGLU), ``position_embedding=ROTARY``, ``norm=RMS_NORM``,
    ``use_bias=False`` and ``tie_embeddings=False``.

    ``position_embedding`` is the position switch; when it is None the older boolean
    ``learned_position_embedding`` decides (True: LEARNED, False: NONE), so GPT configs that only
    set the boolean keep working. Read the resolved kind from ``position_kind``.

    ``lora_rank`` adds LoRA adapters of that rank to the projections ``lora_targets`` names
    (models/lora.py); the base weights keep their names and shapes, so a base checkpoint loads
    into a LoRA model unchanged.
    """

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
    learned_position_embedding: bool = True  # read only when position_embedding is None
    position_embedding: PositionEmbedding | None = None
    rope_theta: float = DEFAULT_THETA  # RoPE base, used when the position kind is ROTARY
    num_kv_heads: int | None = None  # grouped-query attention; None: num_heads (plain MHA)
    gated_mlp: bool = False  # act(x W_gate) * (x W_up) -> W_down; with SILU this is SwiGLU
    attention_kind: AttentionKind = AttentionKind.DOT_PRODUCT  # FLASH: jax.nn.dot_product_attention
    init_std: float = 0.02  # normal(0, init_std) for every matmul weight and the position table
    softmax_init_std: float | None = None  # token embedding / softmax table; None -> init_std
    dropout_prob: float = 0.0  # residual dropout after attention and after the MLP
    input_dropout_prob: float = 0.0  # dropout on (token + position) embedding
    scan_layers: bool = False  # nn.scan over one block (Pax USE_REPEATED_LAYER)
    remat_policy: RematPolicy = RematPolicy.NONE
    dtype: str = "float32"  # compute dtype; params are always param_dtype
    param_dtype: str = "float32"
    lora_rank: int | None = None  # LoRA adapters of this rank (Pax LORA_RANK); None: no LoRA
    lora_alpha: float | None = None  # deltas scaled by alpha / rank; None: alpha = rank (Pax)
    lora_targets: LoraTargets = LoraTargets.ALL  # which projections (Pax LORA_TARGET_LAYERS)

    def __post_init__(self) -> None:
        _coerce_enum(self, "norm", NormKind)
        _coerce_enum(self, "lora_targets", LoraTargets)
        if self.lora_rank is not None:
            check_rank(self.lora_rank, name="TransformerConfig.lora_rank")
        check_alpha(self.lora_alpha, name="TransformerConfig.lora_alpha")
        _coerce_enum(self, "activation", Activation)
        _coerce_enum(self, "remat_policy", RematPolicy)
        _coerce_enum(self, "attention_kind", AttentionKind)
        if self.position_embedding is not None:
            _coerce_enum(self, "position_embedding", PositionEmbedding)
        for name in ("vocab_size", "num_layers", "model_dims", "num_heads", "dims_per_head",
                     "hidden_dims", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"TransformerConfig.{name}={value!r} must be a positive integer"
                )
        if self.num_kv_heads is not None and (
            isinstance(self.num_kv_heads, bool) or not isinstance(self.num_kv_heads, int)
            or self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads
        ):
            raise ValueError(
                f"TransformerConfig.num_kv_heads={self.num_kv_heads!r} must be None or a positive "
                f"divisor of num_heads={self.num_heads}"
            )
        if self.position_kind is PositionEmbedding.ROTARY and self.dims_per_head % 2:
            raise ValueError(
                f"TransformerConfig.dims_per_head={self.dims_per_head} must be even for rotary "
                "position embeddings (they rotate pairs of dimensions)"
            )
        for name in ("use_bias", "tie_embeddings", "learned_position_embedding", "scan_layers",
                     "gated_mlp"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"TransformerConfig.{name}={getattr(self, name)!r} must be True or False"
                )
        for name in ("norm_epsilon", "init_std", "softmax_init_std", "rope_theta"):
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
    def position_kind(self) -> PositionEmbedding:
        """The resolved position embedding: ``position_embedding``, else from the boolean."""
        if self.position_embedding is not None:
            return self.position_embedding
        if self.learned_position_embedding:
            return PositionEmbedding.LEARNED
        return PositionEmbedding.NONE

    @property
    def kv_heads(self) -> int:
        """Key/value heads actually used (num_heads when num_kv_heads is None)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def lora_spec(self) -> LoraSpec | None:
        """The adapters of every targeted Linear, or None without LoRA."""
        if self.lora_rank is None:
            return None
        return LoraSpec(rank=self.lora_rank, alpha=self.lora_alpha)

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

    @nn.compact
    def __call__(
        self, x: jax.Array, mask: jax.Array, positions: jax.Array | None = None
    ) -> tuple[jax.Array, None]:
        """x [B, T, D], mask [B|1, 1, T, S], positions [B, T] (RoPE only) -> (x [B, T, D], None)."""
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
            lora=cfg.lora_spec if cfg.lora_targets.attention else None,
            name="attention",
        )(h, mask, positions)
        h = nn.Dropout(rate=cfg.dropout_prob)(h, deterministic=self.deterministic)
        x = x + h
        x = nn.with_logical_constraint(x, EMBED_ACTIVATION_AXES)

        h = _make_norm(cfg, name="pre_mlp_norm")(x)
        h = Mlp(
            hidden_dims=cfg.hidden_dims,
            activation=_activation_fn(cfg.activation),
            gated=cfg.gated_mlp,
            use_bias=cfg.use_bias,
            init_std=cfg.init_std,
            dtype=dtype,
            param_dtype=param_dtype,
            lora=cfg.lora_spec if cfg.lora_targets.mlp else None,
            name="mlp",
        )(h)
        h = nn.Dropout(rate=cfg.dropout_prob)(h, deterministic=self.deterministic)
        x = x + h
        x = nn.with_logical_constraint(x, EMBED_ACTIVATION_AXES)
        return x, None


class Transformer(nn.Module):
    """Decoder: embeddings -> num_layers pre-norm blocks -> final norm -> logits."""

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
        document together with segment_ids, and attention stays within each document (and RoPE
        rotates each document as if it ran alone).
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
        x = nn.with_logical_constraint(x, EMBED_ACTIVATION_AXES)

        mask = make_attention_mask(seq_len=length, segment_ids=segment_ids)  # [B|1, 1, T, S]
        # Only RoPE reads positions inside the blocks; GPT blocks get None (an empty pytree).
        block_positions = positions if position_kind is PositionEmbedding.ROTARY else None
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
                in_axes=(nn.broadcast, nn.broadcast),
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            x, _ = scanned(config=cfg, deterministic=deterministic, name="layers")(
                x, mask, block_positions
            )
        else:
            for i in range(cfg.num_layers):
                x, _ = block_cls(config=cfg, deterministic=deterministic, name=f"layers_{i}")(
                    x, mask, block_positions
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
    """Exact number of parameters (LoRA adapters included), computed abstractly."""
    params = nn.meta.unbox(abstract_variables(config)["params"])
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


def logical_param_axes(config: TransformerConfig) -> Any:
    """PartitionSpecs of logical axis names with the structure of ``variables['params']``."""
    return nn.get_partition_spec(abstract_variables(config))["params"]
