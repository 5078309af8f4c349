"""Meta consolidated LLaMA checkpoints (``params.json`` + ``consolidated.NN.pth``) -> paxlite.

Model-parallel shards are merged as Meta's code split them: column-parallel weights (wq, wk, wv, w1,
w3, output) along axis 0, row-parallel ones (wo, w2) along axis 1, norms are replicated, and the
token embedding is split along axis 1 in LLaMA-1/2 and axis 0 in LLaMA-3 (told apart by the shard
shape). Meta's q/k rows are already in the interleaved RoPE order paxlite uses: no permutation.

``.pth`` files are pickles; they are read with ``torch.load(weights_only=True)`` only, which refuses
any object that is not a tensor or plain container, so a downloaded file cannot run code.

`load_meta` (behind ``hf.from_meta``) merges whole shards in memory. `open_meta` + `write_paxlite`
(``python -m paxlite convert --from=meta --to=paxlite``) stream instead: `MetaShards` reads one
merged tensor at a time from memory-mapped shards, and the paxlite checkpoint is written one layer
at a time (`stream.write_subtrees`), so the converter holds about a layer of the model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from paxlite.errors import NotFoundError, SettingError, UserError
from paxlite.interop import layouts
from paxlite.interop.errors import ConversionError
from paxlite.interop.hf_config import UnsupportedCheckpointError
from paxlite.interop.layouts import LayoutError, LlamaNaming, Params, llama_to_params
from paxlite.models.transformer import LLAMA_ARCHITECTURE, VALID_DTYPES, TransformerConfig

META_MAX_SEQ_LEN: int = 4096  # params.json does not say; LLaMA-2's context
_SHARD = re.compile(r"^consolidated\.(\d+)\.pth$")
_COLUMN_PARALLEL = re.compile(r"(attention\.w[qkv]|feed_forward\.w[13])\.weight$|^output\.weight$")
_ROW_PARALLEL = re.compile(r"(attention\.wo|feed_forward\.w2)\.weight$")
_IGNORED = ("rope.freqs",)
_LAYER = re.compile(r"^layers\.(\d+)\.")


class UnsafeCheckpointError(UserError, ValueError):
    """A pickle that holds something other than tensors; it is not loaded."""


def load_torch_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """{name: array} of a torch state-dict file, read with weights_only=True (no code execution).

    bfloat16 tensors come back as ml_dtypes.bfloat16 arrays, bit for bit.
    """
    return {name: _to_numpy(tensor) for name, tensor in _open_state(path).items()}


def _open_state(path: str | os.PathLike) -> Mapping[str, Any]:
    """The state dict of a torch file, memory-mapped (no weight is read until used) and unpickled
    with weights_only=True; refused unless it is a dict of tensors. Its tensors keep the mapping,
    and every page of it they were read through stays resident, until the last of them is gone."""
    import pickle

    try:
        import torch
    except ImportError as e:
        raise ImportError(f"reading {path} needs torch: pip install 'paxlite[hf]'") from e
    try:
        state = torch.load(os.fspath(path), map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"refused to load {path}: it holds objects other than tensors, and paxlite only "
            f"unpickles with weights_only=True ({str(e).splitlines()[0]})") from None
    except RuntimeError as e:  # e.g. "PytorchStreamReader failed reading zip archive"
        raise ConversionError(
            f"cannot read {path} as a torch checkpoint ({str(e).splitlines()[0]}): a truncated or "
            "corrupt download (download it again), or a pre-1.6 torch file, which cannot be "
            "memory-mapped") from None
    if not isinstance(state, Mapping):
        raise UnsafeCheckpointError(f"{path} holds a {type(state).__name__}, not a dict of tensors")
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise UnsafeCheckpointError(
                f"{path}: entry {name!r} is a {type(tensor).__name__}, not a tensor")
    return state


def _to_numpy(tensor: Any) -> np.ndarray:
    import ml_dtypes
    import torch

    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def ffn_hidden_dims(*, dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Meta's FFN size: multiple_of * ceil(m * int(8 * dim / 3) / multiple_of)."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _tokenizer_vocab(directory: str) -> int | None:
    for candidate in (os.path.join(directory, "tokenizer.model"),
                      os.path.join(os.path.dirname(os.path.abspath(directory)), "tokenizer.model")):
        if os.path.exists(candidate):
            import sentencepiece

            return int(sentencepiece.SentencePieceProcessor(model_file=candidate).get_piece_size())
    return None


def meta_config(params_json: Mapping[str, Any], *, directory: str,
                vocab_size: int | None = None) -> TransformerConfig:
    """TransformerConfig of a ``params.json``; vocab -1 comes from vocab_size or tokenizer.model."""
    if params_json.get("use_scaled_rope"):
        raise UnsupportedCheckpointError(
            "params.json use_scaled_rope=true is not supported: paxlite implements unscaled RoPE "
            "only")
    moe = sorted(k for k in params_json if "moe" in k or "expert" in k)
    if moe:
        raise UnsupportedCheckpointError(
            f"params.json {moe[0]}={params_json[moe[0]]!r}: paxlite has no mixture-of-experts "
            "model")
    for key in ("dim", "n_layers", "n_heads"):
        if key not in params_json:
            raise UnsupportedCheckpointError(f"params.json has no {key!r}")
    file_vocab = int(params_json.get("vocab_size", -1))
    if file_vocab > 0:
        if vocab_size is not None and vocab_size != file_vocab:
            raise UnsupportedCheckpointError(
                f"--vocab_size={vocab_size} disagrees with params.json vocab_size={file_vocab}")
        vocab = file_vocab
    elif vocab_size is not None:
        vocab = vocab_size
    else:
        found = _tokenizer_vocab(directory)
        if found is None:
            raise UnsupportedCheckpointError(
                f"params.json vocab_size={file_vocab} means 'take it from the tokenizer', and "
                f"there is no tokenizer.model in {directory} or its parent: pass --vocab_size=N "
                "(32000 for LLaMA-1/2) or put tokenizer.model beside the checkpoint")
        vocab = found
    dim, heads = int(params_json["dim"]), int(params_json["n_heads"])
    if dim % heads:
        raise UnsupportedCheckpointError(
            f"params.json dim={dim} is not a multiple of n_heads={heads}")
    return TransformerConfig(
        vocab_size=vocab,
        num_layers=int(params_json["n_layers"]),
        model_dims=dim,
        num_heads=heads,
        num_kv_heads=int(params_json.get("n_kv_heads") or heads),
        dims_per_head=dim // heads,
        hidden_dims=ffn_hidden_dims(dim=dim, multiple_of=int(params_json.get("multiple_of", 256)),
                                    ffn_dim_multiplier=params_json.get("ffn_dim_multiplier")),
        max_seq_len=int(params_json.get("max_seq_len", META_MAX_SEQ_LEN)),
        norm_epsilon=float(params_json.get("norm_eps", 1e-5)),
        tie_embeddings=False,
        **LLAMA_ARCHITECTURE,
        rope_theta=float(params_json.get("rope_theta", 10000.0)),
    )


def _split_axis(name: str, part_shape: tuple[int, ...], *, config: TransformerConfig
                ) -> int | None:
    """The axis Meta's model parallelism split ``name`` along; None: replicated in every shard."""
    if _COLUMN_PARALLEL.search(name):
        return 0
    if _ROW_PARALLEL.search(name):
        return 1
    if name == "tok_embeddings.weight":
        # LLaMA-1/2 split the embedding along model dims, LLaMA-3 along the vocabulary.
        return 1 if part_shape[0] == config.vocab_size else 0
    return None  # norms (and rope.freqs)


def merge_shards(shards: list[dict[str, np.ndarray]], *, config: TransformerConfig
                 ) -> dict[str, np.ndarray]:
    """One state dict from model-parallel shards (docs/interop.md, "Layouts", says which axis)."""
    if len(shards) == 1:
        return dict(shards[0])
    names = set(shards[0])
    for i, shard in enumerate(shards[1:], start=1):
        if set(shard) != names:
            diff = sorted(names.symmetric_difference(shard))
            raise LayoutError(f"Meta shard {i} holds different tensors from shard 0: {diff[:10]}")
    merged: dict[str, np.ndarray] = {}
    for name in sorted(names):
        parts = [shard[name] for shard in shards]
        axis = _split_axis(name, parts[0].shape, config=config)
        if axis is not None:
            merged[name] = np.concatenate(parts, axis=axis)
        else:
            for i, part in enumerate(parts[1:], start=1):
                if part.shape != parts[0].shape or not np.array_equal(part, parts[0]):
                    raise LayoutError(
                        f"Meta shards disagree on the replicated tensor {name} (shard {i} vs 0)")
            merged[name] = parts[0]
    return merged


def meta_naming() -> LlamaNaming:
    return LlamaNaming(
        what="Meta LLaMA checkpoint",
        embed="tok_embeddings.weight",
        q="layers.{i}.attention.wq.weight",
        k="layers.{i}.attention.wk.weight",
        v="layers.{i}.attention.wv.weight",
        o="layers.{i}.attention.wo.weight",
        gate="layers.{i}.feed_forward.w1.weight",
        up="layers.{i}.feed_forward.w3.weight",
        down="layers.{i}.feed_forward.w2.weight",
        attn_norm="layers.{i}.attention_norm.weight",
        mlp_norm="layers.{i}.ffn_norm.weight",
        final_norm="norm.weight",
        output="output.weight",
        rotate_half=False,
        vocab="vocab_size",
        dims="dim",
        heads="n_heads",
        kv_heads="n_kv_heads",
        head_dim="(dim / n_heads)",
        hidden="FFN size from multiple_of/ffn_dim_multiplier",
        ignore=lambda name: name in _IGNORED,
    )


def shard_paths(directory: str) -> list[str]:
    found = sorted((int(m.group(1)), name) for name in os.listdir(directory)
                   if (m := _SHARD.match(name)))
    if not found:
        raise NotFoundError(f"no consolidated.NN.pth shards in {directory}")
    numbers = [n for n, _ in found]
    if numbers != list(range(len(found))):
        raise NotFoundError(
            f"Meta shards in {directory} are not numbered 00..{len(found) - 1:02d}: "
            f"found {numbers}")
    return [os.path.join(directory, name) for _, name in found]


def read_meta_config(directory: str, *, vocab_size: int | None = None) -> TransformerConfig:
    """The TransformerConfig of a Meta checkpoint directory's ``params.json``."""
    params_path = os.path.join(directory, "params.json")
    if not os.path.exists(params_path):
        raise NotFoundError(f"{directory} has no params.json: not a Meta LLaMA checkpoint")
    with open(params_path) as f:
        return meta_config(json.load(f), directory=directory, vocab_size=vocab_size)


def load_meta(path: str | os.PathLike, *, vocab_size: int | None = None
              ) -> tuple[TransformerConfig, Params]:
    """(config, unscanned params in the stored dtype) of a Meta checkpoint directory."""
    directory = os.fspath(path)
    config = read_meta_config(directory, vocab_size=vocab_size)
    shards = [load_torch_file(p) for p in shard_paths(directory)]
    params = llama_to_params(merge_shards(shards, config=config), config=config,
                             naming=meta_naming())
    return config, params


# ---------------------------------------------------------------- streaming
class MetaShards(Mapping):
    """name -> the merged np.ndarray (stored dtype) of a Meta checkpoint's model-parallel shards,
    read from disk on ``[]``, merged as `merge_shards` merges them.

    Opening reads each shard's pickle (names, shapes, dtypes: no weights) and its replicated norms,
    and checks that the shards hold the same float tensors of compatible shapes, agree on the
    replicated ones, and are all there. Reading maps the shards (torch.load(mmap=True)) and copies
    one tensor's pieces out. A page read through a mapping stays resident (and counts in the RSS)
    while any tensor of that load lives, so the shards are mapped per group (the tensors of one
    layer, or one other tensor) and unmapped when the group is read or another one is asked for:
    resident input never exceeds a layer.
    """

    def __init__(self, paths: Sequence[str], *, config: TransformerConfig, directory: str) -> None:
        self._paths = list(paths)
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._groups: dict[int | str, set[str]] = {}
        # (group, mapped shards)
        self._open: tuple[int | str, list[Mapping[str, Any]]] | None = None
        self._unread: set[str] = set()
        shapes, replicated = _scan_shard(self._paths[0], config=config)
        parts = {name: [shape] for name, shape in shapes.items()}
        self._axes = {name: _split_axis(name, shape, config=config)
                      for name, shape in shapes.items()}
        for i, path in enumerate(self._paths[1:], start=1):
            shapes, values = _scan_shard(path, config=config)
            if set(shapes) != set(parts):
                diff = sorted(set(parts).symmetric_difference(shapes))
                raise LayoutError(
                    f"Meta shard {i} holds different tensors from shard 0: {diff[:10]}")
            for name, shape in shapes.items():
                parts[name].append(shape)
            for name, value in values.items():
                if value.shape != replicated[name].shape or not np.array_equal(
                        value, replicated[name]):
                    raise LayoutError(f"Meta shards disagree on the replicated tensor {name} "
                                      f"(shard {i} vs 0)")
        for name, part_shapes in parts.items():
            self._shapes[name] = _merged_shape(name, part_shapes, axis=self._axes[name])
            self._groups.setdefault(_group(name), set()).add(name)
        _check_shard_count(parts, config=config, directory=directory)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._shapes:
            raise KeyError(name)
        group = _group(name)
        if self._open is None or self._open[0] != group:
            self.close()
            self._open = (group, [_open_state(path) for path in self._paths])
            self._unread = set(self._groups[group])
        pieces = [_to_numpy(state[name]) for state in self._open[1]]
        axis = self._axes[name]
        # Copies (concatenate always does): the result must not keep the mapping alive. Casting
        # here instead of in the writer was measured to raise the peak: the cast copy would then
        # coexist with the mapped pieces and the writes still in flight.
        merged = pieces[0].copy() if axis is None else np.concatenate(pieces, axis=axis)
        del pieces
        self._unread.discard(name)
        if not self._unread:
            self.close()
        return merged

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    def close(self) -> None:
        """Unmaps the shards (a later read maps them again)."""
        self._open = None

    def stand_ins(self) -> dict[str, np.ndarray]:
        """The same names as zero-stride float32 arrays of the merged shapes (no memory, no
        reads)."""
        zero = np.zeros(1, np.float32)
        return {name: np.lib.stride_tricks.as_strided(zero, shape, (0,) * len(shape))
                for name, shape in self._shapes.items()}


def _group(name: str) -> int | str:
    """The layer index of a layer's tensor, else the tensor's own name."""
    match = _LAYER.match(name)
    return int(match.group(1)) if match else name


def _scan_shard(path: str, *, config: TransformerConfig
                ) -> tuple[dict[str, tuple[int, ...]], dict[str, np.ndarray]]:
    """(every tensor's shape, copies of the replicated tensors) of one shard, which is unmapped
    again on return; a tensor that is not floating point is refused."""
    shapes: dict[str, tuple[int, ...]] = {}
    replicated: dict[str, np.ndarray] = {}
    for name, tensor in _open_state(path).items():
        if not tensor.is_floating_point():
            raise ConversionError(
                f"{path}: tensor {name} is stored as {tensor.dtype}; paxlite converts float "
                "weights only (a quantized checkpoint needs its scales applied first)")
        shapes[name] = tuple(tensor.shape)
        if _split_axis(name, shapes[name], config=config) is None:
            replicated[name] = _to_numpy(tensor).copy()
    return shapes, replicated


def _merged_shape(name: str, shapes: list[tuple[int, ...]], *, axis: int | None
                  ) -> tuple[int, ...]:
    for i, shape in enumerate(shapes[1:], start=1):
        if len(shape) != len(shapes[0]) or any(
                a != b for k, (a, b) in enumerate(zip(shape, shapes[0])) if k != axis):
            split = "replicated" if axis is None else f"split along axis {axis}"
            raise LayoutError(f"Meta shards disagree on the shape of {name} ({split}): shard {i} "
                              f"{shape}, shard 0 {shapes[0]}")
    if axis is None:
        return shapes[0]
    return tuple(sum(s[axis] for s in shapes) if k == axis else n
                 for k, n in enumerate(shapes[0]))


def _check_shard_count(parts: Mapping[str, list[tuple[int, ...]]], *,
                       config: TransformerConfig, directory: str) -> None:
    """A missing last shard leaves the others numbered 00..N-1 and every split tensor short: say
    which files are missing rather than which rows."""
    name = "layers.0.attention.wq.weight"
    if name not in parts:
        return
    have, rows = len(parts[name]), parts[name][0][0]
    want = config.num_heads * config.dims_per_head
    if rows * have < want and want % rows == 0:
        split = want // rows
        missing = (f"consolidated.{have:02d}.pth is" if split == have + 1 else
                   f"consolidated.{have:02d}.pth to consolidated.{split - 1:02d}.pth are")
        raise NotFoundError(
            f"{directory} holds {have} Meta shard(s), but the checkpoint is split {split} ways "
            f"({name} holds {rows} of its n_heads * head_dim = {want} rows in each shard): "
            f"{missing} missing; finish the download")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetaSource:
    """An opened Meta checkpoint: its converted config; tensors are read when written."""

    directory: str
    config: TransformerConfig
    tensors: MetaShards

    def subtrees(self, tensors: Mapping[str, np.ndarray] | None = None,
                 *, config: TransformerConfig | None = None) -> Iterator[tuple[str, Params]]:
        """The unscanned top-level subtrees (``embedding``, ``layers_<i>``, ...), one at a time."""
        tensors = self.tensors if tensors is None else tensors
        config = dataclasses.replace(config or self.config, scan_layers=False)
        return layouts.iter_llama_params(tensors, config=config, naming=meta_naming())


def open_meta(path: str | os.PathLike, *, vocab_size: int | None = None,
              dtype: str = "float32") -> MetaSource:
    """params.json and the shards' pickles of a Meta checkpoint directory (no weight is read);
    the config's dtype is ``dtype``, as in ``hf.from_meta`` (tensors are cast when written)."""
    if dtype not in VALID_DTYPES:
        raise SettingError(f"dtype={dtype!r} is not valid; expected one of {VALID_DTYPES}")
    directory = os.fspath(path)
    config = read_meta_config(directory, vocab_size=vocab_size)
    config = dataclasses.replace(config, dtype=dtype, param_dtype=dtype)
    tensors = MetaShards(shard_paths(directory), config=config, directory=directory)
    return MetaSource(directory=directory, config=config, tensors=tensors)


def dry_run(source: MetaSource, *, config: TransformerConfig) -> int:
    """Walks the layout on stand-ins: every name and shape checked; returns #parameters."""
    from paxlite.interop.stream import check_stand_ins

    return check_stand_ins(source, config=config)


def write_paxlite(source: MetaSource, out_dir: str | os.PathLike, *,
                  config: TransformerConfig) -> int:
    """The paxlite checkpoint of ``source`` (as ``hf.to_paxlite(hf.from_meta(...))`` writes it:
    stacked layers when ``config.scan_layers``, ``model_config.json``), one layer in memory at a
    time; returns #parameters. Bad tensors are found by `dry_run` before ``out_dir`` is made."""
    from paxlite.interop.stream import write_subtrees

    num_params = dry_run(source, config=config)
    try:
        write_subtrees(source.subtrees(config=config), out_dir, config=config)
    finally:
        source.tensors.close()
    return num_params
