"""Transformer Engine's side of the decoder config: TE's FP8 recipe and mesh axes
(``TransformerEngineConfig``), what TE's TransformerLayer cannot express (checked when a
TransformerConfig asks for TE layers), and TE's activation names.

Apart from models/transformer_config.py, whose dataclass holds a ``te`` field of this type: the
TE rules read best together, and keeping them here keeps that file readable.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

from paxlite.models.open_model_fields import transformer_engine_problems

# TE's DelayedScaling fields that its JAX side supports (margin, format, history, algorithm).
TE_FP8_FORMATS: tuple[str, ...] = ("HYBRID", "E4M3")
TE_AMAX_COMPUTE_ALGOS: tuple[str, ...] = ("max", "most_recent")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerEngineConfig:
    """How Transformer Engine layers run: the FP8 recipe and the mesh axes TE shards over.

    Plain values only, so a model config stays JSON and needs no TE to be read; models/te_layer.py
    turns them into ``te.autocast(enabled=fp8, recipe=DelayedScaling(...), mesh_resource=...)``.
    Defaults are Pax's recipe (paxml PR-46 te_helper: margin 0, HYBRID, history 1024, 'max').

    ``fp8_collection`` names the Flax collection holding TE's FP8 scaling state (TE's
    ``NVTE_FP8_COLLECTION_NAME``, 'fp8_metas'): the train step keeps it in the train state and
    overwrites it with its "gradient", as for native FP8. TE's TransformerLayer does not take a
    collection name, so the layer checks that this one is TE's.
    """

    fp8: bool = False
    fp8_margin: int = 0
    fp8_format: str = "HYBRID"
    fp8_amax_history_len: int = 1024
    fp8_amax_compute_algo: str = "max"
    fp8_collection: str = "fp8_metas"
    # mesh axis names (parallel/mesh.py) given to TE's MeshResource
    dp_resource: str | None = "data"
    fsdp_resource: str | None = "fsdp"
    tp_resource: str | None = "tensor"

    def __post_init__(self) -> None:
        if not isinstance(self.fp8, bool):
            raise ValueError(f"TransformerEngineConfig.fp8={self.fp8!r} must be True or False")
        if self.fp8_format not in TE_FP8_FORMATS:
            raise ValueError(f"TransformerEngineConfig.fp8_format={self.fp8_format!r} is not "
                             f"valid; expected one of {TE_FP8_FORMATS}")
        if self.fp8_amax_compute_algo not in TE_AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"TransformerEngineConfig.fp8_amax_compute_algo={self.fp8_amax_compute_algo!r} is "
                f"not valid; expected one of {TE_AMAX_COMPUTE_ALGOS}")
        for name in ("fp8_margin", "fp8_amax_history_len"):
            value = getattr(self, name)
            low = 1 if name == "fp8_amax_history_len" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"TransformerEngineConfig.{name}={value!r} must be an integer "
                                 f">= {low}")
        if not isinstance(self.fp8_collection, str) or not self.fp8_collection:
            raise ValueError(f"TransformerEngineConfig.fp8_collection={self.fp8_collection!r} must "
                             "be a non-empty string")


def check_transformer_engine(config: Any) -> None:
    """What TE's TransformerLayer cannot express is refused here, not silently changed."""
    if config.te is not None and not isinstance(config.te, TransformerEngineConfig):
        raise ValueError(f"TransformerConfig.te={config.te!r} must be None or a "
                         "TransformerEngineConfig")
    problems = []
    if config.num_heads * config.dims_per_head != config.model_dims:
        problems.append(
            f"num_heads x dims_per_head = {config.num_heads} x {config.dims_per_head} must equal "
            f"model_dims={config.model_dims} (TE derives the head size from them)")
    if config.moe is not None:
        problems.append("mixture-of-experts layers (moe) are not TE TransformerLayers")
    if config.lora_rank is not None:
        problems.append("LoRA adapters (lora_rank) are paxlite's, not TE's")
    if config.position_kind.value == "relative_bias":
        problems.append("the T5 relative position bias is paxlite's per-layer table")
    if not config.scale_query:
        problems.append("scale_query=False (TE scales the logits by 1/sqrt(head size))")
    problems += transformer_engine_problems(config)
    if config.gated_mlp and config.activation.value not in _TE_GATED_ACTIVATIONS:
        problems.append(f"gated activation {config.activation.value!r} has no TE name")
    if not config.gated_mlp and config.activation.value not in _TE_ACTIVATIONS:
        problems.append(f"activation {config.activation.value!r} has no TE name")
    if problems:
        raise ValueError("layer_implementation='transformer_engine' cannot build this model: "
                         + "; ".join(problems))


# paxlite activation value -> TE's activation name. TE's 'gelu' is jax.nn.gelu's default, the tanh
# approximation (GELU_TANH); exact GELU has no TE name. A gated MLP is TE's (name, 'linear') pair.
TE_ACTIVATION_NAMES: Mapping[str, str] = types.MappingProxyType({
    "gelu_tanh": "gelu", "relu": "relu", "silu": "silu",
})
_TE_ACTIVATIONS = TE_ACTIVATION_NAMES
_TE_GATED_ACTIVATIONS = TE_ACTIVATION_NAMES


def te_mlp_activations(config: Any) -> tuple[str, ...]:
    """TE's ``mlp_activations`` for this config: ('gelu',) for GPT, ('silu', 'linear') for SwiGLU
    (TE applies the first to wi_kernel[:, 0] and multiplies by the linear wi_kernel[:, 1])."""
    name = TE_ACTIVATION_NAMES[config.activation.value]
    return (name, "linear") if config.gated_mlp else (name,)
