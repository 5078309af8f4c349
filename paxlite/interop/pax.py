"""Pax's own checkpoints <-> paxlite (``python -m paxlite convert --from=pax`` / ``--to=pax``).

Reads what Pax wrote (a trained GPT, with or without repeated layers) and what saxml's
``convert_llama_ckpt.py`` wrote (LLaMA, fused ``combined_qkv`` or separate ``query/key/value``), in
Pax's per-array TensorStore layout (docs/interop.md, "Pax checkpoints"), into the parameters of the
experiment named by ``--fdl_config``: Pax's files do not say which model they hold, the experiment
does. The name table and the array reader are `paxlite.checkpointing.pax_layout`'s, shared with
``CHECKPOINT_RESTORE_PATH`` (which reads these checkpoints directly); this module adds the
converter's strictness (a Pax tensor the model does not use is an error, not a warning) and the
writer.

Written back (``--to=pax``): ``<DIR>/checkpoints/checkpoint_00000000/`` with ``state/step`` (a
scalar) and one zarr array per parameter under ``state/mdl_vars.params.<name>`` (the experiment's
repeated layers under ``repeat.sub``), ``metadata/metadata`` (Pax's checkpoint version 1.1 and the
arrays' shapes, `pax_metadata`) and ``commit_success.txt``: the layout saxml's converter writes
(through Pax's own ``save_checkpoint``), which Pax restores with ``CHECKPOINT_RESTORE_PATH=<DIR>``.
No optimizer state (saxml writes none either).

The converter holds about one layer, both ways: `open_pax` checks every name and shape first (one
error, before the output directory exists), then `write_paxlite` / `write_hf` make the model one
top-level subtree at a time from Pax's arrays (row ``i`` of a repeated array for layer ``i``);
`stream_paxlite_to_pax` reads a paxlite checkpoint a layer at a time and writes each Pax array as
it is made, a repeated one row by row into an array chunked one layer per chunk. `load` and `save`
hold the whole model (for other sources and targets, and as the tests' reference).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from paxlite.checkpointing import pax_layout
from paxlite.interop import layouts
from paxlite.interop.errors import ConversionError
from paxlite.interop.hf import Pretrained, cast_params
from paxlite.interop.hf_config import UnsupportedCheckpointError, family_of_config
from paxlite.interop.hf_write import numpy_dtype
from paxlite.models.transformer import RematPolicy, TransformerConfig
from paxlite.paths import staged_output

COMMIT_FILE = "commit_success.txt"
METADATA_ITEM = "metadata"  # checkpoint_<STEP>/metadata/metadata: Pax's version file (pax_metadata)
PAX_VERSION = 1.1  # paxml/checkpoint_version.py: per-array TensorStore layout, without OCDBT
_CHUNK_BYTES = 256 * 2**20  # one zarr chunk at most: big embeddings split along their first axis


# ---------------------------------------------------------------- reading Pax
@dataclasses.dataclass(frozen=True, kw_only=True)
class PaxSource:
    """A Pax checkpoint checked against an experiment's model (`open_pax`; nothing read yet), whose
    params are made from Pax's arrays one top-level subtree (``embedding``, ``layers_<i>``, ...) at
    a time."""

    step_dir: str
    config: TransformerConfig  # the experiment's model, unscanned, params in the conversion's dtype
    plans: Mapping[str, pax_layout.LeafPlan]  # unscanned paxlite leaf -> its Pax pieces
    arrays: Mapping[str, pax_layout.PaxArray]

    @property
    def num_params(self) -> int:
        return sum(math.prod(plan.leaf_shape) for plan in self.plans.values())

    def params(self, *, scratch_dir: str | None = None) -> Mapping[str, Any]:
        """The unscanned params, each top-level subtree read on ``[]``. With ``scratch_dir``, a
        repeated array chunked across layers is first copied there one layer per chunk (`_Rows`);
        without it each of its rows costs a read of the whole chunk."""
        return _PaxParams(self, _Rows(self.arrays, scratch_dir=scratch_dir))

    def subtrees(self, *, scratch_dir: str | None = None) -> Iterator[tuple[str, Any]]:
        """(top, subtree) in the model's order, each read when the previous one is done with."""
        params = self.params(scratch_dir=scratch_dir)
        for top in params:
            yield top, params[top]

    def stand_ins(self) -> dict[str, Any]:
        """The params tree as zero-stride float32 arrays of the right shapes (nothing read)."""
        return _unflatten({name: _stand_in(plan.leaf_shape) for name, plan in self.plans.items()})


def open_pax(path: str | os.PathLike, *, config: TransformerConfig, experiment: str,
             dtype: str = "float32") -> PaxSource:
    """The Pax checkpoint ``path`` designates as ``config``'s parameters (unscanned): every tensor
    the model needs present with its shape and none left over, else one error naming them; only
    the arrays' metadata is read."""
    from flax import linen as nn

    from paxlite.checkpointing.pretrained import find_checkpoint
    from paxlite.models.transformer import abstract_variables

    _, step_dir = find_checkpoint(path)
    if not pax_layout.is_pax_step(step_dir):
        raise ConversionError(
            f"{step_dir} is not a Pax checkpoint (no {pax_layout.STATE}/"
            f"{pax_layout.PARAMS_PREFIX}* arrays); a paxlite checkpoint converts with "
            "--from=paxlite")
    config = dataclasses.replace(config, scan_layers=False, remat_policy=RematPolicy.NONE,
                                 dtype=dtype, param_dtype=dtype)
    leaves = {name: tuple(leaf.shape) for name, leaf in layouts.flatten(
        nn.meta.unbox(abstract_variables(config)["params"])).items()}
    arrays = pax_layout.pax_arrays(step_dir)
    layout = pax_layout.read_layout(leaves, arrays)
    plans, unknown = pax_layout.plan_leaves(leaves, layout)
    problems = [f"paxlite's {name} has no Pax name (only GPT and LLaMA models read Pax's layout)"
                for name in unknown]
    problems += pax_layout.check(arrays, plans, layout)
    used = pax_layout.used_names(plans)
    problems += [f"{pax_layout.PARAMS_PREFIX}{name} {arrays[name].shape} is not a parameter of "
                 "this model" for name in sorted(set(arrays) - used)]
    if problems:
        raise ConversionError(pax_layout.one_line(step_dir, problems,
                                                  what=f"{experiment}'s model"))
    return PaxSource(step_dir=os.fspath(step_dir), config=config, plans=plans, arrays=arrays)


def load(path: str | os.PathLike, *, config: TransformerConfig, experiment: str,
         dtype: str = "float32") -> Pretrained:
    """The Pax checkpoint ``path`` designates as ``config``'s parameters (unscanned), read whole
    (the converter streams instead: `open_pax`, `write_paxlite`)."""
    source = open_pax(path, config=config, experiment=experiment, dtype=dtype)
    flat = {leaf: pax_layout.read_leaf(plan, source.arrays) for leaf, plan in source.plans.items()}
    params = cast_params(_unflatten(flat), dtype)
    layouts.check_params(params, config=source.config)
    return Pretrained(config=source.config, params=params, family=family_of_config(source.config))


class _Rows:
    """Pax arrays read whole, or a repeated one a row (one layer) at a time.

    A row read costs the whole chunk holding it, and Pax chunks by device shard, which spans the
    layer axis: read layer by layer, such an array would be decoded once per layer. So on its first
    row read it is copied into ``scratch_dir`` chunk by chunk (one chunk of the source in memory,
    twice while TensorStore decodes it) as an uncompressed array chunked one layer per chunk, and
    its rows are read from the copy."""

    def __init__(self, arrays: Mapping[str, pax_layout.PaxArray], *, scratch_dir: str | None):
        self._arrays = arrays
        self._scratch_dir = scratch_dir
        self._per_layer: dict[str, pax_layout.PaxArray] = {}

    def read(self, name: str, index: int | None) -> np.ndarray:
        array = self._arrays[name]
        if index is None or self._scratch_dir is None:
            return array.read(index)
        if name not in self._per_layer:
            self._per_layer[name] = self._copy_per_layer(array)
        return self._per_layer[name].read(index)

    def _copy_per_layer(self, array: pax_layout.PaxArray) -> pax_layout.PaxArray:
        import tensorstore as ts

        assert self._scratch_dir is not None
        source = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": array.path}},
                         open=True, read=True).result()
        chunk = tuple(source.chunk_layout.read_chunk.shape)
        if chunk[0] <= 1:
            return array
        path = os.path.join(self._scratch_dir, os.path.basename(array.path))
        dtype = np.dtype(source.dtype.numpy_dtype)
        # Chunked as the source but one layer deep: each block copied fills whole chunks (a partial
        # chunk write would hold every chunk it touches, i.e. all layers, in memory).
        copy = _create(path, array.shape, dtype, chunks=[1, *chunk[1:]])
        for block in itertools.product(*(
                [slice(start, min(start + step, size)) for start in range(0, size, step)]
                for size, step in zip(array.shape, chunk))):
            copy[block].write(source[block].read().result()).result()
        return pax_layout.PaxArray(path, array.shape)


class _PaxParams(Mapping):
    """`PaxSource.params`: top-level name -> that subtree, made from Pax's arrays on ``[]`` and cast
    to the source's dtype (what `load` does for the whole tree)."""

    def __init__(self, source: PaxSource, rows: _Rows) -> None:
        self._rows = rows
        self._dtype = numpy_dtype(source.config.param_dtype)
        self._tops: dict[str, dict[str, pax_layout.LeafPlan]] = {}
        for name, plan in source.plans.items():
            top, rest = name.split("/", 1)
            self._tops.setdefault(top, {})[rest] = plan

    def __getitem__(self, top: str) -> dict[str, Any]:
        flat = {}
        for name, plan in self._tops[top].items():
            (layer,) = plan.pieces  # unscanned: one entry per leaf
            pieces = [self._rows.read(pax_name, index) for pax_name, index in layer]
            flat[name] = plan.recipe.combine(pieces).astype(self._dtype, copy=False)
        return _unflatten(flat)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tops)

    def __len__(self) -> int:
        return len(self._tops)


def _stand_in(shape: tuple[int, ...]) -> np.ndarray:
    return np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape, (0,) * len(shape))


@contextlib.contextmanager
def _scratch_beside(out_dir: str | os.PathLike) -> Iterator[str]:
    """A hidden directory beside the output for per-layer copies, removed afterwards."""
    directory = os.path.abspath(os.fspath(out_dir))
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}.rechunk-",
                               dir=os.path.dirname(directory))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_paxlite(source: PaxSource, out_dir: str | os.PathLike, *,
                  config: TransformerConfig) -> int:
    """The paxlite checkpoint of ``source`` as `hf.to_paxlite` writes `load`'s model (``config``:
    the experiment's, scanned or not, params in the source's dtype), made and written one layer at
    a time; returns #parameters."""
    from paxlite.interop.stream import write_subtrees

    with _scratch_beside(out_dir) as scratch:
        write_subtrees(source.subtrees(scratch_dir=scratch), out_dir, config=config)
    return source.num_params


def write_hf(source: PaxSource, out_dir: str | os.PathLike, **options: Any) -> int:
    """`hf.save` of `load`'s model, one layer at a time (`hf.write_hf`; ``options`` as its);
    returns #parameters."""
    from paxlite.interop import hf

    with _scratch_beside(out_dir) as scratch:
        hf.write_hf(source.params(scratch_dir=scratch), out_dir, config=source.config,
                    stand_ins=source.stand_ins(), dtype=source.config.param_dtype, **options)
    return source.num_params


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in flat.items():
        node = out
        *parents, last = name.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return out


# ---------------------------------------------------------------- writing Pax
def _chunks(shape: tuple[int, ...], dtype: np.dtype) -> list[int]:
    """The whole array, or rows of it so that a chunk holds at most _CHUNK_BYTES."""
    chunks = list(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if chunks and nbytes > _CHUNK_BYTES:
        row = max(1, nbytes // max(1, shape[0]))
        chunks[0] = max(1, _CHUNK_BYTES // row)
    return chunks


def _layer_chunks(shape: tuple[int, ...], dtype: np.dtype) -> list[int]:
    """One layer (row) of a repeated [L, ...] array per chunk, split as `_chunks` splits arrays."""
    return [1, *_chunks(tuple(shape[1:]), dtype)]


def _create(path: str, shape: tuple[int, ...], dtype: np.dtype, *, chunks: list[int]) -> Any:
    import tensorstore as ts

    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": path},
            "metadata": {"shape": list(shape), "chunks": chunks,
                         "dtype": "bfloat16" if dtype.name == "bfloat16" else dtype.str,
                         "compressor": None}}
    return ts.open(spec, create=True, open=False).result()


def _write_array(path: str, array: np.ndarray) -> None:
    array = np.asarray(array, order="C")  # not ascontiguousarray: it makes a scalar [1]
    store = _create(path, array.shape, array.dtype, chunks=_chunks(array.shape, array.dtype))
    store.write(array).result()


def save(pretrained: Pretrained, out_dir: str | os.PathLike, *, repeated: bool,
         dtype: str = "float32", step: int = 0) -> str:
    """Writes Pax's layout (module docstring) of a model held whole; returns the step directory.
    `stream_paxlite_to_pax` writes the same from a paxlite checkpoint, a layer at a time."""
    tensors = pax_layout.to_pax(layouts.flatten(cast_params(pretrained.params, dtype)),
                                repeated=repeated)
    with _pax_step(out_dir, step=step) as state:
        for pax_name, array in tensors.items():
            _write_array(os.path.join(state, pax_layout.PARAMS_PREFIX + pax_name), array)
    return os.path.join(
        os.path.abspath(os.fspath(out_dir)), "checkpoints", f"checkpoint_{step:08d}"
    )


def pax_metadata(state: str | os.PathLike) -> dict[str, Any]:
    """The JSON of ``checkpoint_<STEP>/metadata/metadata`` for the arrays written in ``state``.

    Pax 1.4.0 (paxml/checkpoint_managers.py, ``_get_checkpoint_version``) reads the checkpoint's
    version from this file and, without it, takes the step directory for a pre-1.0 layout and
    fails to find ``state/step``; version 1.1 is its per-array TensorStore layout (1.2 is OCDBT).
    ``train_state_metadata`` is what its ``PaxMetadata.from_dict`` parses: ``mdl_vars.params``
    nested by the names' ``.`` parts, each array tagged with its shape and dtype (Pax compares
    them with the model's when it restores with unpadded shapes)."""
    tree: dict[str, Any] = {}
    for child in sorted(os.listdir(state)):
        if not child.startswith(pax_layout.PARAMS_PREFIX):
            continue
        with open(os.path.join(state, child, ".zarray")) as f:
            zarray = json.load(f)
        dtype = zarray["dtype"] if zarray["dtype"] == "bfloat16" else np.dtype(zarray["dtype"]).name
        *parents, last = child.split(".")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = {"_array_metadata_tag": True, "is_optax_masked_node": False,
                      "unpadded_shape": list(zarray["shape"]), "dtype": dtype}
    return {"version": PAX_VERSION, "train_state_metadata": tree}


@contextlib.contextmanager
def _pax_step(out_dir: str | os.PathLike, *, step: int) -> Iterator[str]:
    """The ``state`` directory to write the arrays into; ``step`` (a scalar, as Pax restores it),
    the ``metadata`` item and the commit file around it."""
    with staged_output(out_dir, setting="--output") as staging:
        step_dir = os.path.join(staging, "checkpoints", f"checkpoint_{step:08d}")
        state = os.path.join(step_dir, pax_layout.STATE)
        os.makedirs(state)
        _write_array(os.path.join(state, "step"), np.asarray(step, np.int32))
        yield state
        os.makedirs(os.path.join(step_dir, METADATA_ITEM))
        with open(os.path.join(step_dir, METADATA_ITEM, METADATA_ITEM), "w") as f:
            json.dump(pax_metadata(state), f)
        with open(os.path.join(step_dir, COMMIT_FILE), "w") as f:
            f.write(f"Checkpoint commit was successful to {os.path.abspath(os.fspath(out_dir))}\n")


class _PaxWriter:
    """Pax arrays written into ``state`` as they are made: whole, or (``repeat.sub``) a row at a
    time into an [L, ...] array created at its first row with one chunk per layer. TensorStore
    writes them in its own threads; `end_layer` waits for the layer before, so that one layer is
    written while the next is read."""

    def __init__(self, state: str, *, num_layers: int) -> None:
        self._state = state
        self._num_layers = num_layers
        self._stacks: dict[str, Any] = {}
        self._writing: list[Any] = []  # futures of the current layer's writes
        self._previous: list[Any] = []  # of the layer before

    def put(self, name: str, index: int | None, array: np.ndarray) -> None:
        path = os.path.join(self._state, pax_layout.PARAMS_PREFIX + name)
        array = np.ascontiguousarray(array)
        if index is None:
            store = _create(path, array.shape, array.dtype,
                            chunks=_chunks(array.shape, array.dtype))
            self._writing.append(store.write(array))
            return
        if name not in self._stacks:
            shape = (self._num_layers, *array.shape)
            self._stacks[name] = _create(path, shape, array.dtype,
                                         chunks=_layer_chunks(shape, array.dtype))
        self._writing.append(self._stacks[name][index].write(array))

    def end_layer(self) -> None:
        """Waits for the writes of the layer before this one (two layers in memory at most)."""
        for future in self._previous:
            future.result()
        self._previous, self._writing = self._writing, []

    def close(self) -> None:
        self.end_layer()
        self.end_layer()


def stream_paxlite_to_pax(path: str | os.PathLike, out_dir: str | os.PathLike, *,
                          config: TransformerConfig, repeated: bool, dtype: str = "float32",
                          step: int = 0) -> int:
    """`save` of the paxlite checkpoint at ``path`` (``config``: its model), read one layer at a
    time (`stream_read.CheckpointReader`) and each Pax array written as it is made; names and shapes
    are checked before ``out_dir`` is made. Returns #parameters."""
    from paxlite.checkpointing.pretrained import find_checkpoint
    from paxlite.checkpointing.stream_read import CheckpointReader, LayerParams

    _, step_dir = find_checkpoint(path)
    target = numpy_dtype(dtype)
    reader = CheckpointReader(step_dir)  # names and shapes first: nothing made if they do not fit
    lora = ["/".join(p) for p in reader.leaves if "lora" in "/".join(p).lower()]
    if lora:
        raise UnsupportedCheckpointError(
            f"{step_dir} holds LoRA parameters ({', '.join(lora[:4])}"
            f"{', ...' if len(lora) > 4 else ''}); fold the adapters into the base weights "
            f"first: python -m paxlite export_merged --input={step_dir} --output=MERGED_DIR, "
            "then convert MERGED_DIR")
    stand_ins = LayerParams(reader, stand_ins=True).shapes()
    layouts.check_params(stand_ins, config=dataclasses.replace(config, scan_layers=False))
    leaves = {name: np.shape(leaf) for name, leaf in layouts.flatten(stand_ins).items()}
    plans = pax_layout.plan_writes(leaves, repeated=repeated)
    with _scratch_beside(out_dir) as scratch:
        params = LayerParams(CheckpointReader(step_dir, scratch_dir=scratch))
        with _pax_step(out_dir, step=step) as state:
            writer = _PaxWriter(state, num_layers=pax_layout.model_facts(leaves)[2])
            for top in params:
                for name, leaf in layouts.flatten(params[top], f"{top}/").items():
                    plan = plans[name]
                    (layer,) = plan.pieces
                    leaf = np.asarray(leaf).astype(target, copy=False)
                    for (pax_name, index), piece in zip(layer, plan.recipe.split(leaf)):
                        writer.put(pax_name, index, piece)
                writer.end_layer()
            writer.close()
    return layouts.count(stand_ins)
