"""The one learned matmul of the model zoo, written as an einsum.

Every weight matmul in paxlite (QKV, attention output, MLP) goes through :class:`Linear`, so a
different matmul implementation (FP8, LoRA) has a single place to swap in. The kernel keeps its
natural multi-dimensional shape (e.g. QKV is ``[embed, 3, heads, kv]``) so logical axis names can
shard heads and head dimensions independently.

FP8 (``fp8=Fp8Config()``, Pax ``USE_FP8``) hands the einsum to Flax's ``nn.Fp8Einsum``: inputs and
kernel are quantised to e4m3 and the output gradient to e5m2 with delayed per-tensor scaling. Each
matmul owns a child module ``fp8_einsum`` with its own scales and amax histories in the
``FP8_COLLECTION`` (Flax's ``_overwrite_with_gradient``); the train step overwrites them with
their "gradient" (docs/fp8.md). The bias add and LoRA's low-rank path stay in the compute dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import fp8_ops
from jax.typing import DTypeLike

from paxlite.models.lora import LoraSpec, create_lora_params, lora_output

# The collection of every FP8 scale and amax history (Flax's name, shared with Pax and MaxText).
FP8_COLLECTION: str = fp8_ops.OVERWRITE_WITH_GRADIENT
DEFAULT_AMAX_HISTORY_LENGTH = 1024  # Pax's and Flax's default


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8Config:
    """Native FP8 matmuls with delayed scaling (Flax ``fp8_ops``).

    Attributes:
        amax_history_length: how many past steps' max|x| each scale is computed from (Pax and
            Flax: 1024; AXLearn's Fuji ``-fp8`` configs: 128).
    """

    amax_history_length: int = DEFAULT_AMAX_HISTORY_LENGTH

    def __post_init__(self) -> None:
        problems = fp8_config_problems(amax_history_length=self.amax_history_length)
        if problems:
            raise ValueError("Fp8Config: " + "; ".join(problems))


def fp8_config_problems(*, amax_history_length: object) -> list[str]:
    """What Fp8Config's fields cannot be, one clause each in its field names: the rule a config is
    refused by when it is made, which an experiment reports for its settings before it builds
    one."""
    n = amax_history_length
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return [(f"amax_history_length={n!r} must be a positive number of steps (Pax's default "
                 f"is {DEFAULT_AMAX_HISTORY_LENGTH})")]
    return []


def _fp8_einsum(module: nn.Module) -> nn.Module | None:
    """The matmul's own ``nn.Fp8Einsum`` (its scales and histories under
    ``<module>/fp8_einsum``)."""
    if module.fp8 is None:
        return None
    return nn.Fp8Einsum(amax_history_length=module.fp8.amax_history_length)


def _einsum(module: nn.Module, equation: str, x: jax.Array) -> jax.Array:
    """``einsum(equation, x, kernel)`` in the compute dtype, in FP8 when the module has it."""
    x, kernel = x.astype(module.dtype), module.kernel.astype(module.dtype)
    if module.fp8 is None:
        return jnp.einsum(equation, x, kernel)
    # Fp8Einsum computes in the kernel's dtype (here the compute dtype, as Pax requires).
    return module.fp8_einsum(equation, x, kernel)


def _kernel(module: nn.Module) -> jax.Array:
    """The module's ``kernel``: normal(0, init_std), with its logical axis names."""
    init = nn.initializers.normal(stddev=module.init_std)
    return module.param("kernel", nn.with_logical_partitioning(init, module.kernel_axes),
                        module.kernel_shape, module.param_dtype)


class Linear(nn.Module):
    """``y = einsum(equation, x, kernel) + bias`` with params in param_dtype, math in dtype.

    Attributes:
        equation: einsum with exactly two operands, input first and kernel second, e.g.
            ``'BTD,DKNH->BTKNH'``.
        kernel_shape: shape of ``kernel``; its rank must equal the kernel operand's letters.
        kernel_axes: one logical axis name per kernel dimension.
        bias_axes: logical names of the bias, whose shape is the last ``len(bias_axes)``
            kernel dimensions (the output features); ``None`` means no bias.
        init_std: the kernel is initialised from normal(0, init_std); the bias with zeros.
        lora: None, or low-rank adapters ``lora_a`` / ``lora_b`` beside the kernel
            (models/lora.py): ``y = x @ kernel + scale * (x @ lora_a) @ lora_b``.
    """

    equation: str
    kernel_shape: tuple[int, ...]
    kernel_axes: tuple[str, ...]
    bias_axes: tuple[str, ...] | None = None
    init_std: float = 0.02
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32
    lora: LoraSpec | None = None
    fp8: Fp8Config | None = None

    def setup(self) -> None:
        operands = self.equation.split("->")[0].split(",")
        if len(operands) != 2 or len(operands[1]) != len(self.kernel_shape):
            raise ValueError(
                f"Linear equation {self.equation!r} must have two operands, the second with "
                f"{len(self.kernel_shape)} letters to match kernel_shape {self.kernel_shape}"
            )
        if len(self.kernel_axes) != len(self.kernel_shape):
            raise ValueError(
                f"kernel_axes {self.kernel_axes} must name each of the "
                f"{len(self.kernel_shape)} dimensions of kernel_shape {self.kernel_shape}"
            )
        self.kernel = _kernel(self)
        self.fp8_einsum = _fp8_einsum(self)
        if self.bias_axes is not None:
            bias_shape = self.kernel_shape[len(self.kernel_shape) - len(self.bias_axes):]
            self.bias = self.param(
                "bias",
                nn.with_logical_partitioning(nn.initializers.zeros, self.bias_axes),
                bias_shape,
                self.param_dtype,
            )
        if self.lora is not None:
            self.lora_a, self.lora_b = create_lora_params(
                self, equation=self.equation, kernel_shape=self.kernel_shape,
                kernel_axes=self.kernel_axes, spec=self.lora, init_std=self.init_std,
                param_dtype=self.param_dtype,
            )

    def __call__(self, x: jax.Array) -> jax.Array:
        y = _einsum(self, self.equation, x)
        if self.lora is not None:
            y = y + lora_output(x, self.lora_a, self.lora_b, equation=self.equation,
                                spec=self.lora, dtype=self.dtype)
        if self.bias_axes is not None:
            y = y + self.bias.astype(self.dtype)
        return y


class ExpertLinear(nn.Module):
    """The expert twin of :class:`Linear`: one kernel ``[E, in, out]`` holding every expert's
    matrix.

    Expert matmuls go through here (and :func:`grouped_matmul`) for the reason Linear exists: one
    place to swap the matmul (FP8 gives each expert matmul its own scaling state here). Two ways
    to apply it: ``einsum`` for GShard's dispatched tensors (``'EGCD,EDF->EGCF'``), and
    ``kernel_value`` + :func:`grouped_matmul` for dropless routing, whose grouped matmul runs inside
    ``shard_map`` on the local experts' slice of the kernel.

    Attributes:
        kernel_shape: ``(experts, in, out)``.
        kernel_axes: one logical axis name per kernel dimension, the first naming the experts.
        fp8: None, or an Fp8Config: ``einsum`` runs in FP8 with this matmul's own scaling state
            (one state per ExpertLinear, never shared between wi, wi_gate and wo). The grouped
            matmul of dropless routing has no FP8 form, so ``kernel_value`` refuses it.
        bias_axes: None, or the logical names of a ``bias`` [E, out] per expert (gpt-oss), zeros
            at init; dropless routing adds it (``bias_value``), ``einsum`` refuses it.
    """

    kernel_shape: tuple[int, int, int]
    kernel_axes: tuple[str, str, str]
    init_std: float = 0.02
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32
    fp8: Fp8Config | None = None
    bias_axes: tuple[str, str] | None = None

    def setup(self) -> None:
        if len(self.kernel_shape) != 3 or len(self.kernel_axes) != 3:
            raise ValueError(
                f"ExpertLinear kernel_shape {self.kernel_shape} and kernel_axes {self.kernel_axes} "
                "must both have three entries (experts, in, out)"
            )
        self.kernel = _kernel(self)
        self.fp8_einsum = _fp8_einsum(self)
        if self.bias_axes is not None:
            shape = (self.kernel_shape[0], self.kernel_shape[2])
            self.bias = self.param("bias", nn.with_logical_partitioning(
                nn.initializers.zeros, self.bias_axes), shape, self.param_dtype)

    def einsum(self, equation: str, x: jax.Array) -> jax.Array:
        """``einsum(equation, x, kernel)`` in dtype (FP8 with ``fp8``); the kernel is the second
        operand."""
        if self.bias_axes is not None:
            raise ValueError("expert biases are added by dropless routing only (bias_value)")
        return _einsum(self, equation, x)

    def bias_value(self) -> jax.Array | None:
        """The [E, out] bias in the compute dtype; None without one."""
        return None if self.bias_axes is None else self.bias.astype(self.dtype)

    def kernel_value(self) -> jax.Array:
        """The kernel in the compute dtype, to hand to :func:`grouped_matmul`."""
        if self.fp8 is not None:
            # Flax has no FP8 grouped (ragged) matmul: never fall back to BF16 silently.
            raise ValueError(
                "FP8 (USE_FP8) does not cover the dropless grouped matmul (jax.lax.ragged_dot "
                "has no FP8 form in Flax); use MOE_ROUTING='gshard_top2' with FP8, or "
                "USE_FP8=false")
        return self.kernel.astype(self.dtype)


def ragged_dot(x: jax.Array, kernel: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The ``RAGGED_DOT`` grouped-matmul kernel: ``jax.lax.ragged_dot``, x [M, K] -> [M, N].

    JAX documents only the rows inside the groups; what it leaves in rows past
    ``sum(group_sizes)`` is unspecified (zeros from the CPU lowering, whatever the GPU kernel
    wrote there), which is why :func:`grouped_matmul` masks them.
    """
    return jax.lax.ragged_dot(
        x.astype(kernel.dtype), kernel, group_sizes.astype(jnp.int32),
        preferred_element_type=kernel.dtype,
    )


# A grouped-matmul kernel: (x [M, K], kernel [G, K, N], group_sizes [G]) -> [M, N], rows in groups
# computed, rows past sum(group_sizes) unspecified (any value, NaN included).
GroupedMatmulKernel = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def grouped_matmul(x: jax.Array, kernel: jax.Array, group_sizes: jax.Array, *,
                   kernel_fn: GroupedMatmulKernel = ragged_dot) -> jax.Array:
    """Rows sorted by expert times their expert's matrix: x [M, K], kernel [G, K, N] -> [M, N].

    Rows ``[sum(group_sizes[:g]), sum(group_sizes[:g+1]))`` use ``kernel[g]``. Rows past
    ``sum(group_sizes)`` (in the dropless exchange: rows routed to another shard's experts) are
    zeros, and no gradient flows through them, whatever ``kernel_fn`` leaves there: its output is
    masked to zero there (forward), and so is its input, whose gradient the mask's select then
    drops (backward: a kernel's dgrad may leave anything in those rows too). Neither JAX nor a GPU
    kernel promises zeros there, so nothing downstream may rely on them.
    """
    valid = (jnp.arange(x.shape[0]) < jnp.sum(group_sizes))[:, None]  # [M, 1]
    x = jnp.where(valid, x, jnp.zeros((), x.dtype))
    y = kernel_fn(x, kernel, group_sizes)  # [M, N]
    return jnp.where(valid, y, jnp.zeros((), y.dtype))


def projection(layer: nn.Module, *, equation: str, shape: tuple[int, ...],
               axes: tuple[str, ...], bias_axes: tuple[str, ...] | None, name: str,
               lora: LoraSpec | None) -> Linear:
    """A `Linear` of `layer` (an attention or MLP block), which gives it its initialisation,
    precision and FP8 settings (`init_std`, `dtype`, `param_dtype`, `fp8`) as its own."""
    return Linear(equation=equation, kernel_shape=shape, kernel_axes=axes, bias_axes=bias_axes,
                  lora=lora, name=name, init_std=layer.init_std, dtype=layer.dtype,
                  param_dtype=layer.param_dtype, fp8=layer.fp8)
