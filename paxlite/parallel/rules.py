"""The one table that maps logical axis names (in models) to mesh axes (in parallel/).

Models name every parameter and large activation dimension; only this table knows the mesh. Parameters are
sharded FSDP-style over `fsdp` on their embed dimension and tensor-parallel over `tensor` on heads/mlp/vocab;
activations split their batch over data x fsdp x expert and their sequence over `seq`. MoE expert weights and
expert-major activations split over `expert`; the layer stack over `pipeline`. Optimizer state follows the
parameters.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from paxlite.parallel.mesh import BATCH_AXES, MeshError

LogicalRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

DEFAULT_RULES: LogicalRules = (
    # activations
    ("activation_batch", BATCH_AXES),
    # the sequence between blocks: split over `seq` (sequence parallelism; size 1 without it)
    ("activation_length", "seq"),
    ("activation_embed", None),
    ("activation_mlp", "tensor"),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_kv", None),
    ("activation_vocab", "tensor"),
    ("activation_exp", "expert"),  # the expert dimension of dispatched MoE activations
    # GShard groups once dispatched to experts [E, G, C, D]: over the batch axes but expert, which
    # now splits E (the G -> E resharding is the all-to-all)
    ("activation_group", ("data", "fsdp")),
    # parameters
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("kv", None),
    ("qkv", None),
    ("vocab", "tensor"),
    ("position", None),
    ("norm", None),
    # the scanned layer stack [L, ...]: split over `pipeline`, so each stage holds its own layers
    # (GPipe: contiguous blocks of L / S layers; size 1 without a pipeline)
    ("layers", "pipeline"),
    ("stage", "pipeline"),  # the stage dimension of a pipeline's state (models/pipeline.py)
    ("expert", "expert"),  # MoE expert weights [E, ...]: each expert-axis shard holds E / expert
    ("router", None),
    ("relpos_buckets", None),  # T5 relative-position bias table [heads, buckets]: buckets whole  # the router's [D, E] output dimension stays whole: every token scores all E
)


def logical_to_shardings(logical_specs, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES):
    """Map a pytree of logical PartitionSpecs to NamedShardings on `mesh`."""
    return nn.logical_to_mesh_sharding(logical_specs, mesh, rules)


def _batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """BATCH_AXES that `mesh` has: build_mesh's meshes have them all; a hand-made mesh without an
    expert axis splits its batch over the others (size 1 is what a missing axis means)."""
    return tuple(axis for axis in BATCH_AXES if axis in mesh.axis_names)


def batch_sharding(mesh: Mesh, rank: int = 2) -> NamedSharding:
    """Inputs [batch, length, ...]: batch over data x fsdp x expert, the rest replicated.

    Row blocks follow the mesh order of the axes: data outermost, expert innermost.
    """
    return NamedSharding(mesh, PartitionSpec(_batch_axes(mesh), *([None] * (rank - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_split(mesh: Mesh) -> int:
    """How many ways a global batch is divided: data x fsdp x expert."""
    return math.prod(mesh.shape[axis] for axis in _batch_axes(mesh))


def check_divisible(abstract_tree, shardings, mesh: Mesh, *, what: str = "parameter") -> None:
    """Every sharded dimension must split evenly over its mesh axes; say which ones do not, before compiling."""
    problems = []
    flat_shardings = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    for (path, leaf), sharding in zip(jax.tree_util.tree_leaves_with_path(abstract_tree), flat_shardings):
        for dim, axes in zip(leaf.shape, sharding.spec):
            if axes is None:
                continue
            axes = (axes,) if isinstance(axes, str) else tuple(axes)
            ways = 1
            for axis in axes:
                ways *= mesh.shape[axis]
            if dim % ways:
                problems.append(
                    f"{jax.tree_util.keystr(path)} {tuple(leaf.shape)}: dimension {dim} over "
                    f"{'x'.join(axes)}={ways}"
                )
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise MeshError(
            f"mesh {dict(mesh.shape)} does not divide every {what} evenly: {shown}. Choose mesh "
            "sizes that divide these dimensions (e.g. a tensor axis that divides NUM_HEADS and HIDDEN_DIMS)"
        )
