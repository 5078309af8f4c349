"""The position-wise feed-forward block: wi -> activation -> wo (Pax GPT, ungated)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.typing import DTypeLike

from paxlite.models.linear import Linear

MLP_ACTIVATION_AXES: tuple[str, ...] = ("activation_batch", "activation_length", "activation_mlp")


class Mlp(nn.Module):
    """x [B, T, D] -> wi [D, F] -> activation -> wo [F, D] -> [B, T, D] in dtype.

    ``activation`` is a plain callable so the module stays independent of the config enums;
    the transformer maps its ``Activation`` enum to a function.
    """

    hidden_dims: int
    activation: Callable[[jax.Array], jax.Array]
    use_bias: bool = True
    init_std: float = 0.02
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        model_dims = x.shape[-1]
        hidden = Linear(
            equation="BTD,DF->BTF",
            kernel_shape=(model_dims, self.hidden_dims),
            kernel_axes=("embed", "mlp"),
            bias_axes=("mlp",) if self.use_bias else None,
            init_std=self.init_std,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="wi",
        )(x)  # [B, T, F]
        hidden = self.activation(hidden)
        hidden = nn.with_logical_constraint(hidden, MLP_ACTIVATION_AXES)
        return Linear(
            equation="BTF,FD->BTD",
            kernel_shape=(self.hidden_dims, model_dims),
            kernel_axes=("mlp", "embed"),
            bias_axes=("norm",) if self.use_bias else None,
            init_std=self.init_std,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="wo",
        )(hidden)
