"""Pipeline parallelism as one SPMD program: a stack of layers split into stages over a mesh axis.

Issue 24. ``pipeline_apply`` runs L stacked layers on M microbatches so that the result equals
applying the L layers in order to each microbatch, while each device group of the ``pipeline`` mesh
axis computes only its own stage. ``pipeline_apply_with_extras`` is the same schedule for layers
that also read per-microbatch side inputs and return per-layer extras (summed over the valid
iterations); the Transformer uses it through models/pipelined_stack.py.

The recipe MaxText, AXLearn and Praxis share (docs/parallelism.md, "Pipeline parallelism"):

- the layers of all S stages are ``vmap``ped over a leading stage dimension, sharded over the mesh
  axis the logical name ``"stage"`` maps to (``STAGE_RULE = ("stage", "pipeline")`` by default), so
  each device group runs one stage;
- every iteration, each stage's output moves to the next stage by a ``jnp.roll`` over the stage
  dimension, which the SPMD partitioner lowers to a collective-permute;
- a ``lax.scan`` runs ``R*M + S - 1`` iterations. At iteration t, stage s works on item ``t - s``
  (microbatch ``(t - s) % M`` in repeat ``(t - s) // M``); the other iterations are the bubble.

Schedules: GPipe when ``repeats == 1``; circular when ``repeats = R > 1``: each stage holds R
non-adjacent groups of layers and every microbatch passes through the S stages R times, which
shrinks the bubble to ``(S - 1) / (R*M + S - 1)`` (``bubble_fraction``). The schedule is derived
from ``repeats``, not chosen separately, so the two can never disagree.

Layer order: the saved layout stays the scanned stack's ``[L, ...]`` (independent of the mesh);
layer ``l = (r*S + s)*K + k`` (K = L / (S*R) layers per stage) is the k-th layer of stage s in
repeat r. With R = 1 stage s holds the contiguous layers ``[s*K, (s+1)*K)``, the stack's own split
over the stages; with R > 1 ``_to_stage_order`` moves each stage's K-layer chunks to it by
collective-permutes (the partitioner alone would replicate the whole stack).

Bubbles: a bubble iteration's input is replaced by zeros (a ``where``, not luck) before it reaches
a layer, and its output is never written to the results, so neither its values nor its gradients
reach outputs or parameter gradients (``layer_fn`` must be finite at a zero input, as a dense layer,
a norm with epsilon, or attention is). ``bubble_fill`` sets what the shift state and the circular
buffer hold before anything is written: tests pass NaN so that any leak shows.

Side inputs and extras: side inputs ([M, mb, ...], e.g. an attention mask) are not shifted between
stages; every stage reads its current microbatch's slice. Extras (e.g. sown losses) are added into a
[S, R, K, ...] accumulator only where the stage's item is valid, through a ``where``, so neither
bubble values nor bubble gradients reach them.

FP8 state: a stacked leaf of Flax's ``fp8_ops.fm32`` dtype (whose autodiff ``add`` is ``max``) gets
the max of its per-iteration gradients, as the scan's accumulation uses that ``add``. Its per-layer
selection has a custom VJP (``_index_max_grad``), since JAX cannot transpose the gather of an fm32
leaf.

Einsum letters / shapes: S stages, R repeats, K layers per stage, L = S*R*K layers, M microbatches,
mb rows per microbatch; ``...`` the feature dimensions of one microbatch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops
from jax import lax
from jax.sharding import PartitionSpec

from paxlite.models.parallel_config import bubble_fraction

__all__ = ["STAGE", "STAGE_RULE", "LayerCall", "bubble_fraction", "pipeline_apply",
           "pipeline_apply_with_extras", "stage_mesh_axis"]

STAGE = "stage"  # the logical name of the stage dimension
# the logical-axis rule it needs; the default when no rule names it
STAGE_RULE = (STAGE, "pipeline")


def stage_mesh_axis(num_stages: int) -> str | None:
    """The mesh axis the stage dimension is sharded over, or None (one device, or replicated).

    The logical-axis rules in context (``nn.logical_axis_rules``) decide if they name ``"stage"``;
    otherwise ``STAGE_RULE`` applies. None when no mesh is in context (``jax.set_mesh``), when the
    mesh lacks the axis, or when the axis has size 1.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    rules = dict(nn.get_logical_axis_rules())
    axis = rules.get(STAGE, STAGE_RULE[1])
    if axis is None:
        return None
    if not isinstance(axis, str):
        raise ValueError(f"the logical axis {STAGE!r} must map to one mesh axis, got {axis!r}")
    if axis not in mesh.axis_names or mesh.shape[axis] == 1:
        return None
    if num_stages % mesh.shape[axis]:
        raise ValueError(
            f"{num_stages} pipeline stages do not divide over the {axis!r} mesh axis of size "
            f"{mesh.shape[axis]}: stages must be a multiple of it")
    return axis


def _check(stacked_params, microbatches: jax.Array, *, num_stages: int, repeats: int) -> int:
    """Refuse what the schedule cannot run, naming the numbers; return layers per stage (K)."""
    if num_stages < 1 or repeats < 1:
        raise ValueError(f"num_stages={num_stages} and repeats={repeats} must both be >= 1")
    leaves = jax.tree.leaves(stacked_params)
    if not leaves:
        raise ValueError("stacked_params has no arrays: nothing to pipeline")
    counts = sorted({leaf.shape[0] if leaf.ndim else 0 for leaf in leaves})
    if len(counts) != 1:
        raise ValueError("stacked_params leaves disagree on their leading layer axis: sizes "
                         f"{counts}")
    num_layers = counts[0]
    if num_layers == 0 or num_layers % (num_stages * repeats):
        raise ValueError(
            f"{num_layers} layers do not split into {num_stages} stages x {repeats} repeats: "
            f"the layer count must be a positive multiple of {num_stages * repeats}")
    if microbatches.ndim < 2 or microbatches.shape[0] < 1:
        raise ValueError("microbatches must be [M, mb, ...] with M >= 1, got shape "
                         f"{microbatches.shape}")
    num_micro = microbatches.shape[0]
    if repeats > 1 and num_micro < num_stages:
        # Item (r, m) re-enters stage 0 at iteration r*M + m; its previous pass left the last stage
        # at (r-1)*M + m + S - 1, which is earlier only when M >= S.
        raise ValueError(
            f"the circular schedule ({repeats} repeats) needs at least as many microbatches as "
            f"stages: got {num_micro} microbatches for {num_stages} stages")
    return num_layers // (num_stages * repeats)


def _constrain_stage(x: jax.Array, axis: str | None) -> jax.Array:
    """Shard the leading stage dimension over ``axis``; leave the other dimensions to the
    partitioner."""
    if axis is None:
        return x
    spec = PartitionSpec(axis, *([PartitionSpec.UNCONSTRAINED] * (x.ndim - 1)))
    return lax.with_sharding_constraint(x, spec)


def _perfect_matching(edges: list[list[bool]]) -> list[int]:
    """A perfect matching of a bipartite graph (``edges[p][d]``), as ``match[p] = d`` (Kuhn's
    augmenting paths; the graphs here are regular, so one exists)."""
    owner = [-1] * len(edges)  # owner[d] = p

    def augment(p: int, seen: list[bool]) -> bool:
        for d, edge in enumerate(edges[p]):
            if edge and not seen[d]:
                seen[d] = True
                if owner[d] < 0 or augment(owner[d], seen):
                    owner[d] = p
                    return True
        return False

    for p in range(len(edges)):
        if not augment(p, [False] * len(edges)):
            raise AssertionError("a regular bipartite multigraph always has a perfect matching")
    match = [0] * len(edges)
    for d, p in enumerate(owner):
        match[p] = d
    return match


@functools.cache
def _stage_order_rounds(stages: int, repeats: int, devices: int) -> tuple:
    """How the stack's contiguous blocks reach stage order, as rounds of one chunk per device.

    Chunk c (K layers) sits on device ``c // per`` at slot ``c % per`` (``per = q*R`` chunks per
    device, q = stages per device); it is stage ``s = c % S``'s chunk of repeat ``r = c // S``,
    which device ``s // q`` holds at slot ``(s % q)*R + r``. Every device sends and receives
    ``per`` chunks, so the moves split into ``per`` perfect matchings (König): each round is one
    collective-permute of one chunk per device, and nothing is padded or gathered whole.

    Returns ``per`` rounds ``(src, pairs, dst)``: device p sends its slot ``src[p]`` to the device
    ``pairs`` pairs it with, and device d writes what it receives at its slot ``dst[d]``.
    """
    S, R, P = stages, repeats, devices
    q, per = S // P, (S // P) * repeats
    pending: list[list[list[tuple[int, int]]]] = [[[] for _ in range(P)] for _ in range(P)]
    for c in range(S * R):
        r, s = divmod(c, S)
        pending[c // per][s // q].append((c % per, (s % q) * R + r))
    rounds = []
    for _ in range(per):
        match = _perfect_matching([[bool(pending[p][d]) for d in range(P)] for p in range(P)])
        src, dst = [0] * P, [0] * P
        for p, d in enumerate(match):
            src[p], dst[d] = pending[p][d].pop()
        rounds.append((tuple(src), tuple(enumerate(match)), tuple(dst)))
    return tuple(rounds)


def _move_chunks(local: jax.Array, me: jax.Array, axis: str, rounds) -> jax.Array:
    """Inside a ``shard_map`` manual over ``axis``: round t sends this device's slot
    ``src[t][me]`` to device ``perm[t]``, which writes it at its slot ``dst[t][me]``. Written into
    one buffer by in-place updates: no gather, no scatter, no [per, ...] stack of rounds. ``me``
    ([1], this device's shard of an arange) is the index along ``axis`` as data: jax 0.10.2 lowers
    ``lax.axis_index`` in a partly manual ``shard_map`` to a PartitionId it cannot partition."""
    me = me[0]
    out = jnp.zeros_like(local)
    for src, pairs, dst in rounds:
        chunk = lax.dynamic_index_in_dim(local, jnp.asarray(src)[me], 0)
        chunk = lax.ppermute(chunk, axis, perm=pairs)
        out = lax.dynamic_update_index_in_dim(out, chunk, jnp.asarray(dst)[me], 0)
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _permute_chunks(local: jax.Array, me: jax.Array, axis: str, rounds) -> jax.Array:
    """``_move_chunks`` whose gradient is the inverse move (a permutation's transpose), so the
    backward pass is the same rounds reversed rather than per-round scatter-adds into zeros."""
    return _move_chunks(local, me, axis, rounds)


def _permute_chunks_fwd(local, me, axis, rounds):
    return _move_chunks(local, me, axis, rounds), me


def _permute_chunks_bwd(axis, rounds, me, cotangent):
    back = tuple((dst, tuple((d, p) for p, d in pairs), src) for src, pairs, dst in rounds)
    return _move_chunks(cotangent, me, axis, back), None


_permute_chunks.defvjp(_permute_chunks_fwd, _permute_chunks_bwd)


def _to_stage_order(leaf: jax.Array, *, stages: int, repeats: int, axis: str) -> jax.Array:
    """[L, ...] with L split into contiguous blocks over ``axis`` (the stack's sharding) ->
    [S, R, K, ...] split over ``axis`` on S, moving each chunk of K layers once.

    Why not ``reshape`` + ``swapaxes``: for R > 1 stage s needs the non-adjacent layers
    ``(r*S + s)*K + k``, and unless S divides R or R divides S the partitioner cannot map the
    blocks onto [R, S, K]: it replicates the whole stack on every device (GPT175B, 8 stages, R =
    12: 216 GiB for one MLP kernel). Here each device sends its chunks to their stages by
    collective-permutes (``_stage_order_rounds``), inside a ``shard_map`` manual only over ``axis``,
    so the other axes (FSDP) keep their split; the gradient travels the same way back."""
    mesh = jax.sharding.get_abstract_mesh()
    rounds = _stage_order_rounds(stages, repeats, mesh.shape[axis])
    k = leaf.shape[0] // (stages * repeats)
    chunks = leaf.reshape((stages * repeats, k) + leaf.shape[1:])  # chunk c: layers c*K ...
    index = jnp.arange(mesh.shape[axis], dtype=jnp.int32)  # device p's shard: [p]
    staged = jax.shard_map(lambda local, me: _permute_chunks(local, me, axis, rounds), mesh=mesh,
                           in_specs=(PartitionSpec(axis), PartitionSpec(axis)),
                           out_specs=PartitionSpec(axis), axis_names={axis})(chunks, index)
    return staged.reshape((stages, repeats, k) + leaf.shape[1:])  # slot (s % q)*R + r


# Data movement: cheap to redo, and how the weights an iteration uses are made from the stack.
_MOVES = frozenset({"dynamic_slice", "gather", "slice", "squeeze", "reshape", "expand_dims",
                    "broadcast_in_dim", "transpose", "convert_element_type", "copy", "name"})


def _save_all_but_moves(prim, *_, **__) -> bool:
    """The policy without remat: save every computed intermediate, redo data movement.

    The weights an iteration uses are a slice (a gather, once vmapped over stages), a squeeze and
    often a cast of the loop-invariant stack; saving any of them would keep a copy of a repeat's
    weights for every one of the R*M + S - 1 iterations (``checkpoint_name`` on them is not
    enough: the slice feeding the name would be saved instead). Redoing a move costs a copy; its
    input is the stack, or an activation that is itself saved. (With remat, a ``remat_policy`` that
    saves such moves brings the per-iteration weight copies back.)
    """
    return prim.name not in _MOVES


def _index(leaf: jax.Array, i: jax.Array) -> jax.Array:
    """``leaf[i]`` along the leading axis. An ``fp8_ops.fm32`` leaf (FP8 state whose gradients
    combine by max) is selected by ``_index_max_grad``: JAX cannot transpose the gather that a
    vmapped index becomes for that dtype (its scatter-add has no zero of fm32)."""
    if leaf.dtype == fp8_ops.fm32:
        return _index_max_grad(leaf, i)
    return lax.dynamic_index_in_dim(leaf, i, 0, keepdims=False)


@jax.custom_vjp
def _index_max_grad(leaf: jax.Array, i: jax.Array) -> jax.Array:
    return lax.dynamic_index_in_dim(leaf, i, 0, keepdims=False)


def _index_max_grad_fwd(leaf, i):
    return _index_max_grad(leaf, i), (jnp.zeros(leaf.shape[:1], jnp.float32), i)


def _index_max_grad_bwd(residuals, cotangent):
    """The cotangent at row i, -inf (max's identity: fm32's zero) elsewhere, built in float32."""
    rows, i = residuals
    ct = lax.convert_element_type(cotangent, jnp.float32)
    full = jnp.full(rows.shape + ct.shape, -jnp.inf, jnp.float32)
    full = lax.dynamic_update_index_in_dim(full, ct, i, 0)
    return lax.convert_element_type(full, fp8_ops.fm32), None


_index_max_grad.defvjp(_index_max_grad_fwd, _index_max_grad_bwd)


def _per_stage(flag: jax.Array, like: jax.Array) -> jax.Array:
    """A [S] boolean broadcast against [S, mb, ...]."""
    return flag.reshape(flag.shape + (1,) * (like.ndim - 1))


@jax.custom_vjp
def _select(flag: jax.Array, on_true: jax.Array, on_false: jax.Array) -> jax.Array:
    """``where(flag, on_true, on_false)`` for a scalar or [S] flag over [S, mb, ...] values.

    Why not ``jnp.where``: it broadcasts the flag to the values' shape, and its backward pass keeps
    that mask, one per iteration of the schedule (GPT175B, R = 12: 583 x [mb, T, D] booleans, 14
    GiB per device). This keeps only the flag.
    """
    return jnp.where(_broadcastable(flag, on_true), on_true, on_false)


def _broadcastable(flag: jax.Array, like: jax.Array) -> jax.Array:
    return flag if flag.ndim == 0 else _per_stage(flag, like)


def _select_fwd(flag, on_true, on_false):
    return _select(flag, on_true, on_false), flag


def _select_bwd(flag, cotangent):
    keep = _broadcastable(flag, cotangent)
    zero = jnp.zeros((), cotangent.dtype)
    return None, jnp.where(keep, cotangent, zero), jnp.where(keep, zero, cotangent)


_select.defvjp(_select_fwd, _select_bwd)


class LayerCall(NamedTuple):
    """Which call of ``layer_fn`` this is (int32 scalars, traced): layer ``layer`` of the stack
    [0, L) on microbatch ``microbatch`` [0, M). Bubble calls get the numbers of the item they
    would have computed; their results are discarded. Lets a layer derive, e.g., dropout keys."""

    layer: jax.Array
    microbatch: jax.Array


def pipeline_apply(
    layer_fn: Callable[[Any, jax.Array], jax.Array],
    stacked_params: Any,
    microbatches: jax.Array,
    *,
    num_stages: int,
    repeats: int = 1,
    remat: bool = False,
    remat_policy: Callable[..., bool] | None = None,
    bubble_fill: float = 0.0,
) -> jax.Array:
    """Apply L stacked layers in order to each microbatch, pipelined over ``num_stages`` stages.

    Args:
      layer_fn: ``layer_fn(params_of_one_layer, x) -> x``, x one microbatch [mb, ...]; it must keep
        x's shape and dtype, and be finite at a zero input (bubble inputs are zeros).
      stacked_params: a pytree whose leaves have a leading layer axis L = num_stages * repeats * K.
      microbatches: [M, mb, ...].
      num_stages: S. The stage dimension is sharded over the mesh axis of ``stage_mesh_axis``.
      repeats: R; 1 is GPipe, more is the circular schedule (needs M >= S).
      remat: ``jax.checkpoint`` each iteration's stage computation: its inputs are kept for the
        backward pass and the layers recomputed (``remat_policy`` chooses what else is saved; the
        default saves nothing). Without remat every computed activation is kept, but data movement
        is redone, so the weights an iteration selects are re-sliced from the stack, not saved.
      bubble_fill: what the shift state and circular buffer hold before anything is written (a test
        hook: NaN shows any bubble leak); never reaches outputs or gradients.

    Returns:
      [M, mb, ...]: microbatch m after all L layers.

    ``pipeline_apply_with_extras`` is the same schedule for layers that also read per-microbatch
    side inputs and return per-layer extras.
    """
    out, _ = pipeline_apply_with_extras(
        lambda params, x, side, call: (layer_fn(params, x), ()), stacked_params, microbatches,
        num_stages=num_stages, repeats=repeats, remat=remat, remat_policy=remat_policy,
        bubble_fill=bubble_fill)
    return out


def _check_side(side: Any, num_micro: int) -> None:
    bad = [
        leaf.shape for leaf in jax.tree.leaves(side) if leaf.ndim < 1 or leaf.shape[0] != num_micro
    ]
    if bad:
        raise ValueError(f"side inputs must be [M={num_micro}, ...] like the microbatches, got "
                         f"shapes {bad}")


def pipeline_apply_with_extras(
    layer_fn: Callable[[Any, jax.Array, Any, LayerCall], tuple[jax.Array, Any]],
    stacked_params: Any,
    microbatches: jax.Array,
    *,
    side: Any = None,
    num_stages: int,
    repeats: int = 1,
    remat: bool = False,
    remat_policy: Callable[..., bool] | None = None,
    bubble_fill: float = 0.0,
) -> tuple[jax.Array, Any]:
    """``pipeline_apply`` for layers with side inputs and per-layer extras (a Transformer block:
    its mask, positions, paddings and segment ids in; the MoE losses it sows out).

    Args:
      layer_fn: ``layer_fn(params_of_one_layer, x, side_of_its_microbatch, call) -> (x, extras)``:
        x [mb, ...] as in ``pipeline_apply``; ``side`` the microbatch's slice of ``side`` (read,
        never changed, so it does not travel between stages: every stage reads it from the
        [M, ...] arrays); ``call`` a ``LayerCall`` (which layer, which microbatch); ``extras`` a
        pytree of float arrays of fixed shapes (sown losses, summaries), finite at a zero input.
      side: a pytree of [M, mb, ...] arrays (None leaves allowed: empty subtrees), or None.
      The other arguments are ``pipeline_apply``'s.

    Returns:
      (outputs [M, mb, ...], extras with leaves [L, ...]): layer l's extras summed over the M
      microbatches, over the valid (non-bubble) iterations only; bubble extras never reach them,
      nor their gradients.
    """
    if remat_policy is not None and not remat:
        raise ValueError("remat_policy is used only with remat=True (it chooses what an iteration "
                         "under jax.checkpoint saves); pass remat=True or leave remat_policy out")
    S, R = num_stages, repeats
    K = _check(stacked_params, microbatches, num_stages=S, repeats=R)
    M = microbatches.shape[0]
    _check_side(side, M)
    items = R * M  # (repeat, microbatch) pairs each stage processes
    iterations = items + S - 1
    axis = stage_mesh_axis(S)

    def to_stages(leaf: jax.Array) -> jax.Array:
        # [L, ...] -> [S, R, K, ...]: layer (r*S + s)*K + k is stage s, repeat r.
        if R > 1 and axis is not None and leaf.dtype != fp8_ops.fm32:
            return _constrain_stage(_to_stage_order(leaf, stages=S, repeats=R, axis=axis), axis)
        leaf = jnp.swapaxes(leaf.reshape((R, S, K) + leaf.shape[1:]), 0, 1)
        return _constrain_stage(leaf, axis)

    staged = jax.tree.map(to_stages, stacked_params)

    def stage_step(stage_params, repeat, x, stage_side, stage, micro):
        """One stage: its K layers of repeat ``repeat`` on x [mb, ...] (leaves [R, K, ...]);
        returns (x, extras with leaves [K, ...])."""
        def one_layer(h, k):
            p = jax.tree.map(lambda leaf: _index(_index(leaf, repeat), k), stage_params)
            return layer_fn(p, h, stage_side, LayerCall((repeat * S + stage) * K + k, micro))

        return lax.scan(one_layer, x, jnp.arange(K))

    all_stages = jax.vmap(stage_step, spmd_axis_name=axis)  # every argument has a leading [S]
    if remat:
        policy = remat_policy or jax.checkpoint_policies.nothing_saveable
    else:  # keep every activation, but re-select the weights rather than save them per iteration
        policy = _save_all_but_moves
    all_stages = jax.checkpoint(all_stages, policy=policy)

    stage_ids = jnp.arange(S)
    zeros = jnp.zeros((S,) + microbatches.shape[1:], microbatches.dtype)

    def side_of(micro: jax.Array) -> Any:
        """Each stage's microbatch's side inputs: [M, mb, ...] -> [S, mb, ...]."""
        return jax.tree.map(lambda a: _constrain_stage(jnp.take(a, micro, axis=0), axis), side)

    # The extras' shapes, from an abstract call: the accumulator holds [S, R, K, ...] per leaf.
    extras_shape = jax.eval_shape(all_stages, staged, jnp.zeros((S,), jnp.int32), zeros,
                                  side_of(jnp.zeros((S,), jnp.int32)), stage_ids, stage_ids)[1]
    acc0 = jax.tree.map(
        lambda e: jnp.zeros((S, R) + e.shape[1:], e.dtype), extras_shape)

    def iteration(carry, t):
        state, circ, acc = carry  # state [S, mb, ...]: each stage's last output; circ [M, mb, ...]
        slot = t % M
        first = lax.dynamic_index_in_dim(microbatches, slot, 0, keepdims=False)  # [mb, ...]
        if R > 1:  # repeats after the first re-enter stage 0 from the circular buffer
            first = _select(t < M, first, lax.dynamic_index_in_dim(circ, slot, 0, keepdims=False))
        # stage s gets stage s-1's output
        shifted = _constrain_stage(jnp.roll(state, 1, axis=0), axis)
        x = _select(stage_ids == 0, jnp.broadcast_to(first[None], shifted.shape), shifted)
        item = t - stage_ids  # [S]
        valid = (item >= 0) & (item < items)
        x = _constrain_stage(_select(valid, x, zeros), axis)  # bubbles compute on zeros
        repeat = jnp.clip(item // M, 0, R - 1)
        micro = jnp.mod(item, M)  # [S]; a bubble's is some microbatch, its results are dropped
        out, extras = all_stages(staged, repeat, x, side_of(micro), stage_ids, micro)
        out = _constrain_stage(out, axis)
        # Add each stage's extras [S, K, ...] at its repeat, for valid stages only (a select, so
        # neither a bubble's values nor its gradients reach the sums).
        hit = (jnp.arange(R)[None, :] == repeat[:, None]) & valid[:, None]  # [S, R]
        acc = jax.tree.map(
            lambda a, e: _constrain_stage(a + jnp.where(
                hit.reshape(hit.shape + (1,) * (e.ndim - 1)), e[:, None], jnp.zeros((), e.dtype)),
                axis), acc, extras)
        last = out[S - 1]  # the last stage's item t - (S - 1); every t here has t - (S-1) < items
        # The buffer takes each finished item at its microbatch's slot: the next repeat reads it
        # back, and after the last iteration it holds the last repeat's results in order. (An
        # output stacked per iteration instead would keep R*M + S - 1 of them, and as many
        # cotangents in the backward pass.)
        done = t - (S - 1)
        slot_done = jnp.maximum(done, 0) % M
        kept = lax.dynamic_index_in_dim(circ, slot_done, 0, keepdims=False)
        circ = lax.dynamic_update_index_in_dim(circ, _select(done >= 0, last, kept), slot_done, 0)
        return (out, circ, acc), None

    state0 = jnp.full((S,) + microbatches.shape[1:], bubble_fill, microbatches.dtype)
    circ0 = jnp.full(microbatches.shape, bubble_fill, microbatches.dtype)
    (_, results, acc), _ = lax.scan(iteration, (state0, circ0, acc0), jnp.arange(iterations))
    # [S, R, K, ...] -> [R, S, K, ...] -> [L, ...]: back to the stack's layer order.
    extras = jax.tree.map(
        lambda a: jnp.swapaxes(a, 0, 1).reshape((S * R * K,) + a.shape[3:]), acc)
    return results, extras
