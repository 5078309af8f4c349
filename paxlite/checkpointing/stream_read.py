"""A paxlite checkpoint's parameters read one layer at a time, for conversions that must not hold
the model (`python -m paxlite convert --from=paxlite`, ``export_merged``).

Orbax restores a tree in one call, so a converter built on it holds every array at once (1.7x the
float32 model for paxlite -> HF at 1B parameters, docs/performance.md). This reader opens each
saved array with TensorStore, in whichever layout Orbax wrote it (OCDBT or one directory per array;
zarr v2 or v3, as the item's ``_METADATA`` says), and reads one leaf, or one layer's row of a
stacked (``scan_layers``) leaf, when asked.

A row of a stacked leaf is cheap to read only if the leaf is chunked one layer per chunk, as
converters write it (`stream_write.CheckpointWriter`). A training checkpoint's chunks are its
device shards, which span every layer: reading such a row decodes the whole leaf, so reading layer
by layer would decode every leaf once per layer. Such a leaf is therefore copied once, on its first
read, into a scratch array chunked per layer (uncompressed); the peak is then that one leaf, the
largest being about a quarter of a LLaMA model.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from paxlite.checkpointing.pretrained import PretrainedCheckpointError

ITEM = "state"
_LAYER = re.compile(r"^layers_(\d+)$")
_UNIT_LAYER = re.compile(r"^layer_\d+$")  # a scan unit's k > 1 layers (models/block.py BlockUnit)
LayerPath = tuple[str, ...]


class CheckpointReader:
    """The ``params`` of a paxlite step directory, leaf by leaf. ``scratch_dir`` (the caller's,
    which it removes after use) holds the per-layer copies of leaves whose chunks span layers."""

    def __init__(self, step_dir: str | os.PathLike, *, scratch_dir: str | None = None) -> None:
        self._state = os.path.join(os.path.abspath(os.fspath(step_dir)), ITEM)
        path = os.path.join(self._state, "_METADATA")
        try:
            with open(path) as f:
                metadata = json.load(f)
        except (OSError, ValueError) as error:
            raise PretrainedCheckpointError(
                f"{path} cannot be read ({type(error).__name__}: {error}): not a paxlite (Orbax) "
                "checkpoint, or a damaged one") from None
        self._ocdbt = bool(metadata.get("use_ocdbt", False))
        self._zarr3 = bool(metadata.get("use_zarr3", False))
        # {path under params: Orbax's '.'-joined array name, e.g. params.layers.mlp.wi.kernel}
        self.leaves: dict[LayerPath, str] = {}
        for entry in metadata["tree_metadata"].values():
            keys = tuple(str(k["key"]) for k in entry["key_metadata"])
            if keys[0] == "params" and len(keys) >= 2:
                self.leaves[keys[1:]] = ".".join(keys)
        self._shapes: dict[LayerPath, tuple[int, ...]] = {}
        if not self.leaves:
            raise PretrainedCheckpointError(f"{self._state} holds no params")
        self._scratch_dir = scratch_dir
        self._copies: dict[LayerPath, str] = {}

    # ------------------------------------------------------------ TensorStore
    def _spec(self, name: str) -> dict[str, Any]:
        if self._ocdbt:
            kvstore = {"driver": "ocdbt", "base": f"file://{self._state}/", "path": name}
        else:
            kvstore = {"driver": "file", "path": os.path.join(self._state, name)}
        return {"driver": "zarr3" if self._zarr3 else "zarr", "kvstore": kvstore}

    def _open(self, path: LayerPath) -> Any:
        import tensorstore as ts

        if path in self._copies:
            return ts.open({"driver": "zarr", "kvstore": {"driver": "file",
                                                          "path": self._copies[path]}},
                           open=True, read=True).result()
        try:
            return ts.open(self._spec(self.leaves[path]), open=True, read=True).result()
        except ValueError as error:  # TensorStore reports a missing or damaged array so
            raise PretrainedCheckpointError(
                f"{self._state}: params/{'/'.join(path)} cannot be read "
                f"({str(error).splitlines()[0][:300]}): the checkpoint is damaged or incomplete"
            ) from None

    def shape(self, path: LayerPath) -> tuple[int, ...]:
        """The global shape of ``params/<path>`` (the metadata's write shape is one shard's)."""
        if path not in self._shapes:
            self._shapes[path] = tuple(self._open(path).shape)
        return self._shapes[path]

    def read(self, path: LayerPath, index: int | None = None) -> np.ndarray:
        """Leaf ``params/<path>``, or row ``index`` of it (one layer of a stacked leaf)."""
        store = self._open(path)
        if index is not None and store.chunk_layout.read_chunk.shape[0] > 1 and (
                path not in self._copies):
            store = self._copy_per_layer(path, store)
        return np.asarray((store if index is None else store[index]).read().result())

    def _copy_per_layer(self, path: LayerPath, store: Any) -> Any:
        import tensorstore as ts

        if self._scratch_dir is None:
            raise ValueError(f"params/{'/'.join(path)} is chunked across layers; reading it layer "
                             "by layer needs a scratch directory (a converter bug)")
        target = os.path.join(self._scratch_dir, ".".join(path))
        whole = store.read().result()  # the one leaf in memory
        spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": target},
                "metadata": {"shape": list(whole.shape), "chunks": [1, *whole.shape[1:]],
                             "dtype": "bfloat16" if whole.dtype.name == "bfloat16"
                             else whole.dtype.str, "compressor": None}}
        copy = ts.open(spec, create=True, open=False).result()
        copy.write(whole).result()
        del whole
        self._copies[path] = target
        return copy

    # ------------------------------------------------------------ the model's view
    @property
    def scanned(self) -> bool:
        return any(path[0] == "layers" for path in self.leaves)

    @property
    def unit(self) -> int:
        """Layers per stacked scan unit: k where the units hold ``layers/layer_{j}``, else 1."""
        inner = {path[1] for path in self.leaves if path[0] == "layers" and len(path) > 2}
        if inner and all(_UNIT_LAYER.match(name) for name in inner):
            return len(inner)
        return 1

    def tops(self) -> list[str]:
        """Top-level names of the unscanned tree: ``embedding``, ``layers_0``, ... in model
        order."""
        names = sorted({path[0] for path in self.leaves if path[0] != "layers"})
        if self.scanned:
            num = next(self.shape(p)[0] for p in self.leaves if p[0] == "layers")
            names += [f"layers_{i}" for i in range(num * self.unit)]
        return names

    def subtree(self, top: str, *, stand_ins: bool = False) -> dict[str, Any]:
        """The unscanned subtree ``top`` as NumPy arrays (read now), or zero-stride float32
        stand-ins of the right shapes (nothing read)."""
        match = _LAYER.match(top)
        stacked = match is not None and self.scanned
        prefix: tuple[str, ...] = ("layers",) if stacked else (top,)
        index = None
        if stacked:
            index, unit = divmod(int(match.group(1)), self.unit)
            if self.unit > 1:
                prefix += (f"layer_{unit}",)
        out: dict[str, Any] = {}
        for path in self.leaves:
            if path[:len(prefix)] != prefix:
                continue
            if stand_ins:
                shape = self.shape(path)[1:] if stacked else self.shape(path)
                value = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape,
                                                        (0,) * len(shape))
            else:
                value = self.read(path, index)
            node = out
            for key in path[len(prefix):-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = value
        if not out:
            raise KeyError(top)
        return out


class LayerParams(Mapping):
    """An unscanned params tree read on access, one top-level subtree per ``[]``: what the HF
    tensor iterators (`layouts.iter_llama_tensors`) walk, holding one layer at a time."""

    def __init__(self, reader: CheckpointReader, *, stand_ins: bool = False) -> None:
        self._reader = reader
        self._tops = reader.tops()
        self._stand_ins = stand_ins

    def __getitem__(self, top: str) -> dict[str, Any]:
        if top not in self._tops:
            raise KeyError(top)
        return self._reader.subtree(top, stand_ins=self._stand_ins)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tops)

    def __len__(self) -> int:
        return len(self._tops)

    def shapes(self) -> dict[str, Any]:
        """The whole tree as zero-stride stand-ins (for `layouts.check_params`)."""
        return {top: self._reader.subtree(top, stand_ins=True) for top in self._tops}
