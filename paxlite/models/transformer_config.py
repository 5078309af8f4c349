"""The typed configuration of the decoder (GPT, LLaMA, GLaM, Mixtral): sizes, switches and enums.

Kept apart from the modules (transformer.py) so converters, experiments and the planner can read
and check a model's shape without building it.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import types
from collections.abc import Mapping
from typing import Any

from paxlite.models.activations import Activation
from paxlite.models.attention import AttentionKind, check_attention_choice
from paxlite.models.attention_kernels import AttentionImplementation
from paxlite.models.linear import Fp8Config
from paxlite.models.lora import LoraSpec, LoraTargets, check_alpha, check_rank
from paxlite.models.mla_attention import MlaConfig, mla_problems
from paxlite.models.moe_config import MoeConfig, MoeRouting
from paxlite.models.norms import NormKind
from paxlite.models.open_model_fields import (
    LayerAttention,
    check_open_model_fields,
    layer_pattern_period,
)
from paxlite.models.parallel_config import (
    ContextParallelStrategy,
    PipelineConfig,
    scan_unit_layers,
)
from paxlite.models.rotary import DEFAULT_THETA, RopeScaling
from paxlite.models.te_config import TransformerEngineConfig, check_transformer_engine

VALID_DTYPES: tuple[str, ...] = ("float32", "bfloat16")


class PositionEmbedding(str, enum.Enum):
    """How tokens learn where they are: GPT's learned absolute table, LLaMA's RoPE, or nothing."""

    LEARNED = "learned"  # a [max_seq_len, embed] table added to the token embeddings
    ROTARY = "rotary"  # interleaved-pair RoPE on q and k inside attention (models/rotary.py)
    # T5's bucketed relative position bias added to the attention logits (GLaM;
    # models/relative_position.py)
    RELATIVE_BIAS = "relative_bias"
    NONE = "none"


class LayerImplementation(str, enum.Enum):
    """Whose modules compute each decoder layer; the embeddings, final norm and output stay
    paxlite's.

    TRANSFORMER_ENGINE builds every layer from NVIDIA Transformer Engine's Flax ``TransformerLayer``
    (models/te_layer.py; GPU only, Pax ``ENABLE_TE=1``). Its parameters have TE's names and layout;
    ``python -m paxlite convert --from=paxlite --to=te`` maps between the two (interop/te.py).
    """

    PAXLITE = "paxlite"
    TRANSFORMER_ENGINE = "transformer_engine"


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


# The switches that make a TransformerConfig LLaMA-style (Meta llama/model.py, HF LlamaForCausalLM,
# Pax BaseLLaMA): RMSNorm, SwiGLU, no biases, RoPE instead of a position table. Every LLaMA builder
# (the experiments, the HF and Meta converters) takes them from here; sizes, epsilon, RoPE theta and
# head tying stay with the builder.
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


# The sizes that must be positive integers.
_SIZE_FIELDS = ("vocab_size", "num_layers", "model_dims", "num_heads", "dims_per_head",
                "hidden_dims", "max_seq_len", "relative_position_buckets",
                "relative_position_max_distance")


def _is_size(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value > 0


def shape_problems(**fields: object) -> list[str]:
    """What the sizes given cannot be, one clause each in TransformerConfig's field names: the
    rules a config is refused by when it is made, which an experiment reports for its settings
    before it builds one. Only the fields given are checked; ``position_embedding`` (the
    resolved kind) says whether rotary embeddings need an even ``dims_per_head``."""
    problems = [f"{name}={fields[name]!r} must be a positive integer"
                for name in _SIZE_FIELDS if name in fields and not _is_size(fields[name])]
    kv_heads, heads = fields.get("num_kv_heads"), fields.get("num_heads")
    if kv_heads is not None and _is_size(heads) and (not _is_size(kv_heads) or heads % kv_heads):
        problems.append(
            f"num_kv_heads={kv_heads!r} must be a positive divisor of num_heads={heads} (query "
            "head i uses key/value head i // (num_heads / num_kv_heads))")
    dims = fields.get("dims_per_head")
    rotary = fields.get("position_embedding") == PositionEmbedding.ROTARY
    if rotary and _is_size(dims) and dims % 2:
        problems.append(f"dims_per_head={dims} must be even for rotary position embeddings "
                        "(they rotate pairs of dimensions)")
    return problems


def dropout_problems(**fields: object) -> list[str]:
    """The dropout probabilities given (``dropout_prob``, ``input_dropout_prob``) that are not in
    [0, 1), in TransformerConfig's field names: what a config is refused by when it is made, and
    what an experiment reports for its settings before it builds one."""
    return [f"{name}={value!r} must be a probability in [0, 1)" for name, value in fields.items()
            if isinstance(value, bool) or not isinstance(value, (int, float))
            or not 0.0 <= value < 1.0]


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
    attention_kind: AttentionKind = AttentionKind.DOT_PRODUCT  # FLASH: a fused attention kernel
    # FLASH's kernel: AUTO (cuDNN where it fits, else XLA), XLA, CUDNN, PALLAS_TRITON
    # (docs/attention.md)
    attention_implementation: AttentionImplementation = AttentionImplementation.AUTO
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
    relative_position_buckets: int = 32  # RELATIVE_BIAS: T5 buckets (GLaM 32)
    relative_position_max_distance: int = 128  # RELATIVE_BIAS: longest distance bucketed (GLaM 128)
    scale_query: bool = True  # q x 1/sqrt(dims_per_head); GLaM: False (Pax scales the init instead)
    moe: MoeConfig | None = None  # mixture-of-experts MLPs (models/moe_config.py); None: dense
    # Whose modules compute the layers (Pax ENABLE_TE); te: TE's settings, None -> defaults under TE
    layer_implementation: LayerImplementation = LayerImplementation.PAXLITE
    te: TransformerEngineConfig | None = None
    # Native FP8 (Pax USE_FP8) for the QKV, attention-output, MLP and GShard expert matmuls, each
    # with its own delayed-scaling state (models/linear.py, docs/fp8.md); None: dtype matmuls.
    fp8: Fp8Config | None = None
    # Pipeline parallelism (NUM_STAGES, NUM_MICROBATCHES, PIPELINE_REPEATS): the layer stack runs
    # as a pipeline in training and evaluation (models/pipeline.py); decoding runs it unpipelined
    # over the same parameters. None: no pipeline.
    pipeline: PipelineConfig | None = None
    # Sequence parallelism: how attention reaches the keys of other `seq` shards when the mesh has a
    # `seq` axis > 1 (models/context_parallel.py); read only then.
    context_parallel_strategy: ContextParallelStrategy = ContextParallelStrategy.ALL_GATHER
    # RoPE frequency scaling (LLaMA-3.1's 'llama3', models/rotary.py); None: plain RoPE.
    rope_scaling: RopeScaling | None = None
    # Biases on the q, k, v projections alone (Qwen2); None: as use_bias.
    qkv_bias: bool | None = None
    # RMSNorm over each head's q and k (weights [dims_per_head]) before RoPE (Qwen3).
    qk_norm: bool = False
    # Query i sees key j only when i - sliding_window < j <= i (Mistral v0.1); None: all of them.
    sliding_window: int | None = None
    # Gemma 2/3 (models/open_model_fields.py): norms after attention and after the MLP too
    # (post_attention_norm, post_mlp_norm); embeddings times sqrt(model_dims) in dtype; the query
    # scaled by query_scale_dims ** -0.5 (None: dims_per_head); cap * tanh(x / cap) on the
    # attention logits and on the output logits (None: no cap); per-layer attention
    # (layer_types: one LayerAttention per layer; None: every layer as sliding_window says), the
    # sliding layers with their own RoPE base (local_rope_theta, unscaled; None: as the others).
    post_norms: bool = False
    scale_embeddings: bool = False
    query_scale_dims: int | None = None
    attention_logit_cap: float | None = None
    final_logit_cap: float | None = None
    layer_types: tuple[LayerAttention, ...] | None = None
    local_rope_theta: float | None = None
    # Multi-head latent attention (DeepSeek-V2/V3, models/mla_attention.py); None: Attention.
    mla: MlaConfig | None = None
    # Llama 4 (models/chunked_attention.py): the chunk of the 'chunked_attention' layers; q/k
    # RMS-normed without weights after RoPE (RoPE layers); the NoPE layers' query times
    # 1 + query_temperature_scale * log1p(floor((pos + 1) / query_temperature_floor)) (None: off).
    attention_chunk_size: int | None = None
    qk_l2_norm: bool = False
    query_temperature_floor: int | None = None
    query_temperature_scale: float = 0.1
    # gpt-oss (models/open_model_fields.py): a learned logit per head in every attention softmax
    # (models/attention_sinks.py); a bias on the attention output projection (None: as use_bias).
    attention_sinks: bool = False
    out_bias: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.pipeline, Mapping):  # read back from JSON
            object.__setattr__(self, "pipeline", PipelineConfig(**self.pipeline))
        if self.pipeline is not None and not isinstance(self.pipeline, PipelineConfig):
            raise ValueError(
                f"TransformerConfig.pipeline={self.pipeline!r} must be None or a PipelineConfig")
        _coerce_enum(self, "context_parallel_strategy", ContextParallelStrategy)
        if isinstance(self.moe, Mapping):  # read back from JSON
            object.__setattr__(self, "moe", MoeConfig(**self.moe))
        if self.moe is not None and not isinstance(self.moe, MoeConfig):
            raise ValueError(f"TransformerConfig.moe={self.moe!r} must be None or a MoeConfig")
        if isinstance(self.te, Mapping):  # read back from JSON
            object.__setattr__(self, "te", TransformerEngineConfig(**self.te))
        _coerce_enum(self, "layer_implementation", LayerImplementation)
        if isinstance(self.fp8, Mapping):  # read back from JSON
            object.__setattr__(self, "fp8", Fp8Config(**self.fp8))
        if self.fp8 is not None and not isinstance(self.fp8, Fp8Config):
            raise ValueError(f"TransformerConfig.fp8={self.fp8!r} must be None or an Fp8Config")
        if (self.fp8 is not None and self.moe is not None
                and MoeRouting(self.moe.routing) is not MoeRouting.GSHARD_TOP2):
            raise ValueError(
                f"TransformerConfig.fp8 with moe.routing={self.moe.routing.value!r}: the dropless "
                "grouped matmul has no FP8 form; use routing='gshard_top2' with FP8, or fp8=None")
        _coerce_enum(self, "norm", NormKind)
        _coerce_enum(self, "lora_targets", LoraTargets)
        if self.lora_rank is not None:
            check_rank(self.lora_rank, name="TransformerConfig.lora_rank")
        check_alpha(self.lora_alpha, name="TransformerConfig.lora_alpha")
        _coerce_enum(self, "activation", Activation)
        _coerce_enum(self, "remat_policy", RematPolicy)
        _coerce_enum(self, "attention_kind", AttentionKind)
        _coerce_enum(self, "attention_implementation", AttentionImplementation)
        check_attention_choice(self.attention_kind, self.attention_implementation)
        if self.position_embedding is not None:
            _coerce_enum(self, "position_embedding", PositionEmbedding)
        problems = shape_problems(
            **{name: getattr(self, name) for name in (*_SIZE_FIELDS, "num_kv_heads")},
            position_embedding=self.position_kind)
        if problems:
            raise ValueError("TransformerConfig: " + "; ".join(problems))
        for name in ("use_bias", "tie_embeddings", "learned_position_embedding", "scan_layers",
                     "gated_mlp", "scale_query"):
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
        problems = dropout_problems(dropout_prob=self.dropout_prob,
                                    input_dropout_prob=self.input_dropout_prob)
        if problems:
            raise ValueError("TransformerConfig: " + "; ".join(problems))
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            if value not in VALID_DTYPES:
                raise ValueError(
                    f"TransformerConfig.{name}={value!r} is not valid; expected one of "
                    f"{', '.join(repr(d) for d in VALID_DTYPES)}"
                )
        if self.moe is not None:
            interval = self.moe.moe_layer_interval
            if self.scan_layers and self.num_layers % interval:
                raise ValueError(
                    f"TransformerConfig.num_layers={self.num_layers} must be a multiple of "
                    f"moe_layer_interval={interval} to scan the layers (the scanned unit is "
                    f"{interval} layers, the first of them MoE)"
                )
            if self.moe.first_moe_layer and (self.scan_layers or self.pipeline is not None):
                raise ValueError(
                    f"moe.first_moe_layer={self.moe.first_moe_layer} needs scan_layers=False and "
                    "pipeline=None: dense first layers leave the stack no period to scan")
            if self.lora_rank is not None and self.lora_targets.mlp:
                raise ValueError(
                    "LoRA adapters on MoE experts are not supported: use "
                    "lora_targets='attention' with an MoE model"
                )

        check_open_model_fields(self)  # after the enums above are coerced
        if isinstance(self.mla, Mapping):  # read back from JSON
            object.__setattr__(self, "mla", MlaConfig(**self.mla))
        if self.mla is not None and (problems := mla_problems(self)):
            raise ValueError("TransformerConfig.mla: " + "; ".join(problems))
        if self.layer_implementation is LayerImplementation.TRANSFORMER_ENGINE:
            check_transformer_engine(self)
        elif self.te is not None:
            raise ValueError(
                "TransformerConfig.te (Transformer Engine settings) is set but "
                "layer_implementation='paxlite': set layer_implementation='transformer_engine' "
                "(ENABLE_TE=1) or leave te=None")

    @property
    def uses_qkv_bias(self) -> bool:
        """Whether the q, k, v projections carry biases: ``qkv_bias``, else ``use_bias``."""
        return self.use_bias if self.qkv_bias is None else self.qkv_bias

    @property
    def te_settings(self) -> TransformerEngineConfig:
        """``te``, or TE's defaults (Pax's recipe, FP8 off) when it is None."""
        return self.te if self.te is not None else TransformerEngineConfig()

    @property
    def layers_per_scan_unit(self) -> int:
        """Layers in one scanned body: 1 for dense models, moe_layer_interval for MoE ones, one
        period of ``layer_types`` where the layers attend differently."""
        return scan_unit_layers(
            moe_layer_interval=None if self.moe is None else self.moe.moe_layer_interval,
            pattern_period=layer_pattern_period(self.layer_types))

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
