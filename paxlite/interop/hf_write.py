"""Writing Hugging Face directories the way ``save_pretrained`` does: safetensors shards of at most
``max_shard_size`` bytes with their ``model.safetensors.index.json``, and the tokenizer files.

The shards are laid out from the tensors' names and shapes first, then each tensor is written to
its place as it is made, so an export holds no more than the tensor in hand (a converter reading a
checkpoint layer by layer holds one layer), whatever ``max_shard_size`` is. The whole directory is
staged by `paxlite.paths.staged_output`, so a killed export leaves nothing a reader could mistake
for a model.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Self

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
            raise SettingError(f"{setting}={value!r} is not a size; expected bytes or a number "
                               f"with one of {', '.join(u for u in _UNITS if u)} (e.g. '5GB', "
                               "'500MB')")
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise SettingError(f"{setting}={value!r} must be a positive size")
    return size


class ShardWriter:
    """Writes safetensors shards tensor by tensor, each straight to its place in its file.

    The layout is planned from every tensor's name and shape before the first byte is written
    (transformers' grouping: tensors in order, a new shard when the next would pass ``max_bytes``,
    a bigger tensor alone), so each file's header is written first and each tensor is written at
    its offset as soon as it is made: the writer holds no tensor, whatever the shard size.
    """

    def __init__(self, directory: str, *, tensors: list[tuple[str, tuple[int, ...]]],
                 dtype: Any, max_bytes: int) -> None:
        import numpy as np

        self._dtype = np.dtype(dtype)
        code = _SAFETENSORS_DTYPES[self._dtype.name]
        groups: list[list[tuple[str, tuple[int, ...], int]]] = [[]]
        group_bytes = 0
        for name, shape in tensors:
            size = self._dtype.itemsize * math.prod(shape)
            if groups[-1] and group_bytes + size > max_bytes:
                groups.append([])
                group_bytes = 0
            groups[-1].append((name, tuple(shape), size))
            group_bytes += size
        count = len(groups)
        self.files = ([SINGLE_FILE] if count == 1 else
                      [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
        self.total_bytes = 0
        self._where: dict[str, tuple[int, int, int]] = {}  # name -> (file, offset, bytes)
        self._directory = directory
        self._fds: list[int] = []
        for number, (file, group) in enumerate(zip(self.files, groups)):
            header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
            offset = 0
            for name, shape, size in group:
                if name in header or name in self._where:
                    raise ValueError(f"tensor {name} written twice (a converter bug)")
                header[name] = {"dtype": code, "shape": list(shape),
                                "data_offsets": [offset, offset + size]}
                offset += size
            encoded = json.dumps(header, separators=(",", ":")).encode()
            encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data to 8 bytes
            start = 8 + len(encoded)
            for name, _, size in group:
                begin = header[name]["data_offsets"][0]
                self._where[name] = (number, start + begin, size)
            fd = os.open(os.path.join(directory, file), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            self._fds.append(fd)
            os.pwrite(fd, len(encoded).to_bytes(8, "little") + encoded, 0)
            os.ftruncate(fd, start + offset)
            self.total_bytes += offset
        self._weight_map = {name: self.files[where[0]] for name, where in self._where.items()}
        self._written: set[str] = set()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._fds:  # left open only when the export failed midway
            os.close(fd)
        self._fds = []

    def add(self, name: str, array: np.ndarray) -> None:
        """Casts ``array`` to the writer's dtype and writes it at its planned place."""
        # not at import: `python -m paxlite` builds convert's parser without NumPy
        import numpy as np

        if name not in self._where:
            raise ValueError(f"tensor {name} was not planned (a converter bug)")
        if name in self._written:
            raise ValueError(f"tensor {name} written twice (a converter bug)")
        number, offset, size = self._where[name]
        data = np.ascontiguousarray(np.asarray(array).astype(self._dtype, copy=False))
        if data.nbytes != size:
            raise ValueError(f"tensor {name} has {data.nbytes} bytes, {size} planned (a "
                             "converter bug)")
        view = memoryview(data.reshape(-1).view(np.uint8))
        while view:
            done = os.pwrite(self._fds[number], view, offset)
            view, offset = view[done:], offset + done
        self._written.add(name)

    def close(self) -> list[str]:
        """Checks every planned tensor was written, closes the files and writes the index (for
        several shards); returns the files."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        missing = sorted(set(self._where) - self._written)
        if missing:
            raise ValueError(f"tensors planned but not written: {missing[:5]} (a converter bug)")
        names = list(self.files)
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": dict(sorted(self._weight_map.items()))}
            write_json(os.path.join(self._directory, INDEX_FILE), index)
            names.append(INDEX_FILE)
        return names


_SAFETENSORS_DTYPES: Mapping[str, str] = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


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
HF_TOKENIZER_FILE = "tokenizer.json"
# What an HF tokenizer is read with, beside its tokenizer.json: transformers' settings, its special
# tokens, and the chat templates transformers 5 keeps beside them (a file and a folder)
HF_TOKENIZER_FILES = (HF_TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json",
                      "chat_template.jinja")
HF_TEMPLATES_DIR = "additional_chat_templates"


def is_hf_tokenizer(path: str) -> bool:
    """Whether ``path`` is a Hugging Face tokenizer.json (or a directory holding one), rather
    than a SentencePiece model."""
    if os.path.isdir(path):
        return os.path.isfile(os.path.join(path, HF_TOKENIZER_FILE))
    return os.path.basename(path) == HF_TOKENIZER_FILE


def copy_hf_tokenizer(source: str, output: str) -> list[str]:
    """The HF tokenizer files of directory ``source`` (those it has of HF_TOKENIZER_FILES and
    HF_TEMPLATES_DIR) copied into ``output``, as transformers reads them; their names."""
    copied = []
    for name in HF_TOKENIZER_FILES:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(output, name))
            copied.append(name)
    if os.path.isdir(os.path.join(source, HF_TEMPLATES_DIR)):
        shutil.copytree(os.path.join(source, HF_TEMPLATES_DIR),
                        os.path.join(output, HF_TEMPLATES_DIR), dirs_exist_ok=True)
        copied.append(HF_TEMPLATES_DIR)
    return copied


def _hf_tokenizer_dir(path: str) -> str:
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))


def special_token_ids(path: str) -> tuple[int | None, int | None]:
    """(BOS id, EOS id) of the tokenizer an export ships, as transformers reads it (None where it
    has none): what config.json and generation_config.json carry, so `generate` stops at EOS."""
    from paxlite.data.tokenizer import Tokenizer

    tokenizer = Tokenizer(path)
    return tokenizer.bos_id, None if tokenizer.eos_id < 0 else tokenizer.eos_id


def check_tokenizer(path: str, *, setting: str = "--vocab_path") -> str:
    """``path`` if it is a SentencePiece model, or an HF tokenizer.json, that transformers reads.
    One with more pieces than the model's vocabulary is shipped: transformers runs such a model."""
    if is_hf_tokenizer(path):
        from tokenizers import Tokenizer

        file = os.path.join(_hf_tokenizer_dir(path), HF_TOKENIZER_FILE)
        try:
            Tokenizer.from_file(file)
        except Exception as e:  # noqa: BLE001  the library's own parse errors, said in one line
            raise SettingError(f"{setting}={path} is not a tokenizer.json that the tokenizers "
                               f"library reads ({e})") from None
        return path
    import sentencepiece as spm

    if not os.path.isfile(path):
        raise NotFoundError(f"{setting}={path} does not exist (expected a SentencePiece .model "
                            "file)")
    try:
        spm.SentencePieceProcessor(model_file=path)  # parses, or says why not
    except (RuntimeError, OSError) as e:
        raise SettingError(f"{setting}={path} is not a SentencePiece model ({e})") from None
    kind = sentencepiece_kind(path)
    if kind != "BPE":
        raise SettingError(f"{setting}={path} is a {kind} SentencePiece model; transformers' "
                           "LlamaTokenizer (what --to=hf ships) reproduces BPE models only, as "
                           "LLaMA's and paxlite's train_tokenizer default are")
    normalizer = _unshipped_normalization(path)
    if normalizer is not None:
        raise SettingError(
            f"{setting}={path} {normalizer} before encoding, and transformers' tokenizers built "
            "from a SentencePiece model (what --to=hf ships) do not, so transformers would encode "
            "text into other ids than this model was trained on. Ship it with a SentencePiece "
            "model that has normalization_rule_name='identity' and remove_extra_whitespaces=false "
            "(as LLaMA's, Gemma's and paxlite's train_tokenizer's have), or an HF tokenizer.json")
    return path


def _unshipped_normalization(path: str) -> str | None:
    """What the SentencePiece model does to text that transformers' LlamaTokenizer and
    GemmaTokenizer (a Metaspace pre-tokenizer over the model's pieces, no normalizer) leave out,
    in words; None when nothing."""
    spec = _sentencepiece_proto(path).normalizer_spec
    if spec.precompiled_charsmap:  # the compiled rule; empty for 'identity'
        return f"normalizes text (normalization_rule_name={spec.name!r})"
    if spec.remove_extra_whitespaces:
        return "collapses runs of whitespace (remove_extra_whitespaces=true)"
    return None


def _sentencepiece_proto(path: str):
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    with open(path, "rb") as f:
        proto.ParseFromString(f.read())
    return proto


def sentencepiece_kind(path: str) -> str:
    """'BPE', 'UNIGRAM', 'WORD' or 'CHAR': the model type in the SentencePiece model's proto."""
    from sentencepiece import sentencepiece_model_pb2

    model_type = _sentencepiece_proto(path).trainer_spec.model_type
    return sentencepiece_model_pb2.TrainerSpec.ModelType.Name(model_type)


def adds_dummy_prefix(path: str) -> bool:
    """Whether the SentencePiece model puts "▁" before the text (LLaMA's do; Gemma's do not)."""
    return _sentencepiece_proto(path).normalizer_spec.add_dummy_prefix


def tokenizer_config(path: str, *, family: str | None = None) -> dict[str, Any]:
    """A tokenizer_config.json for transformers' LlamaTokenizer, or GemmaTokenizer for the Gemma
    families' models without the dummy prefix (``family``: the HF model_type), which convert the
    SentencePiece model themselves;
    "▁" before the text as the model itself adds it (add_prefix_space), special tokens the model's
    own pieces, BOS added only if it has one."""
    import sentencepiece as spm

    from paxlite.interop.hf_config import TRANSFORMERS_VERSION_WRITTEN

    sp = spm.SentencePieceProcessor(model_file=path)

    def piece(index: int) -> str | None:
        return sp.id_to_piece(index) if index >= 0 else None

    # GemmaTokenizer never puts "▁" before the text: a Gemma model with a tokenizer that does
    # (paxlite's train_tokenizer's default) ships LlamaTokenizer, which follows add_prefix_space.
    gemma = family is not None and family.startswith("gemma") and not adds_dummy_prefix(path)
    config: dict[str, Any] = {
        "tokenizer_class": "GemmaTokenizer" if gemma else "LlamaTokenizer", "legacy": False,
        "add_prefix_space": adds_dummy_prefix(path),
        "add_bos_token": sp.bos_id() >= 0, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "transformers_version": TRANSFORMERS_VERSION_WRITTEN,
    }
    for key, index in (("unk_token", sp.unk_id()), ("bos_token", sp.bos_id()),
                       ("eos_token", sp.eos_id()), ("pad_token", sp.pad_id())):
        config[key] = piece(index)
    return config


def write_tokenizer(directory: str, *, path: str, family: str | None = None) -> list[str]:
    """The tokenizer an HF export ships: an HF tokenizer's own files (with its chat templates, and
    the SentencePiece model beside them if there is one), or a SentencePiece model with the
    settings transformers reads it with for the model's ``family`` (its HF model_type;
    tokenizer_config)."""
    if is_hf_tokenizer(path):
        source = _hf_tokenizer_dir(path)
        copied = copy_hf_tokenizer(source, directory)
        # HF repositories that have a SentencePiece model ship it beside tokenizer.json
        if os.path.isfile(os.path.join(source, TOKENIZER_FILE)):
            shutil.copyfile(os.path.join(source, TOKENIZER_FILE),
                            os.path.join(directory, TOKENIZER_FILE))
            copied.append(TOKENIZER_FILE)
        return copied
    shutil.copyfile(path, os.path.join(directory, TOKENIZER_FILE))
    config = tokenizer_config(path, family=family)
    write_json(os.path.join(directory, "tokenizer_config.json"), config)
    special = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
    write_json(os.path.join(directory, "special_tokens_map.json"), special)
    return [TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json"]
