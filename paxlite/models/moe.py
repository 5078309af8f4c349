"""Mixture-of-experts feed-forward layer: GLaM's GShard top-2 and Mixtral's dropless top-k.

Both replace a dense MLP ``[B, T, D] -> [B, T, D]``; ``MoeConfig.routing`` picks one.

GShard (GLaM, Praxis ``TransformerFeedForwardMoe``): the B*T tokens form G groups of S; each expert
takes at most C assignments per group (``top2_gating``), and dispatch / combine are dense einsums.
G follows the batch shards, so with the experts sharded over the ``expert`` mesh axis the change
from group-sharded [G, S, D] to expert-sharded [E, G, C, D] is where GSPMD puts the all-to-all.

Dropless (Mixtral): each token goes to its top-k experts, however many pick the same one. Inside
``shard_map`` every shard gathers the tokens of its ``expert`` group (all-gather), sorts the
assignments by local expert, runs the experts as grouped matmuls (``MoeConfig.grouped_matmul``
picks the kernel; the rows of other shards' experts, which sort last, are masked to zero, since no
kernel promises anything there) and reduce-scatters the weighted results back (MaxText's ring of
experts, which JAX users measured faster than ``ragged_all_to_all`` on GPUs, and which also runs on
CPU, where ``ragged_all_to_all`` does not).

Einsum letters: B batch, T length, D model dims, F expert hidden dims, E experts, G groups,
S tokens per group, C capacity per expert and group, N tokens, K experts per token, M sorted
assignments.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec
from jax.typing import DTypeLike

from paxlite.models.activations import activation_fn
from paxlite.models.linear import (
    ExpertLinear,
    Fp8Config,
    GroupedMatmulKernel,
    Linear,
    grouped_matmul,
    ragged_dot,
)
from paxlite.models.mlp import Mlp
from paxlite.models.moe_config import GroupedMatmul, MoeConfig, MoeRouting
from paxlite.models.moe_gating import (
    Top2Gating,
    load_balancing_loss_topk,
    router_z_loss,
    top2_gating,
    topk_routing,
)
from paxlite.models.moe_gpt_oss import GatedUnit, add_expert_bias, gated_unit
from paxlite.models.moe_router_deepseek import SCORE_BIAS_NAME, deepseek_routing
from paxlite.models.moe_sigmoid_gating import sigmoid_topk_routing
from paxlite.models.sown import (
    AUX_LOSS_COLLECTION,
    ROUTER_LOAD_COLLECTION,
    SUMMARIES_COLLECTION,
)
from paxlite.models.tiled_grouped_matmul import tiled_grouped_matmul

__all__ = ["GROUPED_MATMUL_KERNELS", "MoeMlp", "Top2Gating", "grouped_matmul_kernel", "top2_gating",
           "topk_routing"]

# MoeConfig.grouped_matmul -> the kernel the dropless experts run (a new GroupedMatmul value adds
# its kernel here; one without is refused by grouped_matmul_kernel, never replaced by another).
GROUPED_MATMUL_KERNELS: Mapping[GroupedMatmul, GroupedMatmulKernel] = types.MappingProxyType({
    GroupedMatmul.RAGGED_DOT: ragged_dot,
    GroupedMatmul.TILED: tiled_grouped_matmul,
})


def grouped_matmul_kernel(choice: GroupedMatmul | str) -> GroupedMatmulKernel:
    """The kernel of ``MoeConfig.grouped_matmul`` (ValueError for a value with no kernel)."""
    choice = GroupedMatmul(choice)
    if choice not in GROUPED_MATMUL_KERNELS:
        valid = ", ".join(repr(c.value) for c in GROUPED_MATMUL_KERNELS)
        raise ValueError(f"MoeConfig.grouped_matmul={choice.value!r} has no kernel in this "
                         f"version; valid: {valid}")
    return GROUPED_MATMUL_KERNELS[choice]

# [G, S, D] tokens by group, groups over the batch shards; [E, G, C, D] dispatched, experts over
# the expert axis and groups over what remains of the batch axes.
GROUPED_ACTIVATION_AXES: tuple[str, ...] = ("activation_batch", None, "activation_embed")
DISPATCHED_ACTIVATION_AXES: tuple[str, ...] = (
    "activation_exp", "activation_group", None, "activation_embed",
)
# [G, E, C, D]: dispatched tokens still where their group is, before and after the exchange.
GROUP_MAJOR_AXES: tuple[str, ...] = ("activation_batch", None, None, "activation_embed")
DISPATCHED_HIDDEN_AXES: tuple[str, ...] = (
    "activation_exp",
    "activation_group",
    None,
    "activation_mlp",
)


def _mesh_axes(logical: str) -> tuple[str, ...]:
    """The mesh axes a logical name maps to under the current rules (() without rules)."""
    spec = nn.logical_to_mesh_axes((logical,))
    axes = spec[0] if len(spec) else None
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _mesh_size(axes: tuple[str, ...]) -> int:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    return math.prod(mesh.shape[a] for a in axes)


def batch_shards() -> int:
    """How many ways the batch is split on the mesh being traced for (1 without one): GShard's
    default number of groups (Pax: one group per batch shard)."""
    return _mesh_size(_mesh_axes("activation_batch"))


@jax.custom_vjp
def _permute(x: jax.Array, order: jax.Array, inverse: jax.Array) -> jax.Array:
    """x[order] for a permutation ``order`` whose inverse is ``inverse``.

    A plain gather differentiates into a scatter-add; a permutation's transpose is the gather by its
    inverse, which is what the backward pass does here (MaxText ``use_custom_sort_vjp``).
    """
    return x[order]


def _permute_fwd(x, order, inverse):
    return x[order], inverse


def _permute_bwd(inverse, g):
    return g[inverse], None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def _dropless_experts(
    x: jax.Array,  # [N, D] this shard's tokens
    experts: jax.Array,  # [N, K] int32 chosen experts
    weights: jax.Array,  # [N, K] float32 routing weights
    wi: jax.Array,  # [E_local, D, F_local]
    wi_gate: jax.Array | None,  # [E_local, D, F_local]
    wo: jax.Array,  # [E_local, F_local, D]
    biases: tuple[jax.Array | None, ...] = (None,) * 3,  # wi, wi_gate [E_l, F_l], wo [E_l, D]
    *,
    activation,
    expert_axis: str | None,
    tensor_axes: tuple[str, ...],
    kernel_fn: GroupedMatmulKernel,
    weights_on_input: bool = False,
    unit: GatedUnit | None = None,
) -> jax.Array:
    """The body run per shard (or once, without a mesh): [N, D] -> [N, D] in x's dtype.
    ``weights_on_input`` (Llama 4): each expert gets its token times the weight, and the K
    outputs are summed unweighted. Gated experts combine gate and up by ``unit`` (None:
    ``activation(gate) * up``); ``biases`` (gpt-oss) are added per row's expert."""
    local_experts = wi.shape[0]
    if expert_axis is not None:  # every shard of the expert group sees every token of the group
        x = jax.lax.all_gather(x, expert_axis, tiled=True)  # [N', D], N' = N * ep
        experts = jax.lax.all_gather(experts, expert_axis, tiled=True)  # [N', K]
        weights = jax.lax.all_gather(weights, expert_axis, tiled=True)
        first = jax.lax.axis_index(expert_axis) * local_experts
    else:
        first = 0
    num_tokens, k = experts.shape
    local_id = experts.reshape(-1) - first  # [M = N' K], token-major
    is_local = (local_id >= 0) & (local_id < local_experts)
    sort_key = jnp.where(is_local, local_id, local_experts)  # other shards' experts sort last
    order = jnp.argsort(sort_key, stable=True)  # [M]
    inverse = jnp.argsort(order)
    group_sizes = jnp.bincount(sort_key, length=local_experts + 1)[:local_experts]  # [E_local]

    rows = jnp.repeat(x, k, axis=0)  # [M, D]: row m is token m // K
    if weights_on_input:
        rows = (rows * weights.reshape(-1, 1)).astype(x.dtype)
        weights = (weights != 0).astype(jnp.float32)  # padding (weight 0) stays out
    rows = _permute(rows, order, inverse)  # sorted by local expert
    # Rows past sum(group_sizes) belong to other shards' experts (with an expert axis). The kernel
    # may leave anything there; grouped_matmul masks them to zero in its output and keeps their
    # gradient out, so `out` below is exactly zero there before it is un-permuted and combined.
    matmul = functools.partial(grouped_matmul, group_sizes=group_sizes, kernel_fn=kernel_fn)
    row_expert = sort_key[order]  # [M]: each sorted row's local expert (local_experts: foreign)
    bi, bi_gate, bo = biases
    hidden = add_expert_bias(matmul(rows, wi), bi, row_expert)  # [M, F]
    if wi_gate is not None:
        gate = add_expert_bias(matmul(rows, wi_gate), bi_gate, row_expert)
        hidden = (unit or (lambda g, u: activation(g) * u))(gate, hidden)
    else:
        hidden = activation(hidden)
    out = matmul(hidden, wo)  # [M, D]; zero rows for other shards' experts
    if tensor_axes:  # F was split over the tensor axes: partial sums
        out = jax.lax.psum(out, tensor_axes)
    out = add_expert_bias(out, bo, row_expert)  # after the sum: bo is not split over F
    out = _permute(out, inverse, order).reshape(num_tokens, k, -1)  # [N', K, D] token-major
    y = jnp.einsum("NKD,NK->ND", out.astype(jnp.float32), weights)  # combine in float32
    if expert_axis is not None:
        y = jax.lax.psum_scatter(y, expert_axis, scatter_dimension=0, tiled=True)  # [N, D]
    return y.astype(x.dtype)


class MoeMlp(nn.Module):
    """x [B, T, D] -> [B, T, D]: router, then the experts of ``config.routing``, plus the shared
    expert (``shared_expert``, a gated Mlp) where the config has one.

    Sows into AUX_LOSS_COLLECTION the weighted load-balancing (and router z-) loss, and into
    SUMMARIES_COLLECTION ``moe``: aux_loss (unweighted; 1.0 for perfectly uniform routing),
    dropped_fraction, expert_load_min/max (share of assignments of the least and most loaded
    expert) and router_z_loss (when weighted). A DeepSeek router whose choice bias moves in
    training (``bias_update_speed`` > 0) sows its per-expert token counts into
    ROUTER_LOAD_COLLECTION under the bias's name (models/sown.py).

    Attributes:
        config: the MoE switches.
        hidden_dims: each expert's hidden size.
        grouped_matmul_fn: dropless only: a kernel that replaces the one ``config.grouped_matmul``
            names (None: that one). For tests (a kernel that writes NaN past the groups checks
            that nothing reads those rows) and for trying a kernel before it gets a name.
    """

    config: MoeConfig
    hidden_dims: int
    init_std: float = 0.02
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32
    # expert matmuls (GShard einsums) in FP8, each with its own state; the router stays float32
    fp8: Fp8Config | None = None
    grouped_matmul_fn: GroupedMatmulKernel | None = None

    def _expert(self, shape: tuple[int, int, int], axes: tuple[str, str, str], name: str):
        bias = (axes[0], axes[2]) if self.config.use_bias else None  # gpt-oss: [E, out]
        return ExpertLinear(kernel_shape=shape, kernel_axes=axes, init_std=self.init_std,
                            dtype=self.dtype, param_dtype=self.param_dtype, fp8=self.fp8,
                            bias_axes=bias, name=name)

    @nn.compact
    def __call__(self, x: jax.Array, *, paddings: jax.Array | None = None) -> jax.Array:
        """x [B, T, D]; paddings [B, T] (1 where the token is padding) or None."""
        cfg = self.config
        model_dims = x.shape[-1]
        e, f = cfg.num_experts, self.hidden_dims
        # Router in float32 (Praxis and HF Mixtral both route in full precision).
        router = Linear(equation="NTD,DE->NTE", kernel_shape=(model_dims, e),
                        kernel_axes=("embed", "router"), init_std=self.init_std,
                        bias_axes=("router",) if cfg.use_bias else None,
                        dtype=jnp.float32, param_dtype=self.param_dtype, name="router")
        wi = self._expert((e, model_dims, f), ("expert", "embed", "mlp"), "wi")
        wi_gate = (self._expert((e, model_dims, f), ("expert", "embed", "mlp"), "wi_gate")
                   if cfg.gated_experts else None)
        wo = self._expert((e, f, model_dims), ("expert", "mlp", "embed"), "wo")
        act = activation_fn(cfg.expert_activation)
        if cfg.routing is MoeRouting.GSHARD_TOP2:
            y, stats = self._gshard(x, paddings, router, wi, wi_gate, wo, act)
        else:
            y, stats = self._dropless(x, paddings, router, wi, wi_gate, wo, act)
        if cfg.shared_expert_hidden_dims is not None:  # every token, beside its routed experts
            y = y + Mlp(hidden_dims=cfg.shared_expert_hidden_dims, activation=act, gated=True,
                        use_bias=False, init_std=self.init_std, dtype=self.dtype,
                        param_dtype=self.param_dtype, fp8=self.fp8, name="shared_expert")(x)
        aux_loss, z_loss, assignments, dropped = stats
        share = assignments / jnp.maximum(jnp.sum(assignments), 1.0)  # [E]
        summaries = {
            "aux_loss": aux_loss,
            "dropped_fraction": dropped,
            "expert_load_min": jnp.min(share),
            "expert_load_max": jnp.max(share),
        }
        if cfg.load_balancing_weight:
            self.sow(AUX_LOSS_COLLECTION, "load_balancing", cfg.load_balancing_weight * aux_loss)
        if cfg.router_z_loss_weight:
            summaries["router_z_loss"] = z_loss
            self.sow(AUX_LOSS_COLLECTION, "router_z_loss", cfg.router_z_loss_weight * z_loss)
        self.sow(SUMMARIES_COLLECTION, "moe", summaries)
        return y

    def _gshard(self, x, paddings, router, wi, wi_gate, wo, act):
        cfg = self.config
        batch, length, model_dims = x.shape
        tokens = batch * length
        groups = cfg.num_groups if cfg.num_groups is not None else batch_shards()
        if self.is_initializing():  # routing does not shape the parameters; init on any tokens
            groups = math.gcd(groups, tokens)
        if tokens % groups:
            raise ValueError(
                f"MoE num_groups={groups} does not divide the {tokens} tokens of this batch "
                f"({batch} rows x {length}); choose NUM_GROUPS dividing it"
            )
        xg = x.reshape(groups, tokens // groups, model_dims)  # [G, S, D]
        xg = nn.with_logical_constraint(xg, GROUPED_ACTIVATION_AXES)
        logits = router(xg)  # [G, S, E] float32
        pad = None if paddings is None else paddings.reshape(groups, -1).astype(jnp.float32)
        gating = top2_gating(logits, capacity_factor=cfg.capacity_factor, paddings=pad)
        dispatch = gating.dispatch.astype(self.dtype)  # [G, S, E, C]
        # Dispatch where the tokens are (group-sharded), then move experts onto the expert axis: a
        # pure resharding of [G, E, C, D], which GSPMD lowers to one all-to-all.
        xe = jnp.einsum("GSEC,GSD->GECD", dispatch, xg.astype(self.dtype))
        xe = nn.with_logical_constraint(xe, GROUP_MAJOR_AXES)
        xe = nn.with_logical_constraint(jnp.swapaxes(xe, 0, 1), DISPATCHED_ACTIVATION_AXES)
        hidden = wi.einsum("EGCD,EDF->EGCF", xe)
        if wi_gate is not None:
            hidden = act(wi_gate.einsum("EGCD,EDF->EGCF", xe)) * hidden
        else:
            hidden = act(hidden)
        hidden = nn.with_logical_constraint(hidden, DISPATCHED_HIDDEN_AXES)
        ye = wo.einsum("EGCF,EFD->EGCD", hidden)
        ye = nn.with_logical_constraint(ye, DISPATCHED_ACTIVATION_AXES)
        ye = nn.with_logical_constraint(jnp.swapaxes(ye, 0, 1), GROUP_MAJOR_AXES)  # all-to-all back
        y = jnp.einsum("GECD,GSEC->GSD", ye, gating.combine.astype(self.dtype))  # combine locally
        y = nn.with_logical_constraint(y, GROUPED_ACTIVATION_AXES)
        z_loss = router_z_loss(logits.reshape(tokens, -1),
                               None if pad is None else pad.reshape(-1))
        stats = (gating.aux_loss, z_loss, gating.expert_assignments, gating.dropped_fraction)
        return y.reshape(batch, length, model_dims), stats

    def _dropless(self, x, paddings, router, wi, wi_gate, wo, act):
        cfg = self.config
        batch, length, model_dims = x.shape
        logits = router(x)  # [B, T, E] float32
        flat_logits = logits.reshape(batch * length, -1)
        if cfg.deepseek_router is not None:
            bias = (self.param(SCORE_BIAS_NAME,
                               nn.with_logical_partitioning(nn.initializers.zeros, ("router",)),
                               (cfg.num_experts,), jnp.float32)
                    if cfg.deepseek_router.uses_bias else None)  # [E], never trained
            weights, experts, probs = deepseek_routing(
                flat_logits, bias, cfg.deepseek_router, k=cfg.experts_per_token,
                renormalize=cfg.renormalize_top_k)
        elif cfg.routing is MoeRouting.SIGMOID_TOPK:
            weights, experts, probs = sigmoid_topk_routing(flat_logits, k=cfg.experts_per_token)
        else:
            weights, experts, probs = topk_routing(flat_logits, k=cfg.experts_per_token,
                                                   renormalize=cfg.renormalize_top_k)  # [N, K]
        pad = None if paddings is None else paddings.reshape(-1).astype(jnp.float32)
        aux = load_balancing_loss_topk(probs, experts, num_experts=cfg.num_experts, paddings=pad)
        z_loss = router_z_loss(flat_logits, pad)
        real = jnp.ones((batch * length,), jnp.float32) if pad is None else 1.0 - pad
        assignments = jnp.einsum(
            "NKE,N->E", jax.nn.one_hot(experts, cfg.num_experts, dtype=jnp.float32), real)
        if cfg.deepseek_router is not None and cfg.deepseek_router.bias_update_speed:
            # the counts the trainer moves the choice bias by, under the bias's own path
            self.sow(ROUTER_LOAD_COLLECTION, SCORE_BIAS_NAME, assignments,
                     init_fn=lambda: jnp.zeros((cfg.num_experts,), jnp.float32),
                     reduce_fn=jnp.add)

        expert_axes = _mesh_axes("expert")
        batch_axes = _mesh_axes("activation_batch")
        tensor_axes = tuple(a for a in _mesh_axes("mlp") if _mesh_size((a,)) > 1)
        ep = _mesh_size(expert_axes)
        if len(expert_axes) > 1:
            raise ValueError(
                f"the expert logical axis must map to one mesh axis, got {expert_axes}"
            )
        kernel_fn = (self.grouped_matmul_fn if self.grouped_matmul_fn is not None
                     else grouped_matmul_kernel(cfg.grouped_matmul))
        run = functools.partial(
            _dropless_experts, activation=act,
            expert_axis=expert_axes[0] if ep > 1 else None, tensor_axes=tensor_axes,
            kernel_fn=kernel_fn, weights_on_input=cfg.routing is MoeRouting.SIGMOID_TOPK,
            unit=gated_unit(cfg, act))
        gate_kernel = None if wi_gate is None else wi_gate.kernel_value()
        biases = (wi.bias_value(), None if wi_gate is None else wi_gate.bias_value(),
                  wo.bias_value())
        x2 = x.reshape(batch * length, model_dims).astype(self.dtype)
        weights = weights * real[:, None]  # padding contributes nothing
        if jax.sharding.get_abstract_mesh().empty:
            y = run(x2, experts, weights, wi.kernel_value(), gate_kernel, wo.kernel_value(),
                    biases)
        else:
            rows = PartitionSpec(batch_axes or None)
            expert_w = PartitionSpec(expert_axes[0] if ep > 1 else None, None,
                                     tensor_axes or None)
            expert_wo = PartitionSpec(expert_w[0], tensor_axes or None, None)
            bias_specs = (PartitionSpec(expert_w[0], tensor_axes or None),) * 2 + (
                PartitionSpec(expert_w[0], None),)
            kernels = [wi.kernel_value(), wo.kernel_value()] + (
                [] if gate_kernel is None else [gate_kernel])
            present = [b for b in biases if b is not None]
            specs = [spec for b, spec in zip(biases, bias_specs, strict=True) if b is not None]

            def body(x_, experts_, weights_, wi_, wo_, *rest):
                gate_, given = rest[:len(kernels) - 2], iter(rest[len(kernels) - 2:])
                these = tuple(None if b is None else next(given) for b in biases)
                return run(x_, experts_, weights_, wi_, gate_[0] if gate_ else None, wo_, these)

            y = jax.shard_map(
                body,
                in_specs=((rows, rows, rows, expert_w, expert_wo)
                          + (expert_w,) * len(kernels[2:]) + tuple(specs)),
                out_specs=rows,
                check_vma=False,  # outputs are psum'd over the tensor axes: replicated there
            )(x2, experts, weights, *kernels, *present)
        return y.reshape(batch, length, model_dims), (aux, z_loss, assignments,
                                                      jnp.zeros((), jnp.float32))
