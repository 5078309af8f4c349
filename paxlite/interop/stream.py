"""Hugging Face -> paxlite without holding the model: safetensors read lazily, one tensor at a
time, and the paxlite checkpoint written one layer at a time (`paxlite.checkpointing.stream_write`).

A conversion first walks the whole layout on zero-memory stand-ins of the tensors (right shapes,
zero strides), so a missing, left-over or misshapen tensor is reported before the output directory
is made; then it reads, casts and writes each layer and drops it. Peak host memory is about three
layers plus the largest single tensor (docs/performance.md, "Checkpoint conversion").
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from paxlite.checkpointing.stream_write import write_subtrees
from paxlite.errors import NotFoundError
from paxlite.interop import gpt2_layout, gpt_oss_layout, hf_deepseek, hf_gemma, hf_llama4, layouts
from paxlite.interop.errors import ConversionError
from paxlite.interop.hf_config import Family, from_hf_config
from paxlite.models.transformer import TransformerConfig

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# safetensors dtypes a float32 / bfloat16 paxlite model holds (F16 and F64 convert; integers and
# FP8 are quantized weights, which need their scales: not a plain cast).
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
# ...except MXFP4's blocks and scales (bytes; gpt-oss's experts), which its layout dequantises
# (gpt_oss_layout.py): read as uint8 under these name endings only.
MXFP4_SUFFIXES = ("_blocks", "_scales")


class LazySafetensors(Mapping):
    """name -> np.ndarray of an HF directory's safetensors (one file or an index and its shards),
    each read from disk on ``[]``. Opening checks every file named exists and has a complete
    header and that the index and the shards agree, so bad input fails before anything is read."""

    def __init__(self, directory: str) -> None:
        from safetensors import SafetensorError, safe_open

        self._directory = directory
        if os.path.exists(os.path.join(directory, SINGLE)):
            files = [SINGLE]
            weight_map = None
        else:
            with open(os.path.join(directory, INDEX)) as f:
                try:
                    weight_map = json.load(f)["weight_map"]
                except (ValueError, KeyError, TypeError) as e:
                    raise ConversionError(f"{directory}/{INDEX} is not a safetensors index "
                                          f"(no weight_map: {e})") from None
            files = sorted(set(weight_map.values()))
            absent = [name for name in files if not os.path.exists(os.path.join(directory, name))]
            if absent:
                raise ConversionError(
                    f"{directory}/{INDEX} names {len(absent)} shard(s) that are not in "
                    f"{directory}: {', '.join(absent[:4])}{' ...' if len(absent) > 4 else ''} "
                    f"({len(files) - len(absent)} of {len(files)} present); finish the download")
        self._handles: dict[str, Any] = {}
        self._layout: dict[str, tuple[int, dict[str, Any]]] = {}  # file -> (data start, header)
        self._where: dict[str, str] = {}
        for name in files:
            path = os.path.join(directory, name)
            try:
                handle = safe_open(path, framework="np")
            except SafetensorError as e:
                raise ConversionError(f"{path} is not a complete safetensors file ({e}); it is "
                                      "probably truncated: download it again") from None
            self._handles[name] = handle
            self._layout[name] = _read_header(path)
            for tensor in handle.keys():  # noqa: SIM118  safe_open is not iterable
                stored = handle.get_slice(tensor).get_dtype()
                if stored not in FLOAT_DTYPES and not (stored == "U8"
                                                       and tensor.endswith(MXFP4_SUFFIXES)):
                    raise ConversionError(
                        f"{path}: tensor {tensor} is stored as {stored}; paxlite converts float "
                        f"weights only ({', '.join(FLOAT_DTYPES)}): a quantized checkpoint (int8, "
                        "FP8, GPTQ/AWQ) needs its scales applied first: convert the unquantized "
                        "model")
                if tensor in self._where:
                    raise layouts.LayoutError(f"{directory}: tensor {tensor} is in two shards "
                                              f"({self._where[tensor]} and {name})")
                self._where[tensor] = name
        if weight_map is not None:
            wrong = [t for t, f in weight_map.items() if self._where.get(t) != f]
            if wrong:
                t = wrong[0]
                raise ConversionError(
                    f"{directory}/{INDEX} places {len(wrong)} tensor(s) where they are not, e.g. "
                    f"{t} in {weight_map[t]} (found in: {self._where.get(t, 'no shard')})")

    def __getitem__(self, name: str) -> np.ndarray:
        # A plain read at the header's offsets, not safe_open's get_tensor: that one reads through
        # a memory map, whose touched pages stay resident (and count in this process's RSS) for as
        # long as the file is open, i.e. the whole input by the end of a conversion.
        file = self._where[name]
        entry = self._layout[file][1][name]
        begin, end = entry["data_offsets"]
        buffer = np.empty(end - begin, np.uint8)
        with open(os.path.join(self._directory, file), "rb") as f:
            f.seek(self._layout[file][0] + begin)
            if f.readinto(buffer) != end - begin:
                raise ConversionError(f"{self._directory}/{file}: tensor {name} is cut short "
                                      "(the file is truncated)")
        return buffer.view(_numpy_dtype(entry["dtype"])).reshape(entry["shape"])

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def stand_ins(self) -> Mapping[str, np.ndarray]:
        """The same names as zero-stride float32 arrays of the right shapes (no memory, no
        reads)."""
        return _StandIns(self)


def _numpy_dtype(code: str) -> np.dtype:
    """The NumPy dtype of a safetensors dtype code of FLOAT_DTYPES (little-endian on disk)."""
    import ml_dtypes

    return {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8"),
            "BF16": np.dtype(ml_dtypes.bfloat16), "U8": np.dtype(np.uint8)}[code]


def _read_header(path: str) -> tuple[int, dict[str, Any]]:
    """(offset of the data, the JSON header) of a safetensors file (already checked by
    safe_open)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return 8 + size, json.loads(f.read(size))


class _StandIns(Mapping):
    def __init__(self, source: LazySafetensors) -> None:
        self._source = source

    def __getitem__(self, name: str) -> np.ndarray:
        shape = self._source.shape(name)
        return np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape, (0,) * len(shape))

    def __iter__(self) -> Iterator[str]:
        return iter(self._source)

    def __len__(self) -> int:
        return len(self._source)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HfSource:
    """An opened HF directory: its family and converted config; tensors are read when written."""

    directory: str
    family: Family
    config: TransformerConfig
    tensors: Mapping[str, np.ndarray]

    def subtrees(self, tensors: Mapping[str, np.ndarray] | None = None,
                 *, config: TransformerConfig | None = None) -> Iterator[tuple[str, Any]]:
        tensors = self.tensors if tensors is None else tensors
        config = dataclasses.replace(config or self.config, scan_layers=False)
        if self.family is Family.GPT2:
            return gpt2_layout.iter_gpt2_params(tensors, config=config)
        if self.family.value in hf_deepseek.MODEL_TYPES:
            return hf_deepseek.iter_deepseek_params(tensors, config=config)
        if self.family is Family.LLAMA4_TEXT:
            return hf_llama4.iter_llama4_params(tensors, config=config)
        if self.family is Family.GPT_OSS:
            return gpt_oss_layout.iter_gpt_oss_params(tensors, config=config)
        return layouts.iter_llama_params(tensors, config=config,
                                         naming=hf_gemma.tensor_naming(self.family.value))


def open_hf(path: str | os.PathLike, *, dtype: str) -> HfSource:
    """config.json and the safetensors headers of an HF directory (no tensor is read)."""
    directory = os.fspath(path)
    config_path = os.path.join(directory, "config.json")
    if not os.path.exists(config_path):
        raise NotFoundError(f"{directory} has no config.json: not a Hugging Face model directory")
    with open(config_path) as f:
        hf_config = json.load(f)
    family, config = from_hf_config(hf_config, dtype=dtype)
    if not any(os.path.exists(os.path.join(directory, n)) for n in (SINGLE, INDEX)):
        raise NotFoundError(f"{directory} holds no {SINGLE} or {INDEX} (streaming conversion reads "
                            "safetensors; .bin checkpoints are read whole)")
    return HfSource(directory=directory, family=family, config=config,
                    tensors=LazySafetensors(directory))


def _shapes(tree: Any) -> Any:
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.float32), tree)


def dry_run(source: HfSource, *, config: TransformerConfig) -> int:
    """Walks the layout on stand-ins: every name and shape checked; returns #parameters."""
    assert isinstance(source.tensors, LazySafetensors)
    return check_stand_ins(source, config=config)


def check_stand_ins(source: Any, *, config: TransformerConfig) -> int:
    """Every name and shape of a streaming source (HF here, Meta's shards in meta.py) checked on
    its tensors' stand-ins, before anything is read or written; returns #parameters."""
    tree = {top: _shapes(sub) for top, sub in
            source.subtrees(source.tensors.stand_ins(), config=config)}
    layouts.check_params(tree, config=dataclasses.replace(config, scan_layers=False))
    return layouts.count(tree)


def write_paxlite(source: HfSource, out_dir: str | os.PathLike, *,
                  config: TransformerConfig) -> int:
    """The paxlite checkpoint of ``source`` (as `hf.to_paxlite` writes it: stacked layers when
    ``config.scan_layers``, ``model_config.json``), one layer in memory at a time; returns
    #parameters. Bad tensors are found by `dry_run` before ``out_dir`` is made."""
    num_params = dry_run(source, config=config)
    write_subtrees(source.subtrees(config=config), out_dir, config=config)
    return num_params
