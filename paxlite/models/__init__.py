"""Flax Linen model zoo for paxlite; independent of config, data and training code."""

from paxlite.models.attention import Attention, make_attention_mask
from paxlite.models.embedding import Embed
from paxlite.models.linear import Linear
from paxlite.models.mlp import Mlp
from paxlite.models.norms import LayerNorm, RMSNorm
from paxlite.models.transformer import (
    Activation,
    Block,
    NormKind,
    RematPolicy,
    Transformer,
    TransformerConfig,
    abstract_variables,
    logical_param_axes,
    num_params,
)

__all__ = [
    "Activation",
    "Attention",
    "Block",
    "Embed",
    "LayerNorm",
    "Linear",
    "Mlp",
    "NormKind",
    "RMSNorm",
    "RematPolicy",
    "Transformer",
    "TransformerConfig",
    "abstract_variables",
    "logical_param_axes",
    "make_attention_mask",
    "num_params",
]
