"""The non-linearities of the model zoo, named so configs and converters can say which one."""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable

import jax


class Activation(str, enum.Enum):
    """MLP non-linearity; GPT uses the tanh approximation of GELU (Pax ``approximate=True``)."""

    GELU_TANH = "gelu_tanh"
    GELU = "gelu"
    RELU = "relu"
    SILU = "silu"


def activation_fn(activation: Activation) -> Callable[[jax.Array], jax.Array]:
    if activation is Activation.GELU_TANH:
        return functools.partial(jax.nn.gelu, approximate=True)
    if activation is Activation.GELU:
        return functools.partial(jax.nn.gelu, approximate=False)
    if activation is Activation.RELU:
        return jax.nn.relu
    return jax.nn.silu
