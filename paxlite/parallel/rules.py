"""The one table that maps logical axis names (in models) to mesh axes (in parallel/).

Models name every parameter and large activation dimension; only this table knows the mesh.
Parameters are sharded FSDP-style over `fsdp` on their embed dimension and tensor-parallel over
`tensor` on heads/mlp/vocab; activations split their batch over data x fsdp x expert and their
sequence over `seq`. MoE expert weights and expert-major activations split over `expert`; the layer
stack over `pipeline`. Optimizer state follows the parameters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from paxlite.parallel.mesh import BATCH_AXES, MeshError

LogicalRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

DEFAULT_RULES: LogicalRules = (
    # activations
    ("activation_batch", BATCH_AXES),
    # the rows of the embedding, final norm and logits around a pipelined stack: also split over
    # `pipeline`, innermost (each device keeps a part of its rows: no data moves), so each stage
    # computes 1/S of them instead of every stage all of them (MaxText's name)
    ("activation_embed_and_logits_batch", (*BATCH_AXES, "pipeline")),
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
    ("router", None),  # the router's [D, E] output dimension stays whole: every token scores all E
    ("relpos_buckets", None),  # T5 relative-position bias table [heads, buckets]: buckets whole
    ("lora_rank", None),  # LoRA adapters' rank dimension (models/lora.py): small, whole
    ("mla_latent", None),  # multi-head latent attention's latent ranks (models/mla_attention.py)
)

# Names whose mesh axes apply only as far as they divide the dimension (``fitted_spec``): the
# longest leading run of them that divides it is kept, the dimension replicated over the rest,
# instead of the mesh being refused. Key/value heads: grouped-query models with fewer kv heads
# than the tensor axis (MaxText replicates them too; attention repeats its kv activations to a
# multiple of the tensor axis, models/attention.py). Rows around a pipeline: a batch that does
# not divide over the stages too stays split over the batch axes only.
FITTED_NAMES: frozenset[str] = frozenset({
    "kv_heads", "activation_kv_heads", "activation_embed_and_logits_batch",
})


def fitted_spec(names, shape, mesh_shape: Mapping[str, int], rules: LogicalRules) -> PartitionSpec:
    """The mesh PartitionSpec of logical `names` (one per dimension of `shape`) under `rules`.

    As Flax maps them, with mesh axes that `mesh_shape` lacks left out (as a size-1 axis would
    be: a hand-made mesh without "expert"), and for ``FITTED_NAMES`` only the longest leading run
    of the axes whose product divides the dimension kept (none: replicated). So 2 kv heads on a
    tensor axis of 4 are whole on every device, where a plain rule makes a sharding that cannot
    hold them.
    """
    names = tuple(names)
    entries = []
    for name, dim, entry in zip(names, shape, nn.logical_to_mesh_axes(names, rules)):
        if entry is not None:
            given = (entry,) if isinstance(entry, str) else tuple(entry)
            axes = tuple(a for a in given if a in mesh_shape)
            while name in FITTED_NAMES and axes and dim % math.prod(mesh_shape[a] for a in axes):
                axes = axes[:-1]
            if axes != given:
                entry = None if not axes else axes[0] if len(axes) == 1 else axes
        entries.append(entry)
    return PartitionSpec(*entries)


def logical_to_shardings(logical_specs, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES, *,
                         shapes=None):
    """Map a pytree of logical PartitionSpecs to NamedShardings on `mesh`.

    With `shapes` (the same pytree of arrays or ShapeDtypeStructs) the ``FITTED_NAMES`` keep only
    the mesh axes that divide their dimension (``fitted_spec``); without, every rule applies as
    written (and ``check_divisible`` names what does not divide).
    """
    if shapes is None:
        return nn.logical_to_mesh_sharding(logical_specs, mesh, rules)
    return jax.tree.map(
        lambda spec, leaf: NamedSharding(mesh, fitted_spec(spec, leaf.shape, mesh.shape, rules)),
        logical_specs, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def mesh_ways(name: str) -> int:
    """How many ways the rules in context (``nn.logical_axis_rules``) split the logical axis
    `name` on the mesh in context (``jax.set_mesh``); 1 without either."""
    mesh = jax.sharding.get_abstract_mesh()
    rules = nn.get_logical_axis_rules()
    if mesh.empty or not rules:
        return 1
    entry = nn.logical_to_mesh_axes((name,), rules)[0]
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return math.prod(mesh.shape[a] for a in axes if a in mesh.axis_names)


def logical_constraint(x: jax.Array, names) -> jax.Array:
    """``nn.with_logical_constraint`` through ``fitted_spec``: the rules and mesh in context, the
    ``FITTED_NAMES`` kept to the mesh axes that divide `x`'s dimensions. A no-op without a mesh
    or rules in context, as Flax's is."""
    mesh = jax.sharding.get_abstract_mesh()
    rules = nn.get_logical_axis_rules()
    if mesh.empty or not rules:
        return x
    return jax.lax.with_sharding_constraint(x, fitted_spec(names, x.shape, mesh.shape, rules))


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
    """Every sharded dimension must split evenly over its mesh axes; say which ones do not, before
    compiling."""
    problems = []
    flat_shardings = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    for (path, leaf), sharding in zip(
        jax.tree_util.tree_leaves_with_path(abstract_tree), flat_shardings
    ):
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
        shown = "; ".join(problems[:5]) + (
            f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        )
        raise MeshError(
            f"mesh {dict(mesh.shape)} does not divide every {what} evenly: {shown}. Choose mesh "
            "sizes that divide these dimensions (e.g. a tensor axis that divides NUM_HEADS and "
            "HIDDEN_DIMS)"
        )
