"""One abstract trace of each distinct model configuration per test process.

Tracing a model's init abstractly (``transformer.abstract_variables``, under ``jax.eval_shape``) is
most of what the tests of this directory pay for: about a second for a mid-sized model and several
for an unscanned 80-layer one such as LLaMA70B, whose configuration several tests (and several
files, which may share a process) trace. The tests here that only read the traced tree (its shapes,
partition specs or parameter count) take it from this module, which traces each configuration once.

The key is the built ``TransformerConfig`` itself: a frozen dataclass, so equal configurations
(every field equal) hash alike, and a configuration that differs in anything (attention kind, FP8,
MoE, scanning) is traced on its own. The results are still traces of the model, never a closed form,
so a test comparing a closed-form count with the traced one keeps an independent reference.

The returned trees are shared between tests: read them, never change them in place.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax

from paxlite.models.transformer import TransformerConfig, abstract_variables


@functools.cache
def traced_variables(config: TransformerConfig) -> Any:
    """``abstract_variables(config)`` (boxed ShapeDtypeStructs), traced once per configuration."""
    if not isinstance(config, TransformerConfig):  # a Fiddle config would hash by identity
        raise TypeError("traced_variables takes a built TransformerConfig, got "
                        f"{type(config).__name__}")
    return abstract_variables(config)


@functools.cache
def traced_num_params(config: TransformerConfig) -> int:
    """Parameters of the traced model (``transformer.num_params``'s sum, over the shared trace)."""
    params = nn.meta.unbox(traced_variables(config)["params"])
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
