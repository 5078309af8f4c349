"""Pax's own checkpoints <-> paxlite (``python -m paxlite convert --from=pax`` / ``--to=pax``).

Reads what Pax wrote (a trained GPT, with or without repeated layers) and what saxml's
``convert_llama_ckpt.py`` wrote (LLaMA, fused ``combined_qkv`` or separate ``query/key/value``), in
Pax's per-array TensorStore layout (pax.md 14), into the parameters of the experiment named by
``--fdl_config``: Pax's files do not say which model they hold, the experiment does. The name table
and the array reader are `paxlite.train.pax_layout`'s, shared with ``CHECKPOINT_RESTORE_PATH``
(which reads these checkpoints directly); this module adds the converter's strictness (a Pax
tensor the model does not use is an error, not a warning) and the writer.

Written back (``--to=pax``): ``<DIR>/checkpoints/checkpoint_00000000/`` with ``state/step`` and one
zarr array per parameter under ``state/mdl_vars.params.<name>`` (the experiment's repeated layers
under ``repeat.sub``), and ``commit_success.txt``: the layout saxml's converter writes, which Pax
restores with ``CHECKPOINT_RESTORE_PATH=<DIR>``. No optimizer state (saxml writes none either).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from paxlite.interop import layouts
from paxlite.interop.errors import ConversionError
from paxlite.interop.hf import Pretrained, cast_params
from paxlite.interop.hf_config import family_of_config
from paxlite.models.transformer import RematPolicy, TransformerConfig
from paxlite.paths import staged_output
from paxlite.train import pax_layout

COMMIT_FILE = "commit_success.txt"
_CHUNK_BYTES = 256 * 2**20  # one zarr chunk at most: big embeddings split along their first axis


def load(path: str | os.PathLike, *, config: TransformerConfig, experiment: str,
         dtype: str = "float32") -> Pretrained:
    """The Pax checkpoint ``path`` designates as ``config``'s parameters (unscanned)."""
    from flax import linen as nn

    from paxlite.models.transformer import abstract_variables
    from paxlite.train.pretrained import find_checkpoint

    _, step_dir = find_checkpoint(path)
    if not pax_layout.is_pax_step(step_dir):
        raise ConversionError(
            f"{step_dir} is not a Pax checkpoint (no {pax_layout.STATE}/"
            f"{pax_layout.PARAMS_PREFIX}* arrays); a paxlite checkpoint converts with --from=paxlite")
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
    flat = {leaf: pax_layout.read_leaf(plan, arrays) for leaf, plan in plans.items()}
    params = cast_params(_unflatten(flat), dtype)
    layouts.check_params(params, config=config)
    return Pretrained(config=config, params=params, family=family_of_config(config))


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in flat.items():
        node = out
        *parents, last = name.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return out


def _write_array(path: str, array: np.ndarray) -> None:
    import tensorstore as ts

    array = np.ascontiguousarray(array)
    chunks = list(array.shape)
    if chunks and array.nbytes > _CHUNK_BYTES:
        row = max(1, array.nbytes // max(1, array.shape[0]))
        chunks[0] = max(1, _CHUNK_BYTES // row)
    dtype = "bfloat16" if array.dtype.name == "bfloat16" else array.dtype.str
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": path},
            "metadata": {"shape": list(array.shape), "chunks": chunks, "dtype": dtype,
                         "compressor": None}}
    store = ts.open(spec, create=True, open=False).result()
    store.write(array).result()


def save(pretrained: Pretrained, out_dir: str | os.PathLike, *, repeated: bool,
         dtype: str = "float32", step: int = 0) -> str:
    """Writes Pax's layout (module docstring); returns the step directory."""
    tensors = pax_layout.to_pax(layouts.flatten(cast_params(pretrained.params, dtype)),
                                repeated=repeated)
    name = f"checkpoint_{step:08d}"
    with staged_output(out_dir, setting="--output") as staging:
        step_dir = os.path.join(staging, "checkpoints", name)
        state = os.path.join(step_dir, pax_layout.STATE)
        os.makedirs(state)
        _write_array(os.path.join(state, "step"), np.asarray(step, np.int32))
        for pax_name, array in tensors.items():
            _write_array(os.path.join(state, pax_layout.PARAMS_PREFIX + pax_name), array)
        with open(os.path.join(step_dir, COMMIT_FILE), "w") as f:
            f.write(f"Checkpoint commit was successful to {os.path.abspath(os.fspath(out_dir))}\n")
    return os.path.join(os.path.abspath(os.fspath(out_dir)), "checkpoints", name)
