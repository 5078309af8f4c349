"""Meta consolidated LLaMA checkpoints (``params.json`` + ``consolidated.NN.pth``) -> paxlite.

Model-parallel shards are merged as Meta's code split them: column-parallel weights (wq, wk, wv, w1,
w3, output) along axis 0, row-parallel ones (wo, w2) along axis 1, norms are replicated, and the
token embedding is split along axis 1 in LLaMA-1/2 and axis 0 in LLaMA-3 (told apart by the shard
shape). Meta's q/k rows are already in the interleaved RoPE order paxlite uses: no permutation.

``.pth`` files are pickles; they are read with ``torch.load(weights_only=True)`` only, which refuses
any object that is not a tensor or plain container, so a downloaded file cannot run code.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from paxlite.errors import NotFoundError, UserError
from paxlite.interop.hf_config import UnsupportedCheckpointError
from paxlite.interop.layouts import LayoutError, LlamaNaming, Params, llama_to_params
from paxlite.models.transformer import LLAMA_ARCHITECTURE, TransformerConfig

META_MAX_SEQ_LEN: int = 4096  # params.json does not say; LLaMA-2's context
_SHARD = re.compile(r"^consolidated\.(\d+)\.pth$")
_COLUMN_PARALLEL = re.compile(r"(attention\.w[qkv]|feed_forward\.w[13])\.weight$|^output\.weight$")
_ROW_PARALLEL = re.compile(r"(attention\.wo|feed_forward\.w2)\.weight$")
_IGNORED = ("rope.freqs",)


class UnsafeCheckpointError(UserError, ValueError):
    """A pickle that holds something other than tensors; it is not loaded."""


def load_torch_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """{name: array} of a torch state-dict file, read with weights_only=True (no code execution).

    bfloat16 tensors come back as ml_dtypes.bfloat16 arrays, bit for bit.
    """
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
    if not isinstance(state, Mapping):
        raise UnsafeCheckpointError(f"{path} holds a {type(state).__name__}, not a dict of tensors")
    out: dict[str, np.ndarray] = {}
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise UnsafeCheckpointError(
                f"{path}: entry {name!r} is a {type(tensor).__name__}, not a tensor")
        out[name] = _to_numpy(tensor)
    return out


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


def merge_shards(shards: list[dict[str, np.ndarray]], *, config: TransformerConfig
                 ) -> dict[str, np.ndarray]:
    """One state dict from model-parallel shards (interop.md section 6)."""
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
        if _COLUMN_PARALLEL.search(name):
            merged[name] = np.concatenate(parts, axis=0)
        elif _ROW_PARALLEL.search(name):
            merged[name] = np.concatenate(parts, axis=1)
        elif name == "tok_embeddings.weight":
            # LLaMA-1/2 split the embedding along model dims, LLaMA-3 along the vocabulary.
            axis = 1 if parts[0].shape[0] == config.vocab_size else 0
            merged[name] = np.concatenate(parts, axis=axis)
        else:  # norms (and rope.freqs): replicated
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


def load_meta(path: str | os.PathLike, *, vocab_size: int | None = None
              ) -> tuple[TransformerConfig, Params]:
    """(config, unscanned params in the stored dtype) of a Meta checkpoint directory."""
    directory = os.fspath(path)
    params_path = os.path.join(directory, "params.json")
    if not os.path.exists(params_path):
        raise NotFoundError(f"{directory} has no params.json: not a Meta LLaMA checkpoint")
    with open(params_path) as f:
        config = meta_config(json.load(f), directory=directory, vocab_size=vocab_size)
    shards = [load_torch_file(p) for p in shard_paths(directory)]
    params = llama_to_params(merge_shards(shards, config=config), config=config,
                             naming=meta_naming())
    return config, params
