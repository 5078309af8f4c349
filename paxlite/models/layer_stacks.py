"""The Transformer's stack of layers, in the form the config asks for: pipelined, scanned, unrolled.

``stack_kind`` says which runs. A config with a pipeline runs it pipelined
(models/pipelined_stack.py) except at init and while decoding, which run the form its parameters
are stored in: scanned (``params["layers"]``, a leading [L / unit] axis with the logical name
"layers") or unrolled (``layers_0..layers_{L-1}``). So a checkpoint never depends on the
pipeline, and the pipeline reads the same parameters.

What the forms share is decided once, in ``run_layers``: the remat policy (``remat_policy``; none
while decoding, which has no backward pass to save anything for), the scan unit (``scan_unit``: TE's
layer, a Block, or a BlockUnit of ``moe_layer_interval`` blocks whose first is MoE) and the
attributes every layer gets (``layer_attributes``). Decoding differs from training only there:
never pipelined, never remat'd, and its layers keep a KV cache (``decode``).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import jax
from flax import linen as nn

from paxlite.models.attention import (
    CONTEXT_NAME,
    KEY_PROJ_NAME,
    OUT_PROJ_NAME,
    QKV_PROJ_NAME,
    QUERY_PROJ_NAME,
    VALUE_PROJ_NAME,
)
from paxlite.models.block import EMBED_ACTIVATION_AXES, Block, BlockUnit
from paxlite.models.linear import FP8_COLLECTION
from paxlite.models.pipelined_stack import check_pipeline, pipelined_layers
from paxlite.models.sown import (
    AUX_LOSS_COLLECTION,
    ROUTER_LOAD_COLLECTION,
    SUMMARIES_COLLECTION,
)
from paxlite.models.te_layer import (
    TransformerEngineBlock,
    fp8_state_collections,
    uses_transformer_engine,
)
from paxlite.models.transformer_config import RematPolicy, TransformerConfig
from paxlite.parallel import rules as rules_lib

# The rows of the embedding, final norm and logits around a pipelined stack: split over the stages
# too (rules: "activation_embed_and_logits_batch"), so each stage computes 1/S of them rather than
# every stage all of them; the pipeline gathers its microbatches from them (a [B, T, D] all-gather
# over the stages) and hands its result back to be split again.
PIPELINE_EDGE_BATCH = "activation_embed_and_logits_batch"
# q/k/v projection tags: the fused one (GPT) and the separate ones (grouped-query attention).
_QKV_NAMES: tuple[str, ...] = (QKV_PROJ_NAME, QUERY_PROJ_NAME, KEY_PROJ_NAME, VALUE_PROJ_NAME)


class StackKind(str, enum.Enum):
    """The form the layers run in; all compute the same function of the same parameters."""

    PIPELINED = "pipelined"  # stages over the mesh's pipeline axis, microbatches in flight
    SCANNED = "scanned"  # nn.scan over scan units: one traced body, parameters stacked
    UNROLLED = "unrolled"  # a Python loop over layers_0..layers_{L-1}


@dataclasses.dataclass(frozen=True)
class LayerInputs:
    """What every layer reads beside x and never changes; built once for the whole stack (the
    pipeline carries it beside each microbatch)."""

    mask: jax.Array | None  # bool [B|1, 1, T, S]; None: causal only
    positions: jax.Array | None  # int [B, T]; None: the layers need none
    paddings: jax.Array | None  # float [B, T], 1 at padding (MoE routing only)
    segment_ids: jax.Array | None  # int [B, T] of packed rows

    def args(self) -> tuple[jax.Array | None, ...]:
        """The layers' positional arguments after x: (mask, positions, paddings, segment_ids)."""
        return self.mask, self.positions, self.paddings, self.segment_ids


def stack_kind(config: TransformerConfig, *, decode: bool, initializing: bool) -> StackKind:
    """Pipelined where the config has a pipeline, except at init and while decoding (a KV cache),
    which run the stored form of the same parameters."""
    if config.pipeline is not None and not decode and not initializing:
        return StackKind.PIPELINED
    return StackKind.SCANNED if config.scan_layers else StackKind.UNROLLED


def remat_policy_fn(policy: RematPolicy) -> Callable[..., bool]:
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


def remat_policy(config: TransformerConfig, *, decode: bool) -> Callable[..., bool] | None:
    """The policy each layer (scan unit, pipeline iteration) is remat'd with; None: no remat."""
    if config.remat_policy is RematPolicy.NONE or decode:  # decoding: no backward pass
        return None
    return remat_policy_fn(config.remat_policy)


def layer_module(config: TransformerConfig) -> type[nn.Module]:
    """One layer: TE's TransformerLayer under ENABLE_TE (models/te_layer.py; dense only, and
    never pipelined or decoding), else paxlite's Block."""
    return TransformerEngineBlock if uses_transformer_engine(config) else Block


def scan_unit(config: TransformerConfig) -> tuple[type[nn.Module], dict[str, bool]]:
    """The module one scan iteration (and one pipeline "layer") runs, and its MoE attribute: an MoE
    model with experts on every k-th layer scans units of k layers, the first MoE."""
    if config.layers_per_scan_unit > 1:
        return BlockUnit, {}
    return layer_module(config), {"moe_layer": config.moe is not None}


def layer_attributes(config: TransformerConfig, *, deterministic: bool,
                     decode: bool) -> dict[str, Any]:
    """The attributes every layer (or unit) of the stack is built with. ``decode`` is given only
    while decoding: TE's layer, which never decodes, has no such attribute."""
    attributes: dict[str, Any] = {"config": config, "deterministic": deterministic}
    if decode:
        attributes["decode"] = True
    return attributes


def _layer_index(config: TransformerConfig, index: int) -> dict[str, int]:
    """The ``layer_index`` attribute of unrolled layer ``index`` where its attention depends on it
    (``layer_types``); TE's layer, which has none, takes no such attribute (TE refuses
    layer_types)."""
    return {} if config.layer_types is None else {"layer_index": index}


def constrain_rows(x: jax.Array, axes: tuple[str, ...], *, pipelined: bool) -> jax.Array:
    """The logical constraint of `axes`; around a pipelined stack with the rows split over the
    stages as well, as far as the batch divides over them (``PIPELINE_EDGE_BATCH``)."""
    if not pipelined:
        return nn.with_logical_constraint(x, axes)
    return rules_lib.logical_constraint(x, (PIPELINE_EDGE_BATCH,) + axes[1:])


def run_layers(model: nn.Module, x: jax.Array, inputs: LayerInputs, *, kind: StackKind,
               deterministic: bool, decode: bool) -> jax.Array:
    """x [B, T, D] through the layers of ``model`` (the Transformer, inside its ``__call__``) in
    the form ``kind`` -> [B, T, D]."""
    config: TransformerConfig = model.config
    check_pipeline(config)
    policy = remat_policy(config, decode=decode)
    if kind is StackKind.PIPELINED:
        return _pipelined(model, x, inputs, deterministic=deterministic, policy=policy)
    attributes = layer_attributes(config, deterministic=deterministic, decode=decode)
    if kind is StackKind.SCANNED:
        return _scanned(x, inputs, attributes=attributes, policy=policy)
    return _unrolled(x, inputs, attributes=attributes, policy=policy)


def _pipelined(model: nn.Module, x: jax.Array, inputs: LayerInputs, *, deterministic: bool,
               policy: Callable[..., bool] | None) -> jax.Array:
    """The scan unit, unbound, run by the pipeline on the stored parameters; its result rows are
    split over the stages again, as the embedding's were."""
    config: TransformerConfig = model.config
    unit, moe_attribute = scan_unit(config)
    body = unit(config=config, deterministic=deterministic, parent=None, **moe_attribute)
    x = pipelined_layers(
        model, body, x, mask=inputs.mask, positions=inputs.positions, paddings=inputs.paddings,
        segment_ids=inputs.segment_ids, dropout=not deterministic and config.dropout_prob > 0,
        remat_policy=policy)
    return constrain_rows(x, EMBED_ACTIVATION_AXES, pipelined=True)


def _scanned(x: jax.Array, inputs: LayerInputs, *, attributes: dict[str, Any],
             policy: Callable[..., bool] | None) -> jax.Array:
    """nn.scan over the L / unit scan units, parameters (and every per-layer collection) stacked
    under ``layers``; scan already keeps remat's recomputation apart, so no prevent_cse."""
    config: TransformerConfig = attributes["config"]
    unit, moe_attribute = scan_unit(config)
    body: Any = unit if policy is None else nn.remat(unit, policy=policy, prevent_cse=False)
    scanned = nn.scan(
        body,
        # sown MoE losses and summaries are stacked per layer, like the parameters; so is the FP8
        # state (each layer has its own scales and histories, no sharing) and a KV cache
        variable_axes={"params": 0, AUX_LOSS_COLLECTION: 0, SUMMARIES_COLLECTION: 0,
                       ROUTER_LOAD_COLLECTION: 0,
                       FP8_COLLECTION: 0, "cache": 0,
                       **{name: 0 for name in fp8_state_collections(config)}},
        split_rngs={"params": True, "dropout": True},
        in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
        length=config.num_layers // config.layers_per_scan_unit,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )
    x, _ = scanned(**attributes, **moe_attribute, name="layers")(x, *inputs.args())
    return x


def _unrolled(x: jax.Array, inputs: LayerInputs, *, attributes: dict[str, Any],
              policy: Callable[..., bool] | None) -> jax.Array:
    """One module per layer, ``layers_{i}``, the MoE ones where ``moe.is_moe_layer(i)``."""
    config: TransformerConfig = attributes["config"]
    layer: Any = layer_module(config)
    if policy is not None:
        layer = nn.remat(layer, policy=policy, prevent_cse=True)
    for i in range(config.num_layers):
        moe_layer = config.moe is not None and config.moe.is_moe_layer(i)
        x, _ = layer(**attributes, moe_layer=moe_layer, **_layer_index(config, i),
                     name=f"layers_{i}")(x, *inputs.args())
    return x
