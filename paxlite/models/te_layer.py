"""Decoder layers built from NVIDIA Transformer Engine's Flax ``TransformerLayer`` (Pax
``ENABLE_TE=1``).

Selected by ``TransformerConfig.layer_implementation=TRANSFORMER_ENGINE``; the embeddings, final
norm and output projection stay paxlite's. TE fuses the norms into the following matmuls, runs
cuDNN's fused attention and, with ``te.fp8=True`` (``ENABLE_FP8=1``), does the matmuls in FP8 with
delayed scaling. The layer computes the same function as paxlite's ``Block`` (checked on a GPU in
tests/models/test_te_layer.py after `paxlite.interop.te` converts the parameters):

- LayerNorm models use TE's ``zero_centered_gamma`` (Pax's setting): TE's ``scale`` is paxlite's
  ``scale - 1``. RMSNorm scales are stored as they are.
- logits are scaled by 1/sqrt(head size) (``scale_attn_logits=True``), in float32
  (``float32_attention_logits=True``), causal; RoPE pairs consecutive dimensions (paxlite's and
  Meta's interleaved layout) with ``rotary_pos_emb_windows=(1, rope_theta)``.
- TE's own relative position bias is off; its attention and intermediate dropout are 0 (paxlite has
  neither), its hidden dropout is ``dropout_prob`` (paxlite's residual dropout).

TE has no prebuilt JAX wheel and needs CUDA, so it is imported here only, lazily, and its absence is
one `TransformerEngineUnavailableError` (a UserError: exit 2 at the command line).

FP8 state (what train/step.py must route): with ``te.fp8`` TE creates, at init, one set of scaling
variables per GEMM in the collection ``config.te_settings.fp8_collection`` ('fp8_metas'). The train
state must keep that collection beside ``params``, pass both to ``model.apply``, keep it out of the
optimizer (no Adam state, no weight decay, no clipping), and replace it after each step by its
"gradient": TE's custom VJPs return the updated scales and amax histories as the cotangent of those
variables (TE 2.x, ``dense.py``; ``update_fp8_metas`` no longer exists). Gradients of the collection
accumulated over microbatches or scan iterations combine by max, not sum (`fp8_state_collections`
lists the collections to route).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from paxlite.errors import UserError
from paxlite.models.attention import AttentionKind
from paxlite.models.attention_kernels import AttentionImplementation
from paxlite.models.te_config import te_mlp_activations
from paxlite.models.transformer_config import (
    LayerImplementation,
    NormKind,
    PositionEmbedding,
    RematPolicy,
    TransformerConfig,
)
from paxlite.parallel.compile_targets import compile_platform
from paxlite.parallel.rules import LogicalRules

TE_INSTALL_HINT = (
    "Transformer Engine needs an NVIDIA GPU with CUDA: run in NVIDIA's NGC JAX container "
    "(nvcr.io/nvidia/jax:<yy.mm>-py3, which ships it), or install the 'te' extra built against "
    "CUDA on a GPU machine (pip install --no-build-isolation 'paxlite[te]'); or unset ENABLE_TE")


class TransformerEngineUnavailableError(UserError, ImportError):
    """ENABLE_TE=1 (layer_implementation=TRANSFORMER_ENGINE) where TE cannot run."""


@functools.cache
def _import() -> tuple[Any, Any]:
    import transformer_engine.jax as te  # the one gate (pyproject import-linter)
    from transformer_engine.common import recipe

    return te, recipe


def import_transformer_engine() -> tuple[Any, Any]:
    """(transformer_engine.jax, transformer_engine.common.recipe), or one clear error.

    Without CUDA TE raises ImportError (no wheel: not installed) or RuntimeError / OSError (its
    library finds no CUDA); on a machine whose JAX backend is not a GPU it would fail later, inside
    a kernel, so that is refused here too.
    """
    try:
        modules = _import()
    except (ImportError, RuntimeError, OSError) as error:
        first = (str(error).strip().splitlines() or [""])[0][:200]
        raise TransformerEngineUnavailableError(
            f"ENABLE_TE=1 but Transformer Engine cannot be imported ({type(error).__name__}: "
            f"{first}). {TE_INSTALL_HINT}") from None
    backend, _ = compile_platform()  # a compile-only GPU target's platform too
    if backend != "gpu":
        raise TransformerEngineUnavailableError(
            f"ENABLE_TE=1 but JAX's backend is {backend!r}, not 'gpu'. {TE_INSTALL_HINT}")
    return modules


# The remat policies that keep tensors by their checkpoint_name tags (models/attention.py). TE's
# TransformerLayer tags none, so under TE each would keep nothing and recompute the whole layer:
# a different memory/speed trade than the one asked for, silently.
NAME_BASED_REMAT_POLICIES: frozenset[RematPolicy] = frozenset({
    RematPolicy.SAVE_DOT_FOR_MLPERF_200B, RematPolicy.SAVE_QKV_OUT_PROJ, RematPolicy.SAVE_OUT_PROJ,
    RematPolicy.SAVE_CONTEXT, RematPolicy.SAVE_CONTEXT_AND_OUT_PROJ,
})
TE_ATTENTION_REASON = ("TE's TransformerLayer runs its own fused attention, on the backend TE "
                       "picks from NVTE_FUSED_ATTN, and reads neither attention switch")
TE_REMAT_REASON = ("it keeps tensors by their checkpoint_name tags, and TE's TransformerLayer "
                   "tags none (it would keep nothing and recompute the whole layer)")


def settings_te_ignores(*, attention_kind: AttentionKind | str,
                        attention_implementation: AttentionImplementation | str,
                        remat_policy: RematPolicy | str) -> list[tuple[str, str, str]]:
    """(setting, value, why) for each of these a TE layer would not honour ([] when none).

    The attention switches at their defaults (dot_product, auto) and the remat policies that do
    not select by name are what TE runs anyway; anything else would be silently ignored.
    """
    found = []
    kind = AttentionKind(attention_kind)
    implementation = AttentionImplementation(attention_implementation)
    if kind is not AttentionKind.DOT_PRODUCT:
        found.append(("attention_kind", kind.value, TE_ATTENTION_REASON))
    if implementation is not AttentionImplementation.AUTO:
        found.append(("attention_implementation", implementation.value, TE_ATTENTION_REASON))
    policy = RematPolicy.parse(remat_policy)
    if policy in NAME_BASED_REMAT_POLICIES:
        found.append(("remat_policy", policy.value, TE_REMAT_REASON))
    return found


def uses_transformer_engine(config: TransformerConfig) -> bool:
    return config.layer_implementation is LayerImplementation.TRANSFORMER_ENGINE


def fp8_state_collections(config: TransformerConfig) -> tuple[str, ...]:
    """Variable collections besides 'params' that the train state must carry and overwrite with
    their gradient each step (module docstring): TE's FP8 collection when TE runs FP8, else ()."""
    if uses_transformer_engine(config) and config.te_settings.fp8:
        return (config.te_settings.fp8_collection,)
    return ()


def zero_centered_gamma(config: TransformerConfig) -> bool:
    """Whether TE stores the norm scale as ``gamma`` with ``1 + gamma`` applied (LayerNorm only)."""
    return config.norm is NormKind.LAYER_NORM


def transformer_layer_kwargs(config: TransformerConfig) -> dict[str, Any]:
    """The arguments of ``te.flax.TransformerLayer`` that make it paxlite's Block (module
    docstring).

    Plain values, so tests can check them without TE.
    """
    dtype = jnp.dtype(config.dtype)
    rotary = config.position_kind is PositionEmbedding.ROTARY
    init = nn.initializers.normal(stddev=config.init_std)
    return {
        "hidden_size": config.model_dims,
        "mlp_hidden_size": config.hidden_dims,
        "num_attention_heads": config.num_heads,
        "num_gqa_groups": config.kv_heads,
        "layernorm_type": "layernorm" if config.norm is NormKind.LAYER_NORM else "rmsnorm",
        "layernorm_epsilon": config.norm_epsilon,
        "zero_centered_gamma": zero_centered_gamma(config),
        "hidden_dropout": config.dropout_prob,
        "attention_dropout": 0.0,
        "intermediate_dropout": 0.0,
        "mha_kernel_init": init,
        "mlp_kernel_init": init,
        "mlp_activations": te_mlp_activations(config),
        "use_bias": config.use_bias,
        "float32_attention_logits": True,
        "self_attn_mask_type": "causal",
        "enable_relative_embedding": False,
        "enable_rotary_pos_emb": rotary,
        "rotary_pos_emb_windows": (1, config.rope_theta),
        "rotary_pos_emb_group_method": "consecutive",
        "dtype": dtype,
        "fuse_qkv_params": True,
        "transpose_batch_sequence": False,
        "scale_attn_logits": True,
        "scaled_query_init": False,  # paxlite inits q like k and v (normal(init_std))
    }


def autocast_kwargs(config: TransformerConfig) -> dict[str, Any]:
    """``te.autocast``'s arguments as plain values: enabled, the DelayedScaling fields, the mesh
    axes of MeshResource (our axis names: data, fsdp, tensor)."""
    te = config.te_settings
    return {
        "enabled": te.fp8,
        "recipe": {"margin": te.fp8_margin, "fp8_format": te.fp8_format,
                   "amax_history_len": te.fp8_amax_history_len,
                   "amax_compute_algo": te.fp8_amax_compute_algo},
        "mesh_resource": {"dp_resource": te.dp_resource, "fsdp_resource": te.fsdp_resource,
                          "tp_resource": te.tp_resource},
    }


@contextlib.contextmanager
def autocast(config: TransformerConfig) -> Iterator[None]:
    """``te.autocast(enabled=..., recipe=DelayedScaling(...), mesh_resource=MeshResource(...))``.

    Entered around every TE layer call (init and apply): it tells TE the mesh axes even without FP8,
    which TE's sharding constraints and `extend_logical_axis_rules` read.
    """
    te, recipe = import_transformer_engine()
    if te.NVTE_FP8_COLLECTION_NAME != config.te_settings.fp8_collection:
        raise ValueError(
            f"TransformerEngineConfig.fp8_collection={config.te_settings.fp8_collection!r}, but "
            f"TE's TransformerLayer writes its FP8 state to {te.NVTE_FP8_COLLECTION_NAME!r}")
    kwargs = autocast_kwargs(config)
    fp8_recipe = recipe.DelayedScaling(
        margin=kwargs["recipe"]["margin"],
        fp8_format=getattr(recipe.Format, kwargs["recipe"]["fp8_format"]),
        amax_history_len=kwargs["recipe"]["amax_history_len"],
        amax_compute_algo=kwargs["recipe"]["amax_compute_algo"],
    )
    with te.autocast(enabled=kwargs["enabled"], recipe=fp8_recipe,
                     mesh_resource=te.MeshResource(**kwargs["mesh_resource"])):
        yield


def extend_rules(rules: LogicalRules) -> LogicalRules:
    """``rules`` plus TE's own logical axes (``nvte_w_fsdp`` -> fsdp, ...), as
    ``te.flax.extend_logical_axis_rules`` maps them under the current ``autocast``.

    TE's function accepts only rules to a single mesh axis or None, so it is given those of ours;
    the ones it adds are appended to the whole table.
    """
    te, _ = import_transformer_engine()
    simple = tuple(rule for rule in rules if rule[1] is None or isinstance(rule[1], str))
    added = te.flax.extend_logical_axis_rules(simple)[len(simple):]
    return tuple(rules) + tuple(added)


def logical_axis_rules(config: TransformerConfig, rules: LogicalRules) -> LogicalRules:
    """The rules table a trainer should use for this model: ``rules`` itself for paxlite layers;
    with TE's parameter names added (under this model's MeshResource) for TE layers."""
    if not uses_transformer_engine(config):
        return rules
    with autocast(config):
        return extend_rules(rules)


class TransformerEngineBlock(nn.Module):
    """One decoder layer as TE's TransformerLayer, with paxlite Block's call signature.

    Its parameters sit under ``transformer_layer`` (TE's tree: ``attention/qkv/kernel``,
    ``mlp/wi_kernel``, ...; interop/te.py). Packed rows are refused: TE's causal mask type ignores
    the mask, so documents would see each other (Pax also sets PACKED_INPUT=False under TE).
    """

    config: TransformerConfig
    deterministic: bool = True
    moe_layer: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None, positions: jax.Array | None = None,
                 paddings: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> tuple[jax.Array, None]:
        """x [B, T, D], mask None or [1, 1, T, T] (causal; packed rows are refused) -> (x, None).

        RoPE angles come from arange(T) inside TE, which equals the positions of unpacked rows.
        """
        del positions, paddings  # unpacked rows only: positions are arange(T), no MoE
        if self.moe_layer:
            raise ValueError("Transformer Engine layers have no mixture-of-experts MLP")
        ignored = settings_te_ignores(attention_kind=self.config.attention_kind,
                                      attention_implementation=self.config.attention_implementation,
                                      remat_policy=self.config.remat_policy)
        if ignored:  # before TE is imported: the same error with or without a GPU
            raise ValueError(
                "layer_implementation='transformer_engine' would ignore "
                + "; ".join(f"{name}={value!r}: {why}" for name, value, why in ignored)
                + " (attention_kind='dot_product', attention_implementation='auto' and a remat "
                "policy that does not select by name are what TE runs)")
        if segment_ids is not None or (mask is not None and mask.shape[0] != 1):
            raise ValueError(
                "Transformer Engine layers take no packed rows (segment_ids): TE's causal mask "
                "ignores segments; set PACKED_INPUT=False")
        te, _ = import_transformer_engine()
        with autocast(self.config):
            rules = extend_rules(tuple(nn.get_logical_axis_rules()))
            with nn.logical_axis_rules(rules):
                layer = te.flax.TransformerLayer(**transformer_layer_kwargs(self.config),
                                                 name="transformer_layer")
                y = layer(x.astype(jnp.dtype(self.config.dtype)),
                          deterministic=self.deterministic)
        return y, None
