"""Public API: load / save Hugging Face checkpoints, read Meta and paxlite ones
(docs/interop.md, "Python API").

    from paxlite.interop import hf
    pretrained = hf.load("path/to/hf_model_dir")   # any family of docs/interop.md
    logits = pretrained.logits(tokens)             # int32 [B, T] -> float32 [B, T, V]
    hf.save(pretrained, "out_dir")                 # loadable by transformers

Every reader returns the same :class:`Pretrained` (a TransformerConfig plus the unscanned params
tree as NumPy arrays), and every writer takes one, so any source converts to any target. HF files
are read through safetensors' NumPy backend (bfloat16 arrives as ml_dtypes.bfloat16); torch is only
imported for ``.bin``/``.pth`` pickles, which are read with ``weights_only=True``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from paxlite.errors import NotFoundError, SettingError
from paxlite.interop import (
    gpt2_layout,
    gpt_oss_layout,
    hf_deepseek,
    hf_gemma,
    hf_llama4,
    hf_write,
    layouts,
)
from paxlite.interop.errors import ConversionError
from paxlite.interop.hf_config import (
    LLAMA_LAYOUT_FAMILIES,
    MOE_FAMILIES,
    Family,
    UnsupportedCheckpointError,
    family_of_config,
    from_hf_config,
    stored_dtype,
    to_hf_config,
)
from paxlite.models.transformer import VALID_DTYPES, RematPolicy, TransformerConfig
from paxlite.paths import check_output_dir, staged_output

Params = layouts.Params


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pretrained:
    """A converted model: its config, its params (unscanned tree of NumPy arrays) and its family.

    ``config.param_dtype`` is the dtype of ``params``. ``bos_token_id`` / ``eos_token_id`` are
    carried from an HF config into the exported one (paxlite does not need them), as is a Mixtral's
    or Qwen3-MoE's ``router_aux_loss_coef``, which acts in HF only with ``output_router_logits``
    (then it is also ``config.moe.load_balancing_weight``; see `hf_moe.aux_loss_weight`).
    """

    config: TransformerConfig
    params: Params
    family: Family
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    router_aux_loss_coef: float | None = None

    @property
    def num_params(self) -> int:
        return layouts.count(self.params)

    @property
    def dtype(self) -> str:
        return self.config.param_dtype

    def logits(self, tokens: Any) -> np.ndarray:
        """tokens int32 [B, T] -> float32 logits [B, T, V] from paxlite's Transformer."""
        import jax.numpy as jnp

        from paxlite.models.transformer import Transformer

        # fp8=None: converted weights carry no FP8 scaling state (training state), so score in
        # dtype.
        config = dataclasses.replace(self.config, scan_layers=False, remat_policy=RematPolicy.NONE,
                                     fp8=None)
        tokens = jnp.asarray(tokens, jnp.int32)
        # Eager on purpose: compiling the whole model costs seconds per call and per config, while
        # eager dispatch compiles each primitive once per shape and reuses it.
        out = Transformer(config).apply({"params": self.params}, tokens)
        return np.asarray(out, np.float32)


def _check_dtype(dtype: str) -> str:
    if dtype not in VALID_DTYPES:
        raise SettingError(f"dtype={dtype!r} is not valid; expected one of {VALID_DTYPES}")
    return dtype


def _numpy_dtype(dtype: str) -> Any:
    return hf_write.numpy_dtype(_check_dtype(dtype))


def cast_params(params: Params, dtype: str) -> Params:
    """Every leaf as a NumPy array of ``dtype`` ('float32' or 'bfloat16')."""
    import jax

    target = _numpy_dtype(dtype)
    return jax.tree.map(lambda x: np.asarray(x).astype(target, copy=False), params)


def _with_dtype(config: TransformerConfig, dtype: str) -> TransformerConfig:
    return dataclasses.replace(config, dtype=dtype, param_dtype=dtype)


# ---------------------------------------------------------------- reading HF
def read_hf_tensors(directory: str) -> Mapping[str, np.ndarray]:
    """Every tensor of an HF model directory: model.safetensors or sharded safetensors with their
    index (read lazily, each tensor on ``[]``, after checking every shard is there and complete),
    or (read whole, safely) pytorch_model.bin and its shards."""
    from paxlite.interop.meta import load_torch_file
    from paxlite.interop.stream import LazySafetensors

    if any(os.path.exists(os.path.join(directory, name))
           for name in ("model.safetensors", "model.safetensors.index.json")):
        return LazySafetensors(directory)
    for single, index, reader in (
        ("pytorch_model.bin", "pytorch_model.bin.index.json", load_torch_file),
    ):
        if os.path.exists(os.path.join(directory, single)):
            return reader(os.path.join(directory, single))
        index_path = os.path.join(directory, index)
        if os.path.exists(index_path):
            with open(index_path) as f:
                weight_map: Mapping[str, str] = json.load(f)["weight_map"]
            tensors: dict[str, np.ndarray] = {}
            for shard in sorted(set(weight_map.values())):
                for name, array in reader(os.path.join(directory, shard)).items():
                    if name in tensors:
                        raise layouts.LayoutError(f"{directory}: tensor {name} is in two shards")
                    tensors[name] = array
            return tensors
    raise NotFoundError(
        f"{directory} holds no model.safetensors, model.safetensors.index.json, pytorch_model.bin "
        "or pytorch_model.bin.index.json")


def load(path: str | os.PathLike, *, dtype: str = "float32") -> Pretrained:
    """An HF ``*ForCausalLM`` directory (config.json + weights) as paxlite params in ``dtype``."""
    directory = os.fspath(path)
    config_path = os.path.join(directory, "config.json")
    if not os.path.exists(config_path):
        raise NotFoundError(
            f"{directory} has no config.json: not a Hugging Face model directory")
    with open(config_path) as f:
        hf_config = hf_llama4.text_config(json.load(f))  # a multimodal Llama 4's text model
    family, config = from_hf_config(hf_config, dtype=_check_dtype(dtype))
    tensors = read_hf_tensors(directory)
    if family.value in hf_deepseek.MODEL_TYPES:
        params = dict(hf_deepseek.iter_deepseek_params(tensors, config=config))
    elif family is Family.GPT_OSS:
        params = gpt_oss_layout.gpt_oss_to_params(tensors, config=config)
    elif family in LLAMA_LAYOUT_FAMILIES:
        params = layouts.llama_to_params(tensors, config=config,
                                         naming=hf_gemma.tensor_naming(family.value))
    elif family is Family.LLAMA4_TEXT:
        params = dict(hf_llama4.iter_llama4_params(tensors, config=config))
    else:
        params = gpt2_layout.gpt2_to_params(tensors, config=config)
    params = cast_params(params, dtype)
    layouts.check_params(params, config=config)
    return Pretrained(config=config, params=params, family=family,
                      bos_token_id=hf_config.get("bos_token_id"),
                      eos_token_id=hf_config.get("eos_token_id"),
                      router_aux_loss_coef=(hf_config.get("router_aux_loss_coef")
                                            if family in MOE_FAMILIES else None))


def stored_hf_dtype(path: str | os.PathLike) -> str | None:
    """The dtype an HF directory's config.json says its weights are stored in, if any."""
    with open(os.path.join(os.fspath(path), "config.json")) as f:
        return stored_dtype(json.load(f))


# ---------------------------------------------------------------- writing HF
def save(pretrained: Pretrained, out_dir: str | os.PathLike, *, dtype: str = "float32",
         max_shard_size: int | str = hf_write.DEFAULT_MAX_SHARD_SIZE,
         vocab_path: str | None = None, vocab_setting: str = "--vocab_path") -> list[str]:
    """config.json, generation_config.json and the weights for transformers'
    ``AutoModelForCausalLM.from_pretrained``: ``model.safetensors``, or shards of at most
    ``max_shard_size`` with ``model.safetensors.index.json`` (save_pretrained's layout); with
    ``vocab_path`` (a SentencePiece model) also the tokenizer files. Refuses an existing non-empty
    ``out_dir``; returns the files."""
    import jax

    family = family_of_config(pretrained.config, prefer=pretrained.family)
    if family is not pretrained.family:
        raise UnsupportedCheckpointError(
            f"Pretrained.family={pretrained.family.value!r} but its config fits {family.value!r}")
    return write_hf(pretrained.params, out_dir, config=pretrained.config, family=family,
                    stand_ins=jax.tree.map(stand_in, pretrained.params), dtype=dtype,
                    max_shard_size=max_shard_size, vocab_path=vocab_path,
                    vocab_setting=vocab_setting, bos_token_id=pretrained.bos_token_id,
                    eos_token_id=pretrained.eos_token_id,
                    router_aux_loss_coef=pretrained.router_aux_loss_coef)


def stand_in(array: Any) -> np.ndarray:
    """A zero-stride float32 array of ``array``'s shape: no memory, any view of it is free."""
    shape = np.shape(array)
    return np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape, (0,) * len(shape))


def _hf_tensors(params: Mapping[str, Any], *, config: TransformerConfig, family: Family):
    if family.value in hf_deepseek.MODEL_TYPES:
        return hf_deepseek.iter_deepseek_tensors(params, config=config)
    if family is Family.GPT_OSS:
        return gpt_oss_layout.iter_gpt_oss_tensors(params, config=config)
    if family in LLAMA_LAYOUT_FAMILIES:
        return layouts.iter_llama_tensors(params, config=config,
                                          naming=hf_gemma.tensor_naming(family.value))
    if family is Family.LLAMA4_TEXT:
        return hf_llama4.iter_llama4_tensors(params, config=config)
    return gpt2_layout.iter_gpt2_tensors(params, config=config)


def write_hf(params: Mapping[str, Any], out_dir: str | os.PathLike, *, config: TransformerConfig,
             stand_ins: Mapping[str, Any], dtype: str = "float32",
             max_shard_size: int | str = hf_write.DEFAULT_MAX_SHARD_SIZE,
             vocab_path: str | None = None, vocab_setting: str = "--vocab_path",
             bos_token_id: int | None = None, eos_token_id: int | list[int] | None = None,
             router_aux_loss_coef: float | None = None, family: Family | None = None
             ) -> list[str]:
    """`save` for an unscanned params mapping that may read on access (one top-level subtree per
    ``[]``, e.g. `stream_read.LayerParams`): the tensors' names and shapes are laid out from
    ``stand_ins`` (the same tree as zero-stride arrays), checked against ``config``, then each HF
    tensor is made and written in turn, so no more than a layer is held."""
    max_bytes = hf_write.parse_size(max_shard_size)
    directory = check_output_dir(out_dir, setting="output directory")
    family = family_of_config(config, prefer=family)
    layouts.check_params(dict(stand_ins), config=config)
    if vocab_path is not None:
        hf_write.check_tokenizer(vocab_path, setting=vocab_setting)
        if bos_token_id is None and eos_token_id is None:  # a paxlite source records neither
            bos_token_id, eos_token_id = hf_write.special_token_ids(vocab_path)
    target = _numpy_dtype(dtype)
    plan = [(name, tuple(np.shape(array)))
            for name, array in _hf_tensors(stand_ins, config=config, family=family)]
    hf_config = to_hf_config(config, family=family, dtype=dtype, bos_token_id=bos_token_id,
                             eos_token_id=eos_token_id, router_aux_loss_coef=router_aux_loss_coef)
    generation = {"_from_model_config": True, "bos_token_id": bos_token_id,
                  "eos_token_id": eos_token_id,
                  "transformers_version": hf_config["transformers_version"]}
    # Written into <directory>.partial and renamed at the end: a killed save blocks no rerun.
    with staged_output(directory, setting="output directory") as staging:
        with hf_write.ShardWriter(staging, tensors=plan, dtype=target,
                                  max_bytes=max_bytes) as writer:
            for name, array in _hf_tensors(params, config=config, family=family):
                writer.add(name, array)
            files = writer.close()
        for name, content in (("config.json", hf_config), ("generation_config.json", generation)):
            hf_write.write_json(os.path.join(staging, name), content)
            files.append(name)
        if vocab_path is not None:
            files += hf_write.write_tokenizer(staging, path=vocab_path, family=family.value)
    return sorted(files)


# ---------------------------------------------------------------- Meta
def from_meta(path: str | os.PathLike, *, vocab_size: int | None = None,
              dtype: str = "float32") -> Pretrained:
    """A Meta consolidated checkpoint directory (params.json + consolidated.NN.pth)."""
    from paxlite.interop.meta import load_meta

    config, params = load_meta(path, vocab_size=vocab_size)
    config = _with_dtype(config, _check_dtype(dtype))
    params = cast_params(params, dtype)
    layouts.check_params(params, config=config)
    return Pretrained(config=config, params=params, family=Family.LLAMA)


# ---------------------------------------------------------------- paxlite checkpoints
def _lora_leaves(step_dir: Any) -> list[str]:
    """Paths of saved params whose name mentions LoRA (read from the checkpoint's metadata only)."""
    import jax

    from paxlite.checkpointing.checkpoint_damage import is_damage
    from paxlite.checkpointing.pretrained import item_metadata

    try:
        tree = item_metadata(step_dir / "state")
    except Exception as error:  # only damage is let through, as the restore classifies it
        if not is_damage(error):
            raise
        return []  # a damaged checkpoint: the read that follows names the array it cannot read
    params = tree.get("params", {}) if isinstance(tree, Mapping) else {}
    paths: list[str] = []
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        if "lora" in name.lower():
            paths.append(name)
    return paths


def find_model_config(path: str, *, step_dir: Any) -> TransformerConfig | None:
    from paxlite.checkpointing.pretrained import load_model_config

    for directory in (path, step_dir.parent, step_dir.parent.parent):
        config = load_model_config(directory)
        if config is not None:
            return config
    return None


def _paxlite_config(path: str, *, step_dir: Any, config: TransformerConfig | None
                    ) -> TransformerConfig:
    """``config``, else model_config.json's; refuses a checkpoint holding LoRA adapters."""
    if config is None:
        config = find_model_config(path, step_dir=step_dir)
    if config is None:
        raise ConversionError(
            f"no model config for the checkpoint: expected model_config.json beside {path} "
            "(written by python -m paxlite convert), or pass config=TransformerConfig(...); a "
            "training job's config.json is read by paxlite.cli.convert.read_paxlite and python -m "
            "paxlite convert")
    lora = _lora_leaves(step_dir)
    if lora:
        raise UnsupportedCheckpointError(
            f"{step_dir} holds LoRA parameters ({', '.join(lora[:4])}"
            f"{', ...' if len(lora) > 4 else ''}); fold the adapters into the base weights first: "
            f"python -m paxlite export_merged --input={step_dir} --output=MERGED_DIR, then convert "
            "MERGED_DIR")
    return config


def stream_paxlite_to_hf(path: str | os.PathLike, out_dir: str | os.PathLike, *,
                         config: TransformerConfig | None = None, dtype: str = "float32",
                         **options: Any) -> tuple[TransformerConfig, int]:
    """`save` of the paxlite checkpoint at ``path`` read one layer at a time (`from_paxlite` then
    `save`, without holding the model); ``options`` as `write_hf`'s. Returns (the unscanned config,
    #parameters)."""
    from paxlite.checkpointing.pretrained import find_checkpoint
    from paxlite.checkpointing.stream_read import CheckpointReader, LayerParams

    path = os.path.abspath(os.fspath(path))
    _, step_dir = find_checkpoint(path)
    config = _paxlite_config(path, step_dir=step_dir, config=config)
    config = dataclasses.replace(_with_dtype(config, _check_dtype(dtype)), scan_layers=False,
                                 remat_policy=RematPolicy.NONE)
    directory = check_output_dir(out_dir, setting="output directory")
    # Per-layer copies of leaves chunked across layers (stream_read.py), beside the output.
    scratch = tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}.rechunk-",
                               dir=os.path.dirname(directory))
    try:
        reader = CheckpointReader(step_dir, scratch_dir=scratch)
        stand_ins = LayerParams(reader, stand_ins=True).shapes()
        write_hf(LayerParams(reader), directory, config=config, stand_ins=stand_ins, dtype=dtype,
                 **options)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return config, layouts.count(stand_ins)


class _InOrder(Mapping):
    """A source's subtrees (``(top, subtree)`` in model order, read as the iterator advances) as
    the params mapping `write_hf` walks: each ``[top]`` advances to that subtree and holds only it.
    The HF tensor iterators ask for the subtrees in the order sources make them."""

    def __init__(self, subtrees: Iterator[tuple[str, Any]], tops: list[str]) -> None:
        self._subtrees, self._tops, self._done = subtrees, tops, 0

    def __getitem__(self, top: str) -> Any:
        if top not in self._tops[self._done:]:
            raise KeyError(f"{top} (already passed or not in the model: a converter bug)")
        for name, subtree in self._subtrees:
            self._done += 1
            if name == top:
                return subtree
        raise KeyError(top)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tops)

    def __len__(self) -> int:
        return len(self._tops)

    def finish(self) -> None:
        """Runs the source to its end (its own check that every tensor was used)."""
        collections.deque(self._subtrees, maxlen=0)


def stream_source_to_hf(source: Any, out_dir: str | os.PathLike, *, config: TransformerConfig,
                        dtype: str = "float32", **options: Any) -> int:
    """`save` of a streaming source (`meta.MetaSource`, `stream.HfSource`: ``.subtrees(tensors)``
    and ``.tensors.stand_ins()``) read one layer at a time; ``options`` as `write_hf`'s. Returns
    #parameters."""
    import jax

    config = dataclasses.replace(_with_dtype(config, _check_dtype(dtype)), scan_layers=False,
                                 remat_policy=RematPolicy.NONE)
    stand_ins = {top: jax.tree.map(stand_in, subtree)  # each stand-in layer made and dropped
                 for top, subtree in source.subtrees(source.tensors.stand_ins(), config=config)}
    params = _InOrder(source.subtrees(config=config), list(stand_ins))
    write_hf(params, out_dir, config=config, stand_ins=stand_ins, dtype=dtype, **options)
    params.finish()
    return layouts.count(stand_ins)


def from_paxlite(path: str | os.PathLike, *, config: TransformerConfig | None = None,
                 dtype: str = "float32") -> Pretrained:
    """A paxlite checkpoint (converted model or training job) as a Pretrained.

    The model config is ``config`` if given, else ``model_config.json`` beside the checkpoint (what
    ``convert`` writes). A training job's ``config.json`` names an experiment, which only the
    registry above interop/ can rebuild: `paxlite.cli.convert.read_paxlite` reads those too.
    """
    import jax
    from flax import linen as nn

    from paxlite.checkpointing.pretrained import find_checkpoint, restore_params
    from paxlite.models.transformer import abstract_variables

    path = os.path.abspath(os.fspath(path))
    _, step_dir = find_checkpoint(path)
    config = _paxlite_config(path, step_dir=step_dir, config=config)
    family = family_of_config(config)
    # Read onto one local device: a converter holds the whole model on the host anyway.
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, np.float32, sharding=device),
        nn.meta.unbox(abstract_variables(config)["params"]))
    _, restored = restore_params(step_dir, abstract)
    params = jax.tree.map(np.asarray, restored)
    if config.scan_layers:
        params = layouts.unstack_layers(params, num_layers=config.num_layers,
                                        unit=config.layers_per_scan_unit)
    config = dataclasses.replace(_with_dtype(config, _check_dtype(dtype)), scan_layers=False,
                                 remat_policy=RematPolicy.NONE)
    params = cast_params(params, dtype)
    layouts.check_params(params, config=config)
    return Pretrained(config=config, params=params, family=family)


def to_paxlite(pretrained: Pretrained, out_dir: str | os.PathLike) -> str:
    """Writes a paxlite checkpoint (``out_dir/checkpoints/checkpoint_00000000``) plus
    ``model_config.json``; params are stacked when ``config.scan_layers``. Returns the step dir."""
    from paxlite.checkpointing.pretrained import save_params

    check_output_dir(out_dir, setting="output directory")  # before casting a whole model
    config = pretrained.config
    layouts.check_params(pretrained.params, config=config)
    params = cast_params(pretrained.params, config.param_dtype)
    if config.scan_layers:
        params = layouts.stack_layers(params, num_layers=config.num_layers,
                                      unit=config.layers_per_scan_unit)
    return os.fspath(save_params(out_dir, params, model_config=config))
