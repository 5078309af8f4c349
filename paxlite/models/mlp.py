"""The position-wise feed-forward block: plain (Pax GPT) or gated (LLaMA's SwiGLU).

Einsum letters: B batch, T length, D model (embed) dims, F hidden (mlp) dims.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.typing import DTypeLike

from paxlite.models.linear import Fp8Config, Linear, projection
from paxlite.models.lora import LoraSpec

MLP_ACTIVATION_AXES: tuple[str, ...] = ("activation_batch", "activation_length", "activation_mlp")


class Mlp(nn.Module):
    """x [B, T, D] -> hidden [B, T, F] -> wo [F, D] -> [B, T, D] in dtype.

    Plain: ``hidden = act(x @ wi)``. Gated (``gated=True``, Pax ``use_gated_activation``):
    ``hidden = act(x @ wi_gate) * (x @ wi)``, which with SiLU is LLaMA's SwiGLU
    (Pax ``ffn_layer1_gate`` / ``ffn_layer1`` / ``ffn_layer2``; HF ``gate_proj`` / ``up_proj`` /
    ``down_proj``). ``activation`` is a plain callable so the module stays independent of the
    config enums; the transformer maps its ``Activation`` enum to a function. ``lora`` puts LoRA
    adapters on all of ``wi``, ``wi_gate`` and ``wo`` (Pax LORA_TARGET_LAYERS "mlp").
    """

    hidden_dims: int
    activation: Callable[[jax.Array], jax.Array]
    gated: bool = False
    use_bias: bool = True
    init_std: float = 0.02
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32
    lora: LoraSpec | None = None
    fp8: Fp8Config | None = None  # every matmul in FP8 (models/linear.py)

    def _linear(self, *, equation: str, shape: tuple[int, int], axes: tuple[str, str],
                bias_axes: tuple[str, ...], name: str) -> Linear:
        return projection(self, equation=equation, shape=shape, axes=axes,
                          bias_axes=bias_axes if self.use_bias else None, name=name,
                          lora=self.lora)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        model_dims = x.shape[-1]
        shape_in = (model_dims, self.hidden_dims)
        hidden = self._linear(equation="BTD,DF->BTF", shape=shape_in, axes=("embed", "mlp"),
                              bias_axes=("mlp",), name="wi")(x)  # [B, T, F]
        if self.gated:
            gate = self._linear(equation="BTD,DF->BTF", shape=shape_in, axes=("embed", "mlp"),
                                bias_axes=("mlp",), name="wi_gate")(x)  # [B, T, F]
            hidden = self.activation(gate) * hidden
        else:
            hidden = self.activation(hidden)
        hidden = nn.with_logical_constraint(hidden, MLP_ACTIVATION_AXES)
        return self._linear(equation="BTF,FD->BTD", shape=(self.hidden_dims, model_dims),
                            axes=("mlp", "embed"), bias_axes=("norm",), name="wo")(hidden)
