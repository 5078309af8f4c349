"""The Transformer's layer stack run as a pipeline (models/pipeline.py): the Flax-facing glue.

models/layer_stacks.py hands the Transformer's layers here when ``config.pipeline`` is set and
it is neither initializing nor decoding. What this module promises:

- **Same parameters.** The pipeline reads the variables the ordinary stack created: the scanned
  ``params["layers"]`` ([L / unit] leading axis, logical name "layers") or the unscanned
  ``layers_0..layers_{L-1}``, which are stacked here for the forward (grouped into scan units
  ``layer_{j}`` exactly as ``BlockUnit``, models/block.py, names them when
  ``config.layers_per_scan_unit`` > 1). Init runs the ordinary stack, so a checkpoint never
  depends on the pipeline, and decoding (a KV cache) runs the ordinary stack over the same
  parameters. The pipeline's "layer" is one scan unit.
- **Microbatches without moving rows.** The batch [B, ...] is split into M strided microbatches
  (microbatch m holds rows m, m + M, ...: as ``train/grad_accum.split_microbatches`` does, so each
  device's rows stay on it) and put back in the original row order.
- **Side inputs** (attention mask, positions, MoE paddings, segment ids) travel per microbatch
  beside the activations; layers read them and never change them.
- **Sown values.** Each block runs with the ``aux_loss`` and ``summaries`` collections mutable; the
  pipeline sums them per layer over the microbatches (valid iterations only) and they are sown into
  the Transformer's collections, per layer, as the MEAN over the M microbatches, under the names the
  unpipelined model uses. So ``sown.total_aux_loss`` and ``sown.summary_means`` give the mean over
  microbatches of what the unpipelined model gives for one microbatch (a per-microbatch statistic
  such as ``moe/expert_load_max`` is averaged, not recomputed on the whole batch). The routers'
  token counts (``router_load``) are the exception: sown as the SUM over microbatches, the whole
  batch's counts.
- **Dropout.** Each (layer, microbatch) gets its own key: ``make_rng("dropout")`` folded with the
  layer (unit) index, then the microbatch index. Deterministic runs, or no dropout, need no rng.
- **FP8.** Each layer's delayed-scaling state is used once per iteration, so autodiff would add the
  "gradients" (the new states) of its M uses (and of the bubbles). The stacked state enters the
  pipeline as Flax's ``fp8_ops.fm32`` (whose autodiff ``add`` is ``max``) and its gradient leaves
  as float32: the new state is the elementwise max over microbatches. Bubbles compute on zeros
  (amax 0) with the same old state, and a new scale depends only on the old state, so under max
  they change nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from paxlite.models.linear import FP8_COLLECTION
from paxlite.models.pipeline import LayerCall, pipeline_apply_with_extras
from paxlite.models.sown import COLLECTIONS as SOWN_COLLECTIONS
from paxlite.models.sown import ROUTER_LOAD_COLLECTION
from paxlite.models.te_layer import uses_transformer_engine
from paxlite.models.transformer_config import TransformerConfig

# What the pipeline's buffers hold before anything is written (a context variable: tests set it)
_BUBBLE_FILL: contextvars.ContextVar[float] = contextvars.ContextVar("bubble_fill", default=0.0)


@contextlib.contextmanager
def bubble_fill_for_tests(value: float) -> Iterator[None]:
    """Test hook, not a setting: models traced inside fill the pipeline's shift state and circular
    buffer with ``value`` (NaN makes any bubble leak visible). Read at trace time."""
    token = _BUBBLE_FILL.set(value)
    try:
        yield
    finally:
        _BUBBLE_FILL.reset(token)


def check_pipeline(config: TransformerConfig) -> None:
    """Refuse, in one line naming the numbers, what the pipelined stack cannot run."""
    pipe = config.pipeline
    if pipe is None:
        return
    if uses_transformer_engine(config):
        raise ValueError(
            "pipeline parallelism (TransformerConfig.pipeline) is not available with "
            "layer_implementation='transformer_engine' (TE's layers are not pipelined): use "
            "layer_implementation='paxlite' or pipeline=None")
    problems = pipe.problems(num_layers=config.num_layers,
                             layers_per_unit=config.layers_per_scan_unit)
    if problems:
        raise ValueError("; ".join(problems))


def split_microbatches(x: jax.Array, num_microbatches: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...]; microbatch m holds rows m, m + M, m + 2M, ... (strided).

    Strided because the batch is laid out over the batch devices in contiguous row blocks: the
    reshape to [B/M, M, ...] keeps that blocking, and moving M to the front is a local transpose,
    so no row crosses devices (train/grad_accum.py explains it at length).
    """
    batch = x.shape[0]
    if batch % num_microbatches:
        raise ValueError(
            f"a batch of B={batch} rows does not split into M={num_microbatches} pipeline "
            f"microbatches (PipelineConfig.num_microbatches): B must be a multiple of M")
    x = jnp.moveaxis(x.reshape((batch // num_microbatches, num_microbatches) + x.shape[1:]), 1, 0)
    return nn.with_logical_constraint(x, (None, "activation_batch") + (None,) * (x.ndim - 2))


def merge_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of ``split_microbatches``: [M, B/M, ...] -> [B, ...] in the original row
    order."""
    num_micro, rows = x.shape[:2]
    return jnp.moveaxis(x, 0, 1).reshape((num_micro * rows,) + x.shape[2:])


def _stack(trees: list[Any]) -> Any:
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def _stacked_collection(config: TransformerConfig, tree: Mapping[str, Any]) -> Any:
    """One collection's layer variables with a leading [units] axis, as the scanned model has
    them."""
    if config.scan_layers:
        return tree["layers"]
    unit = config.layers_per_scan_unit
    units = config.num_layers // unit
    if unit == 1:
        return _stack([tree[f"layers_{i}"] for i in range(units)])
    return {f"layer_{j}": _stack([tree[f"layers_{u * unit + j}"] for u in range(units)])
            for j in range(unit)}


def _per_layer_entries(config: TransformerConfig, stacked: Any) -> dict[str, Any]:
    """The inverse of ``_stacked_collection`` for sown values: {variable name: value}."""
    if config.scan_layers:
        return {"layers": stacked}
    unit = config.layers_per_scan_unit
    units = config.num_layers // unit
    if unit == 1:
        return {f"layers_{i}": jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(units)}
    entries = {}
    for j, sub in stacked.items():  # only the layers that sowed (GLaM: layer_0, the MoE one)
        index = int(j.removeprefix("layer_"))
        for u in range(units):
            entries[f"layers_{u * unit + index}"] = jax.tree.map(lambda a, u=u: a[u], sub)
    return dict(sorted(entries.items(), key=lambda kv: int(kv[0].removeprefix("layers_"))))


def pipelined_layers(
    module: nn.Module,
    body: nn.Module,
    x: jax.Array,
    *,
    mask: jax.Array | None,
    positions: jax.Array | None,
    paddings: jax.Array | None,
    segment_ids: jax.Array | None,
    remat_policy: Callable[..., bool] | None,
    dropout: bool,
) -> jax.Array:
    """x [B, T, D] through the Transformer's layers, pipelined; sows per-layer MoE values.

    Args:
      module: the Transformer (bound): its variables hold the layers' parameters (and FP8 state),
        its rng streams the dropout key, its collections receive the sown values.
      body: one scan unit, unbound (``parent=None``): a Block, or a BlockUnit when
        ``config.layers_per_scan_unit`` > 1; called as the scanned body is,
        ``body(x, mask, positions, paddings, segment_ids) -> (x, None)``.
      mask: [B, 1, T, S] or None; positions, paddings, segment_ids: [B, T] or None.
      remat_policy: a ``jax.checkpoint`` policy (remat each pipeline iteration), or None: no remat.
      dropout: whether the body drops anything (then the "dropout" rng stream is required).
    """
    cfg: TransformerConfig = module.config
    pipe = cfg.pipeline
    batch = x.shape[0]
    num_micro = pipe.microbatches(batch)  # NUM_MICROBATCHES, rows / MICROBATCH_SIZE, or stages
    variables = nn.meta.unbox(module.variables)
    layer_vars = {"params": _stacked_collection(cfg, variables["params"])}
    if FP8_COLLECTION in variables:  # max-accumulated inside the pipeline (module docstring)
        layer_vars[FP8_COLLECTION] = jax.tree.map(
            lambda a: jax.lax.convert_element_type(a, fp8_ops.fm32),
            _stacked_collection(cfg, variables[FP8_COLLECTION]))
    base_key = module.make_rng("dropout") if dropout else None

    def layer_fn(layer_vars: Any, h: jax.Array, side: Any, call: LayerCall):
        rngs = {}
        if base_key is not None:
            rngs["dropout"] = jax.random.fold_in(
                jax.random.fold_in(base_key, call.layer), call.microbatch)
        (h, _), state = body.apply(
            layer_vars, h, side["mask"], side["positions"], side["paddings"],
            side["segment_ids"], rngs=rngs, mutable=list(SOWN_COLLECTIONS))
        return h, state

    if mask is not None and mask.shape[0] != batch:
        mask = jnp.broadcast_to(mask, (batch,) + mask.shape[1:])
    side = {name: None if value is None else split_microbatches(value, num_micro)
            for name, value in (("mask", mask), ("positions", positions), ("paddings", paddings),
                                ("segment_ids", segment_ids))}
    out, extras = pipeline_apply_with_extras(
        layer_fn, layer_vars, split_microbatches(x, num_micro), side=side,
        num_stages=pipe.num_stages, repeats=pipe.repeats, remat=remat_policy is not None,
        remat_policy=remat_policy, bubble_fill=_BUBBLE_FILL.get())
    for collection, stacked in extras.items():
        if not module.is_mutable_collection(collection):
            continue
        scale = 1.0 if collection == ROUTER_LOAD_COLLECTION else 1.0 / num_micro  # counts: sums
        mean = jax.tree.map(lambda a, scale=scale: a * scale, stacked)
        for name, value in _per_layer_entries(cfg, mean).items():
            module.put_variable(collection, name, value)
    return merge_microbatches(out)
