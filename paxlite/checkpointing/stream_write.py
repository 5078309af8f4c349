"""A paxlite checkpoint written one array at a time, for conversions that must not hold the model.

Orbax saves a whole tree in one call, so a converter using it holds every array at once (2.4x the
float32 model at 1B parameters, docs/performance.md). This writer produces the same checkpoint that
`paxlite.checkpointing.pretrained.save_params` does, in Orbax's non-OCDBT PyTree layout (which
Orbax, and so ``CHECKPOINT_RESTORE_PATH``, reads sharded onto any mesh): one zarr array per leaf,
named by its ``.``-joined path, written with TensorStore as soon as it is made, plus the item's
``_METADATA``, ``_sharding`` and ``array_metadatas`` and the step's ``_CHECKPOINT_METADATA`` /
commit marker. Stacked (``scan_layers``) leaves are chunked one layer per chunk and written layer by
layer. Tests read every written checkpoint back through `restore_params`, so a change in Orbax's
layout fails them rather than users.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from paxlite.checkpointing.checkpoint_damage import FORMAT_KEY, FORMAT_VERSION
from paxlite.compat import ORBAX_STANDARD_HANDLER_TYPESTR

if TYPE_CHECKING:
    from paxlite.models.transformer import TransformerConfig

ITEM = "state"


def _zarr_dtype(dtype: np.dtype) -> str:
    return "bfloat16" if dtype.name == "bfloat16" else dtype.str


class CheckpointWriter:
    """Writes ``<root>/checkpoints/checkpoint_<step>/state`` leaf by leaf; `close` commits it.

    ``root`` is a fresh staging directory (`paxlite.paths.staged_output`), so a killed writer leaves
    no checkpoint a reader would take for complete.
    """

    def __init__(self, root: str, *, step: int = 0) -> None:
        self._step = step
        self.step_dir = os.path.join(root, "checkpoints", f"checkpoint_{step:08d}")
        self._item = os.path.join(self.step_dir, ITEM)
        os.makedirs(self._item)
        self._leaves: dict[tuple[str, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._open: dict[tuple[str, ...], Any] = {}
        self._writing: list[Any] = []  # futures of the writes not yet waited for
        self._issued = 0  # writes waited for
        self._started = time.time_ns()

    def _create(self, path: tuple[str, ...], shape: tuple[int, ...], dtype: np.dtype,
                chunks: tuple[int, ...]) -> Any:
        import tensorstore as ts

        if path in self._leaves:
            raise ValueError(f"checkpoint leaf {'/'.join(path)} written twice (a converter bug)")
        self._leaves[path] = (shape, chunks)
        spec = {
            "driver": "zarr",
            "kvstore": {"driver": "file", "path": os.path.join(self._item, ".".join(path))},
            "metadata": {"shape": list(shape), "chunks": list(chunks), "dtype": _zarr_dtype(dtype),
                         "compressor": {"id": "zstd", "level": 1}, "dimension_separator": ".",
                         "fill_value": None, "order": "C"},
            "create": True,
        }
        return ts.open(spec).result()

    def write(self, path: Sequence[str], array: np.ndarray) -> None:
        """One whole leaf (``params/...``), in chunks of at most CHUNK_BYTES along its first axis
        (TensorStore compresses chunks in parallel; one 250 MB chunk would take one core alone)."""
        array = np.asarray(array)
        store = self._create(tuple(path), tuple(array.shape), array.dtype,
                             _chunks(array.shape, array.dtype.itemsize))
        self._writing.append(store.write(array))

    def write_layer(self, path: Sequence[str], index: int, array: np.ndarray, *,
                    num_layers: int) -> None:
        """Row ``index`` of a stacked [num_layers, ...] leaf; the leaf is made at its first row."""
        key = tuple(path)
        array = np.asarray(array)
        if key not in self._open:
            shape = (num_layers, *array.shape)
            self._open[key] = self._create(key, shape, array.dtype,
                                           (1, *_chunks(array.shape, array.dtype.itemsize)))
        self._writing.append(self._open[key][index].write(array))

    def issued(self) -> int:
        """How many writes were issued so far (a mark for `wait`)."""
        return self._issued + len(self._writing)

    def wait(self, *, upto: int | None = None) -> None:
        """Waits for the writes issued before mark ``upto`` (default: all). TensorStore compresses
        and writes them in parallel; the caller bounds memory by waiting a layer behind."""
        count = len(self._writing) if upto is None else max(0, upto - self._issued)
        done, self._writing = self._writing[:count], self._writing[count:]
        self._issued += len(done)
        for future in done:
            future.result()

    def close(self, *, sharding: str = "cpu:0") -> str:
        """Writes the step leaf and the metadata Orbax reads; returns the step directory."""
        self.write(("step",), np.asarray(self._step, np.int32))
        self.wait()
        self._open.clear()
        tree, shardings, arrays = {}, {}, []
        for path, (shape, chunks) in sorted(self._leaves.items()):
            name = ".".join(path)
            tree[str(path)] = {
                "key_metadata": [{"key": k, "key_type": 2} for k in path],
                "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False,
                                   "write_shape": list(shape)}}
            shardings[base64.urlsafe_b64encode(name.encode()).decode()] = json.dumps(
                {"sharding_type": "SingleDeviceSharding", "device_str": sharding})
            arrays.append({"array_metadata": {"param_name": name, "write_shape": list(shape),
                                              "chunk_shape": list(chunks), "ext_metadata": None}})
        _dump(os.path.join(self._item, "_METADATA"),
              {"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": False,
               "store_array_data_equal_to_fill_value": True, "custom_metadata": None})
        _dump(os.path.join(self._item, "_sharding"), shardings)
        os.makedirs(os.path.join(self._item, "array_metadatas"))
        _dump(os.path.join(self._item, "array_metadatas", "process_0"), {"array_metadatas": arrays})
        _dump(os.path.join(self.step_dir, "_CHECKPOINT_METADATA"),
              {"item_handlers": {ITEM: ORBAX_STANDARD_HANDLER_TYPESTR}, "metrics": {},
               "performance_metrics": {}, "init_timestamp_nsecs": self._started,
               "commit_timestamp_nsecs": time.time_ns(),
               "custom_metadata": {FORMAT_KEY: FORMAT_VERSION}})
        for directory in (self._item, self.step_dir):
            with open(os.path.join(directory, "commit_success.txt"), "w") as f:
                f.write(f"Checkpoint commit was successful to {directory}")
        return self.step_dir


CHUNK_BYTES = 64 * 2**20


def _chunks(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """The whole array, or rows of it, so that a chunk holds at most CHUNK_BYTES."""
    full = tuple(max(1, d) for d in shape)
    if not shape:
        return full
    row = itemsize * int(np.prod(full[1:], dtype=np.int64))
    return (max(1, min(full[0], CHUNK_BYTES // max(1, row))), *full[1:])


def _dump(path: str, content: Any) -> None:
    with open(path, "w") as f:
        json.dump(content, f)


def write_subtrees(subtrees: Iterable[tuple[str, Any]], out_dir: str | os.PathLike, *,
                   config: TransformerConfig, step: int = 0) -> str:
    """Writes the unscanned top-level subtrees (``embedding``, ``layers_<i>``, ...) of any source
    as a paxlite checkpoint (stacked layers when ``config.scan_layers``) with its
    ``model_config.json``, holding about three subtrees at a time; returns the step directory.
    The caller checks names and shapes first (e.g. on stand-ins): a failure here leaves only the
    staging directory, which the next run replaces."""
    import jax
    import ml_dtypes

    from paxlite.checkpointing.pretrained import MODEL_CONFIG_FILE, model_config_to_json
    from paxlite.paths import staged_output

    target = np.dtype(ml_dtypes.bfloat16 if config.param_dtype == "bfloat16" else np.float32)
    with staged_output(os.fspath(out_dir), setting="output directory") as staging:
        writer = CheckpointWriter(staging, step=step)
        marks = [0, 0]  # write counts before the last two subtrees
        for top, subtree in subtrees:
            marks = [marks[1], writer.issued()]
            leaves = jax.tree_util.tree_flatten_with_path(subtree)[0]
            for key_path, leaf in leaves:
                keys = tuple(str(k.key) for k in key_path)
                array = np.asarray(leaf).astype(target, copy=False)
                if config.scan_layers and top.startswith("layers_"):
                    # scan units of k > 1 layers (MoE, attention patterns): layers/layer_{i % k}
                    index, unit = int(top.removeprefix("layers_")), config.layers_per_scan_unit
                    writer.write_layer(
                        ("params", "layers", *([f"layer_{index % unit}"] if unit > 1 else []),
                         *keys),
                        index // unit,
                        array,
                        num_layers=config.num_layers // unit,
                    )
                else:
                    writer.write(("params", top, *keys), array)
            del subtree, leaves, leaf
            # A layer's writes run while the next two are read and cast: three layers in memory.
            writer.wait(upto=marks[0])
        writer.close()
        with open(os.path.join(staging, MODEL_CONFIG_FILE), "w") as f:
            f.write(model_config_to_json(config))
    step_dir = os.path.relpath(writer.step_dir, staging)
    return os.path.join(os.path.abspath(os.fspath(out_dir)), step_dir)
