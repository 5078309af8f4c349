"""Folding a LoRA model's adapters into its base weights, for export to an ordinary checkpoint.

Apart from `lora.py` because it reads the whole model's config (rank, alpha, scanned stack), while
the adapter arithmetic there is what the layers themselves use and must not depend on the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from paxlite.models.lora import LORA_A, LORA_B, LoraSpec, lora_delta
from paxlite.models.transformer import TransformerConfig

PyTree = Any


def merge_lora(params: PyTree, *, config: TransformerConfig) -> PyTree:
    """Base parameters with every adapter folded in: ``kernel + (alpha / r) * A @ B``.

    `config` is the LoRA model's config (its ``lora_rank``, ``lora_alpha`` and ``scan_layers``
    say how to read the factors). The result has no LoRA leaves and fits
    ``dataclasses.replace(config, lora_rank=None)``, so it can be saved as an ordinary
    checkpoint and converted to Hugging Face. The sum is formed in float32 and cast back to each
    kernel's dtype.
    """
    if config.lora_rank is None:
        raise ValueError("merge_lora needs the LoRA model's config; this one has lora_rank=None")
    scale = LoraSpec(rank=config.lora_rank, alpha=config.lora_alpha).scale
    num_batch_dims = 1 if config.scan_layers else 0

    def merge(node: Any, where: str) -> Any:
        if not isinstance(node, Mapping):
            return node
        if LORA_A in node or LORA_B in node:
            if not {LORA_A, LORA_B, "kernel"} <= set(node):
                raise ValueError(f"{where} has {sorted(node)}: LoRA needs kernel, lora_a, lora_b")
            kernel, lora_a, lora_b = node["kernel"], node[LORA_A], node[LORA_B]
            num_group_dims = lora_a.ndim - 1 + lora_b.ndim - 1 - kernel.ndim - num_batch_dims
            delta = lora_delta(lora_a, lora_b, num_group_dims=num_group_dims,
                               num_batch_dims=num_batch_dims)
            if delta.shape != kernel.shape:
                raise ValueError(
                    f"{where}: A @ B has shape {delta.shape}, the kernel {kernel.shape}"
                )
            merged = (kernel.astype(jnp.float32) + scale * delta).astype(kernel.dtype)
            rest = {k: v for k, v in node.items() if k not in (LORA_A, LORA_B, "kernel")}
            return {"kernel": merged, **rest}
        return {k: merge(v, f"{where}/{k}" if where else k) for k, v in node.items()}

    return merge(dict(params), "")
