"""How the train state's leaves are cut into chunks on disk (Orbax SaveArgs), apart from the
checkpointer so that every writer of paxlite checkpoints (checkpoint.py, pretrained.py) cuts them
alike."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

PyTree = Any


def layer_chunked_save_args(state: PyTree) -> PyTree:
    """Orbax SaveArgs that store every leaf of a scanned layer stack (a ``layers`` subtree: params
    and the optimizer moments that mirror them) one layer per chunk.

    Orbax otherwise makes each device shard one chunk, which spans every layer of the stack, so a
    reader that wants one layer (``convert --from=paxlite``, ``export_merged``: stream_read.py)
    must decode the whole leaf for it. Per-layer chunks change nothing for a restore.
    """

    def args(path: tuple, leaf: Any) -> ocp.SaveArgs:
        stacked = any(getattr(k, "key", getattr(k, "name", None)) == "layers" for k in path)
        return ocp.SaveArgs(shard_axes=(0,) if stacked and np.ndim(leaf) >= 1 else ())

    return jax.tree_util.tree_map_with_path(args, state)
