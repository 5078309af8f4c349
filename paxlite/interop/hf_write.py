"""Writing Hugging Face directories the way ``save_pretrained`` does: safetensors shards of at most
``max_shard_size`` bytes with their ``model.safetensors.index.json``, and the tokenizer files.

Tensors are handed over one at a time and a shard is written as soon as the next tensor would not
fit, so a writer holds at most one shard of host arrays (not the whole model). Shards are first
written under provisional names and renamed once their count is known (``model-0000N-of-0000M``);
the whole directory is staged by `paxlite.paths.staged_output`, so a killed export leaves nothing a
reader could mistake for a model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from paxlite.errors import NotFoundError, SettingError

if TYPE_CHECKING:
    import numpy as np

# transformers 5.x's save_pretrained default (4.x used "5GB"); one shard is model.safetensors.
DEFAULT_MAX_SHARD_SIZE: str = "50GB"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.model"

_UNITS: Mapping[str, int] = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: int | str, *, setting: str = "--max_shard_size") -> int:
    """Bytes of "5GB" / "500MB" / "2GiB" / "1000000" (transformers' spellings; GB = 10**9)."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = _SIZE.match(str(value))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise SettingError(f"{setting}={value!r} is not a size; expected bytes or a number with "
                               f"one of {', '.join(u for u in _UNITS if u)} (e.g. '5GB', '500MB')")
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise SettingError(f"{setting}={value!r} must be a positive size")
    return size


class ShardWriter:
    """Collects tensors into shards of at most ``max_bytes`` (a bigger tensor gets its own shard,
    as in transformers) and writes each full shard at once."""

    def __init__(self, directory: str, *, max_bytes: int) -> None:
        self._directory = directory
        self._max = max_bytes
        self._pending: dict[str, np.ndarray] = {}
        self._pending_bytes = 0
        self._files: list[tuple[str, list[str]]] = []  # provisional file name, tensor names
        self.total_bytes = 0

    def add(self, name: str, array: np.ndarray) -> None:
        import numpy as np  # not at import: `python -m paxlite` builds convert's parser without NumPy

        array = np.ascontiguousarray(array)
        if self._pending and self._pending_bytes + array.nbytes > self._max:
            self._flush()
        self._pending[name] = array
        self._pending_bytes += array.nbytes
        self.total_bytes += array.nbytes

    def _flush(self) -> None:
        from safetensors.numpy import save_file

        path = f"shard-{len(self._files):05d}.partial"
        save_file(self._pending, os.path.join(self._directory, path), metadata={"format": "pt"})
        self._files.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Writes the last shard, names the shards and (for several) the index; returns the files."""
        if self._pending or not self._files:
            self._flush()
        count = len(self._files)
        names = ([SINGLE_FILE] if count == 1 else
                 [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
        weight_map: dict[str, str] = {}
        for (provisional, tensors), final in zip(self._files, names):
            os.replace(os.path.join(self._directory, provisional),
                       os.path.join(self._directory, final))
            weight_map.update(dict.fromkeys(tensors, final))
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": dict(sorted(weight_map.items()))}
            write_json(os.path.join(self._directory, INDEX_FILE), index)
            names.append(INDEX_FILE)
        return names


def numpy_dtype(dtype: str) -> Any:
    """The NumPy dtype of 'float32' / 'bfloat16' (ml_dtypes' bfloat16)."""
    import ml_dtypes
    import numpy as np

    return np.float32 if dtype == "float32" else ml_dtypes.bfloat16


def write_json(path: str, content: Any) -> None:
    with open(path, "w") as f:
        json.dump(content, f, indent=2, sort_keys=True)
        f.write("\n")


# ---------------------------------------------------------------- tokenizer
def check_tokenizer(path: str, *, vocab_size: int, setting: str = "--vocab_path") -> str:
    """``path`` if it is a SentencePiece model whose pieces fit the model's vocabulary."""
    import sentencepiece as spm

    if not os.path.isfile(path):
        raise NotFoundError(f"{setting}={path} does not exist (expected a SentencePiece .model file)")
    try:
        processor = spm.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError) as e:
        raise SettingError(f"{setting}={path} is not a SentencePiece model ({e})") from None
    kind = sentencepiece_kind(path)
    if kind != "BPE":
        raise SettingError(f"{setting}={path} is a {kind} SentencePiece model; transformers' "
                           "LlamaTokenizer (what --to=hf ships) reproduces BPE models only, as "
                           "LLaMA's and paxlite's train_tokenizer default are")
    if processor.get_piece_size() > vocab_size:
        raise SettingError(f"{setting}={path} has {processor.get_piece_size()} pieces but the model's "
                           f"vocab_size is {vocab_size}: not this model's tokenizer")
    return path


def sentencepiece_kind(path: str) -> str:
    """'BPE', 'UNIGRAM', 'WORD' or 'CHAR': the model type in the SentencePiece model's proto."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    with open(path, "rb") as f:
        proto.ParseFromString(f.read())
    return sentencepiece_model_pb2.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type)


def tokenizer_config(path: str) -> dict[str, Any]:
    """A tokenizer_config.json for transformers' LlamaTokenizer (which converts the SentencePiece
    model itself); special tokens are the model's own pieces, BOS added only if it has one."""
    import sentencepiece as spm

    from paxlite.interop.hf_config import TRANSFORMERS_VERSION_WRITTEN

    sp = spm.SentencePieceProcessor(model_file=path)

    def piece(index: int) -> str | None:
        return sp.id_to_piece(index) if index >= 0 else None

    config: dict[str, Any] = {
        "tokenizer_class": "LlamaTokenizer", "legacy": False, "add_prefix_space": True,
        "add_bos_token": sp.bos_id() >= 0, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "transformers_version": TRANSFORMERS_VERSION_WRITTEN,
    }
    for key, index in (("unk_token", sp.unk_id()), ("bos_token", sp.bos_id()),
                       ("eos_token", sp.eos_id()), ("pad_token", sp.pad_id())):
        config[key] = piece(index)
    return config


def write_tokenizer(directory: str, *, path: str) -> list[str]:
    shutil.copyfile(path, os.path.join(directory, TOKENIZER_FILE))
    config = tokenizer_config(path)
    write_json(os.path.join(directory, "tokenizer_config.json"), config)
    special = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
    write_json(os.path.join(directory, "special_tokens_map.json"), special)
    return [TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json"]
