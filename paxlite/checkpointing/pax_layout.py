"""Pax's own checkpoints (paxml's TensorStore layout) read into, and written from, paxlite's params.

Here in checkpointing/ (which train/ and interop/ both import) rather than interop/ because
``CHECKPOINT_RESTORE_PATH`` must read them directly (so Pax's ``run_llama_boolq.sh`` argument keeps
working with the checkpoint a user already has), and train/ may not import interop/. The mapping is
keyed on paxlite's *parameter tree names* (the model asks for ``layers_0/attention/qkv/kernel``;
this module knows Pax's name for it), so train/ stays family-blind: no model family, no experiment.

Pax's layout (docs/interop.md, "Pax checkpoints"): ``checkpoint_%08d/state/<flattened name>``, one
TensorStore zarr array per directory, ``.`` separators, ``mdl_vars.params.`` before the model's
names; GPT's repeated layers are one array per name under ``lm.transformer.repeat.sub.x_layers_0``
with a leading [L] axis. Pax LayerNorm scales are zero-centred (praxis applies ``1 + scale``);
LLaMA's RMSNorm uses ``direct_scale`` (the scale as it is): LayerNorm scales move by 1, RMSNorm
scales do not.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
from etils import epath

from paxlite.errors import UserError

PARAMS_PREFIX = "mdl_vars.params."
STATE = "state"
REPEATED_PREFIX = "lm.transformer.repeat.sub.x_layers_0"
_LAYER = re.compile(r"^layers_(\d+)/(.+)$")


class PaxCheckpointError(UserError, ValueError):
    """A Pax checkpoint that cannot be read, or whose tensors do not fit the model."""


@dataclasses.dataclass(frozen=True)
class PaxArray:
    """One saved array: its TensorStore directory and shape (from ``.zarray``; nothing read yet)."""

    path: str
    shape: tuple[int, ...]

    def read(self, index: int | None = None) -> np.ndarray:
        """The array, or its slice ``[index]`` (one layer of a repeated stack), read now."""
        import tensorstore as ts

        spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": self.path}}
        store = ts.open(spec, open=True, read=True).result()
        return np.asarray((store if index is None else store[index]).read().result())


def is_pax_step(step_dir: epath.Path) -> bool:
    """Whether a step directory holds Pax's layout (``state/mdl_vars.params.*``)."""
    state = step_dir / STATE
    return state.is_dir() and any(c.name.startswith(PARAMS_PREFIX) for c in state.iterdir())


def pax_arrays(step_dir: epath.Path) -> dict[str, PaxArray]:
    """{Pax parameter name without ``mdl_vars.params.``: array} of a Pax step directory."""
    state = step_dir / STATE
    if (state / "manifest.ocdbt").exists():
        raise PaxCheckpointError(
            f"{state} is an OCDBT checkpoint (Pax version 1.2, --tensorstore_use_ocdbt); paxlite "
            "reads Pax's per-array layout (version 1.1): save it again without OCDBT")
    out = {}
    for child in sorted(state.iterdir(), key=lambda c: c.name):
        if not child.name.startswith(PARAMS_PREFIX):
            continue
        try:
            shape = tuple(json.loads((child / ".zarray").read_text())["shape"])
        except (OSError, ValueError, KeyError) as error:
            raise PaxCheckpointError(
                f"{child} is not a TensorStore zarr array ({type(error).__name__}: {error}); the "
                "checkpoint is damaged or not in Pax's layout") from None
        out[child.name[len(PARAMS_PREFIX):]] = PaxArray(os.fspath(child), shape)
    return out


# ---------------------------------------------------------------- the name table
@dataclasses.dataclass(frozen=True)
class Recipe:
    """How one paxlite leaf (of one layer) is made of Pax tensors: each piece transposed by
    ``perm`` (np.transpose order), several pieces stacked on ``stack_axis``, then ``shift``
    added."""

    names: tuple[str, ...]
    perm: tuple[int, ...] | None = None
    stack_axis: int | None = None
    shift: float = 0.0

    def pax_shape(self, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape each Pax piece must have for a paxlite leaf of ``leaf_shape``."""
        shape = list(leaf_shape)
        if self.stack_axis is not None:
            del shape[self.stack_axis]
        if self.perm is None:
            return tuple(shape)
        out = [0] * len(shape)
        for j, p in enumerate(self.perm):
            out[p] = shape[j]
        return tuple(out)

    def combine(self, pieces: list[np.ndarray], *, lead: int = 0) -> np.ndarray:
        """The paxlite leaf (or block of it) made of its Pax pieces (or their blocks), each with
        ``lead`` leading axes (a range of layers) before the piece's own."""
        perm = None if self.perm is None else (*range(lead), *(lead + p for p in self.perm))
        parts = [p if perm is None else np.transpose(p, perm) for p in pieces]
        out = parts[0] if self.stack_axis is None else np.stack(parts, axis=lead + self.stack_axis)
        return out + np.asarray(self.shift, out.dtype) if self.shift else out

    def piece_index(self, index: tuple[slice, ...]) -> tuple[slice, tuple[slice, ...]]:
        """(which pieces, the index into each) of a block ``index`` of one layer's leaf: the
        stacked axis selects pieces, the others map through ``perm`` onto the piece's axes."""
        rest = list(index)
        which = slice(0, 1)
        if self.stack_axis is not None:
            which = rest.pop(self.stack_axis)
        if self.perm is None:
            return which, tuple(rest)
        out = [slice(None)] * len(rest)
        for j, p in enumerate(self.perm):
            out[p] = rest[j]
        return which, tuple(out)

    def split(self, leaf: np.ndarray) -> list[np.ndarray]:
        """Inverse of `combine`: the Pax pieces of a paxlite leaf."""
        leaf = np.asarray(leaf)
        if self.shift:
            leaf = leaf - np.asarray(self.shift, leaf.dtype)
        parts = ([leaf] if self.stack_axis is None
                 else [np.take(leaf, k, axis=self.stack_axis) for k in range(len(self.names))])
        inverse = None if self.perm is None else tuple(np.argsort(self.perm))
        return [p if inverse is None else np.transpose(p, inverse) for p in parts]


def _norm(prefix: str, *, layer_norm: bool) -> dict[str, Recipe]:
    return {"scale": Recipe((f"{prefix}.scale",), shift=1.0 if layer_norm else 0.0),
            "bias": Recipe((f"{prefix}.bias",))}


def _layer_table(*, fused_qkv: bool, layer_norm: bool) -> dict[str, Recipe]:
    """paxlite Block leaf -> Recipe with Pax names relative to the layer (praxis's Transformer)."""
    att = "self_attention"
    table: dict[str, Recipe] = {}
    for ours, theirs in (("pre_attention_norm", "layer_norm"),
                         ("pre_mlp_norm", "ff_layer.layer_norm")):
        table.update({f"{ours}/{k}": r for k, r in _norm(theirs, layer_norm=layer_norm).items()})
    if fused_qkv:  # combined_qkv.w [3, D, N, H] -> qkv/kernel [D, 3, N, H]
        table["attention/qkv/kernel"] = Recipe((f"{att}.combined_qkv.w",), perm=(1, 0, 2, 3))
        table["attention/qkv/bias"] = Recipe((f"{att}.combined_qkv.b",))  # [3, N, H]
    else:  # query/key/value.w [D, N, H] stacked on axis 1
        table["attention/qkv/kernel"] = Recipe(
            tuple(f"{att}.{p}.w" for p in ("query", "key", "value")), stack_axis=1)
        table["attention/qkv/bias"] = Recipe(
            tuple(f"{att}.{p}.b" for p in ("query", "key", "value")), stack_axis=0)
    for p in ("query", "key", "value"):
        table[f"attention/{p}/kernel"] = Recipe((f"{att}.{p}.w",))
        table[f"attention/{p}/bias"] = Recipe((f"{att}.{p}.b",))
    table["attention/out/kernel"] = Recipe((f"{att}.post.w",), perm=(1, 2, 0))  # [D,N,H]->[N,H,D]
    table["attention/out/bias"] = Recipe((f"{att}.post.b",))
    for ours, theirs in (
        ("wi", "ffn_layer1"),
        ("wi_gate", "ffn_layer1_gate"),
        ("wo", "ffn_layer2"),
    ):
        table[f"mlp/{ours}/kernel"] = Recipe((f"ff_layer.{theirs}.linear.w",))
        table[f"mlp/{ours}/bias"] = Recipe((f"ff_layer.{theirs}.bias.b",))
    return table


_SOFTMAX_W = "lm.softmax.logits_ffn.linear.w"  # [D, V]; tied models embed with its transpose


def _top_table(*, tied: bool, layer_norm: bool) -> dict[str, Recipe]:
    table = {
        "embedding/embedding": (Recipe((_SOFTMAX_W,), perm=(1, 0)) if tied
                                else Recipe(("lm.embedding_lookup.emb_var",))),
        "output/kernel": Recipe((_SOFTMAX_W,)),
        "output/bias": Recipe(("lm.softmax.logits_ffn.bias.b",)),
        "position_embedding/embedding": Recipe(("lm.position_emb.emb_var",)),
    }
    table.update(
        {f"final_norm/{k}": r for k, r in _norm("lm.final_ln", layer_norm=layer_norm).items()}
    )
    return table


@dataclasses.dataclass(frozen=True)
class Layout:
    """The Pax form chosen for one model: repeated layers or not, fused q/k/v or not."""

    repeated: bool
    fused_qkv: bool
    tied: bool
    layer_norm: bool
    num_layers: int

    def layer_prefix(self, i: int) -> tuple[str, int | None]:
        return (REPEATED_PREFIX, i) if self.repeated else (f"lm.transformer.x_layers_{i}", None)


def model_facts(leaves: Mapping[str, tuple[int, ...]]) -> tuple[bool, bool, int]:
    """(tied embeddings, LayerNorm (not RMSNorm), number of layers) of a paxlite params tree."""
    tied = "output/kernel" not in leaves
    layer_norm = "final_norm/bias" in leaves
    stacked = [s for n, s in leaves.items() if n.startswith("layers/")]
    indices = {int(m.group(1)) for n in leaves if (m := _LAYER.match(n))}
    num_layers = stacked[0][0] if stacked else (max(indices) + 1 if indices else 0)
    return tied, layer_norm, num_layers


def read_layout(leaves: Mapping[str, tuple[int, ...]], names: Mapping[str, Any]) -> Layout:
    """The Layout of an existing Pax checkpoint (its tensor ``names``) for a model's ``leaves``."""
    tied, layer_norm, num_layers = model_facts(leaves)
    repeated = any(n.startswith(REPEATED_PREFIX + ".") for n in names)
    fused = not any(n.endswith(".self_attention.query.w") for n in names)
    return Layout(repeated=repeated, fused_qkv=fused, tied=tied, layer_norm=layer_norm,
                  num_layers=num_layers)


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """The Pax pieces of one paxlite leaf: per layer (a stacked ``layers/`` leaf) or one entry."""

    recipe: Recipe
    pieces: tuple[tuple[tuple[str, int | None], ...], ...]
    stacked: bool
    leaf_shape: tuple[int, ...]  # of one layer for a stacked leaf


def plan_leaves(leaves: Mapping[str, tuple[int, ...]], layout: Layout
                ) -> tuple[dict[str, LeafPlan], list[str]]:
    """({paxlite leaf: plan}, [paxlite leaves Pax has no name for])."""
    top = _top_table(tied=layout.tied, layer_norm=layout.layer_norm)
    per_layer = _layer_table(fused_qkv=layout.fused_qkv, layer_norm=layout.layer_norm)
    plans: dict[str, LeafPlan] = {}
    unknown = []
    for name, shape in leaves.items():
        shape = tuple(shape)
        match = _LAYER.match(name)
        if name.startswith("layers/") or match:
            suffix = name[len("layers/"):] if not match else match.group(2)
            recipe = per_layer.get(suffix)
            if recipe is None:
                unknown.append(name)
                continue
            layers = range(layout.num_layers) if not match else [int(match.group(1))]
            pieces = []
            for i in layers:
                prefix, index = layout.layer_prefix(i)
                pieces.append(tuple((f"{prefix}.{n}", index) for n in recipe.names))
            stacked = not match
            plans[name] = LeafPlan(recipe, tuple(pieces), stacked, shape[1:] if stacked else shape)
        elif name in top:
            recipe = top[name]
            plans[name] = LeafPlan(recipe, (tuple((n, None) for n in recipe.names),), False, shape)
        else:
            unknown.append(name)
    return plans, unknown


def expected_shapes(plans: Mapping[str, LeafPlan], layout: Layout) -> dict[str, tuple[str, tuple]]:
    """{Pax name: (paxlite leaf, the shape the Pax array must have)}."""
    out: dict[str, tuple[str, tuple]] = {}
    for leaf, plan in plans.items():
        per_piece = plan.recipe.pax_shape(plan.leaf_shape)
        for layer in plan.pieces:
            for pax_name, index in layer:
                shape = per_piece if index is None else (layout.num_layers, *per_piece)
                out.setdefault(pax_name, (leaf, shape))
    return out


def check(arrays: Mapping[str, PaxArray], plans: Mapping[str, LeafPlan], layout: Layout
          ) -> list[str]:
    """One line per Pax tensor that is missing or of the wrong shape (none: the plans can run)."""
    problems = []
    for pax_name, (leaf, shape) in expected_shapes(plans, layout).items():
        have = arrays.get(pax_name)
        if have is None:
            problems.append(f"{PARAMS_PREFIX}{pax_name} is missing (expected shape {shape}, for "
                            f"paxlite's {leaf})")
        elif tuple(have.shape) != tuple(shape):
            problems.append(f"{PARAMS_PREFIX}{pax_name} has shape {tuple(have.shape)}, expected "
                            f"{shape} (paxlite's {leaf})")
    return problems


def used_names(plans: Mapping[str, LeafPlan]) -> set[str]:
    return {n for plan in plans.values() for layer in plan.pieces for n, _ in layer}


Bounds = tuple[tuple[int, int], ...]  # (start, stop) per axis of a block of a leaf


class BlockReader:
    """Blocks of paxlite leaves (devices' shards) read from Pax's arrays.

    Each TensorStore read covers only a block's index range of a Pax array, the layer axis
    included: a shard of a repeated [L, ...] array is one read of its rows, never the whole array
    nor one read per layer (Pax chunks by device shard, across all layers, so a per-layer read
    decodes each chunk once per layer). Each array is opened once. ``bytes_read`` counts what the
    reads returned (diagnostics; the tests check it).

    Rows of one repeated array that several unscanned leaves ask for (``layers_<i>`` of a model
    without repeated layers, from ``repeat.sub``) are read together, once, and handed out row by
    row (`expect` says which will be asked for): read one by one, a chunk spanning the layers
    would be decoded once per layer, as the converter's `_Rows` avoids too."""

    def __init__(self, arrays: Mapping[str, PaxArray]) -> None:
        self._arrays = arrays
        self._stores: dict[str, Any] = {}
        self._rows_wanted: dict[str, set[int]] = {}
        self._rows: dict[tuple, tuple[int, np.ndarray, set[int]]] = {}
        self.bytes_read = 0

    def expect(self, plans: Mapping[str, LeafPlan]) -> None:
        """Note the rows of repeated arrays that the unscanned leaves of ``plans`` will ask for."""
        for plan in plans.values():
            if not plan.stacked:
                for name, index in plan.pieces[0]:
                    if index is not None:
                        self._rows_wanted.setdefault(name, set()).add(index)

    def _read_row(self, name: str, row: int, inner: tuple[slice, ...]) -> np.ndarray:
        wanted = self._rows_wanted.get(name, set())
        if len(wanted) < 2 or row not in wanted:
            return self._read(name, (row, *inner))
        key = (name, tuple((s.start, s.stop) for s in inner))
        if key not in self._rows:
            first = min(wanted)
            self._rows[key] = (first, self._read(name, (slice(first, max(wanted) + 1), *inner)),
                               set(wanted))
        first, rows, left = self._rows[key]
        left.discard(row)
        if not left:  # every row handed out: nothing holds the block any more
            del self._rows[key]
        return rows[row - first]

    def _read(self, name: str, index: tuple) -> np.ndarray:
        import tensorstore as ts

        store = self._stores.get(name)
        if store is None:
            spec = {
                "driver": "zarr",
                "kvstore": {"driver": "file", "path": self._arrays[name].path},
            }
            store = ts.open(spec, open=True, read=True).result()
            self._stores[name] = store
        out = np.asarray(store[index].read().result())
        self.bytes_read += out.nbytes
        return out

    def shards(self, plan: LeafPlan, ranges: set[Bounds]) -> dict[Bounds, np.ndarray]:
        """{bounds: block} for this process's distinct device ranges of one leaf.

        When the ranges tile their bounding box (a process's devices hold one contiguous region
        of the leaf: the usual mesh), the box is read once and cut, so a chunk shared by two
        devices is decoded once; otherwise each range is read by itself."""
        if not ranges:  # none of this process's devices holds a part of the leaf
            return {}
        box = tuple((min(r[a][0] for r in ranges), max(r[a][1] for r in ranges))
                    for a in range(len(next(iter(ranges)))))
        volume = lambda bounds: math.prod(stop - start for start, stop in bounds)
        if volume(box) != sum(volume(r) for r in ranges):
            return {r: self.block(plan, tuple(slice(*b) for b in r)) for r in ranges}
        whole = self.block(plan, tuple(slice(*b) for b in box))
        return {r: whole[tuple(slice(b[0] - o[0], b[1] - o[0]) for b, o in zip(r, box))]
                for r in ranges}

    def block(self, plan: LeafPlan, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """The block ``index`` (slices of the paxlite leaf; None: all of it) of one leaf."""
        shape = ((len(plan.pieces), *plan.leaf_shape) if plan.stacked else plan.leaf_shape)
        index = tuple(slice(*s.indices(n)) for s, n in
                      zip((*(index or ()), *[slice(None)] * len(shape))[:len(shape)], shape))
        recipe = plan.recipe
        if not plan.stacked:
            which, inner = recipe.piece_index(index)
            pieces = plan.pieces[0][which]
            return recipe.combine([self._read(n, inner) if i is None
                                   else self._read_row(n, i, inner) for n, i in pieces])
        layers, per_layer = range(len(plan.pieces))[index[0]], index[1:]
        which, inner = recipe.piece_index(per_layer)
        rows = [plan.pieces[i][which] for i in layers]
        names = [n for n, _ in rows[0]] if rows else []
        if rows and all([n for n, _ in row] == names and [i for _, i in row] == [layer] * len(row)
                        for layer, row in zip(layers, rows)):  # repeat.sub: one read of the rows
            span = slice(layers.start, layers.stop, layers.step)
            return recipe.combine([self._read(n, (span, *inner)) for n in names], lead=1)
        return np.stack([recipe.combine([self._read(n, inner if i is None else (i, *inner))
                                         for n, i in row]) for row in rows])


def read_leaf(plan: LeafPlan, arrays: Mapping[str, PaxArray]) -> np.ndarray:
    """One whole paxlite leaf (`BlockReader.block` of all of it)."""
    return BlockReader(arrays).block(plan)


def one_line(step_dir: Any, problems: list[str], *, what: str) -> str:
    more = (f" (and {len(problems) - 1} more: "
            f"{'; '.join(problems[1:4])}{' ...' if len(problems) > 4 else ''})")
    return (f"the Pax checkpoint {step_dir} does not fit {what}: {problems[0]}"
            + (more if len(problems) > 1 else ""))


def plan_writes(leaves: Mapping[str, tuple[int, ...]], *, repeated: bool) -> dict[str, LeafPlan]:
    """Pax's form of unscanned paxlite params of these shapes ({'a/b': shape} of layers_<i>):
    {paxlite leaf: plan}, each piece a Pax name (without ``mdl_vars.params.``) and, under
    ``repeat.sub`` when ``repeated``, its row; fused q/k/v when the model's is fused."""
    tied, layer_norm, num_layers = model_facts(leaves)
    fused = any(n.endswith("attention/qkv/kernel") for n in leaves)
    layout = Layout(repeated=repeated, fused_qkv=fused, tied=tied, layer_norm=layer_norm,
                    num_layers=num_layers)
    plans, unknown = plan_leaves(leaves, layout)
    if unknown:
        raise PaxCheckpointError(f"Pax has no name for paxlite's {', '.join(unknown[:5])}: only "
                                 "GPT and LLaMA models convert to Pax's layout")
    return plans


def to_pax(params: Mapping[str, Any], *, repeated: bool) -> dict[str, np.ndarray]:
    """Unscanned paxlite params (flat {'a/b': array} of layers_<i>) -> {Pax name: array} in Pax's
    form (`plan_writes`), repeated layers stacked."""
    leaves = {n: tuple(np.shape(v)) for n, v in params.items()}
    num_layers = model_facts(leaves)[2]
    plans = plan_writes(leaves, repeated=repeated)
    out: dict[str, np.ndarray] = {}
    per_layer: dict[str, dict[int, np.ndarray]] = {}
    for leaf, plan in plans.items():
        (layer,) = plan.pieces  # unscanned: one entry per leaf
        for (pax_name, index), piece in zip(layer, plan.recipe.split(params[leaf])):
            if index is None:
                out[pax_name] = np.ascontiguousarray(piece)
            else:
                per_layer.setdefault(pax_name, {})[index] = piece
    for pax_name, by_layer in per_layer.items():
        out[pax_name] = np.stack([by_layer[i] for i in range(num_layers)])
    return out
